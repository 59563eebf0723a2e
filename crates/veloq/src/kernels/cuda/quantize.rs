//! Host side of the fused quantize kernel (`quantize.cu`).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{dev_err, Gpu};
use crate::codec::codebook::Granularity;
use crate::codec::vecinfer::VecInferCodec;
use crate::error::{Error, Result};

pub(super) const SOURCE: &str = include_str!("quantize.cu");
const ROWS: usize = 32;
const THREADS: u32 = 256;

/// A VecInfer codec's tables on the GPU.
pub struct GpuCodec {
    pub(super) heads: usize,
    pub(super) head_dim: usize,
    pub(super) sub_dim: usize,
    pub(super) bits: u32,
    pub(super) books: usize,
    pub(super) center: bool,
    pub(super) smooth: bool,
    pub(super) rotate: bool,
    pub(super) mean: CudaSlice<f32>,
    pub(super) scale: CudaSlice<f32>,
    pub(super) inv_scale: CudaSlice<f32>,
    pub(super) centroids: CudaSlice<f32>,
    pub(super) norms: CudaSlice<f32>,
}

impl GpuCodec {
    /// Uploads `codec`. The CUDA path takes power-of-two head_dim 32..=256 with at least 8
    /// sub-vectors per head.
    pub fn upload(gpu: &Gpu, codec: &VecInferCodec) -> Result<Self> {
        let (d, shape) = (codec.head_dim(), codec.shape());
        if !d.is_power_of_two() || !(32..=256).contains(&d) || (d / shape.sub_dim) % 8 != 0 {
            return Err(Error::Device(format!("CUDA kernels take power-of-two head_dim 32..=256 with ≥ 8 sub-vectors; got {d}/{}", shape.sub_dim)));
        }
        let s = gpu.stream();
        let up = |v: &[f32]| s.clone_htod(if v.is_empty() { &[0.0f32][..] } else { v }).map_err(dev_err);
        let mean = codec.mean().map(|m| m.to_vec()).unwrap_or_default();
        let scale = codec.smooth().map(|m| m.as_slice().to_vec()).unwrap_or_default();
        let inv: Vec<f32> = scale.iter().map(|s| 1.0 / s).collect();
        let centroids: Vec<f32> = codec.books().books().iter().flat_map(|b| b.centroids().iter().copied()).collect();
        let norms: Vec<f32> = codec.books().books().iter().flat_map(|b| b.norms().iter().copied()).collect();
        Ok(Self {
            heads: codec.n_heads(),
            head_dim: d,
            sub_dim: shape.sub_dim,
            bits: shape.bits,
            books: if codec.books().granularity() == Granularity::PerLayer { 1 } else { d / shape.sub_dim },
            center: codec.mean().is_some(),
            smooth: codec.smooth().is_some(),
            rotate: codec.rotates(),
            mean: up(&mean)?,
            scale: up(&scale)?,
            inv_scale: up(&inv)?,
            centroids: up(&centroids)?,
            norms: up(&norms)?,
        })
    }

    pub(super) fn subspaces(&self) -> usize {
        self.head_dim / self.sub_dim
    }
    pub(super) fn centroids(&self) -> usize {
        1 << self.bits
    }

    /// Packed code bytes for `rows` head vectors.
    pub fn code_bytes(&self, rows: usize) -> usize {
        (rows * self.subspaces() * self.bits as usize).div_ceil(8)
    }

    fn defines(&self) -> Vec<(&'static str, i64)> {
        vec![
            ("D", self.head_dim as i64),
            ("SD", self.sub_dim as i64),
            ("K", self.centroids() as i64),
            ("BITS", self.bits as i64),
            ("M", self.subspaces() as i64),
            ("BOOKS", self.books as i64),
            ("HEADS", self.heads as i64),
            ("ROWS", ROWS as i64),
            ("CENTER", self.center as i64),
            ("SMOOTH", self.smooth as i64),
            ("ROTATE", self.rotate as i64),
        ]
    }

    fn smem(&self) -> usize {
        let k = self.centroids();
        (self.books * k * self.sub_dim + self.books * k + ROWS * self.head_dim) * 4 + ROWS * self.subspaces() * 2
    }

    /// Encodes `rows` f16 head vectors (`x`: f16 bits, `[rows, head_dim]`, row = token·heads + head)
    /// into `out` ([`code_bytes`](Self::code_bytes)), byte-identical in layout to the CPU encoder.
    pub fn quantize(&self, gpu: &Gpu, x: &CudaSlice<u16>, rows: usize, out: &mut CudaSlice<u8>) -> Result<()> {
        if x.len() < rows * self.head_dim || out.len() < self.code_bytes(rows) {
            return Err(Error::Shape(format!("quantize: {rows} rows need {} inputs and {} output bytes", rows * self.head_dim, self.code_bytes(rows))));
        }
        if rows == 0 {
            return Ok(());
        }
        let smem = self.smem();
        let f = gpu.kernel(SOURCE, "vq_quantize", &self.defines(), smem)?;
        let tiles = rows.div_ceil(ROWS) as u32;
        let blocks = tiles.min(gpu.multiprocessors() * 8);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: smem as u32 };
        let n = rows as i32;
        let mut launch = gpu.stream().launch_builder(&f);
        launch.arg(x).arg(&self.mean).arg(&self.inv_scale).arg(&self.centroids).arg(&self.norms).arg(out).arg(&n);
        unsafe { launch.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }
}

pub(super) fn example_defines() -> Vec<(&'static str, i64)> {
    [("D", 128), ("SD", 4), ("K", 256), ("BITS", 12), ("M", 32), ("BOOKS", 1), ("HEADS", 8), ("ROWS", 32), ("CENTER", 1), ("SMOOTH", 1), ("ROTATE", 1)].to_vec()
}
