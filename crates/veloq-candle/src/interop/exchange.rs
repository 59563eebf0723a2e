//! [`Exchange`]: copies between foreign buffers and veloq's tensors, and the ordering of the two
//! streams (see the module above).

use std::sync::Arc;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{
    result, sys, CudaEvent, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{ForeignBuffer, ForeignDType, ForeignStream};
use crate::error::{Error, Result};

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
    /// candle's conversion kernels, looked up once.
    casts: Casts,
}

/// candle's contiguous cast kernels between the foreign types and f32.
struct Casts {
    f16_to_f32: CudaFunction,
    bf16_to_f32: CudaFunction,
    f32_to_f16: CudaFunction,
    f32_to_bf16: CudaFunction,
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
        let cast = |name: &str| -> Result<CudaFunction> {
            Ok(cuda.get_or_load_func(name, &candle_core::cuda_backend::kernels::CAST)?.into_cuda_function())
        };
        let casts = Casts {
            f16_to_f32: cast("cast_f16_f32")?,
            bf16_to_f32: cast("cast_bf16_f32")?,
            f32_to_f16: cast("cast_f32_f16")?,
            f32_to_bf16: cast("cast_f32_bf16")?,
        };
        Ok(Self { device: cuda.clone(), stream, inputs: event()?, outputs: event()?, casts })
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

    /// A new f32 tensor of `shape` on veloq's stream holding a copy of `src` (converted from f16
    /// or bf16 in the copy).
    ///
    /// # Safety
    /// `src` must address `src.len` elements of `src.dtype` on this device, left unchanged until
    /// the copy is done: call [`before`](Self::before) on the stream that would next write it.
    pub unsafe fn read(&self, src: ForeignBuffer, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if n != src.len {
            return Err(Error::Shape(format!("a buffer of {} elements read as {shape:?}", src.len)));
        }
        let mut dst = self.stream.alloc::<f32>(n).map_err(driver)?;
        {
            let (ptr, _sync) = dst.device_ptr_mut(&self.stream);
            match src.dtype {
                ForeignDType::F32 => {
                    result::memcpy_dtod_async(ptr, src.ptr, n * 4, self.stream.cu_stream()).map_err(driver)?
                }
                ForeignDType::F16 => self.cast(&self.casts.f16_to_f32, n, src.ptr, ptr)?,
                ForeignDType::Bf16 => self.cast(&self.casts.bf16_to_f32, n, src.ptr, ptr)?,
            }
        }
        let storage = CudaStorage::wrap_cuda_slice(dst, self.device.clone());
        Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
    }

    /// Copies `t` (f32 on this device) into `dst` (converted to f16 or bf16 in the copy), on
    /// veloq's stream.
    ///
    /// # Safety
    /// `dst` must address `dst.len` writable elements of `dst.dtype` on this device that nothing
    /// reads or writes until the copy is done: call [`before`](Self::before) on the stream that
    /// uses it next.
    pub unsafe fn write(&self, t: &Tensor, dst: ForeignBuffer) -> Result<()> {
        if t.dtype() != DType::F32 || t.elem_count() != dst.len {
            return Err(Error::Shape(format!(
                "{:?} {:?} written into a buffer of {} elements",
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
        match dst.dtype {
            ForeignDType::F32 => {
                result::memcpy_dtod_async(dst.ptr, ptr, dst.len * 4, self.stream.cu_stream()).map_err(driver)
            }
            ForeignDType::F16 => self.cast(&self.casts.f32_to_f16, dst.len, ptr, dst.ptr),
            ForeignDType::Bf16 => self.cast(&self.casts.f32_to_bf16, dst.len, ptr, dst.ptr),
        }
    }

    /// One launch of candle's contiguous cast kernel `f`: `n` elements from device address `src`
    /// to device address `dst`, on veloq's stream.
    ///
    /// # Safety
    /// `src` and `dst` must address `n` elements of the kernel's source and destination types.
    unsafe fn cast(&self, f: &CudaFunction, n: usize, src: u64, dst: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (dims, info) = (0usize, 0u64); // no layout: contiguous
        let mut b = self.stream.launch_builder(f);
        b.arg(&n).arg(&dims).arg(&info).arg(&src).arg(&dst);
        b.launch(LaunchConfig::for_num_elems(n as u32)).map(drop).map_err(driver)
    }

    fn bind(&self) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(driver)
    }
}

fn driver(e: cudarc::driver::DriverError) -> Error {
    Error::Device(format!("CUDA: {e}"))
}
