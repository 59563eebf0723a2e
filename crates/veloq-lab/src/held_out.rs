//! The setup the codec experiments (`examples/`) share: SmolLM2 from the data cache, activations
//! with queries on 4,096 calibration tokens of *Persuasion* (2,048-position passes) and on 2,048
//! held-out tokens of *Emma*, so a codec trained on one is scored on the other.

use std::path::PathBuf;

use anyhow::Result;

use veloq_candle::collect::{record, Activations, LayerActivations, Queries};
use veloq_candle::model::{encode, Model};

/// The model, then calibration and held-out activations. `cache`: the data cache of
/// `scripts/fetch-data` (default `~/.cache/veloq`).
pub fn smollm2_activations(cache: Option<PathBuf>) -> Result<(Model, Activations, Activations)> {
    let cache = match cache {
        Some(c) => c,
        None => PathBuf::from(std::env::var("HOME")?).join(".cache/veloq"),
    };
    let (model, tok) = Model::open(&cache.join("smollm2-135m-instruct.q4_1.gguf"), 8192)?;
    let calib = encode(&tok, &std::fs::read_to_string(cache.join("austen/persuasion.txt"))?)?;
    let held = encode(&tok, &std::fs::read_to_string(cache.join("austen/emma.txt"))?)?;
    let a = record(&model, &calib[..4096], 2048, Queries::All, &mut |_| {})?;
    let b = record(&model, &held[4000..4000 + 2048], 2048, Queries::All, &mut |_| {})?;
    Ok((model, a, b))
}

/// How close attention over one set of reconstructed keys comes to attention over the exact ones.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KeyScore {
    /// RMS error of the scaled score q·k over the coded positions.
    pub sigma: f64,
    /// RMS over queries of the score error's spread around its mean under the exact attention
    /// (what softmax sees: an error common to every position changes nothing).
    pub spread: f64,
    /// Mean total variation between the exact attention and this one.
    pub tv: f64,
}

/// Scores each of `variants` (reconstructions of `layer`'s keys, `[tokens, kv_heads, d]`) with
/// `layer`'s own queries (`[tokens, heads, d]`): every 32nd query from position 256 on, every
/// head, the first 4 and the last 16 positions exact as in the cache. The examples' shared yardstick.
pub fn score_keys(
    layer: &LayerActivations,
    heads: usize,
    kv_heads: usize,
    d: usize,
    variants: &[&[f32]],
) -> Vec<KeyScore> {
    let (group, tokens) = (heads / kv_heads.max(1), layer.keys.len() / (kv_heads * d).max(1));
    let mut acc = vec![[0.0f64; 3]; variants.len()];
    let (mut n, mut nq) = (0usize, 0usize);
    let soft = |s: &[f64]| -> Vec<f64> {
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        s.iter().map(|x| (x - m).exp() / z).collect()
    };
    for r in (256..tokens).step_by(32) {
        for h in 0..heads {
            let kv = h / group;
            let q = &layer.queries[(r * heads + h) * d..(r * heads + h + 1) * d];
            let dot = |k: &[f32], j: usize| -> f64 {
                let k = &k[(j * kv_heads + kv) * d..(j * kv_heads + kv + 1) * d];
                (layer.scale * q.iter().zip(k).map(|(x, y)| x * y).sum::<f32>()) as f64
            };
            let coded = |j: usize| j >= 4 && j + 16 <= r;
            let ex: Vec<f64> = (0..=r).map(|j| dot(&layer.keys, j)).collect();
            let pe = soft(&ex);
            for (v, a) in variants.iter().zip(acc.iter_mut()) {
                let s: Vec<f64> = (0..=r).map(|j| if coded(j) { dot(v, j) } else { ex[j] }).collect();
                a[0] += (0..=r).filter(|&j| coded(j)).map(|j| (s[j] - ex[j]).powi(2)).sum::<f64>();
                let e: Vec<f64> = s.iter().zip(&ex).map(|(a, b)| a - b).collect();
                let m: f64 = e.iter().zip(&pe).map(|(e, p)| e * p).sum();
                a[1] += e.iter().zip(&pe).map(|(e, p)| p * (e - m).powi(2)).sum::<f64>();
                a[2] += 0.5 * pe.iter().zip(&soft(&s)).map(|(a, b)| (a - b).abs()).sum::<f64>();
            }
            n += (0..=r).filter(|&j| coded(j)).count();
            nq += 1;
        }
    }
    let (n, nq) = (n.max(1) as f64, nq.max(1) as f64);
    acc.iter().map(|a| KeyScore { sigma: (a[0] / n).sqrt(), spread: (a[1] / nq).sqrt(), tv: a[2] / nq }).collect()
}
