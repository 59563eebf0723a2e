//! The innermost search: 8 sub-vectors (one per SIMD lane) against every centroid of a codebook,
//! with the running minimum and its index kept in registers. Nothing but the 8 winners leaves.
//!
//! Lanes hold *sub-vectors*, not centroids: the 8 transposed inputs stay in registers for the whole
//! pass and each centroid coordinate is broadcast once and used by all lanes, so the loop is one
//! broadcast + one FMA per coordinate and needs no horizontal reduction.
//!
//! Two distance forms:
//! - [`Metric::Exact`]: Σ_d (x_d − c_d)², summed in coordinate order with separate multiply and add,
//!   the same arithmetic as the materialising reference, so indices are bit-identical to it;
//! - [`Metric::Expanded`]: ‖c‖² − 2x·c with precomputed norms: one FMA per coordinate instead of
//!   three operations. It ranks centroids identically except on near-ties (gaps of a few ulps of
//!   ‖x‖²), which the parity tests bound.
//!
//! Ties go to the lowest index in both forms (strict less-than while scanning upwards).

use crate::codec::codebook::Codebook;

/// Lanes per search call.
pub const LANES: usize = 8;

/// Which distance the search ranks by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    /// Σ(x − c)² in coordinate order: the reference's indices, bit for bit.
    Exact,
    /// ‖c‖² − 2x·c: one FMA per coordinate; differs only on near-ties.
    Expanded,
}

impl Metric {
    /// `exact` or `expanded`.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Exact => "exact",
            Metric::Expanded => "expanded",
        }
    }
    /// Floating-point operations per (sub-vector, centroid) pair, for roofline figures.
    pub fn flops_per_pair(self, sub_dim: usize) -> usize {
        match self {
            Metric::Exact => 3 * sub_dim,
            Metric::Expanded => 2 * sub_dim + 1,
        }
    }
}

/// Result of one 8-lane search: winning index per lane and its ranking value (the full squared
/// distance for `Exact`, ‖c‖² − 2x·c for `Expanded`). A lane whose input held NaN ends with +∞.
pub type LaneResult = ([u16; LANES], [f32; LANES]);

/// Signature shared by the SIMD and portable searches; `xt` holds `sub_dim` rows of 8 lanes.
pub type SearchFn = fn(xt: &[[f32; LANES]], book: &Codebook, metric: Metric) -> LaneResult;

/// The fastest search this CPU supports, chosen once per call site.
pub fn select() -> SearchFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return avx2::search;
        }
    }
    portable::search
}

/// Plain Rust lanes: the path on CPUs without AVX2/FMA and the cross-check for the SIMD path.
pub mod portable {
    use super::*;

    pub fn search(xt: &[[f32; LANES]], book: &Codebook, metric: Metric) -> LaneResult {
        match xt.len() {
            2 => run::<2>(xt, book, metric),
            4 => run::<4>(xt, book, metric),
            8 => run::<8>(xt, book, metric),
            d => panic!("unsupported sub_dim {d}"),
        }
    }

    fn run<const SD: usize>(xt: &[[f32; LANES]], book: &Codebook, metric: Metric) -> LaneResult {
        let mut best = [f32::INFINITY; LANES];
        let mut idx = [0u16; LANES];
        for k in 0..book.len() {
            let mut acc = [0.0f32; LANES];
            match metric {
                Metric::Exact => {
                    let c = book.centroid(k);
                    for d in 0..SD {
                        for l in 0..LANES {
                            let diff = xt[d][l] - c[d];
                            acc[l] = if d == 0 { diff * diff } else { acc[l] + diff * diff };
                        }
                    }
                }
                Metric::Expanded => {
                    let c = &book.neg2()[k * SD..(k + 1) * SD];
                    acc = [book.norms()[k]; LANES];
                    for d in 0..SD {
                        for l in 0..LANES {
                            acc[l] += xt[d][l] * c[d];
                        }
                    }
                }
            }
            for l in 0..LANES {
                if acc[l] < best[l] {
                    best[l] = acc[l];
                    idx[l] = k as u16;
                }
            }
        }
        (idx, best)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    pub fn search(xt: &[[f32; LANES]], book: &Codebook, metric: Metric) -> LaneResult {
        // SAFETY: `select` hands this out only after detecting AVX2 and FMA.
        if metric == Metric::Expanded && book.len() % 2 == 1 {
            return portable::search(xt, book, metric);
        }
        unsafe {
            match (xt.len(), metric) {
                (2, Metric::Exact) => exact::<2>(xt, book),
                (4, Metric::Exact) => exact::<4>(xt, book),
                (8, Metric::Exact) => exact::<8>(xt, book),
                (2, Metric::Expanded) => expanded::<2>(xt, book),
                (4, Metric::Expanded) => expanded::<4>(xt, book),
                (8, Metric::Expanded) => expanded::<8>(xt, book),
                (d, _) => panic!("unsupported sub_dim {d}"),
            }
        }
    }

    #[inline(always)]
    // SAFETY (callers): AVX2 is available (only `select`'s checked entry point calls in).
    unsafe fn load<const SD: usize>(xt: &[[f32; LANES]]) -> [__m256; SD] {
        let mut x = [_mm256_setzero_ps(); SD];
        for d in 0..SD {
            x[d] = _mm256_loadu_ps(xt[d].as_ptr());
        }
        x
    }

    #[inline(always)]
    // SAFETY (callers): AVX2 is available.
    unsafe fn finish(best: __m256, best_idx: __m256) -> LaneResult {
        let (mut b, mut i) = ([0.0f32; LANES], [0.0f32; LANES]);
        _mm256_storeu_ps(b.as_mut_ptr(), best);
        _mm256_storeu_ps(i.as_mut_ptr(), best_idx);
        (i.map(|v| v as u16), b)
    }

    /// Two centroids per iteration, each with its own running minimum, so the compare/select
    /// chains of neighbouring centroids overlap; merged at the end with ties to the lower index.
    // Coordinate d indexes the lanes' registers and the centroid together: a range loop says so.
    // SAFETY (callers): AVX2 and FMA are available; the book holds `len` centroids of SD, read
    // through raw pointers within those bounds.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn expanded<const SD: usize>(xt: &[[f32; LANES]], book: &Codebook) -> LaneResult {
        let x = load::<SD>(xt);
        let (c, norms, k) = (book.neg2().as_ptr(), book.norms().as_ptr(), book.len());
        let (mut best0, mut best1) = (_mm256_set1_ps(f32::INFINITY), _mm256_set1_ps(f32::INFINITY));
        let (mut idx0, mut idx1) = (_mm256_setzero_ps(), _mm256_set1_ps(1.0));
        let (mut k0, mut k1) = (_mm256_setzero_ps(), _mm256_set1_ps(1.0));
        let two = _mm256_set1_ps(2.0);
        let mut j = 0;
        while j < k {
            let mut a0 = _mm256_broadcast_ss(&*norms.add(j));
            let mut a1 = _mm256_broadcast_ss(&*norms.add(j + 1));
            let (c0, c1) = (c.add(j * SD), c.add((j + 1) * SD));
            for d in 0..SD {
                a0 = _mm256_fmadd_ps(x[d], _mm256_broadcast_ss(&*c0.add(d)), a0);
                a1 = _mm256_fmadd_ps(x[d], _mm256_broadcast_ss(&*c1.add(d)), a1);
            }
            let lt0 = _mm256_cmp_ps::<_CMP_LT_OQ>(a0, best0);
            let lt1 = _mm256_cmp_ps::<_CMP_LT_OQ>(a1, best1);
            best0 = _mm256_min_ps(a0, best0);
            best1 = _mm256_min_ps(a1, best1);
            idx0 = _mm256_blendv_ps(idx0, k0, lt0);
            idx1 = _mm256_blendv_ps(idx1, k1, lt1);
            k0 = _mm256_add_ps(k0, two);
            k1 = _mm256_add_ps(k1, two);
            j += 2;
        }
        // The odd chain wins when strictly smaller, or equal with a lower index.
        let lt = _mm256_cmp_ps::<_CMP_LT_OQ>(best1, best0);
        let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(best1, best0);
        let lower = _mm256_cmp_ps::<_CMP_LT_OQ>(idx1, idx0);
        let take1 = _mm256_or_ps(lt, _mm256_and_ps(eq, lower));
        finish(_mm256_blendv_ps(best0, best1, take1), _mm256_blendv_ps(idx0, idx1, take1))
    }

    /// Σ (x − c)² with separate multiply and add in coordinate order: bit-identical to the
    /// reference.
    // SAFETY (callers): as for `expanded`.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exact<const SD: usize>(xt: &[[f32; LANES]], book: &Codebook) -> LaneResult {
        let x = load::<SD>(xt);
        let (c, k) = (book.centroids().as_ptr(), book.len());
        let mut best = _mm256_set1_ps(f32::INFINITY);
        let mut best_idx = _mm256_setzero_ps();
        let mut kv = _mm256_setzero_ps();
        let one = _mm256_set1_ps(1.0);
        for j in 0..k {
            let cj = c.add(j * SD);
            let diff = _mm256_sub_ps(x[0], _mm256_broadcast_ss(&*cj));
            let mut acc = _mm256_mul_ps(diff, diff);
            for d in 1..SD {
                let diff = _mm256_sub_ps(x[d], _mm256_broadcast_ss(&*cj.add(d)));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(diff, diff));
            }
            let lt = _mm256_cmp_ps::<_CMP_LT_OQ>(acc, best);
            best = _mm256_min_ps(acc, best);
            best_idx = _mm256_blendv_ps(best_idx, kv, lt);
            kv = _mm256_add_ps(kv, one);
        }
        finish(best, best_idx)
    }
}
