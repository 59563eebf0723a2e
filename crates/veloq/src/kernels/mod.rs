//! Kernels over the codec's data: the fused CPU paths, the naive reference they are tested
//! against, and (feature `cuda`) the CUDA kernels, which the CPU path checks.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ptx_cache;
pub mod reference;
pub mod select;

pub use cpu::lanes::Metric;
