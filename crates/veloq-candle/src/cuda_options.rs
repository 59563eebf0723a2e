//! How the CUDA paths run: plain data every layer that has a CUDA path reads (the runner's graphs,
//! the model's GEMV, the cache's flush stream, the kernels' launches), passed in at construction.

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
            kernels: KernelOptions::default(),
        }
    }
}
