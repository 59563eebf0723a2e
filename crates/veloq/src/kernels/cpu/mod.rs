//! CPU kernels: multithreaded with rayon, AVX2/FMA where the CPU has it, portable Rust elsewhere.

pub mod attention;
pub mod lanes;
pub mod search;
