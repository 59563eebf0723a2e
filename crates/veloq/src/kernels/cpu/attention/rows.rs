//! Attention over rows a cache holds exactly (f16 sink and ring rows, a step's own new rows, or
//! rows decoded from codes), with the causal and sliding-window masks. Rows are widened a tile at a
//! time into caller-owned scratch, and each tile is shared by all the queries of the call.
//!
//! With many queries (a prefill chunk, a follow-up turn) a tile's scores and its weighted values
//! are real matrix products, `S = Q·Kᵀ` and `O += P·V`, run by the `gemm` crate's register-blocked
//! kernel; a masked-out score is −∞ (weight 0). With a few (decode) each query runs dot products
//! and axpys over the rows it sees.

use crate::element::Element;

use super::softmax::Softmax;
use super::{axpy, dot, Tile, GEMM_QUERIES};

/// Rows per tile.
pub const TILE: usize = 64;

/// Rows holding consecutive positions from `pos0`: keys and values token-major
/// `[rows, heads, head_dim]`.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a, E> {
    /// Keys `[rows, heads, D]`.
    pub keys: &'a [E],
    /// Values `[rows, heads, D]`.
    pub values: &'a [E],
    /// Position of the first row.
    pub pos0: usize,
}

/// Scratch of [`attend`] for up to `queries` queries of `head_dim`: a tile of widened keys and
/// values, and each query's weights over the tile.
pub struct RowsScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    w: Vec<f32>,
    ranges: Vec<(usize, usize)>,
}

impl RowsScratch {
    /// Scratch for `queries` queries of `head_dim`.
    pub fn new(head_dim: usize, queries: usize) -> Self {
        // `w` is queries × TILE: per query its tile's scores, then its weights.
        Self {
            k: vec![0.0; TILE * head_dim],
            v: vec![0.0; TILE * head_dim],
            w: vec![0.0; TILE * queries],
            ranges: vec![(0, 0); queries],
        }
    }

    fn fit(&mut self, head_dim: usize, queries: usize) {
        if self.k.len() < TILE * head_dim || self.ranges.len() < queries {
            *self = Self::new(head_dim, queries.max(self.ranges.len()));
        }
    }
}

/// Folds into each query's running partial the rows of `segments` it may see. Query `i`
/// (`q[i·D..]`, scaled, one query head over kv head `h` of `heads`) sits at position `q_pos[i]`
/// and sees rows at positions ≤ `q_pos[i]`, with `window` only the `window` most recent (itself
/// included). `stats[i]` and `acc[i·D..]` hold its partial (weights relative to `stats[i].m`).
#[allow(clippy::too_many_arguments)]
pub fn attend<E: Element>(
    q: &[f32],
    q_pos: &[usize],
    h: usize,
    heads: usize,
    segments: &[Segment<E>],
    window: Option<usize>,
    stats: &mut [Softmax],
    acc: &mut [f32],
    scratch: &mut RowsScratch,
) {
    let t = q_pos.len();
    if t == 0 {
        return;
    }
    let d = q.len() / t;
    scratch.fit(d, t);
    let row = heads * d;
    for seg in segments {
        let rows = seg.keys.len() / row;
        for r0 in (0..rows).step_by(TILE) {
            let n = TILE.min(rows - r0);
            let p0 = seg.pos0 + r0;
            let mut any = false;
            for (&p, range) in q_pos.iter().zip(scratch.ranges.iter_mut()) {
                let lo = window.map_or(0, |w| (p + 1).saturating_sub(w)).max(p0);
                let hi = (p + 1).min(p0 + n);
                *range = if lo < hi { (lo - p0, hi - p0) } else { (0, 0) };
                any |= lo < hi;
            }
            if !any {
                continue;
            }
            for j in 0..n {
                let src = ((r0 + j) * heads + h) * d;
                E::widen(&seg.keys[src..src + d], &mut scratch.k[j * d..(j + 1) * d]);
                E::widen(&seg.values[src..src + d], &mut scratch.v[j * d..(j + 1) * d]);
            }
            if t >= GEMM_QUERIES {
                let ranges = &scratch.ranges;
                let tile = Tile { k: &scratch.k, v: &scratch.v, n, d };
                tile.fold_into(q, stats, acc, &mut scratch.w, &mut |i, row| {
                    let (a, b) = ranges[i];
                    if a == b {
                        return false;
                    }
                    row[..a].fill(f32::NEG_INFINITY);
                    row[b..].fill(f32::NEG_INFINITY);
                    true
                });
            } else {
                for i in 0..t {
                    let (a, b) = scratch.ranges[i];
                    if a == b {
                        continue;
                    }
                    let qi = &q[i * d..(i + 1) * d];
                    let w = &mut scratch.w[i * TILE..i * TILE + (b - a)];
                    for (j, wj) in (a..b).zip(w.iter_mut()) {
                        *wj = dot(qi, &scratch.k[j * d..(j + 1) * d]);
                    }
                    let o = &mut acc[i * d..(i + 1) * d];
                    stats[i].fold(w, o);
                    for (j, &wj) in (a..b).zip(w.iter()) {
                        axpy(wj, &scratch.v[j * d..(j + 1) * d], o);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::testing::{fresh_seed, normal, rng};

    /// Masked attention over rows split in segments (and tiles) equals an f64 reference over the
    /// same f16 rows, for causal and sliding masks and queries that see nothing of some segments.
    #[test]
    fn matches_an_f64_reference_with_masks() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let (heads, d) = (3, 16);
        let rows = 150;
        let k: Vec<f16> = normal(&mut r, rows * heads * d, 1.0).into_iter().map(f16::from_f32).collect();
        let v: Vec<f16> = normal(&mut r, rows * heads * d, 1.0).into_iter().map(f16::from_f32).collect();
        // Positions 0..40 in one segment, 40..150 in another.
        let split = 40 * heads * d;
        let segs = [
            Segment { keys: &k[..split], values: &v[..split], pos0: 0 },
            Segment { keys: &k[split..], values: &v[split..], pos0: 40 },
        ];
        let q_pos = [0usize, 39, 40, 100, 149];
        let q = normal(&mut r, q_pos.len() * d, 0.5);
        // 5 queries take the matrix-product path, 3 the per-query one.
        for (nq, h, window) in
            [(5, 0, None), (5, 2, Some(7)), (5, 1, Some(64)), (5, 1, Some(1)), (3, 0, None), (3, 2, Some(7))]
        {
            let (q_pos, q) = (&q_pos[..nq], &q[..nq * d]);
            let mut stats = vec![Softmax::EMPTY; q_pos.len()];
            let mut acc = vec![0.0f32; q.len()];
            attend(q, q_pos, h, heads, &segs, window, &mut stats, &mut acc, &mut RowsScratch::new(d, 2));
            for (i, &p) in q_pos.iter().enumerate() {
                stats[i].finish(&mut acc[i * d..(i + 1) * d]);
                let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
                let score =
                    |t: usize| (0..d).map(|e| q[i * d + e] as f64 * k[(t * heads + h) * d + e].to_f64()).sum::<f64>();
                let m = (lo..=p).map(score).fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = (lo..=p).map(|t| (score(t) - m).exp()).sum();
                for e in 0..d {
                    let want =
                        (lo..=p).map(|t| (score(t) - m).exp() * v[(t * heads + h) * d + e].to_f64()).sum::<f64>()
                            / total;
                    let got = acc[i * d + e] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "seed {seed} head {h} window {window:?} query {p} dim {e}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
