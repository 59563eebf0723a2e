//! CUDA kernels (feature `cuda`): written in CUDA C (`*.cu` beside this file), compiled at first
//! use by NVRTC into machine code for the device's own architecture with every size fixed by
//! `#define`, and cached per process and on disk ([`kernel_cache`](crate::kernels::kernel_cache)).
//! Machine code (CUBIN), not PTX: the driver would translate PTX again in every process whose
//! own cache of translations is cold (a fresh machine or container). cudarc loads the driver
//! and NVRTC at run time, so building needs no CUDA and a machine without a GPU gets an error,
//! not a crash.

mod attention;
mod convert;
mod dense;
mod gemv;
mod launch;
mod prefill;
mod quantize;
mod rows;
mod window;

pub use attention::{
    ragged_entry, tensor_cores_take, AttentionScratch, Coded, GpuAttention, Ragged, SplitKernel, Window, WindowMap,
    DEFAULT_THREADS, MAX_WINDOW, RAGGED_INTS,
};
pub use convert::{Convert, ConvertPart, Elem, MAX_CONVERT_PARTS};
pub use dense::{dense_ragged_entry, GpuDenseAttention, DENSE_RAGGED_INTS};
pub use gemv::{gemv_f16, gemv_f16_many, gemv_many_fits, GemvEpilogue, GemvFused, GemvTune, MAX_ROWS as GEMV_MAX_ROWS};
pub use prefill::{
    GpuPrefill, GpuPrefillCodes, PrefillOut, PrefillParts, Rows, RowsAround, Split, MAX_RUNS as PREFILL_MAX_RUNS,
};
pub use quantize::{quantize_jobs, GpuCodec, QuantizeJob, QuantizeLaunch, RowMap};
pub use rows::{add_f16 as rows_add_f16, gated_f16 as rows_gated_f16, norm_f16 as rows_norm_f16, GatedActivation};
pub use window::{PutMap, PutRows};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::error::{Error, Result};
use crate::kernels::kernel_cache;
use crate::kernels::options::{GemvShapes, KernelOptions};

const COMMON: &str = include_str!("common.cuh");

/// A driver error as ours: out of memory gets its own variant (callers react to it, e.g. by
/// reporting that a context does not fit), everything else is a device error.
/// Dynamic shared memory of `bytes`, rounded up to whole 16-byte words: nvcc reads the tail of
/// a float loop over shared memory as one 16-byte vector (`LDS.128`) and keeps the elements it
/// needs, so an allocation that ends inside a word is read past its end (compute-sanitizer:
/// `f16_attend_merge` with an odd split count; an illegal address under serving load).
pub(crate) fn whole_words(bytes: usize) -> usize {
    bytes.next_multiple_of(16)
}

pub(crate) fn dev_err(e: cudarc::driver::DriverError) -> Error {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Error::OutOfMemory(format!("{e:?}"))
    } else {
        Error::Device(format!("{e:?}"))
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        dev_err(e)
    }
}

/// Runs `f`, turning a panic (cudarc's answer to a missing library) into `Err` without printing it.
fn quietly<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> std::thread::Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(f);
    std::panic::set_hook(hook);
    r
}

/// One GPU: its context, a stream, the kernels compiled for it so far and the options they launch
/// with.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: &'static str,
    major: i32,
    sms: u32,
    max_smem: usize,
    kernels: Mutex<HashMap<String, CudaFunction>>,
    /// [`KernelOptions::overlapped_launches`], read at every launch.
    overlapped: AtomicBool,
    /// [`KernelOptions::candidate_lists`], read at every quantize launch.
    lists: AtomicBool,
    options: Mutex<KernelOptions>,
}

impl Gpu {
    /// Opens GPU `ordinal`. Missing driver library or device → [`Error::Device`].
    pub fn new(ordinal: usize, options: KernelOptions) -> Result<Self> {
        // cudarc panics when libcuda cannot be loaded; turn that into an error.
        let ctx = quietly(|| CudaContext::new(ordinal))
            .map_err(|_| Error::Device("the CUDA driver library (libcuda.so) could not be loaded".into()))?
            .map_err(dev_err)?;
        Self::from_stream(ctx.default_stream(), options)
    }

    /// The GPU of `stream`, launching on it (so kernels order with a framework's work there, e.g.
    /// candle's CUDA device).
    pub fn from_stream(stream: Arc<CudaStream>, options: KernelOptions) -> Result<Self> {
        let ctx = stream.context().clone();
        let (major, minor) = ctx.compute_capability().map_err(dev_err)?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(dev_err)? as u32;
        let max_smem = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(dev_err)? as usize;
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        Ok(Self {
            ctx,
            stream,
            arch,
            major,
            sms,
            max_smem,
            kernels: Mutex::new(HashMap::new()),
            overlapped: AtomicBool::new(options.overlapped_launches),
            lists: AtomicBool::new(options.candidate_lists),
            options: Mutex::new(options),
        })
    }

    /// The options launches follow now.
    pub fn options(&self) -> KernelOptions {
        self.options.lock().expect("kernel options lock").clone()
    }

    /// Options for launches from now on (kernels compiled so far stay compiled; graphs replay
    /// what they captured).
    pub fn set_options(&self, options: KernelOptions) {
        self.overlapped.store(options.overlapped_launches, Ordering::Relaxed);
        self.lists.store(options.candidate_lists, Ordering::Relaxed);
        *self.options.lock().expect("kernel options lock") = options;
    }

    /// The GEMV launch shapes of the options.
    pub fn gemv_shapes(&self) -> GemvShapes {
        self.options.lock().expect("kernel options lock").gemv
    }

    /// Device memory of the default pool (where stream-ordered allocations such as candle's and
    /// veloq's come from): bytes in use now and the most in use since the last
    /// [`reset_peak_memory`](Self::reset_peak_memory), as the driver counts them.
    pub fn pool_memory(&self) -> Result<PoolMemory> {
        use cudarc::driver::sys::CUmemPool_attribute::*;
        let (used, peak) = (
            self.pool_attribute(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            self.pool_attribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        );
        Ok(PoolMemory { used: used as usize, peak: peak as usize })
    }

    /// Restarts the pool's high-water mark from what is in use now.
    pub fn reset_peak_memory(&self) -> Result<()> {
        self.set_pool_attribute(cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    /// Whether memory freed into the default pool stays there for the next allocation (`true`) or
    /// goes back to the driver at every synchronisation (`false`, the driver's own default, a
    /// release threshold of 0): kept, the buffers a step allocates after the host waited on the
    /// GPU are reused instead of mapped again, as PyTorch's caching allocator reuses its blocks.
    pub fn keep_freed_memory(&self, keep: bool) -> Result<()> {
        let attr = cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        self.set_pool_attribute(attr, if keep { u64::MAX } else { 0 })
    }

    /// A 64-bit attribute of the default pool (memory in use, high-water mark, release threshold).
    fn pool_attribute(&self, attr: cudarc::driver::sys::CUmemPool_attribute) -> Result<u64> {
        let pool = self.default_pool()?;
        let mut v: u64 = 0;
        // SAFETY: `pool` is the device's default pool (checked by the call that returned it) and
        // the attributes read through here are 64-bit, written into `v`.
        unsafe { cudarc::driver::sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut _) }
            .result()
            .map_err(dev_err)?;
        Ok(v)
    }

    /// Sets a 64-bit attribute of the default pool.
    fn set_pool_attribute(&self, attr: cudarc::driver::sys::CUmemPool_attribute, mut value: u64) -> Result<()> {
        let pool = self.default_pool()?;
        // SAFETY: a valid pool, and the attributes set through here (high-water mark, release
        // threshold) take a 64-bit value.
        unsafe { cudarc::driver::sys::cuMemPoolSetAttribute(pool, attr, &mut value as *mut u64 as *mut _) }
            .result()
            .map_err(dev_err)
    }

    fn default_pool(&self) -> Result<cudarc::driver::sys::CUmemoryPool> {
        self.ctx.bind_to_thread().map_err(dev_err)?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: the context is bound to this thread and `cu_device` is its device; the driver
        // writes the pool handle into `pool`.
        unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .map_err(dev_err)?;
        Ok(pool)
    }

    /// Why there is no usable GPU, if there is none (for [`KernelChoice`](super::select::KernelChoice)).
    pub fn probe() -> std::result::Result<(), String> {
        Self::new(0, KernelOptions::default()).map(|_| ()).map_err(|e| e.to_string())
    }

    /// The stream kernels launch on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }
    /// Whether launches here may overlap their predecessor's tail ([`launch`]): sm_90 and later,
    /// while [`KernelOptions::overlapped_launches`] is on.
    pub fn overlaps(&self) -> bool {
        self.major >= 9 && self.overlapped.load(Ordering::Relaxed)
    }
    /// Whether quantize launches scan candidate lists ([`KernelOptions::candidate_lists`]).
    pub fn candidate_lists(&self) -> bool {
        self.lists.load(Ordering::Relaxed)
    }
    /// The device's name.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown GPU".into())
    }

    /// Kernel `name` from `sources` with `defines`, compiled on first request; `smem` is the dynamic
    /// shared memory it will be launched with (raised past 48 KiB where the device allows).
    pub(crate) fn kernel(
        &self,
        sources: &[&str],
        name: &str,
        defines: &[(&str, i64)],
        smem: usize,
    ) -> Result<CudaFunction> {
        if smem > self.max_smem {
            return Err(Error::Device(format!(
                "{name} needs {smem} B of shared memory, the device allows {}",
                self.max_smem
            )));
        }
        let key = format!("{name}\n{defines:?}");
        let mut cache = self.kernels.lock().expect("kernel cache lock");
        if let Some(f) = cache.get(&key) {
            return Ok(f.clone());
        }
        let src = source(sources, defines);
        let dir = self.options.lock().expect("kernel options lock").kernel_cache.clone();
        let disk_key = kernel_cache::key(&[self.arch, name, &src, &nvrtc_version()]);
        let cached = dir.as_deref().and_then(|d| kernel_cache::load(d, &disk_key));
        let module = match cached.map(|cubin| self.ctx.load_module(Ptx::from_binary(cubin))) {
            Some(Ok(m)) => m,
            stale => {
                if let (Some(d), Some(Err(_))) = (&dir, stale) {
                    kernel_cache::forget(d, &disk_key);
                }
                let cubin = compile_source(self.arch, name, &src)?;
                if let Some(d) = &dir {
                    // A cache that cannot be written costs the next process a compile, nothing else.
                    let _ = kernel_cache::store(d, &disk_key, &cubin);
                }
                self.ctx.load_module(Ptx::from_binary(cubin)).map_err(dev_err)?
            }
        };
        let f = module.load_function(name).map_err(dev_err)?;
        if smem > 48 * 1024 {
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(dev_err)?;
        }
        cache.insert(key, f.clone());
        Ok(f)
    }
}

/// Stream-ordered device memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolMemory {
    /// Bytes in use.
    pub used: usize,
    /// Most bytes in use since the last reset.
    pub peak: usize,
}

/// NVRTC compile check of every kernel source without a GPU (needs libnvrtc only).
pub fn compile_check(arch: &'static str) -> Result<()> {
    let attention = attention::example_defines().into_iter().map(|d| ("vq_attend_split", attention::SOURCES, d));
    let merge = attention::example_defines().into_iter().map(|d| ("vq_attend_merge", attention::MERGE_SOURCES, d));
    let mma = attention::example_mma_defines().into_iter().map(|d| ("vq_attend_mma", attention::MMA_SOURCES, d));
    let window = std::iter::once(("vq_window_put", window::SOURCES, vec![("D", 128)]));
    let convert = std::iter::once(("vq_convert", convert::SOURCES, vec![]));
    let dense = dense::example_defines().into_iter().map(|d| ("f16_attend_split", dense::SOURCES, d));
    let quantize = quantize::example_defines().into_iter().map(|d| ("vq_quantize", quantize::SOURCES, d));
    let gemv = gemv::example_defines().into_iter().map(|(name, d)| (name, gemv::SOURCES, d));
    let prefill = prefill::example_defines().into_iter().map(|d| ("f16_prefill_rows", prefill::SOURCES, d));
    let rows = rows::KERNELS.into_iter().map(|name| (name, rows::SOURCES, vec![]));
    for (name, sources, defines) in quantize
        .chain(attention)
        .chain(merge)
        .chain(mma)
        .chain(window)
        .chain(convert)
        .chain(dense)
        .chain(prefill)
        .chain(gemv)
        .chain(rows)
    {
        compile(arch, name, sources, &defines)?;
    }
    Ok(())
}

/// The text NVRTC compiles: `defines` as `#define` lines, the common helpers, then `sources`.
fn source(sources: &[&str], defines: &[(&str, i64)]) -> String {
    let header: String = defines.iter().map(|(k, v)| format!("#define {k} {v}\n")).collect();
    format!("{header}{COMMON}\n{}", sources.join("\n"))
}

/// Machine code of kernel `name` for `arch` from `sources` with `defines`, compiled by NVRTC (a
/// missing libnvrtc is an error, not a panic).
fn compile(arch: &'static str, name: &str, sources: &[&str], defines: &[(&str, i64)]) -> Result<Vec<u8>> {
    compile_source(arch, name, &source(sources, defines))
}

/// CUBIN of `src` for `arch` (a real architecture, `sm_90`: NVRTC runs the assembler itself).
fn compile_source(arch: &'static str, name: &str, src: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(src).map_err(|_| Error::Device(format!("{name}: a NUL in the source")))?;
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    let compiled = quietly(move || -> std::result::Result<Vec<u8>, String> {
        let prog = result::create_program(&src, None).map_err(|e| format!("{e:?}"))?;
        // SAFETY: `prog` is live until the destroy below; each size is asked before its buffer is
        // filled, and NVRTC writes no more than it said.
        unsafe {
            let built = match result::compile_program(prog, &options) {
                Ok(()) => {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .and_then(|_| {
                            let mut cubin = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()).result().map(|_| cubin)
                        })
                        .map_err(|e| format!("{e:?}"))
                }
                Err(e) => {
                    let log: Vec<u8> =
                        result::get_program_log(prog).unwrap_or_default().into_iter().map(|c| c as u8).collect();
                    let log = String::from_utf8_lossy(log.split(|&b| b == 0).next().unwrap_or_default());
                    Err(format!("{e:?}: {log}"))
                }
            };
            let _ = result::destroy_program(prog);
            built
        }
    });
    compiled
        .map_err(|_| Error::Device("libnvrtc could not be loaded".into()))?
        .map_err(|e| Error::Device(format!("NVRTC compiling {name}: {e}")))
}

/// NVRTC's version as "major.minor" (part of the disk cache's key: code from a newer compiler may
/// not load on an older driver); "unknown" when libnvrtc cannot be asked.
fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion only writes the two integers it is given.
    match quietly(move || {
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }.result().map(|_| (major, minor))
    }) {
        Ok(Ok((a, b))) => format!("{a}.{b}"),
        _ => "unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    /// Both kernel sources compile for Hopper with NVRTC (no GPU needed; libnvrtc must be on the
    /// library path, e.g. the toolkit from ../shared/scripts/cuda-toolkit.sh).
    #[test]
    fn kernels_compile_with_nvrtc() {
        super::compile_check("sm_90").unwrap();
    }

    /// What the disk cache keeps and the driver loads is machine code, not PTX text.
    #[test]
    fn kernels_compile_to_machine_code() {
        let code = super::compile("sm_90", "vq_convert", super::convert::SOURCES, &[]).unwrap();
        assert_eq!(&code[..4], b"\x7fELF", "a CUBIN is an ELF image");
    }

    /// A kernel that does not compile is an error carrying NVRTC's log, not a panic.
    #[test]
    fn a_compile_error_carries_the_log() {
        let src = "extern \"C\" __global__ void broken() { undeclared_name = 1; }";
        let msg = super::compile_source("sm_90", "broken", src).unwrap_err().to_string();
        assert!(msg.contains("NVRTC compiling broken") && msg.contains("undeclared_name"), "{msg}");
    }
}
