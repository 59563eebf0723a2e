//! How veloq's CUDA kernels launch and where their compiled forms are kept: plain data, passed in
//! at construction (the CUDA runtime holds it), so a process can run two settings side by side and
//! a library user sets them in code. Compiled with or without the `cuda` feature.

use std::path::PathBuf;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Options of the CUDA kernels of one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelOptions {
    /// Launch kernels that support it to overlap their predecessor's tail (programmatic dependent
    /// launch, sm_90 and later). Graphs replay what was on when they were captured.
    pub overlapped_launches: bool,
    /// Directory of compiled kernels kept between processes (NVRTC takes seconds per variant);
    /// `None` compiles in every process.
    pub kernel_cache: Option<PathBuf>,
    /// Launch shapes of the f16 GEMV, when not the built-in ones.
    pub gemv: GemvShapes,
    /// The quantize kernel searches a 2-D book's candidate lists (`codec::search::grid`) instead
    /// of every centroid: the same codes, fewer distances.
    pub candidate_lists: bool,
}

impl Default for KernelOptions {
    /// Overlapped launches on, compiled kernels under `~/.cache/veloq/kernels`, built-in GEMV
    /// shapes, candidate lists on.
    fn default() -> Self {
        Self {
            overlapped_launches: true,
            kernel_cache: Some(crate::paths::default_cache_dir().join("kernels")),
            gemv: GemvShapes::default(),
            candidate_lists: true,
        }
    }
}

/// GEMV launch shapes for one activation row and for more (see `GemvTune` in `kernels::cuda`);
/// `None` takes the built-in shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemvShapes {
    /// One activation row (f32 FMAs).
    pub one_row: Option<GemvShape>,
    /// Two rows or more (tensor cores; `rows` a multiple of 8).
    pub many_rows: Option<GemvShape>,
}

/// One GEMV launch shape: weight rows per block, 16-byte loads in flight per row, threads per
/// block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvShape {
    /// Weight rows per block (1..=32).
    pub rows: usize,
    /// 16-byte loads per row a thread has in flight (1..=8).
    pub unroll: usize,
    /// Threads per block (a multiple of 32 in 32..=1024).
    pub threads: u32,
}

impl FromStr for GemvShape {
    type Err = Error;

    /// `R,U,T`, e.g. `2,2,256`.
    fn from_str(v: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "GEMV shape {v:?}: expected R,U,T with R 1..=32, U 1..=8, T a multiple of 32 up to 1024"
            ))
        };
        let p: Vec<usize> = v.split(',').map(|x| x.trim().parse().map_err(|_| bad())).collect::<Result<_>>()?;
        match p[..] {
            [r, u, t] if (1..=32).contains(&r) && (1..=8).contains(&u) && t % 32 == 0 && (32..=1024).contains(&t) => {
                Ok(Self { rows: r, unroll: u, threads: t as u32 })
            }
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_shapes_parse_and_refuse() {
        assert_eq!("2, 2, 256".parse::<GemvShape>().unwrap(), GemvShape { rows: 2, unroll: 2, threads: 256 });
        for bad in ["", "2,2", "0,1,256", "2,9,256", "2,2,250", "2,2,2048", "a,b,c"] {
            assert!(bad.parse::<GemvShape>().is_err(), "{bad}");
        }
        assert!(KernelOptions::default().overlapped_launches && KernelOptions::default().candidate_lists);
    }
}
