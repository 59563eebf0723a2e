//! Host side of the fused decode attention over codes (`attention.cu`): a split kernel over the
//! sequence and a merge kernel, two launches per layer and decode step.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::quantize::GpuCodec;
use super::{dev_err, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCE: &str = include_str!("attention.cu");
const THREADS: u32 = 256;
/// Most tokens one split block scores (its softmax weights sit in shared memory).
const MAX_SPLIT: usize = 2048;
/// Value codes staged in shared memory per step.
const CHUNK: usize = 256;
/// Most f16 window rows the merge kernel takes.
pub const MAX_WINDOW: usize = 62;

/// Key and value codecs of one layer on the GPU, with the query-head geometry.
pub struct GpuAttention {
    pub keys: GpuCodec,
    pub values: GpuCodec,
    pub q_heads: usize,
}

/// Partials of the split kernel, reused across calls.
pub struct AttentionScratch {
    part_o: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

impl AttentionScratch {
    pub fn new(gpu: &Gpu, batch: usize, q_heads: usize, head_dim: usize, max_splits: usize) -> Result<Self> {
        let n = batch * q_heads * max_splits;
        Ok(Self {
            part_o: gpu.stream().alloc_zeros(n * head_dim).map_err(dev_err)?,
            part_ml: gpu.stream().alloc_zeros(n * 2).map_err(dev_err)?,
        })
    }
}

impl GpuAttention {
    pub fn new(keys: GpuCodec, values: GpuCodec, q_heads: usize) -> Result<Self> {
        let ok = keys.bits == 8 && values.bits == 8 && keys.books == 1 && values.books == 1;
        if !ok || keys.heads != values.heads || keys.head_dim != values.head_dim || q_heads % keys.heads != 0 {
            return Err(Error::Device("CUDA attention takes 8-bit per-layer codebooks for keys and values of one geometry, q_heads a multiple of kv heads".into()));
        }
        Ok(Self { keys, values, q_heads })
    }

    fn group(&self) -> usize {
        self.q_heads / self.keys.heads
    }

    /// Floats of the table space: the key lookup tables, later the staged value codes and the
    /// phase partials.
    fn table(&self, gb: usize) -> usize {
        let (k, v) = (&self.keys, &self.values);
        let slots = (THREADS as usize / 32) * (32 / v.subspaces().min(32));
        (gb * k.subspaces() * k.centroids()).max((v.subspaces() * CHUNK).div_ceil(4)).max(slots * gb * k.head_dim)
    }

    /// Shared memory of the split kernel for `gb` heads per block.
    fn smem(&self, gb: usize) -> usize {
        let v = &self.values;
        (self.table(gb) + gb * MAX_SPLIT + v.centroids() * v.sub_dim + gb * self.keys.head_dim + gb * 32) * 4
    }

    /// Query heads per block: the largest divisor of the GQA group whose tables fit in shared
    /// memory (each kv head's codes are then read once per block of heads).
    fn heads_per_block(&self, gpu: &Gpu) -> usize {
        let g = self.group();
        (1..=g).rev().find(|gb| g % gb == 0 && self.smem(*gb) <= gpu.max_smem).unwrap_or(1)
    }

    /// Splits the split kernel uses for `batch` × `s` tokens: about two blocks per multiprocessor,
    /// each split at most [`MAX_SPLIT`] tokens.
    pub fn splits(&self, gpu: &Gpu, batch: usize, s: usize) -> usize {
        let blocks = batch * self.keys.heads * (self.group() / self.heads_per_block(gpu));
        let fill = (2 * gpu.multiprocessors() as usize).div_ceil(blocks);
        fill.min(s.div_ceil(256)).max(s.div_ceil(MAX_SPLIT)).max(1)
    }

    fn defines(&self, gb: usize) -> Vec<(&'static str, i64)> {
        let (k, v) = (&self.keys, &self.values);
        vec![
            ("D", k.head_dim as i64),
            ("M_K", k.subspaces() as i64),
            ("SD_K", k.sub_dim as i64),
            ("K_K", k.centroids() as i64),
            ("M_V", v.subspaces() as i64),
            ("SD_V", v.sub_dim as i64),
            ("K_V", v.centroids() as i64),
            ("HQ", self.q_heads as i64),
            ("HKV", k.heads as i64),
            ("G", (self.q_heads / k.heads) as i64),
            ("CENTER_K", k.center as i64),
            ("SMOOTH_K", k.smooth as i64),
            ("CENTER_V", v.center as i64),
            ("SMOOTH_V", v.smooth as i64),
            ("ROTATE", (k.rotate && v.rotate) as i64),
            ("MAX_SPLIT", MAX_SPLIT as i64),
            ("GB", gb as i64),
            ("TABLE", self.table(gb) as i64),
            ("CHUNK", CHUNK as i64),
            ("THREADS", THREADS as i64),
        ]
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
    ) -> Result<()> {
        let (k, v) = (&self.keys, &self.values);
        if k.rotate != v.rotate {
            return Err(Error::Device("keys and values must both rotate or both not".into()));
        }
        let d = k.head_dim;
        let hkv = k.heads;
        if w > MAX_WINDOW || s + w == 0 {
            return Err(Error::Device(format!("attention over {s} codes and {w} window rows (window ≤ {MAX_WINDOW}, something to attend)")));
        }
        let nsplit = self.splits(gpu, batch, s.max(1));
        let split = s.div_ceil(nsplit).max(1);
        if scratch.part_ml.len() < batch * self.q_heads * nsplit * 2 || scratch.part_o.len() < batch * self.q_heads * nsplit * d {
            return Err(Error::Device(format!("attention scratch too small for {nsplit} splits")));
        }
        let sizes_ok = q.len() >= batch * self.q_heads * d
            && kcodes.len() >= batch * hkv * s * k.subspaces()
            && vcodes.len() >= batch * hkv * s * v.subspaces()
            && window_k.len() >= batch * hkv * w * d
            && window_v.len() >= batch * hkv * w * d
            && out.len() >= batch * self.q_heads * d;
        if !sizes_ok {
            return Err(Error::Shape("attention: a buffer is smaller than the shapes say".into()));
        }
        let gb = self.heads_per_block(gpu);
        let defines = self.defines(gb);
        let smem = self.smem(gb);
        let split_fn = gpu.kernel(SOURCE, "vq_attend_split", &defines, smem)?;
        let merge_fn = gpu.kernel(SOURCE, "vq_attend_merge", &defines, 0)?;
        let g = (self.group() / gb) as u32;
        let (s_i, split_i, nsplit_i, w_i) = (s as i32, split as i32, nsplit as i32, w as i32);
        let cfg = LaunchConfig { grid_dim: (g, nsplit as u32, (batch * hkv) as u32), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem as u32 };
        let mut l = gpu.stream().launch_builder(&split_fn);
        l.arg(q).arg(kcodes).arg(vcodes).arg(&k.centroids).arg(&v.centroids).arg(&k.mean).arg(&k.scale);
        l.arg(&mut scratch.part_o).arg(&mut scratch.part_ml).arg(&s_i).arg(&split_i).arg(&scale);
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        let cfg = LaunchConfig { grid_dim: (self.q_heads as u32, batch as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let mut l = gpu.stream().launch_builder(&merge_fn);
        l.arg(q).arg(&scratch.part_o).arg(&scratch.part_ml).arg(window_k).arg(window_v).arg(&v.mean).arg(&v.scale).arg(out);
        l.arg(&nsplit_i).arg(&w_i).arg(&scale);
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }
}

pub(super) fn example_defines() -> Vec<(&'static str, i64)> {
    [
        ("D", 128),
        ("M_K", 32),
        ("SD_K", 4),
        ("K_K", 256),
        ("M_V", 32),
        ("SD_V", 4),
        ("K_V", 256),
        ("HQ", 32),
        ("HKV", 8),
        ("G", 4),
        ("CENTER_K", 1),
        ("SMOOTH_K", 1),
        ("CENTER_V", 1),
        ("SMOOTH_V", 0),
        ("ROTATE", 1),
        ("MAX_SPLIT", 2048),
        ("GB", 4),
        ("TABLE", 4 * 32 * 256),
        ("CHUNK", 256),
        ("THREADS", 256),
    ]
    .to_vec()
}
