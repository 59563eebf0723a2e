//! The workspace of candle's cuBLAS handle ([`CudaOptions::blas_workspace`](crate::cuda_options::CudaOptions::blas_workspace)).
//!
//! candle's handle is created with none of its own, so cuBLAS picks its kernels for what fits its
//! default pool; cuBLAS recommends 32 MiB on Hopper, which is what PyTorch gives its handles. The
//! buffer is made once and kept for the process: CUDA graphs captured while it was set replay
//! products that write to it.

use std::sync::Mutex;

use candle_core::cuda_backend::CudaDevice;
use cudarc::driver::{CudaSlice, DevicePtr};

use crate::error::{Error, Result};

/// Bytes of the workspace: cuBLAS's recommendation for Hopper.
pub const BYTES: usize = 32 << 20;

/// The buffer, made the first time it is switched on.
#[derive(Default)]
pub struct BlasWorkspace {
    buffer: Mutex<Option<CudaSlice<u8>>>,
}

impl BlasWorkspace {
    /// Gives `device`'s cuBLAS handle the buffer (`on`) or returns it to cuBLAS's default pool
    /// (setting the handle's stream again resets its workspace, as cuBLAS documents).
    pub fn set(&self, device: &CudaDevice, on: bool) -> Result<()> {
        let blas = device.cublas_handle();
        let stream = device.cuda_stream();
        let err = |e: cudarc::cublas::result::CublasError| Error::Device(format!("cuBLAS workspace: {e:?}"));
        if !on {
            // SAFETY: the handle is candle's, alive while `blas` is, and the stream is the one it
            // was created on.
            return unsafe { cudarc::cublas::result::set_stream(*blas.handle(), stream.cu_stream() as _) }.map_err(err);
        }
        let mut buffer = self.buffer.lock().expect("workspace lock");
        if buffer.is_none() {
            *buffer = Some(stream.alloc_zeros::<u8>(BYTES).map_err(veloq::Error::from)?);
        }
        let buf = buffer.as_ref().expect("just made");
        let (ptr, _sync) = buf.device_ptr(&stream);
        // SAFETY: `ptr` is BYTES of device memory this struct keeps until the process ends (the
        // runtime that owns it is never dropped), on the handle's stream.
        let status = unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, BYTES) };
        status.result().map_err(err)
    }
}
