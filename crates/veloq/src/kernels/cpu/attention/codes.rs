//! Attention over VecInfer codes without rebuilding keys or values in model space. The query moves
//! into code space once (q̃ = H(s ⊙ q)); values are summed in code space and rotated back once at
//! the end. Three forms, chosen by the number of queries that share the codes:
//! - [`attend`], one query (decode): a lookup table LUT[j][c] = q̃_j · C_j[c] (plus q·μ for the
//!   keys' centering) scores each position as Σ_j LUT[j][code_j]; values are summed per centroid
//!   (W[j][c] += p) and decoded once. Per position: 2 × subspaces table reads, no multiply.
//! - [`attend_group`], up to [`GROUP`] queries (a GQA group's heads at decode): the same with the
//!   queries' tables and sums interleaved, LUT[j][c] = [f32; GROUP], so a code is one read and one
//!   4-wide add for all of them (measured: `benches/attend_codes.rs`).
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
}

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
        Self { codec, books_t }
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

/// One sequence's coded positions: blocks of `block` tokens, each the packed codes of
/// `[block, heads, subspaces]` as the codec encodes them; `len` positions in all.
#[derive(Clone, Copy, Debug)]
pub struct CodeBlocks<'a> {
    /// Key code blocks.
    pub keys: &'a [Box<[u8]>],
    /// Value code blocks.
    pub values: &'a [Box<[u8]>],
    /// Positions per block.
    pub block: usize,
    /// Kv heads per position.
    pub heads: usize,
    /// Coded positions.
    pub len: usize,
}

/// Packed codes of one side (keys or values) of [`CodeBlocks`], `m` codes of `bits` per head vector.
struct Packed<'a> {
    blocks: &'a [Box<[u8]>],
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
    blocks: &[Box<[u8]>],
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
    s.w4.clear();
    s.w4.resize(mv * vk, [0.0; GROUP]);
    s.p4.resize(TILE, [0.0; GROUP]);
    s.p.resize(TILE, 0.0);
    let (kpacked, vpacked) = (
        Packed { blocks: codes.keys, block, heads, bits: kbits, m },
        Packed { blocks: codes.values, block, heads, bits: vbits, m: mv },
    );
    for t0 in (0..codes.len).step_by(TILE) {
        let t1 = (t0 + TILE).min(codes.len);
        let p4 = &mut s.p4[..t1 - t0];
        for (t, pv) in (t0..t1).zip(p4.iter_mut()) {
            let mut sum = [0.0f32; GROUP];
            let mut add = |l: &[f32; GROUP]| (0..GROUP).for_each(|i| sum[i] += l[i]);
            if kbits == 8 {
                let row = &codes.keys[t / block][((t % block) * heads + h) * m..][..m];
                row.iter().enumerate().for_each(|(j, &c)| add(&s.lut4[j * kk + c as usize]));
            } else {
                (0..m).for_each(|j| add(&s.lut4[j * kk + kpacked.get(t, h, j)]));
            }
            *pv = sum;
        }
        // Each query's online softmax over its lane; its lane of the sums is rescaled when its
        // maximum moves.
        for (i, st) in stats.iter_mut().enumerate() {
            let p = &mut s.p[..t1 - t0];
            p.iter_mut().zip(p4.iter()).for_each(|(x, pv)| *x = pv[i]);
            let f = st.fold_weights(p);
            if f != 1.0 {
                s.w4.iter_mut().for_each(|w| w[i] *= f);
            }
            p.iter().zip(p4.iter_mut()).for_each(|(x, pv)| pv[i] = *x);
        }
        for (t, pv) in (t0..t1).zip(p4.iter()) {
            let add = |w: &mut [f32; GROUP]| (0..GROUP).for_each(|i| w[i] += pv[i]);
            if vbits == 8 {
                let row = &codes.values[t / block][((t % block) * heads + h) * mv..][..mv];
                row.iter().enumerate().for_each(|(j, &c)| add(&mut s.w4[j * vk + c as usize]));
            } else {
                (0..mv).for_each(|j| add(&mut s.w4[j * vk + vpacked.get(t, h, j)]));
            }
        }
    }
    for (i, (st, out)) in stats.iter().zip(acc.chunks_exact_mut(d)).enumerate() {
        for j in 0..mv {
            let (bt, w) = (values.book_t(j), &s.w4[j * vk..(j + 1) * vk]);
            for e in 0..sdv {
                out[j * sdv + e] = w.iter().zip(&bt[e * vk..(e + 1) * vk]).map(|(w, c)| w[i] * c).sum();
            }
        }
        vc.transform().inverse_weighted(h, out, st.l);
    }
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
    /// and packed 6-bit codes, blocks of 8 and 16 tokens, and more positions than one tile.
    #[test]
    fn matches_attention_over_decoded_rows() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let (heads, d) = (2, 64);
        for (bits, sd, block, len) in [(8u32, 4usize, 8usize, 1000usize), (6, 2, 16, 80), (8, 8, 8, 40)] {
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
            let kb: Vec<Box<[u8]>> = kx.chunks(n).map(|c| kc.encode_vec(c).unwrap().into_boxed_slice()).collect();
            let vb: Vec<Box<[u8]>> = vx.chunks(n).map(|c| vc.encode_vec(c).unwrap().into_boxed_slice()).collect();
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
