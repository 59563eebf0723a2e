//! Attention over VecInfer codes without rebuilding keys or values in model space. The query moves
//! into code space once (q̃ = H(s ⊙ q)); values are summed in code space and rotated back once at
//! the end. Three forms, chosen by the number of queries that share the codes:
//! - [`attend`], one query (decode): a lookup table LUT[j][c] = q̃_j · C_j[c] (plus q·μ for the
//!   keys' centering) scores each position as Σ_j LUT[j][code_j]; values are summed per centroid
//!   (W[j][c] += p) and decoded once. Per position: 2 × subspaces table reads, no multiply.
//! - [`attend_group`], up to [`GROUP`] queries (a GQA group's heads at decode): the queries'
//!   tables interleaved, LUT[j][c] = [f32; GROUP], so a key code is one read and one 4-wide add for
//!   all of them; with 8-bit codes the values are summed straight from codebooks spread for the
//!   group (one 8-wide multiply-add per code), sub-spaces a few at a time so that what they read
//!   stays in L1 (measured: `benches/attend_codes.rs`).
//! - [`attend_many`], a block of queries (prefill chunks, follow-up turns): a tile of positions is
//!   decoded into code space (centroids copied, nothing rotated) in scratch and shared by all the
//!   queries as two matrix products. Measured on SmolLM2's 2k-token prefill (9 query heads, 16
//!   subspaces of 4): the tables cost 16k multiply-adds per query to build and their reads are
//!   gathers, while a decoded tile costs d copies per position once for the whole block.
//!
//! Positions are scored a tile at a time with an online softmax, so scratch does not grow with the
//! context.

use std::sync::Arc;

use crate::codec::pack;
use crate::codec::vecinfer::VecInferCodec;

use super::softmax::Softmax;
use super::{dot, Tile};

/// Positions scored per tile.
const TILE: usize = 512;

/// A VecInfer codec with its codebooks transposed to `[books][sub_dim][centroids]`, so that building
/// a lookup table and decoding per-centroid sums run along contiguous centroid rows.
#[derive(Debug)]
pub struct LutCodec {
    codec: Arc<VecInferCodec>,
    books_t: Vec<f32>,
    /// The books spread for summing values over a GQA group, built on first use (values only):
    /// centroid pairs as `[c₀ ×GROUP, c₁ ×GROUP]`, so a code is one 8-wide load and multiply-add.
    spread: std::sync::OnceLock<Vec<Unit>>,
}

/// Eight lanes: a spread centroid pair, or a group's weights twice.
type Unit = [f32; 2 * GROUP];

impl LutCodec {
    /// Transposes `codec`'s books.
    pub fn new(codec: Arc<VecInferCodec>) -> Self {
        let (k, sd) = (codec.shape().centroids(), codec.shape().sub_dim);
        let mut books_t = Vec::with_capacity(codec.books().books().len() * k * sd);
        for b in codec.books().books() {
            for d in 0..sd {
                books_t.extend((0..k).map(|c| b.centroid(c)[d]));
            }
        }
        Self { codec, books_t, spread: std::sync::OnceLock::new() }
    }

    /// [`Self::spread`]'s books: `[subspace][centroid][sub_dim / 2]` units.
    fn spread_books(&self) -> &[Unit] {
        self.spread.get_or_init(|| {
            let (k, sd, m) = (self.codec.shape().centroids(), self.codec.shape().sub_dim, self.codec.subspaces());
            let mut out = Vec::with_capacity(m * k * sd / 2);
            for j in 0..m {
                let book = self.codec.books().book(j);
                for c in 0..k {
                    for pair in book.centroid(c).chunks_exact(2) {
                        out.push(std::array::from_fn(|l| pair[l / GROUP]));
                    }
                }
            }
            out
        })
    }

    /// The codec itself.
    pub fn codec(&self) -> &Arc<VecInferCodec> {
        &self.codec
    }

    /// The transposed codebook sub-space `j` uses.
    #[inline]
    fn book_t(&self, j: usize) -> &[f32] {
        let size = self.codec.shape().centroids() * self.codec.shape().sub_dim;
        let b = self.codec.books().book_index(j);
        &self.books_t[b * size..(b + 1) * size]
    }

    /// Bytes of the transposed books (held beside the codec's own tables).
    pub fn resident_bytes(&self) -> usize {
        self.books_t.len() * 4
    }
}

/// One block of packed codes. Blocks are immutable once written, so sequences that share a
/// prefix (forks) share its blocks instead of copying them.
pub type CodeBlock = Arc<[u8]>;

/// One sequence's coded positions: blocks of `block` tokens, each the packed codes of
/// `[block, heads, subspaces]` as the codec encodes them; `len` positions in all.
#[derive(Clone, Copy, Debug)]
pub struct CodeBlocks<'a> {
    /// Key code blocks.
    pub keys: &'a [CodeBlock],
    /// Value code blocks.
    pub values: &'a [CodeBlock],
    /// Positions per block.
    pub block: usize,
    /// Kv heads per position.
    pub heads: usize,
    /// Coded positions.
    pub len: usize,
}

/// Packed codes of one side (keys or values) of [`CodeBlocks`], `m` codes of `bits` per head vector.
struct Packed<'a> {
    blocks: &'a [CodeBlock],
    block: usize,
    heads: usize,
    bits: u32,
    m: usize,
}

impl Packed<'_> {
    /// Code `j` of head `h` at position `t`.
    #[inline]
    fn get(&self, t: usize, h: usize, j: usize) -> usize {
        let idx = ((t % self.block) * self.heads + h) * self.m + j;
        pack::get(&self.blocks[t / self.block], self.bits, idx) as usize
    }
}

/// Queries [`attend_group`] takes in one pass (its table entries are `[f32; GROUP]`).
pub const GROUP: usize = 4;

/// Caller-owned scratch of [`attend`], [`attend_group`] and [`attend_many`].
#[derive(Default)]
pub struct CodesScratch {
    qt: Vec<f32>,
    lut: Vec<f32>,
    lut4: Vec<[f32; GROUP]>,
    w4: Vec<[f32; GROUP]>,
    p4: Vec<[f32; GROUP]>,
    p: Vec<f32>,
    w: Vec<f32>,
    k_codes: Vec<u8>,
    v_codes: Vec<u8>,
    rot: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Positions per decoded tile of [`attend_many`].
const MANY_TILE: usize = 64;

/// Copies the centroids of head `h`'s codes at positions `t0..t1` into `out` (`(t1−t0) × d`, code
/// space).
fn decode_tile(
    codec: &LutCodec,
    blocks: &[CodeBlock],
    codes: &CodeBlocks,
    h: usize,
    t0: usize,
    t1: usize,
    out: &mut [f32],
) {
    let c = &*codec.codec;
    let (m, sd, bits) = (c.subspaces(), c.shape().sub_dim, c.shape().bits);
    let packed = Packed { blocks, block: codes.block, heads: codes.heads, bits, m };
    let d = m * sd;
    for (t, row) in (t0..t1).zip(out.chunks_exact_mut(d)) {
        if bits == 8 {
            // One byte per code: the position's codes for head h are one contiguous row.
            let codes = &blocks[t / codes.block][((t % codes.block) * codes.heads + h) * m..][..m];
            for ((j, dst), &k) in row.chunks_exact_mut(sd).enumerate().zip(codes) {
                dst.copy_from_slice(c.books().book(j).centroid(k as usize));
            }
        } else {
            for (j, dst) in row.chunks_exact_mut(sd).enumerate() {
                dst.copy_from_slice(c.books().book(j).centroid(packed.get(t, h, j)));
            }
        }
    }
}

/// [`attend`] for a block of queries `qs` (`t × head_dim`, scaled, one query head over kv head
/// `h`): each query's softmax partial in `stats` (which must start empty) and its weighted value
/// sum in `acc` (`t × head_dim`, value space), tiles of positions decoded into scratch and shared
/// by the queries as matrix products.
#[allow(clippy::too_many_arguments)]
pub fn attend_many(
    keys: &LutCodec,
    values: &LutCodec,
    codes: &CodeBlocks,
    h: usize,
    qs: &[f32],
    stats: &mut [Softmax],
    acc: &mut [f32],
    s: &mut CodesScratch,
) {
    let (kc, vc) = (&*keys.codec, &*values.codec);
    let d = kc.head_dim();
    let t = stats.len();
    acc.fill(0.0);
    stats.fill(Softmax::EMPTY);
    if codes.len == 0 || t == 0 {
        return;
    }
    s.qt.resize(t * d, 0.0);
    s.rot.resize(t, 0.0);
    for i in 0..t {
        let q = &qs[i * d..(i + 1) * d];
        kc.transform_query(h, q, &mut s.qt[i * d..(i + 1) * d]);
        s.rot[i] = kc.transform().query_offset(h, q);
    }
    s.k.resize(MANY_TILE * d, 0.0);
    s.v.resize(MANY_TILE * d, 0.0);
    s.p.resize(t * MANY_TILE, 0.0);
    for t0 in (0..codes.len).step_by(MANY_TILE) {
        let t1 = (t0 + MANY_TILE).min(codes.len);
        let n = t1 - t0;
        decode_tile(keys, codes.keys, codes, h, t0, t1, &mut s.k[..n * d]);
        decode_tile(values, codes.values, codes, h, t0, t1, &mut s.v[..n * d]);
        let offsets = &s.rot;
        let tile = Tile { k: &s.k, v: &s.v, n, d };
        tile.fold_into(&s.qt, stats, acc, &mut s.p, &mut |i, row| {
            row.iter_mut().for_each(|x| *x += offsets[i]);
            true
        });
    }
    for (i, st) in stats.iter().enumerate() {
        vc.transform().inverse_weighted(h, &mut acc[i * d..(i + 1) * d], st.l);
    }
}

/// [`attend`] for up to [`GROUP`] queries `qs` (`t × head_dim`, scaled) over kv head `h` in one
/// pass over the codes: each query's softmax partial in `stats` (`t` of them, reset here) and its
/// weighted value sum in `acc` (`t × head_dim`, value space), as [`attend_many`] returns them.
///
/// With 8-bit codes (the defaults) a tile's codes are copied into a dense `positions × subspaces`
/// block first, so both sides walk it a few sub-spaces at a time: the keys read [`KEY_COLUMNS`]
/// tables (4 KiB each) that stay in L1 while the whole tile passes, and the values sum
/// `p · centroid` in registers straight from the sub-space's codebook — no table of per-centroid
/// sums to read and write back per code. Packed codes (and, for the values, head dims that are not
/// a multiple of 16) keep the per-centroid tables.
#[allow(clippy::too_many_arguments)]
pub fn attend_group(
    keys: &LutCodec,
    values: &LutCodec,
    codes: &CodeBlocks,
    h: usize,
    qs: &[f32],
    stats: &mut [Softmax],
    acc: &mut [f32],
    s: &mut CodesScratch,
) {
    let (kc, vc) = (&*keys.codec, &*values.codec);
    let d = kc.head_dim();
    let t = stats.len();
    assert!(t <= GROUP && qs.len() == t * d && acc.len() == t * d, "attend_group takes at most {GROUP} queries");
    acc.fill(0.0);
    stats.fill(Softmax::EMPTY);
    if codes.len == 0 || t == 0 {
        return;
    }
    let (m, sd, kk, kbits) = (kc.subspaces(), kc.shape().sub_dim, kc.shape().centroids(), kc.shape().bits);
    let (mv, sdv, vk, vbits) = (vc.subspaces(), vc.shape().sub_dim, vc.shape().centroids(), vc.shape().bits);
    let (block, heads) = (codes.block, codes.heads);
    s.qt.resize(t * d, 0.0);
    for i in 0..t {
        kc.transform_query(h, &qs[i * d..(i + 1) * d], &mut s.qt[i * d..(i + 1) * d]);
    }
    // The queries' tables interleaved; lanes past `t` stay zero (they score 0 and weigh nothing
    // that is read back).
    s.lut4.clear();
    s.lut4.resize(m * kk, [0.0; GROUP]);
    for (j, row) in s.lut4.chunks_exact_mut(kk).enumerate() {
        let bt = keys.book_t(j);
        for e in 0..sd {
            let mut qd = [0.0f32; GROUP];
            for (i, x) in qd.iter_mut().enumerate().take(t) {
                *x = s.qt[i * d + j * sd + e];
            }
            for (l, &c) in row.iter_mut().zip(&bt[e * kk..(e + 1) * kk]) {
                for i in 0..GROUP {
                    l[i] += c * qd[i];
                }
            }
        }
    }
    for i in 0..t {
        let offset = kc.transform().query_offset(h, &qs[i * d..(i + 1) * d]);
        s.lut4[..kk].iter_mut().for_each(|l| l[i] += offset);
    }
    // Values: the code-space output itself, summed from spread books (8-bit codes, head dims that
    // split into whole passes of sub-spaces), else weighted sums per centroid, decoded at the end.
    let direct = vbits == 8 && d.is_multiple_of(2 * VALUE_UNITS);
    s.w4.clear();
    s.w4.resize(if direct { mv * sdv } else { mv * vk }, [0.0; GROUP]);
    s.p4.resize(TILE, [0.0; GROUP]);
    s.p.resize(TILE, 0.0);
    let (kpacked, vpacked) = (
        Packed { blocks: codes.keys, block, heads, bits: kbits, m },
        Packed { blocks: codes.values, block, heads, bits: vbits, m: mv },
    );
    for t0 in (0..codes.len).step_by(TILE) {
        let t1 = (t0 + TILE).min(codes.len);
        let n = t1 - t0;
        let p4 = &mut s.p4[..n];
        if kbits == 8 {
            gather_rows(codes.keys, block, heads, h, m, t0, t1, &mut s.k_codes);
            score_columns(s.lut4.as_chunks::<BYTE>().0, &s.k_codes, m, p4);
        } else {
            for (t, pv) in (t0..t1).zip(p4.iter_mut()) {
                let mut sum = [0.0f32; GROUP];
                for j in 0..m {
                    add_lanes(&mut sum, &s.lut4[j * kk + kpacked.get(t, h, j)]);
                }
                *pv = sum;
            }
        }
        // Each query's online softmax over its lane; its lane of the sums is rescaled when its
        // maximum moves.
        for (i, st) in stats.iter_mut().enumerate() {
            let p = &mut s.p[..n];
            p.iter_mut().zip(p4.iter()).for_each(|(x, pv)| *x = pv[i]);
            let f = st.fold_weights(p);
            if f != 1.0 {
                s.w4.iter_mut().for_each(|w| w[i] *= f);
            }
            p.iter().zip(p4.iter_mut()).for_each(|(x, pv)| pv[i] = *x);
        }
        if direct {
            gather_rows(codes.values, block, heads, h, mv, t0, t1, &mut s.v_codes);
            let (spread, out) = (values.spread_books(), s.w4.as_chunks_mut::<2>().0);
            match sdv {
                2 => sum_spread::<1, VALUE_UNITS>(spread, &s.v_codes, mv, p4, out),
                4 => sum_spread::<2, { VALUE_UNITS / 2 }>(spread, &s.v_codes, mv, p4, out),
                _ => sum_spread::<4, { VALUE_UNITS / 4 }>(spread, &s.v_codes, mv, p4, out),
            }
        } else {
            for (t, pv) in (t0..t1).zip(p4.iter()) {
                for j in 0..mv {
                    add_lanes(&mut s.w4[j * vk + vpacked.get(t, h, j)], pv);
                }
            }
        }
    }
    if direct {
        for (e, w) in s.w4.iter().enumerate() {
            for (i, out) in acc.chunks_exact_mut(d).enumerate() {
                out[e] = w[i];
            }
        }
    } else {
        // Decode the sums: out[j·sdv + e] = Σ_c W[j][c] · C_j[c][e], all queries' lanes at once.
        for j in 0..mv {
            let (bt, w) = (values.book_t(j), &s.w4[j * vk..(j + 1) * vk]);
            for e in 0..sdv {
                let sum = weighted_lanes(w, &bt[e * vk..(e + 1) * vk]);
                for (i, out) in acc.chunks_exact_mut(d).enumerate() {
                    out[j * sdv + e] = sum[i];
                }
            }
        }
    }
    for (st, out) in stats.iter().zip(acc.chunks_exact_mut(d)) {
        vc.transform().inverse_weighted(h, out, st.l);
    }
}

/// Centroids of a book with 8-bit codes: a code indexes its table with no bounds check.
const BYTE: usize = 256;

/// Key tables [`score_columns`] reads per pass over a tile: 8 × 4 KiB stay in L1 beside the tile's
/// codes ([`add_entries`] sums exactly this many).
const KEY_COLUMNS: usize = 8;

/// `sum += x`, lane by lane.
#[inline(always)]
fn add_lanes(sum: &mut [f32; GROUP], x: &[f32; GROUP]) {
    for i in 0..GROUP {
        sum[i] += x[i];
    }
}

/// Copies the 8-bit code rows of head `h` (`m` codes each) at positions `t0..t1` into `out`
/// (`(t1 − t0) × m`, dense).
#[allow(clippy::too_many_arguments)]
fn gather_rows(
    blocks: &[CodeBlock],
    block: usize,
    heads: usize,
    h: usize,
    m: usize,
    t0: usize,
    t1: usize,
    out: &mut Vec<u8>,
) {
    out.resize((t1 - t0) * m, 0);
    let stride = heads * m;
    let mut dst = out.chunks_exact_mut(m);
    for (b, codes) in blocks.iter().enumerate().take(t1.div_ceil(block)).skip(t0 / block) {
        // Blocks are separate allocations, too short for the hardware prefetcher to follow: ask
        // for the one after next while this one is copied.
        if let Some(ahead) = blocks.get(b + PREFETCH_BLOCKS) {
            prefetch(ahead);
        }
        let (s, e) = (t0.max(b * block) - b * block, t1.min((b + 1) * block) - b * block);
        for (r, o) in codes[s * stride..e * stride].chunks_exact(stride).zip(&mut dst) {
            let r = &r[h * m..(h + 1) * m];
            if m.is_multiple_of(8) {
                // Word moves inline: a `memcpy` call per row of 8–32 bytes costs more than the row.
                o.chunks_exact_mut(8).zip(r.chunks_exact(8)).for_each(|(o, r)| o.copy_from_slice(r));
            } else {
                o.copy_from_slice(r);
            }
        }
    }
}

/// Code blocks [`gather_rows`] prefetches ahead of the one it copies.
const PREFETCH_BLOCKS: usize = 2;

/// Asks for `bytes`' cache lines ahead of use (a no-op off x86-64).
#[inline(always)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch is a hint; it reads nothing and the address lies in `bytes`.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast()) };
    }
}

/// `p4[t] = Σ_j tables[j][codes[t][j]]` over a tile of dense code rows (`m` per position),
/// [`KEY_COLUMNS`] tables at a time.
fn score_columns(tables: &[[[f32; GROUP]; BYTE]], codes: &[u8], m: usize, p4: &mut [[f32; GROUP]]) {
    p4.fill([0.0; GROUP]);
    let whole = m / KEY_COLUMNS * KEY_COLUMNS;
    for j0 in (0..whole).step_by(KEY_COLUMNS) {
        let tabs: &[[[f32; GROUP]; BYTE]; KEY_COLUMNS] = tables[j0..j0 + KEY_COLUMNS].try_into().expect("columns");
        for (row, pv) in codes.chunks_exact(m).zip(p4.iter_mut()) {
            let row: &[u8; KEY_COLUMNS] = row[j0..j0 + KEY_COLUMNS].try_into().expect("columns");
            add_entries(tabs, row, pv);
        }
    }
    for (j, tab) in tables.iter().enumerate().skip(whole) {
        for (row, pv) in codes.chunks_exact(m).zip(p4.iter_mut()) {
            add_lanes(pv, &tab[row[j] as usize]);
        }
    }
}

// The SSE path of `add_entries` holds a group's lanes in one __m128, and sums 8 columns.
const _: () = assert!(GROUP == 4 && KEY_COLUMNS == 8);

/// `pv += Σ_u tabs[u][row[u]]`, summed as a tree so that the adds' latency overlaps. Explicit
/// SSE (part of x86-64) on x86: left to itself the compiler vectorises the caller's loop across
/// positions instead, assembling each vector from scattered lanes.
#[inline(always)]
fn add_entries(tabs: &[[[f32; GROUP]; BYTE]; KEY_COLUMNS], row: &[u8; KEY_COLUMNS], pv: &mut [f32; GROUP]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_add_ps, _mm_loadu_ps, _mm_storeu_ps};
        // SAFETY: every load reads one whole `[f32; GROUP]` entry (GROUP = 4 lanes of an __m128)
        // and the store writes `pv`; SSE is part of x86-64.
        unsafe {
            let e = |u: usize| _mm_loadu_ps(tabs[u][row[u] as usize].as_ptr());
            let s01 = _mm_add_ps(e(0), e(1));
            let s23 = _mm_add_ps(e(2), e(3));
            let s45 = _mm_add_ps(e(4), e(5));
            let s67 = _mm_add_ps(e(6), e(7));
            let sum = _mm_add_ps(_mm_add_ps(s01, s23), _mm_add_ps(s45, s67));
            _mm_storeu_ps(pv.as_mut_ptr(), _mm_add_ps(_mm_loadu_ps(pv.as_ptr()), sum));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (tab, &c) in tabs.iter().zip(row) {
        add_lanes(pv, &tab[c as usize]);
    }
}

/// Accumulators (8 lanes each) [`sum_spread`] keeps in registers.
const VALUE_UNITS: usize = 8;

/// `out[j·sd/2 + k] += Σ_t [p4[t], p4[t]] · spread[j][codes[t][j]][k]` over a tile: `COLS`
/// sub-spaces at a time (their spread books, `COLS·UNITS` KiB × 8, stay in L1), positions inner,
/// `UNITS = sub_dim / 2` spread pairs per centroid, every accumulator in a register.
fn sum_spread<const UNITS: usize, const COLS: usize>(
    spread: &[Unit],
    codes: &[u8],
    m: usize,
    p4: &[[f32; GROUP]],
    out: &mut [[[f32; GROUP]; 2]],
) {
    let books = spread.as_chunks::<UNITS>().0;
    for j0 in (0..m).step_by(COLS) {
        let cols: [&[[Unit; UNITS]; BYTE]; COLS] =
            std::array::from_fn(|u| books[(j0 + u) * BYTE..][..BYTE].try_into().expect("8-bit codebook"));
        let mut acc = [[[0.0f32; 2 * GROUP]; UNITS]; COLS];
        for (row, p) in codes.chunks_exact(m).zip(p4) {
            let pp: Unit = std::array::from_fn(|l| p[l % GROUP]);
            let row: &[u8; COLS] = row[j0..j0 + COLS].try_into().expect("COLS codes");
            for u in 0..COLS {
                let x = &cols[u][row[u] as usize];
                for k in 0..UNITS {
                    for l in 0..2 * GROUP {
                        acc[u][k][l] = pp[l].mul_add(x[k][l], acc[u][k][l]);
                    }
                }
            }
        }
        for u in 0..COLS {
            for k in 0..UNITS {
                let o = &mut out[(j0 + u) * UNITS + k];
                for l in 0..2 * GROUP {
                    o[l / GROUP][l % GROUP] += acc[u][k][l];
                }
            }
        }
    }
}

/// Σ_c w[c] · x[c], lane by lane, in four independent sums.
#[inline]
fn weighted_lanes(w: &[[f32; GROUP]], x: &[f32]) -> [f32; GROUP] {
    let mut acc = [[0.0f32; GROUP]; 4];
    let (wc, xc) = (w.chunks_exact(4), x.chunks_exact(4));
    for (w, x) in wc.remainder().iter().zip(xc.remainder()) {
        (0..GROUP).for_each(|i| acc[0][i] += w[i] * x);
    }
    for (w, x) in wc.zip(xc) {
        for u in 0..4 {
            (0..GROUP).for_each(|i| acc[u][i] += w[u][i] * x[u]);
        }
    }
    let [a, b, c, d] = acc;
    std::array::from_fn(|i| (a[i] + b[i]) + (c[i] + d[i]))
}

/// Attention of query `q` (one query head over kv head `h`, scaled) over every coded position of
/// `codes`: the softmax partial, with the weighted value sum written to `out` (head_dim, value
/// space: rotated back, scaled, plus the mean times the weight). Codes need no mask: they are
/// older than every query.
pub fn attend(
    keys: &LutCodec,
    values: &LutCodec,
    codes: &CodeBlocks,
    h: usize,
    q: &[f32],
    out: &mut [f32],
    s: &mut CodesScratch,
) -> Softmax {
    out.fill(0.0);
    let mut stat = Softmax::EMPTY;
    if codes.len == 0 {
        return stat;
    }
    let (kc, vc) = (&*keys.codec, &*values.codec);
    let d = kc.head_dim();
    let (m, sd, kk, kbits) = (kc.subspaces(), kc.shape().sub_dim, kc.shape().centroids(), kc.shape().bits);
    let (mv, sdv, vk, vbits) = (vc.subspaces(), vc.shape().sub_dim, vc.shape().centroids(), vc.shape().bits);
    let (block, heads) = (codes.block, codes.heads);
    s.qt.resize(d, 0.0);
    s.lut.clear();
    s.lut.resize(m * kk, 0.0);
    s.p.resize(TILE, 0.0);
    s.w.clear();
    s.w.resize(mv * vk, 0.0);
    s.rot.resize(d, 0.0);
    kc.transform_query(h, q, &mut s.qt);
    for (j, row) in s.lut.chunks_exact_mut(kk).enumerate() {
        let bt = keys.book_t(j);
        for e in 0..sd {
            let qd = s.qt[j * sd + e];
            row.iter_mut().zip(&bt[e * kk..(e + 1) * kk]).for_each(|(l, c)| *l += c * qd);
        }
    }
    // Centering: q·k = q·μ + q̃·x̂, the same offset for every coded position.
    let offset = kc.transform().query_offset(h, q);
    s.lut[..kk].iter_mut().for_each(|l| *l += offset);
    for t0 in (0..codes.len).step_by(TILE) {
        let t1 = (t0 + TILE).min(codes.len);
        let p = &mut s.p[..t1 - t0];
        if kbits == 8 {
            // One byte per code: a position's codes for head h are one contiguous row.
            for (t, pv) in (t0..t1).zip(p.iter_mut()) {
                let row = &codes.keys[t / block][((t % block) * heads + h) * m..][..m];
                *pv = row.iter().enumerate().map(|(j, &c)| s.lut[j * kk + c as usize]).sum();
            }
        } else {
            let packed = Packed { blocks: codes.keys, block, heads, bits: kbits, m };
            for (t, pv) in (t0..t1).zip(p.iter_mut()) {
                *pv = (0..m).map(|j| s.lut[j * kk + packed.get(t, h, j)]).sum();
            }
        }
        stat.fold(p, &mut s.w);
        if vbits == 8 {
            for (t, &pv) in (t0..t1).zip(p.iter()) {
                let row = &codes.values[t / block][((t % block) * heads + h) * mv..][..mv];
                for (j, &c) in row.iter().enumerate() {
                    s.w[j * vk + c as usize] += pv;
                }
            }
        } else {
            let packed = Packed { blocks: codes.values, block, heads, bits: vbits, m: mv };
            for (t, &pv) in (t0..t1).zip(p.iter()) {
                for j in 0..mv {
                    s.w[j * vk + packed.get(t, h, j)] += pv;
                }
            }
        }
    }
    for j in 0..mv {
        let bt = values.book_t(j);
        for e in 0..sdv {
            s.rot[j * sdv + e] = dot(&s.w[j * vk..(j + 1) * vk], &bt[e * vk..(e + 1) * vk]);
        }
    }
    vc.transform().inverse_weighted(h, &mut s.rot, stat.l);
    out.copy_from_slice(&s.rot);
    stat
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibrate::{train_codec, KMeansConfig};
    use crate::codec::codebook::PqShape;
    use crate::codec::vecinfer::CodecSpec;
    use crate::testing::{fresh_seed, normal, outlier_rows, rng};

    /// The lookup-table partial equals an f64 softmax over the decoded keys and values, for 8-bit
    /// codes of every sub_dim and packed 6-bit codes, blocks of 8 and 16 tokens, and more
    /// positions than one tile.
    #[test]
    fn matches_attention_over_decoded_rows() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let heads = 2;
        // Head dim 80 (sub_dim 8: 10 sub-spaces) leaves the keys a partial pass of tables; 72 sends
        // 8-bit values through the per-centroid sums.
        for (bits, sd, block, len, d) in [
            (8u32, 4usize, 8usize, 1000usize, 64usize),
            (8, 2, 8, 696, 64),
            (6, 2, 16, 80, 64),
            (8, 8, 8, 40, 64),
            (8, 8, 8, 40, 80),
            (8, 8, 8, 40, 72),
        ] {
            let shape = PqShape::new(sd, bits).unwrap();
            let train = outlier_rows(&mut r, 400 * heads, d);
            let kc = Arc::new(
                train_codec(&train, heads, d, &CodecSpec::keys(shape), &KMeansConfig::new(1 << bits, 1)).unwrap().0,
            );
            let vc = Arc::new(
                train_codec(&train, heads, d, &CodecSpec::values(shape), &KMeansConfig::new(1 << bits, 2)).unwrap().0,
            );
            let (kx, vx) = (outlier_rows(&mut r, len * heads, d), normal(&mut r, len * heads * d, 1.0));
            let n = heads * d * block;
            let kb: Vec<CodeBlock> = kx.chunks(n).map(|c| kc.encode_vec(c).unwrap().into()).collect();
            let vb: Vec<CodeBlock> = vx.chunks(n).map(|c| vc.encode_vec(c).unwrap().into()).collect();
            let (mut kd, mut vd) = (vec![0.0f32; kx.len()], vec![0.0f32; vx.len()]);
            for (i, (a, b)) in kb.iter().zip(&vb).enumerate() {
                kc.decode(a, &mut kd[i * n..(i + 1) * n]).unwrap();
                vc.decode(b, &mut vd[i * n..(i + 1) * n]).unwrap();
            }
            let codes = CodeBlocks { keys: &kb, values: &vb, block, heads, len };
            let (kl, vl) = (LutCodec::new(kc.clone()), LutCodec::new(vc.clone()));
            let mut scratch = CodesScratch::default();
            for h in 0..heads {
                // Five queries: each through its lookup tables, all five as one block, and in groups.
                let qs = normal(&mut r, 5 * d, 0.2);
                let mut many = vec![0.0f32; qs.len()];
                let mut many_stats = vec![Softmax::EMPTY; 5];
                attend_many(&kl, &vl, &codes, h, &qs, &mut many_stats, &mut many, &mut scratch);
                // The first four as one group, the fifth as a group of one.
                let mut group = vec![0.0f32; qs.len()];
                let mut group_stats = [Softmax::EMPTY; 5];
                for (i0, i1) in [(0, GROUP), (GROUP, 5)] {
                    let (qg, og) = (&qs[i0 * d..i1 * d], &mut group[i0 * d..i1 * d]);
                    attend_group(&kl, &vl, &codes, h, qg, &mut group_stats[i0..i1], og, &mut scratch);
                }
                for i in 0..5 {
                    let q = &qs[i * d..(i + 1) * d];
                    let mut out = vec![0.0f32; d];
                    let stat = attend(&kl, &vl, &codes, h, q, &mut out, &mut scratch);
                    stat.finish(&mut out);
                    many_stats[i].finish(&mut many[i * d..(i + 1) * d]);
                    group_stats[i].finish(&mut group[i * d..(i + 1) * d]);
                    let score =
                        |t: usize| (0..d).map(|e| q[e] as f64 * kd[(t * heads + h) * d + e] as f64).sum::<f64>();
                    let mx = (0..len).map(score).fold(f64::NEG_INFINITY, f64::max);
                    let total: f64 = (0..len).map(|t| (score(t) - mx).exp()).sum();
                    for (what, st, o) in [
                        ("table", stat, &out[..]),
                        ("block", many_stats[i], &many[i * d..(i + 1) * d]),
                        ("group", group_stats[i], &group[i * d..(i + 1) * d]),
                    ] {
                        let l = st.l as f64 * (st.m as f64 - mx).exp();
                        assert!((l - total).abs() <= 1e-3 * total, "seed {seed} {what}: weight {l} vs {total}");
                        let (mut err, mut norm) = (0.0f64, 0.0f64);
                        for e in 0..d {
                            let want = (0..len)
                                .map(|t| (score(t) - mx).exp() * vd[(t * heads + h) * d + e] as f64)
                                .sum::<f64>()
                                / total;
                            err += (o[e] as f64 - want).powi(2);
                            norm += want * want;
                        }
                        assert!(
                            err.sqrt() <= 1e-4 * norm.sqrt().max(1e-3),
                            "seed {seed} bits {bits} head {h} {what}: rel err {}",
                            (err / norm).sqrt()
                        );
                    }
                }
            }
        }
    }
}
