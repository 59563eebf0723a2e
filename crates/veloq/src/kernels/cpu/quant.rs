//! Matrix products with GGUF block-quantized weights: `out[n, m] = x[n, k] · W[m, k]ᵀ`, W as
//! ggml's blocks of 32 weights ([`Format`]): Q4_1 (`d·q + m`, q a nibble; 20 bytes: f16 d, f16 m,
//! 16 bytes of nibbles, low nibbles the first 16 weights, high nibbles the last 16) and Q8_0
//! (`d·q`, q a signed byte; 34 bytes: f16 d, 32 bytes).
//!
//! Why our own: candle 0.11 has no SIMD path for Q4_1 (its `vec_dot` is the scalar reference) and
//! multiplies one (row, column) pair at a time, so a 512-token prefill chunk of SmolLM2 (Q4_1)
//! spent three quarters of its time there; its Q8_0 product (SmolLM2's tied output matrix, 49k
//! rows) runs on candle's one thread while the other core waits.
//!
//! The weights are repacked once ([`Packed`]): rows in groups of [`GROUP`], each group's blocks
//! interleaved so that one AVX2 register holds two weights of each of its 8 rows. A product then
//! never sums across a register: `madd` of a group's pair of columns against the activations' pair,
//! broadcast, leaves each row's partial sum in its own 32-bit lane, and a block's scales (8 f16 in
//! a row) scale all 8 rows at once. Two paths, both multithreaded over tiles of groups:
//! - few tokens (decode, small steps): each group's blocks meet up to [`ROWS`] tokens' activations
//!   as 16-bit integers (a scale per block of 32: [`Tokens`]), integer sums per block;
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
/// W rows per group of the packed layout: an AVX2 register's eight 32-bit lanes.
pub const GROUP: usize = 8;

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

    /// Bytes of a group's scales (d, and Q4_1's m) at the head of each packed group block.
    const fn scale_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 4 * GROUP,
            Format::Q8_0 => 2 * GROUP,
        }
    }

    /// Row `r`'s 32 weights of a packed group block `g`, widened to f32 into `o`.
    fn widen_packed(self, g: &[u8], r: usize, o: &mut [f32]) {
        let half = |at: usize| f16::from_le_bytes([g[at], g[at + 1]]).to_f32();
        let (d, body) = (half(2 * r), self.scale_bytes());
        match self {
            Format::Q4_1 => {
                let min = half(2 * GROUP + 2 * r);
                for c in 0..GROUP {
                    for e in 0..2 {
                        let q = g[body + 16 * c + 2 * r + e];
                        o[2 * c + e] = (q & 15) as f32 * d + min;
                        o[16 + 2 * c + e] = (q >> 4) as f32 * d + min;
                    }
                }
            }
            Format::Q8_0 => {
                for j in 0..BLOCK / 2 {
                    for e in 0..2 {
                        o[2 * j + e] = g[body + 16 * j + 2 * r + e] as i8 as f32 * d;
                    }
                }
            }
        }
    }

    /// Writes GGUF block `src` as row `r` of packed group block `g` (the inverse of
    /// [`Format::widen_packed`]'s reading).
    fn pack_into(self, src: &[u8], g: &mut [u8], r: usize) {
        g[2 * r..2 * r + 2].copy_from_slice(&src[..2]);
        let body = self.scale_bytes();
        match self {
            Format::Q4_1 => {
                g[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2].copy_from_slice(&src[2..4]);
                // Nibble byte i holds weights i and 16 + i: bytes 2c, 2c + 1 go to chunk c.
                for c in 0..GROUP {
                    g[body + 16 * c + 2 * r..][..2].copy_from_slice(&src[4 + 2 * c..][..2]);
                }
            }
            Format::Q8_0 => {
                for j in 0..BLOCK / 2 {
                    g[body + 16 * j + 2 * r..][..2].copy_from_slice(&src[2 + 2 * j..][..2]);
                }
            }
        }
    }
}

/// Tokens multiplied per pass over a group in the few-token path.
pub const ROWS: usize = 4;
/// From this many tokens on, tiles are widened and multiplied by `gemm`.
pub const GEMM_FROM: usize = 16;
/// Groups per task (32 rows).
const TILE_GROUPS: usize = 4;

/// Why a product cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShapeError {
    #[error("block-quantized weights: k = {0} is not a positive multiple of 32")]
    /// An inner dimension that is not a whole, non-zero number of blocks.
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
    #[error("block-quantized matrices stack only in one format and width, each but the last a whole number of {GROUP}-row groups")]
    /// Matrices [`Packed::stack`] cannot join.
    Stack,
}

fn check(what: &'static str, expected: usize, got: usize) -> Result<(), ShapeError> {
    if expected == got {
        Ok(())
    } else {
        Err(ShapeError::Len { what, expected, got })
    }
}

/// A `[rows, cols]` matrix of GGUF blocks repacked for the products: rows in groups of
/// [`GROUP`] (the last padded with zero weights), each group's blocks one after another, and in
/// each group block the 8 rows' d (then Q4_1's 8 m) as f16, then the weights in chunks of 16
/// bytes, two weights of each row per chunk: Q4_1 chunk c holds nibble bytes 2c and 2c + 1 of
/// every row (weights 2c, 2c + 1 in the low nibbles, 16 + 2c, 17 + 2c in the high), Q8_0 chunk j
/// holds weights 2j and 2j + 1. The same bytes as the GGUF blocks, rearranged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packed {
    format: Format,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl Packed {
    /// Repacks `w`, `rows × cols/32` blocks of `format` row after row (a GGUF tensor's data).
    pub fn new(format: Format, w: &[u8], rows: usize, cols: usize) -> Result<Self, ShapeError> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(ShapeError::K(cols));
        }
        let (nb, bb) = (cols / BLOCK, format.block_bytes());
        check("weight bytes", rows * nb * bb, w.len())?;
        let mut data = vec![0u8; rows.div_ceil(GROUP) * GROUP * nb * bb];
        let gbb = GROUP * bb;
        for (g, group) in data.chunks_exact_mut(nb * gbb).enumerate() {
            for (b, gb) in group.chunks_exact_mut(gbb).enumerate() {
                for r in 0..GROUP.min(rows - g * GROUP) {
                    format.pack_into(&w[((g * GROUP + r) * nb + b) * bb..][..bb], gb, r);
                }
            }
        }
        Ok(Self { format, rows, cols, data })
    }

    /// The matrices' rows one after another: what one product over all of them multiplies (a
    /// layer's q, k and v). Same format and width, every part but the last whole groups.
    pub fn stack(parts: &[&Packed]) -> Result<Self, ShapeError> {
        let Some(first) = parts.first() else { return Err(ShapeError::Stack) };
        let joins = parts.iter().all(|p| p.format == first.format && p.cols == first.cols)
            && parts[..parts.len() - 1].iter().all(|p| p.rows.is_multiple_of(GROUP));
        if !joins {
            return Err(ShapeError::Stack);
        }
        let rows = parts.iter().map(|p| p.rows).sum::<usize>();
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Ok(Self { format: first.format, rows, cols: first.cols, data })
    }

    /// The block format.
    pub fn format(&self) -> Format {
        self.format
    }
    /// Rows (outputs per token).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns (inputs per token).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes held (what one pass over the weights reads), the padding rows included.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Bytes of one group block (8 rows × 32 columns).
    fn group_block(&self) -> usize {
        GROUP * self.format.block_bytes()
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`.
    pub fn matmul(&self, x: &[f32], n: usize, out: &mut [f32]) -> Result<(), ShapeError> {
        check("activations", n * self.cols, x.len())?;
        check("outputs", n * self.rows, out.len())?;
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        if n >= GEMM_FROM {
            self.widened_gemm(x, n, out);
        } else {
            self.few_tokens(x, n, out);
        }
        Ok(())
    }

    /// The first `live` rows of a tile of whole groups widened to f32 into `dst` (`live × cols`).
    fn widen_tile(&self, tile: &[u8], live: usize, dst: &mut [f32]) {
        let (k, gbb) = (self.cols, self.group_block());
        for (g, group) in tile.chunks_exact(k / BLOCK * gbb).enumerate() {
            for (b, gb) in group.chunks_exact(gbb).enumerate() {
                for r in 0..GROUP.min(live.saturating_sub(g * GROUP)) {
                    self.format.widen_packed(gb, r, &mut dst[(g * GROUP + r) * k + b * BLOCK..][..BLOCK]);
                }
            }
        }
    }

    fn widened_gemm(&self, x: &[f32], n: usize, out: &mut [f32]) {
        let (k, m) = (self.cols, self.rows);
        let out_ptr = SendPtr(out.as_mut_ptr());
        let tile_bytes = TILE_GROUPS * k / BLOCK * self.group_block();
        self.data.par_chunks(tile_bytes).enumerate().for_each(|(t, tile)| {
            let r0 = t * TILE_GROUPS * GROUP;
            let live = (m - r0).min(TILE_GROUPS * GROUP);
            let mut w = vec![0f32; live * k];
            self.widen_tile(tile, live, &mut w);
            let dst = out_ptr;
            // SAFETY: gemm writes out[i, r0 .. r0 + live] for i < n (row stride m, column stride
            // 1): inside `out` (n·m elements, checked by `matmul`) and disjoint between tasks,
            // which own disjoint row ranges of W. x is n × k (row stride k), the tile live × k
            // read transposed (row stride 1, column stride k).
            unsafe { gemm((n, live, k), dst.0.add(r0), m, false, x.as_ptr(), k, w.as_ptr(), (1, k)) };
        });
    }

    fn few_tokens(&self, x: &[f32], n: usize, out: &mut [f32]) {
        let (k, m) = (self.cols, self.rows);
        let (kernel, integers) = select(self.format);
        let tokens = Tokens::new(x, integers);
        let group_bytes = k / BLOCK * self.group_block();
        let out_ptr = SendPtr(out.as_mut_ptr());
        self.data.par_chunks(TILE_GROUPS * group_bytes).enumerate().for_each(|(t, tile)| {
            for (gi, g) in tile.chunks_exact(group_bytes).enumerate() {
                let r0 = (t * TILE_GROUPS + gi) * GROUP;
                let live = GROUP.min(m - r0);
                for i0 in (0..n).step_by(ROWS) {
                    let rows = ROWS.min(n - i0);
                    let mut acc = [[0f32; GROUP]; ROWS];
                    kernel(g, tokens.rows(i0, rows, k), k, &mut acc[..rows]);
                    for (i, a) in acc[..rows].iter().enumerate() {
                        let dst = out_ptr;
                        // SAFETY: out[(i0 + i)·m + r0 ..][..live] lies inside `out` (n·m elements,
                        // checked by `matmul`; r0 + live ≤ m) and belongs to this task's group
                        // alone.
                        unsafe { std::ptr::copy_nonoverlapping(a.as_ptr(), dst.0.add((i0 + i) * m + r0), live) };
                    }
                }
            }
        });
    }
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
    /// `x`'s sums, and its 16-bit integers when `integers` (the SIMD kernels read them).
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

/// One packed group (all its blocks) against up to [`ROWS`] tokens: `acc[i][r]` = token i's
/// product with the group's row r.
type GroupFn = fn(g: &[u8], t: TokenRows<'_>, k: usize, acc: &mut [[f32; GROUP]]);

/// The group kernel of `format` on this CPU (the first of [`kernels`]), and whether it reads the
/// 16-bit activations.
fn select(format: Format) -> (GroupFn, bool) {
    let (_, kernel, integers) = kernels(format)[0];
    (kernel, integers)
}

/// Every group kernel of `format` this CPU runs, fastest first: name, kernel, and whether it
/// reads the 16-bit activations. The SIMD ones give the same bits (exact integer sums, the same
/// f32 operations after).
fn kernels(format: Format) -> Vec<(&'static str, GroupFn, bool)> {
    let mut all: Vec<(&'static str, GroupFn, bool)> = Vec::with_capacity(3);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma") && has!("f16c");
        // SAFETY (each): the instruction sets its kernel enables were detected here.
        if avx2 && has!("avx512vnni") && has!("avx512vl") {
            all.push(match format {
                Format::Q4_1 => ("vnni", |g, t, k, a| unsafe { simd::vnni::group::<true>(g, t, k, a) }, true),
                Format::Q8_0 => ("vnni", |g, t, k, a| unsafe { simd::vnni::group::<false>(g, t, k, a) }, true),
            });
        }
        if avx2 {
            all.push(match format {
                Format::Q4_1 => ("avx2", |g, t, k, a| unsafe { simd::avx2::group::<true>(g, t, k, a) }, true),
                Format::Q8_0 => ("avx2", |g, t, k, a| unsafe { simd::avx2::group::<false>(g, t, k, a) }, true),
            });
        }
    }
    all.push(match format {
        Format::Q4_1 => ("portable", |g, t, k, a| portable(Format::Q4_1, g, t, k, a), false),
        Format::Q8_0 => ("portable", |g, t, k, a| portable(Format::Q8_0, g, t, k, a), false),
    });
    all
}

/// Each row's blocks widened one at a time, then multiplied in f32 (no SIMD).
fn portable(format: Format, g: &[u8], t: TokenRows<'_>, k: usize, acc: &mut [[f32; GROUP]]) {
    let gbb = GROUP * format.block_bytes();
    let mut widened = [0f32; BLOCK];
    acc.iter_mut().for_each(|a| *a = [0.0; GROUP]);
    for (b, gb) in g.chunks_exact(gbb).enumerate() {
        for r in 0..GROUP {
            format.widen_packed(gb, r, &mut widened);
            for (i, a) in acc.iter_mut().enumerate() {
                let xb = &t.x[i * k + b * BLOCK..][..BLOCK];
                a[r] += widened.iter().zip(xb).map(|(w, x)| w * x).sum::<f32>();
            }
        }
    }
}

/// The group kernels' body for one instruction set: `$dot(acc, a, b)` adds the pairwise
/// products of 16-bit lanes `a`·`b` into the 32-bit lanes of `acc` (`madd` then `add` on AVX2,
/// one `vpdpwssd` with AVX-512 VNNI: the same exact integer sums, so every variant gives the same
/// bits).
#[cfg(target_arch = "x86_64")]
macro_rules! group_kernels {
    ($features:literal, |$acc:ident, $a:ident, $b:ident| $dot:expr) => {
        use std::arch::x86_64::*;

        use super::super::{Format, TokenRows, BLOCK, GROUP};

        /// [`super::super::GroupFn`] for Q4_1 (`Q41`) or Q8_0, up to [`super::super::ROWS`] tokens.
        #[target_feature(enable = $features)]
        pub unsafe fn group<const Q41: bool>(g: &[u8], t: TokenRows<'_>, k: usize, acc: &mut [[f32; GROUP]]) {
            match acc.len() {
                1 => tokens::<Q41, 1>(g, t, k, acc),
                2 => tokens::<Q41, 2>(g, t, k, acc),
                3 => tokens::<Q41, 3>(g, t, k, acc),
                _ => tokens::<Q41, 4>(g, t, k, acc),
            }
        }

        /// Per block: each chunk of 16 weight bytes widened to 16-bit lanes (two weights of each
        /// of the 8 rows), multiplied pairwise with each token's pair of activations broadcast,
        /// so every row's sum stays in its own lane; the block's 32-bit sums are exact (Q4_1:
        /// |Σ| ≤ 32·15·32,767 < 2²⁴; Q8_0 fits 32 bits), converted once and scaled by the rows'
        /// d times the token's block scale; Q4_1 adds m·Σx from the exact sums.
        #[target_feature(enable = $features)]
        unsafe fn tokens<const Q41: bool, const R: usize>(
            g: &[u8],
            t: TokenRows<'_>,
            k: usize,
            acc: &mut [[f32; GROUP]],
        ) {
            let format = if Q41 { Format::Q4_1 } else { Format::Q8_0 };
            let (nb, gbb, body) = (k / BLOCK, GROUP * format.block_bytes(), format.scale_bytes());
            debug_assert!(acc.len() == R && t.q.len() >= R * k && t.scales.len() >= R * nb && g.len() >= nb * gbb);
            let mut total = [_mm256_setzero_ps(); R];
            let low = _mm_set1_epi8(15);
            for bi in 0..nb {
                // SAFETY: group block bi is g[bi·gbb ..][..gbb], inside `g` (checked above); token
                // i's block bi is q[i·k + bi·32 ..][..32], read as 16 pairs of i16.
                let b = g.as_ptr().add(bi * gbb);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(b as *const __m128i));
                let x: [*const i32; R] = std::array::from_fn(|i| t.q.as_ptr().add(i * k + bi * BLOCK) as *const i32);
                let mut sums = [_mm256_setzero_si256(); R];
                if Q41 {
                    for c in 0..GROUP {
                        let q = _mm_loadu_si128(b.add(body + 16 * c) as *const __m128i);
                        let lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, low));
                        let hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low));
                        for i in 0..R {
                            let xl = _mm256_set1_epi32(x[i].add(c).read_unaligned());
                            let xh = _mm256_set1_epi32(x[i].add(c + GROUP).read_unaligned());
                            let ($acc, $a, $b) = (sums[i], lo, xl);
                            let ($acc, $a, $b) = ($dot, hi, xh);
                            sums[i] = $dot;
                        }
                    }
                } else {
                    for j in 0..BLOCK / 2 {
                        let q = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(body + 16 * j) as *const __m128i));
                        for i in 0..R {
                            let ($acc, $a, $b) = (sums[i], q, _mm256_set1_epi32(x[i].add(j).read_unaligned()));
                            sums[i] = $dot;
                        }
                    }
                }
                let m = if Q41 { _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * GROUP) as *const __m128i)) } else { d };
                for i in 0..R {
                    let s = _mm256_mul_ps(d, _mm256_set1_ps(*t.scales.get_unchecked(i * nb + bi)));
                    total[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]), s, total[i]);
                    if Q41 {
                        total[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(*t.sums.get_unchecked(i * nb + bi)), total[i]);
                    }
                }
            }
            for i in 0..R {
                _mm256_storeu_ps(acc[i].as_mut_ptr(), total[i]);
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod simd {
    /// AVX2: `madd` then `add`.
    pub mod avx2 {
        group_kernels!("avx2,fma,f16c", |acc, a, b| _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)));
    }
    /// AVX-512 VNNI on 256-bit registers: `vpdpwssd` (Intel since Ice Lake, AMD since Zen 4).
    pub mod vnni {
        group_kernels!("avx2,fma,f16c,avx512vnni,avx512vl", |acc, a, b| _mm256_dpwssd_epi32(acc, a, b));
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

    /// A GGUF block's 32 weights as f64 `(d·q, m)` pairs (Q8_0: m = 0), read from the GGUF layout
    /// directly, independent of the packing.
    fn block_terms(format: Format, b: &[u8]) -> Vec<(f64, f64)> {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f64();
        match format {
            Format::Q4_1 => {
                let m = f16::from_le_bytes([b[2], b[3]]).to_f64();
                let q = b[4..].iter().map(|q| q & 15).chain(b[4..].iter().map(|q| q >> 4));
                q.map(|q| (d * q as f64, m)).collect()
            }
            Format::Q8_0 => b[2..].iter().map(|&q| (d * q as i8 as f64, 0.0)).collect(),
        }
    }

    /// Every weight's `(d·q, m)` terms, row after row.
    fn terms(format: Format, w: &[u8]) -> Vec<(f64, f64)> {
        w.chunks_exact(format.block_bytes()).flat_map(|b| block_terms(format, b)).collect()
    }

    /// f64 over the GGUF blocks: the reference every path must match.
    fn reference(x: &[f32], n: usize, k: usize, t: &[(f64, f64)], m: usize) -> Vec<f64> {
        let mut out = vec![0f64; n * m];
        for i in 0..n {
            for r in 0..m {
                out[i * m + r] = (0..k).map(|j| x[i * k + j] as f64 * (t[r * k + j].0 + t[r * k + j].1)).sum();
            }
        }
        out
    }

    /// Both paths and the portable kernel against the f64 reference over the GGUF blocks, on
    /// fresh random weights and activations, shapes with partial groups and tiles. The bound is
    /// the maths of f32 arithmetic, whatever the summation order (the `gemm` crate picks its
    /// kernel by the CPU at run time): a sum of k rounded products errs by at most γ_k·Σ|terms|
    /// (γ_k = kε/(1−kε), ε = 2⁻²⁴), where a Q4_1 term counts |d·q| and |m| apart (the kernel sums
    /// d·Σqx and m·Σx, which may cancel), and widening a weight to f32 adds 2ε of it; 2·(k + 4)·ε
    /// covers both. Fewer than `GEMM_FROM` tokens may also round each activation to 16 bits of its
    /// block's largest |x| (the SIMD kernels): at most half a step, |x|max / 32,767 / 2 (the 10⁻⁶
    /// covers the f32 rounding of the scale and of x / scale, a few ε), times |d·q| of its weight;
    /// the gemm path keeps f32 activations, and its bound leaves that term out.
    #[test]
    fn every_path_matches_the_reference_on_random_shapes() {
        let seed = crate::testing::fresh_seed();
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        for format in [Format::Q4_1, Format::Q8_0] {
            for &(n, k, m) in &[
                (1, 32, 1),
                (1, 576, 576),
                (2, 64, 45),
                (3, 64, 45),
                (4, 96, 33),
                (5, 96, 33),
                (15, 128, 70),
                (16, 576, 64),
                (37, 160, 97),
            ] {
                let w = weights(format, &mut rng, m, k);
                let t = terms(format, &w);
                let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                let want = reference(&x, n, k, &t, m);
                let packed = Packed::new(format, &w, m, k).unwrap();
                let mut out = vec![f32::NAN; n * m];
                packed.matmul(&x, n, &mut out).unwrap();
                let gamma = 2.0 * (k + 4) as f64 * f64::powi(2.0, -24);
                let rounded = n < GEMM_FROM;
                let step = |i: usize, j: usize| -> f64 {
                    let block = &x[i * k + j / BLOCK * BLOCK..][..BLOCK];
                    block.iter().fold(0f64, |a, v| a.max(v.abs() as f64)) / i16::MAX as f64 / 2.0 * (1.0 + 1e-6)
                };
                let bound_if = |rounded: bool, i: usize, r: usize| -> f64 {
                    (0..k)
                        .map(|j| {
                            let (dq, m) = t[r * k + j];
                            let f32_error = gamma * (dq.abs() + m.abs()) * (x[i * k + j] as f64).abs();
                            f32_error + if rounded { dq.abs() * step(i, j) } else { 0.0 }
                        })
                        .sum::<f64>()
                };
                let bound = |i: usize, r: usize| bound_if(rounded, i, r);
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
                // Every kernel this CPU runs, over every group and the first tokens: within the
                // bound, and the SIMD ones (16-bit activations) bit for bit the same.
                let nr = n.min(ROWS);
                let group_bytes = k / BLOCK * packed.group_block();
                let mut simd: Option<(&str, Vec<[f32; GROUP]>)> = None;
                for (name, kernel, integers) in kernels(format) {
                    let tokens = Tokens::new(&x, integers);
                    let mut got = Vec::new();
                    for (gi, g) in packed.data.chunks_exact(group_bytes).enumerate() {
                        let mut acc = [[f32::NAN; GROUP]; ROWS];
                        kernel(g, tokens.rows(0, nr, k), k, &mut acc[..nr]);
                        for (i, a) in acc[..nr].iter().enumerate() {
                            for (r, &p) in a.iter().enumerate().take(m - gi * GROUP) {
                                let (want, b) = (want[i * m + gi * GROUP + r], bound_if(integers, i, gi * GROUP + r));
                                assert!((p as f64 - want).abs() <= b, "{at}: {name} [{i}, {}]", gi * GROUP + r);
                            }
                        }
                        got.extend_from_slice(&acc[..nr]);
                    }
                    match (&simd, integers) {
                        (Some((first, bits)), true) => {
                            let same = bits
                                .iter()
                                .flatten()
                                .zip(got.iter().flatten())
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{at}: {name} and {first} differ");
                        }
                        (None, true) => simd = Some((name, got)),
                        (_, false) => {}
                    }
                }
            }
        }
    }

    /// Stacked matrices multiply as the GGUF rows one after another, and packing keeps every byte.
    #[test]
    fn stacking_is_packing_the_rows_together() {
        let seed = crate::testing::fresh_seed();
        let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
        for format in [Format::Q4_1, Format::Q8_0] {
            let k = 64;
            let (a, b, c) =
                (weights(format, &mut rng, 16, k), weights(format, &mut rng, 8, k), weights(format, &mut rng, 5, k));
            let pack = |w: &[u8], m| Packed::new(format, w, m, k).unwrap();
            let stacked = Packed::stack(&[&pack(&a, 16), &pack(&b, 8), &pack(&c, 5)]).unwrap();
            let rows = [a.as_slice(), &b, &c].concat();
            let whole = pack(&rows, 29);
            assert_eq!(stacked, whole, "seed {seed} {format:?}");
            let mut sorted = whole.data.clone();
            let mut bytes = rows;
            bytes.extend(std::iter::repeat_n(0, whole.data.len() - bytes.len()));
            sorted.sort_unstable();
            bytes.sort_unstable();
            assert_eq!(sorted, bytes, "seed {seed} {format:?}: packing lost or made up bytes");
            assert_eq!(Packed::stack(&[&pack(&c, 5), &pack(&b, 8)]), Err(ShapeError::Stack));
        }
    }

    #[test]
    fn shapes_are_checked() {
        let mut out = vec![0f32; 1];
        assert_eq!(Packed::new(Format::Q4_1, &[], 1, 33), Err(ShapeError::K(33)));
        assert_eq!(Packed::new(Format::Q4_1, &[], 1, 0), Err(ShapeError::K(0)));
        assert!(matches!(Packed::new(Format::Q4_1, &[0; 19], 1, 32), Err(ShapeError::Len { .. })));
        assert!(matches!(Packed::new(Format::Q8_0, &[0; 20], 1, 32), Err(ShapeError::Len { .. })));
        let p = Packed::new(Format::Q8_0, &[0; 34], 1, 32).unwrap();
        assert!(matches!(p.matmul(&[0.0; 31], 1, &mut out), Err(ShapeError::Len { what: "activations", .. })));
        assert!(matches!(p.matmul(&[0.0; 32], 1, &mut [0.0; 2]), Err(ShapeError::Len { what: "outputs", .. })));
    }
}
