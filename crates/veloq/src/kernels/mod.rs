//! Kernels over the codec's data: the fused CPU paths (attention over codes and rows, the Q4_1
//! weight products) and (feature `cuda`) the CUDA kernels, which the CPU path checks; the
//! three-state switch that picks them and the options they launch with.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kernel_cache;
pub mod options;
pub mod select;

pub use options::{GemvShape, GemvShapes, KernelOptions};
pub use select::KernelChoice;
