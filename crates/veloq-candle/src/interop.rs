//! Device memory owned by another framework (PyTorch, CuPy, JAX — whatever hands out a CUDA
//! pointer and a stream), exchanged with veloq's tensors without a trip through the host: a
//! foreign buffer is copied device to device into a tensor on veloq's stream, a result copied
//! back the same way, and the two streams are ordered by events, so neither side waits on the
//! host and the foreign framework's allocator can reuse its buffers as soon as its own stream
//! says so.
//!
//! The other framework must use the device's primary context (PyTorch, CuPy and JAX do).

use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{result, sys, CudaEvent, CudaStream, DevicePtr, DevicePtrMut};

use crate::error::{Error, Result};

/// A contiguous buffer of f32 on a CUDA device that another framework owns: its address and its
/// length in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignBuffer {
    /// The device address of the first element.
    pub ptr: u64,
    /// Elements (f32).
    pub len: usize,
}

/// A stream of another framework, as its raw `CUstream` handle (0: the legacy default stream,
/// 2: the per-thread default stream, as CUDA numbers them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignStream(pub u64);

/// Copies and stream ordering between veloq's stream on one CUDA device and foreign buffers and
/// streams. One per cache: it holds the two events it orders with.
pub struct Exchange {
    device: CudaDevice,
    stream: Arc<CudaStream>,
    /// Recorded on the foreign stream, waited on by veloq's: the inputs are written.
    inputs: CudaEvent,
    /// Recorded on veloq's stream, waited on by the foreign one: the outputs are written and the
    /// inputs read.
    outputs: CudaEvent,
}

impl Exchange {
    /// The exchange for `device` (a CUDA device).
    pub fn new(device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            return Err(Error::Device(format!("foreign CUDA buffers need a CUDA device, got {device:?}")));
        };
        let stream = cuda.cuda_stream();
        let ctx = stream.context().clone();
        let event = || ctx.new_event(None).map_err(|e| Error::Device(format!("creating a CUDA event: {e}")));
        Ok(Self { device: cuda.clone(), stream, inputs: event()?, outputs: event()? })
    }

    /// veloq's stream waits for what `foreign` has queued so far (the inputs being written).
    pub fn after(&self, foreign: ForeignStream) -> Result<()> {
        self.bind()?;
        // SAFETY: the event is alive (owned by self); the handle is the caller's live stream.
        unsafe { result::event::record(self.inputs.cu_event(), foreign.0 as sys::CUstream) }.map_err(driver)?;
        self.stream.wait(&self.inputs).map_err(driver)
    }

    /// `foreign` waits for what veloq's stream has queued so far (outputs written, inputs read).
    pub fn before(&self, foreign: ForeignStream) -> Result<()> {
        self.outputs.record(&self.stream).map_err(driver)?;
        self.bind()?;
        // SAFETY: as in `after`.
        unsafe {
            result::stream::wait_event(
                foreign.0 as sys::CUstream,
                self.outputs.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(driver)
    }

    /// A new f32 tensor of `shape` on veloq's stream holding a copy of `src`.
    ///
    /// # Safety
    /// `src` must address `src.len` f32 on this device, left unchanged until the copy is done:
    /// call [`before`](Self::before) on the stream that would next write it.
    pub unsafe fn read(&self, src: ForeignBuffer, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != src.len {
            return Err(Error::Shape(format!("a buffer of {} elements read as {shape:?}", src.len)));
        }
        let mut dst = self.stream.alloc::<f32>(n).map_err(driver)?;
        {
            let (ptr, _sync) = dst.device_ptr_mut(&self.stream);
            result::memcpy_dtod_async(ptr, src.ptr, n * 4, self.stream.cu_stream()).map_err(driver)?;
        }
        let storage = CudaStorage::wrap_cuda_slice(dst, self.device.clone());
        Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
    }

    /// Copies `t` (f32 on this device) into `dst`, on veloq's stream.
    ///
    /// # Safety
    /// `dst` must address `dst.len` writable f32 on this device that nothing reads or writes
    /// until the copy is done: call [`before`](Self::before) on the stream that uses it next.
    pub unsafe fn write(&self, t: &Tensor, dst: ForeignBuffer) -> Result<()> {
        if t.dtype() != DType::F32 || t.elem_count() != dst.len {
            return Err(Error::Shape(format!(
                "{:?} {:?} written into a buffer of {} f32",
                t.dtype(),
                t.dims(),
                dst.len
            )));
        }
        let t = t.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else {
            return Err(Error::Device(format!("expected a tensor on the CUDA device, got one on {:?}", t.device())));
        };
        if !cuda.device().same_device(&self.device) {
            return Err(Error::Device("the tensor is on another CUDA device".into()));
        }
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(Error::Shape("expected a contiguous tensor".into()));
        };
        let src = cuda.as_cuda_slice::<f32>()?.slice(start..end);
        let (ptr, _sync) = src.device_ptr(&self.stream);
        result::memcpy_dtod_async(dst.ptr, ptr, dst.len * 4, self.stream.cu_stream()).map_err(driver)
    }

    fn bind(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(driver)
    }
}

fn driver(e: cudarc::driver::DriverError) -> Error {
    Error::Device(format!("CUDA: {e}"))
}
