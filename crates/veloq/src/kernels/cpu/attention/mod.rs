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

pub use codes::{CodeBlocks, CodesScratch, LutCodec};
pub use rows::{RowsScratch, Segment};
pub use softmax::Softmax;

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
