//! Device memory owned by another framework (PyTorch, CuPy, JAX — whatever hands out a CUDA
//! pointer and a stream), exchanged with veloq's tensors without a trip through the host: a
//! step's foreign buffers are copied device to device into veloq's f32 buffers in one launch, a
//! result copied back the same way — converted between the model's f16/bf16 and the cache's f32
//! in that launch, so the caller converts nothing — and the two streams are ordered by events, so
//! neither side waits on the host and the foreign framework's allocator can reuse its buffers as
//! soon as its own stream says so.
//!
//! The other framework must use the device's primary context (PyTorch, CuPy and JAX do).
//!
//! The buffer and stream types are plain data (any build: the Python binding checks arrays against
//! them); the copies themselves (`Exchange`) need the `cuda` feature.

#[cfg(feature = "cuda")]
mod exchange;
#[cfg(feature = "cuda")]
pub use exchange::{Exchange, Stage};

/// The element type of a foreign buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForeignDType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl ForeignDType {
    /// Bytes an element.
    pub fn size(self) -> usize {
        match self {
            ForeignDType::F32 => 4,
            ForeignDType::F16 | ForeignDType::Bf16 => 2,
        }
    }
}

/// A contiguous buffer on a CUDA device that another framework owns: its address, its length in
/// elements and their type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignBuffer {
    /// The device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
    /// Their type.
    pub dtype: ForeignDType,
}

/// A stream of another framework, as its raw `CUstream` handle (0: the legacy default stream,
/// 2: the per-thread default stream, as CUDA numbers them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignStream(pub u64);
