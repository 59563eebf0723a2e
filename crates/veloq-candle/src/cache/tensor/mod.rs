//! The portable backend: a layer's f16 rows and codes in candle tensors on any device, every
//! operation in candle ops (`slice_set` for rows, the tensor codec for codes, tiled partials for
//! attention). What `KernelChoice::Forbid` selects and what devices without fused kernels get;
//! the CUDA backend keeps the same storage and replaces the hot operations with kernels.
//!
//! Storage per layer, allocated up front (a serving engine's reservation): f16 rows
//! `[2, slots, kv, rows, D]` (keys, then values: one allocation, so a kernel writing both takes
//! one mutable borrow); codes `[slots, kv, capacity, M]` for keys and for values (u8 for ≤ 256
//! centroids), or the scalar baselines' packed codes and f16 metadata ([`scalar`]).

pub mod attention;
pub mod codec;
pub mod scalar;

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

use veloq::codec::block::BlockCodec;
use veloq::codec::vecinfer::VecInferCodec;

use self::attention::{codes_state, fold_rows, RowChunk, State, ROW_CHUNK};
use self::codec::TensorCodec;
use self::scalar::ScalarCodec;
use super::backend::{Backend, Heads};
use super::residency::{Footprint, Put, Quantize, Restore, RowRun, RowSource, SeqView};
use crate::error::{Error, Result};

/// Queries per tile of the partials (bounds the scratch with the chunks).
const QUERY_TILE: usize = 128;
/// The scalar baselines' tiles: larger, since each tile decodes every code again.
const SCALAR_QUERY_TILE: usize = 512;
/// Bytes of scores one chunk of a scalar baseline's decoded rows may take.
const SCALAR_SCORE_BYTES: usize = 64 << 20;

/// Codecs and codes of a coded layer.
pub struct TensorCodes {
    /// Key codec.
    pub keys: TensorCodec,
    /// Value codec.
    pub values: TensorCodec,
    /// `[slots, kv, capacity, M]`
    pub key_codes: Tensor,
    /// `[slots, kv, capacity, M]`
    pub value_codes: Tensor,
}

/// Codecs and storage of a layer coded by a scalar baseline (KIVI, rotation + Lloyd–Max).
pub struct ScalarCodes {
    /// Key codec.
    pub keys: ScalarCodec,
    /// Value codec.
    pub values: ScalarCodec,
    /// Packed codes `[slots, kv, capacity, packed_width]` u8: keys, values.
    codes: [Tensor; 2],
    /// Metadata `[slots, kv, capacity / group_tokens, planes, width]` f16: keys, values.
    meta: [Tensor; 2],
}

impl ScalarCodes {
    fn codec(&self, plane: usize) -> &ScalarCodec {
        if plane == 0 {
            &self.keys
        } else {
            &self.values
        }
    }

    /// Positions every encode and decode span is aligned to (both codecs' metadata groups).
    fn align(&self) -> usize {
        let (a, b) = (self.keys.group_tokens(), self.values.group_tokens());
        a.max(b) // groups are 1 or a common size: the larger is a multiple of the other
    }

    /// Rows of positions `first..first + n` of `slot` (aligned), decoded: `[kv, n, D]` f32.
    fn decode(&self, plane: usize, slot: usize, first: usize, n: usize) -> Result<Tensor> {
        let c = self.codec(plane);
        let g = c.group_tokens();
        let packed = self.codes[plane].get(slot)?.narrow(1, first, n)?;
        let meta = self.meta[plane].get(slot)?.narrow(1, first / g, n / g)?;
        c.decode(&packed, &meta)
    }

    /// Codes rows `[kv, n, D]` into positions `at..at + n` of `slot` (aligned).
    fn encode(&self, plane: usize, slot: usize, at: usize, rows: &Tensor) -> Result<()> {
        let c = self.codec(plane);
        let g = c.group_tokens();
        let (packed, meta) = c.encode(rows)?;
        self.codes[plane].narrow(0, slot, 1)?.slice_set(&packed.unsqueeze(0)?, 2, at)?;
        self.meta[plane].narrow(0, slot, 1)?.slice_set(&meta.unsqueeze(0)?, 2, at / g)?;
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.codes.iter().chain(&self.meta).map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

/// What a coded layer holds.
pub enum Coded {
    /// VecInfer codebook indices (lookup-table attention).
    VecInfer(TensorCodes),
    /// A scalar baseline's codes (attention over rows decoded a chunk at a time).
    Scalar(ScalarCodes),
}

/// A step's keys and values, `[tokens, kv, D]` f32, and their f16 copies made when first needed
/// (a decode step on CUDA never needs them: its kernels convert as they write).
pub struct TensorInput {
    /// Keys.
    pub keys: Tensor,
    /// Values.
    pub values: Tensor,
    half: OnceLock<(Tensor, Tensor)>,
}

impl TensorInput {
    /// Keys and values as f16 (what the cache stores).
    pub fn half(&self) -> Result<&(Tensor, Tensor)> {
        if let Some(h) = self.half.get() {
            return Ok(h);
        }
        let h = (self.keys.to_dtype(DType::F16)?, self.values.to_dtype(DType::F16)?);
        Ok(self.half.get_or_init(|| h))
    }
}

/// Partials `[tokens, q heads, ·]` (`o` with head_dim, `m` and `l` with 1).
pub struct TensorPartial(pub State);

/// One layer's storage in candle tensors and attention in candle ops.
pub struct TensorBackend {
    /// Head geometry.
    pub heads: Heads,
    /// Where the tensors live.
    pub device: Device,
    /// f16 rows `[2, slots, kv, rows, D]`: keys, then values.
    pub rows: Tensor,
    /// Codecs and codes of coded layers.
    pub codes: Option<Coded>,
}

impl TensorBackend {
    /// f16 rows only: `rows` per sequence.
    pub fn dense(heads: Heads, slots: usize, rows: usize, device: &Device) -> Result<Self> {
        let rows = Tensor::zeros((2, slots, heads.kv, rows, heads.dim), DType::F16, device)?;
        Ok(Self { heads, device: device.clone(), rows, codes: None })
    }

    /// VecInfer codes for `capacity` positions per sequence beside `rows` f16 rows.
    pub fn vecinfer(
        heads: Heads,
        slots: usize,
        rows: usize,
        capacity: usize,
        keys: &VecInferCodec,
        values: &VecInferCodec,
        device: &Device,
    ) -> Result<Self> {
        heads.check_codec(keys)?;
        heads.check_codec(values)?;
        let mut b = Self::dense(heads, slots, rows, device)?;
        let (kc, vc) = (TensorCodec::new(keys, device)?, TensorCodec::new(values, device)?);
        let codes = |c: &TensorCodec| Tensor::zeros((slots, heads.kv, capacity, c.subspaces()), c.code_dtype(), device);
        b.codes = Some(Coded::VecInfer(TensorCodes {
            key_codes: codes(&kc)?,
            value_codes: codes(&vc)?,
            keys: kc,
            values: vc,
        }));
        Ok(b)
    }

    /// A scalar baseline's codes (KIVI, rotation + Lloyd–Max: codecs with a
    /// [`scalar_form`](BlockCodec::scalar_form)) for `capacity` positions per sequence beside
    /// `rows` f16 rows, packed as tightly as the codec's own bytes.
    pub fn scalar(
        heads: Heads,
        slots: usize,
        rows: usize,
        capacity: usize,
        keys: &dyn BlockCodec,
        values: &dyn BlockCodec,
        device: &Device,
    ) -> Result<Self> {
        heads.check_codec(keys)?;
        heads.check_codec(values)?;
        let mut b = Self::dense(heads, slots, rows, device)?;
        let (kc, vc) = (ScalarCodec::new(keys, device)?, ScalarCodec::new(values, device)?);
        let g = kc.group_tokens().max(vc.group_tokens());
        if !g.is_multiple_of(kc.group_tokens()) || !g.is_multiple_of(vc.group_tokens()) {
            return Err(Error::Config(format!(
                "key and value groups ({}, {}) do not nest",
                kc.group_tokens(),
                vc.group_tokens()
            )));
        }
        let capacity = capacity.div_ceil(g) * g;
        let codes = |c: &ScalarCodec| Tensor::zeros((slots, heads.kv, capacity, c.packed_width()), DType::U8, device);
        let meta = |c: &ScalarCodec| {
            let (p, w) = c.meta_shape();
            Tensor::zeros((slots, heads.kv, capacity / c.group_tokens(), p, w), DType::F16, device)
        };
        b.codes = Some(Coded::Scalar(ScalarCodes {
            codes: [codes(&kc)?, codes(&vc)?],
            meta: [meta(&kc)?, meta(&vc)?],
            keys: kc,
            values: vc,
        }));
        Ok(b)
    }

    fn coded(&self) -> Result<&Coded> {
        self.codes.as_ref().ok_or_else(|| Error::Config("a dense cache holds no codes".into()))
    }

    /// The VecInfer codes of a VecInfer layer (what the CUDA kernels read and write).
    pub fn vecinfer_codes(&self) -> Result<&TensorCodes> {
        match self.coded()? {
            Coded::VecInfer(c) => Ok(c),
            Coded::Scalar(_) => Err(Error::Config("a scalar baseline's layer holds no VecInfer codes".into())),
        }
    }

    /// Rows `first..first + n` of `slot`, keys (`plane` 0) or values (1): `[kv, n, D]` f16.
    pub fn rows_of(&self, plane: usize, slot: usize, first: usize, n: usize) -> Result<Tensor> {
        Ok(self.rows.get(plane)?.get(slot)?.narrow(1, first, n)?)
    }

    /// `[kv, n, D]` rows (f16) into rows `to` of `slot`.
    fn write_rows(&self, slot: usize, to: RowRun, keys: &Tensor, values: &Tensor) -> Result<()> {
        let mut done = 0;
        for (first, n) in to.parts(keys.dim(1)?) {
            for (plane, src) in [keys, values].into_iter().enumerate() {
                let part = src.narrow(1, done, n)?.contiguous()?.unsqueeze(0)?.unsqueeze(0)?;
                self.rows.narrow(0, plane, 1)?.narrow(1, slot, 1)?.slice_set(&part, 3, first)?;
            }
            done += n;
        }
        Ok(())
    }

    /// Every f16 row a view's queries may see (sink, ring, the step's own rows), as chunks.
    fn row_chunks(&self, v: &SeqView, input: &TensorInput) -> Result<Vec<RowChunk>> {
        let mut out = Vec::new();
        for span in v.row_spans() {
            for c0 in (0..span.n).step_by(ROW_CHUNK) {
                let len = ROW_CHUNK.min(span.n - c0);
                let (keys, values) = match span.from {
                    RowSource::Stored(first) => {
                        (self.rows_of(0, v.slot, first + c0, len)?, self.rows_of(1, v.slot, first + c0, len)?)
                    }
                    RowSource::Input(src) => {
                        let (k16, v16) = input.half()?;
                        let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(0, src + c0, len)?.transpose(0, 1)?) };
                        (rows(k16)?, rows(v16)?)
                    }
                };
                out.push(RowChunk { keys, values, pos0: span.pos0 + c0 });
            }
        }
        Ok(out)
    }

    /// Queries `i0..i1` of a view as `[Hq, n, D]` f32, scaled.
    fn queries(&self, q: &Tensor, v: &SeqView, i0: usize, i1: usize, scale: f32) -> Result<Tensor> {
        Ok((q.narrow(0, v.queries.start + i0, i1 - i0)?.to_dtype(DType::F32)? * scale as f64)?
            .transpose(0, 1)?
            .contiguous()?)
    }

    /// Runs `f` per (view, tile of at most `tile` queries) on `[Hq, n, D]` queries and packs the
    /// states into `[tokens, Hq, ·]`.
    fn per_tile(
        &self,
        q: &Tensor,
        views: &[SeqView],
        scale: f32,
        tile: usize,
        mut f: impl FnMut(&SeqView, &Tensor, usize) -> Result<State>,
    ) -> Result<TensorPartial> {
        let mut parts: Vec<State> = Vec::new();
        for v in views {
            for i0 in (0..v.queries.len()).step_by(tile) {
                let i1 = (i0 + tile).min(v.queries.len());
                let qs = self.queries(q, v, i0, i1, scale)?;
                let st = f(v, &qs, i0)?;
                // [Hq, n, ·] → [n, Hq, ·]
                let tr = |t: &Tensor| -> Result<Tensor> { Ok(t.transpose(0, 1)?.contiguous()?) };
                parts.push(State { o: tr(&st.o)?, m: tr(&st.m)?, l: tr(&st.l)? });
            }
        }
        let cat = |f: fn(&State) -> &Tensor| -> Result<Tensor> {
            Ok(Tensor::cat(&parts.iter().map(f).collect::<Vec<_>>(), 0)?)
        };
        Ok(TensorPartial(State { o: cat(|s| &s.o)?, m: cat(|s| &s.m)?, l: cat(|s| &s.l)? }))
    }
}

impl Backend for TensorBackend {
    type Input = TensorInput;
    type Partial = TensorPartial;

    fn input(&self, k: &Tensor, v: &Tensor) -> Result<TensorInput> {
        let f32c =
            |x: &Tensor| -> Result<Tensor> { Ok(x.to_device(&self.device)?.to_dtype(DType::F32)?.contiguous()?) };
        let (keys, values) = (f32c(k)?, f32c(v)?);
        Ok(TensorInput { keys, values, half: OnceLock::new() })
    }

    fn put_rows(&mut self, input: &TensorInput, puts: &[Put]) -> Result<()> {
        for p in puts {
            let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.narrow(0, p.src, p.n)?.transpose(0, 1)?) };
            let (k16, v16) = input.half()?;
            self.write_rows(p.slot, p.to, &rows(k16)?, &rows(v16)?)?;
        }
        Ok(())
    }

    fn quantize(&mut self, input: &TensorInput, spans: &[Quantize]) -> Result<()> {
        let c = self.coded()?;
        for q in spans {
            // Rows in position order, [n, kv, D] f16: the oldest ring rows, then the input's.
            let mut parts: Vec<(Tensor, Tensor)> = Vec::new();
            for (first, n) in q.ring.0.parts(q.ring.1) {
                let rows =
                    |plane: usize| -> Result<Tensor> { Ok(self.rows_of(plane, q.slot, first, n)?.transpose(0, 1)?) };
                parts.push((rows(0)?, rows(1)?));
            }
            if q.input.1 > 0 {
                let (k16, v16) = input.half()?;
                parts.push((k16.narrow(0, q.input.0, q.input.1)?, v16.narrow(0, q.input.0, q.input.1)?));
            }
            if parts.is_empty() {
                continue;
            }
            let cat = |i: usize| -> Result<Tensor> {
                Ok(Tensor::cat(&parts.iter().map(|p| if i == 0 { &p.0 } else { &p.1 }).collect::<Vec<_>>(), 0)?)
            };
            match c {
                Coded::VecInfer(c) => {
                    for (codec, rows, dst) in [(&c.keys, cat(0)?, &c.key_codes), (&c.values, cat(1)?, &c.value_codes)] {
                        let codes = codec.quantize(&rows)?.transpose(0, 1)?.contiguous()?.unsqueeze(0)?; // [1, kv, n, M]
                        dst.narrow(0, q.slot, 1)?.slice_set(&codes, 2, q.at)?;
                    }
                }
                Coded::Scalar(c) => {
                    let rows = [cat(0)?, cat(1)?];
                    let (n, g) = (rows[0].dim(0)?, c.align());
                    if !q.at.is_multiple_of(g) || !n.is_multiple_of(g) {
                        return Err(Error::Shape(format!("codes at {}..{} are not aligned to {g}", q.at, q.at + n)));
                    }
                    for (plane, rows) in rows.iter().enumerate() {
                        c.encode(plane, q.slot, q.at, &rows.transpose(0, 1)?.contiguous()?)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn copy_slot(&mut self, from: usize, to: usize, held: Footprint) -> Result<()> {
        // Along `dim`, the first `n` entries of `from`'s share of `t` (slot axis `slot_dim`)
        // written over `to`'s.
        let copy = |t: &Tensor, slot_dim: usize, dim: usize, n: usize| -> Result<()> {
            if n == 0 {
                return Ok(());
            }
            let part = t.narrow(slot_dim, from, 1)?.narrow(dim, 0, n)?.force_contiguous()?;
            Ok(t.narrow(slot_dim, to, 1)?.slice_set(&part, dim, 0)?)
        };
        for plane in 0..2 {
            copy(&self.rows.narrow(0, plane, 1)?, 1, 3, held.rows)?;
        }
        match &self.codes {
            None => {}
            Some(Coded::VecInfer(c)) => {
                copy(&c.key_codes, 0, 2, held.coded)?;
                copy(&c.value_codes, 0, 2, held.coded)?;
            }
            Some(Coded::Scalar(c)) => {
                let g = c.align();
                for plane in 0..2 {
                    let (tokens, meta) = (held.coded.div_ceil(g) * g, c.codec(plane).group_tokens());
                    copy(&c.codes[plane], 0, 2, tokens)?;
                    copy(&c.meta[plane], 0, 2, tokens / meta)?;
                }
            }
        }
        Ok(())
    }

    fn restore(&mut self, r: &Restore) -> Result<()> {
        if r.n == 0 {
            return Ok(());
        }
        let (k, v) = match self.coded()? {
            Coded::VecInfer(c) => {
                let decode = |codec: &TensorCodec, codes: &Tensor| -> Result<Tensor> {
                    let part = codes.get(r.slot)?.narrow(1, r.keep, r.n)?.transpose(0, 1)?.contiguous()?; // [n, kv, M]
                    Ok(codec.decode(&part)?.to_dtype(DType::F16)?.transpose(0, 1)?)
                    // [kv, n, D]
                };
                (decode(&c.keys, &c.key_codes)?, decode(&c.values, &c.value_codes)?)
            }
            Coded::Scalar(c) => {
                // Whole groups decoded, the restored positions kept.
                let g = c.align();
                let (a0, a1) = (r.keep / g * g, (r.keep + r.n).div_ceil(g) * g);
                let decode = |plane: usize| -> Result<Tensor> {
                    Ok(c.decode(plane, r.slot, a0, a1 - a0)?.narrow(1, r.keep - a0, r.n)?.to_dtype(DType::F16)?)
                };
                (decode(0)?, decode(1)?)
            }
        };
        self.write_rows(r.slot, r.to, &k, &v)
    }

    fn attend_codes(&self, q: &Tensor, views: &[SeqView], scale: f32) -> Result<TensorPartial> {
        let Heads { q: hq, kv, dim: d } = self.heads;
        let tile = match self.coded()? {
            Coded::VecInfer(_) => QUERY_TILE,
            Coded::Scalar(_) => SCALAR_QUERY_TILE,
        };
        self.per_tile(q, views, scale, tile, |v, qs, _| {
            if v.coded == 0 {
                return State::empty(hq, qs.dim(1)?, d, &self.device);
            }
            match self.coded()? {
                Coded::VecInfer(c) => {
                    let slot = |t: &Tensor| t.get(v.slot);
                    codes_state(qs, (&c.keys, &slot(&c.key_codes)?), (&c.values, &slot(&c.value_codes)?), v.coded)
                }
                Coded::Scalar(c) => {
                    // Rows decoded a chunk at a time (every code is older than every query: no mask).
                    let n = qs.dim(1)?;
                    let qh = qs.reshape((kv, hq / kv * n, d))?;
                    let mut st = State::empty(kv, hq / kv * n, d, &self.device)?;
                    let g = c.align();
                    let chunk = (SCALAR_SCORE_BYTES / (hq * n * 4)).clamp(g, 4 * ROW_CHUNK) / g * g;
                    for s0 in (0..v.coded).step_by(chunk) {
                        let len = chunk.min(v.coded - s0);
                        let (k, val) = (c.decode(0, v.slot, s0, len)?, c.decode(1, v.slot, s0, len)?);
                        st.fold(&qh.matmul(&k.t()?)?, &val)?;
                    }
                    let back = |t: &Tensor| -> Result<Tensor> { Ok(t.reshape((hq, n, ()))?) };
                    Ok(State { o: back(&st.o)?, m: back(&st.m)?, l: back(&st.l)? })
                }
            }
        })
    }

    fn attend_rows(&self, q: &Tensor, views: &[SeqView], input: &TensorInput, scale: f32) -> Result<TensorPartial> {
        let Heads { q: hq, kv, dim: d } = self.heads;
        self.per_tile(q, views, scale, QUERY_TILE, |v, qs, i0| {
            let n = qs.dim(1)?;
            let qh = qs.reshape((kv, hq / kv * n, d))?;
            let q_pos: Vec<usize> = (i0..i0 + n).map(|i| v.query_pos(i)).collect();
            let mut st = State::empty(kv, hq / kv * n, d, &self.device)?;
            fold_rows(&mut st, &qh, &q_pos, &self.row_chunks(v, input)?, v.window)?;
            let back = |t: &Tensor| -> Result<Tensor> { Ok(t.reshape((hq, n, ()))?) };
            Ok(State { o: back(&st.o)?, m: back(&st.m)?, l: back(&st.l)? })
        })
    }

    fn merge(&self, a: TensorPartial, b: TensorPartial) -> Result<TensorPartial> {
        Ok(TensorPartial(a.0.merge(&b.0)?))
    }

    fn finish(&self, p: TensorPartial) -> Result<Tensor> {
        p.0.finish()
    }

    fn resident_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let codes = self.codes.as_ref().map_or(0, |c| match c {
            Coded::VecInfer(c) => {
                bytes(&c.key_codes) + bytes(&c.value_codes) + c.keys.resident_bytes() + c.values.resident_bytes()
            }
            Coded::Scalar(c) => c.bytes(),
        });
        bytes(&self.rows) + codes
    }

    /// A slot's share of the rows and codes reserved at construction.
    fn sequence_bytes(&self, _: Footprint) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let codes = self.codes.as_ref().map_or(0, |c| match c {
            Coded::VecInfer(c) => bytes(&c.key_codes) + bytes(&c.value_codes),
            Coded::Scalar(c) => c.bytes(),
        });
        (bytes(&self.rows) + codes) / self.rows.dim(1).unwrap_or(1).max(1)
    }
}
