//! Host side of the fused quantize kernel (`quantize.cu`).

use std::sync::OnceLock;

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{dev_err, whole_words, Gpu};
use crate::codec::codebook::Granularity;
use crate::codec::search::grid::{NearestGrid, CELLS};
use crate::codec::vecinfer::VecInferCodec;
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("quantize.cu")];
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
    /// The centroids as f16 bits (the tensor-core attention stages these).
    pub(super) centroids_f16: CudaSlice<u16>,
    pub(super) norms: CudaSlice<f32>,
    /// The book's candidate lists (sub-vectors of 2, one book of ≤ 256 centroids).
    grid: Option<GridTables>,
    /// The compiled kernel, found once.
    function: OnceLock<CudaFunction>,
}

/// A [`NearestGrid`] on the GPU.
struct GridTables {
    /// lo₀, lo₁, inv₀, inv₁.
    bbox: CudaSlice<f32>,
    offsets: CudaSlice<u16>,
    entries: CudaSlice<u8>,
}

impl GpuCodec {
    /// Uploads `codec`. The CUDA path takes power-of-two head_dim 32..=256 with at least 8
    /// sub-vectors per head.
    pub fn upload(gpu: &Gpu, codec: &VecInferCodec) -> Result<Self> {
        Self::check(codec).map_err(Error::Device)?;
        let (d, shape) = (codec.head_dim(), codec.shape());
        let s = gpu.stream();
        let up = |v: &[f32]| s.clone_htod(if v.is_empty() { &[0.0f32][..] } else { v }).map_err(dev_err);
        let mean = codec.mean().map(|m| m.to_vec()).unwrap_or_default();
        let scale = codec.smooth().map(|m| m.as_slice().to_vec()).unwrap_or_default();
        let inv: Vec<f32> = scale.iter().map(|s| 1.0 / s).collect();
        let centroids: Vec<f32> = codec.books().books().iter().flat_map(|b| b.centroids().iter().copied()).collect();
        let norms: Vec<f32> = codec.books().books().iter().flat_map(|b| b.norms().iter().copied()).collect();
        let per_layer = codec.books().granularity() == Granularity::PerLayer;
        let grid = match per_layer.then(|| NearestGrid::build(codec.books().book(0))).flatten() {
            Some(g) => Some(GridTables {
                bbox: up(&[g.lo[0], g.lo[1], g.inv[0], g.inv[1]])?,
                offsets: s.clone_htod(&g.offsets).map_err(dev_err)?,
                entries: s.clone_htod(&g.entries).map_err(dev_err)?,
            }),
            None => None,
        };
        Ok(Self {
            heads: codec.n_heads(),
            head_dim: d,
            sub_dim: shape.sub_dim,
            bits: shape.bits,
            books: if per_layer { 1 } else { d / shape.sub_dim },
            center: codec.mean().is_some(),
            smooth: codec.smooth().is_some(),
            rotate: codec.rotates(),
            mean: up(&mean)?,
            scale: up(&scale)?,
            inv_scale: up(&inv)?,
            centroids_f16: s
                .clone_htod(&centroids.iter().map(|&c| half::f16::from_f32(c).to_bits()).collect::<Vec<u16>>())
                .map_err(dev_err)?,
            centroids: up(&centroids)?,
            norms: up(&norms)?,
            grid,
            function: OnceLock::new(),
        })
    }

    /// Whether the kernels take `codec` (no GPU needed): why not, if not.
    pub fn check(codec: &VecInferCodec) -> std::result::Result<(), String> {
        let (d, sd) = (codec.head_dim(), codec.shape().sub_dim);
        if !d.is_power_of_two() || !(32..=256).contains(&d) || (d / sd) % 8 != 0 {
            return Err(format!("CUDA kernels take power-of-two head_dim 32..=256 with ≥ 8 sub-vectors; got {d}/{sd}"));
        }
        Ok(())
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
            ("ROTATE", self.rotate as i64),
            ("GRID", if self.grid.is_some() { CELLS as i64 } else { 0 }),
        ]
    }

    fn smem(&self) -> usize {
        let k = self.centroids();
        whole_words(
            (self.books * k * self.sub_dim + self.books * k + ROWS * self.head_dim) * 4 + ROWS * self.subspaces() * 2,
        )
    }

    /// Whether this codec's searches scan candidate lists (sub-vectors of 2, one book).
    pub fn has_grid(&self) -> bool {
        self.grid.is_some()
    }

    /// Compiles the kernel now (it is otherwise compiled at the first call).
    pub fn prepare(&self, gpu: &Gpu) -> Result<()> {
        self.function(gpu).map(|_| ())
    }

    fn function(&self, gpu: &Gpu) -> Result<&CudaFunction> {
        if let Some(f) = self.function.get() {
            return Ok(f);
        }
        let f = gpu.kernel(SOURCES, "vq_quantize", &self.defines(), self.smem())?;
        Ok(self.function.get_or_init(|| f))
    }

    /// Bytes of the tables on the GPU (codebooks, norms, means, smoothing scales).
    pub fn table_bytes(&self) -> usize {
        4 * (self.centroids.len() + self.norms.len() + self.mean.len() + self.scale.len() + self.inv_scale.len())
    }

    /// Bytes of one head vector's codes.
    pub fn row_bytes(&self) -> usize {
        self.subspaces() * self.bits as usize / 8
    }

    /// Encodes `rows` f16 head vectors (`x`: f16 bits, `[rows, head_dim]`, row = token·heads + head)
    /// into `out` ([`code_bytes`](Self::code_bytes)), byte-identical in layout to the CPU encoder.
    pub fn quantize(&self, gpu: &Gpu, x: &CudaSlice<u16>, rows: usize, out: &mut CudaSlice<u8>) -> Result<()> {
        if !rows.is_multiple_of(self.heads) {
            return Err(Error::Shape(format!("quantize: {rows} rows are not whole tokens of {} heads", self.heads)));
        }
        let map = RowMap::tokens(rows / self.heads, self.heads);
        self.quantize_mapped(gpu, &x.as_view(), self.heads, map, &mut out.as_view_mut())
    }

    /// Encodes `t` vectors of each of `streams` streams (a stream: one kv head of one sequence)
    /// where `map` says: the layouts of `x` and `out` (see `quantize.cu`). One launch.
    pub fn quantize_mapped(
        &self,
        gpu: &Gpu,
        x: &CudaView<u16>,
        streams: usize,
        map: RowMap,
        out: &mut CudaViewMut<u8>,
    ) -> Result<()> {
        quantize_jobs(gpu, &mut [QuantizeJob { codec: self, x, out }], streams, map, QuantizeLaunch::default())
            .map(|_| ())
    }

    /// The centering and smoothing bits of the kernel's `flags` for job `job`.
    fn flags(&self, job: usize) -> i32 {
        ((self.center as i32) | (self.smooth as i32) << 1) << (2 * job)
    }

    /// Whether `x` and `out` hold every row `map` reads and writes for `streams` streams.
    fn check_rows(&self, x: &CudaView<u16>, out: &CudaViewMut<u8>, streams: usize, map: RowMap) -> Result<()> {
        let t = map.t.max(0) as usize;
        let last = |hs: i64, ts: i32, base: i32| (streams as i64 - 1) * hs + (base as i64 + t as i64 - 1) * ts as i64;
        let last_in = if map.in_wrap > 0 {
            last(map.in_hs, map.in_ts, map.in_off + map.in_wrap - t as i32)
        } else {
            last(map.in_hs, map.in_ts, map.in_base)
        };
        let last_out = last(map.out_hs, map.out_ts, map.out_base);
        let negative = map.in_hs < 0
            || map.out_hs < 0
            || map.in_ts < 0
            || map.out_ts < 0
            || map.in_base < 0
            || map.out_base < 0
            || map.in_wrap < 0
            || map.in_off < 0;
        if negative
            || (last_in as usize + 1) * self.head_dim > x.len()
            || (last_out as usize + 1) * self.row_bytes() > out.len()
        {
            return Err(Error::Shape(format!(
                "quantize: {streams}×{t} rows reach input row {last_in} and output row {last_out}; buffers hold {} and {}",
                x.len() / self.head_dim,
                out.len() / self.row_bytes()
            )));
        }
        Ok(())
    }
}

/// One codec's part of a quantize launch: the rows it reads and the codes it writes.
pub struct QuantizeJob<'a, 'x, 'o> {
    /// The codec.
    pub codec: &'a GpuCodec,
    /// Rows to code (f16 bits).
    pub x: &'a CudaView<'x, u16>,
    /// Where its codes go.
    pub out: &'a mut CudaViewMut<'o, u8>,
}

/// Threads that share one nearest-centroid search when a tile holds `items` (row, sub-space)
/// pairs: enough that the block's threads all search (two pairs a group), a power of two ≤ 32
/// (the shuffles stay inside a warp) and ≤ the centroids.
fn slices(items: usize, centroids: usize) -> u32 {
    let want = (2 * THREADS as usize / items.max(1)).clamp(1, 32.min(centroids));
    1 << want.ilog2()
}

/// A device pointer that is never dereferenced.
const NULL: u64 = 0;

/// Blocks a multiprocessor gets, rows permitting (a block's tile is the rows it searches at
/// once): one left a prompt chunk's rows on a few warps of each, more than two cost more in split
/// searches than they gained (`veloq-lab bench cuda`, "a chunk's codes"; results/README.md).
const BLOCKS_PER_SM: usize = 2;

/// How a quantize launch spreads its rows; the defaults are the product's choice, the fields
/// override them (the lab times the alternatives side by side).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuantizeLaunch {
    /// Threads per nearest-centroid search (a power of two ≤ 32 and ≤ the centroids).
    pub slices: Option<u32>,
    /// Blocks per multiprocessor the rows are tiled for (at most [`ROWS`] rows a tile).
    pub blocks_per_sm: Option<usize>,
    /// Searches through the books' candidate lists where the codecs have them, or over every
    /// centroid (`Some(false)`): the same codes either way. `None`: as
    /// [`KernelOptions::candidate_lists`](crate::kernels::KernelOptions::candidate_lists) says.
    pub grid: Option<bool>,
}

/// Encodes the same rows (`map`, `streams` streams) for each of `jobs` (one or two: a layer's
/// keys and values) in one launch when their codecs share a kernel (same geometry; centering and
/// smoothing may differ), else one launch each, spread as `launch` says. Returns the launches
/// issued.
pub fn quantize_jobs(
    gpu: &Gpu,
    jobs: &mut [QuantizeJob],
    streams: usize,
    map: RowMap,
    launch: QuantizeLaunch,
) -> Result<usize> {
    if jobs.is_empty() || jobs.len() > 2 {
        return Err(Error::Shape(format!("quantize: {} jobs in one launch (1 or 2)", jobs.len())));
    }
    let rows = streams * map.t.max(0) as usize;
    if rows == 0 {
        return Ok(0);
    }
    for j in jobs.iter() {
        j.codec.check_rows(j.x, j.out, streams, map)?;
    }
    if jobs.len() == 2 && jobs[0].codec.defines() != jobs[1].codec.defines() {
        let (a, b) = jobs.split_at_mut(1);
        return Ok(quantize_jobs(gpu, a, streams, map, launch)? + quantize_jobs(gpu, b, streams, map, launch)?);
    }
    let c = jobs[0].codec;
    let f = c.function(gpu)?;
    // Few rows (a flush of the ring's oldest, a prompt chunk): smaller tiles, several blocks per
    // multiprocessor, not one or two blocks searching every row alone, and each search spread
    // over a group of threads.
    let per_sm = launch.blocks_per_sm.unwrap_or(BLOCKS_PER_SM).max(1);
    let tile = rows.div_ceil(gpu.multiprocessors() as usize * per_sm).clamp(1, ROWS);
    let blocks = (rows.div_ceil(tile) as u32).min(gpu.multiprocessors() * 8);
    let slices = launch.slices.unwrap_or_else(|| self::slices(tile * c.subspaces(), c.centroids()));
    if !slices.is_power_of_two() || slices > 32 || slices as usize > c.centroids() {
        return Err(Error::Shape(format!(
            "quantize: {slices} threads per search (a power of two ≤ 32 and ≤ the centroids)"
        )));
    }
    let cfg = LaunchConfig {
        grid_dim: (blocks, jobs.len() as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: c.smem() as u32,
    };
    let grid_on = (launch.grid.unwrap_or_else(|| gpu.candidate_lists()) && c.grid.is_some()) as i32;
    let flags = jobs.iter().enumerate().fold(0, |f, (i, j)| f | j.codec.flags(i));
    let (n, tile) = (rows as i32, tile as i32);
    let (first, second) = jobs.split_at_mut(1);
    let a = &mut first[0];
    // Without a second job its arguments are never read (gridDim.y is 1): job 0's again, and a
    // null output.
    let (ca, xa) = (a.codec, a.x);
    let (cb, xb) = second.first().map_or((ca, xa), |b| (b.codec, b.x));
    let mut l = gpu.stream().launch_builder(f);
    l.arg(xa)
        .arg(xb)
        .arg(&ca.mean)
        .arg(&cb.mean)
        .arg(&ca.inv_scale)
        .arg(&cb.inv_scale)
        .arg(&ca.centroids)
        .arg(&cb.centroids)
        .arg(&ca.norms)
        .arg(&cb.norms)
        .arg(&mut *a.out);
    match second.first_mut() {
        Some(b) => l.arg(&mut *b.out),
        None => l.arg(&NULL),
    };
    l.arg(&flags).arg(&n).arg(&tile).arg(&slices).arg(&map);
    // The grids of jobs 0 and 1 (job 0's again without a second job; null pointers, never read,
    // without grids: the defines say GRID 0 or `grid_on` is 0).
    match (&ca.grid, &cb.grid) {
        (Some(ga), Some(gb)) => {
            l.arg(&ga.bbox).arg(&gb.bbox).arg(&ga.offsets).arg(&gb.offsets).arg(&ga.entries).arg(&gb.entries)
        }
        _ => l.arg(&NULL).arg(&NULL).arg(&NULL).arg(&NULL).arg(&NULL).arg(&NULL),
    };
    l.arg(&grid_on);
    // SAFETY: arguments in vq_quantize's order (inputs, means, inverse scales, books, norms and
    // outputs of jobs 0 and 1, flags, n_rows, tile ≤ ROWS, slices a power of two ≤ min(32, K),
    // map, the grids' boxes, offsets and entries of jobs 0 and 1, grid_on); the jobs' codecs
    // have the kernel's defines (checked above: both have grids or neither), each grid's
    // CELLS² + 1 offsets end at its entries' length, and the box is 4 floats; `RowMap` is
    // `repr(C)` as the kernel declares it, and `check_rows` kept every job's last input and
    // output row inside its buffers.
    unsafe { l.launch(cfg) }.map_err(dev_err)?;
    Ok(1)
}

/// Where the quantize kernel reads and writes (mirrors `RowMap` in `quantize.cu`): vector `t` of
/// stream `s` is input row `s·in_hs + (in_base + t)·in_ts`, output row `s·out_hs + (out_base + t)·out_ts`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowMap {
    /// Vectors per stream.
    pub t: i32,
    /// Input rows between streams.
    pub in_hs: i64,
    /// Input rows between vectors of a stream.
    pub in_ts: i32,
    /// First input vector.
    pub in_base: i32,
    /// Output rows between streams.
    pub out_hs: i64,
    /// Output rows between vectors of a stream.
    pub out_ts: i32,
    /// First output vector.
    pub out_base: i32,
    /// When positive, the input is a ring of this many rows starting at row `in_off` of each
    /// stream: vector `t` is row `in_off + (in_base + t) mod in_wrap`.
    pub in_wrap: i32,
    /// The ring's first row in each stream.
    pub in_off: i32,
}

impl RowMap {
    /// `t` tokens of `heads` head vectors, token-major (`[t, heads]` rows), in and out.
    pub fn tokens(t: usize, heads: usize) -> Self {
        Self {
            t: t as i32,
            in_hs: 1,
            in_ts: heads as i32,
            in_base: 0,
            out_hs: 1,
            out_ts: heads as i32,
            out_base: 0,
            in_wrap: 0,
            in_off: 0,
        }
    }

    /// `t` vectors per stream from rows `in_base..` of `[streams, in_hs]` rows to rows
    /// `out_base..` of `[streams, out_hs]` rows (both head-major).
    pub fn streams(t: usize, in_hs: usize, in_base: usize, out_hs: usize, out_base: usize) -> Self {
        Self {
            t: t as i32,
            in_hs: in_hs as i64,
            in_ts: 1,
            in_base: in_base as i32,
            out_hs: out_hs as i64,
            out_ts: 1,
            out_base: out_base as i32,
            in_wrap: 0,
            in_off: 0,
        }
    }
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for RowMap {}

/// Defines of the kernel's variants, for the NVRTC compile check.
pub(super) fn example_defines() -> Vec<Vec<(&'static str, i64)>> {
    let geometry = |sd: i64, bits: i64, grid: i64| {
        vec![
            ("D", 128),
            ("SD", sd),
            ("K", 256),
            ("BITS", bits),
            ("M", 128 / sd),
            ("BOOKS", 1),
            ("HEADS", 8),
            ("ROWS", 32),
            ("ROTATE", 1),
            ("GRID", grid),
        ]
    };
    // Sub-vectors of 4 without a grid; the default's sub-vectors of 2 with one.
    vec![geometry(4, 12, 0), geometry(2, 8, CELLS as i64)]
}
