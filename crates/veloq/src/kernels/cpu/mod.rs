//! CPU kernels: multithreaded with rayon, AVX2/FMA where the CPU has it, portable Rust elsewhere.

pub mod attention;
pub mod gemm;
pub mod quant;
