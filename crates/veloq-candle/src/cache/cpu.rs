//! The CPU backend: f16 rows and codes in host memory, attention by veloq's CPU kernels
//! (`veloq::kernels::cpu::attention`). VecInfer codes are scored through lookup tables and their
//! values summed from the codebooks in code space (no key or value is rebuilt); other codecs
//! (KIVI, Lloyd–Max) are decoded a block at a time into scratch. Work runs in parallel over (sequence, query head,
//! tile of queries), one pass over codes and rows each.
//!
//! Tensors on other devices work too (the step's keys, values and queries are copied to the host
//! and the output back): the scalar baselines run this way everywhere.

use std::collections::HashSet;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;

use veloq::codec::block::BlockCodec;
use veloq::codec::vecinfer::VecInferCodec;
use veloq::kernels::cpu::attention::{
    codes, rows, CodeBlock, CodeBlocks, CodesScratch, LutCodec, RowsScratch, Segment, Softmax,
};

use super::backend::{Backend, Heads};
use super::residency::{Footprint, Put, Quantize, Restore, RowSource, SeqView};
use crate::error::{Error, Result};

/// Rows per allocation: a dense cache grows 256 positions at a time.
const ROW_BLOCK: usize = 256;
/// Queries per task (each with every query head of its kv group).
const QUERY_TILE: usize = 16;
/// A task's queries over codes: one through its own lookup tables, up to this many in groups of
/// interleaved tables ([`codes::attend_group`]), more through decoded tiles and matrix products
/// (the crossover `benches/attend_codes.rs` measures: interleaved tables win up to about 8
/// queries, where building a table per query still costs less than decoding tiles; figures in
/// `results/bench-attend-codes-cpu.txt`).
const CODE_GROUP_QUERIES: usize = 2 * codes::GROUP;

/// Key and value codecs of a coded cache on the CPU.
enum Codecs {
    /// VecInfer: attention through lookup tables.
    Lut { keys: LutCodec, values: LutCodec },
    /// Any other codec: attention over rows decoded a block at a time.
    Decode { keys: Arc<dyn BlockCodec>, values: Arc<dyn BlockCodec> },
}

impl Codecs {
    /// The key (`keys`) or value codec.
    fn codec(&self, keys: bool) -> &dyn BlockCodec {
        match (self, keys) {
            (Codecs::Lut { keys, .. }, true) => &**keys.codec(),
            (Codecs::Lut { values, .. }, false) => &**values.codec(),
            (Codecs::Decode { keys, .. }, true) => &**keys,
            (Codecs::Decode { values, .. }, false) => &**values,
        }
    }

    /// Encodes f16 rows with the key or value codec (VecInfer reads f16 directly; others f32).
    fn encode(&self, keys: bool, rows: &[f16]) -> Result<CodeBlock> {
        Ok(match (self, keys) {
            (Codecs::Lut { keys, .. }, true) => keys.codec().encode_vec(rows)?,
            (Codecs::Lut { values, .. }, false) => values.codec().encode_vec(rows)?,
            (Codecs::Decode { .. }, _) => {
                self.codec(keys).encode_vec(&rows.iter().map(|x| x.to_f32()).collect::<Vec<_>>())?
            }
        }
        .into())
    }
}

/// Positions a share of a view's attention covers at least: below it, the tables a share of codes
/// builds for its queries cost more than the idle thread it saves.
const SHARE_MIN: usize = 512;

/// Shares of each view's positions: enough for `base` (view, head, tile) tasks to make at least
/// two per thread, none under [`SHARE_MIN`] positions.
fn shares(base: usize, threads: usize, positions: usize) -> usize {
    let want = (2 * threads).div_ceil(base.max(1));
    want.min(positions / SHARE_MIN).max(1)
}

/// Share `sh` of `shares` of the rows of `segs` (`len` elements a row), in order: the rows
/// `R·sh/shares .. R·(sh + 1)/shares` of their `R`, each piece keeping its positions.
fn share_rows(segs: Vec<Segment<'_, f16>>, len: usize, sh: usize, shares: usize) -> Vec<Segment<'_, f16>> {
    if shares == 1 {
        return segs;
    }
    let total: usize = segs.iter().map(|s| s.keys.len() / len).sum();
    let (lo, hi) = (total * sh / shares, total * (sh + 1) / shares);
    let mut out = Vec::new();
    let mut first = 0;
    for s in segs {
        let n = s.keys.len() / len;
        let (a, b) = (lo.max(first) - first, hi.min(first + n).saturating_sub(first));
        if a < b {
            out.push(Segment {
                keys: &s.keys[a * len..b * len],
                values: &s.values[a * len..b * len],
                pos0: s.pos0 + a,
            });
        }
        first += n;
    }
    out
}

/// One sequence's f16 rows, token-major `[rows, kv heads, head_dim]`, allocated a block at a time
/// as rows are first written.
#[derive(Default)]
struct SlotRows {
    keys: Vec<Box<[f16]>>,
    values: Vec<Box<[f16]>>,
}

/// One sequence's codes: blocks of `block` positions, keys and values. A block never changes once
/// written, so a fork shares its source's blocks (reference-counted) instead of copying them.
#[derive(Default)]
struct SlotCodes {
    keys: Vec<CodeBlock>,
    values: Vec<CodeBlock>,
}

impl SlotCodes {
    /// Every block, keys then values.
    fn blocks(&self) -> impl Iterator<Item = &CodeBlock> {
        self.keys.iter().chain(&self.values)
    }
}

/// A step's keys and values as f16 rows `[tokens, kv heads, head_dim]`.
pub struct CpuInput {
    keys: Vec<f16>,
    values: Vec<f16>,
}

/// Softmax partials `[tokens, q heads]` with their weighted sums `[tokens, q heads, head_dim]`.
pub struct CpuPartial {
    stats: Vec<Softmax>,
    acc: Vec<f32>,
    device: Device,
}

/// Host-memory storage of one layer and the CPU attention kernels over it.
pub struct CpuBackend {
    heads: Heads,
    /// Rows per block of storage (at most the rows a sequence holds).
    block_rows: usize,
    rows: Vec<SlotRows>,
    codecs: Option<(Codecs, usize)>,
    codes: Vec<SlotCodes>,
}

/// Which pieces a pass over the tasks computes.
#[derive(Clone, Copy)]
struct Pieces {
    codes: bool,
    rows: bool,
}

impl CpuBackend {
    /// f16 rows only (fp16 and sliding-window layers): `rows` per sequence at most.
    pub fn dense(heads: Heads, slots: usize, rows: usize) -> Self {
        Self {
            heads,
            block_rows: ROW_BLOCK.min(rows.max(1)),
            rows: (0..slots).map(|_| SlotRows::default()).collect(),
            codecs: None,
            codes: Vec::new(),
        }
    }

    /// VecInfer codes written `block` positions at a time, attended through lookup tables.
    pub fn vecinfer(
        heads: Heads,
        slots: usize,
        rows: usize,
        keys: Arc<VecInferCodec>,
        values: Arc<VecInferCodec>,
        block: usize,
    ) -> Result<Self> {
        heads.check_codec(&*keys)?;
        heads.check_codec(&*values)?;
        Ok(Self::with_codecs(
            heads,
            slots,
            rows,
            Codecs::Lut { keys: LutCodec::new(keys), values: LutCodec::new(values) },
            block,
        ))
    }

    /// Codes of any [`BlockCodec`] (`block` a multiple of its block tokens), attended over rows
    /// decoded a block at a time.
    pub fn decoding(
        heads: Heads,
        slots: usize,
        rows: usize,
        keys: Arc<dyn BlockCodec>,
        values: Arc<dyn BlockCodec>,
        block: usize,
    ) -> Result<Self> {
        heads.check_codec(&*keys)?;
        heads.check_codec(&*values)?;
        if !block.is_multiple_of(keys.block_tokens()) || !block.is_multiple_of(values.block_tokens()) {
            return Err(Error::Config(format!(
                "code block {block} is not a multiple of the codecs' blocks ({}, {})",
                keys.block_tokens(),
                values.block_tokens()
            )));
        }
        Ok(Self::with_codecs(heads, slots, rows, Codecs::Decode { keys, values }, block))
    }

    fn with_codecs(heads: Heads, slots: usize, rows: usize, codecs: Codecs, block: usize) -> Self {
        let mut b = Self::dense(heads, slots, rows);
        b.codes = (0..slots).map(|_| SlotCodes::default()).collect();
        b.codecs = Some((codecs, block));
        b
    }

    fn row_len(&self) -> usize {
        self.heads.kv * self.heads.dim
    }

    /// Keys and values of row `r` of `slot`, allocating its block on first use.
    fn row_mut(&mut self, slot: usize, r: usize) -> (&mut [f16], &mut [f16]) {
        let (n, len) = (self.block_rows, self.row_len());
        let s = &mut self.rows[slot];
        while s.keys.len() <= r / n {
            s.keys.push(vec![f16::ZERO; n * len].into_boxed_slice());
            s.values.push(vec![f16::ZERO; n * len].into_boxed_slice());
        }
        let o = (r % n) * len;
        (&mut s.keys[r / n][o..o + len], &mut s.values[r / n][o..o + len])
    }

    fn row(&self, slot: usize, r: usize) -> (&[f16], &[f16]) {
        let (n, len) = (self.block_rows, self.row_len());
        let s = &self.rows[slot];
        let o = (r % n) * len;
        (&s.keys[r / n][o..o + len], &s.values[r / n][o..o + len])
    }

    /// Rows `first..first + n` of `slot` as segments that do not cross storage blocks, holding
    /// positions from `pos0`.
    fn segments<'a>(&'a self, slot: usize, first: usize, n: usize, pos0: usize, out: &mut Vec<Segment<'a, f16>>) {
        let (b, len) = (self.block_rows, self.row_len());
        let s = &self.rows[slot];
        let mut done = 0;
        while done < n {
            let r = first + done;
            let take = (b - r % b).min(n - done);
            let o = (r % b) * len;
            out.push(Segment {
                keys: &s.keys[r / b][o..o + take * len],
                values: &s.values[r / b][o..o + take * len],
                pos0: pos0 + done,
            });
            done += take;
        }
    }

    /// Everything a view's queries may see in f16 (sink, ring, the step's own rows), as segments.
    fn row_segments<'a>(&'a self, v: &SeqView, input: &'a CpuInput) -> Vec<Segment<'a, f16>> {
        let len = self.row_len();
        let mut segs = Vec::new();
        for span in v.row_spans() {
            match span.from {
                RowSource::Stored(first) => self.segments(v.slot, first, span.n, span.pos0, &mut segs),
                RowSource::Input(src) => {
                    let r = src * len..(src + span.n) * len;
                    segs.push(Segment { keys: &input.keys[r.clone()], values: &input.values[r], pos0: span.pos0 });
                }
            }
        }
        segs
    }

    /// Runs every (view, kv head, query tile) task, each folding the chosen pieces into the
    /// partials of its queries: every query head of the kv head's group for each query of the
    /// tile, so a tile of rows or codes is widened once for the whole group (GQA).
    fn pass(
        &self,
        q: &Tensor,
        views: &[SeqView],
        input: Option<&CpuInput>,
        scale: f32,
        pieces: Pieces,
    ) -> Result<CpuPartial> {
        let Heads { q: hq, kv, dim: d } = self.heads;
        let g = hq / kv;
        let qv = q.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let n = q.dim(0)?;
        // (view, kv head, first query of the tile, share, shares): a step of few sequences has
        // fewer (view, head, tile) tasks than a multiple of the threads (one sequence of 3 kv
        // heads on 2 threads: one thread idles a third of the time), so each view's positions are
        // cut into shares whose partials merge below.
        let base = views.iter().map(|v| kv * v.queries.len().div_ceil(QUERY_TILE)).sum::<usize>();
        let threads = rayon::current_num_threads();
        let tasks: Vec<(usize, usize, usize, usize, usize)> = views
            .iter()
            .enumerate()
            .flat_map(|(vi, v)| {
                let shares = shares(base, threads, v.row_spans().iter().map(|r| r.n).sum::<usize>() + v.coded);
                (0..kv).flat_map(move |h| {
                    (0..v.queries.len())
                        .step_by(QUERY_TILE)
                        .flat_map(move |t0| (0..shares).map(move |sh| (vi, h, t0, sh, shares)))
                })
            })
            .collect();
        // Query i of the tile, head gh of the group, is the task's query i·g + gh.
        let rows_of = move |start: usize, kvh: usize, t0: usize, t1: usize| {
            (t0..t1).flat_map(move |i| (0..g).map(move |gh| (start + i) * hq + kvh * g + gh))
        };
        let results: Vec<(Vec<Softmax>, Vec<f32>)> = tasks
            .par_iter()
            .map(|&(vi, kvh, t0, sh, shares)| -> Result<(Vec<Softmax>, Vec<f32>)> {
                let v = &views[vi];
                let t1 = (t0 + QUERY_TILE).min(v.queries.len());
                let nq = (t1 - t0) * g;
                let qs: Vec<f32> = rows_of(v.queries.start, kvh, t0, t1)
                    .flat_map(|row| qv[row * d..(row + 1) * d].iter().map(|x| x * scale))
                    .collect();
                let q_pos: Vec<usize> = (t0..t1).flat_map(|i| std::iter::repeat_n(v.query_pos(i), g)).collect();
                let mut stats = vec![Softmax::EMPTY; nq];
                let mut acc = vec![0.0f32; nq * d];
                if pieces.rows {
                    if let Some(input) = input {
                        let segs = share_rows(self.row_segments(v, input), self.row_len(), sh, shares);
                        rows::attend(
                            &qs,
                            &q_pos,
                            kvh,
                            kv,
                            &segs,
                            v.window,
                            &mut stats,
                            &mut acc,
                            &mut RowsScratch::new(d, nq),
                        );
                    }
                }
                if pieces.codes && v.coded > 0 {
                    self.codes_task(v, kvh, (sh, shares), &qs, &q_pos, &mut stats, &mut acc)?;
                }
                Ok((stats, acc))
            })
            .collect::<Result<_>>()?;
        let mut out =
            CpuPartial { stats: vec![Softmax::EMPTY; n * hq], acc: vec![0.0; n * hq * d], device: q.device().clone() };
        for (&(vi, kvh, t0, _, _), (stats, acc)) in tasks.iter().zip(results) {
            let v = &views[vi];
            let t1 = (t0 + QUERY_TILE).min(v.queries.len());
            for (i, (row, st)) in rows_of(v.queries.start, kvh, t0, t1).zip(stats).enumerate() {
                out.stats[row].merge(&mut out.acc[row * d..(row + 1) * d], st, &acc[i * d..(i + 1) * d]);
            }
        }
        Ok(out)
    }

    /// Folds share `share.0` of `share.1` of a view's codes into the partials of its queries `qs`
    /// (one query head over kv head `h`).
    #[allow(clippy::too_many_arguments)]
    fn codes_task(
        &self,
        v: &SeqView,
        h: usize,
        share: (usize, usize),
        qs: &[f32],
        q_pos: &[usize],
        stats: &mut [Softmax],
        acc: &mut [f32],
    ) -> Result<()> {
        let Some((codecs, block)) = &self.codecs else { return Ok(()) };
        let d = self.heads.dim;
        let sc = &self.codes[v.slot];
        // Codes are unmasked (older than every query): a share is a run of whole blocks.
        let n_blocks = v.coded.div_ceil(*block);
        let (b0, b1) = (n_blocks * share.0 / share.1, n_blocks * (share.0 + 1) / share.1);
        let len = v.coded.min(b1 * block).saturating_sub(b0 * block);
        if len == 0 {
            return Ok(());
        }
        match codecs {
            Codecs::Lut { keys, values } => {
                let blocks = CodeBlocks {
                    keys: &sc.keys[b0..b1],
                    values: &sc.values[b0..b1],
                    block: *block,
                    heads: self.heads.kv,
                    len,
                };
                let mut scratch = CodesScratch::default();
                let (mut cs, mut ca) = (vec![Softmax::EMPTY; stats.len()], vec![0.0f32; acc.len()]);
                match stats.len() {
                    1 => cs[0] = codes::attend(keys, values, &blocks, h, qs, &mut ca, &mut scratch),
                    n if n <= CODE_GROUP_QUERIES => {
                        let chunks = qs.chunks(codes::GROUP * d).zip(cs.chunks_mut(codes::GROUP));
                        for ((q, st), o) in chunks.zip(ca.chunks_mut(codes::GROUP * d)) {
                            codes::attend_group(keys, values, &blocks, h, q, st, o, &mut scratch);
                        }
                    }
                    _ => codes::attend_many(keys, values, &blocks, h, qs, &mut cs, &mut ca, &mut scratch),
                }
                for (i, st) in stats.iter_mut().enumerate() {
                    st.merge(&mut acc[i * d..(i + 1) * d], cs[i], &ca[i * d..(i + 1) * d]);
                }
            }
            Codecs::Decode { keys, values } => {
                // Positions only order the codes (whole blocks of them).
                let n = block * self.row_len();
                let (mut kb, mut vb) = (vec![0.0f32; n], vec![0.0f32; n]);
                let mut scratch = RowsScratch::new(d, qs.len() / d);
                let (mut cs, mut ca) = (vec![Softmax::EMPTY; stats.len()], vec![0.0f32; acc.len()]);
                let whole = b1.min(v.coded / block);
                for (i, (kc, vc)) in sc.keys.iter().zip(&sc.values).enumerate().take(whole).skip(b0) {
                    keys.decode(kc, &mut kb)?;
                    values.decode(vc, &mut vb)?;
                    let seg = [Segment { keys: &kb[..], values: &vb[..], pos0: v.n_sink + i * block }];
                    rows::attend(qs, q_pos, h, self.heads.kv, &seg, None, &mut cs, &mut ca, &mut scratch);
                }
                for (i, st) in stats.iter_mut().enumerate() {
                    st.merge(&mut acc[i * d..(i + 1) * d], cs[i], &ca[i * d..(i + 1) * d]);
                }
            }
        }
        Ok(())
    }

    /// Keys and values of a quantize span in position order (the oldest ring rows, then the
    /// input's), f16 `[n, kv, D]` each.
    fn gather(&self, input: &CpuInput, q: &Quantize) -> (Vec<f16>, Vec<f16>) {
        let len = self.row_len();
        let (mut keys, mut values) = (Vec::with_capacity(q.len() * len), Vec::with_capacity(q.len() * len));
        for i in 0..q.ring.1 {
            let (k, v) = self.row(q.slot, q.ring.0.row(i));
            keys.extend_from_slice(k);
            values.extend_from_slice(v);
        }
        if q.input.1 > 0 {
            let r = q.input.0 * len..(q.input.0 + q.input.1) * len;
            keys.extend_from_slice(&input.keys[r.clone()]);
            values.extend_from_slice(&input.values[r]);
        }
        (keys, values)
    }
}

impl Backend for CpuBackend {
    type Input = CpuInput;
    type Partial = CpuPartial;

    fn input(&self, k: &Tensor, v: &Tensor) -> Result<CpuInput> {
        let rows = |x: &Tensor| -> Result<Vec<f16>> { Ok(x.to_dtype(DType::F16)?.flatten_all()?.to_vec1::<f16>()?) };
        Ok(CpuInput { keys: rows(k)?, values: rows(v)? })
    }

    fn put_rows(&mut self, input: &CpuInput, puts: &[Put]) -> Result<()> {
        let len = self.row_len();
        for p in puts {
            for i in 0..p.n {
                let src = (p.src + i) * len..(p.src + i + 1) * len;
                let (k, v) = self.row_mut(p.slot, p.to.row(i));
                k.copy_from_slice(&input.keys[src.clone()]);
                v.copy_from_slice(&input.values[src]);
            }
        }
        Ok(())
    }

    fn quantize(&mut self, input: &CpuInput, spans: &[Quantize]) -> Result<()> {
        let Some((codecs, block)) = &self.codecs else {
            return Err(Error::Config("a dense cache holds no codes".into()));
        };
        let n = *block * self.row_len();
        let mut new = Vec::with_capacity(spans.len());
        for q in spans {
            let sc = &self.codes[q.slot];
            if q.at != sc.keys.len() * block || q.len() % block != 0 {
                return Err(Error::Config(format!(
                    "codes at {} ({} positions) do not continue {} whole blocks of {block}",
                    q.at,
                    q.len(),
                    sc.keys.len()
                )));
            }
            let (keys, values) = self.gather(input, q);
            let blocks = keys
                .chunks(n)
                .zip(values.chunks(n))
                .map(|(kb, vb)| Ok((codecs.encode(true, kb)?, codecs.encode(false, vb)?)))
                .collect::<Result<Vec<_>>>()?;
            new.push((q.slot, blocks));
        }
        for (slot, blocks) in new {
            let sc = &mut self.codes[slot];
            for (k, v) in blocks {
                sc.keys.push(k);
                sc.values.push(v);
            }
        }
        Ok(())
    }

    fn restore(&mut self, r: &Restore) -> Result<()> {
        let Some((codecs, block)) = &self.codecs else {
            return Err(Error::Config("a dense cache holds no codes".into()));
        };
        let (block, len) = (*block, self.row_len());
        if !r.keep.is_multiple_of(block) {
            return Err(Error::Config(format!("restore keeps {} positions, not whole blocks of {block}", r.keep)));
        }
        let b = r.keep / block;
        let held = self.codes[r.slot].keys.len();
        if (r.keep + r.n).div_ceil(block) > held {
            return Err(Error::Config(format!(
                "restore of positions {}..{} from {held} code blocks of {block}",
                r.keep,
                r.keep + r.n
            )));
        }
        // The blocks the run touches, decoded first (a restore is a cut's few recent positions).
        let blocks = b..(r.keep + r.n).div_ceil(block);
        let (mut kb, mut vb) = (vec![0.0f32; blocks.len() * block * len], vec![0.0f32; blocks.len() * block * len]);
        let sc = &self.codes[r.slot];
        for (i, blk) in blocks.enumerate() {
            let at = i * block * len..(i + 1) * block * len;
            codecs.codec(true).decode(&sc.keys[blk], &mut kb[at.clone()])?;
            codecs.codec(false).decode(&sc.values[blk], &mut vb[at])?;
        }
        let first = r.keep - b * block;
        for i in 0..r.n {
            let at = (first + i) * len..(first + i + 1) * len;
            let (dk, dv) = self.row_mut(r.slot, r.to.row(i));
            dk.iter_mut().zip(&kb[at.clone()]).for_each(|(a, &x)| *a = f16::from_f32(x));
            dv.iter_mut().zip(&vb[at]).for_each(|(a, &x)| *a = f16::from_f32(x));
        }
        let sc = &mut self.codes[r.slot];
        sc.keys.truncate(b);
        sc.values.truncate(b);
        Ok(())
    }

    fn attend_codes(&self, q: &Tensor, views: &[SeqView], scale: f32) -> Result<CpuPartial> {
        self.pass(q, views, None, scale, Pieces { codes: true, rows: false })
    }

    fn attend_rows(&self, q: &Tensor, views: &[SeqView], input: &CpuInput, scale: f32) -> Result<CpuPartial> {
        self.pass(q, views, Some(input), scale, Pieces { codes: false, rows: true })
    }

    fn merge(&self, mut a: CpuPartial, b: CpuPartial) -> Result<CpuPartial> {
        let d = self.heads.dim;
        for (i, (st, other)) in a.stats.iter_mut().zip(b.stats).enumerate() {
            st.merge(&mut a.acc[i * d..(i + 1) * d], other, &b.acc[i * d..(i + 1) * d]);
        }
        Ok(a)
    }

    fn finish(&self, mut p: CpuPartial) -> Result<Tensor> {
        let Heads { q: hq, dim: d, .. } = self.heads;
        for (i, st) in p.stats.iter().enumerate() {
            st.finish(&mut p.acc[i * d..(i + 1) * d]);
        }
        let n = p.stats.len() / hq;
        Ok(Tensor::from_vec(p.acc, (n, hq, d), &p.device)?)
    }

    /// One pass: each task folds codes and rows together.
    fn attend(&self, q: &Tensor, views: &[SeqView], input: &CpuInput, scale: f32) -> Result<Tensor> {
        let p = self.pass(q, views, Some(input), scale, Pieces { codes: true, rows: true })?;
        self.finish(p)
    }

    fn resident_bytes(&self) -> usize {
        let rows: usize =
            self.rows.iter().map(|s| s.keys.iter().chain(&s.values).map(|b| b.len() * 2).sum::<usize>()).sum();
        // A block shared by forks is held once; only shared blocks need telling apart (this runs
        // every engine step).
        let mut seen = HashSet::new();
        let codes: usize = self
            .codes
            .iter()
            .flat_map(SlotCodes::blocks)
            .filter(|b| Arc::strong_count(b) == 1 || seen.insert(b.as_ptr()))
            .map(|b| b.len())
            .sum();
        let tables = match &self.codecs {
            Some((c, _)) => {
                let transposed = match c {
                    Codecs::Lut { keys, values } => keys.resident_bytes() + values.resident_bytes(),
                    Codecs::Decode { .. } => 0,
                };
                c.codec(true).resident_bytes() + c.codec(false).resident_bytes() + transposed
            }
            None => 0,
        };
        rows + codes + tables
    }

    fn sequence_bytes(&self, f: Footprint) -> usize {
        let rows = f.rows.div_ceil(self.block_rows) * self.block_rows * self.row_len() * 2 * 2;
        let codes = match &self.codecs {
            Some((c, block)) => {
                f.coded / block * (c.codec(true).encoded_len(*block) + c.codec(false).encoded_len(*block))
            }
            None => 0,
        };
        rows + codes
    }

    fn shareable_bytes(&self, f: Footprint) -> usize {
        let rows = Footprint { rows: 0, ..f };
        self.sequence_bytes(rows)
    }

    fn shared_bytes(&self, slot: usize) -> usize {
        self.codes.get(slot).map_or(0, |s| s.blocks().filter(|b| Arc::strong_count(b) > 1).map(|b| b.len()).sum())
    }

    fn copy_slot(&mut self, from: usize, to: usize, held: Footprint) -> Result<()> {
        if from.max(to) >= self.rows.len() {
            return Err(Error::Shape(format!("copy slot {from} into {to} of {} slots", self.rows.len())));
        }
        let blocks = held.rows.div_ceil(self.block_rows).min(self.rows[from].keys.len());
        let src = &self.rows[from];
        let rows = SlotRows { keys: src.keys[..blocks].to_vec(), values: src.values[..blocks].to_vec() };
        self.rows[to] = rows;
        if let Some((_, block)) = &self.codecs {
            let n = held.coded / block;
            let src = &self.codes[from];
            if n > src.keys.len() {
                return Err(Error::Config(format!("slot {from} holds {} code blocks, not {n}", src.keys.len())));
            }
            // The blocks themselves are shared, not copied.
            let codes = SlotCodes { keys: src.keys[..n].to_vec(), values: src.values[..n].to_vec() };
            self.codes[to] = codes;
        }
        Ok(())
    }

    fn release(&mut self, slot: usize, rows: usize) -> Result<()> {
        let s = self.rows.get_mut(slot).ok_or_else(|| Error::Shape(format!("no slot {slot}")))?;
        let keep = rows.div_ceil(self.block_rows);
        s.keys.truncate(keep);
        s.values.truncate(keep);
        if keep == 0 {
            // An empty slot gives its block vectors back too.
            *s = SlotRows::default();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use half::f16;
    use veloq::kernels::cpu::attention::Segment;

    use super::{share_rows, shares, SHARE_MIN};

    /// The shares of a view's rows are its rows, each once, in order, at their own positions.
    #[test]
    fn shares_cover_every_row_once() {
        let len = 3;
        let rows: Vec<f16> = (0..40 * len).map(|i| f16::from_f32(i as f32)).collect();
        // Three runs (a sink, a wrapped ring, staged input) of 5, 21 and 14 rows.
        let segs = [
            Segment { keys: &rows[..5 * len], values: &rows[..5 * len], pos0: 0 },
            Segment { keys: &rows[5 * len..26 * len], values: &rows[5 * len..26 * len], pos0: 100 },
            Segment { keys: &rows[26 * len..], values: &rows[26 * len..], pos0: 121 },
        ];
        for n in 1..=7 {
            let mut seen = Vec::new();
            for sh in 0..n {
                for s in share_rows(segs.to_vec(), len, sh, n) {
                    for r in 0..s.keys.len() / len {
                        seen.push((s.keys[r * len].to_f32() as usize / len, s.pos0 + r));
                    }
                }
            }
            // The sink at positions 0..5, then the ring and the input continuing from 100.
            let want: Vec<(usize, usize)> = (0..40).map(|r| (r, if r < 5 { r } else { 95 + r })).collect();
            assert_eq!(seen, want, "{n} shares");
        }
        assert_eq!(shares(3, 2, 1024), 2, "one sequence, 3 kv heads, 2 threads, 1k");
        assert_eq!(shares(3, 2, SHARE_MIN - 1), 1, "short contexts stay whole");
        assert_eq!(shares(64, 2, 1 << 20), 1, "enough tasks already");
    }
}
