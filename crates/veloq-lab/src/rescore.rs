//! Issue 34's "second precision read only at the top-scoring positions": attention that scores
//! every coded position through its reconstruction, then reads the exact key and value of the
//! `top` coded positions that scored highest for this query head and scores those again. What a
//! cache holding codes plus a second copy it rarely reads (host memory, or a residual stage)
//! would compute; the simulation runs it in place of the fp16 cache's attention.

use rayon::prelude::*;

use veloq::kernels::cpu::attention::{axpy, dot};
use veloq_candle::cache::Heads;

/// One sequence's positions as the rescoring attention reads them, rows `[position, kv heads,
/// head_dim]`: positions `sink..coded` are coded (`coarse_*` holds their reconstructions, from
/// `sink` on), every other position is exact; `exact_*` holds every position exactly.
pub struct SeqRows<'a> {
    /// Every position's exact keys.
    pub exact_k: &'a [f32],
    /// Every position's exact values.
    pub exact_v: &'a [f32],
    /// Reconstructed keys of positions `sink..coded`.
    pub coarse_k: &'a [f32],
    /// Reconstructed values of positions `sink..coded`.
    pub coarse_v: &'a [f32],
    /// The first coded position (the sink's end).
    pub sink: usize,
    /// The end of the coded span.
    pub coded: usize,
}

impl SeqRows<'_> {
    /// Kv head `g`'s key and value of position `p` (`d` wide, `row` per position): the
    /// reconstructions where `p` is coded, unless `exact`.
    fn at(&self, p: usize, g: usize, d: usize, row: usize, exact: bool) -> (&[f32], &[f32]) {
        let (k, v, i) = match !exact && p >= self.sink && p < self.coded {
            true => (self.coarse_k, self.coarse_v, (p - self.sink) * row + g * d),
            false => (self.exact_k, self.exact_v, p * row + g * d),
        };
        (&k[i..i + d], &v[i..i + d])
    }
}

/// Causal attention of `q` (`[n, q heads, head_dim]`, query `t` at position `start + t`) over
/// `rows`: softmax of `scale · q·k` with coded positions scored through their reconstructions
/// except the `top` best of them per (query, head), which are scored and weighted with their
/// exact keys and values. Returns `[n, q heads, head_dim]`.
pub fn attend(q: &[f32], start: usize, rows: &SeqRows, heads: Heads, scale: f32, top: usize) -> Vec<f32> {
    let Heads { q: hq, kv, dim: d } = heads;
    let group = hq / kv;
    let row = kv * d;
    let mut out = vec![0.0f32; q.len()];
    out.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / hq, i % hq);
        let g = h / group;
        let qv = &q[i * d..(i + 1) * d];
        let seen = start + t + 1;
        let at = |p: usize, exact: bool| rows.at(p, g, d, row, exact);
        let mut scores: Vec<f32> = (0..seen).map(|p| scale * dot(qv, at(p, false).0)).collect();
        // The coded positions to read again: the `top` best by their coarse scores.
        let mut coded: Vec<usize> = (rows.sink..rows.coded.min(seen)).collect();
        if top < coded.len() {
            coded.select_nth_unstable_by(top, |&a, &b| scores[b].total_cmp(&scores[a]));
            coded.truncate(top);
        }
        let mut exact = vec![false; seen];
        for &p in &coded {
            exact[p] = true;
            scores[p] = scale * dot(qv, at(p, true).0);
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (p, s) in scores.iter().enumerate() {
            let w = (s - m).exp();
            sum += w;
            axpy(w, at(p, exact[p]).1, o);
        }
        o.iter_mut().for_each(|x| *x /= sum);
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::Rng;

    /// Plain causal softmax attention over explicit rows (`[positions, kv heads, head_dim]`).
    fn reference(q: &[f32], start: usize, k: &[f32], v: &[f32], heads: Heads, scale: f32) -> Vec<f32> {
        let Heads { q: hq, kv, dim: d } = heads;
        let mut out = vec![0.0f64; q.len()];
        for (i, o) in out.chunks_mut(d).enumerate() {
            let (t, h) = (i / hq, i % hq);
            let g = h / (hq / kv);
            let s: Vec<f64> = (0..start + t + 1)
                .map(|p| (0..d).map(|e| (q[i * d + e] * k[(p * kv + g) * d + e]) as f64).sum::<f64>() * scale as f64)
                .collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for (p, w) in w.iter().enumerate() {
                (0..d).for_each(|e| o[e] += w / z * v[(p * kv + g) * d + e] as f64);
            }
        }
        out.into_iter().map(|x| x as f32).collect()
    }

    /// No rescored position reads the reconstructions everywhere they exist; rescoring every
    /// coded position reads everything exactly; one rescored position per query equals plain
    /// attention over the rows with that query's best coarse position made exact.
    #[test]
    fn rescoring_reads_exact_rows_at_the_top_coarse_positions_only() {
        let mut rng = Rng(crate::testing::fresh_seed() | 1);
        let heads = Heads { q: 4, kv: 2, dim: 8 };
        let (len, sink, coded, start, n) = (40usize, 3usize, 30usize, 36usize, 4usize);
        let row = heads.kv * heads.dim;
        let exact_k: Vec<f32> = (0..len * row).map(|_| rng.uniform() as f32 * 2.0 - 1.0).collect();
        let exact_v: Vec<f32> = (0..len * row).map(|_| rng.uniform() as f32 * 2.0 - 1.0).collect();
        let noisy =
            |x: &[f32], rng: &mut Rng| -> Vec<f32> { x.iter().map(|a| a + rng.uniform() as f32 - 0.5).collect() };
        let coarse_k = noisy(&exact_k[sink * row..coded * row], &mut rng);
        let coarse_v = noisy(&exact_v[sink * row..coded * row], &mut rng);
        let q: Vec<f32> = (0..n * heads.q * heads.dim).map(|_| rng.uniform() as f32 * 4.0 - 2.0).collect();
        let rows =
            SeqRows { exact_k: &exact_k, exact_v: &exact_v, coarse_k: &coarse_k, coarse_v: &coarse_v, sink, coded };
        let scale = 0.35;
        let mixed = |k: &[f32], v: &[f32]| -> (Vec<f32>, Vec<f32>) {
            let (mut mk, mut mv) = (exact_k.clone(), exact_v.clone());
            mk[sink * row..coded * row].copy_from_slice(k);
            mv[sink * row..coded * row].copy_from_slice(v);
            (mk, mv)
        };
        let close = |a: &[f32], b: &[f32], what: &str| {
            let err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-4, "{what}: max error {err}");
        };
        let (ck, cv) = mixed(&coarse_k, &coarse_v);
        close(&attend(&q, start, &rows, heads, scale, 0), &reference(&q, start, &ck, &cv, heads, scale), "top 0");
        close(
            &attend(&q, start, &rows, heads, scale, coded),
            &reference(&q, start, &exact_k, &exact_v, heads, scale),
            "every coded position",
        );
        // One position: per (query, head), its best coarse score among the coded positions.
        let got = attend(&q, start, &rows, heads, scale, 1);
        let d = heads.dim;
        for i in 0..n * heads.q {
            let (t, h) = (i / heads.q, i % heads.q);
            let g = h / (heads.q / heads.kv);
            let qi = &q[i * d..(i + 1) * d];
            let score = |p: usize| -> f32 { (0..d).map(|e| qi[e] * ck[(p * heads.kv + g) * d + e]).sum() };
            let best = (sink..coded).max_by(|&a, &b| score(a).total_cmp(&score(b))).unwrap();
            let (mut k1, mut v1) = (ck.clone(), cv.clone());
            k1[best * row..(best + 1) * row].copy_from_slice(&exact_k[best * row..(best + 1) * row]);
            v1[best * row..(best + 1) * row].copy_from_slice(&exact_v[best * row..(best + 1) * row]);
            // The reference for this one query row alone, at its own position.
            let one = reference(&q[t * heads.q * d..(t + 1) * heads.q * d], start + t, &k1, &v1, heads, scale);
            close(&got[i * d..(i + 1) * d], &one[h * d..(h + 1) * d], "top 1");
        }
    }
}
