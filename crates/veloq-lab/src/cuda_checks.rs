//! The CUDA kernels checked against the CPU path (feature `cuda`): every kernel on fresh random
//! inputs, outputs poisoned first, each against an f64 or CPU-encoder reference with the bound
//! its arithmetic implies. Run as tests (`tests/cuda_kernels.rs`, which fail without a GPU unless
//! told to skip) and before `veloq-lab bench cuda` times the same kernels.

use anyhow::{bail, Result};
use half::{bf16, f16};
use serde_json::json;

use veloq::codec::codebook::Granularity;
use veloq::codec::pack::unpack;
use veloq::codec::vecinfer::VecInferCodec;
use veloq::kernels::cuda::{
    gemv_f16, gemv_f16_many, gemv_many_fits, quantize_jobs, ragged_entry, rows_add_f16, rows_gated_f16, rows_norm_f16,
    tensor_cores_take, AttentionScratch, Coded, Convert, ConvertPart, Elem, GatedActivation, GemvEpilogue, GemvFused,
    GemvTune, Gpu, GpuAttention, GpuCodec, QuantizeJob, QuantizeLaunch, Ragged, RowMap, SplitKernel, Window, WindowMap,
    GEMV_MAX_ROWS,
};
use veloq::kernels::GemvShapes;

use crate::synthetic::{codec_of, Rng};

macro_rules! dev {
    ($e:expr) => {
        $e.map_err(|e| anyhow::anyhow!("{e:?}"))?
    };
}

/// Shapes `[rows, k]` of the row kernels' check: one row, an odd count of a model's width, a
/// chunk of SmolLM2's, and a chunk of the 8B's MLP width (longer than one pass of the grid).
const ROWS_SHAPES: [(usize, usize); 4] = [(1, 576), (37, 4096), (513, 576), (517, 14336)];

/// The row kernels of many-row steps (`rows.cu`) against f64 references on fresh random inputs,
/// outputs poisoned first: the norm to f16 and the gated activations within f16's rounding of
/// the exact value plus the f32 formula's error; the f16 added into f32 exactly as the host adds.
/// Returns the elements checked.
pub fn check_rows(gpu: &Gpu, rng: &mut Rng) -> Result<usize> {
    let st = gpu.stream();
    let mut checked = 0;
    // Half an f16 ulp of the value, the f32 arithmetic's error `rel` of `scale`, and f16's
    // subnormal spacing.
    let f16_bound = |want: f64, scale: f64, rel: f64| 2f64.powi(-11) * want.abs() * (1.0 + rel) + rel * scale + 6e-8;
    let eps32 = 2f64.powi(-24);
    for (rows, k) in ROWS_SHAPES {
        let n = rows * k;
        let x: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
        let w: Vec<f32> = (0..k).map(|_| 0.5 + rng.uniform() as f32).collect();
        let xd = dev!(st.clone_htod(&x));
        let wd = dev!(st.clone_htod(&w));
        let mut out = dev!(st.clone_htod(&vec![0x7e00u16; n]));
        rows_norm_f16(gpu, &xd.as_view(), &wd.as_view(), &mut out.as_view_mut(), rows, k, 1e-5)?;
        let got: Vec<u16> = dev!(st.clone_dtoh(&out));
        // The sum of squares: k / 256 terms a thread, then a tree of 256; the scale and two products.
        let rel = (k as f64 / 256.0 + 16.0) * eps32;
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            let scale = 1.0 / (xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / k as f64 + 1e-5).sqrt();
            for c in 0..k {
                let want = xr[c] as f64 * scale * w[c] as f64;
                let have = f16::from_bits(got[r * k + c]).to_f64();
                if have.is_nan() || (have - want).abs() > f16_bound(want, want.abs(), rel) {
                    bail!("rows_norm_f16 [{rows}, {k}] row {r} col {c}: {have} against {want}");
                }
            }
        }
        for act in [GatedActivation::Silu, GatedActivation::GeluTanh] {
            let g = f16_bits(&(0..n).map(|_| rng.normal() * 4.0).collect::<Vec<_>>());
            let u = f16_bits(&(0..n).map(|_| rng.normal() * 2.0).collect::<Vec<_>>());
            let (gd, ud) = (dev!(st.clone_htod(&g)), dev!(st.clone_htod(&u)));
            let mut out = dev!(st.clone_htod(&vec![0x7e00u16; n]));
            rows_gated_f16(gpu, &gd.as_view(), &ud.as_view(), &mut out.as_view_mut(), n, act)?;
            let got: Vec<u16> = dev!(st.clone_dtoh(&out));
            for i in 0..n {
                let (gv, uv) = (f16::from_bits(g[i]).to_f64(), f16::from_bits(u[i]).to_f64());
                let a = match act {
                    GatedActivation::Silu => gv / (1.0 + (-gv).exp()),
                    GatedActivation::GeluTanh => {
                        0.5 * gv * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (gv + 0.044715 * gv.powi(3))).tanh())
                    }
                };
                let want = a * uv;
                let have = f16::from_bits(got[i]).to_f64();
                // expf / tanhf and the division: a few f32 ulps of act(g) · up, at most |g · up|.
                if have.is_nan() || (have - want).abs() > f16_bound(want, (gv * uv).abs(), 16.0 * eps32) {
                    bail!("rows_gated_f16 {act:?} element {i}: act({gv}) · {uv} = {have} against {want}");
                }
            }
        }
        let y = f16_bits(&(0..n).map(|_| rng.normal() * 2.0).collect::<Vec<_>>());
        let yd = dev!(st.clone_htod(&y));
        let mut xs = dev!(st.clone_htod(&x));
        rows_add_f16(gpu, &mut xs.as_view_mut(), &yd.as_view(), n)?;
        let got: Vec<f32> = dev!(st.clone_dtoh(&xs));
        if let Some(i) = (0..n).find(|&i| got[i].to_bits() != (x[i] + f16::from_bits(y[i]).to_f32()).to_bits()) {
            bail!("rows_add_f16 element {i}: {} against {} + {}", got[i], x[i], f16::from_bits(y[i]));
        }
        checked += 4 * n;
    }
    println!("row kernels: {checked} elements (norm, silu, GELU, add) within their bounds");
    Ok(checked)
}

/// Part lengths of the conversion check: empty, one element, not a multiple of a block, and
/// longer than one launch's threads cover in one pass (the grid strides).
const CONVERT_LENGTHS: [usize; 4] = [0, 1, 4_097, 3_000_001];

/// The conversion kernel (`vq_convert`) copies every part of a launch, converted exactly as the
/// host rounds (`half`'s round-to-nearest-even; NaN stays NaN): f32 to f16 and bf16 and back, and
/// f16 to bf16, four parts of different lengths in one launch, on values spread over f16's and
/// bf16's whole ranges (subnormals, overflow to infinity, ties) as well as the special values.
/// Returns the elements checked.
pub fn check_convert(gpu: &Gpu, rng: &mut Rng) -> Result<usize> {
    let st = gpu.stream();
    let kernel = Convert::new(gpu)?;
    let special =
        [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, 65520.0, 6.0e-8, 1.0 + 1.0 / 2048.0];
    // Magnitudes from 2^-30 to 2^30 with random mantissas and signs, then the special values.
    let values = |n: usize, rng: &mut Rng| -> Vec<f32> {
        (0..n)
            .map(|i| match i < special.len() {
                true => special[i],
                false => {
                    let e = (rng.uniform() * 60.0 - 30.0) as i32;
                    let m = 1.0 + rng.uniform() as f32;
                    let sign = if rng.uniform() < 0.5 { -1.0 } else { 1.0 };
                    sign * m * 2f32.powi(e)
                }
            })
            .collect()
    };
    let same = |a: f32, b: f32| (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits();
    let mut checked = 0;
    // f32 → f16, f32 → bf16, and f16 → f32, bf16 → f32 of the results, each launch four parts.
    let x: Vec<Vec<f32>> = CONVERT_LENGTHS.iter().map(|&n| values(n, rng)).collect();
    let xd = x.iter().map(|v| Ok(dev!(st.clone_htod(&padded(v))))).collect::<Result<Vec<_>>>()?;
    for to in [Elem::F16, Elem::Bf16] {
        let outs = CONVERT_LENGTHS
            .iter()
            .map(|&n| Ok(dev!(st.clone_htod(&vec![0xFFFFu16; n.max(1)]))))
            .collect::<Result<Vec<_>>>()?;
        let parts: Vec<ConvertPart> = (0..x.len())
            .map(|i| ConvertPart {
                src: address(&xd[i], st),
                dst: address(&outs[i], st),
                n: x[i].len(),
                from: Elem::F32,
                to,
            })
            .collect();
        // SAFETY: every address holds at least `n` elements of its type (padded to one for n = 0).
        unsafe { kernel.launch(gpu, &parts) }?;
        let back = CONVERT_LENGTHS
            .iter()
            .map(|&n| Ok(dev!(st.clone_htod(&vec![f32::NAN; n.max(1)]))))
            .collect::<Result<Vec<_>>>()?;
        let parts: Vec<ConvertPart> = (0..x.len())
            .map(|i| ConvertPart {
                src: address(&outs[i], st),
                dst: address(&back[i], st),
                n: x[i].len(),
                from: to,
                to: Elem::F32,
            })
            .collect();
        // SAFETY: as above.
        unsafe { kernel.launch(gpu, &parts) }?;
        for i in 0..x.len() {
            let got: Vec<u16> = dev!(st.clone_dtoh(&outs[i]));
            let got_back: Vec<f32> = dev!(st.clone_dtoh(&back[i]));
            for (j, &v) in x[i].iter().enumerate() {
                let want = match to {
                    Elem::F16 => f16::from_f32(v).to_f32(),
                    _ => bf16::from_f32(v).to_f32(),
                };
                let stored = match to {
                    Elem::F16 => f16::from_bits(got[j]).to_f32(),
                    _ => bf16::from_bits(got[j]).to_f32(),
                };
                if !same(stored, want) || !same(got_back[j], want) {
                    bail!("vq_convert f32 → {to:?} of {v:e} (part {i}, element {j}): {stored:e} stored, {:e} read back, host {want:e}", got_back[j]);
                }
            }
            checked += x[i].len();
        }
    }
    // f16 → bf16 (both narrow: the f32 in between is exact), one part.
    let h: Vec<u16> = values(100_003, rng).iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let hd = dev!(st.clone_htod(&h));
    let out = dev!(st.clone_htod(&vec![0xFFFFu16; h.len()]));
    let part =
        ConvertPart { src: address(&hd, st), dst: address(&out, st), n: h.len(), from: Elem::F16, to: Elem::Bf16 };
    // SAFETY: both buffers hold `h.len()` elements of 16 bits.
    unsafe { kernel.launch(gpu, &[part]) }?;
    let got: Vec<u16> = dev!(st.clone_dtoh(&out));
    for (j, (&a, &b)) in h.iter().zip(&got).enumerate() {
        let want = bf16::from_f32(f16::from_bits(a).to_f32()).to_f32();
        if !same(bf16::from_bits(b).to_f32(), want) {
            bail!(
                "vq_convert f16 → bf16 of {:e} (element {j}): {:e}, host {want:e}",
                f16::from_bits(a).to_f32(),
                bf16::from_bits(b).to_f32()
            );
        }
    }
    Ok(checked + h.len())
}

/// `v`, or one element where it is empty (a device buffer cannot be empty).
fn padded(v: &[f32]) -> Vec<f32> {
    if v.is_empty() {
        vec![0.0]
    } else {
        v.to_vec()
    }
}

/// The device address of a buffer's first element.
fn address<T>(b: &cudarc::driver::CudaSlice<T>, st: &std::sync::Arc<cudarc::driver::CudaStream>) -> u64 {
    use cudarc::driver::DevicePtr;
    b.device_ptr(st).0
}

/// One attention configuration under test.
#[derive(Clone, Copy)]
pub struct Variant {
    /// The split kernel.
    pub kernel: SplitKernel,
    /// Threads per block of the table kernel.
    pub threads: u32,
    /// f16 value accumulation (table kernel).
    pub half: bool,
    /// The tensor-core kernel merges its splits in its last block.
    pub fused: bool,
}

impl Variant {
    /// The attention object of this variant for codecs `kc`, `vc` and `hq` query heads.
    pub fn build(self, gpu: &Gpu, kc: &VecInferCodec, vc: &VecInferCodec, hq: usize) -> Result<GpuAttention> {
        let att = GpuAttention::new(GpuCodec::upload(gpu, kc)?, GpuCodec::upload(gpu, vc)?, hq)?
            .with_split_kernel(self.kernel)?;
        Ok(att.with_threads(self.threads)?.with_half_values(self.half)?.with_fused_merge(self.fused))
    }

    /// Label and the relative error it must stay within against the f64 reference: f16 operands
    /// on tensor cores (the bound), f32 (or f16 partials) on CUDA cores.
    pub fn label(self) -> (String, f64) {
        match self.kernel {
            SplitKernel::TensorCores => {
                (format!("{}{}", self.kernel.name(), if self.fused { "" } else { " +merge" }), 1e-2)
            }
            SplitKernel::Tables => {
                (format!("{} {} {}", self.kernel.name(), self.threads, if self.half { "f16" } else { "f32" }), 1e-3)
            }
        }
    }
}

/// f16 bit patterns of `x`.
pub fn f16_bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| f16::from_f32(v).to_bits()).collect()
}

/// Relative squared error of `y` against `x`.
pub fn rel_mse(x: &[f32], y: &[f32]) -> f64 {
    let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    e / x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>()
}

/// (n, k) of the GEMV checks: the 8B's k/v projection, ragged tails of warps and blocks, a
/// short row.
const GEMV_SHAPES: [(usize, usize); 4] = [(1024, 4096), (4103, 136), (77, 4096), (14337, 512)];

/// Largest error of a GEMV relative to its outputs' rms: f32 rounding over k terms. Tensor cores
/// add their products into the f32 accumulator without rounding to nearest: up to 4.6e-5 seen
/// on an H200, still a tenth of what rounding the activations to f16 costs (the reference has
/// them rounded).
fn tolerance(tune: GemvTune) -> f64 {
    if tune.tensor_cores {
        1e-4
    } else {
        1e-5
    }
}

/// The largest |y − want| over want's rms; NaN when an output is NaN (never written: the
/// outputs are poisoned with NaN first).
fn max_err_over_rms(y: &[f32], want: &[f64]) -> f64 {
    max_excess_over_rms(y, want, &vec![0.0; want.len()])
}

/// [`max_err_over_rms`] after each output's own `slack` (an error the maths allows that the
/// outputs' rms does not measure).
fn max_excess_over_rms(y: &[f32], want: &[f64], slack: &[f64]) -> f64 {
    let excess = y.iter().zip(want).zip(slack).map(|((a, b), s)| ((*a as f64 - b).abs() - s).max(0.0));
    let worst = excess.fold(0.0f64, |m, e| if e.is_nan() || m.is_nan() { f64::NAN } else { m.max(e) });
    worst / rms(want)
}

/// Root mean square of `x`.
fn rms(x: &[f64]) -> f64 {
    (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64).sqrt()
}

/// How a GEMV check adds a residual stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Res {
    No,
    Operand,
    InPlace,
}

/// veloq's f16 GEMV against an f64 host reference on fresh random weights and activations, both
/// kernels at every row count (their default shapes and one odd shape each): the largest error
/// relative to the outputs' rms must stay at f32 rounding. The tensor-core kernel rounds the
/// activations to f16 by contract, so its reference takes them rounded; where it normalises them
/// first, each output may also move by what a one-ulp flip of those roundings allows, and a gated
/// output by what its two products' own allowed errors become through the product.
pub fn check_gemv(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<serde_json::Value>> {
    let st = gpu.stream();
    let tunes = [
        GemvTune::for_rows(1, &GemvShapes::default()),
        GemvTune { tensor_cores: false, rows: 3, unroll: 4, threads: 96 },
        GemvTune::for_rows(2, &GemvShapes::default()),
        GemvTune { tensor_cores: true, rows: 24, unroll: 3, threads: 64 },
    ];
    let mut out = Vec::new();
    for b in 1..=GEMV_MAX_ROWS {
        for &(n, k) in &GEMV_SHAPES {
            let w = f16_bits(&rng.rows(n, k));
            let x = rng.rows(b, k);
            let (wd, xd) = (dev!(st.clone_htod(&w)), dev!(st.clone_htod(&x)));
            let wf: Vec<f64> = w.iter().map(|&h| f16::from_bits(h).to_f64()).collect();
            for tune in tunes {
                let xr: Vec<f64> = if tune.tensor_cores {
                    x.iter().map(|&v| f16::from_f32(v).to_f64()).collect()
                } else {
                    x.iter().map(|&v| v as f64).collect()
                };
                let mut yd = dev!(st.clone_htod(&vec![f32::NAN; b * n]));
                gemv_f16(gpu, &wd.as_view(), &xd.as_view(), &mut yd.as_view_mut(), b, n, k, tune)?;
                let y = dev!(st.clone_dtoh(&yd));
                let want: Vec<f64> = (0..b * n)
                    .map(|i| {
                        let (bi, ni) = (i / n, i % n);
                        (0..k).map(|j| wf[ni * k + j] * xr[bi * k + j]).sum()
                    })
                    .collect();
                let err = max_err_over_rms(&y, &want);
                if err.is_nan() || err > tolerance(tune) {
                    bail!("f16 GEMV {tune:?}, b {b}, n {n}, k {k}: max error {err:.2e} of the outputs' rms");
                }
                out.push(json!({"check": "gemv_f16", "kernel": tune.kernel_name(), "rows": tune.rows,
                    "unroll": tune.unroll, "threads": tune.threads, "b": b, "n": n, "k": k, "max_err_over_rms": err}));
            }
        }
    }
    // Several matrices in one launch, with the operations a decode layer fuses into them: q, k, v
    // side by side (norm first, RoPE after), the gated MLP forms (norm first), a residual add.
    let cases = [
        (vec![240, 48, 77], 136, GemvEpilogue::Concat, true, Res::No, Some(16)),
        (vec![240, 48, 77], 136, GemvEpilogue::Concat, false, Res::No, None),
        (vec![1000, 1000], 512, GemvEpilogue::Silu, true, Res::No, None),
        (vec![77, 77], 4096, GemvEpilogue::GeluTanh, false, Res::No, None),
        (vec![1001], 1024, GemvEpilogue::Concat, false, Res::Operand, None),
        (vec![4096], 4096, GemvEpilogue::Concat, false, Res::InPlace, None),
    ];
    for b in [1, 3, GEMV_MAX_ROWS] {
        for (rows, k, epilogue, norm, res, rope) in &cases {
            let (k, epilogue) = (*k, *epilogue);
            let ws: Vec<Vec<u16>> = rows.iter().map(|&n| f16_bits(&rng.rows(n, k))).collect();
            let x = rng.rows(b, k);
            let gains: Vec<f32> = rng.rows(1, k).iter().map(|v| 1.0 + 0.1 * v).collect();
            let n_out = if epilogue == GemvEpilogue::Concat { rows.iter().sum() } else { rows[0] };
            let residual = rng.rows(b, n_out);
            let half = rope.unwrap_or(2) / 2;
            let angles = rng.rows(b, half);
            let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
            let wd = ws.iter().map(|w| Ok(dev!(st.clone_htod(w)))).collect::<Result<Vec<_>>>()?;
            let [xd, gd, rd, cd, sd] = [&x, &gains, &residual, &cos, &sin].map(|v| st.clone_htod(v));
            let [xd, gd, rd, cd, sd] = [dev!(xd), dev!(gd), dev!(rd), dev!(cd), dev!(sd)];
            let eps = 1e-5f32;
            // The activations the products see: normalised (then rounded to f16 on tensor cores).
            let exact: Vec<f64> = x
                .chunks(k)
                .flat_map(|row| {
                    let inv = if *norm {
                        1.0 / (row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / k as f64 + eps as f64).sqrt()
                    } else {
                        1.0
                    };
                    row.iter().zip(&gains).map(move |(&v, &g)| if *norm { v as f64 * inv * g as f64 } else { v as f64 })
                })
                .collect();
            for tune in tunes {
                if !gemv_many_fits(rows, epilogue, *rope, tune) {
                    continue;
                }
                let xr: Vec<f64> =
                    exact.iter().map(|&v| if tune.tensor_cores { f16::from_f64(v).to_f64() } else { v }).collect();
                let dot = |w: &[u16], bi: usize, ni: usize| -> f64 {
                    (0..k).map(|j| f16::from_bits(w[ni * k + j]).to_f64() * xr[bi * k + j]).sum()
                };
                // The kernel normalises in f32 and then rounds to f16: an activation within the
                // f32 normalisation's error (a sum of k squares, a reciprocal square root, two
                // products: under 2⁻¹⁹ of it) of an f16 tie may round to the neighbour the f64
                // reference does not take. Those activations and how far the two roundings lie
                // apart, per row; every other activation rounds alike.
                let near = 2f64.powi(-19);
                let flips: Vec<f64> = exact
                    .iter()
                    .zip(&xr)
                    .map(|(&v, &r)| {
                        let (a, b) =
                            (f16::from_f64(v * (1.0 - near)).to_f64(), f16::from_f64(v * (1.0 + near)).to_f64());
                        match *norm && tune.tensor_cores && a != b {
                            true => (r - a).abs().max((r - b).abs()),
                            false => 0.0,
                        }
                    })
                    .collect();
                let ulp_sum = |w: &[u16], bi: usize, ni: usize| -> f64 {
                    (0..k).map(|j| (f16::from_bits(w[ni * k + j]).to_f64() * flips[bi * k + j]).abs()).sum()
                };
                // Each output and its slack for those flips: a product moves by at most
                // Σ|w|·(its flips) (RoPE mixes two with weights of modulus ≤ 1); an activation
                // times its gate by the activation's slope (under 1.13 for SiLU and tanh-GELU)
                // times the first's move times the gate, plus the activation (≤ |g|) times the
                // gate's move.
                let (mut want, slack): (Vec<f64>, Vec<f64>) = match epilogue {
                    // Matrix after matrix, each [b, n], RoPE on the first two's row pairs.
                    GemvEpilogue::Concat => ws
                        .iter()
                        .zip(rows)
                        .enumerate()
                        .flat_map(|(m, (w, &n))| {
                            let (dot, ulp_sum) = (&dot, &ulp_sum);
                            let (cos, sin) = (&cos, &sin);
                            (0..b).flat_map(move |bi| {
                                (0..n).map(move |ni| match rope {
                                    Some(d) if m < 2 => {
                                        let (p, even) = ((ni % d) / 2, ni - ni % 2);
                                        let (x0, x1) = (dot(w, bi, even), dot(w, bi, even + 1));
                                        let (c, s) = (cos[bi * half + p] as f64, sin[bi * half + p] as f64);
                                        let y = if ni % 2 == 0 { x0 * c - x1 * s } else { x0 * s + x1 * c };
                                        (y, ulp_sum(w, bi, even) + ulp_sum(w, bi, even + 1))
                                    }
                                    _ => (dot(w, bi, ni), ulp_sum(w, bi, ni)),
                                })
                            })
                        })
                        .unzip(),
                    // A gated output multiplies two products, each of which may be off by what
                    // the plain products above are allowed (the tolerance times its rms): that
                    // error, carried through the product, is slack too.
                    _ => {
                        let (gs, us): (Vec<f64>, Vec<f64>) = (0..b * rows[0])
                            .map(|i| (dot(&ws[0], i / rows[0], i % rows[0]), dot(&ws[1], i / rows[0], i % rows[0])))
                            .unzip();
                        let (eg, eu) = (tolerance(tune) * rms(&gs), tolerance(tune) * rms(&us));
                        gs.iter()
                            .zip(&us)
                            .enumerate()
                            .map(|(i, (&g, &u))| {
                                let (bi, ni) = (i / rows[0], i % rows[0]);
                                let (sg, su) = (ulp_sum(&ws[0], bi, ni) + eg, ulp_sum(&ws[1], bi, ni) + eu);
                                let act = if epilogue == GemvEpilogue::Silu {
                                    g / (1.0 + (-g).exp())
                                } else {
                                    0.5 * g * (1.0 + (0.797_884_560_8 * (g + 0.044715 * g * g * g)).tanh())
                                };
                                (act * u, 1.13 * sg * (u.abs() + su) + (g.abs() + sg) * su)
                            })
                            .unzip()
                    }
                };
                if *res != Res::No {
                    want.iter_mut().zip(&residual).for_each(|(w, r)| *w += *r as f64);
                }
                // Outputs poisoned first, or holding the stream they are added to.
                let mut yd = dev!(st.clone_htod(&if *res == Res::InPlace {
                    residual.clone()
                } else {
                    vec![f32::NAN; want.len()]
                }));
                let views: Vec<_> = wd.iter().map(|w| w.as_view()).collect();
                let args: Vec<_> = views.iter().zip(rows).map(|(v, &n)| (v, n)).collect();
                let (gv, rv, cv, sv) = (gd.as_view(), rd.as_view(), cd.as_view(), sd.as_view());
                let fused = GemvFused {
                    norm: norm.then_some((&gv, eps)),
                    residual: (*res == Res::Operand).then_some(&rv),
                    accumulate: *res == Res::InPlace,
                    rope: rope.map(|d| (&cv, &sv, d)),
                };
                gemv_f16_many(gpu, &args, &xd.as_view(), &mut yd.as_view_mut(), b, k, epilogue, fused, tune)?;
                let y = dev!(st.clone_dtoh(&yd));
                let err = max_excess_over_rms(&y, &want, &slack);
                let res_name = match res {
                    Res::No => "",
                    Res::Operand => " +residual",
                    Res::InPlace => " +=",
                };
                let what = format!(
                    "{epilogue:?}{}{res_name}{}",
                    if *norm { " +norm" } else { "" },
                    if rope.is_some() { " +rope" } else { "" }
                );
                if err.is_nan() || err > tolerance(tune) {
                    bail!("f16 GEMV {what} {tune:?}, b {b}, rows {rows:?}, k {k}: max error beyond the f16 flips' slack {err:.2e} of the outputs' rms");
                }
                out.push(json!({"check": "gemv_f16_many", "kernel": tune.kernel_name(), "form": what,
                    "rows": tune.rows, "unroll": tune.unroll, "threads": tune.threads, "b": b, "matrices": rows, "k": k,
                    "max_err_over_rms": err}));
            }
        }
    }
    for kernel in ["f16_gemv", "f16_gemv_mma"] {
        let of = out.iter().filter(|c| c["kernel"] == kernel);
        let worst = of.clone().filter_map(|c| c["max_err_over_rms"].as_f64()).fold(0.0, f64::max);
        println!(
            "{kernel}: {} products (b 1..={GEMV_MAX_ROWS}), largest error {worst:.2e} of the outputs' rms",
            of.count()
        );
    }
    Ok(out)
}

/// GPU codes vs the CPU encoder on one shape: code agreement and reconstruction error. With
/// `pair`, a key and a value codec of the shape (different centering and smoothing) code the same
/// rows in one launch, as a cache's flush does, and each is compared with its own CPU encoder.
pub fn check_quantize(
    gpu: &Gpu,
    rng: &mut Rng,
    (s, d, h, sd, bits, g): (usize, usize, usize, usize, u32, Granularity),
    pair: bool,
) -> Result<serde_json::Value> {
    let codecs = if pair {
        vec![codec_of(rng, h, d, (sd, bits), g, true)?, codec_of(rng, h, d, (sd, bits), g, false)?]
    } else {
        vec![codec_of(rng, h, d, (sd, bits), g, true)?]
    };
    let gcs = codecs.iter().map(|c| GpuCodec::upload(gpu, c)).collect::<veloq::Result<Vec<_>>>()?;
    let x = rng.rows(s * h, d);
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    let st = gpu.stream();
    let xd = dev!(st.clone_htod(&f16_bits(&x)));
    let mut outs = gcs
        .iter()
        .map(|gc| Ok(dev!(st.clone_htod(&vec![0xABu8; gc.code_bytes(s * h)]))))
        .collect::<Result<Vec<_>>>()?;
    let run = |outs: &mut [cudarc::driver::CudaSlice<u8>], launch: QuantizeLaunch| -> Result<usize> {
        let x = xd.as_view();
        let mut views: Vec<_> = outs.iter_mut().map(|o| o.as_view_mut()).collect();
        let mut jobs: Vec<_> =
            gcs.iter().zip(&mut views).map(|(codec, out)| QuantizeJob { codec, x: &x, out }).collect();
        Ok(quantize_jobs(gpu, &mut jobs, h, RowMap::tokens(s, h), launch)?)
    };
    let launches = run(&mut outs, QuantizeLaunch::default())?;
    // With candidate lists (sub-vectors of 2), the full scan must give the same bytes.
    let grid = gcs[0].has_grid();
    if grid {
        let mut full = gcs
            .iter()
            .map(|gc| Ok(dev!(st.clone_htod(&vec![0x5Au8; gc.code_bytes(s * h)]))))
            .collect::<Result<Vec<_>>>()?;
        run(&mut full, QuantizeLaunch { grid: Some(false), ..QuantizeLaunch::default() })?;
        for (a, b) in outs.iter().zip(&full) {
            if dev!(st.clone_dtoh(a)) != dev!(st.clone_dtoh(b)) {
                bail!("quantize S={s} D={d} H={h} sd={sd}: codes through the grid's lists differ from the full scan's");
            }
        }
    }
    let m = s * h * d / sd;
    let xf: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
    let (mut differ, mut worst) = (0, 0.0f64);
    let mut mse = Vec::new();
    for (c, out) in codecs.iter().zip(&outs) {
        let want = c.encode_vec(&xh)?;
        let got: Vec<u8> = dev!(st.clone_dtoh(out));
        let (mut a, mut b) = (vec![0u16; m], vec![0u16; m]);
        unpack(&want, bits, &mut a)?;
        unpack(&got, bits, &mut b)?;
        differ += a.iter().zip(&b).filter(|(p, q)| p != q).count();
        let (mut ya, mut yb) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        c.decode(&want, &mut ya)?;
        c.decode(&got, &mut yb)?;
        let (ea, eb) = (rel_mse(&xf, &ya), rel_mse(&xf, &yb));
        worst = worst.max((eb - ea).abs() / ea);
        mse.push((ea, eb));
    }
    let ok = (differ as f64) <= 1e-3 * (m * codecs.len()) as f64 && worst <= 0.01;
    let what = if pair { format!("keys+values, {launches} launch") } else { "keys".into() };
    let what = if grid { format!("{what}, grid = full scan") } else { what };
    let shown: Vec<String> = mse.iter().map(|(a, b)| format!("{a:.5}/{b:.5}")).collect();
    println!(
        "quantize S={s:<5} D={d:<3} H={h} sd={sd} {bits:>2}b {:<12} {what}: codes differing {differ}/{}, rel MSE cpu/gpu {} {}",
        g.name(),
        m * codecs.len(),
        shown.join(" "),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        bail!("quantize mismatch beyond near-ties");
    }
    Ok(json!({"S": s, "D": d, "H": h, "sub_dim": sd, "bits": bits, "granularity": g.name(), "pair": pair,
        "launches": launches, "grid_equals_full_scan": grid, "codes": m * codecs.len(), "differing": differ, "rel_mse_cpu_gpu": mse}))
}

/// Codes `[B][S][H][M]` from the CPU encoder, reordered to the kernel's `[B][H][S][M]`.
fn head_major(codes: &[u8], b: usize, s: usize, h: usize, m: usize) -> Vec<u8> {
    let mut out = vec![0u8; codes.len()];
    for bi in 0..b {
        for t in 0..s {
            for hi in 0..h {
                let src = ((bi * s + t) * h + hi) * m;
                let dst = ((bi * h + hi) * s + t) * m;
                out[dst..dst + m].copy_from_slice(&codes[src..src + m]);
            }
        }
    }
    out
}

/// Quantize checks (S, D, H, sub_dim, bits, books): many rows (one thread per search) and few
/// (a flush: searches spread over 8–32 threads), every bit width and both book granularities;
/// sub-vectors of 2 (the default's format) with candidate lists (one book) and without.
pub const QUANTIZE_CHECKS: [(usize, usize, usize, usize, u32, Granularity); 14] = [
    (1001, 128, 8, 2, 8, Granularity::PerLayer),
    (3, 128, 8, 2, 8, Granularity::PerLayer),
    (129, 64, 3, 2, 8, Granularity::PerLayer),
    (257, 128, 2, 2, 8, Granularity::PerSubspace),
    (1001, 64, 4, 4, 8, Granularity::PerLayer),
    (777, 128, 8, 8, 8, Granularity::PerLayer),
    (513, 256, 4, 4, 8, Granularity::PerLayer),
    (301, 128, 8, 8, 12, Granularity::PerLayer),
    (257, 128, 2, 4, 6, Granularity::PerSubspace),
    (8, 128, 8, 4, 8, Granularity::PerLayer),
    (1, 64, 4, 4, 6, Granularity::PerLayer),
    (3, 256, 1, 4, 8, Granularity::PerLayer),
    (5, 128, 8, 8, 12, Granularity::PerLayer),
    (2, 128, 2, 4, 6, Granularity::PerSubspace),
];

/// Keys and values in one launch: a flush, and many rows.
pub const QUANTIZE_PAIR_CHECKS: [(usize, usize, usize, usize, u32, Granularity); 4] = [
    (8, 128, 8, 4, 8, Granularity::PerLayer),
    (611, 64, 4, 4, 8, Granularity::PerLayer),
    (8, 128, 8, 2, 8, Granularity::PerLayer),
    (611, 128, 8, 2, 8, Granularity::PerLayer),
];

/// Attention checks: GQA 1–4 and 8, D 64/128/256, odd and empty code counts, windows 0–64 (the
/// merge scores window rows 16 at a time: full, partial and absent second halves and chunks).
pub const ATTENTION_CHECKS: [AttnCase; 21] = [
    AttnCase { b: 2, hq: 8, hkv: 2, d: 64, s: 1000, w: 7, sd: (4, 4) },
    AttnCase { b: 1, hq: 32, hkv: 8, d: 128, s: 4097, w: 31, sd: (4, 4) },
    AttnCase { b: 3, hq: 4, hkv: 4, d: 256, s: 333, w: 0, sd: (4, 4) },
    AttnCase { b: 1, hq: 12, hkv: 4, d: 128, s: 0, w: 20, sd: (4, 4) },
    AttnCase { b: 2, hq: 9, hkv: 3, d: 64, s: 777, w: 20, sd: (4, 4) },
    AttnCase { b: 2, hq: 32, hkv: 8, d: 128, s: 20011, w: 16, sd: (4, 4) },
    AttnCase { b: 1, hq: 8, hkv: 1, d: 256, s: 5, w: 3, sd: (4, 4) },
    AttnCase { b: 2, hq: 16, hkv: 2, d: 128, s: 17, w: 0, sd: (4, 4) },
    AttnCase { b: 1, hq: 32, hkv: 8, d: 128, s: 131071, w: 24, sd: (4, 4) },
    // The 4-bit default (sub-vectors of 2) and the mixed formats (K4V2 = keys 2, values 4).
    AttnCase { b: 2, hq: 9, hkv: 3, d: 64, s: 777, w: 20, sd: (2, 2) },
    AttnCase { b: 1, hq: 32, hkv: 8, d: 128, s: 20011, w: 16, sd: (2, 2) },
    AttnCase { b: 3, hq: 4, hkv: 4, d: 256, s: 333, w: 0, sd: (2, 2) },
    AttnCase { b: 1, hq: 8, hkv: 1, d: 256, s: 5, w: 3, sd: (2, 4) },
    AttnCase { b: 2, hq: 32, hkv: 8, d: 128, s: 4097, w: 31, sd: (2, 4) },
    AttnCase { b: 2, hq: 16, hkv: 2, d: 128, s: 17, w: 0, sd: (4, 2) },
    AttnCase { b: 1, hq: 12, hkv: 4, d: 128, s: 0, w: 20, sd: (2, 2) },
    AttnCase { b: 1, hq: 32, hkv: 8, d: 128, s: 131071, w: 24, sd: (2, 2) },
    // Windows past 32 rows (the merge's second chunk of scores).
    AttnCase { b: 2, hq: 32, hkv: 8, d: 128, s: 3001, w: 41, sd: (2, 2) },
    AttnCase { b: 1, hq: 9, hkv: 3, d: 64, s: 500, w: 64, sd: (4, 4) },
    AttnCase { b: 1, hq: 12, hkv: 4, d: 128, s: 0, w: 64, sd: (2, 2) },
    AttnCase { b: 1, hq: 8, hkv: 1, d: 256, s: 77, w: 33, sd: (2, 4) },
];

/// Ragged decode checks: (q heads, kv heads, head_dim, key/value sub_dims) — SmolLM2's and the 8B
/// geometry's heads at the default's format, 2-bit codes, and 1-bit codes with 12 query heads on
/// one kv head (lookup tables only).
pub const RAGGED_CHECKS: [(usize, usize, usize, (usize, usize)); 4] =
    [(9, 3, 64, (2, 2)), (32, 8, 128, (2, 2)), (32, 8, 128, (4, 4)), (12, 1, 64, (8, 8))];

#[derive(Clone, Copy)]
/// One attention check's geometry.
pub struct AttnCase {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads.
    pub hkv: usize,
    /// Head dimension.
    pub d: usize,
    /// Coded positions.
    pub s: usize,
    /// f16 window rows.
    pub w: usize,
    /// Key and value sub_dims (4: 2 bits per element, 2: 4 bits).
    pub sd: (usize, usize),
}

/// GPU attention over codes + window vs an f64 reference over the CPU-decoded keys and values.
pub fn check_attention(gpu: &Gpu, rng: &mut Rng, c: AttnCase, v: Variant) -> Result<serde_json::Value> {
    let AttnCase { b, hq, hkv, d, s, w, sd } = c;
    let (kc, vc) = (
        codec_of(rng, hkv, d, (sd.0, 8), Granularity::PerLayer, true)?,
        codec_of(rng, hkv, d, (sd.1, 8), Granularity::PerLayer, false)?,
    );
    let att = v.build(gpu, &kc, &vc, hq)?;
    let (label, bound) = v.label();
    let (mk, mv) = (d / sd.0, d / sd.1);
    let keys = rng.rows(b * s * hkv, d);
    let values = rng.rows(b * s * hkv, d);
    let kcodes = if s > 0 { kc.encode_vec(&keys)? } else { Vec::new() };
    let vcodes = if s > 0 { vc.encode_vec(&values)? } else { Vec::new() };
    let (mut kd, mut vd) = (vec![0.0f32; keys.len()], vec![0.0f32; values.len()]);
    if s > 0 {
        kc.decode(&kcodes, &mut kd)?;
        vc.decode(&vcodes, &mut vd)?;
    }
    let wk: Vec<f32> = rng.rows(b * hkv * w, d).iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let wv: Vec<f32> = rng.rows(b * hkv * w, d).iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let q = rng.rows(b * hq, d);
    let scale = 1.0 / (d as f32).sqrt();
    // Reference in f64: keys token-major [B][S][H][D], window [B][H][W][D].
    let mut want = vec![0.0f64; b * hq * d];
    for bi in 0..b {
        for qh in 0..hq {
            let h = qh / (hq / hkv);
            let qv = &q[(bi * hq + qh) * d..][..d];
            let krow = |t: usize| -> &[f32] {
                if t < s {
                    &kd[((bi * s + t) * hkv + h) * d..][..d]
                } else {
                    &wk[((bi * hkv + h) * w + t - s) * d..][..d]
                }
            };
            let vrow = |t: usize| -> &[f32] {
                if t < s {
                    &vd[((bi * s + t) * hkv + h) * d..][..d]
                } else {
                    &wv[((bi * hkv + h) * w + t - s) * d..][..d]
                }
            };
            let sc: Vec<f64> = (0..s + w)
                .map(|t| krow(t).iter().zip(qv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64)
                .collect();
            let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            let o = &mut want[(bi * hq + qh) * d..][..d];
            for (t, p) in e.iter().enumerate() {
                for (oi, vi) in o.iter_mut().zip(vrow(t)) {
                    *oi += p / z * *vi as f64;
                }
            }
        }
    }
    let st = gpu.stream();
    let nz = |v: Vec<u8>| if v.is_empty() { vec![0u8; 16] } else { v };
    let kcd = dev!(st.clone_htod(&nz(head_major(&kcodes, b, s, hkv, mk))));
    let vcd = dev!(st.clone_htod(&nz(head_major(&vcodes, b, s, hkv, mv))));
    let wkd = dev!(st.clone_htod(&if w > 0 { f16_bits(&wk) } else { vec![0u16; 1] }));
    let wvd = dev!(st.clone_htod(&if w > 0 { f16_bits(&wv) } else { vec![0u16; 1] }));
    let qd = dev!(st.clone_htod(&q));
    let mut out = dev!(st.clone_htod(&vec![f32::NAN; b * hq * d]));
    let mut scratch = AttentionScratch::new(gpu, b, hq, d, att.splits(gpu, b, s.max(1)))?;
    att.attend(gpu, &qd, &kcd, &vcd, b, s, &wkd, &wvd, w, scale, &mut scratch, &mut out)?;
    let got: Vec<f32> = dev!(st.clone_dtoh(&out));
    let err: f64 = got.iter().zip(&want).map(|(g, w)| (*g as f64 - w).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    let rel = err / norm;
    let ok = rel.is_finite() && rel < bound;
    println!(
        "attention B={b} Hq={hq} Hkv={hkv} D={d} S={s:<5} W={w:<2} sd {}/{} {label}: rel err {rel:.2e} (bound {bound:.0e}) {}",
        sd.0,
        sd.1,
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        bail!("attention mismatch");
    }
    Ok(
        json!({"B": b, "Hq": hq, "Hkv": hkv, "D": d, "S": s, "W": w, "sub_dims": [sd.0, sd.1], "kernel": label, "rel_err": rel, "bound": bound}),
    )
}

/// A ragged decode (`attend_ragged`) against one call per sequence (`attend_cache`, checked
/// against f64 above) with the same kernels, on the same cache of 4 slots: three sequences at
/// different coded lengths (one with nothing coded; with `coded` false, none has codes: the merge
/// alone), sinks and ring states, their queries at shuffled rows. The two differ only by where
/// the splits fall (rounding), so the bound is 1e-4 relative.
#[allow(clippy::too_many_arguments)]
pub fn check_ragged(
    gpu: &Gpu,
    rng: &mut Rng,
    hq: usize,
    hkv: usize,
    d: usize,
    sd: (usize, usize),
    v: Variant,
    coded: bool,
) -> Result<serde_json::Value> {
    let (slots, stride, w, sink_cap, ring_cap) = (4usize, 300usize, 24usize, 4usize, 20usize);
    let (kc, vc) = (
        codec_of(rng, hkv, d, (sd.0, 8), Granularity::PerLayer, true)?,
        codec_of(rng, hkv, d, (sd.1, 8), Granularity::PerLayer, false)?,
    );
    let att = v.build(gpu, &kc, &vc, hq)?;
    let (mk, mv) = (d / sd.0, d / sd.1);
    let kcodes = head_major(&kc.encode_vec(&rng.rows(slots * stride * hkv, d))?, slots, stride, hkv, mk);
    let vcodes = head_major(&vc.encode_vec(&rng.rows(slots * stride * hkv, d))?, slots, stride, hkv, mv);
    let wk = f16_bits(&rng.rows(slots * hkv * w, d));
    let wv = f16_bits(&rng.rows(slots * hkv * w, d));
    // (slot, query row, coded, n_sink, ring head, ring len)
    let mut seqs = [(2usize, 0usize, 300usize, 4usize, 5usize, 20usize), (0, 2, 37, 2, 0, 7), (3, 1, 0, 4, 19, 3)];
    if !coded {
        seqs.iter_mut().for_each(|s| s.2 = 0);
    }
    let tokens = seqs.len();
    let q = rng.rows(tokens * hq, d);
    let scale = 1.0 / (d as f32).sqrt();
    let map = |n_sink: usize, head: usize, len: usize| WindowMap {
        n_sink: n_sink as i32,
        sink_cap: sink_cap as i32,
        ring_head: head as i32,
        ring_len: len as i32,
        ring_cap: ring_cap as i32,
    };
    let st = gpu.stream();
    let (kcd, vcd) = (dev!(st.clone_htod(&kcodes)), dev!(st.clone_htod(&vcodes)));
    let (wkd, wvd, qd) = (dev!(st.clone_htod(&wk)), dev!(st.clone_htod(&wv)), dev!(st.clone_htod(&q)));
    let host: Vec<i32> = seqs
        .iter()
        .flat_map(|&(slot, row, len, n_sink, head, ring)| ragged_entry(slot, row, len, map(n_sink, head, ring)))
        .collect();
    let table = dev!(st.clone_htod(&host));
    let longest = seqs.iter().map(|s| s.2).max().unwrap_or(0);
    let mut got = dev!(st.clone_htod(&vec![f32::NAN; tokens * hq * d]));
    let mut scratch = AttentionScratch::new(gpu, tokens, hq, d, att.splits(gpu, tokens, longest))?;
    let codes = Coded { keys: kcd.as_view(), values: vcd.as_view(), len: longest, stride };
    let window =
        Window { keys: wkd.as_view(), values: wvd.as_view(), rows: w, map: WindowMap::all(w), just_written: false };
    let ragged = Ragged { table: table.as_view(), host: &host };
    let launches =
        att.attend_ragged(gpu, &qd.as_view(), &codes, &window, &ragged, scale, &mut scratch, &mut got.as_view_mut())?;
    let got: Vec<f32> = dev!(st.clone_dtoh(&got));
    let mut want = vec![f32::NAN; tokens * hq * d];
    for &(slot, row, len, n_sink, head, ring) in &seqs {
        let codes = Coded {
            keys: kcd.slice(slot * hkv * stride * mk..),
            values: vcd.slice(slot * hkv * stride * mv..),
            len,
            stride,
        };
        let window = Window {
            keys: wkd.slice(slot * hkv * w * d..),
            values: wvd.slice(slot * hkv * w * d..),
            rows: w,
            map: map(n_sink, head, ring),
            just_written: false,
        };
        let qs = qd.slice(row * hq * d..(row + 1) * hq * d);
        let mut one = dev!(st.clone_htod(&vec![f32::NAN; hq * d]));
        let mut scratch = AttentionScratch::new(gpu, 1, hq, d, att.splits(gpu, 1, len.max(1)))?;
        att.attend_cache(gpu, &qs, 1, &codes, &window, scale, &mut scratch, &mut one.as_view_mut())?;
        want[row * hq * d..(row + 1) * hq * d].copy_from_slice(&dev!(st.clone_dtoh(&one)));
    }
    let rel = rel_mse(&got, &want).sqrt();
    // One uniform batch's launches: the merge alone with nothing coded, else the split kernel
    // and, unless it merges in its last block, the merge.
    let fused = v.kernel == SplitKernel::TensorCores && v.fused;
    let expected = if !coded || fused { 1 } else { 2 };
    let ok = rel.is_finite() && rel < 1e-4 && launches == expected;
    let (label, _) = v.label();
    println!(
        "ragged decode Hq={hq} Hkv={hkv} D={d} sd {}/{} {label}{}: 3 sequences in {launches} launch(es) (want {expected}) vs one call each, rel err {rel:.2e} (bound 1e-4) {}",
        sd.0,
        sd.1,
        if coded { "" } else { ", nothing coded" },
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        bail!("ragged decode mismatch");
    }
    Ok(
        json!({"check": "ragged", "Hq": hq, "Hkv": hkv, "D": d, "sub_dims": [sd.0, sd.1], "kernel": label, "coded": coded, "launches": launches, "rel_err": rel}),
    )
}

/// Every check: quantize (single codecs and key/value pairs), the GEMV forms, and attention for
/// each variant (the tensor-core kernel only where a kv head's group fits it). Returns what each
/// measured; the first failure is the error.
pub fn all(gpu: &Gpu, rng: &mut Rng, variants: &[Variant]) -> Result<Vec<serde_json::Value>> {
    let mut checks = Vec::new();
    for &shape in &QUANTIZE_CHECKS {
        checks.push(check_quantize(gpu, rng, shape, false)?);
    }
    for &shape in &QUANTIZE_PAIR_CHECKS {
        checks.push(check_quantize(gpu, rng, shape, true)?);
    }
    checks.extend(check_gemv(gpu, rng)?);
    checks.push(json!({"check": "convert", "elements": check_convert(gpu, rng)?, "exact": true}));
    checks.extend(attention(gpu, rng, variants)?);
    Ok(checks)
}

/// The attention checks alone: every shape for each variant, then the ragged batches.
pub fn attention(gpu: &Gpu, rng: &mut Rng, variants: &[Variant]) -> Result<Vec<serde_json::Value>> {
    let mut checks = attention_shapes(gpu, rng, variants)?;
    checks.extend(ragged_batches(gpu, rng, variants)?);
    Ok(checks)
}

/// Whether a variant's split kernel takes a geometry: lookup tables every one the checks use,
/// tensor cores those [`tensor_cores_take`] names.
fn takes(v: &Variant, hq: usize, hkv: usize, d: usize, sd: (usize, usize)) -> bool {
    v.kernel == SplitKernel::Tables || tensor_cores_take(sd, d, hq / hkv)
}

/// Every shape of [`ATTENTION_CHECKS`] for each variant that takes it, against f64.
pub fn attention_shapes(gpu: &Gpu, rng: &mut Rng, variants: &[Variant]) -> Result<Vec<serde_json::Value>> {
    let mut checks = Vec::new();
    for &c in &ATTENTION_CHECKS {
        for v in variants.iter().filter(|v| takes(v, c.hq, c.hkv, c.d, c.sd)) {
            checks.push(check_attention(gpu, rng, c, *v)?);
        }
    }
    Ok(checks)
}

/// Every geometry of [`RAGGED_CHECKS`] for each variant that takes it, with and without codes.
/// f16 value partials (an option, never the product's) round differently per split: not here.
pub fn ragged_batches(gpu: &Gpu, rng: &mut Rng, variants: &[Variant]) -> Result<Vec<serde_json::Value>> {
    let mut checks = Vec::new();
    for (hq, hkv, d, sd) in RAGGED_CHECKS {
        for v in variants.iter().filter(|v| !v.half && takes(v, hq, hkv, d, sd)) {
            for coded in [true, false] {
                checks.push(check_ragged(gpu, rng, hq, hkv, d, sd, *v, coded)?);
            }
        }
    }
    Ok(checks)
}

/// The attention variants the product runs: the tensor-core kernel (merge fused and separate)
/// and the table kernel (f32 and f16 values).
pub fn default_variants() -> Vec<Variant> {
    let t = veloq::kernels::cuda::DEFAULT_THREADS;
    vec![
        Variant { kernel: SplitKernel::TensorCores, threads: t, half: false, fused: true },
        Variant { kernel: SplitKernel::TensorCores, threads: t, half: false, fused: false },
        Variant { kernel: SplitKernel::Tables, threads: t, half: false, fused: false },
        Variant { kernel: SplitKernel::Tables, threads: t, half: true, fused: false },
    ]
}
