//! Fused quantize on the CPU: rows (head vectors) in, bit-packed codes out, in one pass.
//!
//! Work is cut into blocks of 8 rows. A block's rows are transformed (widened, smoothed, rotated:
//! whatever the caller's `load_row` does) into a stack scratch, each sub-space is searched with the
//! 8 rows in SIMD lanes, and the block's codes are packed straight into its own byte range of the
//! output. Nothing is allocated: the only memory written besides the stack is the output, so the
//! peak extra memory is the output itself.

use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};

pub mod grid;
mod lanes;
pub mod reference;

use crate::codec::codebook::{Codebook, CodebookSet};
use crate::codec::hadamard::MAX_HEAD_DIM;
use crate::codec::pack::{pack_unchecked, packed_len};
use crate::element::Element;
use crate::error::{Error, Result};
pub use lanes::Metric;
use lanes::LANES;

/// Rows per parallel task: a multiple of 8 so every task starts on a byte boundary of the packed
/// stream, large enough that task overhead vanishes next to 8 × 256-centroid searches.
const ROWS_PER_TASK: usize = 64;
/// Most codes one block of 8 rows can produce (8 × MAX_HEAD_DIM / smallest sub_dim).
const MAX_BLOCK_CODES: usize = LANES * MAX_HEAD_DIM / 2;

/// Quantizes `rows` head vectors of `dim` floats into `out` (`packed_len(rows × dim/sub_dim, bits)`
/// bytes). `load_row(r, buf)` writes row `r`, transformed, into `buf`; it is called once per row.
/// Fails when a row produced no finite distance (NaN or infinite input).
pub fn quantize_rows<F>(
    rows: usize,
    dim: usize,
    books: &CodebookSet,
    metric: Metric,
    load_row: F,
    out: &mut [u8],
) -> Result<()>
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let shape = books.shape();
    let m = shape.subspaces(dim)?;
    if dim > MAX_HEAD_DIM {
        return Err(Error::Shape(format!("head_dim {dim} exceeds {MAX_HEAD_DIM}")));
    }
    let bits = shape.bits;
    if out.len() != packed_len(rows * m, bits) {
        return Err(Error::Shape(format!(
            "quantize: {rows} rows × {m} codes of {bits} bits need {} bytes, output has {}",
            packed_len(rows * m, bits),
            out.len()
        )));
    }
    let search = lanes::select();
    let bad = AtomicBool::new(false);
    let task_bytes = ROWS_PER_TASK * m * bits as usize / 8;
    let run_task = |(t, chunk): (usize, &mut [u8])| {
        let mut scratch = [[0.0f32; MAX_HEAD_DIM]; LANES];
        let mut codes = [0u16; MAX_BLOCK_CODES];
        let mut xt = [[0.0f32; LANES]; 8];
        let first = t * ROWS_PER_TASK;
        let end = (first + ROWS_PER_TASK).min(rows);
        let mut written = 0;
        for block in (first..end).step_by(LANES) {
            let n = (end - block).min(LANES);
            for (l, buf) in scratch.iter_mut().enumerate().take(n) {
                load_row(block + l, &mut buf[..dim]);
            }
            for j in 0..m {
                let o = j * shape.sub_dim;
                for (d, lane_row) in xt.iter_mut().enumerate().take(shape.sub_dim) {
                    for l in 0..LANES {
                        // Short blocks repeat their first row in the idle lanes.
                        lane_row[l] = scratch[if l < n { l } else { 0 }][o + d];
                    }
                }
                let (idx, best) = search(&xt[..shape.sub_dim], books.book(j), metric);
                for l in 0..n {
                    codes[l * m + j] = idx[l];
                    if !best[l].is_finite() {
                        bad.store(true, Ordering::Relaxed);
                    }
                }
            }
            let bytes = packed_len(n * m, bits);
            pack_unchecked(&codes[..n * m], bits, &mut chunk[written..written + bytes]);
            written += bytes;
        }
    };
    if rows <= ROWS_PER_TASK {
        run_task((0, out));
    } else {
        out.par_chunks_mut(task_bytes).enumerate().for_each(run_task);
    }
    if bad.load(Ordering::Relaxed) {
        return Err(Error::NonFinite {
            what: "quantize input (a row gave no finite distance to any centroid)".into(),
            index: 0,
            value: f32::NAN,
        });
    }
    Ok(())
}

/// Fused nearest-centroid search on raw rows of any element type, no transform: the kernel the
/// benchmarks compare with the materialising reference.
pub fn search_rows<T: Element>(x: &[T], dim: usize, books: &CodebookSet, metric: Metric, out: &mut [u8]) -> Result<()> {
    if dim == 0 || !x.len().is_multiple_of(dim) {
        return Err(Error::Shape(format!("search: {} values are not whole rows of {dim}", x.len())));
    }
    quantize_rows(
        x.len() / dim,
        dim,
        books,
        metric,
        |r, buf| {
            for (b, v) in buf.iter_mut().zip(&x[r * dim..(r + 1) * dim]) {
                *b = v.to_f32();
            }
        },
        out,
    )
}

/// Nearest centroid of every point of `points` (`[n, sub_dim]`), with its true squared distance:
/// the assignment step of k-means. Parallel over fixed chunks, so results do not depend on the
/// thread count.
pub fn assign_points(points: &[f32], book: &Codebook, metric: Metric, codes: &mut [u16], dist: &mut [f32]) {
    let sd = book.sub_dim();
    let n = points.len() / sd;
    assert!(codes.len() == n && dist.len() == n && points.len() == n * sd);
    let search = lanes::select();
    const CHUNK: usize = 1024;
    codes.par_chunks_mut(CHUNK).zip(dist.par_chunks_mut(CHUNK)).enumerate().for_each(|(t, (codes, dist))| {
        let base = t * CHUNK;
        let mut xt = [[0.0f32; LANES]; 8];
        for block in (0..codes.len()).step_by(LANES) {
            let n = (codes.len() - block).min(LANES);
            for (d, lanes) in xt.iter_mut().enumerate().take(sd) {
                for (l, x) in lanes.iter_mut().enumerate() {
                    let p = base + block + if l < n { l } else { 0 };
                    *x = points[p * sd + d];
                }
            }
            let (idx, best) = search(&xt[..sd], book, metric);
            for l in 0..n {
                codes[block + l] = idx[l];
                dist[block + l] = match metric {
                    Metric::Exact => best[l],
                    Metric::Expanded => {
                        let norm: f32 = (0..sd).map(|d| xt[d][l] * xt[d][l]).sum();
                        (best[l] + norm).max(0.0)
                    }
                };
            }
        }
    });
}

#[cfg(test)]
mod tests;
