//! Host side of `prefill.cu`: attention of a tile of queries over a sequence's f16 rows as
//! softmax partials per split of the positions (one launch over its runs of rows: the sink, the
//! ring, the step's own rows, and a VecInfer cache's codes decoded a block at a time into rows of
//! the cache's own space), then one fold of every split into the output.
//! What chunked prefill and follow-up turns run on CUDA: a handful of launches per tile, no
//! tensor ops between them.

use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::attention::Coded;
use super::quantize::GpuCodec;
use super::{dev_err, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("prefill.cu")];
const WARPS: usize = 4;
/// Positions per tile: S for 16 rows × 64 positions is 32 accumulators per lane.
const TILE: usize = 64;
/// Warps per block of the fold (a warp per query head and query) and of the decode.
const ROW_WARPS: usize = 8;

/// A `#define` the kernels are compiled with.
type Define = (&'static str, i64);

/// The multi-query attention over f16 rows for one geometry, and the fold of its partials.
pub struct GpuPrefill {
    heads: usize,
    head_dim: usize,
    group: usize,
    function: CudaFunction,
    fold: CudaFunction,
}

/// A VecInfer layer's side of the prefill: its codes decoded a block at a time to f16 rows of the
/// cache's own space (centroids rotated, scaled and shifted back), which [`GpuPrefill`]'s kernel
/// attends as one more run of rows — so the queries, the launch and the fold are the rows'.
/// 8-bit per-layer books.
pub struct GpuPrefillCodes {
    rows: GpuPrefill,
    decode: CudaFunction,
}

/// A run of f16 rows: `keys`/`values` at its first row of stream 0, stream h's row p at
/// `h·head_stride + p·row_stride` elements; row p holds position `pos0 + p`, query i sits at
/// `qpos0 + i` (a query sees positions up to its own, the last `window` of them with one).
pub struct Rows<'b> {
    /// Key rows (f16 bits).
    pub keys: CudaView<'b, u16>,
    /// Value rows (f16 bits).
    pub values: CudaView<'b, u16>,
    /// Rows in the run.
    pub len: usize,
    /// Elements from one stream's rows to the next's.
    pub head_stride: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
    /// Position of row 0.
    pub pos0: usize,
    /// Position of query 0.
    pub qpos0: usize,
    /// A sliding window: positions a query sees, itself included.
    pub window: Option<usize>,
}

/// Runs of rows one launch takes (the kernel's `RUNS`): of the decoded codes, the sink, the ring's
/// parts and the step's own rows, as many as fit.
pub const MAX_RUNS: usize = 4;

/// The kernel's `RowRuns`: each run's rows, strides, first position and splits.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RowRuns {
    k: [u64; MAX_RUNS],
    v: [u64; MAX_RUNS],
    len: [i32; MAX_RUNS],
    hs: [i32; MAX_RUNS],
    rs: [i32; MAX_RUNS],
    pos0: [i32; MAX_RUNS],
    per: [i32; MAX_RUNS],
    splits: [i32; MAX_RUNS],
    n: i32,
}

// SAFETY: plain old data with the C layout the kernel declares (device addresses as u64).
unsafe impl DeviceRepr for RowRuns {}

/// The positions of each split (whole tiles) and how many splits that makes: the partials are
/// `count` deep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Splits (the partials' depth).
    pub count: usize,
    per: usize,
}

impl Split {
    /// The same positions per split over `len` positions (a shorter run lands in the first
    /// splits of the same partials).
    pub fn fit(&self, len: usize) -> Split {
        Split { count: len.div_ceil(self.per).max(1), per: self.per }
    }
}

/// Where a launch writes: `o` `[splits, q heads, queries, head_dim]` (unnormalised) and `ml`
/// `[splits, q heads, queries, 2]` (maximum score, sum of weights); with `accumulate`, merged
/// into the partials already there (blocks of decoded codes share one set).
pub struct PrefillOut<'a, 'b> {
    /// Unnormalised outputs.
    pub o: &'a mut CudaViewMut<'b, f32>,
    /// Maximum score and sum of weights per (split, head, query).
    pub ml: &'a mut CudaViewMut<'b, f32>,
    /// Merge into the partials there instead of overwriting them.
    pub accumulate: bool,
}

/// A tile's partials for the fold: `splits` deep.
pub struct PrefillParts<'a, 'b> {
    /// `[splits, q heads, queries, head_dim]`.
    pub o: &'a CudaView<'b, f32>,
    /// `[splits, q heads, queries, 2]`.
    pub ml: &'a CudaView<'b, f32>,
    /// Splits in all.
    pub splits: usize,
}

impl GpuPrefill {
    /// Compiles the kernels over f16 rows for `kv_heads` streams of `head_dim`, `q_heads` query heads.
    pub fn new(gpu: &Gpu, kv_heads: usize, head_dim: usize, q_heads: usize) -> Result<Self> {
        Ok(Self::build(gpu, kv_heads, head_dim, q_heads, &[])?.0)
    }

    /// The rows kernels for a geometry and `extra` defines (a codec's), and the defines they were
    /// compiled with (the codec's other kernels take the same).
    fn build(gpu: &Gpu, kv: usize, d: usize, q_heads: usize, extra: &[Define]) -> Result<(Self, Vec<Define>)> {
        if kv == 0 || !d.is_multiple_of(16) || d > 256 || !q_heads.is_multiple_of(kv) || q_heads / kv > WARPS * 16 {
            return Err(Error::Device(format!(
                "the CUDA prefill kernel takes head_dim a multiple of 16 up to 256 and at most {} query heads per kv head",
                WARPS * 16
            )));
        }
        let group = q_heads / kv;
        let mut defines = vec![("D", d as i64), ("G", group as i64), ("WARPS", WARPS as i64), ("TP", TILE as i64)];
        defines.extend_from_slice(extra);
        if !extra.iter().any(|(n, _)| *n == "SDK") {
            defines.extend([("SDK", 2), ("SDV", 2)]);
        }
        let function = gpu.kernel(SOURCES, "f16_prefill_rows", &defines, Self::smem(d))?;
        let fold = gpu.kernel(SOURCES, "prefill_fold", &defines, 0)?;
        Ok((Self { heads: kv, head_dim: d, group, function, fold }, defines))
    }

    /// Bytes of shared memory: the block's queries and two buffers each of keys and values.
    fn smem(d: usize) -> usize {
        2 * (WARPS * 16 * (d + 8) + 4 * TILE * (d + 8))
    }

    fn queries_per_block(&self) -> usize {
        WARPS * 16 / self.group
    }

    fn q_heads(&self) -> usize {
        self.heads * self.group
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

    /// A launch over a grid of (query, query head) warps.
    fn row_grid(&self, queries: usize) -> LaunchConfig {
        let warps = queries * self.q_heads();
        LaunchConfig {
            grid_dim: (warps.div_ceil(ROW_WARPS) as u32, 1, 1),
            block_dim: ((ROW_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Partials of `queries` queries (`q`: `[queries, q heads, head_dim]` f32, times `scale`) of
    /// one sequence over a run of its rows, split as [`split`](Self::split) planned for the run's
    /// length, into `out`. One launch.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        queries: usize,
        scale: f32,
        rows: Rows,
        split: Split,
        out: PrefillOut,
    ) -> Result<()> {
        self.launch_runs(gpu, q, queries, scale, &[(rows, split)], out)
    }

    /// [`launch`](Self::launch) over up to [`MAX_RUNS`] runs of one sequence's rows in one launch
    /// (each split as planned for its own length; run r's partials follow the splits of the runs
    /// before it in `out`). The runs share the queries' positions and window. A launch per run
    /// costs the host a launch and the GPU a drain each, and a short run's blocks (a sink of a
    /// few rows) leave most of the device idle on their own.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_runs(
        &self,
        gpu: &Gpu,
        q: &CudaView<f32>,
        queries: usize,
        scale: f32,
        runs: &[(Rows, Split)],
        out: PrefillOut,
    ) -> Result<()> {
        let (d, kv, hq) = (self.head_dim, self.heads, self.q_heads());
        let total: usize = runs.iter().map(|(_, s)| s.count).sum();
        let (qpos0, window) = runs.first().map_or((0, None), |(r, _)| (r.qpos0, r.window));
        let fits = |r: &Rows, split: &Split| {
            let span = (kv - 1) * r.head_stride + r.len.saturating_sub(1) * r.row_stride + d;
            r.row_stride >= d
                && r.keys.len() >= span
                && r.values.len() >= span
                && span < 1 << 31
                && r.pos0 + r.len < 1 << 30
                && (r.qpos0, r.window) == (qpos0, window)
                && r.len > 0
                && split.per.is_multiple_of(TILE)
                && r.len.div_ceil(split.per) == split.count
        };
        let ok = (1..=MAX_RUNS).contains(&runs.len())
            && runs.iter().all(|(r, s)| fits(r, s))
            && qpos0 + queries < 1 << 30
            && window.is_none_or(|w| (1..1 << 30).contains(&w))
            && queries > 0
            && total < 1 << 16
            && q.len() >= hq * queries * d
            && out.o.len() >= total * hq * queries * d
            && out.ml.len() >= total * hq * queries * 2;
        if !ok {
            let lens: Vec<usize> = runs.iter().map(|(r, _)| r.len).collect();
            return Err(Error::Shape(format!(
                "prefill attention: {queries} queries × {hq} heads × {d}, runs of {lens:?} rows, {total} splits do not fit the kernel or the buffers"
            )));
        }
        let stream = gpu.stream();
        let mut arg = RowRuns::default();
        let mut guards = Vec::with_capacity(2 * runs.len());
        for (i, (r, split)) in runs.iter().enumerate() {
            let (k, gk) = r.keys.device_ptr(stream);
            let (v, gv) = r.values.device_ptr(stream);
            guards.extend([gk, gv]);
            arg.k[i] = k;
            arg.v[i] = v;
            arg.len[i] = r.len as i32;
            arg.hs[i] = r.head_stride as i32;
            arg.rs[i] = r.row_stride as i32;
            arg.pos0[i] = r.pos0 as i32;
            arg.per[i] = split.per as i32;
            arg.splits[i] = split.count as i32;
        }
        arg.n = runs.len() as i32;
        let cfg = LaunchConfig {
            grid_dim: (queries.div_ceil(self.queries_per_block()) as u32, kv as u32, total as u32),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: Self::smem(d) as u32,
        };
        let (t, qpos0_i, window_i, accumulate) =
            (queries as i32, qpos0 as i32, window.unwrap_or(0) as i32, out.accumulate as i32);
        let mut l = stream.launch_builder(&self.function);
        l.arg(q).arg(&scale).arg(&t).arg(&arg).arg(&qpos0_i).arg(&window_i).arg(&accumulate).arg(out.o).arg(out.ml);
        // SAFETY: the arguments follow `f16_prefill_rows`'s signature (`RowRuns` by value, its C
        // layout); the checks above keep every query row, every row read of every run (streams
        // `kv`, `len` rows, by its strides) and every output row of the grid (all runs' splits ·
        // q heads · queries) inside the buffers, which `guards` keep ordered until the launch.
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        drop(guards);
        Ok(())
    }

    /// Every split of a tile (`parts`) into `out` (`[queries, q heads, head_dim]` f32, the step's
    /// rows of the tile): one softmax over all, normalised. One launch.
    pub fn fold(&self, gpu: &Gpu, parts: PrefillParts, queries: usize, out: &mut CudaViewMut<f32>) -> Result<()> {
        let (d, hq) = (self.head_dim, self.q_heads());
        let rows = queries * hq;
        let ok = queries > 0
            && parts.splits > 0
            && parts.o.len() >= parts.splits * rows * d
            && parts.ml.len() >= parts.splits * rows * 2
            && out.len() >= rows * d;
        if !ok {
            return Err(Error::Shape(format!(
                "prefill fold: {queries} queries × {hq} heads × {d}, {} splits do not fit the buffers",
                parts.splits
            )));
        }
        let (splits, t, hq_i) = (parts.splits as i32, queries as i32, hq as i32);
        let mut l = gpu.stream().launch_builder(&self.fold);
        l.arg(parts.o).arg(parts.ml).arg(&splits).arg(&t).arg(&hq_i).arg(out);
        // SAFETY: the signature of `prefill_fold`; every (query, head) row of every split read and
        // every output row written is inside the buffers checked above.
        unsafe { l.launch(self.row_grid(queries)) }.map_err(dev_err)?;
        Ok(())
    }
}

impl GpuPrefillCodes {
    /// Compiles the kernels for `keys`/`values` (uploaded codecs), `q_heads` query heads.
    pub fn new(gpu: &Gpu, keys: &GpuCodec, values: &GpuCodec, q_heads: usize) -> Result<Self> {
        let ok = keys.bits == 8
            && values.bits == 8
            && keys.books == 1
            && values.books == 1
            && (values.head_dim, values.heads) == (keys.head_dim, keys.heads)
            && keys.sub_dim.is_multiple_of(2)
            && values.sub_dim.is_multiple_of(2);
        if !ok {
            return Err(Error::Device("the CUDA prefill kernels take 8-bit per-layer books of even sub_dim".into()));
        }
        let b = |x: bool| x as i64;
        let defines = [
            ("SDK", keys.sub_dim as i64),
            ("SDV", values.sub_dim as i64),
            ("CENTER_K", b(keys.center)),
            ("SMOOTH_K", b(keys.smooth)),
            ("ROTATE_K", b(keys.rotate)),
            ("CENTER_V", b(values.center)),
            ("SMOOTH_V", b(values.smooth)),
            ("ROTATE_V", b(values.rotate)),
        ];
        let (rows, all) = GpuPrefill::build(gpu, keys.heads, keys.head_dim, q_heads, &defines)?;
        let decode = gpu.kernel(SOURCES, "vq_decode_rows", &all, 0)?;
        Ok(Self { rows, decode })
    }

    /// The attention over the decoded rows (and its splits).
    pub fn rows(&self) -> &GpuPrefill {
        &self.rows
    }

    /// Positions `p0..p0 + n` of `codes` decoded into f16 rows of the cache's own space
    /// `out_keys`/`out_values` (`[kv heads, T, head_dim]` each: a run of [`Rows`] with head stride
    /// `T · head_dim`), with `around`'s rows copied before and after them (T = its rows + `n`;
    /// without it, T = `n`).
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        gpu: &Gpu,
        codes: &Coded,
        (p0, n): (usize, usize),
        (keys, values): (&GpuCodec, &GpuCodec),
        around: Option<&RowsAround>,
        out_keys: &mut CudaViewMut<u16>,
        out_values: &mut CudaViewMut<u16>,
    ) -> Result<()> {
        let (kv, d) = (self.rows.heads, self.rows.head_dim);
        let total = n + around.map_or(0, RowsAround::rows);
        let around_fits = |a: &RowsAround| {
            let last = a.ring.iter().filter(|p| p.1 > 0).map(|p| p.0 + p.1).chain([a.sink]).max().unwrap_or(0);
            let span = (kv - 1) * a.head_stride + last * d;
            a.head_stride >= last * d && a.keys.len() >= span && a.values.len() >= span && span < 1 << 31
        };
        let ok = (keys.heads, keys.head_dim, values.heads, values.head_dim) == (kv, d, kv, d)
            && n > 0
            && p0 + n <= codes.len
            && codes.len <= codes.stride
            && codes.keys.len() >= kv * codes.stride * keys.subspaces()
            && codes.values.len() >= kv * codes.stride * values.subspaces()
            && out_keys.len() >= kv * total * d
            && out_values.len() >= kv * total * d
            && kv * codes.stride < 1 << 31
            && kv * total < 1 << 31
            && around.is_none_or(around_fits);
        if !ok {
            return Err(Error::Shape(format!(
                "prefill decode: positions {p0}..{} of {} coded do not fit the codes or the buffers",
                p0 + n,
                codes.len
            )));
        }
        let stream = gpu.stream();
        let mut arg = AroundArg::default();
        let mut guards = Vec::with_capacity(2);
        if let Some(a) = around {
            let (k, gk) = a.keys.device_ptr(stream);
            let (v, gv) = a.values.device_ptr(stream);
            guards.extend([gk, gv]);
            let [(r0, n0), (r1, n1)] = a.ring;
            arg = AroundArg {
                k,
                v,
                hs: a.head_stride as i32,
                sink: a.sink as i32,
                r0: r0 as i32,
                n0: n0 as i32,
                r1: r1 as i32,
                n1: n1 as i32,
            };
        }
        let (heads, stride, p0_i, n_i) = (kv as i32, codes.stride as i32, p0 as i32, n as i32);
        // head_dim / 8 lanes a row (8 elements each), grid-stride over the warps' groups of rows.
        let warps = (kv * total).div_ceil(32 / (d / 8));
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(ROW_WARPS).min(8 * gpu.multiprocessors() as usize) as u32, 1, 1),
            block_dim: ((ROW_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = stream.launch_builder(&self.decode);
        l.arg(&codes.keys).arg(&codes.values).arg(&heads).arg(&stride).arg(&p0_i).arg(&n_i);
        l.arg(&keys.centroids_f16).arg(&values.centroids_f16);
        l.arg(&keys.mean).arg(&keys.scale).arg(&values.mean).arg(&values.scale).arg(&arg).arg(out_keys).arg(out_values);
        // SAFETY: the signature of `vq_decode_rows` (compiled for these sub_dims and the codecs'
        // flags; `Around` by value, its C layout); the codes read (streams `kv` of `stride`,
        // positions p0..p0 + n), the rows copied (streams `kv` by `head_stride`, rows below the
        // sink's and the ring parts' ends) and the rows written (`kv × T × D`) are inside the
        // buffers checked above, which `guards` keep ordered until the launch; the books are
        // 256 × sub_dim f16; mean and scale are [kv heads][head_dim] where the codec has them (the
        // kernel reads them only then).
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        drop(guards);
        Ok(())
    }
}

/// The f16 rows [`GpuPrefillCodes::decode`] copies around the codes: a sequence's sink before
/// them and its ring's parts after, so that sink, codes and ring are one run of consecutive
/// positions (one split plan, where three short runs would each write and fold whole partials).
pub struct RowsAround<'b> {
    /// The sequence's stored key rows from its row 0 (stream h's row r at `h·head_stride + r·head_dim`).
    pub keys: CudaView<'b, u16>,
    /// Its value rows, laid out alike.
    pub values: CudaView<'b, u16>,
    /// Elements from one stream's rows to the next's.
    pub head_stride: usize,
    /// Sink rows (rows 0..sink), the positions before the codes.
    pub sink: usize,
    /// The ring's parts after the codes, in position order: (first row, rows).
    pub ring: [(usize, usize); 2],
}

impl RowsAround<'_> {
    /// Rows copied.
    pub fn rows(&self) -> usize {
        self.sink + self.ring[0].1 + self.ring[1].1
    }
}

/// The kernel's `Around`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct AroundArg {
    k: u64,
    v: u64,
    hs: i32,
    sink: i32,
    r0: i32,
    n0: i32,
    r1: i32,
    n1: i32,
}

// SAFETY: plain old data with the C layout the kernel declares (device addresses as u64).
unsafe impl DeviceRepr for AroundArg {}

/// Defines the compile check builds the kernels with (each compile holds every kernel of the
/// source: the decode and the fold too).
pub(super) fn example_defines() -> Vec<Vec<(&'static str, i64)>> {
    [(64, 3, 2, 2, 1), (80, 2, 2, 2, 0), (128, 4, 2, 4, 1), (128, 8, 8, 4, 0), (256, 4, 4, 4, 1)]
        .into_iter()
        .map(|(d, g, sdk, sdv, f)| {
            let mut v = vec![("D", d), ("G", g), ("SDK", sdk), ("SDV", sdv), ("WARPS", 4), ("TP", 64)];
            v.extend(["CENTER_K", "SMOOTH_K", "ROTATE_K", "CENTER_V", "SMOOTH_V", "ROTATE_V"].map(|n| (n, f)));
            v
        })
        .collect()
}
