//! Issue 34's "extra bits where they matter", by kv head: which (layer, kv head)'s keys move the
//! attention most when coded at a low precision rather than a high one, measured on the
//! calibration text's own queries, so that a budget of upgraded heads goes where it buys most
//! (the heads that retrieve rather than those that park on the sink).

use rayon::prelude::*;

use veloq_candle::cache::Heads;
use veloq_candle::collect::LayerActivations;

/// What the ranking reads of a layer: its recorded keys and queries and the keys reconstructed
/// at each precision (`[tokens, kv heads, head_dim]`).
pub struct LayerKeys<'a> {
    /// Exact keys, queries and the layer's attention scale.
    pub acts: &'a LayerActivations,
    /// The keys at the low precision.
    pub low: &'a [f32],
    /// The keys at the high precision.
    pub high: &'a [f32],
}

/// Where the ranking samples queries and which positions they see coded (the cache's residency).
pub use veloq::calibrate::value_weights::QuerySampling as Sampling;

/// The attention's total variation against exact keys, averaged over the sampled queries of each
/// kv head's group: `(low, high)` per kv head. Positions in the sink and in the recent window stay
/// exact as in the cache.
pub fn head_distortion(layer: &LayerKeys, heads: Heads, at: Sampling) -> Vec<(f64, f64)> {
    let Heads { q: nh, kv: nkv, dim: d } = heads;
    let a = layer.acts;
    let group = nh / nkv;
    let tokens = a.keys.len() / (nkv * d);
    let sampled = at.queries(tokens);
    let per_query: Vec<Vec<(f64, f64)>> = sampled
        .par_iter()
        .map(|&(w0, r)| {
            let mut tv = vec![(0.0, 0.0); nkv];
            let n = r - w0 + 1;
            let (mut ex, mut lo, mut hi) = (vec![0.0f64; n], vec![0.0f64; n], vec![0.0f64; n]);
            for h in 0..nh {
                let kv = h / group;
                let q = &a.queries[(r * nh + h) * d..(r * nh + h + 1) * d];
                let dot = |k: &[f32], j: usize| -> f64 {
                    let row = &k[(j * nkv + kv) * d..(j * nkv + kv + 1) * d];
                    (a.scale * q.iter().zip(row).map(|(x, y)| x * y).sum::<f32>()) as f64
                };
                for (i, j) in (w0..=r).enumerate() {
                    ex[i] = dot(&a.keys, j);
                    let coded = at.coded(i, n);
                    (lo[i], hi[i]) = if coded { (dot(layer.low, j), dot(layer.high, j)) } else { (ex[i], ex[i]) };
                }
                let (pe, pl, ph) = (softmax(&ex), softmax(&lo), softmax(&hi));
                let dist = |p: &[f64]| 0.5 * pe.iter().zip(p).map(|(x, y)| (x - y).abs()).sum::<f64>();
                tv[kv].0 += dist(&pl);
                tv[kv].1 += dist(&ph);
            }
            tv
        })
        .collect();
    let count = (sampled.len() * group).max(1) as f64;
    (0..nkv)
        .map(|kv| {
            let (l, h) = per_query.iter().fold((0.0, 0.0), |(l, h), t| (l + t[kv].0, h + t[kv].1));
            (l / count, h / count)
        })
        .collect()
}

fn softmax(s: &[f64]) -> Vec<f64> {
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
    s.iter().map(|x| (x - m).exp() / z).collect()
}

/// Which kv heads take the high precision: the `count` with the largest `gain` over all layers
/// (`gain[layer][head]`), as a mask per layer. Ties go to the earlier head.
pub fn upgrade_mask(gain: &[Vec<f64>], count: usize) -> Vec<Vec<bool>> {
    let mut order: Vec<(usize, usize)> =
        gain.iter().enumerate().flat_map(|(l, g)| (0..g.len()).map(move |h| (l, h))).collect();
    order.sort_by(|&(la, ha), &(lb, hb)| gain[lb][hb].total_cmp(&gain[la][ha]).then((la, ha).cmp(&(lb, hb))));
    let mut mask: Vec<Vec<bool>> = gain.iter().map(|g| vec![false; g.len()]).collect();
    for &(l, h) in order.iter().take(count) {
        mask[l][h] = true;
    }
    mask
}

/// `count` kv heads drawn uniformly at random (a control for [`upgrade_mask`]'s ranking).
pub fn random_mask(shape: &[usize], count: usize, seed: u64) -> Vec<Vec<bool>> {
    let mut all: Vec<(usize, usize)> =
        shape.iter().enumerate().flat_map(|(l, &n)| (0..n).map(move |h| (l, h))).collect();
    let mut rng = crate::synthetic::Rng(seed | 1);
    for i in (1..all.len()).rev() {
        let j = ((rng.uniform() * (i + 1) as f64) as usize).min(i);
        all.swap(i, j);
    }
    let mut mask: Vec<Vec<bool>> = shape.iter().map(|&n| vec![false; n]).collect();
    for &(l, h) in all.iter().take(count) {
        mask[l][h] = true;
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;
    use veloq_candle::config::WindowConfig;

    #[test]
    fn the_mask_takes_the_largest_gains_across_layers() {
        let gain = vec![vec![0.1, 0.5, 0.2], vec![0.4, 0.0, 0.3]];
        let m = upgrade_mask(&gain, 3);
        assert_eq!(m, vec![vec![false, true, false], vec![true, false, true]]);
        assert_eq!(upgrade_mask(&gain, 0).iter().flatten().filter(|&&b| b).count(), 0);
        assert_eq!(upgrade_mask(&gain, 9).iter().flatten().filter(|&&b| b).count(), 6);
        let r = random_mask(&[3, 3], 4, 7);
        assert_eq!(r.iter().flatten().filter(|&&b| b).count(), 4);
    }

    /// Exact keys at one precision give no distortion; keys perturbed only on one kv head distort
    /// only that head, and more the more they are perturbed.
    #[test]
    fn distortion_is_zero_for_exact_keys_and_follows_the_perturbed_head() {
        let heads = Heads { q: 4, kv: 2, dim: 8 };
        let tokens = 96;
        let mut rng = crate::synthetic::Rng(crate::testing::fresh_seed() | 1);
        let mut gauss = |n: usize| (0..n).map(|_| rng.normal()).collect::<Vec<f32>>();
        let acts = LayerActivations {
            keys: gauss(tokens * 2 * 8),
            values: gauss(tokens * 2 * 8),
            queries: gauss(tokens * 4 * 8).iter().map(|x| x * 4.0).collect(),
            scale: 1.0 / 8f32.sqrt(),
            ..Default::default()
        };
        let noise = gauss(tokens * 2 * 8);
        let perturb = |amount: f32| -> Vec<f32> {
            acts.keys
                .iter()
                .zip(&noise)
                .enumerate()
                .map(|(i, (k, e))| if (i / 8) % 2 == 1 { k + amount * e } else { *k })
                .collect()
        };
        let (small, large) = (perturb(0.1), perturb(0.5));
        let layer = LayerKeys { acts: &acts, low: &large, high: &small };
        let rows = WindowConfig::default();
        let at = Sampling { window: 48, stride: 5, skip: 24, sink: rows.sink, recent: rows.window };
        // Head 0's scores are computed from the same exact keys at every precision, so its
        // softmaxes are bitwise equal; head 1's noise is the same direction five times larger,
        // which moves the attention more on average over the sampled queries.
        let d = head_distortion(&layer, heads, at);
        assert_eq!(d[0], (0.0, 0.0), "head 0's keys are exact at both precisions");
        assert!(d[1].0 > d[1].1 && d[1].1 > 0.0, "{d:?}");
        let same = LayerKeys { acts: &acts, low: &acts.keys, high: &acts.keys };
        assert!(head_distortion(&same, heads, at).iter().all(|&(l, h)| l == 0.0 && h == 0.0));
    }
}
