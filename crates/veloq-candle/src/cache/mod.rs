//! The cache contract: a model layer hands its post-RoPE keys and values to a [`LayerCache`] and
//! asks it for attention, so a compressed cache can score against codes without rebuilding fp16
//! keys. Implementations: [`Fp16Cache`] (the reference), [`VecInferCache`] (codes, lookup-table
//! decode) and [`DecodingCache`] (any other [`BlockCodec`](veloq::codec::block::BlockCodec), for
//! the scalar baselines); [`SlidingCache`] serves sliding-window layers whatever the method.
//! On other devices: [`TensorCache`] (f16 in device tensors, candle's attention) and, with the
//! `cuda` feature, [`CudaVecInferCache`] (codes on the GPU, veloq's fused kernels).
//!
//! Shapes: keys/values `[B, n_kv_heads, T, head_dim]`, queries `[B, n_q_heads, T, head_dim]`, f32.
//! The CPU caches take batch 1; GQA is handled inside (query heads index their kv head, keys are
//! never copied per query head).

mod decoding;
mod dense;
mod fp16;
mod portable;
mod sliding;
mod store;
mod tensor;
mod vecinfer;
#[cfg(feature = "cuda")]
mod cuda;

pub use decoding::DecodingCache;
pub use fp16::Fp16Cache;
pub use portable::PortableVecInferCache;
pub use sliding::SlidingCache;
pub use store::WindowConfig;
pub use tensor::{attend_tensors, TensorCache};
#[cfg(feature = "cuda")]
pub use cuda::{CudaRuntime, CudaVecInferCache};
pub use vecinfer::VecInferCache;

use candle_core::Tensor;

use crate::error::Result;

pub trait LayerCache: Send {
    /// Appends `T` new positions (post-RoPE keys and values).
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()>;
    /// Causal attention of the last `T` appended positions' queries over everything cached:
    /// query `i` sees positions `0..=len - T + i`. Returns `[1, n_q_heads, T, head_dim]`.
    fn attend(&mut self, q: &Tensor, scale: f64) -> Result<Tensor>;
    /// Positions cached.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes really held (allocated storage of codes, windows, codebooks' share), not bit counts.
    fn resident_bytes(&self) -> usize;
    /// Keeps the first `len` positions.
    fn truncate(&mut self, len: usize) -> Result<()>;
    /// Moves what appends left pending into long-term storage (codes) as `attend` does after
    /// attending; for filling a cache without attending (benchmarks, restored sessions).
    fn commit(&mut self) -> Result<()> {
        Ok(())
    }
    /// Device operations (kernel launches) issued so far; 0 for the CPU caches, whose work is
    /// not launched.
    fn launches(&self) -> usize {
        0
    }
}

/// Splits a `[1, H, T, D]` tensor into token-major rows `[T, H, D]` of f32.
pub(crate) fn token_major(x: &Tensor) -> Result<(usize, usize, usize, Vec<f32>)> {
    let (b, h, t, d) = x.dims4()?;
    if b != 1 {
        return Err(crate::Error::Config(format!("the CPU caches take batch 1, got {b}")));
    }
    let v = x.squeeze(0)?.transpose(0, 1)?.contiguous()?.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok((h, t, d, v))
}

/// Token-major rows of one append's keys and values (`[T, H, D]` f32 each) and `T`, checked
/// against the `n_kv × head_dim` geometry `what` holds.
pub(crate) fn kv_rows(k: &Tensor, v: &Tensor, n_kv: usize, head_dim: usize, what: &str) -> Result<(usize, Vec<f32>, Vec<f32>)> {
    let (h, t, d, kr) = token_major(k)?;
    let (vh, vt, vd, vr) = token_major(v)?;
    if (h, d) != (n_kv, head_dim) || (vh, vt, vd) != (h, t, d) {
        return Err(crate::Error::Config(format!("{what} holds {n_kv}×{head_dim}, got keys {h}×{d} and values {vh}×{vd} ({t} and {vt} positions)")));
    }
    Ok((t, kr, vr))
}
