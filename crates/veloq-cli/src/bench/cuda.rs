//! `veloq bench cuda` (feature `cuda`): every CUDA kernel checked against the CPU path on fresh
//! random inputs (outputs poisoned first), then timed with CUDA events (median of many), with the
//! two roofline numbers (FLOPs, bytes) per shape. PyTorch/Triton anchors come from
//! scripts/device/baselines.py in the same device call.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use half::f16;
use serde_json::json;

use cudarc::driver::{CudaFunction, CudaSlice};
use veloq::codec::codebook::Granularity;
use veloq::codec::pack::unpack;
use veloq::codec::vecinfer::VecInferCodec;
use veloq::kernels::cuda::{
    gemv_f16, gemv_f16_many, gemv_many_fits, quantize_jobs, AttentionScratch, GemvEpilogue, GemvFused, GemvTune, Gpu,
    GpuAttention, GpuCodec, QuantizeJob, RowMap, SplitKernel, GEMV_MAX_ROWS,
};

pub(super) use crate::synthetic::{codec, Rng};

use super::write_json;

#[derive(ClapArgs)]
pub struct Args {
    /// Timed repetitions per shape (median reported).
    #[arg(long, default_value_t = 50)]
    reps: usize,
    /// How each timed rep starts: queued (as do_bench times the anchors), queued-clean or idle.
    #[arg(long, value_enum, default_value = "queued")]
    timing: Timing,
    /// Time the f16 GEMV's launch shapes on the 8B geometry's weights (after the checks) and
    /// nothing else: the seven plain products, then the four fused launches as a decode step
    /// replays them; prints the fastest of the latter as `best VELOQ_GEMV=R,U,T`.
    #[arg(long)]
    gemv_sweep: bool,
    /// Skip timing (correctness only).
    #[arg(long)]
    check_only: bool,
    /// Skip the correctness checks (timing only; for comparing variants already checked).
    #[arg(long)]
    skip_checks: bool,
    /// Skip the quantize timing.
    #[arg(long)]
    skip_quantize: bool,
    #[arg(long)]
    json: Option<PathBuf>,
    /// JSON from scripts/device/baselines.py run just before on the same GPU: adds ratio tables.
    #[arg(long)]
    baselines: Option<PathBuf>,
    /// PNG figure of decode attention time against context (needs --baselines).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Only run decode attention at batch B over S positions (`--profile B,S`): three warm-up
    /// calls and one timed, then exit. For a profiler such as Nsight Compute.
    #[arg(long, value_delimiter = ',')]
    profile: Vec<usize>,
    /// Attention split kernels, comma separated: tensor-cores and/or tables. Each is checked and
    /// timed over the same grid in this run (the ratio tables and the figure use the first).
    #[arg(long, value_delimiter = ',', default_value = "tensor-cores,tables")]
    kernels: Vec<String>,
    /// Batches of the attention timing grid.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8, 32])]
    batches: Vec<usize>,
    /// Positions (coded tokens) of the attention timing grid.
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 4096, 16384, 65536, 131072])]
    contexts: Vec<usize>,
    /// How the tensor-core kernel merges its splits, comma separated: fused (its last block per
    /// stream, one launch) and/or separate (a second launch). Each is checked and timed.
    #[arg(long, value_delimiter = ',', default_value = "fused")]
    merge: Vec<String>,
    /// Threads per block of the table kernel, comma separated: times it at each.
    #[arg(long, value_delimiter = ',', default_values_t = [veloq::kernels::cuda::DEFAULT_THREADS])]
    threads: Vec<u32>,
    /// Value accumulation in the table kernel, comma separated: f32 (default) and/or f16 (packed
    /// pairs, partials flushed to f32). Timed and checked for each.
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    values: Vec<String>,
}

/// One attention configuration under test.
#[derive(Clone, Copy)]
struct Variant {
    kernel: SplitKernel,
    threads: u32,
    half: bool,
    fused: bool,
}

impl Variant {
    fn build(self, gpu: &Gpu, kc: &VecInferCodec, vc: &VecInferCodec, hq: usize) -> Result<GpuAttention> {
        let att = GpuAttention::new(GpuCodec::upload(gpu, kc)?, GpuCodec::upload(gpu, vc)?, hq)?
            .with_split_kernel(self.kernel)?;
        Ok(att.with_threads(self.threads)?.with_half_values(self.half)?.with_fused_merge(self.fused))
    }

    /// Label and the relative error it must stay within against the f64 reference: f16 operands
    /// on tensor cores (the issue's bound), f32 (or f16 partials) on CUDA cores.
    fn label(self) -> (String, f64) {
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

fn f16_bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| f16::from_f32(v).to_bits()).collect()
}

fn rel_mse(x: &[f32], y: &[f32]) -> f64 {
    let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    e / x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>()
}

macro_rules! dev {
    ($e:expr) => {
        $e.map_err(|e| anyhow::anyhow!("{e:?}"))?
    };
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
    let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
    let worst = y.iter().zip(want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0f64, |m, e| {
        if e.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(e)
        }
    });
    worst / rms
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
/// activations to f16 by contract, so its reference takes them rounded.
fn check_gemv(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<serde_json::Value>> {
    let st = gpu.stream();
    let tunes = [
        GemvTune::for_rows(1),
        GemvTune { tensor_cores: false, rows: 3, unroll: 4, threads: 96 },
        GemvTune::for_rows(2),
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
            for tune in tunes {
                if !gemv_many_fits(rows, epilogue, *rope, tune) {
                    continue;
                }
                // The activations the products see: normalised, then rounded to f16 on tensor cores.
                let xr: Vec<f64> = x
                    .chunks(k)
                    .flat_map(|row| {
                        let inv = if *norm {
                            1.0 / (row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / k as f64 + eps as f64).sqrt()
                        } else {
                            1.0
                        };
                        row.iter()
                            .zip(&gains)
                            .map(move |(&v, &g)| if *norm { v as f64 * inv * g as f64 } else { v as f64 })
                    })
                    .map(|v| if tune.tensor_cores { f16::from_f64(v).to_f64() } else { v })
                    .collect();
                let dot = |w: &[u16], bi: usize, ni: usize| -> f64 {
                    (0..k).map(|j| f16::from_bits(w[ni * k + j]).to_f64() * xr[bi * k + j]).sum()
                };
                let mut want: Vec<f64> = match epilogue {
                    // Matrix after matrix, each [b, n], RoPE on the first two's row pairs.
                    GemvEpilogue::Concat => ws
                        .iter()
                        .zip(rows)
                        .enumerate()
                        .flat_map(|(m, (w, &n))| {
                            let dot = &dot;
                            let (cos, sin) = (&cos, &sin);
                            (0..b).flat_map(move |bi| {
                                (0..n).map(move |ni| match rope {
                                    Some(d) if m < 2 => {
                                        let (p, even) = ((ni % d) / 2, ni - ni % 2);
                                        let (x0, x1) = (dot(w, bi, even), dot(w, bi, even + 1));
                                        let (c, s) = (cos[bi * half + p] as f64, sin[bi * half + p] as f64);
                                        if ni % 2 == 0 {
                                            x0 * c - x1 * s
                                        } else {
                                            x0 * s + x1 * c
                                        }
                                    }
                                    _ => dot(w, bi, ni),
                                })
                            })
                        })
                        .collect(),
                    _ => (0..b * rows[0])
                        .map(|i| {
                            let (bi, ni) = (i / rows[0], i % rows[0]);
                            let (g, u) = (dot(&ws[0], bi, ni), dot(&ws[1], bi, ni));
                            let act = if epilogue == GemvEpilogue::Silu {
                                g / (1.0 + (-g).exp())
                            } else {
                                0.5 * g * (1.0 + (0.797_884_560_8 * (g + 0.044715 * g * g * g)).tanh())
                            };
                            act * u
                        })
                        .collect(),
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
                let err = max_err_over_rms(&y, &want);
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
                    bail!("f16 GEMV {what} {tune:?}, b {b}, rows {rows:?}, k {k}: max error {err:.2e} of the outputs' rms");
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

/// A Llama-3.1-8B layer's weight matrices for one decode token: (n, k, how many per layer).
const GEMV_LAYER: [(usize, usize, usize); 4] = [(4096, 4096, 2), (1024, 4096, 2), (14336, 4096, 2), (4096, 14336, 1)];

/// Device-to-device copy bandwidth (bytes read + written per second) over 1 GiB buffers, the
/// median of 9 copies after 2: the yardstick of bytes floors, measured in the same run.
pub(super) fn copy_bandwidth(gpu: &Gpu) -> Result<f64> {
    let n = 1usize << 30;
    let stream = gpu.stream();
    let src = dev!(stream.alloc_zeros::<u8>(n));
    let mut dst = dev!(stream.alloc_zeros::<u8>(n));
    let mut times = Vec::new();
    for i in 0..11 {
        dev!(stream.synchronize());
        let t = std::time::Instant::now();
        dev!(stream.memcpy_dtod(&src, &mut dst));
        dev!(stream.synchronize());
        if i >= 2 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * n as f64 / times[times.len() / 2])
}

/// Times the f16 GEMV's launch shapes over a Llama-3.1-8B layer's weight matrices, one
/// activation row (`f16_gemv`) and eight (`f16_gemv_mma`), beside the device-to-device copy
/// bandwidth measured here. Per shape: GB/s of each matrix alone (L2 cleared before each rep:
/// includes each launch's ramp and tail) and the layer's seven products back to back on distinct
/// buffers, as a decode step issues them (436 MB, no clear needed), against the weights' bytes at
/// the copy bandwidth. Every shape's outputs are checked against the default's. Prints the fastest
/// layer as `best VELOQ_GEMV=R,U,T` and `best VELOQ_GEMV_MMA=R,U,T`.
fn gemv_sweep(gpu: &Gpu, rng: &mut Rng, reps: usize) -> Result<()> {
    let st = gpu.stream();
    let bw = copy_bandwidth(gpu)?;
    let (mut clear, mut clean) = (Clear::new(gpu, Timing::Queued)?, Clear::new(gpu, Timing::QueuedClean)?);
    // One host matrix per shape, uploaded once per use in the layer.
    let mats = GEMV_LAYER
        .iter()
        .map(|&(n, k, c)| {
            let host = f16_bits(&rng.rows(n, k));
            let copies = (0..c).map(|_| Ok(dev!(st.clone_htod(&host)))).collect::<Result<Vec<_>>>()?;
            Ok((n, k, copies))
        })
        .collect::<Result<Vec<_>>>()?;
    let layer_bytes: usize = GEMV_LAYER.iter().map(|&(n, k, c)| n * k * 2 * c).sum();
    let floor_ms = layer_bytes as f64 / bw * 1e3;
    println!(
        "copy {:.2} TB/s (read + write); a layer's weights ({} MB) at it: {floor_ms:.3} ms",
        bw / 1e12,
        layer_bytes / 1_000_000
    );
    for (b, env, tensor_cores) in [(1usize, "VELOQ_GEMV", false), (GEMV_MAX_ROWS, "VELOQ_GEMV_MMA", true)] {
        // Every product reads the first b·k activations as [b, k].
        let x = dev!(st.clone_htod(&rng.rows(b, 14336)));
        let mut ys = mats
            .iter()
            .map(|(n, _, c)| c.iter().map(|_| Ok(dev!(st.alloc_zeros::<f32>(b * n)))).collect())
            .collect::<Result<Vec<Vec<_>>>>()?;
        let default = GemvTune::for_rows(b);
        let run = |tune: GemvTune, ys: &mut [Vec<CudaSlice<f32>>]| -> Result<()> {
            for ((n, k, ws), y) in mats.iter().zip(ys.iter_mut()) {
                for (w, y) in ws.iter().zip(y.iter_mut()) {
                    gemv_f16(gpu, &w.as_view(), &x.slice(..b * k), &mut y.as_view_mut(), b, *n, *k, tune)?;
                }
            }
            Ok(())
        };
        run(default, &mut ys)?;
        let want = ys.iter().map(|y| Ok(dev!(st.clone_dtoh(&y[0])))).collect::<Result<Vec<_>>>()?;
        println!("\n{b} activation row(s), {}", default.kernel_name());
        println!(
            "| R,U,T | {} | layer ms | × floor |",
            GEMV_LAYER.map(|(n, k, _)| format!("{n}×{k} GB/s")).join(" | ")
        );
        println!("|---|---|---|---|---|---|---|");
        let rows: &[usize] = if tensor_cores { &[16, 32, 64] } else { &[1, 2, 4] };
        let mut best: Option<(f64, GemvTune)> = None;
        for &rows in rows {
            for unroll in [1, 2] {
                for threads in [256, 512, 1024] {
                    let tune = GemvTune { tensor_cores, rows, unroll, threads };
                    // Shapes past the device's limits (registers, shared memory) are skipped.
                    if let Err(e) = run(tune, &mut ys) {
                        println!(
                            "| {rows},{unroll},{threads} | does not run: {} |",
                            e.to_string().lines().last().unwrap_or("")
                        );
                        continue;
                    }
                    let mut cells = Vec::new();
                    for (((n, k, ws), y), want) in mats.iter().zip(ys.iter_mut()).zip(&want) {
                        let ms = time_ms(gpu, &mut clear, reps, || {
                            Ok(gemv_f16(
                                gpu,
                                &ws[0].as_view(),
                                &x.slice(..b * k),
                                &mut y[0].as_view_mut(),
                                b,
                                *n,
                                *k,
                                tune,
                            )?)
                        })?;
                        if rel_mse(want, &dev!(st.clone_dtoh(&y[0]))) > 1e-10 {
                            bail!("GEMV {tune:?} on {n}×{k} disagrees with the default shape");
                        }
                        cells.push(format!("{:.0}", (n * k * 2) as f64 / (ms * 1e-3) / 1e9));
                    }
                    let layer = time_ms(gpu, &mut clean, reps, || run(tune, &mut ys))?;
                    println!(
                        "| {rows},{unroll},{threads} | {} | {layer:.3} | {:.2} |",
                        cells.join(" | "),
                        layer / floor_ms
                    );
                    if best.is_none_or(|(t, _)| layer < t) {
                        best = Some((layer, tune));
                    }
                }
            }
        }
        let (t, best) = best.expect("variants timed");
        println!(
            "fastest plain {env}={},{},{} ({t:.3} ms a layer, {:.2}× the floor; default {default:?})",
            best.rows,
            best.unroll,
            best.threads,
            t / floor_ms
        );
    }
    step_layers(gpu, rng, reps, &mats, floor_ms)
}

/// Layers of their own weights in a step (more than L2 holds), for [`step_layers`].
const STEP_LAYERS: usize = 8;

/// The 8B decode layer as a step issues it — four launches with the fused operations (norm, q/k/v
/// side by side and RoPE; the output projection adding into the stream; norm and the gated
/// pair; the down projection adding) — over [`STEP_LAYERS`] layers of distinct weights, for every
/// launch shape: eagerly, replayed from one CUDA graph per layer (as the decode step's segments
/// are), and so with three small launches between the graphs (where the step puts the cache's
/// rows in, attends and commits). The last is how a step runs them, and picks the shape: the
/// plain products' ranking above does not carry over (one row: 2,1,512 was fastest there, and in
/// a step 2,2,256 took 4.05 ms of segments against its 4.88).
fn step_layers(
    gpu: &Gpu,
    rng: &mut Rng,
    reps: usize,
    mats: &[(usize, usize, Vec<CudaSlice<u16>>)],
    floor_ms: f64,
) -> Result<()> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    // The legacy default stream cannot be captured: a stream of its own.
    let gpu = &Gpu::from_stream(dev!(gpu.stream().context().new_stream()))?;
    let st = gpu.stream();
    let (mut clean, hidden, inter, head_dim) = (Clear::new(gpu, Timing::QueuedClean)?, 4096usize, 14336usize, 128usize);
    // Layer l's matrices in GEMV_LAYER's order, q, o (4096×4096), k, v (1024×4096), gate, up,
    // down (copies of the sweep's, each layer its own), and their (n, k).
    let shapes: Vec<(usize, usize)> =
        mats.iter().flat_map(|(n, k, copies)| std::iter::repeat_n((*n, *k), copies.len())).collect();
    let layers = (0..STEP_LAYERS)
        .map(|_| {
            let mut w = Vec::new();
            for (_, _, copies) in mats {
                for c in copies {
                    let mut d = dev!(st.alloc_zeros::<u16>(c.len()));
                    dev!(st.memcpy_dtod(c, &mut d));
                    w.push(d);
                }
            }
            Ok(w)
        })
        .collect::<Result<Vec<_>>>()?;
    dev!(st.synchronize());
    let (q, o, k, v, gate, up, down) = (0, 1, 2, 3, 4, 5, 6);
    for (b, env, tensor_cores) in [(1usize, "VELOQ_GEMV", false), (GEMV_MAX_ROWS, "VELOQ_GEMV_MMA", true)] {
        let up_h = |v: Vec<f32>| -> Result<CudaSlice<f32>> { Ok(dev!(st.clone_htod(&v))) };
        let mut x = up_h(rng.rows(b, hidden).iter().map(|v| v * 0.01).collect())?;
        let attn = up_h(rng.rows(b, hidden))?;
        let norm = up_h((0..hidden).map(|i| 1.0 + (i % 7) as f32 * 0.01).collect())?;
        let angles: Vec<f32> = (0..b * head_dim / 2).map(|i| i as f32 * 0.37).collect();
        let (cos, sin) =
            (up_h(angles.iter().map(|a| a.cos()).collect())?, up_h(angles.iter().map(|a| a.sin()).collect())?);
        let mut qkv = dev!(st.alloc_zeros::<f32>(b * (hidden + 2048)));
        let mut h = dev!(st.alloc_zeros::<f32>(b * inter));
        let mut small = dev!(st.alloc_zeros::<f32>(b * hidden));
        let mut outs =
            shapes.iter().map(|&(n, _)| Ok(dev!(st.alloc_zeros::<f32>(b * n)))).collect::<Result<Vec<_>>>()?;
        println!("\nthe decode layer as a step issues it (4 fused launches), {b} activation row(s), {STEP_LAYERS} layers of their own weights, ms a layer");
        println!("| R,U,T | 7 products | 4 fused, eager | 4 fused, a graph per layer | + 3 small launches between graphs | × floor (last) |");
        println!("|---|---|---|---|---|---|");
        let rows: &[usize] = if tensor_cores { &[16, 32] } else { &[1, 2, 4] };
        let mut best: Option<(f64, GemvTune)> = None;
        for &rows in rows {
            for unroll in [1, 2] {
                for threads in [256, 512, 1024] {
                    let tune = GemvTune { tensor_cores, rows, unroll, threads };
                    let plain = time_ms(gpu, &mut clean, reps, || {
                        for w in &layers {
                            for ((m, y), &(n, kk)) in w.iter().zip(outs.iter_mut()).zip(&shapes) {
                                let xin = if kk == inter { h.slice(..b * kk) } else { attn.slice(..b * kk) };
                                gemv_f16(gpu, &m.as_view(), &xin, &mut y.as_view_mut(), b, n, kk, tune)?;
                            }
                        }
                        Ok(())
                    });
                    let Ok(plain) = plain else {
                        println!("| {rows},{unroll},{threads} | does not run |");
                        continue;
                    };
                    let (norm_v, cos_v, sin_v, attn_v) = (norm.as_view(), cos.as_view(), sin.as_view(), attn.as_view());
                    let mut layer = |l: usize, x: &mut CudaSlice<f32>| -> Result<()> {
                        let wv: Vec<_> = layers[l].iter().map(|m| m.as_view()).collect();
                        let along = GemvFused {
                            norm: Some((&norm_v, 1e-5)),
                            rope: Some((&cos_v, &sin_v, head_dim)),
                            ..GemvFused::default()
                        };
                        let qkv_w = [(&wv[q], hidden), (&wv[k], 1024), (&wv[v], 1024)];
                        gemv_f16_many(
                            gpu,
                            &qkv_w,
                            &x.as_view(),
                            &mut qkv.as_view_mut(),
                            b,
                            hidden,
                            GemvEpilogue::Concat,
                            along,
                            tune,
                        )?;
                        let add = GemvFused { accumulate: true, ..GemvFused::default() };
                        gemv_f16_many(
                            gpu,
                            &[(&wv[o], hidden)],
                            &attn_v,
                            &mut x.as_view_mut(),
                            b,
                            hidden,
                            GemvEpilogue::Concat,
                            add,
                            tune,
                        )?;
                        let normed = GemvFused { norm: Some((&norm_v, 1e-5)), ..GemvFused::default() };
                        let pair = [(&wv[gate], inter), (&wv[up], inter)];
                        gemv_f16_many(
                            gpu,
                            &pair,
                            &x.as_view(),
                            &mut h.as_view_mut(),
                            b,
                            hidden,
                            GemvEpilogue::Silu,
                            normed,
                            tune,
                        )?;
                        gemv_f16_many(
                            gpu,
                            &[(&wv[down], hidden)],
                            &h.as_view(),
                            &mut x.as_view_mut(),
                            b,
                            inter,
                            GemvEpilogue::Concat,
                            add,
                            tune,
                        )?;
                        Ok(())
                    };
                    let per = STEP_LAYERS as f64;
                    let eager =
                        match time_ms(gpu, &mut clean, reps, || (0..STEP_LAYERS).try_for_each(|l| layer(l, &mut x))) {
                            Ok(t) => t / per,
                            Err(e) => {
                                println!(
                                    "| {rows},{unroll},{threads} | {plain:.3} | fused forms do not run: {} |",
                                    e.to_string().lines().last().unwrap_or("")
                                );
                                continue;
                            }
                        };
                    let mut graphs = Vec::with_capacity(STEP_LAYERS);
                    // cudarc's cross-stream events would wait on work outside the capture, which
                    // the driver refuses; everything here is on one stream.
                    // SAFETY: no buffer is used by another stream while tracking is off.
                    unsafe { st.context().disable_event_tracking() };
                    for l in 0..STEP_LAYERS {
                        dev!(st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
                        let body = layer(l, &mut x);
                        let g = st.end_capture(CUgraphInstantiate_flags(0));
                        body?;
                        graphs.push(dev!(g).context("the capture recorded nothing")?);
                    }
                    let replayed =
                        time_ms(gpu, &mut clean, reps, || graphs.iter().try_for_each(|g| Ok(dev!(g.launch()))))? / per;
                    let between = time_ms(gpu, &mut clean, reps, || {
                        for g in &graphs {
                            for _ in 0..3 {
                                dev!(st.memcpy_dtod(&attn, &mut small));
                            }
                            dev!(g.launch());
                        }
                        Ok(())
                    })? / per;
                    // SAFETY: as above; tracking resumes for what follows.
                    unsafe { st.context().enable_event_tracking() };
                    println!(
                        "| {rows},{unroll},{threads} | {:.3} | {eager:.3} | {replayed:.3} | {between:.3} | {:.2} |",
                        plain / per,
                        between / floor_ms
                    );
                    if best.is_none_or(|(t, _)| between < t) {
                        best = Some((between, tune));
                    }
                }
            }
        }
        let (t, best) = best.context("no launch shape ran")?;
        println!(
            "best {env}={},{},{} ({t:.3} ms a layer as a step runs it, {:.2}× the floor; default {:?})",
            best.rows,
            best.unroll,
            best.threads,
            t / floor_ms,
            GemvTune::for_rows(b)
        );
    }
    Ok(())
}

/// How each timed repetition starts.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Timing {
    /// As `triton.testing.do_bench`, which times the PyTorch and Triton anchors: L2 cleared
    /// (256 MB written) before each rep, the rep's events queued behind the clear, one
    /// synchronisation at the end. The GPU is busy when a rep is submitted, so host launch latency
    /// is hidden, as in a decode loop that runs ahead of the GPU.
    Queued,
    /// As `queued`, but L2 is cleared by reading 256 MB instead of writing it: the lines it leaves
    /// are clean (as after a layer's weight reads), so the timed kernel's reads do not have to
    /// write dirty lines back first.
    QueuedClean,
    /// Each rep submitted to an idle GPU and waited for: includes the host's launch latency of the
    /// first kernel, and whatever of the inputs stayed in L2 from the previous rep.
    Idle,
}

/// Reads a buffer whole (L2 left holding its clean lines); writes only if a checksum that the
/// zeroed buffer never gives comes out, so that the reads are not optimised away.
const READ_FLUSH: &str = r#"
extern "C" __global__ void read_flush(const uint4* p, unsigned long long n, unsigned* sink) {
    unsigned x = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x9e3779b9u) sink[0] = x;
}
"#;

/// What runs on the stream before each timed rep: L2 cleared by a 256 MB write (do_bench), by a
/// 256 MB read, or nothing (idle timing). Made once per run: the buffer and the read kernel serve
/// every timed shape.
enum Clear {
    Nothing,
    Write(CudaSlice<u8>),
    Read(CudaSlice<u8>, CudaFunction, CudaSlice<u32>),
}

impl Clear {
    fn new(gpu: &Gpu, timing: Timing) -> Result<Self> {
        let s = gpu.stream();
        Ok(match timing {
            Timing::Queued => Clear::Write(dev!(s.alloc_zeros::<u8>(256 << 20))),
            Timing::QueuedClean => {
                let ptx = dev!(cudarc::nvrtc::compile_ptx(READ_FLUSH));
                let f = dev!(dev!(gpu.context().load_module(ptx)).load_function("read_flush"));
                Clear::Read(dev!(s.alloc_zeros::<u8>(256 << 20)), f, dev!(s.alloc_zeros::<u32>(1)))
            }
            Timing::Idle => Clear::Nothing,
        })
    }

    /// Idle timing: each rep waited for.
    fn idle(&self) -> bool {
        matches!(self, Clear::Nothing)
    }

    fn run(&mut self, gpu: &Gpu) -> Result<()> {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let s = gpu.stream();
        match self {
            Clear::Nothing => {}
            Clear::Write(buf) => dev!(s.memset_zeros(buf)),
            Clear::Read(buf, f, sink) => {
                let n = (buf.len() / 16) as u64;
                let cfg = LaunchConfig {
                    grid_dim: (4 * gpu.multiprocessors(), 1, 1),
                    block_dim: (512, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut l = s.launch_builder(f);
                l.arg(&*buf).arg(&n).arg(&*sink);
                // SAFETY: the arguments match read_flush's signature; n uint4s fit in buf.
                dev!(unsafe { l.launch(cfg) });
            }
        }
        Ok(())
    }
}

/// Median milliseconds of `reps` runs of `f`, timed with events on the GPU's stream (after 3
/// warm-up runs).
fn time_ms(gpu: &Gpu, clear: &mut Clear, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    for _ in 0..3 {
        f()?;
    }
    let s = gpu.stream();
    let mut events = Vec::with_capacity(reps);
    for _ in 0..reps {
        clear.run(gpu)?;
        let a = dev!(s.record_event(Some(CU_EVENT_DEFAULT)));
        f()?;
        let b = dev!(s.record_event(Some(CU_EVENT_DEFAULT)));
        if clear.idle() {
            dev!(b.synchronize());
        }
        events.push((a, b));
    }
    dev!(s.synchronize());
    let mut t = events.iter().map(|(a, b)| Ok(dev!(a.elapsed_ms(b)) as f64)).collect::<Result<Vec<_>>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// GPU codes vs the CPU encoder on one shape: code agreement and reconstruction error. With
/// `pair`, a key and a value codec of the shape (different centering and smoothing) code the same
/// rows in one launch, as a cache's flush does, and each is compared with its own CPU encoder.
fn check_quantize(
    gpu: &Gpu,
    rng: &mut Rng,
    (s, d, h, sd, bits, g): (usize, usize, usize, usize, u32, Granularity),
    pair: bool,
) -> Result<serde_json::Value> {
    let codecs = if pair {
        vec![codec(rng, h, d, sd, bits, g, true)?, codec(rng, h, d, sd, bits, g, false)?]
    } else {
        vec![codec(rng, h, d, sd, bits, g, true)?]
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
    let launches = {
        let x = xd.as_view();
        let mut views: Vec<_> = outs.iter_mut().map(|o| o.as_view_mut()).collect();
        let mut jobs: Vec<_> =
            gcs.iter().zip(&mut views).map(|(codec, out)| QuantizeJob { codec, x: &x, out }).collect();
        quantize_jobs(gpu, &mut jobs, h, RowMap::tokens(s, h), None)?
    };
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
        "launches": launches, "codes": m * codecs.len(), "differing": differ, "rel_mse_cpu_gpu": mse}))
}

/// A flush of the ring's oldest rows (`t` vectors of `h` kv heads, keys and values): two launches
/// with one thread per search (how flushes ran before), two with the searches spread, and one
/// launch for both, timed back to back in this call.
fn time_flush(
    gpu: &Gpu,
    rng: &mut Rng,
    clear: &mut Clear,
    reps: usize,
    (t, h, d): (usize, usize, usize),
) -> Result<serde_json::Value> {
    let (kc, vc) =
        (codec(rng, h, d, 4, 8, Granularity::PerLayer, true)?, codec(rng, h, d, 4, 8, Granularity::PerLayer, false)?);
    let (kg, vg) = (GpuCodec::upload(gpu, &kc)?, GpuCodec::upload(gpu, &vc)?);
    let st = gpu.stream();
    let xd = dev!(st.clone_htod(&f16_bits(&rng.rows(t * h, d))));
    let mut ko = dev!(st.alloc_zeros::<u8>(kg.code_bytes(t * h)));
    let mut vo = dev!(st.alloc_zeros::<u8>(vg.code_bytes(t * h)));
    let map = RowMap::tokens(t, h);
    let mut run = |fused: bool, slices: Option<u32>| -> Result<f64> {
        time_ms(gpu, clear, reps, || {
            let (x, mut k, mut v) = (xd.as_view(), ko.as_view_mut(), vo.as_view_mut());
            if fused {
                let mut jobs =
                    [QuantizeJob { codec: &kg, x: &x, out: &mut k }, QuantizeJob { codec: &vg, x: &x, out: &mut v }];
                quantize_jobs(gpu, &mut jobs, h, map, slices)?;
            } else {
                quantize_jobs(gpu, &mut [QuantizeJob { codec: &kg, x: &x, out: &mut k }], h, map, slices)?;
                quantize_jobs(gpu, &mut [QuantizeJob { codec: &vg, x: &x, out: &mut v }], h, map, slices)?;
            }
            Ok(())
        })
    };
    let (before, spread, one) = (run(false, Some(1))?, run(false, None)?, run(true, None)?);
    println!("| {t}×{h}, D {d} | {before:.4} | {spread:.4} | {one:.4} | {:.2}× |", before / one);
    Ok(
        json!({"t": t, "heads": h, "D": d, "two_launches_one_thread_ms": before, "two_launches_spread_ms": spread, "one_launch_ms": one}),
    )
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

/// Quantize checks: (S, D, H, sub_dim, bits, granularity).
/// Quantize checks (S, D, H, sub_dim, bits, books): many rows (one thread per search) and few
/// (a flush: searches spread over 8–32 threads), every bit width and both book granularities.
const QUANTIZE_CHECKS: [(usize, usize, usize, usize, u32, Granularity); 10] = [
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
const QUANTIZE_PAIR_CHECKS: [(usize, usize, usize, usize, u32, Granularity); 2] =
    [(8, 128, 8, 4, 8, Granularity::PerLayer), (611, 64, 4, 4, 8, Granularity::PerLayer)];

/// Attention checks: GQA 1–4 and 8, D 64/128/256, odd and empty code counts, windows 0–31.
const ATTENTION_CHECKS: [AttnCase; 9] = [
    AttnCase { b: 2, hq: 8, hkv: 2, d: 64, s: 1000, w: 7 },
    AttnCase { b: 1, hq: 32, hkv: 8, d: 128, s: 4097, w: 31 },
    AttnCase { b: 3, hq: 4, hkv: 4, d: 256, s: 333, w: 0 },
    AttnCase { b: 1, hq: 12, hkv: 4, d: 128, s: 0, w: 20 },
    AttnCase { b: 2, hq: 9, hkv: 3, d: 64, s: 777, w: 20 },
    AttnCase { b: 2, hq: 32, hkv: 8, d: 128, s: 20011, w: 16 },
    AttnCase { b: 1, hq: 8, hkv: 1, d: 256, s: 5, w: 3 },
    AttnCase { b: 2, hq: 16, hkv: 2, d: 128, s: 17, w: 0 },
    AttnCase { b: 1, hq: 32, hkv: 8, d: 128, s: 131071, w: 24 },
];

/// Quantize timing: the anchors' shapes (S, D, H, sub_dim), 256 centroids.
const QUANTIZE_SHAPES: [(usize, usize, usize, usize); 5] =
    [(2048, 128, 8, 8), (8192, 128, 8, 8), (131072, 128, 8, 8), (4096, 256, 4, 4), (131072, 128, 8, 4)];

#[derive(Clone, Copy)]
struct AttnCase {
    b: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    s: usize,
    w: usize,
}

/// GPU attention over codes + window vs an f64 reference over the CPU-decoded keys and values.
fn check_attention(gpu: &Gpu, rng: &mut Rng, c: AttnCase, v: Variant) -> Result<serde_json::Value> {
    let AttnCase { b, hq, hkv, d, s, w } = c;
    let (kc, vc) = (
        codec(rng, hkv, d, 4, 8, Granularity::PerLayer, true)?,
        codec(rng, hkv, d, 4, 8, Granularity::PerLayer, false)?,
    );
    let att = v.build(gpu, &kc, &vc, hq)?;
    let (label, bound) = v.label();
    let m = d / 4;
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
    let kcd = dev!(st.clone_htod(&nz(head_major(&kcodes, b, s, hkv, m))));
    let vcd = dev!(st.clone_htod(&nz(head_major(&vcodes, b, s, hkv, m))));
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
        "attention B={b} Hq={hq} Hkv={hkv} D={d} S={s:<5} W={w:<2} {label}: rel err {rel:.2e} (bound {bound:.0e}) {}",
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        bail!("attention mismatch");
    }
    Ok(json!({"B": b, "Hq": hq, "Hkv": hkv, "D": d, "S": s, "W": w, "kernel": label, "rel_err": rel, "bound": bound}))
}

pub fn run(a: Args) -> Result<()> {
    let gpu = Gpu::new(0).context("opening GPU 0")?;
    // SAFETY: everything here runs on the GPU's one stream, so cudarc's per-buffer event tracking
    // would only add driver calls to every launch.
    unsafe { gpu.stream().context().disable_event_tracking() };
    let seed = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64 | 1;
    let mut rng = Rng(seed);
    println!("{} ({} SMs), seed {seed}", gpu.name(), gpu.multiprocessors());
    let half: Vec<bool> = a
        .values
        .iter()
        .map(|v| match v.as_str() {
            "f32" => Ok(false),
            "f16" => Ok(true),
            o => bail!("--values takes f32 or f16, not {o}"),
        })
        .collect::<Result<_>>()?;
    let mut variants = Vec::new();
    for k in &a.kernels {
        match k.as_str() {
            "tensor-cores" => {
                for m in &a.merge {
                    let fused = match m.as_str() {
                        "fused" => true,
                        "separate" => false,
                        o => bail!("--merge takes fused or separate, not {o}"),
                    };
                    variants.push(Variant {
                        kernel: SplitKernel::TensorCores,
                        threads: a.threads[0],
                        half: false,
                        fused,
                    });
                }
            }
            "tables" => {
                for &threads in &a.threads {
                    for &h in &half {
                        variants.push(Variant { kernel: SplitKernel::Tables, threads, half: h, fused: false });
                    }
                }
            }
            o => bail!("--kernels takes tensor-cores or tables, not {o}"),
        }
    }
    if variants.is_empty() {
        bail!("--kernels names no kernel");
    }
    match a.profile[..] {
        [] => {}
        [b, s] => {
            time_attention(&gpu, &mut rng, vec![(b, s)], &mut Clear::Nothing, 1, variants[0])?;
            return Ok(());
        }
        _ => bail!("--profile takes B,S"),
    }
    let mut checks = Vec::new();
    let (quantize_checks, attention_checks): (&[_], &[_]) =
        if a.skip_checks { (&[], &[]) } else { (&QUANTIZE_CHECKS, &ATTENTION_CHECKS) };
    for &shape in quantize_checks {
        checks.push(check_quantize(&gpu, &mut rng, shape, false)?);
    }
    for &shape in if a.skip_checks { &[][..] } else { &QUANTIZE_PAIR_CHECKS[..] } {
        checks.push(check_quantize(&gpu, &mut rng, shape, true)?);
    }
    if !a.skip_checks {
        checks.extend(check_gemv(&gpu, &mut rng)?);
    }
    for &c in attention_checks {
        for &v in &variants {
            // The tensor-core kernel takes groups of at most 8 heads; others use the table kernel.
            if v.kernel == SplitKernel::TensorCores && c.hq / c.hkv > 8 {
                continue;
            }
            checks.push(check_attention(&gpu, &mut rng, c, v)?);
        }
    }
    if a.check_only {
        return write_json(&a.json, &json!({"gpu": gpu.name(), "checks": checks}));
    }
    if a.gemv_sweep {
        return gemv_sweep(&gpu, &mut rng, a.reps);
    }
    let st = gpu.stream();
    let mut clear = Clear::new(&gpu, a.timing)?;
    println!("\n| quantize S,D,H,sd | ms | G sub-vec/s | GFLOP/s | GB/s |");
    println!("|---|---|---|---|---|");
    let mut qt = Vec::new();
    let quantize_shapes: &[_] = if a.skip_quantize { &[] } else { &QUANTIZE_SHAPES };
    for &(s, d, h, sd) in quantize_shapes {
        let c = codec(&mut rng, h, d, sd, 8, Granularity::PerLayer, true)?;
        let gc = GpuCodec::upload(&gpu, &c)?;
        let xd = dev!(st.clone_htod(&f16_bits(&rng.rows(s * h, d))));
        let mut out = dev!(st.alloc_zeros::<u8>(gc.code_bytes(s * h)));
        let ms = time_ms(&gpu, &mut clear, a.reps, || Ok(gc.quantize(&gpu, &xd, s * h, &mut out)?))?;
        let n = (s * h * d / sd) as f64;
        let flops = n * 256.0 * (2.0 * sd as f64 + 1.0);
        let bytes = (s * h * d * 2) as f64 + gc.code_bytes(s * h) as f64;
        println!(
            "| {s},{d},{h},{sd} | {ms:.4} | {:.2} | {:.0} | {:.0} |",
            n / ms / 1e6,
            flops / ms / 1e6,
            bytes / ms / 1e6
        );
        qt.push(
            json!({"S": s, "D": d, "H": h, "sub_dim": sd, "ms": ms, "sub_vectors": n, "flops": flops, "bytes": bytes}),
        );
    }
    let mut flushes = Vec::new();
    if !a.skip_quantize {
        println!("\n| flush t×kv heads (keys + values) | 2 launches, 1 thread a search ms | 2 launches, spread ms | 1 launch, spread ms | first ÷ last |");
        println!("|---|---|---|---|---|");
        for shape in [(8, 8, 128), (8, 64, 128), (8, 1, 256)] {
            flushes.push(time_flush(&gpu, &mut rng, &mut clear, a.reps, shape)?);
        }
    }
    // Decode attention timing: Llama-3.1-8B geometry, 2-bit codes (256 centroids of 4).
    println!("\n| attention B,S (Hq 32, Hkv 8, D 128) | kernel | ms | code MiB | GB/s | splits |");
    println!("|---|---|---|---|---|---|");
    let mut at = Vec::new();
    for &v in &variants {
        let grid = a.batches.iter().flat_map(|&b| a.contexts.iter().map(move |&s| (b, s))).collect();
        at.extend(time_attention(&gpu, &mut rng, grid, &mut clear, a.reps, v)?);
    }
    side_by_side(&at);
    let first_label = variants[0].label().0;
    let first: Vec<_> = at.iter().filter(|x| x["kernel"] == first_label.as_str()).cloned().collect();
    if let Some(path) = &a.baselines {
        let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        ratios(&base, &qt, &first, a.plot.as_deref())?;
    }
    let timing = a.timing.to_possible_value().map(|v| v.get_name().to_string());
    write_json(
        &a.json,
        &json!({"gpu": gpu.name(), "seed": seed, "timing": timing, "checks": checks, "quantize": qt, "flushes": flushes, "attention": at}),
    )
}

/// Times decode attention over 2-bit codes (256 centroids of 4) in the Llama-3.1-8B geometry for
/// each (batch, positions), printing a table row each.
fn time_attention(
    gpu: &Gpu,
    rng: &mut Rng,
    shapes: Vec<(usize, usize)>,
    clear: &mut Clear,
    reps: usize,
    v: Variant,
) -> Result<Vec<serde_json::Value>> {
    let st = gpu.stream();
    let mut at = Vec::new();
    let (hq, hkv, d, w) = (32, 8, 128, 16);
    let kc = codec(rng, hkv, d, 4, 8, Granularity::PerLayer, true)?;
    let vc = codec(rng, hkv, d, 4, 8, Granularity::PerLayer, false)?;
    let att = v.build(gpu, &kc, &vc, hq)?;
    let label = v.label().0;
    for (b, s) in shapes {
        let m = d / 4;
        let n = b * hkv * s * m;
        let codes: Vec<u8> = (0..n).map(|i| (rng.next() * 256.0) as u8 ^ (i as u8)).collect();
        let kcd = dev!(st.clone_htod(&codes));
        let vcd = dev!(st.clone_htod(&codes));
        let wkd = dev!(st.clone_htod(&f16_bits(&rng.rows(b * hkv * w, d))));
        let wvd = dev!(st.clone_htod(&f16_bits(&rng.rows(b * hkv * w, d))));
        let qd = dev!(st.clone_htod(&rng.rows(b * hq, d)));
        let mut out = dev!(st.alloc_zeros::<f32>(b * hq * d));
        let splits = att.splits(gpu, b, s);
        let mut scratch = AttentionScratch::new(gpu, b, hq, d, splits)?;
        let mut launches = 0;
        let ms = time_ms(gpu, clear, reps, || {
            launches = att.attend(gpu, &qd, &kcd, &vcd, b, s, &wkd, &wvd, w, 0.088, &mut scratch, &mut out)?;
            Ok(())
        })?;
        let bytes = 2.0 * n as f64;
        println!(
            "| {b},{s} | {label} | {ms:.4} | {:.1} | {:.0} | {splits} |",
            bytes / (1 << 20) as f64,
            bytes / ms / 1e6
        );
        at.push(json!({"B": b, "S": s, "kernel": label, "Hq": hq, "Hkv": hkv, "D": d, "W": w, "ms": ms, "code_bytes": bytes, "splits": splits,
            "fp16_kv_bytes": (2 * b * hkv * s * d * 2) as f64, "launches": launches}));
    }
    Ok(at)
}

/// Each kernel's time at every shape next to the first kernel's, measured in this run.
fn side_by_side(at: &[serde_json::Value]) {
    let Some(first) = at.first().map(|x| x["kernel"].clone()) else { return };
    let others: Vec<_> = at.iter().filter(|x| x["kernel"] != first).collect();
    if others.is_empty() {
        return;
    }
    println!(
        "\n| attention B,S | {} ms | other kernel | its ms | speed-up of {} |",
        first.as_str().unwrap_or("?"),
        first.as_str().unwrap_or("?")
    );
    println!("|---|---|---|---|---|");
    for o in others {
        let Some(f) = at.iter().find(|x| x["kernel"] == first && x["B"] == o["B"] && x["S"] == o["S"]) else {
            continue;
        };
        let (fm, om) = (f["ms"].as_f64().unwrap_or(f64::NAN), o["ms"].as_f64().unwrap_or(f64::NAN));
        println!(
            "| {},{} | {fm:.4} | {} | {om:.4} | {:.2}× |",
            o["B"],
            o["S"],
            o["kernel"].as_str().unwrap_or("?"),
            om / fm
        );
    }
}

/// Side-by-side tables against the PyTorch/Triton anchors timed in the same device call, and the
/// attention figure.
fn ratios(
    base: &serde_json::Value,
    qt: &[serde_json::Value],
    at: &[serde_json::Value],
    plot: Option<&std::path::Path>,
) -> Result<()> {
    let get = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let same = |a: &serde_json::Value, b: &serde_json::Value, keys: &[&str]| keys.iter().all(|k| a[*k] == b[*k]);
    println!(
        "\n| quantize S,D,H,sd | veloq ms | G sub-vec/s | × naive | × GEMM | × Triton argmin | veloq extra memory |"
    );
    println!("|---|---|---|---|---|---|---|");
    for q in qt {
        let Some(b) =
            base["search"].as_array().and_then(|v| v.iter().find(|b| same(b, q, &["S", "D", "H", "sub_dim"])))
        else {
            continue;
        };
        let ms = get(q, "ms");
        // The naive anchor is skipped where its difference tensor would not fit.
        let naive = b["naive_ms"].as_f64().map_or("too big".into(), |n| format!("{:.0}×", n / ms));
        println!(
            "| {},{},{},{} | {ms:.4} | {:.2} | {naive} | {:.1}× | {:.1}× | 0 B (output only) |",
            q["S"],
            q["D"],
            q["H"],
            q["sub_dim"],
            get(q, "sub_vectors") / ms / 1e6,
            get(b, "gemm_ms") / ms,
            get(b, "triton_ms") / ms
        );
    }
    println!("\n| attention B,S | veloq ms | SDPA fp16 ms | veloq speed / SDPA | veloq GB/s on codes (of 4,800) | SDPA TB/s |");
    println!("|---|---|---|---|---|---|");
    let mut series: Vec<crate::plot::AttentionSeries> = Vec::new();
    for x in at {
        let Some(b) = base["sdpa"].as_array().and_then(|v| v.iter().find(|b| same(b, x, &["B", "S"]))) else {
            continue;
        };
        let (ms, sd) = (get(x, "ms"), get(b, "ms"));
        println!(
            "| {},{} | {ms:.4} | {sd:.4} | {:.2}× | {:.0} | {:.2} |",
            x["B"],
            x["S"],
            sd / ms,
            get(x, "code_bytes") / ms / 1e6,
            get(b, "kv_bytes") / sd / 1e9
        );
        let bb = x["B"].as_u64().unwrap_or(0) as usize;
        if !series.iter().any(|s| s.0 == bb) {
            series.push((bb, Vec::new(), Vec::new()));
        }
        let s = series.iter_mut().find(|s| s.0 == bb).expect("series");
        s.1.push((get(x, "S"), ms));
        s.2.push((get(x, "S"), sd));
    }
    if let Some(path) = plot {
        crate::plot::attention(path, &series)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
