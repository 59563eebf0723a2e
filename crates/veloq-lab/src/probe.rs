//! Where attention goes while a needle is read back. A prompt and its correct answer are
//! teacher-forced through exact (f16) caches, recording every layer's queries and keys; each
//! head's softmax at the answer's positions is then recomputed with keys that went through a
//! calibration's codec, everything else unchanged (positions the cache keeps exact — the sink and
//! the recent window, and sliding-window layers — stay exact). So the attention mass a head puts
//! on the needle, and the score error there and elsewhere, compare per (layer, head) between exact
//! and coded keys: the measurement behind the needle harness's misses.

use std::ops::Range;

use veloq::artifact::Calibration;

use veloq_candle::collect::{record, Queries};
use veloq_candle::config::WindowConfig;
use veloq_candle::error::{Error, Result};
use veloq_candle::model::Model;

use crate::simulate::round_trip;

/// One (layer, query head), averaged over the answer's queries.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadMass {
    /// Layer.
    pub layer: usize,
    /// Query head.
    pub head: usize,
    /// Attention mass on the needle's positions with exact keys.
    pub exact: f32,
    /// The same with each calibration's coded keys.
    pub coded: Vec<f32>,
    /// RMS error of the scaled score q·k on the needle's positions, per calibration.
    pub err_needle: Vec<f32>,
    /// RMS error of the scaled score on every other coded position, per calibration.
    pub err_rest: Vec<f32>,
}

/// What a method's keys become before attention scores them: a layer's `[tokens, kv heads,
/// head_dim]` keys in, their reconstruction out.
pub trait KeyCoder {
    /// Layer `layer`'s keys through the method.
    fn reconstruct(&self, layer: usize, keys: &[f32]) -> Result<Vec<f32>>;
}

impl KeyCoder for Calibration {
    fn reconstruct(&self, layer: usize, keys: &[f32]) -> Result<Vec<f32>> {
        round_trip(&self.layers[layer].keys, keys)
    }
}

/// Probes every (layer, head) for the sequence `ids` (prompt then answer; the answer starts at
/// `answer_from`), the needle at `needle`. One entry per head, layer-major. The sequence goes
/// through the model in one forward pass (its attention memory grows with the square of its
/// length): meant for prompts of a few thousand tokens.
pub fn needle_attention(
    model: &Model,
    ids: &[u32],
    needle: Range<usize>,
    answer_from: usize,
    coders: &[&dyn KeyCoder],
    window: &WindowConfig,
) -> Result<Vec<HeadMass>> {
    if answer_from == 0 || answer_from >= ids.len() || needle.end > answer_from || needle.is_empty() {
        return Err(Error::Config(format!(
            "probe: needle {needle:?} and answer from {answer_from} do not fit {} tokens",
            ids.len()
        )));
    }
    let acts = record(model, ids, ids.len(), Queries::All, &mut |_| {})?;
    let (nh, nkv, d) = (model.info.n_heads, model.info.identity.n_kv_heads, model.info.identity.head_dim);
    let group = nh / nkv;
    let t = ids.len();
    let mut out = Vec::with_capacity(acts.layers.len() * nh);
    for (l, a) in acts.layers.iter().enumerate() {
        let sliding = model.layer_window(l);
        // Exact keys, then each method's reconstructed keys (exact again for sliding layers).
        let mut keys: Vec<Vec<f32>> = vec![a.keys.clone()];
        for c in coders {
            keys.push(if sliding.is_some() { a.keys.clone() } else { c.reconstruct(l, &a.keys)? });
        }
        for h in 0..nh {
            let kv = h / group;
            let mut mass = vec![0.0f32; keys.len()];
            let (mut en, mut er) = (vec![0.0f64; keys.len()], vec![0.0f64; keys.len()]);
            let (mut nn, mut nr) = (0usize, 0usize);
            for r in answer_from - 1..t - 1 {
                let q = &a.queries[(r * nh + h) * d..(r * nh + h + 1) * d];
                let lo = sliding.map_or(0, |w| (r + 1).saturating_sub(w));
                let score = |k: &[f32], j: usize| -> f32 {
                    a.scale
                        * q.iter().zip(&k[(j * nkv + kv) * d..(j * nkv + kv + 1) * d]).map(|(x, y)| x * y).sum::<f32>()
                };
                let exact: Vec<f32> = (lo..=r).map(|j| score(&keys[0], j)).collect();
                for (ci, k) in keys.iter().enumerate() {
                    let s: Vec<f32> = (lo..=r)
                        .zip(&exact)
                        .map(|(j, &e)| {
                            let kept = j < window.sink || j + window.window > r;
                            if ci == 0 || kept {
                                return e;
                            }
                            let c = score(k, j);
                            let sq = ((c - e) as f64).powi(2);
                            if needle.contains(&j) {
                                en[ci] += sq;
                            } else {
                                er[ci] += sq;
                            }
                            c
                        })
                        .collect();
                    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                    let on: f32 =
                        (lo..=r).zip(&s).filter(|(j, _)| needle.contains(j)).map(|(_, x)| (x - m).exp()).sum();
                    mass[ci] += on / z;
                }
                let visible = lo..r + 1;
                let coded = |j: &usize| !(*j < window.sink || j + window.window > r);
                nn += needle.clone().filter(|j| visible.contains(j) && coded(j)).count();
                nr += visible.clone().filter(|j| !needle.contains(j) && coded(j)).count();
            }
            let rows = (t - answer_from) as f32;
            let rms = |sum: f64, n: usize| if n == 0 { 0.0 } else { (sum / n as f64).sqrt() as f32 };
            out.push(HeadMass {
                layer: l,
                head: h,
                exact: mass[0] / rows,
                coded: mass[1..].iter().map(|m| m / rows).collect(),
                err_needle: en[1..].iter().map(|&s| rms(s, nn)).collect(),
                err_rest: er[1..].iter().map(|&s| rms(s, nr)).collect(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With exact keys the mass is a probability, and a calibration whose codes are the keys
    /// themselves is not needed to check it: the exact mass equals a softmax computed by hand from
    /// the recorded activations for one head and one query.
    #[test]
    fn exact_mass_is_the_softmax_share_of_the_needle() {
        let model = crate::testing::tiny_model(97, 64);
        let ids: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 97).collect();
        let probe = needle_attention(&model, &ids, 10..14, 39, &[], &WindowConfig::default()).unwrap();
        assert_eq!(probe.len(), 2 * 4);
        let acts = record(&model, &ids, ids.len(), Queries::All, &mut |_| {}).unwrap();
        let (l, h, r) = (1, 3, 38);
        let a = &acts.layers[l];
        let q = &a.queries[(r * 4 + h) * 16..(r * 4 + h + 1) * 16];
        let s: Vec<f64> = (0..=r)
            .map(|j| {
                (a.scale * q.iter().zip(&a.keys[(j * 2 + h / 2) * 16..][..16]).map(|(x, y)| x * y).sum::<f32>()) as f64
            })
            .collect();
        let z: f64 = s.iter().map(|x| x.exp()).sum();
        let want = s[10..14].iter().map(|x| x.exp()).sum::<f64>() / z;
        let got = probe.iter().find(|p| p.layer == l && p.head == h).unwrap();
        assert!((got.exact as f64 - want).abs() < 1e-5, "{} vs {want}", got.exact);
        assert!(probe.iter().all(|p| (0.0..=1.0 + 1e-6).contains(&p.exact) && p.coded.is_empty()));
    }
}
