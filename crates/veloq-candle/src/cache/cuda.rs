//! The CUDA backend (feature `cuda`): the portable backend's storage (candle tensors on the GPU)
//! with veloq's CUDA kernels for the hot operations, on candle's stream so they order with the
//! model's own launches:
//! - new rows into the f16 sink and ring (`window.cu`, keys and values in one launch for every
//!   sequence whose rows go to the same place, e.g. a batch decoding together);
//! - codes from ring rows or from a step's rows (`quantize.cu`, keys and values in one launch);
//!   a decode step's flush of ring rows runs on a second stream (see [`CudaRuntime`]), off the
//!   step's critical path;
//! - decode attention (one query per sequence, its rows all stored): over codes and f16 rows in
//!   one launch on tensor cores (`attention_mma.cu`, merging in its last block per stream), two on
//!   lookup tables; over an fp16 cache, flash-decoding (`dense.cu`, two launches).
//!
//! - blocks of queries (prefill chunks, follow-up turns): `prefill.cu`'s kernels over the codes
//!   and over each run of f16 rows (sink, ring, the step's own rows read in place from the
//!   input), then one fold of their splits into the output — a handful of launches per 1,024
//!   queries, no tensor ops.
//!
//! Sequences decode together in one launch when their storage is laid out alike (consecutive
//! slots, same sink, coded span and ring state), as a batch started together is; a ragged batch
//! (each sequence at its own position) takes the launches of one such group, reading a table per
//! sequence (`CudaBackend::decode_ragged`: one on tensor cores, two on lookup tables and for
//! fp16's flash-decoding, the merge alone while nothing is coded), and a decode
//! step's new rows go in with one launch either way. Sliding-window layers (decode and prefill)
//! take the prefill kernels with the window in their mask; truncation into codes is the portable
//! backend's candle ops.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Layout, Storage, Tensor};
use cudarc::driver::{CudaEvent, CudaSlice, CudaView, CudaViewMut};
use half::f16;

use veloq::codec::vecinfer::VecInferCodec;
use veloq::kernels::cuda::{
    dense_ragged_entry, quantize_jobs, ragged_entry, AttentionScratch, Coded, Gpu, GpuAttention, GpuCodec,
    GpuDenseAttention, GpuPrefill, GpuPrefillCodes, PrefillOut, PrefillParts, PutMap, PutRows, QuantizeJob,
    QuantizeLaunch, Ragged, RowMap, Rows, RowsAround, Split, Window, WindowMap, MAX_WINDOW, PREFILL_MAX_RUNS,
};

use super::backend::{compose, Backend, Heads};
use super::residency::{Put, Quantize, Restore, RowRun, RowSource, RowSpan, SeqView};
use super::tensor::{TensorBackend, TensorInput, TensorPartial};
use crate::cuda_options::CudaOptions;
use crate::error::{Error, Result};

/// veloq's kernels on one candle CUDA device, shared by the layers of a model: one scratch for
/// the attention partials (layers run one after another) and a count of the launches issued.
///
/// Flushes (the ring's oldest rows into codes, every few decode steps) go to a second stream:
/// nothing in the rest of the step reads them, so they run beside the next layers' products
/// instead of between them, and a layer's next use of its storage waits for them (an event per
/// layer). Only when cudarc's per-buffer event tracking is off (as a device opened through
/// [`runtime::Device::open`](crate::runtime::Device::open) runs): with it on, a second stream would
/// make cudarc track every launch of the process. [`CudaOptions::flush_stream`] off (or
/// [`set_flushes_aside`](Self::set_flushes_aside)) keeps them on the main stream.
pub struct CudaRuntime {
    gpu: Gpu,
    flush: Option<Gpu>,
    aside: AtomicBool,
    /// [`CudaOptions::gemv`]: f16 weights of a decode step take veloq's GEMV.
    gemv: AtomicBool,
    /// [`CudaOptions::f16_rows`].
    f16_rows: AtomicBool,
    /// [`CudaOptions::ragged_decode`].
    ragged: AtomicBool,
    device: CudaDevice,
    scratch: Mutex<Option<AttentionScratch>>,
    /// The ragged tables uploaded last, most recent at the end ([`table`](Self::table)).
    tables: Mutex<Vec<KeptTable>>,
    launches: AtomicUsize,
}

/// Ragged tables kept on the device: a step's puts, its coded layers' and its f16 layers'.
const TABLES_KEPT: usize = 4;

/// A ragged table as the host wrote it, and its device copy.
type KeptTable = (Vec<i32>, Arc<CudaSlice<i32>>);

impl CudaRuntime {
    /// The runtime of `device`, one per device and process (kernels compile once), with the
    /// options it was configured with ([`configure`](Self::configure); the defaults otherwise);
    /// an error for other devices.
    pub fn new(device: &Device) -> Result<Arc<Self>> {
        Self::registry(device, None)
    }

    /// The runtime of `device` with `options` from now on (created if it is the first use).
    pub fn configure(device: &Device, options: &CudaOptions) -> Result<Arc<Self>> {
        Self::registry(device, Some(options))
    }

    fn registry(device: &Device, options: Option<&CudaOptions>) -> Result<Arc<Self>> {
        static RUNTIMES: Mutex<Vec<Arc<CudaRuntime>>> = Mutex::new(Vec::new());
        let Device::Cuda(cuda) = device else {
            return Err(Error::Device(format!("veloq's CUDA kernels need a CUDA device, got {device:?}")));
        };
        let mut all = RUNTIMES.lock().expect("runtime registry lock");
        if let Some(rt) = all.iter().find(|rt| rt.device.same_device(cuda)) {
            if let Some(o) = options {
                rt.set_options(o)?;
            }
            return Ok(rt.clone());
        }
        let defaults = CudaOptions::default();
        let options = options.unwrap_or(&defaults);
        let gpu = Gpu::from_stream(cuda.cuda_stream(), options.kernels.clone())?;
        gpu.keep_freed_memory(options.keep_freed_memory)?;
        let ctx = gpu.context();
        let flush = match ctx.is_event_tracking() {
            false => Some(Gpu::from_stream(ctx.new_stream().map_err(veloq::Error::from)?, options.kernels.clone())?),
            true => None,
        };
        let rt = Arc::new(Self {
            gpu,
            flush,
            aside: AtomicBool::new(options.flush_stream),
            gemv: AtomicBool::new(options.gemv),
            f16_rows: AtomicBool::new(options.f16_rows),
            ragged: AtomicBool::new(options.ragged_decode),
            device: cuda.clone(),
            scratch: Mutex::new(None),
            tables: Mutex::new(Vec::new()),
            launches: AtomicUsize::new(0),
        });
        all.push(rt.clone());
        Ok(rt)
    }

    /// The GPU handle the kernels launch on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Options for what runs from now on (kernels compiled so far stay; CUDA graphs replay what
    /// they captured, and are keyed by the options they depend on).
    pub fn set_options(&self, options: &CudaOptions) -> Result<()> {
        self.gpu.set_options(options.kernels.clone());
        if let Some(f) = &self.flush {
            f.set_options(options.kernels.clone());
        }
        self.aside.store(options.flush_stream, Ordering::Relaxed);
        self.gemv.store(options.gemv, Ordering::Relaxed);
        self.f16_rows.store(options.f16_rows, Ordering::Relaxed);
        self.ragged.store(options.ragged_decode, Ordering::Relaxed);
        Ok(self.gpu.keep_freed_memory(options.keep_freed_memory)?)
    }

    /// Whether f16 weights of decode steps take veloq's GEMV ([`CudaOptions::gemv`]).
    pub fn gemv(&self) -> bool {
        self.gemv.load(Ordering::Relaxed)
    }

    /// Whether many-row steps over f16 weights take the f16 row path ([`CudaOptions::f16_rows`]).
    pub fn f16_rows(&self) -> bool {
        self.f16_rows.load(Ordering::Relaxed)
    }

    /// Whether sequences at different positions decode in one batch's launches
    /// ([`CudaOptions::ragged_decode`]).
    pub fn ragged_decode(&self) -> bool {
        self.ragged.load(Ordering::Relaxed)
    }

    /// Whether flushes run on their own stream.
    pub fn flushes_aside(&self) -> bool {
        self.flush.is_some() && self.aside.load(Ordering::Relaxed)
    }

    /// Flushes on their own stream (where event tracking is off) or on the main one, from the
    /// next flush on (for comparisons in one process).
    pub fn set_flushes_aside(&self, on: bool) {
        self.aside.store(on, Ordering::Relaxed);
    }

    /// Kernel launches veloq has issued on this device (candle's own ops not counted).
    pub fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    fn count(&self, n: usize) {
        self.launches.fetch_add(n, Ordering::Relaxed);
    }

    /// The device copy of a ragged batch's table `host`. Every layer of a decode step passes the
    /// same tables (its sequences' slots, rows, lengths and windows do not change between
    /// layers), so the last few uploaded are handed out again: one upload a step, not one a
    /// layer. Kernels only read them, and one dropped while a queued kernel still reads it is
    /// freed in stream order.
    fn table(&self, host: &[i32]) -> Result<Arc<CudaSlice<i32>>> {
        let mut kept = self.tables.lock().expect("tables lock");
        if let Some(i) = kept.iter().position(|(h, _)| h == host) {
            let hit = kept.remove(i);
            let table = hit.1.clone();
            kept.push(hit);
            return Ok(table);
        }
        let table = Arc::new(self.gpu.stream().clone_htod(host).map_err(veloq::Error::from)?);
        if kept.len() == TABLES_KEPT {
            kept.remove(0);
        }
        kept.push((host.to_vec(), table.clone()));
        Ok(table)
    }

    /// Runs `f` with a scratch for `partials` partials of `head_dim` and `streams` counters,
    /// grown (to powers of two) when a call needs more.
    fn with_scratch<R>(
        &self,
        partials: usize,
        streams: usize,
        head_dim: usize,
        f: impl FnOnce(&mut AttentionScratch) -> Result<R>,
    ) -> Result<R> {
        let mut guard = self.scratch.lock().expect("scratch lock");
        if !guard.as_ref().is_some_and(|s| s.fits(partials, streams, head_dim)) {
            let grow = |n: usize| n.max(1).next_power_of_two();
            *guard = Some(AttentionScratch::sized(&self.gpu, grow(partials), grow(streams), grow(head_dim))?);
        }
        f(guard.as_mut().expect("just set"))
    }
}

/// Runs `f` on the device memory of `t` (contiguous, on a CUDA device) as elements of `T`.
fn with_view<T: CudaDType, R>(t: &Tensor, f: impl FnOnce(CudaView<T>) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(Error::Shape(format!("expected a CUDA tensor, got one on {:?}", t.device())));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::Shape("expected a contiguous tensor".into()));
    };
    f(cuda.as_cuda_slice::<T>()?.slice(start..end))
}

/// `f` with views of a step's staged key and value rows, where it has them.
fn with_staged<R>(
    staged: Option<&(Tensor, Tensor)>,
    f: impl FnOnce(Option<(CudaView<f16>, CudaView<f16>)>) -> Result<R>,
) -> Result<R> {
    match staged {
        Some((k, v)) => with_view::<f16, _>(k, |k| with_view::<f16, _>(v, |v| f(Some((k, v))))),
        None => f(None),
    }
}

/// A scratch of decoded codes (`[kv heads, n, head_dim]` keys and values) as a run of its `n`
/// rows, holding positions `pos0..`.
fn decoded_run<'a>(
    (k, v): &'a (CudaSlice<u16>, CudaSlice<u16>),
    (kv, d): (usize, usize),
    (pos0, n): (usize, usize),
    qpos0: usize,
    window: Option<usize>,
) -> Rows<'a> {
    Rows {
        keys: k.slice(..kv * n * d),
        values: v.slice(..kv * n * d),
        len: n,
        head_stride: n * d,
        row_stride: d,
        pos0,
        qpos0,
        window,
    }
}

/// An f16 buffer as the raw 16-bit words veloq's kernels take.
fn bits<'a>(v: &CudaView<'a, f16>) -> CudaView<'a, u16> {
    // SAFETY: f16 and u16 have the same size and alignment; the kernels read the bits as f16.
    unsafe { v.transmute::<u16>(v.len()).expect("same size") }
}

/// The key and value planes of a layer's f16 rows (every slot's keys, then every slot's values),
/// each from element `from` of its plane on.
fn planes<'a>(all: &CudaView<'a, f16>, from: usize) -> (CudaView<'a, u16>, CudaView<'a, u16>) {
    let plane = all.len() / 2;
    (bits(&all.slice(from..plane)), bits(&all.slice(plane + from..)))
}

/// Writes into a tensor's device memory with a kernel: candle hands storage out mutably only to
/// in-place ops. `f` gets the whole contiguous buffer, from the tensor's first element.
struct Write<'a, T, F: Fn(&mut CudaViewMut<T>) -> Result<()>> {
    f: &'a F,
    _elem: PhantomData<T>,
}

impl<T: CudaDType, F: Fn(&mut CudaViewMut<T>) -> Result<()>> candle_core::InplaceOp1 for Write<'_, T, F> {
    fn name(&self) -> &'static str {
        "veloq-kernel-write"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("veloq's CUDA kernels write CUDA tensors only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("veloq's kernels write contiguous tensors only");
        };
        let mut dst = storage.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
        (self.f)(&mut dst).map_err(candle_core::Error::wrap)
    }
}

fn write<T: CudaDType>(t: &Tensor, f: impl Fn(&mut CudaViewMut<T>) -> Result<()>) -> Result<()> {
    Ok(t.inplace_op1(&Write { f: &f, _elem: PhantomData })?)
}

/// [`write`] into two tensors at once (one kernel writing both: key and value codes).
fn write2<T: CudaDType>(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(&mut CudaViewMut<T>, &mut CudaViewMut<T>) -> Result<()>,
) -> Result<()> {
    write::<T>(a, |va| {
        let va = RefCell::new(va);
        write::<T>(b, |vb| f(&mut va.borrow_mut(), vb))
    })
}

/// Queries per tile of the prefill launches: a whole 512-token chunk in one; the partials of a
/// tile (splits × q heads × queries × D f32) stay a few tens of MiB.
const KERNEL_QUERY_TILE: usize = 1024;

/// Codes decoded per launch of the prefill attention over them: the scratch of a block of
/// queries (two f16 planes of this many positions), whatever the context.
const DECODE_BLOCK: usize = 8192;

/// The attention kernels of the layer's method: decode, and blocks of queries (prefill,
/// follow-up turns) over the f16 rows (and, VecInfer, over the codes decoded a block at a time).
enum Attention {
    Dense(GpuDenseAttention, GpuPrefill),
    Coded(Box<GpuAttention>, GpuPrefillCodes),
}

/// The portable backend's storage on a CUDA device, with veloq's kernels for the hot operations.
pub struct CudaBackend {
    base: TensorBackend,
    rt: Arc<CudaRuntime>,
    put: PutRows,
    attention: Attention,
    /// Codes per sequence (the stride of the code tensors), for coded layers.
    capacity: usize,
    /// Codes decoded per launch of the prefill attention over them ([`DECODE_BLOCK`]).
    decode_block: usize,
    /// A flush on the runtime's flush stream: `ready` marks the main stream's work it follows
    /// (the rows it codes), `done` its end, which the main stream waits for before it next
    /// touches this layer's storage (`pending` until then).
    flushed: Option<(CudaEvent, CudaEvent)>,
    pending: AtomicBool,
    /// The main stream's last launch was this layer's put of new rows (nothing since): the
    /// decode attention after it may start while it runs (`Window::just_written`).
    put_last: AtomicBool,
}

impl Drop for CudaBackend {
    /// Storage is freed on the main stream: a flush still writing it must finish first.
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// Runs of consecutive items that a predicate says belong together (`same(first, next, offset)`).
fn groups<T>(items: &[T], same: impl Fn(&T, &T, usize) -> bool) -> Vec<&[T]> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < items.len() {
        let n = 1 + items[i + 1..].iter().enumerate().take_while(|(k, x)| same(&items[i], x, k + 1)).count();
        out.push(&items[i..i + n]);
        i += n;
    }
    out
}

impl CudaBackend {
    /// An fp16 (dense) layer: f16 rows for `rows` positions per sequence.
    pub fn dense(rt: Arc<CudaRuntime>, heads: Heads, slots: usize, rows: usize, device: &Device) -> Result<Self> {
        let base = TensorBackend::dense(heads, slots, rows, device)?;
        let attn = GpuDenseAttention::new(heads.q, heads.kv, heads.dim)?;
        attn.prepare(rt.gpu())?;
        let prefill = GpuPrefill::new(rt.gpu(), heads.kv, heads.dim, heads.q)?;
        Ok(Self {
            put: PutRows::new(rt.gpu(), heads.dim)?,
            base,
            rt,
            attention: Attention::Dense(attn, prefill),
            capacity: 0,
            decode_block: DECODE_BLOCK,
            flushed: None,
            pending: AtomicBool::new(false),
            put_last: AtomicBool::new(false),
        })
    }

    /// A VecInfer layer: codes for `capacity` positions per sequence beside `rows` f16 rows (sink
    /// and ring, at most the merge kernel's window). Kernels compile now, not in the first steps.
    #[allow(clippy::too_many_arguments)]
    pub fn vecinfer(
        rt: Arc<CudaRuntime>,
        heads: Heads,
        slots: usize,
        rows: usize,
        capacity: usize,
        keys: &VecInferCodec,
        values: &VecInferCodec,
        device: &Device,
    ) -> Result<Self> {
        GpuAttention::supports(keys, values, heads.q).map_err(|e| Error::Codec(veloq::Error::Device(e)))?;
        if rows > MAX_WINDOW {
            return Err(Error::Config(format!("the CUDA VecInfer cache keeps at most {MAX_WINDOW} f16 rows per sequence (sink + window + flush block), asked for {rows}")));
        }
        let base = TensorBackend::vecinfer(heads, slots, rows, capacity, keys, values, device)?;
        let gpu = rt.gpu();
        let attn = GpuAttention::new(GpuCodec::upload(gpu, keys)?, GpuCodec::upload(gpu, values)?, heads.q)?;
        attn.prepare(gpu)?;
        attn.keys.prepare(gpu)?;
        attn.values.prepare(gpu)?;
        let prefill = GpuPrefillCodes::new(gpu, &attn.keys, &attn.values, heads.q)?;
        let attention = Attention::Coded(Box::new(attn), prefill);
        let flushed = match rt.flush {
            Some(_) => {
                let event = || gpu.context().new_event(None).map_err(veloq::Error::from);
                Some((event()?, event()?))
            }
            None => None,
        };
        Ok(Self {
            put: PutRows::new(gpu, heads.dim)?,
            base,
            rt,
            attention,
            capacity,
            decode_block: DECODE_BLOCK,
            flushed,
            pending: AtomicBool::new(false),
            put_last: AtomicBool::new(false),
        })
    }

    /// Codes decoded per launch of the prefill attention over them (default [`DECODE_BLOCK`];
    /// at least 1): smaller blocks trade launches for scratch and give the same attention, so
    /// tests use them to cross block boundaries on short contexts.
    pub fn with_decode_block(mut self, positions: usize) -> Self {
        self.decode_block = positions.max(1);
        self
    }

    /// Codes `streams` streams of keys `xk` and values `xv` (f16 bits) where `map` says into the
    /// codes of sequences from `slot` on, on `gpu`'s stream. Returns the launches issued.
    fn code(
        &self,
        gpu: &Gpu,
        xk: &CudaView<u16>,
        xv: &CudaView<u16>,
        slot: usize,
        streams: usize,
        map: RowMap,
    ) -> Result<usize> {
        let Attention::Coded(attn, _) = &self.attention else {
            return Err(Error::Config("a dense cache holds no codes".into()));
        };
        let c = self.base.vecinfer_codes()?;
        let (kv, cap) = (self.base.heads.kv, self.capacity);
        let n = Cell::new(0);
        write2::<u8>(&c.key_codes, &c.value_codes, |ko, vo| {
            let mut ko = ko.slice_mut(slot * kv * cap * attn.keys.row_bytes()..);
            let mut vo = vo.slice_mut(slot * kv * cap * attn.values.row_bytes()..);
            let mut jobs = [
                QuantizeJob { codec: &attn.keys, x: xk, out: &mut ko },
                QuantizeJob { codec: &attn.values, x: xv, out: &mut vo },
            ];
            n.set(quantize_jobs(gpu, &mut jobs, streams, map, QuantizeLaunch::default())?);
            Ok(())
        })?;
        Ok(n.get())
    }

    /// Starts a flush on the flush stream, after the main stream's work so far: the stream's GPU
    /// handle, or `None` to flush on the main stream.
    fn flush_begin(&self) -> Result<Option<&Gpu>> {
        let (Some(aside), Some((ready, _))) = (&self.rt.flush, &self.flushed) else {
            return Ok(None);
        };
        if !self.rt.flushes_aside() {
            return Ok(None);
        }
        ready.record(self.rt.gpu().stream()).map_err(veloq::Error::from)?;
        aside.stream().wait(ready).map_err(veloq::Error::from)?;
        Ok(Some(aside))
    }

    /// Marks the end of the flush just issued; the main stream waits for it at its next use.
    fn flush_end(&self) -> Result<()> {
        if let (Some(aside), Some((_, done))) = (&self.rt.flush, &self.flushed) {
            done.record(aside.stream()).map_err(veloq::Error::from)?;
            self.pending.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Orders the main stream after this layer's last flush, if one is still pending. Every entry
    /// point that launches calls it first, so it also ends "the put was the last launch": it
    /// returns whether that held until now.
    fn join(&self) -> Result<bool> {
        let after_put = self.put_last.swap(false, Ordering::Relaxed);
        if let Some((_, done)) = &self.flushed {
            if self.pending.swap(false, Ordering::AcqRel) {
                self.rt.gpu().stream().wait(done).map_err(veloq::Error::from)?;
            }
        }
        Ok(after_put)
    }

    /// Which of a slot's f16 rows hold a view's positions: its sink rows, then its ring.
    fn window_map(v: &SeqView) -> WindowMap {
        WindowMap {
            n_sink: v.n_sink as i32,
            sink_cap: v.ring.base as i32,
            ring_head: v.ring.start as i32,
            ring_len: v.ring_len as i32,
            ring_cap: v.ring.wrap as i32,
        }
    }

    fn dims(&self) -> Result<(usize, usize)> {
        let (_, slots, _, rows, _) = self.base.rows.dims5()?;
        Ok((slots, rows))
    }

    /// Decode attention for `group` (consecutive slots and query rows, storage alike) into `out`
    /// rows `[tokens, q heads, D]`; `after_put`: the stream's last launch was the put of this
    /// step's rows. Returns the launches issued.
    fn decode_group(
        &self,
        q: &CudaView<f32>,
        group: &[SeqView],
        scale: f32,
        after_put: bool,
        out: &mut CudaViewMut<f32>,
    ) -> Result<usize> {
        let Heads { q: hq, kv, dim: d } = self.base.heads;
        let (_, rows) = self.dims()?;
        let (b, first, slot0) = (group.len(), &group[0], group[0].slot);
        let q = q.slice(first.queries.start * hq * d..(first.queries.start + b) * hq * d);
        let mut out = out.slice_mut(first.queries.start * hq * d..(first.queries.start + b) * hq * d);
        let gpu = self.rt.gpu();
        with_view::<f16, _>(&self.base.rows, |all| {
            let (wk, wv) = planes(&all, slot0 * kv * rows * d);
            match &self.attention {
                Attention::Dense(attn, _) => {
                    let len = first.ring_len;
                    let nsplit = attn.splits(gpu, b, len);
                    // The put wrote each sequence's new rows, its last (decodable: one query).
                    let fresh = after_put.then(|| len - first.queries.len());
                    self.rt.with_scratch(b * hq * nsplit, b * kv, d, |scratch| {
                        attn.attend(gpu, &q, &wk, &wv, b, len, rows, scale, fresh, scratch, &mut out)
                            .map_err(Error::from)
                    })?;
                    Ok(2)
                }
                Attention::Coded(attn, _) => {
                    let c = self.base.vecinfer_codes()?;
                    let nsplit = attn.splits(gpu, b, first.coded);
                    let map = Self::window_map(first);
                    let window = Window { keys: wk, values: wv, rows, map, just_written: after_put };
                    let (mk, mv) = (c.keys.subspaces(), c.values.subspaces());
                    with_view::<u8, _>(&c.key_codes, |kc| {
                        with_view::<u8, _>(&c.value_codes, |vc| {
                            let codes = Coded {
                                keys: kc.slice(slot0 * kv * self.capacity * mk..),
                                values: vc.slice(slot0 * kv * self.capacity * mv..),
                                len: first.coded,
                                stride: self.capacity,
                            };
                            self.rt.with_scratch(b * hq * nsplit, b * kv, d, |scratch| {
                                Ok(attn.attend_cache(gpu, &q, b, &codes, &window, scale, scratch, &mut out)?)
                            })
                        })
                    })
                }
            }
        })
    }

    /// Decode attention of sequences at different positions (`views`: decodable) in the launches
    /// of one group (split and merge, or the tensor-core kernel merging in its last block): a
    /// table of each one's slot, query row and lengths (and, for codes, window map) goes to the
    /// device, and the kernels read their sequence's entry. Returns the launches issued, or `None`
    /// (nothing launched) where the coded layer's merge cannot take the batch (a window past the
    /// merge's rows or shared memory): the caller launches per group.
    fn decode_ragged(
        &self,
        q: &CudaView<f32>,
        views: &[SeqView],
        scale: f32,
        out: &mut CudaViewMut<f32>,
    ) -> Result<Option<usize>> {
        let Heads { q: hq, kv, dim: d } = self.base.heads;
        let (_, rows) = self.dims()?;
        let gpu = self.rt.gpu();
        let attn = match &self.attention {
            Attention::Dense(attn, _) => {
                let host: Vec<i32> =
                    views.iter().flat_map(|v| dense_ragged_entry(v.slot, v.queries.start, v.ring_len)).collect();
                let table = self.rt.table(&host)?;
                let seqs = Ragged { table: table.as_view(), host: &host };
                let (b, longest) = (views.len(), views.iter().map(|v| v.ring_len).max().unwrap_or(0));
                let nsplit = attn.splits(gpu, b, longest);
                with_view::<f16, _>(&self.base.rows, |all| {
                    let (wk, wv) = planes(&all, 0);
                    self.rt.with_scratch(b * hq * nsplit, b * kv, d, |scratch| {
                        Ok(attn.attend_ragged(gpu, q, &wk, &wv, &seqs, rows, scale, scratch, out)?)
                    })
                })?;
                return Ok(Some(2));
            }
            Attention::Coded(attn, _) => attn,
        };
        let (b, longest) = (views.len(), views.iter().map(|v| v.coded).max().unwrap_or(0));
        if !attn.takes_ragged(gpu, b, longest, rows)? {
            return Ok(None);
        }
        let host: Vec<i32> =
            views.iter().flat_map(|v| ragged_entry(v.slot, v.queries.start, v.coded, Self::window_map(v))).collect();
        let table = self.rt.table(&host)?;
        let ragged = Ragged { table: table.as_view(), host: &host };
        let c = self.base.vecinfer_codes()?;
        let nsplit = attn.splits(gpu, b, longest);
        let launches = with_view::<f16, _>(&self.base.rows, |all| {
            let (wk, wv) = planes(&all, 0);
            // The table's maps say which rows hold positions; this one is not read.
            let window = Window { keys: wk, values: wv, rows, map: WindowMap::all(rows), just_written: false };
            with_view::<u8, _>(&c.key_codes, |kc| {
                with_view::<u8, _>(&c.value_codes, |vc| {
                    let codes = Coded { keys: kc, values: vc, len: longest, stride: self.capacity };
                    self.rt.with_scratch(b * hq * nsplit, b * kv, d, |scratch| {
                        Ok(attn.attend_ragged(gpu, q, &codes, &window, &ragged, scale, scratch, out)?)
                    })
                })
            })
        })?;
        Ok(Some(launches))
    }

    /// Attention of a view's queries over everything it sees, through the prefill kernels, into
    /// `out` rows `[tokens, q heads, D]` (the view's rows). A VecInfer cache's codes are decoded
    /// into f16 rows of the cache's own space, so that the rows' kernel, queries and fold serve
    /// them: where they fit one block (most prompts) they are decoded once, with the sink and the
    /// ring copied around them, and that one run shares a launch with the step's own rows (read
    /// token-major from `staged`); longer, a block at a time, each block a launch merged into one
    /// set of splits, beside the runs of f16 rows. Then one fold of every split into the output.
    /// No tensor ops.
    fn attend_block(
        &self,
        qf: &CudaView<f32>,
        v: &SeqView,
        staged: Option<&(Tensor, Tensor)>,
        scale: f32,
        out: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let Heads { q: hq, kv, dim: d } = self.base.heads;
        let (_, rows) = self.dims()?;
        let gpu = self.rt.gpu();
        let stream = gpu.stream();
        let alloc = |n: usize| -> Result<cudarc::driver::CudaSlice<f32>> {
            // SAFETY: every element is written before it is read (the first launch into a split
            // writes every row of it; the fold writes every output row).
            Ok(unsafe { stream.alloc::<f32>(n) }.map_err(veloq::Error::from)?)
        };
        let (prefill, coded) = match &self.attention {
            Attention::Coded(attn, codes) => (codes.rows(), Some((attn, codes)).filter(|_| v.coded > 0)),
            Attention::Dense(_, rows) => (rows, None),
        };
        // Codes that fit one block are decoded once, with the sink and the ring copied around
        // them: one run of rows (positions 0.. in order) beside the step's own.
        let joined = coded.is_some() && v.coded <= self.decode_block && v.ring_pos0 == v.n_sink + v.coded;
        let spans: Vec<_> = v
            .row_spans()
            .into_iter()
            .filter(|s| s.n > 0 && !(joined && matches!(s.from, RowSource::Stored(_))))
            .collect();
        // Scratch for one block of decoded codes (and the rows around them), shared by the tiles.
        let block = v.coded.min(self.decode_block);
        let around_rows = if joined { v.n_sink + v.ring_len } else { 0 };
        let mut decoded = match coded {
            Some(_) => {
                // SAFETY: each block's rows are written by the decode before the attention reads them.
                let scratch =
                    || unsafe { stream.alloc::<u16>(kv * (block + around_rows) * d) }.map_err(veloq::Error::from);
                Some((scratch()?, scratch()?))
            }
            None => None,
        };
        // Positions p0..p0 + nb of the codes (with `around`'s rows) into the scratch.
        let decode = |p0: usize,
                      nb: usize,
                      around: Option<&RowsAround>,
                      (dk, dv): &mut (CudaSlice<u16>, CudaSlice<u16>)|
         -> Result<()> {
            let (attn, codes) = coded.expect("decoded only for coded views");
            let c = self.base.vecinfer_codes()?;
            let (mk, mv) = (c.keys.subspaces(), c.values.subspaces());
            let elems = kv * (nb + around.map_or(0, RowsAround::rows)) * d;
            with_view::<u8, _>(&c.key_codes, |kc| {
                with_view::<u8, _>(&c.value_codes, |vc| {
                    let all = Coded {
                        keys: kc.slice(v.slot * kv * self.capacity * mk..),
                        values: vc.slice(v.slot * kv * self.capacity * mv..),
                        len: v.coded,
                        stride: self.capacity,
                    };
                    let (mut ko, mut vo) = (dk.slice_mut(..elems), dv.slice_mut(..elems));
                    let books = (&attn.keys, &attn.values);
                    Ok(codes.decode(gpu, &all, (p0, nb), books, around, &mut ko, &mut vo)?)
                })
            })
        };
        if let (true, Some(scratch)) = (joined, decoded.as_mut()) {
            with_view::<f16, _>(&self.base.rows, |all| {
                let (keys, values) = planes(&all, v.slot * kv * rows * d);
                let mut parts = v.ring.parts(v.ring_len);
                let around = RowsAround {
                    keys,
                    values,
                    head_stride: rows * d,
                    sink: v.n_sink,
                    ring: [parts.next().unwrap_or_default(), parts.next().unwrap_or_default()],
                };
                decode(0, v.coded, Some(&around), scratch)
            })?;
            self.rt.count(1);
        }
        for i0 in (0..v.queries.len()).step_by(KERNEL_QUERY_TILE) {
            let n = KERNEL_QUERY_TILE.min(v.queries.len() - i0);
            let first = (v.queries.start + i0) * hq * d;
            let q = qf.slice(first..first + n * hq * d);
            let qpos0 = v.query_pos(i0);
            // Each run split for its own length (blocks of codes longer than one launch share
            // one set of splits).
            let code_split = coded.map(|_| prefill.split(gpu, n, block + around_rows));
            let row_splits: Vec<Split> = spans.iter().map(|sp| prefill.split(gpu, n, sp.n)).collect();
            let code_splits = code_split.map_or(0, |s| s.count);
            let total = code_splits + row_splits.iter().map(|s| s.count).sum::<usize>();
            if total == 0 {
                return Err(Error::Config("a query with no position to attend reached the prefill kernels".into()));
            }
            let (part, two) = (hq * n * d, hq * n * 2);
            let (mut o, mut ml) = (alloc(total * part)?, alloc(total * two)?);
            let mut launches = 0;
            if let (false, Some(split), Some(scratch)) = (joined, code_split, decoded.as_mut()) {
                for p0 in (0..v.coded).step_by(block) {
                    let nb = block.min(v.coded - p0);
                    decode(p0, nb, None, scratch)?;
                    let fit = split.fit(nb);
                    let out = PrefillOut {
                        o: &mut o.slice_mut(..fit.count * part),
                        ml: &mut ml.slice_mut(..fit.count * two),
                        accumulate: p0 > 0,
                    };
                    let run = decoded_run(scratch, (kv, d), (v.n_sink + p0, nb), qpos0, v.window);
                    prefill.launch_runs(gpu, &q, n, scale, &[(run, fit)], out)?;
                    launches += 2;
                }
            }
            // The runs of rows (the decoded codes first where they fit one block), their splits
            // after the codes'.
            with_view::<f16, _>(&self.base.rows, |all| {
                with_staged(staged, |input| {
                    let run = |span: &RowSpan| match span.from {
                        RowSource::Stored(first) => {
                            let (keys, values) = planes(&all, (v.slot * kv * rows + first) * d);
                            Rows {
                                keys,
                                values,
                                len: span.n,
                                head_stride: rows * d,
                                row_stride: d,
                                pos0: span.pos0,
                                qpos0,
                                window: v.window,
                            }
                        }
                        RowSource::Input(src) => {
                            let (k, vv) = input.as_ref().expect("made for views with input rows");
                            Rows {
                                keys: bits(&k.slice(src * kv * d..)),
                                values: bits(&vv.slice(src * kv * d..)),
                                len: span.n,
                                head_stride: d,
                                row_stride: kv * d,
                                pos0: span.pos0,
                                qpos0,
                                window: v.window,
                            }
                        }
                    };
                    let codes_run = match (joined, decoded.as_ref(), code_split) {
                        (true, Some(scratch), Some(split)) => {
                            let n = v.coded + around_rows;
                            Some((decoded_run(scratch, (kv, d), (0, n), qpos0, v.window), split))
                        }
                        _ => None,
                    };
                    let mut at = if codes_run.is_some() { 0 } else { code_splits };
                    let runs: Vec<(Rows, Split)> =
                        codes_run.into_iter().chain(spans.iter().map(run).zip(row_splits.iter().copied())).collect();
                    for chunk in runs.chunks(PREFILL_MAX_RUNS) {
                        let c: usize = chunk.iter().map(|(_, s)| s.count).sum();
                        let out = PrefillOut {
                            o: &mut o.slice_mut(at * part..(at + c) * part),
                            ml: &mut ml.slice_mut(at * two..(at + c) * two),
                            accumulate: false,
                        };
                        prefill.launch_runs(gpu, &q, n, scale, chunk, out)?;
                        at += c;
                        launches += 1;
                    }
                    Ok(())
                })
            })?;
            let parts = PrefillParts { o: &o.as_view(), ml: &ml.as_view(), splits: total };
            prefill.fold(gpu, parts, n, &mut out.slice_mut(first..first + n * hq * d))?;
            self.rt.count(launches + 1);
        }
        Ok(())
    }

    /// Attention of every view into `out` rows `[tokens, q heads, D]` in step order: decodable
    /// views through the decode kernels (a launch per group stored alike), the rest through the
    /// prefill kernels (sliding windows included), and coded views with a window (no method makes
    /// them) through the portable pieces, copied in.
    fn attend_to(
        &self,
        q: &Tensor,
        views: &[SeqView],
        input: &TensorInput,
        scale: f32,
        after_put: bool,
        out: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let (fast, slow): (Vec<SeqView>, Vec<SeqView>) = views.iter().cloned().partition(|v| self.decodable(v));
        let (blocks, slow): (Vec<SeqView>, Vec<SeqView>) = slow.into_iter().partition(Self::blockable);
        let Heads { q: hq, dim: d, .. } = self.base.heads;
        // Only the first group follows the put directly, and only if the queries need no
        // conversion (which would be a launch between).
        let mut after_put = after_put && q.dtype() == DType::F32 && q.is_contiguous();
        let qf = q.to_dtype(DType::F32)?.contiguous()?;
        // A step's own rows, f16 token-major, for the blocks that read them.
        let staged = match blocks.iter().any(|v| v.staged.is_some()) {
            true => Some(input.half()?),
            false => None,
        };
        with_view::<f32, _>(&qf, |qv| {
            let alike = groups(&fast, Self::alike);
            let ragged = match alike.len() {
                0 | 1 => None,
                _ if !self.rt.ragged_decode() => None,
                _ => self.decode_ragged(&qv, &fast, scale, out)?,
            };
            match ragged {
                Some(launches) => self.rt.count(launches),
                None => {
                    for g in alike {
                        let launches = self.decode_group(&qv, g, scale, std::mem::take(&mut after_put), out)?;
                        self.rt.count(launches);
                    }
                }
            }
            for v in &blocks {
                self.attend_block(&qv, v, staged, scale, out)?;
            }
            Ok(())
        })?;
        for v in &slow {
            let part = compose(self, q, std::slice::from_ref(v), input, scale)?.contiguous()?;
            let r = v.queries.start * hq * d..v.queries.end * hq * d;
            with_view::<f32, _>(&part, |src| {
                let mut dst = out.slice_mut(r.clone());
                self.rt.gpu().stream().memcpy_dtod(&src, &mut dst).map_err(veloq::Error::from)?;
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Whether the prefill kernels take a view: any without codes, and coded ones without a
    /// sliding window (the decoded codes are attended unmasked).
    fn blockable(v: &SeqView) -> bool {
        v.window.is_none() || v.coded == 0
    }

    /// Whether the decode kernels take a view, and which views decode together with it.
    fn decodable(&self, v: &SeqView) -> bool {
        v.queries.len() == 1
            && v.staged.is_none()
            && v.window.is_none()
            && (matches!(self.attention, Attention::Coded(..))
                || (v.ring_pos0 == 0 && v.ring.start == 0 && v.ring_len > 0))
    }

    fn alike(a: &SeqView, b: &SeqView, k: usize) -> bool {
        b.slot == a.slot + k
            && b.queries.start == a.queries.start + k
            && (b.n_sink, b.coded, b.ring, b.ring_len) == (a.n_sink, a.coded, a.ring, a.ring_len)
    }
}

impl Backend for CudaBackend {
    type Input = TensorInput;
    type Partial = TensorPartial;

    fn input(&self, k: &Tensor, v: &Tensor) -> Result<TensorInput> {
        self.base.input(k, v)
    }

    /// One launch per run of puts that write alike (consecutive slots and source rows, same
    /// destination and length): a batch decoding together puts its rows in one launch.
    fn put_rows(&mut self, input: &TensorInput, puts: &[Put]) -> Result<()> {
        self.join()?;
        let (slots, rows) = self.dims()?;
        let Heads { kv, dim: d, .. } = self.base.heads;
        let plane = slots * kv * rows * d;
        let alike =
            groups(puts, |a, b, k| b.slot == a.slot + k && b.src == a.src + k * a.n && (b.n, b.to) == (a.n, a.to));
        // A decode step's rows of sequences at different positions: one launch for all.
        if alike.len() > 1 && puts.iter().all(|p| p.n == 1) {
            let host: Vec<i32> = puts.iter().flat_map(|p| [p.slot, p.src, p.to.row(0)]).map(|x| x as i32).collect();
            let table = self.rt.table(&host)?;
            with_view::<f32, _>(&input.keys, |k| {
                with_view::<f32, _>(&input.values, |v| {
                    write::<f16>(&self.base.rows, |all| {
                        // SAFETY: f16 and u16 have the same size and alignment; the kernel writes f16 bits.
                        let mut w = unsafe { all.transmute_mut::<u16>(all.len()) }.expect("same size");
                        let gpu = self.rt.gpu();
                        Ok(self.put.launch_ragged(gpu, &k, &v, kv, &table.as_view(), &host, &mut w, rows, plane)?)
                    })
                })
            })?;
            self.rt.count(1);
            self.put_last.store(true, Ordering::Relaxed);
            return Ok(());
        }
        for g in alike {
            let p = g[0];
            let RowRun { base, start, wrap } = p.to;
            let map = PutMap {
                t: p.n as i32,
                src_t: p.n as i32,
                src0: p.src as i32,
                heads: kv as i32,
                n_sink: 0,
                sink0: 0,
                sink_cap: base as i32,
                ring0: start as i32,
                ring_cap: wrap as i32,
            };
            let streams = g.len() * kv;
            let off = p.slot * kv * rows * d;
            with_view::<f32, _>(&input.keys, |k| {
                with_view::<f32, _>(&input.values, |v| {
                    write::<f16>(&self.base.rows, |all| {
                        // SAFETY: f16 and u16 have the same size and alignment; the kernel writes f16 bits.
                        let mut w = unsafe { all.transmute_mut::<u16>(all.len()) }.expect("same size");
                        let mut w = w.slice_mut(off..);
                        Ok(self.put.launch(self.rt.gpu(), &k, &v, streams, &mut w, rows, plane, map)?)
                    })
                })
            })?;
            self.rt.count(1);
            self.put_last.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Ring spans of sequences laid out alike code in one launch (keys and values together), on
    /// the flush stream when there is one; rows from the step's input one sequence at a time, on
    /// the main stream (the input is the step's, freed there).
    fn quantize(&mut self, input: &TensorInput, spans: &[Quantize]) -> Result<()> {
        self.join()?;
        if !matches!(self.attention, Attention::Coded(..)) {
            return Err(Error::Config("a dense cache holds no codes".into()));
        }
        let (_, rows) = self.dims()?;
        let Heads { kv, dim: d, .. } = self.base.heads;
        let (main, cap) = (self.rt.gpu(), self.capacity);
        for g in groups(spans, |a, b, k| {
            b.slot == a.slot + k && (b.at, b.ring) == (a.at, a.ring) && a.input.1 == 0 && b.input.1 == 0
        }) {
            let q = g[0];
            let streams = g.len() * kv;
            if q.ring.1 > 0 {
                let RowRun { base, start, wrap } = q.ring.0;
                let map = RowMap {
                    in_wrap: wrap as i32,
                    in_off: base as i32,
                    ..RowMap::streams(q.ring.1, rows, start, cap, q.at)
                };
                let aside = self.flush_begin()?;
                let gpu = aside.unwrap_or(main);
                let r = with_view::<f16, _>(&self.base.rows, |all| {
                    let (keys, values) = planes(&all, q.slot * kv * rows * d);
                    self.code(gpu, &keys, &values, q.slot, streams, map)
                });
                if aside.is_some() {
                    self.flush_end()?;
                }
                self.rt.count(r?);
            }
            if q.input.1 > 0 {
                // Token-major input: vector t of head h is row (src + t)·kv + h.
                let map = RowMap {
                    t: q.input.1 as i32,
                    in_hs: 1,
                    in_ts: kv as i32,
                    in_base: q.input.0 as i32,
                    out_hs: cap as i64,
                    out_ts: 1,
                    out_base: (q.at + q.ring.1) as i32,
                    in_wrap: 0,
                    in_off: 0,
                };
                let (k16, v16) = input.half()?;
                let n = with_view::<f16, _>(k16, |xk| {
                    with_view::<f16, _>(v16, |xv| self.code(main, &bits(&xk), &bits(&xv), q.slot, kv, map))
                })?;
                self.rt.count(n);
            }
        }
        Ok(())
    }

    fn restore(&mut self, restore: &Restore) -> Result<()> {
        self.join()?;
        self.base.restore(restore)
    }

    fn copy_slot(&mut self, from: usize, to: usize, held: super::residency::Footprint) -> Result<()> {
        self.join()?;
        self.base.copy_slot(from, to, held)
    }

    /// The portable pieces: only coded views with a sliding window reach them here (every other
    /// view takes the decode or prefill kernels in [`attend`](Backend::attend)).
    fn attend_codes(&self, q: &Tensor, views: &[SeqView], scale: f32) -> Result<TensorPartial> {
        self.join()?;
        self.base.attend_codes(q, views, scale)
    }

    fn attend_rows(&self, q: &Tensor, views: &[SeqView], input: &TensorInput, scale: f32) -> Result<TensorPartial> {
        self.join()?;
        self.base.attend_rows(q, views, input, scale)
    }

    fn merge(&self, a: TensorPartial, b: TensorPartial) -> Result<TensorPartial> {
        self.base.merge(a, b)
    }

    fn finish(&self, p: TensorPartial) -> Result<Tensor> {
        self.base.finish(p)
    }

    /// Sequences with one query and all rows stored go to the decode kernels (together where
    /// their storage is alike), the rest to the prefill kernels (sliding windows included);
    /// outputs land in step order.
    fn attend(&self, q: &Tensor, views: &[SeqView], input: &TensorInput, scale: f32) -> Result<Tensor> {
        let after_put = self.join()?;
        if !views.iter().any(|v| self.decodable(v) || Self::blockable(v)) {
            return compose(self, q, views, input, scale);
        }
        let Heads { q: hq, dim: d, .. } = self.base.heads;
        let n = q.dim(0)?;
        // SAFETY: `attend_to` writes every row before anything reads it (every packed row belongs
        // to one view, and every view is written: by its decode group, its prefill fold, or
        // copied in).
        let mut out = unsafe { self.rt.gpu().stream().alloc::<f32>(n * hq * d) }.map_err(veloq::Error::from)?;
        self.attend_to(q, views, input, scale, after_put, &mut out.as_view_mut())?;
        let storage = CudaStorage::wrap_cuda_slice(out, self.rt.device.clone());
        Ok(Tensor::from_storage(Storage::Cuda(storage), (n, hq, d), BackpropOp::none(), false))
    }

    /// The decode kernels write straight into `out` (a graph's fixed buffer: no copy after).
    fn attend_into(&self, q: &Tensor, views: &[SeqView], input: &TensorInput, scale: f32, out: &Tensor) -> Result<()> {
        let after_put = self.join()?;
        let Heads { q: hq, dim: d, .. } = self.base.heads;
        let fits = out.dtype() == DType::F32
            && out.is_contiguous()
            && out.device().same_device(&self.base.device)
            && out.dims() == [q.dim(0)?, hq, d];
        if !fits || !views.iter().any(|v| self.decodable(v) || Self::blockable(v)) {
            return super::copy_into(out, &self.attend(q, views, input, scale)?);
        }
        write::<f32>(out, |o| self.attend_to(q, views, input, scale, after_put, o))
    }

    fn resident_bytes(&self) -> usize {
        let tables = match &self.attention {
            Attention::Coded(a, _) => a.keys.table_bytes() + a.values.table_bytes(),
            Attention::Dense(..) => 0,
        };
        self.base.resident_bytes() + tables
    }

    fn sequence_bytes(&self, footprint: super::residency::Footprint) -> usize {
        self.base.sequence_bytes(footprint)
    }
}
