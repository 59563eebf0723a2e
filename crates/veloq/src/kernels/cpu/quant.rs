//! Matrix products with GGUF block-quantized weights: `out[n, m] = x[n, k] · W[m, k]ᵀ`, W as
//! ggml's blocks of 32 weights ([`Format`]): Q4_1 (`d·q + m`, q a nibble; 20 bytes: f16 d, f16 m,
//! 16 bytes of nibbles, low nibbles the first 16 weights, high nibbles the last 16) and Q8_0
//! (`d·q`, q a signed byte; 34 bytes: f16 d, 32 bytes).
//!
//! Why our own: candle 0.11 has no SIMD path for Q4_1 (its `vec_dot` is the scalar reference) and
//! multiplies one (row, column) pair at a time, so a 512-token prefill chunk of SmolLM2 (Q4_1)
//! spent three quarters of its time there; its Q8_0 product (SmolLM2's tied output matrix, 49k
//! rows) runs on candle's one thread while the other core waits. Two paths, both multithreaded
//! over tiles of W's rows:
//! - few tokens (decode, small steps): each tile's blocks are multiplied into up to [`ROWS`] tokens
//!   at a time (the weights stream from memory once per [`ROWS`] tokens); with AVX2 the block's
//!   integers meet the activations as 16-bit integers (a scale per block of 32: [`Tokens`]) in
//!   `madd` instructions, half the work of widening every weight to f32;
//! - many tokens (prefill chunks): each tile of W is widened into scratch (a tile, not the matrix)
//!   and multiplied by the `gemm` crate (the kernel candle itself uses for f32 matmuls).
//!
//! Activations keep 16 bits or more in both: candle's path (and llama.cpp's) rounds them to 8 bits,
//! which costs perplexity (results/README.md, "CPU decode against llama.cpp"); 16 bits per block
//! err by at most 2⁻¹⁶ of the block's largest activation, below the f16 weights' own rounding.

use half::f16;
use rayon::prelude::*;

use super::gemm::matmul as gemm;

/// Weights per block.
pub const BLOCK: usize = 32;

/// A GGUF block format of 32 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `d·q + m`, q in 0..16: 20 bytes.
    Q4_1,
    /// `d·q`, q in −128..128: 34 bytes.
    Q8_0,
}

impl Format {
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
        }
    }

    /// One block widened to f32 into `o` (32 weights).
    fn widen(self, b: &[u8], o: &mut [f32]) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        match self {
            Format::Q4_1 => {
                let min = f16::from_le_bytes([b[2], b[3]]).to_f32();
                for (j, &q) in b[4..].iter().enumerate() {
                    o[j] = (q & 15) as f32 * d + min;
                    o[j + 16] = (q >> 4) as f32 * d + min;
                }
            }
            Format::Q8_0 => {
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = q as i8 as f32 * d;
                }
            }
        }
    }
}

/// Tokens multiplied per pass over a block in the few-token path.
pub const ROWS: usize = 4;
/// From this many tokens on, tiles are widened and multiplied by `gemm`.
pub const GEMM_FROM: usize = 16;
/// W rows per task.
const TILE: usize = 32;

/// Why a product cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShapeError {
    #[error("block-quantized weights: k = {0} is not a multiple of 32")]
    /// An inner dimension that is not a whole number of blocks.
    K(usize),
    #[error("block-quantized product: expected {expected} {what}, got {got}")]
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

/// `out[n, m] = x[n, k] · W[m, k]ᵀ` with `w` the `m × k/32` blocks of `format`, row after row.
pub fn matmul(
    format: Format,
    x: &[f32],
    n: usize,
    k: usize,
    w: &[u8],
    m: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    if !k.is_multiple_of(BLOCK) {
        return Err(ShapeError::K(k));
    }
    check("activations", n * k, x.len())?;
    check("weight bytes", m * k / BLOCK * format.block_bytes(), w.len())?;
    check("outputs", n * m, out.len())?;
    if n == 0 || m == 0 {
        return Ok(());
    }
    if n >= GEMM_FROM {
        widened_gemm(format, x, n, k, w, m, out);
    } else {
        few_tokens(format, x, n, k, w, m, out);
    }
    Ok(())
}

/// W's rows (`w`, whole rows of `format` blocks) widened to f32 into `dst` (`rows × k`).
pub fn dequantize(format: Format, w: &[u8], k: usize, dst: &mut [f32]) {
    let bb = format.block_bytes();
    for (row, d) in w.chunks_exact(k / BLOCK * bb).zip(dst.chunks_exact_mut(k)) {
        for (b, o) in row.chunks_exact(bb).zip(d.chunks_exact_mut(BLOCK)) {
            format.widen(b, o);
        }
    }
}

fn widened_gemm(format: Format, x: &[f32], n: usize, k: usize, w: &[u8], m: usize, out: &mut [f32]) {
    let row_bytes = k / BLOCK * format.block_bytes();
    let out_ptr = SendPtr(out.as_mut_ptr());
    w.par_chunks(row_bytes * TILE).enumerate().for_each(|(t, wt)| {
        let rows = wt.len() / row_bytes;
        let mut tile = vec![0f32; rows * k];
        dequantize(format, wt, k, &mut tile);
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

/// Tokens' activations as the few-token kernels read them, per block of 32: f32, their sum (the `m`
/// term of `d·q + m` multiplies it), and 16-bit integers `q` with a scale (`x ≈ q · scale`, the
/// block's largest |x| at 32,767).
struct Tokens<'a> {
    x: &'a [f32],
    sums: Vec<f32>,
    /// `q` and the scales, when the kernel reads them.
    integers: Option<(Vec<i16>, Vec<f32>)>,
}

impl<'a> Tokens<'a> {
    /// `x`'s sums, and its 16-bit integers when `integers` (the kernels of Q4_1 read them).
    fn new(x: &'a [f32], integers: bool) -> Self {
        let blocks = x.len() / BLOCK;
        let sums = x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect();
        let integers = integers.then(|| {
            let (mut q, mut scales) = (vec![0i16; x.len()], Vec::with_capacity(blocks));
            for (b, qb) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)) {
                let max = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let scale = max / i16::MAX as f32;
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                // Half away from zero, then truncated: |v·inv| ≤ 32,767 stays in range.
                for (q, v) in qb.iter_mut().zip(b) {
                    *q = (v * inv + 0.5f32.copysign(*v)) as i16;
                }
                scales.push(scale);
            }
            (q, scales)
        });
        Self { x, sums, integers }
    }

    /// Tokens `i0 .. i0 + rows` of a `k`-wide batch.
    fn rows(&self, i0: usize, rows: usize, k: usize) -> TokenRows<'_> {
        let (e, b) = (i0 * k..(i0 + rows) * k, i0 * k / BLOCK..(i0 + rows) * k / BLOCK);
        let (q, scales) = match &self.integers {
            Some((q, scales)) => (&q[e.clone()], &scales[b.clone()]),
            None => (&[][..], &[][..]),
        };
        TokenRows { x: &self.x[e], sums: &self.sums[b], q, scales }
    }
}

/// Up to [`ROWS`] tokens of [`Tokens`].
#[derive(Clone, Copy)]
struct TokenRows<'a> {
    x: &'a [f32],
    sums: &'a [f32],
    q: &'a [i16],
    scales: &'a [f32],
}

fn few_tokens(format: Format, x: &[f32], n: usize, k: usize, w: &[u8], m: usize, out: &mut [f32]) {
    let row_bytes = k / BLOCK * format.block_bytes();
    let (dot, integers) = select(format, n);
    let tokens = Tokens::new(x, integers);
    // Results per W row ([m, n]), transposed into `out` after: tasks own whole W rows.
    let mut by_row = vec![0f32; m * n];
    by_row.par_chunks_mut(TILE * n).zip(w.par_chunks(row_bytes * TILE)).for_each(|(o, wt)| {
        for (r, wr) in wt.chunks_exact(row_bytes).enumerate() {
            for i0 in (0..n).step_by(ROWS) {
                let rows = ROWS.min(n - i0);
                let mut acc = [0f32; ROWS];
                dot(wr, tokens.rows(i0, rows, k), k, &mut acc[..rows]);
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

/// One W row against up to [`ROWS`] tokens: `acc[i] = Σ_b d_b·(q_b · x_i,b) (+ m_b·Σ x_i,b)`.
type DotFn = fn(w: &[u8], t: TokenRows<'_>, k: usize, acc: &mut [f32]);

/// The dot kernel of `format` for `n` tokens on this CPU, and whether it reads the 16-bit
/// activations: Q4_1 for one token (a decode step), where the widening to f32 is most of the work;
/// with more tokens per block, or Q8_0's bytes, the f32 form measured faster (`cargo bench -p
/// veloq --bench quant`).
fn select(format: Format, n: usize) -> (DotFn, bool) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            return match format {
                Format::Q4_1 if n > 1 => (
                    |w, t, k, acc| {
                        // SAFETY: AVX2, FMA and F16C were detected just above.
                        unsafe { avx2::dot_q4_1_f32(w, t.x, t.sums, k, acc) }
                    },
                    false,
                ),
                Format::Q4_1 => (
                    |w, t, k, acc| {
                        // SAFETY: AVX2, FMA and F16C were detected just above.
                        unsafe { avx2::dot_q4_1(w, t, k, acc) }
                    },
                    true,
                ),
                Format::Q8_0 => (
                    |w, t, k, acc| {
                        // SAFETY: AVX2, FMA and F16C were detected just above.
                        unsafe { avx2::dot_q8_0(w, t.x, k, acc) }
                    },
                    false,
                ),
            };
        }
    }
    match format {
        Format::Q4_1 => (|w, t, k, acc| portable_dot(Format::Q4_1, w, t.x, k, acc), false),
        Format::Q8_0 => (|w, t, k, acc| portable_dot(Format::Q8_0, w, t.x, k, acc), false),
    }
}

/// Blocks widened one at a time, then multiplied (no SIMD).
fn portable_dot(format: Format, w: &[u8], x: &[f32], k: usize, acc: &mut [f32]) {
    let mut widened = [0f32; BLOCK];
    for (i, a) in acc.iter_mut().enumerate() {
        let xi = &x[i * k..(i + 1) * k];
        let mut total = 0f32;
        for (b, xb) in w.chunks_exact(format.block_bytes()).zip(xi.chunks_exact(BLOCK)) {
            format.widen(b, &mut widened);
            total += widened.iter().zip(xb).map(|(w, x)| w * x).sum::<f32>();
        }
        *a = total;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Format, TokenRows, BLOCK, ROWS};

    const BLOCK_BYTES: usize = Format::Q4_1.block_bytes();
    const Q8_BYTES: usize = Format::Q8_0.block_bytes();

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

    /// A block's leading f16 pair (Q4_1's d and m) as f32, by the F16C instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_min(b: *const u8) -> (f32, f32) {
        // SAFETY (caller): `b` points at a block's first 4 bytes.
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((b as *const i32).read_unaligned()));
        (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// See [`super::DotFn`]. Per block: the 32 nibbles widened to 16-bit lanes once, then for every
    /// token two `madd`s with its 16-bit activations, the 8 sums converted and accumulated scaled
    /// by d times the token's block scale, plus m·Σx from the exact sums.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1(w: &[u8], t: TokenRows<'_>, k: usize, acc: &mut [f32]) {
        let (nb, rows) = (k / BLOCK, acc.len());
        debug_assert!(rows <= ROWS && t.q.len() >= rows * k && t.scales.len() >= rows * nb);
        debug_assert!(w.len() >= nb * BLOCK_BYTES);
        let mut total = [_mm256_setzero_ps(); ROWS];
        let mut mins = [0f32; ROWS];
        let low = _mm_set1_epi8(15);
        for bi in 0..nb {
            // SAFETY: block bi is w[bi·20 ..][..20], inside `w` (checked above).
            let b = w.as_ptr().add(bi * BLOCK_BYTES);
            let (d, m) = scale_min(b);
            let q = _mm_loadu_si128(b.add(4) as *const __m128i);
            let lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, low));
            let hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low));
            for i in 0..rows {
                // SAFETY: token i's block bi is q[i·k + bi·32 ..][..32] and scales/sums[i·nb + bi].
                let xp = t.q.as_ptr().add(i * k + bi * BLOCK) as *const __m256i;
                let p = _mm256_add_epi32(
                    _mm256_madd_epi16(lo, _mm256_loadu_si256(xp)),
                    _mm256_madd_epi16(hi, _mm256_loadu_si256(xp.add(1))),
                );
                let s = d * *t.scales.get_unchecked(i * nb + bi);
                total[i] = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(p), total[i]);
                mins[i] += m * *t.sums.get_unchecked(i * nb + bi);
            }
        }
        for i in 0..rows {
            acc[i] = hsum(total[i]) + mins[i];
        }
    }

    /// Q4_1 against several tokens' f32 activations: per block the nibbles widened to f32 once,
    /// then for every token 4 FMAs into its own accumulator scaled by d, plus m·Σx from the sums
    /// (with two or more tokens this beats [`dot_q4_1`], whose per-token work is larger).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_f32(w: &[u8], x: &[f32], sums: &[f32], k: usize, acc: &mut [f32]) {
        let (nb, rows) = (k / BLOCK, acc.len());
        debug_assert!(rows <= ROWS && x.len() >= rows * k && w.len() >= nb * BLOCK_BYTES);
        let mut total = [_mm256_setzero_ps(); ROWS];
        let mut mins = [0f32; ROWS];
        for bi in 0..nb {
            let b = &w[bi * BLOCK_BYTES..(bi + 1) * BLOCK_BYTES];
            let (d, m) = scale_min(b.as_ptr());
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

    /// One W row of Q8_0 against up to [`ROWS`] tokens' f32 activations: each block's bytes widened
    /// to f32 once, 4 FMAs per token, scaled by d.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(w: &[u8], x: &[f32], k: usize, acc: &mut [f32]) {
        let (nb, rows) = (k / BLOCK, acc.len());
        debug_assert!(rows <= ROWS && x.len() >= rows * k && w.len() >= nb * Q8_BYTES);
        let mut total = [_mm256_setzero_ps(); ROWS];
        for bi in 0..nb {
            let b = w.as_ptr().add(bi * Q8_BYTES);
            let d = _mm256_set1_ps(half::f16::from_le_bytes([*b, *b.add(1)]).to_f32());
            // SAFETY: the block's 32 signed bytes are b[2..34], inside `w` (checked above).
            let q: [__m256; 4] = std::array::from_fn(|j| {
                let v = _mm_loadl_epi64(b.add(2 + 8 * j) as *const __m128i);
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
            });
            for (i, t) in total[..rows].iter_mut().enumerate() {
                // SAFETY: token i's block bi is x[i·k + bi·32 ..][..32], inside x (checked above).
                let xp = x.as_ptr().add(i * k + bi * BLOCK);
                let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
                s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp.add(8)), s);
                s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp.add(16)), s);
                s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp.add(24)), s);
                *t = _mm256_fmadd_ps(d, s, *t);
            }
        }
        for (a, t) in acc.iter_mut().zip(total) {
            *a = hsum(t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random rows with realistic scales (Q4_1: d ≈ 0.01, m ≈ −8d; Q8_0: d ≈ 0.001).
    fn weights(format: Format, rng: &mut impl Rng, m: usize, k: usize) -> Vec<u8> {
        let mut w = Vec::with_capacity(m * k / BLOCK * format.block_bytes());
        for _ in 0..m * k / BLOCK {
            match format {
                Format::Q4_1 => {
                    let d = rng.random_range(0.002f32..0.02);
                    w.extend(f16::from_f32(d).to_le_bytes());
                    w.extend(f16::from_f32(-8.0 * d * rng.random_range(0.5f32..1.5)).to_le_bytes());
                    w.extend((0..16).map(|_| rng.random::<u8>()));
                }
                Format::Q8_0 => {
                    w.extend(f16::from_f32(rng.random_range(0.0002f32..0.002)).to_le_bytes());
                    w.extend((0..32).map(|_| rng.random::<u8>()));
                }
            }
        }
        w
    }

    /// Per weight, (|d·q|, |m|) (Q8_0: m = 0). Their sum is what the f32 error of a product with
    /// it scales by; |d·q| alone is what the activations' 16-bit rounding multiplies (Q4_1's m
    /// meets exact sums).
    fn magnitudes(format: Format, w: &[u8]) -> Vec<(f64, f64)> {
        let mut out = Vec::with_capacity(w.len() / format.block_bytes() * BLOCK);
        for b in w.chunks_exact(format.block_bytes()) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f64().abs();
            match format {
                Format::Q4_1 => {
                    let m = f16::from_le_bytes([b[2], b[3]]).to_f64().abs();
                    let q = b[4..].iter().map(|q| q & 15).chain(b[4..].iter().map(|q| q >> 4));
                    out.extend(q.map(|q| (d * q as f64, m)));
                }
                Format::Q8_0 => out.extend(b[2..].iter().map(|&q| (d * (q as i8 as f64).abs(), 0.0))),
            }
        }
        out
    }

    /// f64 over the widened weights: the reference both paths must match.
    fn reference(format: Format, x: &[f32], n: usize, k: usize, w: &[u8], m: usize) -> Vec<f64> {
        let mut wd = vec![0f32; m * k];
        dequantize(format, w, k, &mut wd);
        let mut out = vec![0f64; n * m];
        for i in 0..n {
            for r in 0..m {
                out[i * m + r] = (0..k).map(|j| x[i * k + j] as f64 * wd[r * k + j] as f64).sum();
            }
        }
        out
    }

    /// Both paths and the portable dot against the f64 reference over the widened weights, on
    /// fresh random weights and activations. The bound is the maths of f32 arithmetic, whatever
    /// the summation order (the `gemm` crate picks its kernel by the CPU at run time): a sum of k
    /// rounded products errs by at most γ_k·Σ|terms| (γ_k = kε/(1−kε), ε = 2⁻²⁴), where a Q4_1
    /// term counts |d·q| and |m| apart (the kernel sums d·Σqx and m·Σx, which may cancel), and
    /// widening a weight to f32 adds 2ε of it; 2·(k + 4)·ε covers both. A lone token's Q4_1 product
    /// may also round each activation to 16 bits of its block's largest |x| (the AVX2 kernel): at
    /// most half a step, |x|max / 32,767 / 2 (the 10⁻⁶ covers the f32 rounding of the scale and of
    /// x / scale, a few ε), times |d·q| of its weight. Other products keep f32 activations, and
    /// the bound leaves that term out for them.
    #[test]
    fn both_paths_match_the_reference_on_random_shapes() {
        let seed = crate::testing::fresh_seed();
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        for format in [Format::Q4_1, Format::Q8_0] {
            for &(n, k, m) in
                &[(1, 32, 1), (1, 576, 576), (3, 64, 45), (5, 96, 33), (15, 128, 70), (16, 576, 64), (37, 160, 97)]
            {
                let w = weights(format, &mut rng, m, k);
                let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let want = reference(format, &x, n, k, &w, m);
                let mut out = vec![f32::NAN; n * m];
                matmul(format, &x, n, k, &w, m, &mut out).unwrap();
                let mags = magnitudes(format, &w);
                let gamma = 2.0 * (k + 4) as f64 * f64::powi(2.0, -24);
                let rounded = format == Format::Q4_1 && n == 1;
                let step = |i: usize, j: usize| -> f64 {
                    let block = &x[i * k + j / BLOCK * BLOCK..][..BLOCK];
                    block.iter().fold(0f64, |a, v| a.max(v.abs() as f64)) / i16::MAX as f64 / 2.0 * (1.0 + 1e-6)
                };
                let bound = |i: usize, r: usize| -> f64 {
                    (0..k)
                        .map(|j| {
                            let (dq, m) = mags[r * k + j];
                            let f32_error = gamma * (dq + m) * (x[i * k + j] as f64).abs();
                            f32_error + if rounded { dq * step(i, j) } else { 0.0 }
                        })
                        .sum::<f64>()
                };
                let at = format!("seed {seed} {format:?} n {n} k {k} m {m}");
                for i in 0..n {
                    for r in 0..m {
                        let (got, b) = (out[i * m + r] as f64, bound(i, r));
                        assert!(
                            (got - want[i * m + r]).abs() <= b,
                            "{at} [{i}, {r}]: {got} vs {} (bound {b})",
                            want[i * m + r]
                        );
                    }
                }
                let mut portable = vec![0f32; n.min(ROWS)];
                portable_dot(format, &w[..k / BLOCK * format.block_bytes()], &x, k, &mut portable);
                for (i, p) in portable.iter().enumerate() {
                    assert!((*p as f64 - want[i * m]).abs() <= bound(i, 0), "{at}: portable");
                }
            }
        }
    }

    #[test]
    fn shapes_are_checked() {
        let mut out = vec![0f32; 1];
        assert_eq!(matmul(Format::Q4_1, &[0.0; 33], 1, 33, &[], 1, &mut out), Err(ShapeError::K(33)));
        assert!(matches!(matmul(Format::Q4_1, &[0.0; 32], 1, 32, &[0; 19], 1, &mut out), Err(ShapeError::Len { .. })));
        assert!(matches!(matmul(Format::Q8_0, &[0.0; 32], 1, 32, &[0; 20], 1, &mut out), Err(ShapeError::Len { .. })));
    }
}
