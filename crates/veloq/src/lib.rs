#![warn(missing_docs)]
//! veloq: KV-cache compression for LLM inference.
//!
//! This crate is the framework-free core: codec math (Hadamard rotation, smoothing, product VQ,
//! bit packing), calibration (k-means), artifacts (safetensors), and the CPU kernels (fused
//! nearest-centroid search). Tensors are slices plus shapes; `half` provides f16/bf16.

pub mod artifact;
pub mod calibrate;
pub mod codec;
pub mod element;
pub mod error;
pub mod kernels;
pub mod paths;

#[cfg(test)]
mod testing;

pub use element::Element;
pub use error::{Error, Result};
