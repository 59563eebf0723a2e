//! The one call into the `gemm` crate (the f32 kernel candle's CPU matmul uses): row-major
//! operands with unit column stride, the right-hand side with any strides (so a transposed tile is
//! read in place), on the calling thread (callers parallelise over tiles with rayon).

/// `dst[m × n] = a[m × k] · b[k × n]`, or `+=` when `accumulate`. Row strides `dst_rs`, `a_rs`;
/// `b` element (r, c) at `b + r·b_rs + c·b_cs`.
///
/// # Safety
/// Every element addressed through these pointers and strides must lie in a live allocation, and
/// `dst`'s must not alias `a`'s or `b`'s.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    a: *const f32,
    a_rs: usize,
    b: *const f32,
    (b_rs, b_cs): (usize, usize),
) {
    // SAFETY: the caller's contract; gemm writes only dst's m × n elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            a,
            1,
            a_rs as isize,
            b,
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
