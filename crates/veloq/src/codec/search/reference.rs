//! The naive nearest-centroid search, as one writes it with tensor ops: broadcast the difference
//! into an `[N, centroids, sub_dim]` tensor, square, sum, argmin. It materialises
//! `N × centroids × sub_dim` floats; it exists as the ground truth for tests and as the baseline
//! of the benchmarks (multithreaded, like the tensor library it imitates).

use rayon::prelude::*;

use crate::codec::codebook::CodebookSet;
use crate::element::Element;

/// Codes `[rows, dim/sub_dim]` (unpacked) of the nearest centroid of each sub-vector; ties go to
/// the lowest index.
pub fn search_rows_naive<T: Element>(x: &[T], dim: usize, books: &CodebookSet) -> Vec<u16> {
    let shape = books.shape();
    let (sd, k) = (shape.sub_dim, shape.centroids());
    let m = dim / sd;
    let n = x.len() / sd;
    // diff[i, c, d] = x_i[d] − C_{j(i)}[c, d]
    let mut diff = vec![0.0f32; n * k * sd];
    diff.par_chunks_mut(k * sd).enumerate().for_each(|(i, row)| {
        let book = books.book(i % m);
        let xi = &x[i * sd..(i + 1) * sd];
        for c in 0..k {
            let cc = book.centroid(c);
            for d in 0..sd {
                row[c * sd + d] = xi[d].to_f32() - cc[d];
            }
        }
    });
    // dist[i, c] = Σ_d diff²
    let mut dist = vec![0.0f32; n * k];
    dist.par_chunks_mut(k).zip(diff.par_chunks(k * sd)).for_each(|(out, row)| {
        for (o, dv) in out.iter_mut().zip(row.chunks_exact(sd)) {
            let mut s = 0.0f32;
            for &v in dv {
                s += v * v;
            }
            *o = s;
        }
    });
    dist.par_chunks(k)
        .map(|row| {
            let mut best = 0;
            for (c, &v) in row.iter().enumerate() {
                if v < row[best] {
                    best = c;
                }
            }
            best as u16
        })
        .collect()
}

/// Bytes [`search_rows_naive`] allocates for `n` sub-vectors: the difference tensor, the distance
/// matrix and the codes.
pub fn naive_scratch_bytes(n: usize, centroids: usize, sub_dim: usize) -> usize {
    4 * n * centroids * sub_dim + 4 * n * centroids + 2 * n
}
