//! CPU kernels: multithreaded with rayon, AVX2/FMA where the CPU has it, portable Rust elsewhere.

pub mod attention;
pub mod gemm;
pub mod lanes;
pub mod q4_1;
pub mod search;
