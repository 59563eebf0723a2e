//! How the CUDA paths run: plain data every layer that has a CUDA path reads (the runner's graphs,
//! the model's GEMV, the cache's flush stream, the kernels' launches), passed in at construction.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use veloq::kernels::KernelOptions;

/// How the CUDA paths run; ignored on the CPU. Each switch exists to time a path against the one
/// before it in one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// Decode steps replayed from CUDA graphs (a [`Runner`](crate::Runner)'s).
    pub graphs: bool,
    /// f16 weights of decode steps through veloq's GEMV (off: candle's matmul, cuBLAS).
    pub gemv: bool,
    /// f16 weights of many-row steps (prompt chunks, batches past the GEMV's rows) multiplied as
    /// f16 activations, with veloq's row kernels between the products (off: candle's f32 path,
    /// a cast on each side of every product).
    pub f16_rows: bool,
    /// Cache flushes on a second stream, off the step's path.
    pub flush_stream: bool,
    /// Device memory freed by a step kept in the allocator's pool for the next one (off: given
    /// back to the driver whenever the host waits on the GPU, and mapped again by the next step).
    pub keep_freed_memory: bool,
    /// Sequences at different positions decode in the launches of one batch, each reading its
    /// entry of a table (off: the launches of one batch per group of sequences laid out alike).
    pub ragged_decode: bool,
    /// Overlapped launches, the kernel cache, GEMV shapes.
    pub kernels: KernelOptions,
}

impl Default for CudaOptions {
    /// Every fast path on; compiled kernels kept under `~/.cache/veloq/kernels`.
    fn default() -> Self {
        Self {
            graphs: true,
            gemv: true,
            f16_rows: true,
            flush_stream: true,
            keep_freed_memory: true,
            ragged_decode: true,
            kernels: KernelOptions::default(),
        }
    }
}

/// The variable through which the CUDA driver finds its cache of machine code translated from PTX.
pub const DRIVER_CACHE_VAR: &str = "CUDA_CACHE_PATH";

/// Where the CUDA driver should keep the machine code it translates from PTX, given veloq's cache
/// directory and the variable's current value: `<cache_dir>/nv`, or `None` where the variable is
/// set already (the user's choice wins). candle's kernels ship as PTX and their translation is
/// most of a process's start-up (about 19 s on an H100) wherever the driver's own cache
/// (`~/.nv/ComputeCache`) is empty, as in every fresh container; beside the models and veloq's
/// compiled kernels, one mounted cache directory carries both. The binaries set it first thing
/// (the driver reads it once, when it starts, and a process may set its environment only while
/// it has a single thread).
pub fn driver_cache_dir(cache_dir: &Path, current: Option<&OsStr>) -> Option<PathBuf> {
    match current {
        Some(v) if !v.is_empty() => None,
        _ => Some(cache_dir.join("nv")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_cache_goes_beside_veloqs_unless_set() {
        let dir = Path::new("/mnt/models");
        assert_eq!(driver_cache_dir(dir, None), Some(PathBuf::from("/mnt/models/nv")));
        assert_eq!(driver_cache_dir(dir, Some(OsStr::new(""))), Some(PathBuf::from("/mnt/models/nv")));
        assert_eq!(driver_cache_dir(dir, Some(OsStr::new("/elsewhere"))), None);
    }
}
