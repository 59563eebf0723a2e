//! Decode steps on CUDA replayed from CUDA graphs (feature `cuda`).
//!
//! A decode step issues a few dozen candle operations per layer; at batch 1 the host issuing them
//! (allocation, lookup, launch: several µs each) is slower than the GPU running them, so the step
//! costs the host's time, not the bytes it reads. Everything between two attention calls — the
//! previous layer's output projection, residual and MLP, then this layer's norm, projections and
//! RoPE — depends on nothing but the batch size: its shapes are fixed and its inputs can sit in
//! buffers that never move. Each such segment (layers + 1 per step) is captured once per batch
//! size and replayed with one launch. The cache's own work (rows in, attention, flushes into
//! codes) stays outside the graphs: it is a few launches per layer, its lengths and ring positions
//! change every step, and it is the same code every other path runs.
//!
//! The segments are the eager pass's own functions (`Model::qkv`, `Model::residual`, …), so the
//! two paths cannot drift apart; temporaries allocated inside a capture become the graph's own
//! (stream-ordered) allocations, and candle's small parameter uploads come from its capture
//! cache. A capture that fails — an operation the driver refuses in capture — turns graphs off
//! for that batch size with a warning, and the step runs eagerly.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use crate::cache::CudaRuntime;
use crate::cache::{ModelCache, Step};
use crate::error::{Error, Result};
use crate::model::{Model, Qkv, RopeRows};

/// Graphs per batch size ([`Runner::set_cuda_graphs`](super::Runner::set_cuda_graphs) turns
/// them on and off).
pub(crate) struct Graphs {
    on: AtomicBool,
    batches: Mutex<HashMap<Key, Batch>>,
    /// The most tokens an eager pass has carried, in each of candle's quantized-product regimes
    /// ([`Graphs::note`]).
    widest: Mutex<Widest>,
    launches: AtomicUsize,
    /// Set while steps are being timed part by part ([`Runner::set_step_phases`](super::Runner::set_step_phases)).
    clock: Mutex<Option<Clock>>,
}

/// Rows up to which candle multiplies quantized weights by its vector kernel (`fast_mmvq`);
/// more take its matrix kernel (`fast_mmq`). Each keeps one scratch per device, reallocated when
/// a call needs more.
const CANDLE_MMVQ_ROWS: usize = 8;

/// The most tokens a pass has carried in each regime of candle's quantized products, so far.
#[derive(Default)]
struct Widest {
    vector: usize,
    matrix: usize,
}

/// What a captured graph depends on besides its buffers: the batch size, and whether f16 weights
/// took veloq's GEMV or the f16 row path (batches past the GEMV's rows) and launches overlapped
/// when it was captured (a graph replays the kernels and edges it was captured with).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    batch: usize,
    gemv: bool,
    f16_rows: bool,
    overlapped: bool,
}

impl Graphs {
    pub(crate) fn new(on: bool) -> Self {
        Self {
            on: AtomicBool::new(on),
            batches: Mutex::new(HashMap::new()),
            widest: Mutex::new(Widest::default()),
            launches: AtomicUsize::new(0),
            clock: Mutex::new(None),
        }
    }
}

/// Where graph steps' GPU time went, from CUDA events recorded between their parts (each
/// interval, the gaps before its launches included, counts to the part that ends it), summed over
/// [`steps`](Self::steps). The events themselves cost a few µs a layer: compare the total with a
/// step timed without them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases {
    /// Steps measured.
    pub steps: usize,
    /// The segments replayed from graphs: every layer's products with the norms, RoPE, residual
    /// adds and MLP fused or captured with them, the embedding and the head (ms).
    pub segments_ms: f64,
    /// The step's keys and values into the caches' f16 rows (ms).
    pub rows_in_ms: f64,
    /// Attention over the caches, into the graphs' buffer (ms).
    pub attention_ms: f64,
    /// Commits: rows past the recent window into codes, on the steps that flush (ms).
    pub flush_ms: f64,
    /// Token ids and positions in, logits out (ms).
    pub io_ms: f64,
}

impl StepPhases {
    /// GPU time of the steps, all parts.
    pub fn total_ms(&self) -> f64 {
        self.segments_ms + self.rows_in_ms + self.attention_ms + self.flush_ms + self.io_ms
    }
}

#[derive(Clone, Copy)]
enum Part {
    Start,
    Segments,
    RowsIn,
    Attention,
    Flush,
    Io,
}

/// Events reused step after step, and the sums so far.
#[derive(Default)]
struct Clock {
    events: Vec<cudarc::driver::CudaEvent>,
    parts: Vec<Part>,
    sums: StepPhases,
}

impl Clock {
    /// Records the end of `part` (or, `Part::Start`, the step's beginning) on `stream`.
    fn mark(&mut self, stream: &Arc<CudaStream>, part: Part) -> Result<()> {
        let err = |e| Error::Cuda(format!("CUDA event: {e:?}"));
        if matches!(part, Part::Start) {
            self.parts.clear();
        }
        let n = self.parts.len();
        if self.events.len() == n {
            let timing = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
            self.events.push(stream.context().new_event(Some(timing)).map_err(err)?);
        }
        self.events[n].record(stream).map_err(err)?;
        self.parts.push(part);
        Ok(())
    }

    /// Waits for the step's last event and adds its intervals to the sums.
    fn finish(&mut self) -> Result<()> {
        let err = |e| Error::Cuda(format!("CUDA event: {e:?}"));
        for i in 1..self.parts.len() {
            let ms = self.events[i - 1].elapsed_ms(&self.events[i]).map_err(err)? as f64;
            let s = &mut self.sums;
            match self.parts[i] {
                Part::Segments => s.segments_ms += ms,
                Part::RowsIn => s.rows_in_ms += ms,
                Part::Attention => s.attention_ms += ms,
                Part::Flush => s.flush_ms += ms,
                Part::Io | Part::Start => s.io_ms += ms,
            }
        }
        self.sums.steps += 1;
        Ok(())
    }
}

/// The buffers a batch size's segments read and write (fixed addresses: the graphs point at them)
/// and, once captured, the segments' graphs.
struct Batch {
    ids: Tensor,
    positions: Tensor,
    /// Residual stream `[B, hidden]`.
    x: Tensor,
    /// Queries, keys and values one after another, as the fused product writes them (into this
    /// buffer); `q`, `k`, `v` are views of it.
    qkv: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Attention output `[B, heads, D]`, written by each layer's attention.
    y: Tensor,
    rope: RopeRows,
    logits: Tensor,
    graphs: Captured,
    /// A step has run: the first runs eagerly (libraries allocate their workspaces then), later
    /// ones capture the segments not captured yet.
    warm: bool,
    /// Capture failed: this batch size runs eagerly from now on.
    broken: bool,
}

/// Graph objects are not thread-safe; every use goes through the [`Graphs`] mutex.
struct Captured(Vec<CudaGraph>);
// SAFETY: the graphs are only touched with the `batches` lock held, one thread at a time, as the
// driver requires for graph objects.
unsafe impl Send for Captured {}

impl Batch {
    fn new(model: &Model, b: usize) -> Result<Self> {
        let (info, dev) = (&model.info, model.device());
        let (nh, nkv, hd) = (info.n_heads, info.identity.n_kv_heads, info.identity.head_dim);
        let z = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, dev);
        let zero_positions = z(&[b], DType::U32)?;
        let qkv = z(&[b * (nh + 2 * nkv) * hd], DType::F32)?;
        let part = |from: usize, heads: usize| -> Result<Tensor> {
            Ok(qkv.narrow(0, b * from * hd, b * heads * hd)?.reshape((b, heads, hd))?)
        };
        let (q, k, v) = (part(0, nh)?, part(nh, nkv)?, part(nh + nkv, nkv)?);
        Ok(Self {
            ids: z(&[b], DType::U32)?,
            rope: model.rope_rows(&zero_positions)?,
            positions: zero_positions,
            x: z(&[b, info.hidden], DType::F32)?,
            qkv,
            q,
            k,
            v,
            y: z(&[b, nh, hd], DType::F32)?,
            logits: z(&[b, info.vocab], DType::F32)?,
            graphs: Captured(Vec::new()),
            warm: false,
            broken: false,
        })
    }

    /// Segment `i` of a step: the embedding (i = 0) or layer i−1's residual, then layer i's
    /// queries, keys and values; after the last layer, the logits. Writes only this batch's
    /// buffers; every temporary is dropped before it returns (inside a capture, too).
    fn segment(&self, model: &Model, cuda: &CudaDevice, i: usize) -> Result<()> {
        // candle uploads small kernel parameters (dims, strides) from the host; with this guard
        // they come from a cache filled in the eager first step, so a captured graph never
        // points at a host vector or a device buffer that is gone when it replays (and a miss
        // during capture is an error, not a dangling pointer).
        let _params = cuda.enable_cuda_graph_htod_cache();
        let layers = model.layers.len();
        let x = if i == 0 {
            let rows = model.rope_rows(&self.positions)?;
            self.rope.cos.slice_set(&rows.cos, 0, 0)?;
            self.rope.sin.slice_set(&rows.sin, 0, 0)?;
            if let (Some((c, s)), Some((rc, rs))) = (&self.rope.local, &rows.local) {
                c.slice_set(rc, 0, 0)?;
                s.slice_set(rs, 0, 0)?;
            }
            model.embed_tokens(&self.ids)?
        } else {
            model.residual(&model.layers[i - 1], &self.x, &self.y)?
        };
        if i < layers {
            let Qkv { q, k, v, packed } = model.qkv(&model.layers[i], &x, &self.rope, Some(&self.qkv))?;
            match packed.filter(|p| p.elem_count() == self.qkv.elem_count()) {
                // The fused product wrote them where they belong (`qkv` is flat: the same tensor).
                Some(p) if p.id() == self.qkv.id() => {}
                Some(p) => self.qkv.slice_set(&p, 0, 0)?,
                None => {
                    self.q.slice_set(&q, 0, 0)?;
                    self.k.slice_set(&k, 0, 0)?;
                    self.v.slice_set(&v, 0, 0)?;
                }
            }
            // The fused residual updates the stream where it lies.
            if x.id() != self.x.id() {
                self.x.slice_set(&x, 0, 0)?;
            }
        } else {
            self.logits.slice_set(&model.head(&x)?, 0, 0)?;
        }
        Ok(())
    }
}

/// Runs `body` under stream capture on `stream`; the graph, or why there is none.
fn capture(stream: &Arc<CudaStream>, body: impl FnOnce() -> Result<()>) -> std::result::Result<CudaGraph, String> {
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| format!("begin capture: {e:?}"))?;
    let body = body();
    let end = stream.end_capture(CUgraphInstantiate_flags(0));
    let out = match (body, end) {
        (Ok(()), Ok(Some(g))) => Ok(g),
        (Err(e), _) => Err(e.to_string()),
        (_, Err(e)) => Err(format!("end capture: {e:?}")),
        (_, Ok(None)) => Err("the capture recorded nothing".into()),
    };
    if out.is_err() {
        // Errors of frees inside the abandoned capture were parked on the context; clear them.
        let _ = stream.context().check_err();
    }
    out
}

impl Graphs {
    pub(crate) fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    pub(crate) fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// A pass of `tokens` tokens is about to run on `model`'s device. candle's quantized
    /// products keep a scratch per device that grows (a new allocation, the old one freed) when
    /// a pass carries more rows than any before it in the same regime; a graph captured earlier
    /// keeps the old address and would write into freed memory when replayed (an illegal
    /// address under serving load, where batches grow after the first graphs). So a pass wider
    /// than any before drops every captured graph: the next steps capture them again (a pass
    /// that widens nothing — every replay among them — changes nothing).
    pub(crate) fn note(&self, model: &Model, tokens: usize) -> Result<()> {
        let mut widest = self.widest.lock().expect("widest lock");
        let w = if tokens <= CANDLE_MMVQ_ROWS { &mut widest.vector } else { &mut widest.matrix };
        if tokens <= *w {
            return Ok(());
        }
        *w = tokens;
        let mut batches = self.batches.lock().expect("graph lock");
        if batches.values().any(|b| !b.graphs.0.is_empty()) {
            // Replays already queued finish before their graphs go.
            model.device().synchronize()?;
            for b in batches.values_mut() {
                b.graphs.0.clear();
            }
        }
        Ok(())
    }

    /// Graph launches issued so far.
    pub(crate) fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// Starts (from zero) or stops timing graph steps part by part.
    pub(crate) fn set_phases(&self, on: bool) {
        *self.clock.lock().expect("clock lock") = on.then(Clock::default);
    }

    /// The parts' times since [`set_phases`](Self::set_phases) turned timing on.
    pub(crate) fn phases(&self) -> Option<StepPhases> {
        self.clock.lock().expect("clock lock").as_ref().map(|c| c.sums)
    }

    /// A decode step (one new token per sequence) through the graphs: logits `[sequences,
    /// vocab]`; `None` when graphs do not apply (off, not CUDA, several tokens for a sequence)
    /// and the caller runs the step eagerly.
    pub(crate) fn forward(
        &self,
        model: &Model,
        tokens: &[u32],
        step: &Step,
        cache: &mut ModelCache,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(cuda) = model.device() else { return Ok(None) };
        if !self.enabled() || step.seqs().iter().any(|s| s.len != 1) {
            return Ok(None);
        }
        let b = tokens.len();
        let rt = CudaRuntime::new(model.device())?;
        let key = Key { batch: b, gemv: rt.gemv(), f16_rows: rt.f16_rows(), overlapped: rt.gpu().overlaps() };
        let mut batches = self.batches.lock().expect("graph lock");
        let batch = match batches.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(Batch::new(model, b)?),
        };
        if batch.broken {
            return Ok(None);
        }
        let dev = model.device();
        let stream = cuda.cuda_stream();
        let mut clock = self.clock.lock().expect("clock lock");
        // Events mark the parts' ends while timing (never inside a capture).
        let mut mark = |part: Part| clock.as_mut().map_or(Ok(()), |c| c.mark(&stream, part));
        mark(Part::Start)?;
        batch.ids.slice_set(&Tensor::new(tokens, dev)?, 0, 0)?;
        batch.positions.slice_set(&Tensor::new(step.positions().as_slice(), dev)?, 0, 0)?;
        mark(Part::Io)?;
        let scale = model.attn_scale as f32;
        let caches = cache.layers_mut();
        for i in 0..=model.layer_count() {
            if i > 0 {
                let c = &mut caches[i - 1];
                c.append(&batch.k, &batch.v, step)?;
                mark(Part::RowsIn)?;
                c.attend_into(&batch.q, step, scale, &batch.y)?;
                mark(Part::Attention)?;
                c.commit()?;
                mark(Part::Flush)?;
            }
            if let Some(g) = batch.graphs.0.get(i) {
                self.replay(g)?;
                mark(Part::Segments)?;
                continue;
            }
            if batch.warm && !batch.broken {
                match capture(&stream, || batch.segment(model, cuda, i)) {
                    Ok(g) => {
                        self.replay(&g)?;
                        batch.graphs.0.push(g);
                        mark(Part::Segments)?;
                        continue;
                    }
                    Err(why) => {
                        eprintln!("veloq: CUDA graphs off for batch {b} (capture failed: {why}); running eagerly");
                        batch.broken = true;
                        batch.graphs.0.clear();
                    }
                }
            }
            batch.segment(model, cuda, i)?;
            mark(Part::Segments)?;
        }
        batch.warm = true;
        let logits = batch.logits.copy()?;
        mark(Part::Io)?;
        if let Some(c) = clock.as_mut() {
            c.finish()?;
        }
        Ok(Some(logits))
    }

    fn replay(&self, g: &CudaGraph) -> Result<()> {
        g.launch().map_err(|e| Error::Cuda(format!("CUDA graph launch: {e:?}")))?;
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
