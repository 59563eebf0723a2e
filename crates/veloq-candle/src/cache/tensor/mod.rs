//! The portable backend: a layer's f16 rows and codes in candle tensors on any device, every
//! operation in candle ops (`slice_set` for rows, the tensor codec for codes, tiled partials for
//! attention). What `KernelChoice::Forbid` selects and what devices without fused kernels get;
//! the CUDA backend keeps the same storage and replaces the hot operations with kernels.
//!
//! Storage per layer, allocated up front (a serving engine's reservation): f16 rows
//! `[2, slots, kv, rows, D]` (keys, then values: one allocation, so a kernel writing both takes
//! one mutable borrow); codes `[slots, kv, capacity, M]` for keys and for values (u8 for ≤ 256
//! centroids).

pub mod attention;
pub mod codec;

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

use veloq::codec::vecinfer::VecInferCodec;

use self::attention::{codes_state, fold_rows, RowChunk, State, ROW_CHUNK};
use self::codec::TensorCodec;
use super::backend::{Backend, Heads};
use super::residency::{Footprint, Put, Quantize, Restore, RowRun, RowSource, SeqView};
use crate::error::{Error, Result};

/// Queries per tile of the partials (bounds the scratch with the chunks).
const QUERY_TILE: usize = 128;

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
    pub codes: Option<TensorCodes>,
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
        b.codes = Some(TensorCodes { key_codes: codes(&kc)?, value_codes: codes(&vc)?, keys: kc, values: vc });
        Ok(b)
    }

    fn codes(&self) -> Result<&TensorCodes> {
        self.codes.as_ref().ok_or_else(|| Error::Config("a dense cache holds no codes".into()))
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
    pub(crate) fn queries(&self, q: &Tensor, v: &SeqView, i0: usize, i1: usize, scale: f32) -> Result<Tensor> {
        Ok((q.narrow(0, v.queries.start + i0, i1 - i0)?.to_dtype(DType::F32)? * scale as f64)?
            .transpose(0, 1)?
            .contiguous()?)
    }

    /// Runs `f` per (view, tile of at most `tile` queries) on `[Hq, n, D]` queries and packs the
    /// states into `[tokens, Hq, ·]`.
    pub(crate) fn per_tile(
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
        let c = self.codes()?;
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
            for (codec, rows, dst) in [(&c.keys, cat(0)?, &c.key_codes), (&c.values, cat(1)?, &c.value_codes)] {
                let codes = codec.quantize(&rows)?.transpose(0, 1)?.contiguous()?.unsqueeze(0)?; // [1, kv, n, M]
                dst.narrow(0, q.slot, 1)?.slice_set(&codes, 2, q.at)?;
            }
        }
        Ok(())
    }

    fn restore(&mut self, r: &Restore) -> Result<()> {
        if r.n == 0 {
            return Ok(());
        }
        let c = self.codes()?;
        let decode = |codec: &TensorCodec, codes: &Tensor| -> Result<Tensor> {
            let part = codes.get(r.slot)?.narrow(1, r.keep, r.n)?.transpose(0, 1)?.contiguous()?; // [n, kv, M]
            Ok(codec.decode(&part)?.to_dtype(DType::F16)?.transpose(0, 1)?) // [kv, n, D]
        };
        let (k, v) = (decode(&c.keys, &c.key_codes)?, decode(&c.values, &c.value_codes)?);
        self.write_rows(r.slot, r.to, &k, &v)
    }

    fn attend_codes(&self, q: &Tensor, views: &[SeqView], scale: f32) -> Result<TensorPartial> {
        let c = self.codes()?;
        let (hq, d) = (self.heads.q, self.heads.dim);
        self.per_tile(q, views, scale, QUERY_TILE, |v, qs, _| {
            if v.coded == 0 {
                return State::empty(hq, qs.dim(1)?, d, &self.device);
            }
            let slot = |t: &Tensor| t.get(v.slot);
            codes_state(qs, (&c.keys, &slot(&c.key_codes)?), (&c.values, &slot(&c.value_codes)?), v.coded)
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
        let codes = self.codes.as_ref().map_or(0, |c| {
            bytes(&c.key_codes) + bytes(&c.value_codes) + c.keys.resident_bytes() + c.values.resident_bytes()
        });
        bytes(&self.rows) + codes
    }

    /// A slot's share of the rows and codes reserved at construction.
    fn sequence_bytes(&self, _: Footprint) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let codes = self.codes.as_ref().map_or(0, |c| bytes(&c.key_codes) + bytes(&c.value_codes));
        (bytes(&self.rows) + codes) / self.rows.dim(1).unwrap_or(1).max(1)
    }
}
