//! Element types the kernels read: f32, f16 and bf16 all widen exactly to f32, so every kernel
//! computes in f32 whatever it was given.

use half::{bf16, f16};

/// A storage type that widens to f32 without loss.
pub trait Element: Copy + Send + Sync + 'static {
    /// The type's name, for messages.
    const NAME: &'static str;
    /// Widens to f32.
    fn to_f32(self) -> f32;
    /// Narrows from f32 (round to nearest).
    fn from_f32(v: f32) -> Self;
    /// Widens `src` into `dst` (same length).
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
    }
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const NAME: &'static str = "f16";
    /// F16C where the CPU has it.
    #[inline]
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
