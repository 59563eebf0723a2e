//! Host side of `gemv.cu`: `y = x·Wᵀ` for f16 weights and up to [`MAX_ROWS`] f32 activation rows
//! (a decode step's), one launch, bound by reading the weights once. Libraries' GEMMs tile for
//! many rows and read a small-batch weight matrix well below the copy bandwidth.

use std::sync::OnceLock;

use cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::{dev_err, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("gemv.cu")];
/// Most activation rows one launch takes (the accumulators live in registers).
pub const MAX_ROWS: usize = 8;

/// A launch shape of the GEMV: output rows per warp (more share each load of x), 16-byte loads
/// per row a lane has in flight, threads per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvTune {
    pub rows_per_warp: usize,
    pub unroll: usize,
    pub threads: u32,
}

impl GemvTune {
    /// The shape for `b` activation rows: `VELOQ_GEMV=R,U,T` if set (from `veloq bench cuda
    /// --gemv-sweep` on the device at hand), else one row per warp, one load in flight, 256
    /// threads for one row (the fastest of 18 shapes on an H200, 8B layer: 0.190 ms against 0.205
    /// for R 2, U 2, 128 threads), R = clamp(b, 2, 4), U = 2, 128 threads for more rows.
    pub fn for_rows(b: usize) -> Self {
        static ENV: OnceLock<Option<(usize, usize, u32)>> = OnceLock::new();
        let env = ENV.get_or_init(|| {
            let v = std::env::var("VELOQ_GEMV").ok()?;
            let p: Vec<usize> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
            match p[..] {
                [r, u, t]
                    if (1..=8).contains(&r) && (1..=8).contains(&u) && t % 32 == 0 && (32..=1024).contains(&t) =>
                {
                    Some((r, u, t as u32))
                }
                _ => None,
            }
        });
        match *env {
            Some((rows_per_warp, unroll, threads)) => Self { rows_per_warp, unroll, threads },
            None if b == 1 => Self { rows_per_warp: 1, unroll: 1, threads: 256 },
            None => Self { rows_per_warp: b.clamp(2, 4), unroll: 2, threads: 128 },
        }
    }

    fn defines(&self, b: usize) -> Vec<(&'static str, i64)> {
        vec![
            ("B", b as i64),
            ("R", self.rows_per_warp as i64),
            ("U", self.unroll as i64),
            ("THREADS", self.threads as i64),
        ]
    }
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
    if !(1..=MAX_ROWS).contains(&b) || !k.is_multiple_of(8) || n == 0 {
        return Err(Error::Device(format!(
            "f16 gemv takes 1..={MAX_ROWS} rows and k a multiple of 8; got b {b}, n {n}, k {k}"
        )));
    }
    if w.len() < n * k || x.len() < b * k || y.len() < b * n {
        return Err(Error::Shape(format!(
            "f16 gemv: buffers smaller than [{n}, {k}] weights, [{b}, {k}] → [{b}, {n}]"
        )));
    }
    let f = gpu.kernel(SOURCES, "f16_gemv", &tune.defines(b), 0)?;
    let per_block = (tune.threads as usize / 32) * tune.rows_per_warp;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(per_block) as u32, 1, 1),
        block_dim: (tune.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_i, k_i) = (n as i32, k as i32);
    let mut l = gpu.stream().launch_builder(&f);
    l.arg(w).arg(x).arg(y).arg(&n_i).arg(&k_i);
    // SAFETY: arguments in f16_gemv's order (w, x, y, N, K); the checks above bound every read
    // (rows < n, chunks < k/8) and write (b·n outputs).
    unsafe { l.launch(cfg) }.map_err(dev_err)?;
    Ok(())
}

/// Defines of every row count (and a few launch shapes), for the NVRTC compile check.
pub(super) fn example_defines() -> Vec<Vec<(&'static str, i64)>> {
    let tuned =
        [(1, 4, 256), (4, 1, 64)].map(|(r, u, t)| GemvTune { rows_per_warp: r, unroll: u, threads: t }.defines(1));
    (1..=MAX_ROWS).map(|b| GemvTune::for_rows(b).defines(b)).chain(tuned).collect()
}
