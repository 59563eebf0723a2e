//! Matrix products with GGUF Q4_1 weights: `out[n, m] = x[n, k] · W[m, k]ᵀ`, W as ggml's Q4_1
//! blocks (32 weights `d·q + m`, q a nibble; 20 bytes: f16 d, f16 m, 16 bytes of nibbles, low
//! nibbles the first 16 weights, high nibbles the last 16).
//!
//! Why our own: candle 0.11 has no SIMD path for Q4_1 (its `vec_dot` is the scalar reference) and
//! multiplies one (row, column) pair at a time, so a 512-token prefill chunk of SmolLM2 (Q4_1)
//! spent three quarters of its time there. Two paths, both multithreaded over tiles of W's rows:
//! - few tokens (decode, small steps): each tile's blocks are widened to f32 once in registers and
//!   multiplied into up to [`ROWS`] tokens at a time (the weights stream from memory once per
//!   [`ROWS`] tokens);
//! - many tokens (prefill chunks): each tile of W is widened into scratch (a tile, not the matrix)
//!   and multiplied by the `gemm` crate (the kernel candle itself uses for f32 matmuls).
//!
//! Activations stay f32 in both (candle's path rounds them to 8 bits first), so the two paths
//! differ only in summation order.

use half::f16;
use rayon::prelude::*;

use super::gemm::matmul as gemm;

/// Weights per block.
pub const BLOCK: usize = 32;
/// Bytes per block.
pub const BLOCK_BYTES: usize = 20;
/// Tokens multiplied per pass over a block in the few-token path.
pub const ROWS: usize = 4;
/// From this many tokens on, tiles are widened and multiplied by `gemm`.
pub const GEMM_FROM: usize = 16;
/// W rows per task.
const TILE: usize = 32;

/// Why a product cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShapeError {
    #[error("Q4_1 weights: k = {0} is not a multiple of 32")]
    /// An inner dimension that is not a whole number of blocks.
    K(usize),
    #[error("Q4_1 product: expected {expected} {what}, got {got}")]
    /// A buffer of the wrong length.
    Len {
        /// Which buffer.
        what: &'static str,
        /// The length it needs.
        expected: usize,
        /// Its length.
        got: usize,
    },
}

fn check(what: &'static str, expected: usize, got: usize) -> Result<(), ShapeError> {
    if expected == got {
        Ok(())
    } else {
        Err(ShapeError::Len { what, expected, got })
    }
}

/// `out[n, m] = x[n, k] · W[m, k]ᵀ` with `w` the `m × k/32` Q4_1 blocks, row after row.
pub fn matmul(x: &[f32], n: usize, k: usize, w: &[u8], m: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    if !k.is_multiple_of(BLOCK) {
        return Err(ShapeError::K(k));
    }
    check("activations", n * k, x.len())?;
    check("weight bytes", m * k / BLOCK * BLOCK_BYTES, w.len())?;
    check("outputs", n * m, out.len())?;
    if n == 0 || m == 0 {
        return Ok(());
    }
    if n >= GEMM_FROM {
        widened_gemm(x, n, k, w, m, out);
    } else {
        few_tokens(x, n, k, w, m, out);
    }
    Ok(())
}

/// W's rows `tile` widened to f32 into `dst` (`rows × k`).
pub fn dequantize(w: &[u8], k: usize, dst: &mut [f32]) {
    let row_bytes = k / BLOCK * BLOCK_BYTES;
    for (row, d) in w.chunks_exact(row_bytes).zip(dst.chunks_exact_mut(k)) {
        for (b, o) in row.chunks_exact(BLOCK_BYTES).zip(d.chunks_exact_mut(BLOCK)) {
            let (scale, min) = scale_min(b);
            for (j, &q) in b[4..].iter().enumerate() {
                o[j] = (q & 15) as f32 * scale + min;
                o[j + 16] = (q >> 4) as f32 * scale + min;
            }
        }
    }
}

fn scale_min(b: &[u8]) -> (f32, f32) {
    (f16::from_le_bytes([b[0], b[1]]).to_f32(), f16::from_le_bytes([b[2], b[3]]).to_f32())
}

fn widened_gemm(x: &[f32], n: usize, k: usize, w: &[u8], m: usize, out: &mut [f32]) {
    let row_bytes = k / BLOCK * BLOCK_BYTES;
    let out_ptr = SendPtr(out.as_mut_ptr());
    w.par_chunks(row_bytes * TILE).enumerate().for_each(|(t, wt)| {
        let rows = wt.len() / row_bytes;
        let mut tile = vec![0f32; rows * k];
        dequantize(wt, k, &mut tile);
        let dst = out_ptr;
        // SAFETY: gemm writes out[i, t·TILE .. t·TILE + rows] for i < n (row stride m, column
        // stride 1): inside `out` (n·m elements, checked by `matmul`) and disjoint between tasks,
        // which own disjoint column ranges. x is n × k (row stride k), the tile rows × k read
        // transposed (row stride 1, column stride k).
        unsafe { gemm((n, rows, k), dst.0.add(t * TILE), m, false, x.as_ptr(), k, tile.as_ptr(), (1, k)) };
    });
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand tasks disjoint parts of one output (see the writes' comments).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Per token and block, Σ x over the block: the `m` term of `d·q + m` multiplies it.
fn block_sums(x: &[f32], k: usize) -> Vec<f32> {
    debug_assert!(x.len().is_multiple_of(k));
    x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect()
}

fn few_tokens(x: &[f32], n: usize, k: usize, w: &[u8], m: usize, out: &mut [f32]) {
    let row_bytes = k / BLOCK * BLOCK_BYTES;
    let sums = block_sums(x, k);
    let dot = select();
    // Results per W row ([m, n]), transposed into `out` after: tasks own whole W rows.
    let mut by_row = vec![0f32; m * n];
    by_row.par_chunks_mut(TILE * n).zip(w.par_chunks(row_bytes * TILE)).for_each(|(o, wt)| {
        for (r, wr) in wt.chunks_exact(row_bytes).enumerate() {
            for i0 in (0..n).step_by(ROWS) {
                let rows = ROWS.min(n - i0);
                let mut acc = [0f32; ROWS];
                dot(
                    wr,
                    &x[i0 * k..(i0 + rows) * k],
                    &sums[i0 * k / BLOCK..(i0 + rows) * k / BLOCK],
                    k,
                    &mut acc[..rows],
                );
                o[r * n + i0..r * n + i0 + rows].copy_from_slice(&acc[..rows]);
            }
        }
    });
    for i in 0..n {
        for r in 0..m {
            out[i * m + r] = by_row[r * n + i];
        }
    }
}

/// One W row against up to [`ROWS`] tokens: `acc[i] = Σ_b d_b·(q_b · x_i,b) + m_b·Σ x_i,b`.
type DotFn = fn(w: &[u8], x: &[f32], sums: &[f32], k: usize, acc: &mut [f32]);

fn select() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return |w, x, sums, k, acc| {
                // SAFETY: AVX2 and FMA were detected just above.
                unsafe { avx2::dot(w, x, sums, k, acc) }
            };
        }
    }
    portable_dot
}

fn portable_dot(w: &[u8], x: &[f32], sums: &[f32], k: usize, acc: &mut [f32]) {
    let nb = k / BLOCK;
    for (i, a) in acc.iter_mut().enumerate() {
        let (xi, si) = (&x[i * k..(i + 1) * k], &sums[i * nb..(i + 1) * nb]);
        let mut total = 0f32;
        for (bi, b) in w.chunks_exact(BLOCK_BYTES).enumerate() {
            let (scale, min) = scale_min(b);
            let xb = &xi[bi * BLOCK..(bi + 1) * BLOCK];
            let mut qx = 0f32;
            for (j, &q) in b[4..].iter().enumerate() {
                qx += (q & 15) as f32 * xb[j] + (q >> 4) as f32 * xb[j + 16];
            }
            total += scale * qx + min * si[bi];
        }
        *a = total;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{scale_min, BLOCK, BLOCK_BYTES, ROWS};

    /// Widens a block's 32 nibbles to f32 `q` (not yet scaled): 4 registers of 8.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles(b: &[u8]) -> [__m256; 4] {
        // SAFETY (caller): `b` holds a whole block (20 bytes); the 16 nibble bytes start at 4.
        let q = _mm_loadu_si128(b.as_ptr().add(4) as *const __m128i);
        let lo = _mm_and_si128(q, _mm_set1_epi8(15));
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
        let f = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// See [`super::DotFn`]. Per block: nibbles widened once, then for every token 4 FMAs into
    /// its own accumulator scaled by d, plus m·Σx from the precomputed sums.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(w: &[u8], x: &[f32], sums: &[f32], k: usize, acc: &mut [f32]) {
        let (nb, rows) = (k / BLOCK, acc.len());
        debug_assert!(rows <= ROWS && x.len() >= rows * k && w.len() >= nb * BLOCK_BYTES);
        let mut total = [_mm256_setzero_ps(); ROWS];
        let mut mins = [0f32; ROWS];
        for bi in 0..nb {
            let b = &w[bi * BLOCK_BYTES..(bi + 1) * BLOCK_BYTES];
            let (d, m) = scale_min(b);
            let q = nibbles(b);
            for i in 0..rows {
                // SAFETY: token i's block bi is x[i·k + bi·32 ..][..32], inside x (checked above).
                let xp = x.as_ptr().add(i * k + bi * BLOCK);
                let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
                s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp.add(8)), s);
                s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), s);
                s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), s);
                total[i] = _mm256_fmadd_ps(_mm256_set1_ps(d), s, total[i]);
                mins[i] += m * sums[i * nb + bi];
            }
        }
        for i in 0..rows {
            acc[i] = hsum(total[i]) + mins[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random Q4_1 rows with realistic scales (d ≈ 0.01, m ≈ −8d).
    fn weights(rng: &mut impl Rng, m: usize, k: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(m * k / BLOCK * BLOCK_BYTES);
        for _ in 0..m * k / BLOCK {
            let d = rng.random_range(0.002f32..0.02);
            w.extend(f16::from_f32(d).to_le_bytes());
            w.extend(f16::from_f32(-8.0 * d * rng.random_range(0.5f32..1.5)).to_le_bytes());
            w.extend((0..16).map(|_| rng.random::<u8>()));
        }
        w
    }

    /// f64 over the widened weights: the reference both paths must match.
    fn reference(x: &[f32], n: usize, k: usize, w: &[u8], m: usize) -> Vec<f64> {
        let mut wd = vec![0f32; m * k];
        dequantize(w, k, &mut wd);
        let mut out = vec![0f64; n * m];
        for i in 0..n {
            for r in 0..m {
                out[i * m + r] = (0..k).map(|j| x[i * k + j] as f64 * wd[r * k + j] as f64).sum();
            }
        }
        out
    }

    #[test]
    fn both_paths_match_the_reference_on_random_shapes() {
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(7);
        for &(n, k, m) in
            &[(1, 32, 1), (1, 576, 576), (3, 64, 45), (5, 96, 33), (15, 128, 70), (16, 576, 64), (37, 160, 97)]
        {
            let w = weights(&mut rng, m, k);
            let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let want = reference(&x, n, k, &w, m);
            let mut out = vec![f32::NAN; n * m];
            matmul(&x, n, k, &w, m, &mut out).unwrap();
            let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
            let err = out.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max) / scale;
            assert!(scale > 0.1 && err < 1e-5, "n {n} k {k} m {m}: relative error {err}");
            let mut portable = vec![0f32; n.min(ROWS)];
            let sums = block_sums(&x[..n.min(ROWS) * k], k);
            portable_dot(&w[..k / BLOCK * BLOCK_BYTES], &x, &sums, k, &mut portable);
            for (i, p) in portable.iter().enumerate() {
                assert!((*p as f64 - want[i * m]).abs() / scale < 1e-5, "portable n {n} k {k} m {m}");
            }
        }
    }

    #[test]
    fn shapes_are_checked() {
        let mut out = vec![0f32; 1];
        assert_eq!(matmul(&[0.0; 33], 1, 33, &[], 1, &mut out), Err(ShapeError::K(33)));
        assert!(matches!(matmul(&[0.0; 32], 1, 32, &[0; 19], 1, &mut out), Err(ShapeError::Len { .. })));
    }
}
