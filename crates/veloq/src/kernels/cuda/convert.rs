//! Host side of `convert.cu`: element copies between f32, f16 and bf16 buffers, converted on the
//! way and several in one launch — what another framework's query, keys and values cost the
//! host to hand over is launches, so they come in one.

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{dev_err, Gpu};
use crate::error::{Error, Result};

pub(super) const SOURCES: &[&str] = &[include_str!("convert.cu")];

/// Parts one launch copies.
pub const MAX_CONVERT_PARTS: usize = 4;

/// Element types the copies read and write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl Elem {
    /// Bytes an element.
    pub fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }

    fn code(self) -> i32 {
        match self {
            Elem::F32 => 0,
            Elem::F16 => 1,
            Elem::Bf16 => 2,
        }
    }
}

/// `n` elements from device address `src` (of type `from`) to `dst` (of type `to`), rounded to
/// nearest even where `to` is narrower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvertPart {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Elements.
    pub n: usize,
    /// Source type.
    pub from: Elem,
    /// Destination type.
    pub to: Elem,
}

/// `ConvertPart` as `convert.cu` declares it.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawPart {
    src: u64,
    dst: u64,
    n: i64,
    from: i32,
    to: i32,
}

/// `ConvertParts` as `convert.cu` declares it: passed by value, no table to upload.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RawParts {
    p: [RawPart; MAX_CONVERT_PARTS],
    count: i32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for RawParts {}

/// The conversion kernel, compiled when made.
pub struct Convert {
    function: CudaFunction,
}

impl Convert {
    /// The kernel, compiled now.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self { function: gpu.kernel(SOURCES, "vq_convert", &[], 0)? })
    }

    /// Copies every part, converting, in one launch on `gpu`'s stream (none when nothing is to
    /// copy).
    ///
    /// # Safety
    /// Each part's `src` must address `n` readable elements of `from` and its `dst` `n` writable
    /// elements of `to` on this device, ordered on this stream after whatever writes the sources
    /// and before whatever reads the destinations; no destination may overlap another part's
    /// source or destination.
    pub unsafe fn launch(&self, gpu: &Gpu, parts: &[ConvertPart]) -> Result<()> {
        if parts.len() > MAX_CONVERT_PARTS {
            return Err(Error::Shape(format!("{} parts in one conversion, at most {MAX_CONVERT_PARTS}", parts.len())));
        }
        if let Some(p) = parts.iter().find(|p| i64::try_from(p.n).is_err()) {
            return Err(Error::Shape(format!("a conversion of {} elements", p.n)));
        }
        let longest = parts.iter().map(|p| p.n).max().unwrap_or(0);
        if longest == 0 {
            return Ok(());
        }
        let mut raw = RawParts { count: parts.len() as i32, ..RawParts::default() };
        for (r, p) in raw.p.iter_mut().zip(parts) {
            *r = RawPart { src: p.src, dst: p.dst, n: p.n as i64, from: p.from.code(), to: p.to.code() };
        }
        let threads = 256;
        let blocks = longest.div_ceil(threads).min(8 * gpu.multiprocessors() as usize).max(1);
        let cfg =
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
        let mut l = gpu.stream().launch_builder(&self.function);
        l.arg(&raw);
        // SAFETY: the argument is `ConvertParts` by value with its C layout; the caller vouches for
        // every address and count (above), and the kernel touches elements 0..n of each part only.
        unsafe { l.launch(cfg) }.map_err(dev_err)?;
        Ok(())
    }
}
