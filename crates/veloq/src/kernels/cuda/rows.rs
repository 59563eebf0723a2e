//! Host side of `rows.cu`: the row-wise work of a many-row layer step (a prompt chunk) around
//! f16 weight products — a norm that writes f16, a gated activation over f16 products, an f16
//! product added into the f32 residual stream — so that cuBLAS takes and gives f16 with no cast
//! launch on either side.

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig};

use super::launch::Launch;
use super::Gpu;
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("rows.cu")];

/// The MLP's activation of its gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatedActivation {
    /// x · sigmoid(x).
    Silu,
    /// GELU, tanh form.
    GeluTanh,
}

const THREADS: u32 = 256;

fn elementwise(gpu: &Gpu, n: usize, per_thread: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize * per_thread).clamp(1, 16 * gpu.multiprocessors() as usize);
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

fn too_short(what: &str, need: usize, have: usize) -> Error {
    Error::Shape(format!("rows: {what} holds {have} elements, {need} needed"))
}

/// `out [rows, k] = f16(x · rsqrt(mean(x²) + eps) · w)` row by row (`x` f32, `w` f32 `[k]`).
pub fn norm_f16(
    gpu: &Gpu,
    x: &CudaView<f32>,
    w: &CudaView<f32>,
    out: &mut CudaViewMut<u16>,
    rows: usize,
    k: usize,
    eps: f32,
) -> Result<()> {
    let n = rows * k;
    if x.len() < n || out.len() < n || w.len() < k {
        return Err(too_short("norm operands", n, x.len().min(out.len())));
    }
    if rows == 0 || k == 0 {
        return Ok(());
    }
    let (Ok(blocks), Ok(k_i)) = (u32::try_from(rows), i32::try_from(k)) else {
        return Err(Error::Shape(format!("rows: a norm over {rows} rows of {k}")));
    };
    let f = gpu.kernel(SOURCES, "rows_norm_f16", &[], 0)?;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut l = Launch::new(gpu.stream(), &f);
    l.buf(x).buf(w).buf_mut(out).val(&k_i).val(&eps);
    // SAFETY: (x, w, out, k, eps) as the kernel declares them; block r reads row r of x (rows·k
    // elements checked above) and k weights, and writes row r of out. Not overlapped: it reads
    // what the launch before wrote.
    unsafe { l.run(cfg, false) }
}

/// `out = f16(act(gate) · up)` element by element (`gate`, `up` and `out` f16, `n` long).
pub fn gated_f16(
    gpu: &Gpu,
    gate: &CudaView<u16>,
    up: &CudaView<u16>,
    out: &mut CudaViewMut<u16>,
    n: usize,
    act: GatedActivation,
) -> Result<()> {
    if gate.len() < n || up.len() < n || out.len() < n {
        return Err(too_short("gated operands", n, gate.len().min(up.len()).min(out.len())));
    }
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(SOURCES, "rows_gated_f16", &[], 0)?;
    let (n_i, act_i) = (n as i64, matches!(act, GatedActivation::GeluTanh) as i32);
    let mut l = Launch::new(gpu.stream(), &f);
    l.buf(gate).buf(up).buf_mut(out).val(&n_i).val(&act_i);
    // SAFETY: (gate, up, out, n, act) as declared; every index is below n, which each holds.
    unsafe { l.run(elementwise(gpu, n, 4), false) }
}

/// `x += f32(y)` element by element, in place (`x` f32, `y` f16, `n` long).
pub fn add_f16(gpu: &Gpu, x: &mut CudaViewMut<f32>, y: &CudaView<u16>, n: usize) -> Result<()> {
    if x.len() < n || y.len() < n {
        return Err(too_short("added operands", n, x.len().min(y.len())));
    }
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernel(SOURCES, "rows_add_f16", &[], 0)?;
    let n_i = n as i64;
    let mut l = Launch::new(gpu.stream(), &f);
    l.buf_mut(x).buf(y).val(&n_i);
    // SAFETY: (x, y, n) as declared; every index is below n, which both hold.
    unsafe { l.run(elementwise(gpu, n, 1), false) }
}

/// The kernels' names, for the NVRTC compile check.
pub(super) const KERNELS: [&str; 3] = ["rows_norm_f16", "rows_gated_f16", "rows_add_f16"];
