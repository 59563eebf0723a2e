//! Kernels over the codec's data: the fused CPU paths and the naive reference they are tested
//! against. (CUDA kernels live behind the `cuda` feature, in the same shape.)

pub mod cpu;
pub mod reference;

pub use cpu::lanes::Metric;
