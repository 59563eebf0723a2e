//! Host side of the fused decode attention over codes: a split kernel over the sequence and a merge
//! (`merge.cu`). On tensor cores (`attention_mma.cu`, where the geometry allows) the split kernel's
//! last block per stream merges: one launch per layer and decode step. The lookup-table split
//! kernel (`attention.cu`, every geometry) is followed by the merge kernel: two launches.

use std::sync::OnceLock;

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig};

use super::launch::Launch;
use super::quantize::GpuCodec;
use super::{dev_err, whole_words, Gpu};
use crate::codec::codebook::Granularity;
use crate::codec::vecinfer::VecInferCodec;
use crate::error::{Error, Result};

const MERGE: &str = include_str!("merge.cu");
pub(super) const SOURCES: &[&str] = &[include_str!("attention.cu")];
pub(super) const MERGE_SOURCES: &[&str] = &[MERGE];
/// The tensor-core split kernel ends with the merge.
pub(super) const MMA_SOURCES: &[&str] = &[MERGE, include_str!("attention_mma.cu")];
/// Threads per split block (16 warps: the block holds a whole SM's shared memory).
pub const DEFAULT_THREADS: u32 = 512;
/// Most tokens one split block scores (its softmax weights sit in shared memory).
const MAX_SPLIT: usize = 4096;
/// Fewest value-code tokens staged in shared memory per step (more when the table space allows).
const MIN_CHUNK: usize = 256;
/// Most f16 window rows the merge kernel takes.
pub const MAX_WINDOW: usize = 64;

/// Threads per tensor-core split block (its warp partials must fit over the two 32 KiB codebooks).
const MMA_THREADS: u32 = 256;

/// Tensor-core blocks resident per multiprocessor at `head_dim`: the kernel's `MIN_BLOCKS` (which
/// caps its registers) and the split count's waves, from one place. Two; one at head_dim 256 (its
/// registers). Three cap the registers at 80, which spills (NOTES.md has the timings).
fn mma_blocks(head_dim: usize) -> usize {
    if head_dim == 256 {
        1
    } else {
        2
    }
}

/// Most positions per tensor-core split (nothing in shared memory grows with it; more splits only
/// fill the GPU).
const MMA_MAX_SPLIT: usize = 16384;

/// Which split kernel scores and accumulates the codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitKernel {
    /// `attention_mma.cu`: `mma.sync` on f16 centroids and weights with f32 accumulation, for
    /// sub-vectors of 2 or 4 (keys and values each), head_dim 64/128/256 and at most 8 query heads
    /// per kv head. The default where it applies.
    TensorCores,
    /// `attention.cu`: per-query lookup tables and f32 FMAs on CUDA cores; every geometry.
    Tables,
}

impl SplitKernel {
    /// The kernel's name in flags and tables.
    pub fn name(self) -> &'static str {
        match self {
            SplitKernel::TensorCores => "tensor-cores",
            SplitKernel::Tables => "tables",
        }
    }
}

/// Key and value codecs of one layer on the GPU, with the query-head geometry.
pub struct GpuAttention {
    /// The keys' codebooks and transform on the GPU.
    pub keys: GpuCodec,
    /// The values'.
    pub values: GpuCodec,
    /// Query heads (a multiple of the kv heads).
    pub q_heads: usize,
    threads: u32,
    half_values: bool,
    kernel: SplitKernel,
    fuse_merge: bool,
    /// The plan and its compiled split and merge kernels, found once (a decode step should not
    /// rebuild define lists and cache keys per layer).
    prepared: OnceLock<(Plan, CudaFunction, CudaFunction)>,
}

struct Geometry {
    heads: usize,
    head_dim: usize,
    sub_dim: usize,
    bits: u32,
    per_layer: bool,
}

impl Geometry {
    fn of(c: &GpuCodec) -> Self {
        Self { heads: c.heads, head_dim: c.head_dim, sub_dim: c.sub_dim, bits: c.bits, per_layer: c.books == 1 }
    }
}

/// Whether the tensor-core split kernel takes this geometry (the table kernel's checks passed).
fn mma_geometry(k: &Geometry, v: &Geometry, q_heads: usize) -> bool {
    tensor_cores_take((k.sub_dim, v.sub_dim), k.head_dim, q_heads / k.heads)
}

/// Whether the tensor-core split kernel takes key and value sub-vectors of `sub_dims`, `head_dim`
/// and `group` query heads per kv head (in a geometry the lookup-table kernel takes).
pub fn tensor_cores_take(sub_dims: (usize, usize), head_dim: usize, group: usize) -> bool {
    matches!(sub_dims.0, 2 | 4) && matches!(sub_dims.1, 2 | 4) && matches!(head_dim, 64 | 128 | 256) && group <= 8
}

fn check_geometry(k: Geometry, v: Geometry, q_heads: usize) -> std::result::Result<(), String> {
    let ok = k.bits == 8
        && v.bits == 8
        && k.per_layer
        && v.per_layer
        && (k.head_dim / k.sub_dim).is_multiple_of(4)
        && k.sub_dim.is_multiple_of(2);
    if !ok
        || k.heads != v.heads
        || k.head_dim != v.head_dim
        || !q_heads.is_multiple_of(k.heads)
        || q_heads / k.heads > 16
    {
        return Err("CUDA attention takes 8-bit per-layer codebooks for keys and values of one geometry (key sub-spaces a multiple of 4, even key sub_dim), q_heads a multiple of kv heads, at most 16 query heads per kv head (a warp each in the merge)".into());
    }
    Ok(())
}

/// Partials of the split kernel and per-stream counts of finished blocks (zero between calls),
/// reused across calls.
pub struct AttentionScratch {
    pub(super) part_o: CudaSlice<f32>,
    pub(super) part_ml: CudaSlice<f32>,
    pub(super) done: CudaSlice<u32>,
}

impl AttentionScratch {
    /// For `batch` sequences of `q_heads` query heads split up to `max_splits` ways.
    pub fn new(gpu: &Gpu, batch: usize, q_heads: usize, head_dim: usize, max_splits: usize) -> Result<Self> {
        Self::sized(gpu, batch * q_heads * max_splits, batch * q_heads, head_dim)
    }

    /// Room for `partials` (query head × split) partials of `head_dim` and `streams` counters
    /// (at least one each, so that a call with nothing coded still finds its counters).
    pub fn sized(gpu: &Gpu, partials: usize, streams: usize, head_dim: usize) -> Result<Self> {
        let n = partials.max(1);
        Ok(Self {
            part_o: gpu.stream().alloc_zeros(n * head_dim).map_err(dev_err)?,
            part_ml: gpu.stream().alloc_zeros(n * 2).map_err(dev_err)?,
            done: gpu.stream().alloc_zeros(streams.max(1)).map_err(dev_err)?,
        })
    }

    /// Whether it holds `partials` partials of `head_dim` and `streams` counters.
    pub fn fits(&self, partials: usize, streams: usize, head_dim: usize) -> bool {
        self.part_o.len() >= partials * head_dim && self.part_ml.len() >= partials * 2 && self.done.len() >= streams
    }
}

impl GpuAttention {
    /// Attention over codes of `keys` and `values` for `q_heads` query heads (the table kernel; see `with_split_kernel`).
    pub fn new(keys: GpuCodec, values: GpuCodec, q_heads: usize) -> Result<Self> {
        let (kg, vg) = (Geometry::of(&keys), Geometry::of(&values));
        let kernel = if mma_geometry(&kg, &vg, q_heads) { SplitKernel::TensorCores } else { SplitKernel::Tables };
        check_geometry(kg, vg, q_heads).map_err(Error::Device)?;
        Ok(Self {
            keys,
            values,
            q_heads,
            threads: DEFAULT_THREADS,
            half_values: false,
            kernel,
            fuse_merge: true,
            prepared: OnceLock::new(),
        })
    }

    /// Chooses the split kernel (for comparisons: the default is the tensor-core kernel wherever it
    /// applies). Tensor cores for a geometry they do not take → [`Error::Device`].
    pub fn with_split_kernel(mut self, kernel: SplitKernel) -> Result<Self> {
        if kernel == SplitKernel::TensorCores
            && !mma_geometry(&Geometry::of(&self.keys), &Geometry::of(&self.values), self.q_heads)
        {
            return Err(Error::Device("the tensor-core attention kernel takes sub-vectors of 2 or 4, head_dim 64/128/256 and at most 8 query heads per kv head".into()));
        }
        self.kernel = kernel;
        self.prepared = OnceLock::new();
        Ok(self)
    }

    /// Whether the tensor-core split kernel merges in its last block per stream (the default; it
    /// falls back to the merge kernel when the merge's shared memory does not fit its own) or
    /// leaves the merge to a second launch. For comparisons; the table kernel always launches it.
    pub fn with_fused_merge(mut self, on: bool) -> Self {
        self.fuse_merge = on;
        self
    }

    /// Whether the kernels take these codecs (no GPU needed): why not, if not.
    pub fn supports(keys: &VecInferCodec, values: &VecInferCodec, q_heads: usize) -> std::result::Result<(), String> {
        let geometry = |c: &VecInferCodec| Geometry {
            heads: c.n_heads(),
            head_dim: c.head_dim(),
            sub_dim: c.shape().sub_dim,
            bits: c.shape().bits,
            per_layer: c.books().granularity() == Granularity::PerLayer,
        };
        GpuCodec::check(keys)?;
        GpuCodec::check(values)?;
        check_geometry(geometry(keys), geometry(values), q_heads)
    }

    /// Threads per block of the table kernel (a multiple of 32, at most 1024; more threads get
    /// fewer registers each). For tuning: the default is the measured best.
    pub fn with_threads(mut self, threads: u32) -> Result<Self> {
        if !threads.is_multiple_of(32) || !(64..=1024).contains(&threads) {
            return Err(Error::Device(format!("{threads} threads per block: need a multiple of 32 in 64..=1024")));
        }
        self.threads = threads;
        self.prepared = OnceLock::new();
        Ok(self)
    }

    /// Accumulate values with packed f16 FMAs in the table kernel (partials of 8 tokens summed in
    /// f32): half the value-pass instructions for about 1e-3 relative error. Needs an even value
    /// sub_dim.
    pub fn with_half_values(mut self, on: bool) -> Result<Self> {
        if on && !self.values.sub_dim.is_multiple_of(2) {
            return Err(Error::Device("f16 value accumulation needs an even value sub_dim".into()));
        }
        self.half_values = on;
        self.prepared = OnceLock::new();
        Ok(self)
    }

    fn group(&self) -> usize {
        self.q_heads / self.keys.heads
    }

    fn plan(&self, gb: usize) -> Plan {
        let (k, v) = (&self.keys, &self.values);
        Plan {
            d: k.head_dim,
            sd_k: k.sub_dim,
            sd_v: v.sub_dim,
            q_heads: self.q_heads,
            kv_heads: k.heads,
            center: (k.center, v.center),
            smooth: (k.smooth, v.smooth),
            rotate: k.rotate && v.rotate,
            gb,
            threads: self.threads,
            half_values: self.half_values,
            kernel: self.kernel,
        }
    }

    /// The plan with the most query heads per block (a divisor of the GQA group) whose tables fit
    /// in shared memory: each kv head's codes are then read once per block of heads.
    fn best_plan(&self, gpu: &Gpu) -> Plan {
        let g = self.group();
        (1..=g.min(4))
            .rev()
            .filter(|gb| g.is_multiple_of(*gb))
            .map(|gb| self.plan(gb))
            .find(|p| p.smem() <= gpu.max_smem)
            .unwrap_or_else(|| self.plan(1))
    }

    /// Compiles the kernels for this geometry now (they are otherwise compiled at the first call).
    pub fn prepare(&self, gpu: &Gpu) -> Result<()> {
        self.kernels(gpu).map(|_| ())
    }

    fn kernels(&self, gpu: &Gpu) -> Result<&(Plan, CudaFunction, CudaFunction)> {
        if let Some(k) = self.prepared.get() {
            return Ok(k);
        }
        let plan = self.best_plan(gpu);
        let split = match plan.kernel {
            SplitKernel::TensorCores => {
                gpu.kernel(MMA_SOURCES, "vq_attend_mma", &plan.mma_defines(), plan.split_smem())?
            }
            SplitKernel::Tables => gpu.kernel(SOURCES, "vq_attend_split", &plan.defines(), plan.split_smem())?,
        };
        let merge = gpu.kernel(MERGE_SOURCES, "vq_attend_merge", &plan.merge_defines(), gpu.max_smem)?;
        Ok(self.prepared.get_or_init(|| (plan, split, merge)))
    }

    /// Splits the split kernel uses for `batch` × `s` tokens: as few as keep each split within its
    /// most positions ([`MAX_SPLIT`] for the table kernel: one table build per split), then as many
    /// as fill the waves those need (table kernel: one block per multiprocessor, it takes most of
    /// the shared memory; tensor cores: two, one at head_dim 256), at least 256 positions each;
    /// tensor cores then keep the fewest splits whose busiest warp takes as many steps. Zero for
    /// nothing coded (the merge alone attends the window).
    pub fn splits(&self, gpu: &Gpu, batch: usize, s: usize) -> usize {
        if s == 0 {
            return 0;
        }
        let gb = self.prepared.get().map_or_else(|| self.best_plan(gpu).gb, |k| k.0.gb);
        let sms = gpu.multiprocessors() as usize;
        let (blocks, most, per_sm) = match self.kernel {
            // As many per SM as the kernel's registers allow (`MIN_BLOCKS` in the kernel).
            SplitKernel::TensorCores => (batch * self.keys.heads, MMA_MAX_SPLIT, mma_blocks(self.keys.head_dim)),
            SplitKernel::Tables => (batch * self.keys.heads * (self.group() / gb), MAX_SPLIT, 1),
        };
        let slots = sms * per_sm;
        let fewest = s.div_ceil(most).max(1);
        let waves = (blocks * fewest).div_ceil(slots);
        let n = (waves * slots / blocks).clamp(fewest, s.div_ceil(256).max(fewest));
        match self.kernel {
            SplitKernel::TensorCores => fewest_with_steps(s, n, fewest),
            SplitKernel::Tables => n,
        }
    }

    /// Decode attention for `q` (`[batch, q_heads, D]` f32) over `s` coded positions
    /// (`kcodes`/`vcodes`: `[batch, kv_heads, s, subspaces]` bytes) and `w` f16 window rows
    /// (`[batch, kv_heads, w, D]`), into `out` (`[batch, q_heads, D]`).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        gpu: &Gpu,
        q: &CudaSlice<f32>,
        kcodes: &CudaSlice<u8>,
        vcodes: &CudaSlice<u8>,
        batch: usize,
        s: usize,
        window_k: &CudaSlice<u16>,
        window_v: &CudaSlice<u16>,
        w: usize,
        scale: f32,
        scratch: &mut AttentionScratch,
        out: &mut CudaSlice<f32>,
    ) -> Result<usize> {
        let codes = Coded { keys: kcodes.as_view(), values: vcodes.as_view(), len: s, stride: s };
        let window = Window {
            keys: window_k.as_view(),
            values: window_v.as_view(),
            rows: w,
            map: WindowMap::all(w),
            just_written: false,
        };
        self.attend_cache(gpu, &q.as_view(), batch, &codes, &window, scale, scratch, &mut out.as_view_mut())
    }

    /// Decode attention of `q` (`[batch, q_heads, D]` f32) over a cache's codes and f16 rows, into
    /// `out` (`[batch, q_heads, D]`). One launch on tensor cores, two on lookup tables; the merge
    /// alone when nothing is coded yet. Returns the launches issued.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_cache(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        batch: usize,
        codes: &Coded,
        window: &Window,
        scale: f32,
        scratch: &mut AttentionScratch,
        out: &mut CudaViewMut<f32>,
    ) -> Result<usize> {
        self.attend_impl(gpu, q, batch, codes, window, None, scale, scratch, out)
    }

    /// Whether [`attend_ragged`](Self::attend_ragged) takes `batch` sequences of at most `max_len`
    /// coded positions beside `w` window rows: every split kernel and the merge alone do, as long
    /// as the window and the merge's shared memory fit.
    pub fn takes_ragged(&self, gpu: &Gpu, batch: usize, max_len: usize, w: usize) -> Result<bool> {
        if batch == 0 || w > MAX_WINDOW {
            return Ok(false);
        }
        let nsplit = self.splits(gpu, batch, max_len);
        Ok(Plan::merge_smem(w, self.keys.head_dim, self.group(), nsplit) <= gpu.max_smem)
    }

    /// Decode attention of a ragged batch: sequences at different positions, each with its own
    /// slot, coded length and window map ([`Ragged`]), in the launches of one uniform batch (one
    /// on tensor cores, two on tables, the merge alone when nothing is coded). `q` and `out` are
    /// the step's packed rows (`[tokens, q_heads, D]`, a sequence's at its row), `codes` and
    /// `window` every slot's (from slot 0; `codes.len` the longest coded length, `window.map`
    /// unused). Only where [`takes_ragged`](Self::takes_ragged) says so. Returns the launches
    /// issued.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_ragged(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        codes: &Coded,
        window: &Window,
        ragged: &Ragged,
        scale: f32,
        scratch: &mut AttentionScratch,
        out: &mut CudaViewMut<f32>,
    ) -> Result<usize> {
        let batch = ragged.host.len() / RAGGED_INTS;
        if !self.takes_ragged(gpu, batch, codes.len, window.rows)? {
            return Err(Error::Device(format!(
                "a ragged batch of {batch} beside {} window rows (at most {MAX_WINDOW}) does not fit the merge",
                window.rows
            )));
        }
        self.attend_impl(gpu, q, batch, codes, window, Some(ragged), scale, scratch, out)
    }

    /// Checks a ragged table against the buffers: every sequence's slot inside the codes and the
    /// window rows, its query row inside `q` and `out`, its coded length within `codes.len`, its
    /// window map inside `w` rows, something to attend.
    fn check_ragged(&self, ragged: &Ragged, codes: &Coded, window: &Window, q_rows: usize) -> Result<()> {
        let (k, v) = (&self.keys, &self.values);
        let (d, hkv, w) = (k.head_dim, k.heads, window.rows);
        let code_slots = (codes.keys.len() / (hkv * codes.stride * k.subspaces()))
            .min(codes.values.len() / (hkv * codes.stride * v.subspaces()));
        let window_slots = (window.keys.len().min(window.values.len())) / (hkv * w * d).max(1);
        let bad = |i: usize, why: &str| Err(Error::Shape(format!("ragged batch, sequence {i}: {why}")));
        for (i, r) in ragged.sequences(RAGGED_INTS)?.enumerate() {
            if r.iter().any(|&x| x < 0) {
                return bad(i, "negative entry");
            }
            let e: Vec<usize> = r.iter().map(|&x| x as usize).collect();
            let [slot, row, len, n_sink, sink_cap, head, ring_len, ring_cap] = e[..] else {
                unreachable!("chunks of RAGGED_INTS")
            };
            let ring_ok = ring_cap >= 1 && head < ring_cap && ring_len <= ring_cap && sink_cap + ring_cap <= w;
            if slot >= code_slots.min(window_slots) {
                return bad(i, "slot outside the codes or the window rows");
            }
            if row >= q_rows {
                return bad(i, "query row outside the step");
            }
            if len > codes.len || n_sink > sink_cap || !ring_ok || len + n_sink + ring_len == 0 {
                return bad(i, "coded length or window map out of range");
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn attend_impl(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        batch: usize,
        codes: &Coded,
        window: &Window,
        ragged: Option<&Ragged>,
        scale: f32,
        scratch: &mut AttentionScratch,
        out: &mut CudaViewMut<f32>,
    ) -> Result<usize> {
        let (k, v) = (&self.keys, &self.values);
        if k.rotate != v.rotate {
            return Err(Error::Device("keys and values must both rotate or both not".into()));
        }
        let (d, hkv, s, w) = (k.head_dim, k.heads, codes.len, window.rows);
        let something = ragged.is_some() || s + window.map.positions() > 0;
        if w > MAX_WINDOW || !something || codes.stride < s {
            return Err(Error::Device(format!(
                "attention over {s} codes (stride {}) and {} of {w} window rows (window ≤ {MAX_WINDOW}, something to attend)",
                codes.stride,
                window.map.positions()
            )));
        }
        let nsplit = self.splits(gpu, batch, s);
        let split = s.div_ceil(nsplit.max(1)).max(1);
        let streams = batch * hkv;
        if !scratch.fits(batch * self.q_heads * nsplit, streams, d) {
            return Err(Error::Device(format!("attention scratch too small for {nsplit} splits of {batch} sequences")));
        }
        let sizes_ok = match ragged {
            // Per sequence: its slot and query row are checked against the buffers.
            Some(r) => {
                let rows = (q.len().min(out.len())) / (self.q_heads * d);
                self.check_ragged(r, codes, window, rows)?;
                true
            }
            None => {
                q.len() >= batch * self.q_heads * d
                    && codes.keys.len() >= streams * codes.stride * k.subspaces()
                    && codes.values.len() >= streams * codes.stride * v.subspaces()
                    && window.keys.len() >= streams * w * d
                    && window.values.len() >= streams * w * d
                    && out.len() >= batch * self.q_heads * d
            }
        };
        if !sizes_ok {
            return Err(Error::Shape("attention: a buffer is smaller than the shapes say".into()));
        }
        let (plan, split_fn, merge_fn) = self.kernels(gpu)?;
        let smem = plan.split_smem() as u32;
        let merge_smem = Plan::merge_smem(w, d, self.group(), nsplit);
        if merge_smem > gpu.max_smem {
            return Err(Error::Device(format!("the merge of {nsplit} splits and {w} window rows needs {merge_smem} B of shared memory, the device allows {}", gpu.max_smem)));
        }
        // The tensor-core kernel merges in its last block per stream when the merge fits its shared memory.
        let fused = plan.kernel == SplitKernel::TensorCores && self.fuse_merge && merge_smem <= smem as usize;
        let w_i = w as i32;
        if nsplit > 0 {
            let (s_i, stride, split_i) = (s as i32, codes.stride as i64, split as i32);
            let cfg = match plan.kernel {
                SplitKernel::TensorCores => LaunchConfig {
                    grid_dim: (nsplit as u32, streams as u32, 1),
                    block_dim: (MMA_THREADS, 1, 1),
                    shared_mem_bytes: smem,
                },
                SplitKernel::Tables => {
                    let g = (self.group() / plan.gb) as u32;
                    LaunchConfig {
                        grid_dim: (g, nsplit as u32, streams as u32),
                        block_dim: (plan.threads, 1, 1),
                        shared_mem_bytes: smem,
                    }
                }
            };
            let mut l = Launch::new(gpu.stream(), split_fn);
            l.buf(q).buf(&codes.keys).buf(&codes.values);
            match plan.kernel {
                SplitKernel::TensorCores => l.buf(&k.centroids_f16).buf(&v.centroids_f16),
                SplitKernel::Tables => l.buf(&k.centroids).buf(&v.centroids),
            };
            l.buf(&k.mean).buf(&k.scale);
            l.buf_mut(&mut scratch.part_o)
                .buf_mut(&mut scratch.part_ml)
                .val(&s_i)
                .val(&stride)
                .val(&split_i)
                .val(&scale);
            let tensor_cores = plan.kernel == SplitKernel::TensorCores;
            // Early only when this launch merges: a separate merge waits for the split kernel,
            // whose end must then imply the put's (its blocks wait when not early).
            let (fuse, early) = (fused as i32, (fused && window.just_written) as i32);
            if tensor_cores {
                l.buf(&window.keys)
                    .buf(&window.values)
                    .buf(&v.mean)
                    .buf(&v.scale)
                    .buf_mut(&mut *out)
                    .val(&w_i)
                    .val(&window.map)
                    .buf_mut(&mut scratch.done)
                    .val(&fuse)
                    .val(&early);
            }
            ragged_args(&mut l, ragged, &v.mean);
            // SAFETY: the arguments follow the split kernel's signature in order (vq_attend_mma:
            // q, key and value codes, f16 books, key mean and scale, partials, S, stride, split,
            // scale, then window rows, value mean and scale, out, W, map, counters, fuse, early;
            // vq_attend_split goes from scale to the last two), then the ragged table and its flag
            // (a checked table: every slot, query row, length and map inside the buffers); the
            // size checks above keep every stream's codes, rows, partials and outputs inside
            // their buffers, and `WindowMap` is `repr(C)`. Only the tensor-core kernel is launched
            // overlapped: it waits before the reads its predecessor may write (all of them unless
            // `just_written`, else the window rows).
            unsafe { l.run(cfg, tensor_cores && gpu.overlaps()) }?;
            if fused {
                return Ok(1);
            }
        }
        let nsplit_i = nsplit as i32;
        let cfg = LaunchConfig {
            grid_dim: (streams as u32, 1, 1),
            block_dim: (Plan::merge_threads(self.group()), 1, 1),
            shared_mem_bytes: merge_smem as u32,
        };
        let mut l = Launch::new(gpu.stream(), merge_fn);
        l.buf(q)
            .buf(&scratch.part_o)
            .buf(&scratch.part_ml)
            .buf(&window.keys)
            .buf(&window.values)
            .buf(&v.mean)
            .buf(&v.scale)
            .buf_mut(out);
        l.val(&nsplit_i).val(&w_i).val(&window.map).val(&scale);
        ragged_args(&mut l, ragged, &v.mean);
        // SAFETY: the arguments follow vq_attend_merge's signature (q, part_o, part_ml, window
        // keys and values, value mean and scale, out, nsplit, W, map, scale, the ragged table
        // and its flag: checked as above); one block per stream reads `nsplit` partials per
        // query head, all inside the checked scratch. It waits for its predecessors before
        // reading anything (merge_stream).
        unsafe { l.run(cfg, gpu.overlaps()) }?;
        Ok(1 + usize::from(nsplit > 0))
    }
}

/// The last two arguments of every attention kernel: the ragged table and 1, or any device
/// pointer (never read) and 0.
fn ragged_args<'a>(l: &mut Launch<'a>, ragged: Option<&'a Ragged>, unread: &'a CudaSlice<f32>) {
    match ragged {
        Some(r) => l.buf(&r.table).val(&1i32),
        None => l.buf(unread).val(&0i32),
    };
}

/// Steps of 16 positions the busiest warp of a tensor-core block takes when `s` positions are
/// split `n` ways (runs of whole steps per warp, as the kernel assigns them).
fn mma_steps(s: usize, n: usize) -> usize {
    s.div_ceil(n).div_ceil(MMA_THREADS as usize / 32).div_ceil(16)
}

/// The fewest splits (≥ `fewest`) whose busiest warp takes no more steps than with `n`: the same
/// time, fewer partials for the merge to read.
fn fewest_with_steps(s: usize, n: usize, fewest: usize) -> usize {
    let steps = mma_steps(s, n);
    (fewest..=n).find(|&m| mma_steps(s, m) <= steps).unwrap_or(n)
}

/// A cache's codes: `[streams, stride, subspaces]` bytes each (stream = sequence × kv head), the
/// first `len` positions of every stream filled.
pub struct Coded<'a> {
    /// Key codes.
    pub keys: CudaView<'a, u8>,
    /// Value codes.
    pub values: CudaView<'a, u8>,
    /// Positions filled in every stream.
    pub len: usize,
    /// Positions a stream has room for.
    pub stride: usize,
}

/// Ints per sequence of a ragged table: slot, packed query row, coded length, then the window
/// map's five (`n_sink`, `sink_cap`, `ring_head`, `ring_len`, `ring_cap`).
pub const RAGGED_INTS: usize = 8;

/// One sequence's entry of a ragged table, in the order `vq_attend_mma` reads it: its slot, its
/// packed query row, its coded length and its window map.
pub fn ragged_entry(slot: usize, row: usize, coded: usize, map: WindowMap) -> [i32; RAGGED_INTS] {
    let WindowMap { n_sink, sink_cap, ring_head, ring_len, ring_cap } = map;
    [slot as i32, row as i32, coded as i32, n_sink, sink_cap, ring_head, ring_len, ring_cap]
}

/// A ragged batch: a table of ints per sequence ([`RAGGED_INTS`] for
/// [`GpuAttention::attend_ragged`], [`DENSE_RAGGED_INTS`](super::DENSE_RAGGED_INTS) for
/// [`GpuDenseAttention::attend_ragged`](super::GpuDenseAttention::attend_ragged)), on the device
/// (`table`, what the kernel reads) and on the host (`host`, the same values, checked before the
/// launch).
pub struct Ragged<'a> {
    /// The table on the device.
    pub table: CudaView<'a, i32>,
    /// The same table on the host.
    pub host: &'a [i32],
}

impl Ragged<'_> {
    /// The host table's entries of `ints` ints each, once the table is checked whole (at least
    /// one sequence, whole entries) and as long on the device.
    pub(super) fn sequences(&self, ints: usize) -> Result<std::slice::ChunksExact<'_, i32>> {
        if self.host.is_empty() || !self.host.len().is_multiple_of(ints) || self.table.len() < self.host.len() {
            return Err(Error::Shape(format!(
                "a ragged table holds {ints} ints per sequence, on the device as on the host"
            )));
        }
        Ok(self.host.chunks_exact(ints))
    }
}

/// A cache's f16 rows: `[streams, rows, head_dim]` each, `map` says which rows hold positions.
/// `just_written`: the launch right before the attention's in the stream wrote some of these rows
/// and nothing else the attention reads (a decode step's put), so the split kernel scores codes
/// while it runs when it also merges (launch.rs); false makes no such promise.
pub struct Window<'a> {
    /// Key rows (f16 bits).
    pub keys: CudaView<'a, u16>,
    /// Value rows (f16 bits).
    pub values: CudaView<'a, u16>,
    /// Rows per stream.
    pub rows: usize,
    /// Which rows hold positions.
    pub map: WindowMap,
    /// The launch before wrote some of these rows and nothing else the attention reads.
    pub just_written: bool,
}

/// Which f16 rows of a stream hold positions (mirrors `WindowMap` in `attention.cu`): rows
/// `[0, n_sink)`, and ring rows `sink_cap + (ring_head + i) mod ring_cap` for `i < ring_len`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowMap {
    /// Sink rows holding positions.
    pub n_sink: i32,
    /// Sink rows reserved (where the ring starts).
    pub sink_cap: i32,
    /// The ring's oldest row.
    pub ring_head: i32,
    /// Ring rows holding positions.
    pub ring_len: i32,
    /// Ring rows reserved.
    pub ring_cap: i32,
}

impl WindowMap {
    /// All of `rows` rows hold positions.
    pub fn all(rows: usize) -> Self {
        Self { n_sink: rows as i32, sink_cap: rows as i32, ring_head: 0, ring_len: 0, ring_cap: 1 }
    }
    /// Positions held.
    pub fn positions(&self) -> usize {
        (self.n_sink + self.ring_len) as usize
    }
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for WindowMap {}

/// Sizes and layout choices of the split kernel for one geometry, 8-bit codebooks (no GPU needed).
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    d: usize,
    sd_k: usize,
    sd_v: usize,
    q_heads: usize,
    kv_heads: usize,
    /// (keys, values)
    center: (bool, bool),
    smooth: (bool, bool),
    rotate: bool,
    /// Query heads per block.
    gb: usize,
    threads: u32,
    /// Value pass in packed f16 (`VALUES_F16`).
    half_values: bool,
    kernel: SplitKernel,
}

impl Plan {
    const CENTROIDS: usize = 256;
    /// Bytes of the tensor-core kernel's two f16 codebooks (16 replicas of 4 elements each).
    const MMA_BOOKS: usize = 2 * Self::CENTROIDS * 16 * 4 * 2;

    /// The Llama-3.1-8B geometry (2-bit codes, key centering and smoothing, rotation) with `kernel`:
    /// the base the compile checks and tests vary.
    fn example(kernel: SplitKernel) -> Self {
        Plan {
            d: 128,
            sd_k: 4,
            sd_v: 4,
            q_heads: 32,
            kv_heads: 8,
            center: (true, true),
            smooth: (true, false),
            rotate: true,
            gb: 4,
            threads: DEFAULT_THREADS,
            half_values: false,
            kernel,
        }
    }

    fn m_k(&self) -> usize {
        self.d / self.sd_k
    }

    fn m_v(&self) -> usize {
        self.d / self.sd_v
    }

    /// Floats of one table entry (the heads of a block, padded to a vector load).
    fn entry(&self) -> usize {
        if self.gb == 3 {
            4
        } else {
            self.gb
        }
    }

    /// Sub-spaces interleaved per code in the table: as many as the lanes of one shared-memory
    /// phase (so their random codes still hit distinct banks), a power of two dividing M_K.
    fn interleave(&self) -> usize {
        let m = self.m_k();
        let mut pj = (32 / self.entry()).min(m).next_power_of_two();
        while pj > 1 && (!m.is_multiple_of(pj) || pj > m) {
            pj /= 2;
        }
        pj
    }

    /// 32-bit words per value centroid in shared memory (f32, or f16 pairs).
    fn value_words(&self) -> usize {
        if self.half_values {
            self.sd_v / 2
        } else {
            self.sd_v
        }
    }

    /// Copies of the value codebook (one per lane of a 128-byte phase).
    fn replicas(&self) -> usize {
        (32 / self.value_words()).max(1)
    }

    /// Floats of the table space: the key lookup tables, later the staged value codes and the
    /// per-warp partials.
    fn table(&self) -> usize {
        let slots = (self.threads as usize / 32) * (32 / self.m_v().min(32));
        (self.entry() * self.m_k() * Self::CENTROIDS)
            .max((self.m_v() * MIN_CHUNK).div_ceil(4))
            .max(slots * self.gb * self.d)
    }

    /// Value-code tokens staged per step: as many as fill the table space.
    fn chunk(&self) -> usize {
        (self.table() * 4 / self.m_v() / 16 * 16).clamp(16, MAX_SPLIT)
    }

    /// Shared memory of the split kernel in use.
    fn split_smem(&self) -> usize {
        whole_words(match self.kernel {
            // Two f16 codebooks × 16 replicas, the queries, offsets, warp maxima and sums.
            SplitKernel::TensorCores => {
                Self::MMA_BOOKS + (self.group() * self.d + 8 + (MMA_THREADS as usize / 32) * 16) * 4
            }
            SplitKernel::Tables => self.smem(),
        })
    }

    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Shared memory of the merge of `g` query heads (`merge.cu`): a stream's `w` f16 window rows
    /// of keys and values, the heads' split weights, code-space sums and masses.
    fn merge_smem(w: usize, d: usize, g: usize, nsplit: usize) -> usize {
        whole_words(2 * w * d * 2 + (g * nsplit + g * d + g) * 4)
    }

    /// Threads of the merge kernel (its `MERGE_THREADS`): a warp per query head, at least 8 warps.
    fn merge_threads(g: usize) -> u32 {
        32 * g.max(8) as u32
    }

    /// Defines of the merge (`merge.cu`).
    fn merge_defines(&self) -> Vec<(&'static str, i64)> {
        let b = |x: bool| x as i64;
        vec![
            ("D", self.d as i64),
            ("HQ", self.q_heads as i64),
            ("HKV", self.kv_heads as i64),
            ("G", self.group() as i64),
            ("CENTER_V", b(self.center.1)),
            ("SMOOTH_V", b(self.smooth.1)),
            ("ROTATE", b(self.rotate)),
            ("MERGE_THREADS", Self::merge_threads(self.group()) as i64),
        ]
    }

    /// Defines of the tensor-core split kernel (which ends with the merge).
    fn mma_defines(&self) -> Vec<(&'static str, i64)> {
        let b = |x: bool| x as i64;
        let mut d = self.merge_defines();
        d.extend([
            ("SDK", self.sd_k as i64),
            ("SDV", self.sd_v as i64),
            ("CENTER_K", b(self.center.0)),
            ("SMOOTH_K", b(self.smooth.0)),
            ("WARPS", (MMA_THREADS / 32) as i64),
            ("MIN_BLOCKS", mma_blocks(self.d) as i64),
        ]);
        d
    }

    /// Shared memory of the table kernel.
    fn smem(&self) -> usize {
        whole_words(
            (self.table()
                + self.entry() * MAX_SPLIT
                + Self::CENTROIDS * self.replicas() * self.value_words()
                + self.gb * self.d
                + self.gb * 32)
                * 4,
        )
    }

    fn defines(&self) -> Vec<(&'static str, i64)> {
        let b = |x: bool| x as i64;
        let mut d = self.merge_defines();
        d.extend([
            ("M_K", self.m_k() as i64),
            ("SD_K", self.sd_k as i64),
            ("K_K", Self::CENTROIDS as i64),
            ("M_V", self.m_v() as i64),
            ("SD_V", self.sd_v as i64),
            ("K_V", Self::CENTROIDS as i64),
            ("CENTER_K", b(self.center.0)),
            ("SMOOTH_K", b(self.smooth.0)),
            ("MAX_SPLIT", MAX_SPLIT as i64),
            ("GB", self.gb as i64),
            ("TABLE", self.table() as i64),
            ("CHUNK", self.chunk() as i64),
            ("THREADS", self.threads as i64),
            ("GBP", self.entry() as i64),
            ("PJ", self.interleave() as i64),
            ("RV", self.replicas() as i64),
            ("VALUES_F16", self.half_values as i64),
        ]);
        d
    }
}

/// Defines of several geometries (D 64/128/256, sub_dim 2/4/8, 1–4 heads per block), for the
/// NVRTC compile check.
pub(super) fn example_defines() -> Vec<Vec<(&'static str, i64)>> {
    let base = Plan::example(SplitKernel::Tables);
    [
        base,
        Plan { d: 64, sd_k: 8, sd_v: 8, gb: 1, q_heads: 8, threads: 1024, ..base },
        Plan { d: 256, sd_k: 4, sd_v: 2, gb: 2, q_heads: 16, center: (false, false), threads: 256, ..base },
        Plan { q_heads: 24, gb: 3, smooth: (false, true), rotate: false, ..base },
        Plan { half_values: true, ..base },
        Plan { d: 256, sd_k: 4, sd_v: 2, gb: 2, q_heads: 16, half_values: true, ..base },
    ]
    .iter()
    .map(Plan::defines)
    .collect()
}

/// Defines of the tensor-core split kernel for D 64/128/256, groups of 1–8 heads and every pair of
/// sub_dims, for the NVRTC compile check.
pub(super) fn example_mma_defines() -> Vec<Vec<(&'static str, i64)>> {
    let base = Plan::example(SplitKernel::TensorCores);
    let (vq4, smollm2) =
        (Plan { sd_k: 2, sd_v: 2, ..base }, Plan { d: 64, q_heads: 9, kv_heads: 3, sd_k: 2, sd_v: 2, ..base });
    [
        base,
        Plan { d: 64, q_heads: 9, kv_heads: 3, ..base },
        Plan { d: 256, q_heads: 8, kv_heads: 1, center: (false, false), smooth: (false, false), rotate: false, ..base },
        Plan { q_heads: 4, kv_heads: 4, ..base },
        vq4,
        smollm2,
        Plan { d: 256, q_heads: 8, kv_heads: 1, ..vq4 },
        Plan { sd_k: 2, sd_v: 4, ..base },
        Plan { d: 256, q_heads: 8, kv_heads: 1, sd_k: 4, sd_v: 2, ..base },
        Plan { q_heads: 16, kv_heads: 2, sd_k: 4, sd_v: 2, ..base },
        Plan { d: 256, q_heads: 8, kv_heads: 1, sd_k: 2, sd_v: 4, ..base },
    ]
    .iter()
    .map(Plan::mma_defines)
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `vq_attend_mma` reads entry b as slot, query row, coded length, then `WindowMap`'s fields
    /// in their declared order (`r[3..8]`).
    #[test]
    fn a_ragged_entry_is_laid_out_as_the_kernel_reads_it() {
        let map = WindowMap { n_sink: 3, sink_cap: 4, ring_head: 5, ring_len: 6, ring_cap: 7 };
        assert_eq!(ragged_entry(2, 9, 40, map), [2, 9, 40, 3, 4, 5, 6, 7]);
    }

    fn geometry(heads: usize, head_dim: usize, sub_dim: usize) -> Geometry {
        Geometry { heads, head_dim, sub_dim, bits: 8, per_layer: true }
    }

    /// Trimmed split counts keep the busiest warp's steps: 131,072 positions over 33 splits
    /// (3,972 each: runs of 512 positions, 32 steps) need only 32 splits; 31 would take 34 steps.
    #[test]
    fn splits_trim_to_the_same_steps() {
        assert_eq!(mma_steps(131072, 33), 32);
        assert_eq!(fewest_with_steps(131072, 33, 8), 32);
        assert_eq!(mma_steps(131072, 31), 34);
        for (s, n, fewest) in [(65536, 4, 4), (1024, 4, 1), (20011, 33, 2), (5, 1, 1), (131071, 66, 8)] {
            let m = fewest_with_steps(s, n, fewest);
            assert!((fewest..=n).contains(&m) && mma_steps(s, m) == mma_steps(s, n), "{s} over {n}: {m}");
            assert!(m == fewest || mma_steps(s, m - 1) > mma_steps(s, n), "{s} over {n}: {m} is not the fewest");
        }
    }

    /// The tensor-core kernel is chosen exactly where its layout holds: sub-vectors of 2 or 4,
    /// head_dim 64/128/256, at most 8 query heads per kv head.
    #[test]
    fn tensor_cores_take_their_geometries_only() {
        assert!(mma_geometry(&geometry(8, 128, 4), &geometry(8, 128, 4), 32));
        assert!(mma_geometry(&geometry(3, 64, 4), &geometry(3, 64, 4), 9));
        assert!(mma_geometry(&geometry(1, 256, 4), &geometry(1, 256, 4), 8));
        assert!(mma_geometry(&geometry(3, 64, 2), &geometry(3, 64, 2), 9));
        assert!(mma_geometry(&geometry(8, 128, 2), &geometry(8, 128, 4), 32));
        assert!(mma_geometry(&geometry(8, 128, 4), &geometry(8, 128, 2), 32));
        assert!(!mma_geometry(&geometry(8, 128, 8), &geometry(8, 128, 8), 32));
        assert!(!mma_geometry(&geometry(8, 128, 4), &geometry(8, 128, 8), 32));
        assert!(!mma_geometry(&geometry(2, 128, 4), &geometry(2, 128, 4), 32));
        assert!(!mma_geometry(&geometry(4, 96, 4), &geometry(4, 96, 4), 8));
    }

    /// Every tensor-core plan fits the H200's 227 KiB of shared memory per block with room for a
    /// second block, and its warp partials fit over the two codebooks they overwrite.
    #[test]
    fn tensor_core_plans_fit_shared_memory() {
        for (d, hq, hkv) in [(64, 9, 3), (128, 32, 8), (128, 8, 8), (256, 8, 1)] {
            let p = Plan { d, q_heads: hq, kv_heads: hkv, ..Plan::example(SplitKernel::TensorCores) };
            assert!(2 * p.split_smem() <= 227 * 1024, "D {d}: {} B", p.split_smem());
            let partials = (MMA_THREADS as usize / 32) * (hq / hkv) * d * 4;
            assert!(partials <= Plan::MMA_BOOKS, "D {d}, group {}: {partials} B of partials", hq / hkv);
        }
    }
}
