//! Launches that may start before the previous kernel in their stream has finished
//! (programmatic dependent launch, sm_90 and later); [`KernelOptions::overlapped_launches`]
//! (crate::kernels::KernelOptions) turns them off.
//!
//! A decode step is a chain of short kernels, each waiting for the last: between two of them the
//! GPU drains the first's tail, flushes its writes and only then starts the next one's blocks, so
//! the weights' stream from memory stops for a few µs at every boundary. Launched with
//! programmatic stream serialization, a kernel's blocks are scheduled once every block of its
//! predecessor has signalled `griddepcontrol.launch_dependents` (veloq's kernels signal on entry),
//! run what does not read the predecessor's results (prefetch weights, fill shared memory, score
//! codes), and execute `griddepcontrol.wait` before the first read of anything a kernel may have
//! written. Kernels launched this way must wait before such reads: that contract lives in the
//! `.cu` files (`grid_wait` in `common.cuh`); this file only sets the launch attribute. Stream
//! capture turns the attribute into programmatic edges of the graph.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUlaunchAttributeID};
use cudarc::driver::{CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, SyncOnDrop};

use super::dev_err;
use crate::error::Result;

enum Arg {
    /// A device address, held here (the driver reads the parameter through a pointer to it).
    Ptr(sys::CUdeviceptr),
    /// A value the caller keeps alive until the launch.
    Val(*mut c_void),
}

/// A kernel's arguments in signature order, for [`Launch::run`]. Buffers go through cudarc's
/// `device_ptr`, so a context that tracks events per buffer still orders them.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    f: &'a CudaFunction,
    args: Vec<Arg>,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    pub(crate) fn new(stream: &'a CudaStream, f: &'a CudaFunction) -> Self {
        Self { stream, f, args: Vec::with_capacity(24), guards: Vec::with_capacity(16) }
    }

    /// A buffer the kernel reads.
    pub(crate) fn buf<T>(&mut self, b: &'a impl DevicePtr<T>) -> &mut Self {
        let (p, g) = b.device_ptr(self.stream);
        self.args.push(Arg::Ptr(p));
        self.guards.push(g);
        self
    }

    /// A buffer the kernel writes.
    pub(crate) fn buf_mut<T>(&mut self, b: &'a mut impl DevicePtrMut<T>) -> &mut Self {
        let (p, g) = b.device_ptr_mut(self.stream);
        self.args.push(Arg::Ptr(p));
        self.guards.push(g);
        self
    }

    /// A value passed by copy (ints, floats, `repr(C)` structs).
    pub(crate) fn val<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(Arg::Val(v as *const T as *mut c_void));
        self
    }

    /// Launches with `cfg`, with programmatic stream serialization when `overlap` (callers pass
    /// [`Gpu::overlaps`](super::Gpu::overlaps)).
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in order and type, every access the
    /// kernel makes must stay inside the buffers given, and with `overlap` the kernel must
    /// `grid_wait()` before reading or writing memory its predecessors may still touch.
    pub(crate) unsafe fn run(mut self, cfg: LaunchConfig, overlap: bool) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(dev_err)?;
        let mut params: Vec<*mut c_void> = self
            .args
            .iter_mut()
            .map(|a| match a {
                Arg::Ptr(p) => p as *mut sys::CUdeviceptr as *mut c_void,
                Arg::Val(v) => *v,
            })
            .collect();
        // SAFETY: a zeroed attribute value is valid (plain integers); one field is set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: overlap as u32,
        };
        // SAFETY: `params` points at one value per kernel parameter (the caller's contract), all
        // alive until the call returns (the driver copies them at launch); `config` and `attr`
        // outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, self.f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(dev_err)?;
        drop(self.guards);
        Ok(())
    }
}
