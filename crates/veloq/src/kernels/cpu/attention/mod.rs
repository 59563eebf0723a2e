#![warn(missing_docs)]
//! Attention over what a KV cache holds, on the CPU, in softmax partials that merge: a cache's
//! coded positions ([`codes`]) and its f16 rows ([`rows`]) are attended separately and combined
//! with the log-sum-exp rule ([`softmax`]). Codes are always older than every query, so they need
//! no mask; rows carry positions and are masked causally (and by a sliding window).
//!
//! Every function works on one query head at a time over slices (no framework, no allocation in
//! the loops: the caller owns the scratch), so a cache can run them in parallel over heads and
//! queries.

pub mod codes;
pub mod rows;
pub mod softmax;

use super::gemm::matmul;

pub use codes::{attend_many, CodeBlock, CodeBlocks, CodesScratch, LutCodec};
pub use rows::{RowsScratch, Segment};
pub use softmax::Softmax;

/// From this many queries on, a tile of rows is scored and summed by matrix products ([`Tile`]);
/// below it, by dot products per query.
pub const GEMM_QUERIES: usize = 4;

/// A tile of `n` widened keys and values (`n × d` each, row-major) that several queries attend.
pub(crate) struct Tile<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub n: usize,
    pub d: usize,
}

impl Tile<'_> {
    /// Folds the tile into `t` queries' partials (`q` and `acc` `t × d`) by two matrix products,
    /// `S = Q·Kᵀ` and `O += P·V`, run by the `gemm` crate's register-blocked kernel. `w` is scratch
    /// of at least `t × n`; `prepare(i, scores)` edits query `i`'s scores before its softmax (−∞
    /// masks a row, an offset shifts them) and returns false when the query sees none of them.
    pub fn fold_into(
        &self,
        q: &[f32],
        stats: &mut [Softmax],
        acc: &mut [f32],
        w: &mut [f32],
        prepare: &mut dyn FnMut(usize, &mut [f32]) -> bool,
    ) {
        let (t, n, d) = (stats.len(), self.n, self.d);
        assert!(q.len() >= t * d && acc.len() >= t * d && w.len() >= t * n && self.k.len() >= n * d);
        assert!(self.v.len() >= n * d);
        let w = &mut w[..t * n];
        // SAFETY: S (t × n, row stride n) lies in `w`; Q (t × d, row stride d) in `q`; the keys
        // (n × d, row stride d) in `self.k`, read transposed (row stride 1, column stride d) — all
        // sizes asserted above.
        unsafe { matmul((t, n, d), w.as_mut_ptr(), n, false, q.as_ptr(), d, self.k.as_ptr(), (1, d)) };
        for (i, row) in w.chunks_exact_mut(n).enumerate() {
            if prepare(i, row) {
                stats[i].fold(row, &mut acc[i * d..(i + 1) * d]);
            } else {
                row.fill(0.0);
            }
        }
        // SAFETY: O (t × d, row stride d) lies in `acc`; P (t × n, row stride n) in `w`; the values
        // (n × d, row stride d) in `self.v` (asserted above). O += P·V.
        unsafe { matmul((t, d, n), acc.as_mut_ptr(), d, true, w.as_ptr(), n, self.v.as_ptr(), (d, 1)) };
    }
}

/// Dot product with 8 independent accumulators (vectorises without reassociation flags).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out += w · x`
#[inline]
pub fn axpy(w: f32, x: &[f32], out: &mut [f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += w * v;
    }
}
