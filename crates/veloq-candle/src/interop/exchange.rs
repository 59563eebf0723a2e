//! [`Exchange`]: copies between foreign buffers and veloq's tensors, and the ordering of the two
//! streams (see the module above).

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType, Device, Storage, Tensor};
use cudarc::driver::{result, sys, CudaEvent, CudaStream, DevicePtr};
use veloq::kernels::cuda::{Convert, ConvertPart, Elem, Gpu, MAX_CONVERT_PARTS};

use super::{ForeignBuffer, ForeignDType, ForeignStream};
use crate::cache::CudaRuntime;
use crate::error::{Error, Result};

/// Elements of f32 a step's inputs (and, apart, its output) may take from the reused buffers: a
/// decode step's are far fewer; a long prompt chunk's are allocated for it instead, so the
/// buffers stay a few MiB.
const STAGE_ELEMS: usize = 1 << 20;

/// Copies and stream ordering between veloq's stream on one CUDA device and foreign buffers and
/// streams. One per cache: it holds the two events it orders with and the f32 buffers a step's
/// inputs and output pass through, reused from step to step (an allocation and a free each, per
/// array and step, were host time that every layer of a decode step paid).
pub struct Exchange {
    device: CudaDevice,
    runtime: Arc<CudaRuntime>,
    /// Recorded on the foreign stream, waited on by veloq's: the inputs are written.
    inputs: CudaEvent,
    /// Recorded on veloq's stream, waited on by the foreign one: the outputs are written and the
    /// inputs read.
    outputs: CudaEvent,
    convert: Convert,
    staging: Mutex<Staging>,
}

/// The reused buffers: inputs and output apart (a kernel writes the output while it reads the
/// inputs, and candle locks a buffer for writing as a whole).
#[derive(Default)]
struct Staging {
    inputs: Option<Tensor>,
    output: Option<Tensor>,
}

/// One step's use of an [`Exchange`]'s buffers, exclusive while it lives: the tensors
/// [`read`](Self::read) and [`output`](Self::output) hand out may be the exchange's reused
/// buffers, so they are the step's only until the stage is dropped.
pub struct Stage<'a> {
    ex: &'a Exchange,
    staging: MutexGuard<'a, Staging>,
}

impl Exchange {
    /// The exchange for `device` (a CUDA device).
    pub fn new(device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            return Err(Error::Device(format!("foreign CUDA buffers need a CUDA device, got {device:?}")));
        };
        let runtime = CudaRuntime::new(device)?;
        let ctx = runtime.gpu().stream().context().clone();
        let event = || ctx.new_event(None).map_err(|e| Error::Device(format!("creating a CUDA event: {e}")));
        let convert = Convert::new(runtime.gpu())?;
        Ok(Self {
            device: cuda.clone(),
            inputs: event()?,
            outputs: event()?,
            convert,
            runtime,
            staging: Mutex::new(Staging::default()),
        })
    }

    fn gpu(&self) -> &Gpu {
        self.runtime.gpu()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.gpu().stream()
    }

    /// veloq's stream waits for what `foreign` has queued so far (the inputs being written).
    pub fn after(&self, foreign: ForeignStream) -> Result<()> {
        self.bind()?;
        // SAFETY: the event is alive (owned by self); the handle is the caller's live stream.
        unsafe { result::event::record(self.inputs.cu_event(), foreign.0 as sys::CUstream) }.map_err(driver)?;
        self.stream().wait(&self.inputs).map_err(driver)
    }

    /// `foreign` waits for what veloq's stream has queued so far (outputs written, inputs read).
    pub fn before(&self, foreign: ForeignStream) -> Result<()> {
        self.outputs.record(self.stream()).map_err(driver)?;
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

    /// The exchange's buffers for one step (waits while another thread's step holds them).
    pub fn stage(&self) -> Stage<'_> {
        Stage { ex: self, staging: self.staging.lock().unwrap_or_else(|p| p.into_inner()) }
    }

    fn bind(&self) -> Result<()> {
        self.stream().context().bind_to_thread().map_err(driver)
    }

    /// A new f32 buffer of `n` elements on veloq's stream, as a tensor.
    fn alloc(&self, n: usize) -> Result<Tensor> {
        // SAFETY: every caller writes all `n` elements on this stream before anything reads them.
        let dst = unsafe { self.stream().alloc::<f32>(n.max(1)) }.map_err(driver)?;
        let storage = CudaStorage::wrap_cuda_slice(dst, self.device.clone());
        Ok(Tensor::from_storage(Storage::Cuda(storage), n.max(1), BackpropOp::none(), false))
    }
}

impl Stage<'_> {
    /// f32 tensors of the given shapes holding copies of the buffers (converted from f16 or bf16
    /// in the copy), all in one launch on veloq's stream.
    ///
    /// # Safety
    /// Each buffer must address its `len` elements of its `dtype` on this device, left unchanged
    /// until the copies are done: call [`Exchange::before`] on the stream that would next write
    /// them.
    pub unsafe fn read(&mut self, srcs: &[(ForeignBuffer, &[usize])]) -> Result<Vec<Tensor>> {
        if srcs.len() > MAX_CONVERT_PARTS {
            return Err(Error::Shape(format!("{} buffers read at once, at most {MAX_CONVERT_PARTS}", srcs.len())));
        }
        for (src, shape) in srcs {
            let n: usize = shape.iter().product();
            if n != src.len {
                return Err(Error::Shape(format!("a buffer of {} elements read as {shape:?}", src.len)));
            }
        }
        let total: usize = srcs.iter().map(|(s, _)| s.len).sum();
        let buffer = buffer(&mut self.staging.inputs, total, self.ex)?;
        let base = address(&buffer, &self.ex.device, self.ex.stream())?;
        let mut parts = Vec::with_capacity(srcs.len());
        let mut tensors = Vec::with_capacity(srcs.len());
        let mut offset = 0;
        for (src, shape) in srcs {
            let dst = base + (offset * 4) as u64;
            parts.push(ConvertPart { src: src.ptr, dst, n: src.len, from: elem(src.dtype), to: Elem::F32 });
            tensors.push(buffer.narrow(0, offset, src.len)?.reshape(*shape)?);
            offset += src.len;
        }
        // SAFETY: the caller vouches for the sources; the destinations are `buffer`'s disjoint
        // runs, which nothing else uses while this stage lives (the stream orders the previous
        // step's reads of them before these writes).
        unsafe { self.ex.convert.launch(self.ex.gpu(), &parts) }?;
        Ok(tensors)
    }

    /// An f32 tensor of `shape` for the step's output, uninitialised: a kernel writes it.
    pub fn output(&mut self, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let buffer = buffer(&mut self.staging.output, n, self.ex)?;
        Ok(buffer.narrow(0, 0, n)?.reshape(shape)?)
    }

    /// Copies `t` (f32 on this device) into `dst` (converted to f16 or bf16 in the copy), on
    /// veloq's stream.
    ///
    /// # Safety
    /// `dst` must address `dst.len` writable elements of `dst.dtype` on this device that nothing
    /// reads or writes until the copy is done: call [`Exchange::before`] on the stream that uses
    /// it next.
    pub unsafe fn write(&mut self, t: &Tensor, dst: ForeignBuffer) -> Result<()> {
        if t.dtype() != DType::F32 || t.elem_count() != dst.len {
            return Err(Error::Shape(format!(
                "{:?} {:?} written into a buffer of {} elements",
                t.dtype(),
                t.dims(),
                dst.len
            )));
        }
        let t = t.contiguous()?;
        let src = address(&t, &self.ex.device, self.ex.stream())?;
        let part = ConvertPart { src, dst: dst.ptr, n: dst.len, from: Elem::F32, to: elem(dst.dtype) };
        // SAFETY: `t` holds `dst.len` f32 elements on this device (checked above and by
        // `address`); the caller vouches for `dst`.
        Ok(unsafe { self.ex.convert.launch(self.ex.gpu(), &[part]) }?)
    }
}

/// A buffer of at least `n` f32 elements: the reused one in `slot`, grown (to a power of two) when
/// it holds fewer, or a new one past [`STAGE_ELEMS`].
fn buffer(slot: &mut Option<Tensor>, n: usize, ex: &Exchange) -> Result<Tensor> {
    if n > STAGE_ELEMS {
        return ex.alloc(n);
    }
    if slot.as_ref().is_none_or(|t| t.elem_count() < n) {
        *slot = Some(ex.alloc(n.max(1).next_power_of_two())?);
    }
    Ok(slot.clone().expect("just set"))
}

/// The device address of the first element of `t`, a contiguous f32 tensor on `device`.
fn address(t: &Tensor, device: &CudaDevice, stream: &Arc<CudaStream>) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err(Error::Device(format!("expected a tensor on the CUDA device, got one on {:?}", t.device())));
    };
    if !cuda.device().same_device(device) {
        return Err(Error::Device("the tensor is on another CUDA device".into()));
    }
    if t.dtype() != DType::F32 {
        return Err(Error::Shape(format!("expected f32, got {:?}", t.dtype())));
    }
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(Error::Shape("expected a contiguous tensor".into()));
    };
    let slice = cuda.as_cuda_slice::<f32>()?.slice(start..end);
    let (ptr, _sync) = slice.device_ptr(stream);
    Ok(ptr)
}

fn elem(d: ForeignDType) -> Elem {
    match d {
        ForeignDType::F32 => Elem::F32,
        ForeignDType::F16 => Elem::F16,
        ForeignDType::Bf16 => Elem::Bf16,
    }
}

fn driver(e: cudarc::driver::DriverError) -> Error {
    Error::Device(format!("CUDA: {e}"))
}
