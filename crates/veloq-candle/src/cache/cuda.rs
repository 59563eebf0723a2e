//! veloq's CUDA kernels behind the candle caches (feature `cuda`): the per-device runtime, the
//! VecInfer cache ([`CudaVecInferCache`]) and the fp16 cache's CUDA path (`DenseKernels`, used by
//! [`TensorCache`](super::TensorCache)). Codes, sink and window live in GPU memory and the kernels
//! run on candle's stream, so they order with the model's own launches.
//!
//! Layout per stream (one kv head of one sequence): codes `[capacity, subspaces]` bytes for keys
//! and for values; f16 rows `[sink + ring, head_dim]`, where the first `sink` rows keep the first
//! positions for good and the ring holds the recent ones (attention does not care about order).
//! A decode step is 2 launches: the new row into the ring, then attention over codes + f16 rows
//! (on tensor cores one kernel whose last block per stream merges; the table kernel and, while
//! nothing is coded, the window alone take a separate merge launch). When the ring reaches `window + flush_block` rows after
//! attending, its oldest `flush_block` rows are quantized in place (one launch for keys, one for
//! values), so quantizing costs 2 launches every `flush_block` steps. Prefill attends exactly and
//! quantizes all but the window straight from the prompt's keys and values.
//!
//! Same policy as the CPU [`VecInferCache`](super::VecInferCache) (sink, window, flush after
//! attending), so the two agree to rounding.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaView};
use half::f16;

use veloq::codec::vecinfer::VecInferCodec;
use veloq::kernels::cuda::{AttentionScratch, Coded, Gpu, GpuAttention, GpuCodec, GpuDenseAttention, PutMap, PutRows, RowMap, Window, WindowMap, MAX_WINDOW};

use super::store::WindowConfig;
use super::tensor::attend_tensors;
use super::LayerCache;
use crate::error::{Error, Result};

fn dev(e: impl std::fmt::Debug) -> Error {
    Error::Codec(veloq::Error::Device(format!("{e:?}")))
}

/// veloq's kernels on one candle CUDA device, shared by the layers of a model (one scratch for
/// the attention partials: layers run one after another).
pub struct CudaRuntime {
    gpu: Gpu,
    device: CudaDevice,
    /// The scratch and the partials (batch × q-heads × splits) and head_dim it holds.
    scratch: Mutex<Option<(usize, usize, AttentionScratch)>>,
}

impl CudaRuntime {
    /// The runtime of `device`, one per device and process (kernels compile once); an error for
    /// other devices.
    pub fn new(device: &Device) -> Result<Arc<Self>> {
        static RUNTIMES: Mutex<Vec<Arc<CudaRuntime>>> = Mutex::new(Vec::new());
        let Device::Cuda(cuda) = device else {
            return Err(Error::Config(format!("veloq's CUDA kernels need a CUDA device, got {device:?}")));
        };
        let mut all = RUNTIMES.lock().expect("runtime registry lock");
        if let Some(rt) = all.iter().find(|rt| rt.device.same_device(cuda)) {
            return Ok(rt.clone());
        }
        let gpu = Gpu::from_stream(cuda.cuda_stream())?;
        let rt = Arc::new(Self { gpu, device: cuda.clone(), scratch: Mutex::new(None) });
        all.push(rt.clone());
        Ok(rt)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Runs `f` with a scratch for at least `entries` (batch × q-heads × splits) partials.
    pub(crate) fn with_scratch<R>(&self, entries: usize, head_dim: usize, f: impl FnOnce(&mut AttentionScratch) -> Result<R>) -> Result<R> {
        let mut guard = self.scratch.lock().expect("scratch lock");
        if guard.as_ref().map_or(true, |(have, d, _)| *have < entries || *d < head_dim) {
            let grown = entries.max(1).next_power_of_two();
            let d = guard.as_ref().map_or(head_dim, |g| g.1.max(head_dim));
            *guard = Some((grown, d, AttentionScratch::new(&self.gpu, 1, grown, d, 1)?));
        }
        f(&mut guard.as_mut().expect("just set").2)
    }

    /// Wraps `slice` (f32) as a candle tensor of `shape`.
    pub(crate) fn tensor(&self, slice: CudaSlice<f32>, shape: (usize, usize, usize, usize)) -> Tensor {
        let storage = CudaStorage::wrap_cuda_slice(slice, self.device.clone());
        Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
    }
}

/// Runs `f` on the device memory of `t` (contiguous, on a CUDA device) as elements of `T`.
pub(crate) fn with_view<T: candle_core::cuda_backend::CudaDType, R>(t: &Tensor, f: impl FnOnce(CudaView<T>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(Error::Config(format!("expected a CUDA tensor, got one on {:?}", t.device())));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::Config("expected a contiguous tensor".into()));
    };
    f(cuda.as_cuda_slice::<T>()?.slice(start..end))
}

/// An f16 tensor's memory as the raw 16-bit words veloq's kernels take.
pub(crate) fn as_bits<'a>(v: &CudaView<'a, f16>) -> CudaView<'a, u16> {
    // SAFETY: f16 and u16 have the same size and alignment; the kernels read the bits as f16.
    unsafe { v.transmute::<u16>(v.len()).expect("same size") }
}

/// Codes of keys and values, `[streams, capacity, row bytes]` each; the first `len` positions
/// of every stream filled.
struct Codes {
    keys: CudaSlice<u8>,
    values: CudaSlice<u8>,
    len: usize,
    capacity: usize,
}

impl Codes {
    /// Codes the vectors `input` picks from `x` (keys) and `y` (values), f16 bits, after the
    /// filled positions (its output fields are set here). Two launches.
    fn write(&mut self, attn: &GpuAttention, gpu: &Gpu, streams: usize, x: &CudaView<u16>, y: &CudaView<u16>, input: RowMap) -> Result<usize> {
        let t = input.t.max(0) as usize;
        if t == 0 {
            return Ok(0);
        }
        if self.len + t > self.capacity {
            return Err(Error::Config(format!("{} coded positions would exceed the capacity of {}", self.len + t, self.capacity)));
        }
        let map = RowMap { out_hs: self.capacity as i64, out_ts: 1, out_base: self.len as i32, ..input };
        attn.keys.quantize_mapped(gpu, x, streams, map, &mut self.keys)?;
        attn.values.quantize_mapped(gpu, y, streams, map, &mut self.values)?;
        self.len += t;
        Ok(2)
    }
}

pub struct CudaVecInferCache {
    rt: Arc<CudaRuntime>,
    attn: GpuAttention,
    put: PutRows,
    cfg: WindowConfig,
    batch: usize,
    n_kv: usize,
    head_dim: usize,
    codes: Codes,
    /// f16 rows: keys `[streams, sink + ring, head_dim]`, then values the same.
    w: CudaSlice<u16>,
    n_sink: usize,
    ring_head: usize,
    ring_len: usize,
    /// A prompt's keys and values (f32 `[B, n_kv, T, D]`), attended exactly, coded at commit.
    pending: Option<(Tensor, Tensor)>,
    launches: usize,
}

impl CudaVecInferCache {
    /// A cache for `batch` sequences of up to `capacity` positions each, `q_heads` query heads
    /// (allocated now, like [`TensorCache`](super::TensorCache)).
    pub fn new(
        rt: Arc<CudaRuntime>,
        keys: &VecInferCodec,
        values: &VecInferCodec,
        q_heads: usize,
        batch: usize,
        capacity: usize,
        cfg: WindowConfig,
    ) -> Result<Self> {
        GpuAttention::supports(keys, values, q_heads).map_err(|e| Error::Codec(veloq::Error::Device(e)))?;
        let rows = cfg.sink + cfg.window + cfg.flush_block;
        if cfg.flush_block == 0 || rows > MAX_WINDOW || batch == 0 {
            return Err(Error::Config(format!(
                "CUDA VecInfer cache: sink + window + flush_block = {rows} must be ≤ {MAX_WINDOW}, flush_block and batch positive"
            )));
        }
        let gpu = rt.gpu();
        let attn = GpuAttention::new(GpuCodec::upload(gpu, keys)?, GpuCodec::upload(gpu, values)?, q_heads)?;
        let (n_kv, head_dim) = (keys.n_heads(), keys.head_dim());
        // Compile now, not inside the first decode steps.
        attn.prepare(gpu)?;
        attn.keys.prepare(gpu)?;
        attn.values.prepare(gpu)?;
        let put = PutRows::new(gpu, head_dim)?;
        let streams = batch * n_kv;
        let alloc8 = |n: usize| gpu.stream().alloc_zeros::<u8>(n.max(1)).map_err(dev);
        let alloc16 = |n: usize| gpu.stream().alloc_zeros::<u16>(n).map_err(dev);
        let codes = Codes {
            keys: alloc8(streams * capacity * attn.keys.row_bytes())?,
            values: alloc8(streams * capacity * attn.values.row_bytes())?,
            len: 0,
            capacity,
        };
        Ok(Self {
            codes,
            w: alloc16(2 * streams * rows * head_dim)?,
            rt,
            attn,
            put,
            cfg,
            batch,
            n_kv,
            head_dim,
            n_sink: 0,
            ring_head: 0,
            ring_len: 0,
            pending: None,
            launches: 0,
        })
    }

    fn ring_cap(&self) -> usize {
        self.cfg.window + self.cfg.flush_block
    }
    fn rows(&self) -> usize {
        self.cfg.sink + self.ring_cap()
    }
    fn streams(&self) -> usize {
        self.batch * self.n_kv
    }
    /// Elements of the keys' (or values') f16 rows.
    fn plane(&self) -> usize {
        self.streams() * self.rows() * self.head_dim
    }

    fn window_map(&self) -> WindowMap {
        WindowMap {
            n_sink: self.n_sink as i32,
            sink_cap: self.cfg.sink as i32,
            ring_head: self.ring_head as i32,
            ring_len: self.ring_len as i32,
            ring_cap: self.ring_cap() as i32,
        }
    }

    /// Rows `src0..src0 + t` of `k`/`v` (f32 `[B, n_kv, src_t, D]`) into the sink, then the ring.
    fn put(&mut self, k: &Tensor, v: &Tensor, src0: usize, t: usize) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        let to_sink = (self.cfg.sink - self.n_sink).min(t);
        if self.ring_len + t - to_sink > self.ring_cap() {
            return Err(Error::Config(format!("{t} rows do not fit the ring ({} of {} used)", self.ring_len, self.ring_cap())));
        }
        let map = PutMap {
            t: t as i32,
            src_t: k.dim(2)? as i32,
            src0: src0 as i32,
            n_sink: to_sink as i32,
            sink0: self.n_sink as i32,
            sink_cap: self.cfg.sink as i32,
            ring0: ((self.ring_head + self.ring_len) % self.ring_cap()) as i32,
            ring_cap: self.ring_cap() as i32,
        };
        let (streams, rows) = (self.streams(), self.rows());
        let (gpu, put, w) = (self.rt.gpu(), &self.put, &mut self.w);
        with_view::<f32, _>(k, |kv| with_view::<f32, _>(v, |vv| Ok(put.launch(gpu, &kv, &vv, streams, &mut w.as_view_mut(), rows, map)?)))?;
        self.n_sink += to_sink;
        self.ring_len += t - to_sink;
        self.launches += 1;
        Ok(())
    }

    /// Codes the oldest `n` ring rows (two launches, wherever the ring wraps).
    fn code_ring(&mut self, n: usize) -> Result<()> {
        let (cap, rows, sink, streams, plane) = (self.ring_cap(), self.rows(), self.cfg.sink, self.streams(), self.plane());
        let input = RowMap { in_wrap: cap as i32, in_off: sink as i32, ..RowMap::streams(n, rows, self.ring_head, 0, 0) };
        let (x, y) = (self.w.slice(..plane), self.w.slice(plane..));
        self.launches += self.codes.write(&self.attn, self.rt.gpu(), streams, &x, &y, input)?;
        self.ring_head = (self.ring_head + n) % cap;
        self.ring_len -= n;
        Ok(())
    }

    /// Codes ring rows until fewer than `window + flush_block` remain (whole blocks, oldest first).
    fn flush_ring(&mut self) -> Result<()> {
        let (w, b) = (self.cfg.window, self.cfg.flush_block);
        if self.ring_len >= w + b {
            self.code_ring((self.ring_len - w) / b * b)?;
        }
        Ok(())
    }

    /// Moves a prompt into sink, codes and ring: the first positions to the sink, the newest
    /// `window..window + flush_block` to the ring, everything between coded (the ring's older rows
    /// first, then the prompt's straight from its f16 copy).
    fn settle(&mut self, k: Tensor, v: Tensor) -> Result<()> {
        let t = k.dim(2)?;
        let to_sink = (self.cfg.sink - self.n_sink).min(t);
        self.put(&k, &v, 0, to_sink)?;
        let rest = t - to_sink;
        let total = self.ring_len + rest;
        let (w, b) = (self.cfg.window, self.cfg.flush_block);
        if total < w + b {
            return self.put(&k, &v, to_sink, rest);
        }
        let n_code = (total - w) / b * b;
        let from_ring = n_code.min(self.ring_len);
        self.code_ring(from_ring)?;
        let from_new = n_code - from_ring;
        if from_new > 0 {
            let (k16, v16) = (k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?);
            self.launches += 2;
            let streams = self.streams();
            let (codes, attn, gpu) = (&mut self.codes, &self.attn, self.rt.gpu());
            self.launches += with_view::<f16, _>(&k16, |kx| {
                with_view::<f16, _>(&v16, |vx| codes.write(attn, gpu, streams, &as_bits(&kx), &as_bits(&vx), RowMap::streams(from_new, t, to_sink, 0, 0)))
            })?;
        }
        self.put(&k, &v, to_sink + from_new, rest - from_new)
    }

    fn settle_pending(&mut self) -> Result<()> {
        match self.pending.take() {
            Some((k, v)) => self.settle(k, v),
            None => Ok(()),
        }
    }

    /// Exact keys and values of every position (f16 rows in position order, then the prompt), for
    /// prefill; only while nothing is coded.
    fn exact_rows(&self) -> Result<(Tensor, Tensor)> {
        let (b, h, d, rows) = (self.batch, self.n_kv, self.head_dim, self.rows());
        let order: Vec<u32> = (0..self.n_sink).chain((0..self.ring_len).map(|i| self.cfg.sink + (self.ring_head + i) % self.ring_cap())).map(|r| r as u32).collect();
        let pending = self.pending.clone();
        if order.is_empty() {
            // Nothing in f16 rows yet (zero-sized copies are errors on CUDA).
            return pending.ok_or_else(|| Error::Config("nothing to attend".into()));
        }
        let stream = self.rt.gpu().stream();
        let plane = self.plane();
        let copy = |src: CudaView<u16>| -> Result<Tensor> {
            let mut dst = stream.alloc_zeros::<f16>(src.len()).map_err(dev)?;
            // SAFETY: same size; the rows hold f16 bits.
            let view = unsafe { src.transmute::<f16>(src.len()).expect("same size") };
            stream.memcpy_dtod(&view, &mut dst).map_err(dev)?;
            let storage = CudaStorage::wrap_cuda_slice(dst, self.rt.device.clone());
            Ok(Tensor::from_storage(Storage::Cuda(storage), (b, h, rows, d), BackpropOp::none(), false))
        };
        let idx = Tensor::new(order.as_slice(), &Device::Cuda(self.rt.device.clone()))?;
        let (mut k, mut v) = (copy(self.w.slice(..plane))?.index_select(&idx, 2)?.to_dtype(DType::F32)?, copy(self.w.slice(plane..))?.index_select(&idx, 2)?.to_dtype(DType::F32)?);
        if let Some((pk, pv)) = &pending {
            k = Tensor::cat(&[&k, pk], 2)?;
            v = Tensor::cat(&[&v, pv], 2)?;
        }
        Ok((k, v))
    }

    /// One query per sequence over codes and f16 rows: the fused kernels.
    fn attend_decode(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (b, hq, _, d) = q.dims4()?;
        let q = q.to_dtype(DType::F32)?.contiguous()?;
        let gpu = self.rt.gpu();
        let nsplit = if self.codes.len == 0 { 0 } else { self.attn.splits(gpu, b, self.codes.len) };
        // SAFETY: every element is written by the merge kernel before it is read.
        let mut out = unsafe { gpu.stream().alloc::<f32>(b * hq * d) }.map_err(dev)?;
        let coded = Coded { keys: &self.codes.keys, values: &self.codes.values, len: self.codes.len, stride: self.codes.capacity };
        let plane = self.plane();
        let window = Window { keys: self.w.slice(..plane), values: self.w.slice(plane..), rows: self.rows(), map: self.window_map() };
        let attn = &self.attn;
        self.launches += self.rt.with_scratch(b * hq * nsplit, d, |scratch| {
            with_view::<f32, _>(&q, |qv| Ok(attn.attend_cache(gpu, &qv, b, &coded, &window, scale as f32, scratch, &mut out)?))
        })?;
        Ok(self.rt.tensor(out, (b, hq, 1, d)))
    }
}

impl LayerCache for CudaVecInferCache {
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let (b, h, d) = (self.batch, self.n_kv, self.head_dim);
        let (kb, kh, t, kd) = k.dims4()?;
        if (kb, kh, kd) != (b, h, d) || v.dims4()? != (kb, kh, t, kd) {
            return Err(Error::Config(format!("CUDA VecInfer cache holds {b}×{h}×{d}, got keys {:?} and values {:?}", k.dims(), v.dims())));
        }
        if self.len() + t > self.codes.capacity {
            return Err(Error::ContextOverflow { requested: self.len() + t, max: self.codes.capacity });
        }
        self.commit()?;
        let (k, v) = (k.to_dtype(DType::F32)?.contiguous()?, v.to_dtype(DType::F32)?.contiguous()?);
        let room = (self.cfg.sink - self.n_sink) + (self.ring_cap() - self.ring_len);
        if t <= room {
            self.put(&k, &v, 0, t)
        } else {
            self.pending = Some((k, v));
            Ok(())
        }
    }

    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor> {
        let t = q.dim(2)?;
        let y = if t == 1 {
            self.settle_pending()?;
            self.attend_decode(q, scale)?
        } else {
            if self.codes.len > 0 {
                return Err(Error::Config(format!(
                    "the CUDA VecInfer cache attends several queries only before anything is coded ({} positions are); feed later tokens one at a time",
                    self.codes.len
                )));
            }
            let (k, v) = self.exact_rows()?;
            attend_tensors(q, &k, &v, k.dim(2)?, scale)?
        };
        self.commit()?;
        Ok(y)
    }

    fn len(&self) -> usize {
        let pending = self.pending.as_ref().map_or(0, |(k, _)| k.dim(2).unwrap_or(0));
        self.n_sink + self.codes.len + self.ring_len + pending
    }

    /// Codes and f16 rows as allocated (the whole capacity), plus the codec tables.
    fn resident_bytes(&self) -> usize {
        self.codes.keys.len() + self.codes.values.len() + 2 * self.w.len() + self.attn.keys.table_bytes() + self.attn.values.table_bytes()
    }

    /// Drops recent positions still in f16 (not coded ones).
    fn truncate(&mut self, len: usize) -> Result<()> {
        self.commit()?;
        let fixed = self.n_sink + self.codes.len;
        if len < fixed || len > self.len() {
            if len == 0 {
                (self.n_sink, self.ring_head, self.ring_len, self.codes.len) = (0, 0, 0, 0);
                return Ok(());
            }
            return Err(Error::Config(format!("the CUDA VecInfer cache can keep 0 or {fixed}..={} positions, not {len}", self.len())));
        }
        self.ring_len = len - fixed;
        Ok(())
    }

    fn commit(&mut self) -> Result<()> {
        self.settle_pending()?;
        self.flush_ring()
    }

    fn launches(&self) -> usize {
        self.launches
    }
}

/// The fp16 cache's CUDA path ([`TensorCache`](super::TensorCache) on a CUDA device): one launch
/// per append (f32 → f16 into the reserved tensor) and flash-decoding attention over the f16
/// rows (two launches), the same structure as the code kernels, so end-to-end comparisons are
/// kernel against kernel rather than against candle's generic matmuls.
pub(crate) struct DenseKernels {
    rt: Arc<CudaRuntime>,
    attn: GpuDenseAttention,
    put: PutRows,
}

impl DenseKernels {
    /// `Some` on CUDA devices, kernels compiled.
    pub(crate) fn new(device: &Device, q_heads: usize, n_kv: usize, head_dim: usize) -> Result<Option<Self>> {
        let Device::Cuda(_) = device else { return Ok(None) };
        let rt = CudaRuntime::new(device)?;
        let attn = GpuDenseAttention::new(q_heads, n_kv, head_dim)?;
        attn.prepare(rt.gpu())?;
        let put = PutRows::new(rt.gpu(), head_dim)?;
        Ok(Some(Self { rt, attn, put }))
    }

    /// Writes `k`/`v` (`[B, h, T, D]`) at positions `len..len + T` of `kv` (`[2, B, h, cap, D]` f16).
    pub(crate) fn append(&self, kv: &Tensor, k: &Tensor, v: &Tensor, len: usize) -> Result<()> {
        let (_, b, h, cap, _) = kv.dims5()?;
        let t = k.dim(2)?;
        let (k, v) = (k.to_dtype(DType::F32)?.contiguous()?, v.to_dtype(DType::F32)?.contiguous()?);
        let map = PutMap { t: t as i32, src_t: t as i32, src0: 0, n_sink: 0, sink0: 0, sink_cap: 0, ring0: len as i32, ring_cap: cap as i32 };
        kv.inplace_op1(&PutOp { gpu: self.rt.gpu(), put: &self.put, k: &k, v: &v, streams: b * h, rows: cap, map })?;
        Ok(())
    }

    /// One query per sequence (`q`: `[B, Hq, 1, D]`) over the first `len` positions of `kv`.
    pub(crate) fn attend(&self, q: &Tensor, kv: &Tensor, len: usize, scale: f64) -> Result<Tensor> {
        let (b, hq, _, d) = q.dims4()?;
        let (_, _, h, cap, _) = kv.dims5()?;
        let attn = &self.attn;
        let q = q.to_dtype(DType::F32)?.contiguous()?;
        let gpu = self.rt.gpu();
        let nsplit = attn.splits(gpu, b, len);
        // SAFETY: every element is written by the merge kernel before it is read.
        let mut out = unsafe { gpu.stream().alloc::<f32>(b * hq * d) }.map_err(dev)?;
        let plane = b * h * cap * d;
        with_view::<f16, _>(kv, |all| {
            let (kx, vx) = (all.slice(..plane), all.slice(plane..));
            self.rt.with_scratch(b * hq * nsplit, d, |scratch| {
                with_view::<f32, _>(&q, |qv| Ok(attn.attend(gpu, &qv, &as_bits(&kx), &as_bits(&vx), b, len, cap, scale as f32, scratch, &mut out)?))
            })
        })?;
        Ok(self.rt.tensor(out, (b, hq, 1, d)))
    }
}

/// New rows into a reserved f16 tensor in place (candle hands out the storage mutably only to
/// in-place ops).
struct PutOp<'a> {
    gpu: &'a Gpu,
    put: &'a PutRows,
    k: &'a Tensor,
    v: &'a Tensor,
    streams: usize,
    rows: usize,
    map: PutMap,
}

impl candle_core::InplaceOp1 for PutOp<'_> {
    fn name(&self) -> &'static str {
        "veloq-put-rows"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &candle_core::Layout) -> candle_core::Result<()> {
        candle_core::bail!("veloq-put-rows runs on CUDA devices only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &candle_core::Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("veloq-put-rows needs a contiguous destination");
        };
        let mut dst = storage.as_cuda_slice_mut::<f16>()?.slice_mut(start..end);
        // SAFETY: f16 and u16 have the same size and alignment; the kernel writes f16 bits.
        let mut bits = unsafe { dst.transmute_mut::<u16>(end - start) }.expect("same size");
        let (s, rows, map) = (self.streams, self.rows, self.map);
        let r = with_view::<f32, _>(self.k, |k| with_view::<f32, _>(self.v, |v| Ok(self.put.launch(self.gpu, &k, &v, s, &mut bits, rows, map)?)));
        r.map_err(candle_core::Error::wrap)
    }
}
