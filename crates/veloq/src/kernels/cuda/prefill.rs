//! Host side of `prefill.cu`: attention of a block of queries over a sequence's codes or f16
//! rows, as softmax partials per split of the positions (the caller merges them, and maps coded
//! sums back to value space). What chunked prefill and follow-up turns run on CUDA.

use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::attention::Coded;
use super::quantize::GpuCodec;
use super::{dev_err, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("prefill.cu")];
const WARPS: usize = 4;
/// Positions per tile: S for 16 rows × 64 positions is 32 accumulators per lane.
const TILE: usize = 64;
const CENTROIDS: usize = 256;

/// The multi-query kernel for one geometry: over codes (8-bit per-layer books, like the decode
/// kernels) or over f16 rows.
pub struct GpuPrefill {
    heads: usize,
    head_dim: usize,
    group: usize,
    /// Key and value sub_dims of the codes; `None` for rows.
    subs: Option<(usize, usize)>,
    function: CudaFunction,
}

/// What a launch attends: one sequence's codes, or a run of its f16 rows.
pub enum Source<'a, 'b> {
    /// A sequence's codes.
    Codes {
        /// The codes.
        codes: &'a Coded<'b>,
        /// The keys' codec on the GPU.
        keys: &'a GpuCodec,
        /// The values' codec.
        values: &'a GpuCodec,
    },
    /// `keys`/`values` at the run's first row of stream 0 (stream h's row p at
    /// `(h·stride + p)·head_dim`); row p holds position `pos0 + p`, query i sits at `qpos0 + i`.
    Rows {
        /// Key rows (f16 bits).
        keys: CudaView<'b, u16>,
        /// Value rows (f16 bits).
        values: CudaView<'b, u16>,
        /// Rows in the run.
        len: usize,
        /// Rows per stream.
        stride: usize,
        /// Position of row 0.
        pos0: usize,
        /// Position of query 0.
        qpos0: usize,
    },
}

/// The positions of each split (whole tiles) and how many splits that makes: the partials are
/// `count` deep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Splits (the partials' depth).
    pub count: usize,
    per: usize,
}

/// Where a launch writes: `o` `[splits, q heads, queries, head_dim]` (code space, unnormalised)
/// and `ml` `[splits, q heads, queries, 2]` (maximum score, sum of weights).
pub struct PrefillOut<'a, 'b> {
    /// Unnormalised outputs in code space.
    pub o: &'a mut CudaViewMut<'b, f32>,
    /// Maximum score and sum of weights per (split, head, query).
    pub ml: &'a mut CudaViewMut<'b, f32>,
}

impl GpuPrefill {
    /// Compiles the kernel over codes for `keys`/`values` (uploaded codecs), `q_heads` query heads.
    pub fn codes(gpu: &Gpu, keys: &GpuCodec, values: &GpuCodec, q_heads: usize) -> Result<Self> {
        let ok = keys.bits == 8
            && values.bits == 8
            && keys.books == 1
            && values.books == 1
            && (values.head_dim, values.heads) == (keys.head_dim, keys.heads)
            && keys.sub_dim.is_multiple_of(2)
            && values.sub_dim.is_multiple_of(2);
        if !ok {
            return Err(Error::Device("the CUDA prefill kernel takes 8-bit per-layer books of even sub_dim".into()));
        }
        Self::build(gpu, keys.heads, keys.head_dim, q_heads, Some((keys.sub_dim, values.sub_dim)))
    }

    /// Compiles the kernel over f16 rows.
    pub fn rows(gpu: &Gpu, kv_heads: usize, head_dim: usize, q_heads: usize) -> Result<Self> {
        Self::build(gpu, kv_heads, head_dim, q_heads, None)
    }

    fn build(gpu: &Gpu, kv: usize, d: usize, q_heads: usize, subs: Option<(usize, usize)>) -> Result<Self> {
        if kv == 0 || !d.is_multiple_of(16) || d > 256 || !q_heads.is_multiple_of(kv) || q_heads / kv > WARPS * 16 {
            return Err(Error::Device(format!(
                "the CUDA prefill kernel takes head_dim a multiple of 16 up to 256 and at most {} query heads per kv head",
                WARPS * 16
            )));
        }
        let group = q_heads / kv;
        let (sdk, sdv) = subs.unwrap_or((2, 2));
        let defines = [
            ("D", d as i64),
            ("G", group as i64),
            ("SDK", sdk as i64),
            ("SDV", sdv as i64),
            ("WARPS", WARPS as i64),
            ("TP", TILE as i64),
        ];
        let name = if subs.is_some() { "vq_prefill_codes" } else { "f16_prefill_rows" };
        let function = gpu.kernel(SOURCES, name, &defines, Self::smem(d, subs))?;
        Ok(Self { heads: kv, head_dim: d, group, subs, function })
    }

    fn smem(d: usize, subs: Option<(usize, usize)>) -> usize {
        let books = subs.map_or(0, |(k, v)| CENTROIDS * (k + v));
        2 * (WARPS * 16 * (d + 8) + TILE * (d + 8) + d * (TILE + 8) + books)
    }

    fn queries_per_block(&self) -> usize {
        WARPS * 16 / self.group
    }

    /// How to split `len` positions for `queries` queries: enough blocks for two per
    /// multiprocessor, each split whole tiles.
    pub fn split(&self, gpu: &Gpu, queries: usize, len: usize) -> Split {
        let blocks = queries.div_ceil(self.queries_per_block()) * self.heads;
        let tiles = len.div_ceil(TILE).max(1);
        let want = (2 * gpu.multiprocessors() as usize).div_ceil(blocks.max(1)).clamp(1, tiles);
        let per = tiles.div_ceil(want) * TILE;
        Split { count: len.div_ceil(per).max(1), per }
    }

    /// Partials of `queries` queries (`q`: `[q heads, queries, head_dim]` f32, scaled; in code
    /// space for codes) of one sequence over `source`'s positions, split as
    /// [`split`](Self::split) planned for that length, into `out`. One launch.
    pub fn launch(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        queries: usize,
        source: Source,
        split: Split,
        out: PrefillOut,
    ) -> Result<()> {
        let (d, kv) = (self.head_dim, self.heads);
        let hq = kv * self.group;
        let (len, stride) = match &source {
            Source::Codes { codes, .. } => (codes.len, codes.stride),
            Source::Rows { len, stride, .. } => (*len, *stride),
        };
        let splits = split.count;
        let source_fits = match &source {
            Source::Codes { codes, keys, values } => {
                self.subs == Some((keys.sub_dim, values.sub_dim))
                    && (keys.head_dim, keys.heads) == (d, kv)
                    && codes.keys.len() >= kv * stride * keys.subspaces()
                    && codes.values.len() >= kv * stride * values.subspaces()
            }
            Source::Rows { keys, values, pos0, qpos0, .. } => {
                self.subs.is_none()
                    && keys.len() >= ((kv - 1) * stride + len) * d
                    && values.len() >= ((kv - 1) * stride + len) * d
                    && qpos0 + queries < 1 << 30
                    && pos0 + len < 1 << 30
            }
        };
        let ok = source_fits
            && queries > 0
            && len > 0
            && len <= stride
            && split.per.is_multiple_of(TILE)
            && len.div_ceil(split.per) == splits
            && q.len() >= hq * queries * d
            && out.o.len() >= splits * hq * queries * d
            && out.ml.len() >= splits * hq * queries * 2;
        if !ok {
            return Err(Error::Shape(format!(
                "prefill attention: {queries} queries × {hq} heads × {d}, {len} of {stride} positions, {splits} splits do not fit the kernel or the buffers"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (queries.div_ceil(self.queries_per_block()) as u32, kv as u32, splits as u32),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: Self::smem(d, self.subs) as u32,
        };
        let (t, len_i, stride_i, per_i) = (queries as i32, len as i32, stride as i32, split.per as i32);
        let mut l = gpu.stream().launch_builder(&self.function);
        let (pos0_i, qpos0_i);
        l.arg(q).arg(&t);
        match &source {
            Source::Codes { codes, keys, values } => {
                l.arg(&codes.keys).arg(&codes.values).arg(&len_i).arg(&stride_i);
                l.arg(&keys.centroids_f16).arg(&values.centroids_f16);
            }
            Source::Rows { keys, values, pos0, qpos0, .. } => {
                (pos0_i, qpos0_i) = (*pos0 as i32, *qpos0 as i32);
                l.arg(keys).arg(values).arg(&len_i).arg(&stride_i).arg(&pos0_i).arg(&qpos0_i);
            }
        }
        l.arg(&per_i).arg(out.o).arg(out.ml);
        // SAFETY: the arguments follow the kernel's signature (`vq_prefill_codes` or
        // `f16_prefill_rows`); the checks above keep every query row, code byte or row (streams
        // `kv` of `stride`, `len` read) and output row of the grid (splits · q heads · queries)
        // inside the buffers; the books are 256 × sub_dim f16.
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }
}

/// Defines the compile check builds the kernels with.
pub(super) fn example_defines() -> Vec<Vec<(&'static str, i64)>> {
    [(64, 3, 4, 4), (128, 4, 4, 4), (128, 8, 8, 4), (256, 4, 4, 4)]
        .into_iter()
        .map(|(d, g, sdk, sdv)| vec![("D", d), ("G", g), ("SDK", sdk), ("SDV", sdv), ("WARPS", 4), ("TP", 64)])
        .collect()
}
