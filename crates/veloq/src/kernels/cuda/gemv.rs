//! Host side of `gemv.cu`: `y = x·Wᵀ` for f16 weights and up to [`MAX_ROWS`] f32 activation rows
//! (a decode step's), one launch, bound by reading the weights once. Libraries' GEMMs tile for
//! many rows and read a small-batch weight matrix well below the copy bandwidth.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::launch::Launch;
use super::Gpu;
use crate::error::{Error, Result};
use crate::kernels::options::GemvShapes;

pub(super) const SOURCES: &[&str] = &[include_str!("gemv.cu")];
/// Most activation rows one launch takes (the accumulators live in registers).
pub const MAX_ROWS: usize = 8;

/// A launch shape of the GEMV. `tensor_cores` picks `f16_gemv_mma` (activations rounded to f16,
/// for batches: FMAs on f32 re-read each activation chunk once per weight row and lost to cuBLAS
/// at 8 rows) over `f16_gemv` (f32 FMAs, exact products: one row). `rows` weight rows per block
/// (a multiple of 8 with tensor cores), `unroll` 16-byte loads per row a thread has in flight,
/// `threads` per block (its warps split each row's K).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvTune {
    /// Tensor cores (`f16_gemv_mma`) or f32 FMAs (`f16_gemv`).
    pub tensor_cores: bool,
    /// Weight rows per block.
    pub rows: usize,
    /// 16-byte loads a thread has in flight per row.
    pub unroll: usize,
    /// Threads per block.
    pub threads: u32,
}

impl GemvTune {
    /// The shape for `b` activation rows: `shapes`' own (from `veloq-lab bench cuda --gemv-sweep`
    /// on the device at hand) where given, else the sweep's fastest on an H200 for an 8B layer as
    /// a decode step issues it (the sweep is in results/README.md).
    pub fn for_rows(b: usize, shapes: &GemvShapes) -> Self {
        let tensor_cores = b > 1;
        let given = if tensor_cores { shapes.many_rows } else { shapes.one_row };
        let (rows, unroll, threads) = match given {
            Some(t) if !tensor_cores || t.rows.is_multiple_of(8) => (t.rows, t.unroll, t.threads),
            _ if tensor_cores => (32, 1, 512),
            _ => (2, 2, 256),
        };
        Self { tensor_cores, rows, unroll, threads }
    }

    /// The kernel this shape launches.
    pub fn kernel_name(&self) -> &'static str {
        if self.tensor_cores {
            "f16_gemv_mma"
        } else {
            "f16_gemv"
        }
    }

    fn defines(&self, b: usize) -> Vec<(&'static str, i64)> {
        let rows = if self.tensor_cores { ("G", (self.rows / 8) as i64) } else { ("R", self.rows as i64) };
        vec![("B", b as i64), rows, ("U", self.unroll as i64), ("THREADS", self.threads as i64)]
    }
}

/// What a launch over several matrices writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvEpilogue {
    /// Each matrix's outputs side by side: `y [b, Σ n]` (up to 3 matrices).
    Concat,
    /// Two matrices of one shape, gate and up: `y [b, n] = silu(x·gateᵀ) ⊙ (x·upᵀ)`.
    Silu,
    /// As [`GemvEpilogue::Silu`] with GELU (tanh form), Gemma's MLP.
    GeluTanh,
}

impl GemvEpilogue {
    fn gated(self) -> i64 {
        match self {
            GemvEpilogue::Concat => 0,
            GemvEpilogue::Silu => 1,
            GemvEpilogue::GeluTanh => 2,
        }
    }
}

/// The small operations around a product that its launch takes along (none by default).
#[derive(Clone, Copy, Default)]
pub struct GemvFused<'a> {
    /// RMS-normalise each activation row first: the norm's weights `[k]` and eps.
    pub norm: Option<(&'a CudaView<'a, f32>, f32)>,
    /// Add the product to this residual stream (laid out as `y`).
    pub residual: Option<&'a CudaView<'a, f32>>,
    /// Add the product to what `y` holds (the residual stream updated in place).
    pub accumulate: bool,
    /// Rotate the first two matrices' rows (q, k; side by side only) by interleaved RoPE: cos and
    /// sin rows `[b, head_dim / 2]` of each activation row's position, and head_dim.
    pub rope: Option<(&'a CudaView<'a, f32>, &'a CudaView<'a, f32>, usize)>,
}

/// `y [b, n] = x [b, k] · w [n, k]ᵀ`: `w` f16 bits, `x` and `y` f32, contiguous. `k` a multiple of
/// 8 (16-byte loads), `b` from 1 to [`MAX_ROWS`].
#[allow(clippy::too_many_arguments)]
pub fn gemv_f16(
    gpu: &Gpu,
    w: &CudaView<u16>,
    x: &CudaView<f32>,
    y: &mut CudaViewMut<f32>,
    b: usize,
    n: usize,
    k: usize,
    tune: GemvTune,
) -> Result<()> {
    gemv_f16_many(gpu, &[(w, n)], x, y, b, k, GemvEpilogue::Concat, GemvFused::default(), tune)
}

/// Whether [`gemv_f16_many`] takes matrices of these row counts with this epilogue and shape:
/// side by side, every matrix but the last a whole number of the shape's blocks; gated, two of
/// one height. With RoPE of `rope_dim`, side by side, q and k whole heads, the rows of a block
/// in pairs.
pub fn gemv_many_fits(rows: &[usize], epilogue: GemvEpilogue, rope_dim: Option<usize>, tune: GemvTune) -> bool {
    let shape = match epilogue {
        GemvEpilogue::Concat => {
            (1..=3).contains(&rows.len()) && rows[..rows.len() - 1].iter().all(|n| n.is_multiple_of(tune.rows))
        }
        _ => rows.len() == 2 && rows[0] == rows[1],
    };
    shape
        && rope_dim.is_none_or(|d| {
            epilogue == GemvEpilogue::Concat
                && d > 0
                && d.is_multiple_of(2)
                && tune.rows.is_multiple_of(2)
                && rows.iter().take(2).all(|n| n.is_multiple_of(d))
        })
}

/// Several f16 matrices `(w [n, k], n)` applied to the same activations `x [b, k]` in one
/// launch, written as `epilogue` says (side by side: matrix after matrix, each `[b, n]`), with
/// `fused`'s operations. Same contract as [`gemv_f16`] otherwise.
#[allow(clippy::too_many_arguments)]
pub fn gemv_f16_many(
    gpu: &Gpu,
    ws: &[(&CudaView<u16>, usize)],
    x: &CudaView<f32>,
    y: &mut CudaViewMut<f32>,
    b: usize,
    k: usize,
    epilogue: GemvEpilogue,
    fused: GemvFused,
    tune: GemvTune,
) -> Result<()> {
    let rows: Vec<usize> = ws.iter().map(|w| w.1).collect();
    if !(1..=MAX_ROWS).contains(&b) || !k.is_multiple_of(8) || rows.contains(&0) {
        return Err(Error::Device(format!(
            "f16 gemv takes 1..={MAX_ROWS} rows and k a multiple of 8; got b {b}, matrices of {rows:?} rows, k {k}"
        )));
    }
    if tune.rows == 0 || (tune.tensor_cores && !tune.rows.is_multiple_of(8)) {
        return Err(Error::Device(format!("f16 gemv: no launch shape {tune:?}")));
    }
    let rope_dim = fused.rope.map(|r| r.2);
    if !gemv_many_fits(&rows, epilogue, rope_dim, tune) {
        return Err(Error::Shape(format!("f16 gemv: matrices of {rows:?} rows do not fit {epilogue:?} with {tune:?}")));
    }
    let n = if epilogue == GemvEpilogue::Concat { rows.iter().sum() } else { rows[0] };
    if ws.iter().any(|(w, r)| w.len() < r * k) || x.len() < b * k || y.len() < b * n {
        return Err(Error::Shape(format!(
            "f16 gemv: buffers smaller than {rows:?} × {k} weights, [{b}, {k}] → [{b}, {n}]"
        )));
    }
    let short = |what: &str| Error::Shape(format!("f16 gemv: {what} shorter than the product needs"));
    if fused.norm.is_some_and(|(g, _)| g.len() < k) {
        return Err(short("norm weights"));
    }
    if fused.residual.is_some_and(|r| r.len() < b * n) {
        return Err(short("residual"));
    }
    if fused.accumulate && fused.residual.is_some() {
        return Err(Error::Shape("f16 gemv: a residual operand and accumulation into y are exclusive".into()));
    }
    if fused.rope.is_some_and(|(c, s, d)| c.len() < b * d / 2 || s.len() < b * d / 2) {
        return Err(short("RoPE rows"));
    }
    let mut defines = tune.defines(b);
    defines.extend([
        ("GATED", epilogue.gated()),
        ("NORM", fused.norm.is_some() as i64),
        ("RES", if fused.accumulate { 2 } else { fused.residual.is_some() as i64 }),
        ("ROPE", rope_dim.unwrap_or(0) as i64),
    ]);
    let f = gpu.kernel(SOURCES, tune.kernel_name(), &defines, 0)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(tune.rows) as u32, 1, 1),
        block_dim: (tune.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let w = |i: usize| ws.get(i).unwrap_or(&ws[0]).0;
    let (n1, n2) = (rows[0], rows.get(1).copied().unwrap_or(0));
    let [n_i, n1_i, n2_i, k_i] = [n, n1, n2, k].map(|v| v as i32);
    let eps = fused.norm.map_or(0.0, |n| n.1);
    // Operands a define leaves out are never read; x stands in for them.
    let (res, norm) = (fused.residual.unwrap_or(x), fused.norm.map_or(x, |n| n.0));
    let (cos, sin) = fused.rope.map_or((x, x), |(c, s, _)| (c, s));
    let mut l = Launch::new(gpu.stream(), &f);
    l.buf(w(0)).buf(w(1)).buf(w(2)).buf(x).buf_mut(y).buf(res).buf(norm).buf(cos).buf(sin);
    l.val(&n_i).val(&n1_i).val(&n2_i).val(&k_i).val(&eps);
    // SAFETY: arguments in both kernels' order (w, w2, w3, x, y, residual, norm weights, cos,
    // sin, N, N1, N2, K, eps); the checks above bound every read (each matrix's rows, chunks <
    // k/8, a block reads one matrix or the same rows of two when gated; norm weights < k; residual
    // as y; RoPE rows b·head_dim/2) and write (b·n outputs). Matrices not given are never read.
    // Overlapped: before `grid_wait` the kernels only prefetch weights, which nothing writes.
    unsafe { l.run(cfg, gpu.overlaps()) }
}

/// (kernel, defines) of every row count and a few launch shapes, for the NVRTC compile check.
pub(super) fn example_defines() -> Vec<(&'static str, Vec<(&'static str, i64)>)> {
    let tuned = [(false, 2, 4, 128), (true, 32, 1, 64), (true, 8, 8, 512)]
        .map(|(tensor_cores, rows, unroll, threads)| GemvTune { tensor_cores, rows, unroll, threads });
    let shapes: Vec<(usize, GemvTune)> = (1..=MAX_ROWS)
        .map(|b| (b, GemvTune::for_rows(b, &GemvShapes::default())))
        .chain(tuned.map(|t| (if t.tensor_cores { MAX_ROWS } else { 1 }, t)))
        .collect();
    shapes
        .into_iter()
        .flat_map(|(b, t)| {
            // The layer's four forms: q/k/v (norm, RoPE), output (residual), gate/up (norm,
            // gated), down (residual); and the bare product.
            [(0, 1, 0, 128), (0, 0, 1, 0), (0, 0, 2, 0), (1, 1, 0, 0), (2, 1, 0, 0), (0, 0, 0, 0)].map(
                move |(gated, norm, res, rope)| {
                    let mut d = t.defines(b);
                    d.extend([("GATED", gated), ("NORM", norm), ("RES", res), ("ROPE", rope)]);
                    (t.kernel_name(), d)
                },
            )
        })
        .collect()
}
