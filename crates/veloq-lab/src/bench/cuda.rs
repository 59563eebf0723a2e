//! `veloq-lab bench cuda` (feature `cuda`): every CUDA kernel checked against the CPU path
//! (`veloq_lab::cuda_checks`, also the `cuda_kernels` tests), then timed with CUDA events (median
//! of many), with the two roofline numbers (FLOPs, bytes) per shape. PyTorch/Triton anchors come from
//! scripts/device/baselines.py in the same device call.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};
use serde_json::json;

use cudarc::driver::{CudaFunction, CudaSlice};
use veloq::codec::codebook::Granularity;
use veloq::kernels::cuda::{
    gemv_f16, gemv_f16_many, quantize_jobs, AttentionScratch, GemvEpilogue, GemvFused, GemvTune, Gpu, GpuCodec,
    QuantizeJob, QuantizeLaunch, RowMap, SplitKernel, GEMV_MAX_ROWS,
};
use veloq::kernels::{GemvShapes, KernelOptions};

pub(super) use veloq_lab::cuda_checks::{self, f16_bits, rel_mse, Variant};
pub(super) use veloq_lab::synthetic::{codec_of, Rng};

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
    /// Run only the attention checks (every shape for each variant, and the ragged batches), not
    /// the quantize, GEMV and conversion checks before them: for device calls about attention.
    #[arg(long)]
    attention_checks_only: bool,
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
    /// Code formats of the attention timing, comma separated, each `K/V` sub_dims: 4/4 (2 bits
    /// per element, `vq-2`), 2/2 (4 bits, the default `vq-4`), 2/4 (`vq-k4v2`). Each is timed
    /// with every kernel over the same grid.
    #[arg(long, value_delimiter = ',', default_value = "4/4")]
    sub_dims: Vec<String>,
}

/// `K/V` sub_dims of `--sub-dims`.
fn parse_sub_dims(s: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| -> Result<usize> {
        match x.trim().parse() {
            Ok(n @ (2 | 4)) => Ok(n),
            _ => bail!("--sub-dims {s}: key and value sub_dims are 2 or 4, as K/V"),
        }
    };
    match s.split_once('/') {
        Some((k, v)) => Ok((parse(k)?, parse(v)?)),
        None => bail!("--sub-dims {s}: K/V, e.g. 2/2"),
    }
}

/// Bits per element of codes with these sub_dims (256 centroids: 8 bits per sub-vector).
fn format_label((k, v): (usize, usize)) -> String {
    if k == v {
        format!("{:.1} bits", 8.0 / k as f64)
    } else {
        format!("K{} V{} ({:.1} bits)", 8 / k, 8 / v, (8.0 / k as f64 + 8.0 / v as f64) / 2.0)
    }
}

macro_rules! dev {
    ($e:expr) => {
        $e.map_err(|e| anyhow::anyhow!("{e:?}"))?
    };
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
        let default = GemvTune::for_rows(b, &GemvShapes::default());
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
/// plain products' ranking above does not carry over to a step (the shapes compete for the same
/// caches and the launches between them change what stays resident).
fn step_layers(
    gpu: &Gpu,
    rng: &mut Rng,
    reps: usize,
    mats: &[(usize, usize, Vec<CudaSlice<u16>>)],
    floor_ms: f64,
) -> Result<()> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    // The legacy default stream cannot be captured: a stream of its own.
    let gpu = &Gpu::from_stream(dev!(gpu.stream().context().new_stream()), gpu.options())?;
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
            GemvTune::for_rows(b, &GemvShapes::default())
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

/// Keys and values of `t` vectors of `h` kv heads on the device with their codecs (sub_dim `sd`,
/// 256 centroids, keys centred), to time their quantize launches.
struct KvCodes {
    keys: GpuCodec,
    values: GpuCodec,
    x: CudaSlice<u16>,
    key_codes: CudaSlice<u8>,
    value_codes: CudaSlice<u8>,
    heads: usize,
    map: RowMap,
}

impl KvCodes {
    fn new(gpu: &Gpu, rng: &mut Rng, (t, h, d, sd): (usize, usize, usize, usize)) -> Result<Self> {
        let (kc, vc) = (
            codec_of(rng, h, d, (sd, 8), Granularity::PerLayer, true)?,
            codec_of(rng, h, d, (sd, 8), Granularity::PerLayer, false)?,
        );
        let (keys, values) = (GpuCodec::upload(gpu, &kc)?, GpuCodec::upload(gpu, &vc)?);
        let st = gpu.stream();
        let x = dev!(st.clone_htod(&f16_bits(&rng.rows(t * h, d))));
        let key_codes = dev!(st.alloc_zeros::<u8>(keys.code_bytes(t * h)));
        let value_codes = dev!(st.alloc_zeros::<u8>(values.code_bytes(t * h)));
        Ok(Self { keys, values, x, key_codes, value_codes, heads: h, map: RowMap::tokens(t, h) })
    }

    /// Median ms of coding both: in one launch (`fused`) or one each, spread as `launch` says.
    fn time(&mut self, gpu: &Gpu, clear: &mut Clear, reps: usize, fused: bool, launch: QuantizeLaunch) -> Result<f64> {
        let Self { keys, values, x, key_codes, value_codes, heads, map } = self;
        time_ms(gpu, clear, reps, || {
            let (x, mut k, mut v) = (x.as_view(), key_codes.as_view_mut(), value_codes.as_view_mut());
            if fused {
                let mut jobs = [
                    QuantizeJob { codec: keys, x: &x, out: &mut k },
                    QuantizeJob { codec: values, x: &x, out: &mut v },
                ];
                quantize_jobs(gpu, &mut jobs, *heads, *map, launch)?;
            } else {
                quantize_jobs(gpu, &mut [QuantizeJob { codec: keys, x: &x, out: &mut k }], *heads, *map, launch)?;
                quantize_jobs(gpu, &mut [QuantizeJob { codec: values, x: &x, out: &mut v }], *heads, *map, launch)?;
            }
            Ok(())
        })
    }
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
    let mut codes = KvCodes::new(gpu, rng, (t, h, d, 4))?;
    let one_thread = QuantizeLaunch { slices: Some(1), ..QuantizeLaunch::default() };
    let before = codes.time(gpu, clear, reps, false, one_thread)?;
    let spread = codes.time(gpu, clear, reps, false, QuantizeLaunch::default())?;
    let one = codes.time(gpu, clear, reps, true, QuantizeLaunch::default())?;
    println!("| {t}×{h}, D {d} | {before:.4} | {spread:.4} | {one:.4} | {:.2}× |", before / one);
    Ok(
        json!({"t": t, "heads": h, "D": d, "two_launches_one_thread_ms": before, "two_launches_spread_ms": spread, "one_launch_ms": one}),
    )
}

/// A prompt chunk's codes (`t` vectors of `h` kv heads, keys and values in one launch, sub_dim
/// `sd`, 256 centroids) with its rows tiled for each of `per_sm` blocks per multiprocessor, timed
/// back to back in this call.
fn time_chunk_quantize(
    gpu: &Gpu,
    rng: &mut Rng,
    clear: &mut Clear,
    reps: usize,
    (t, h, d, sd): (usize, usize, usize, usize),
    per_sm: &[usize],
) -> Result<serde_json::Value> {
    let mut codes = KvCodes::new(gpu, rng, (t, h, d, sd))?;
    let ms = per_sm
        .iter()
        .map(|&n| {
            let launch = QuantizeLaunch { blocks_per_sm: Some(n), ..QuantizeLaunch::default() };
            codes.time(gpu, clear, reps, true, launch)
        })
        .collect::<Result<Vec<_>>>()?;
    let cells: Vec<String> = ms.iter().map(|m| format!("{m:.4}")).collect();
    println!("| {t}×{h}, D {d}, sd {sd} | {} |", cells.join(" | "));
    Ok(json!({"t": t, "heads": h, "D": d, "sub_dim": sd, "blocks_per_sm": per_sm, "ms": ms}))
}

/// Codes of sub-vectors of 2 (the default's format; keys and values in one launch): every
/// centroid scanned, then only the books' candidate lists, timed back to back in this call
/// (the codes are the same: the checks compare them).
fn time_grid_quantize(
    gpu: &Gpu,
    rng: &mut Rng,
    clear: &mut Clear,
    reps: usize,
    (t, h, d): (usize, usize, usize),
) -> Result<serde_json::Value> {
    let mut codes = KvCodes::new(gpu, rng, (t, h, d, 2))?;
    let full = codes.time(gpu, clear, reps, true, QuantizeLaunch { grid: Some(false), ..QuantizeLaunch::default() })?;
    let grid = codes.time(gpu, clear, reps, true, QuantizeLaunch::default())?;
    println!("| {t}×{h}, D {d} | {full:.4} | {grid:.4} | {:.2}× |", full / grid);
    Ok(json!({"t": t, "heads": h, "D": d, "full_scan_ms": full, "grid_ms": grid}))
}

/// Quantize timing: the anchors' shapes (S, D, H, sub_dim), 256 centroids.
const QUANTIZE_SHAPES: [(usize, usize, usize, usize); 5] =
    [(2048, 128, 8, 8), (8192, 128, 8, 8), (131072, 128, 8, 8), (4096, 256, 4, 4), (131072, 128, 8, 4)];

pub fn run(a: Args) -> Result<()> {
    let gpu = Gpu::new(0, KernelOptions::default()).context("opening GPU 0")?;
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
    let formats = a.sub_dims.iter().map(|s| parse_sub_dims(s)).collect::<Result<Vec<_>>>()?;
    if formats.is_empty() {
        bail!("--sub-dims names no format");
    }
    match a.profile[..] {
        [] => {}
        [b, s] => {
            time_attention(&gpu, &mut rng, vec![(b, s)], &mut Clear::Nothing, 1, variants[0], formats[0])?;
            return Ok(());
        }
        _ => bail!("--profile takes B,S"),
    }
    let checks = if a.skip_checks {
        Vec::new()
    } else if a.attention_checks_only {
        cuda_checks::attention(&gpu, &mut rng, &variants)?
    } else {
        cuda_checks::all(&gpu, &mut rng, &variants)?
    };
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
        let c = codec_of(&mut rng, h, d, (sd, 8), Granularity::PerLayer, true)?;
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
    let mut chunks = Vec::new();
    if !a.skip_quantize {
        let per_sm = [1, 2, 4, 8];
        let head: Vec<String> = per_sm.iter().map(|n| format!("{n} block(s)/SM ms")).collect();
        println!("\n| a chunk's codes t×kv heads (keys + values, one launch) | {} |", head.join(" | "));
        println!("|---|{}", "---|".repeat(per_sm.len()));
        for shape in [(512, 8, 128, 2), (2048, 8, 128, 2), (512, 8, 128, 4), (64, 8, 128, 2), (512, 3, 64, 2)] {
            chunks.push(time_chunk_quantize(&gpu, &mut rng, &mut clear, a.reps, shape, &per_sm)?);
        }
    }
    let mut grids = Vec::new();
    if !a.skip_quantize {
        println!("\n| sub-vectors of 2, t×kv heads (keys + values, one launch) | every centroid ms | candidate lists ms | speed-up |");
        println!("|---|---|---|---|");
        for shape in [(512, 8, 128), (2048, 8, 128), (64, 8, 128), (8, 8, 128), (8, 64, 128), (512, 3, 64)] {
            grids.push(time_grid_quantize(&gpu, &mut rng, &mut clear, a.reps, shape)?);
        }
    }
    // Decode attention timing: Llama-3.1-8B geometry, each code format (256 centroids).
    println!("\n| attention B,S (Hq 32, Hkv 8, D 128) | kernel | ms | code MiB | GB/s | splits |");
    println!("|---|---|---|---|---|---|");
    let mut at = Vec::new();
    for &f in &formats {
        for &v in &variants {
            let grid = a.batches.iter().flat_map(|&b| a.contexts.iter().map(move |&s| (b, s))).collect();
            at.extend(time_attention(&gpu, &mut rng, grid, &mut clear, a.reps, v, f)?);
        }
    }
    side_by_side(&at);
    if let Some(path) = &a.baselines {
        let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        // The figure draws the first kernel and format; the table every one.
        let first = at.first().map(|x| x["kernel"].clone());
        ratios(&base, &qt, &at, first.as_ref(), a.plot.as_deref())?;
    }
    let timing = a.timing.to_possible_value().map(|v| v.get_name().to_string());
    write_json(
        &a.json,
        &json!({"gpu": gpu.name(), "seed": seed, "timing": timing, "checks": checks, "quantize": qt, "flushes": flushes, "chunk_quantize": chunks, "grid_quantize": grids, "attention": at}),
    )
}

/// Times decode attention over codes of sub_dims `sd` (keys, values; 256 centroids) in the
/// Llama-3.1-8B geometry for each (batch, positions), printing a table row each.
fn time_attention(
    gpu: &Gpu,
    rng: &mut Rng,
    shapes: Vec<(usize, usize)>,
    clear: &mut Clear,
    reps: usize,
    v: Variant,
    sd: (usize, usize),
) -> Result<Vec<serde_json::Value>> {
    let st = gpu.stream();
    let mut at = Vec::new();
    let (hq, hkv, d, w) = (32, 8, 128, 16);
    let kc = codec_of(rng, hkv, d, (sd.0, 8), Granularity::PerLayer, true)?;
    let vc = codec_of(rng, hkv, d, (sd.1, 8), Granularity::PerLayer, false)?;
    let att = v.build(gpu, &kc, &vc, hq)?;
    let label = format!("{}, {}", v.label().0, format_label(sd));
    for (b, s) in shapes {
        let random = |n: usize, rng: &mut Rng| -> Vec<u8> {
            (0..n).map(|i| (rng.uniform() * 256.0) as u8 ^ (i as u8)).collect()
        };
        let (nk, nv) = (b * hkv * s * (d / sd.0), b * hkv * s * (d / sd.1));
        let kcd = dev!(st.clone_htod(&random(nk, rng)));
        let vcd = dev!(st.clone_htod(&random(nv, rng)));
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
        let bytes = (nk + nv) as f64;
        println!(
            "| {b},{s} | {label} | {ms:.4} | {:.1} | {:.0} | {splits} |",
            bytes / (1 << 20) as f64,
            bytes / ms / 1e6
        );
        at.push(json!({"B": b, "S": s, "kernel": label, "sub_dims": [sd.0, sd.1], "Hq": hq, "Hkv": hkv, "D": d, "W": w, "ms": ms, "code_bytes": bytes, "splits": splits,
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
    plotted: Option<&serde_json::Value>,
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
    println!("\n| attention B,S | kernel, format | veloq ms | SDPA fp16 ms | veloq speed / SDPA | veloq GB/s on codes (of 4,800) | SDPA TB/s |");
    println!("|---|---|---|---|---|---|---|");
    let mut series: Vec<veloq_lab::plot::AttentionSeries> = Vec::new();
    for x in at {
        let Some(b) = base["sdpa"].as_array().and_then(|v| v.iter().find(|b| same(b, x, &["B", "S"]))) else {
            continue;
        };
        let (ms, sd) = (get(x, "ms"), get(b, "ms"));
        println!(
            "| {},{} | {} | {ms:.4} | {sd:.4} | {:.2}× | {:.0} | {:.2} |",
            x["B"],
            x["S"],
            x["kernel"].as_str().unwrap_or("?"),
            sd / ms,
            get(x, "code_bytes") / ms / 1e6,
            get(b, "kv_bytes") / sd / 1e9
        );
        if Some(&x["kernel"]) != plotted {
            continue;
        }
        let bb = x["B"].as_u64().unwrap_or(0) as usize;
        if !series.iter().any(|s| s.0 == bb) {
            series.push((bb, Vec::new(), Vec::new()));
        }
        let s = series.iter_mut().find(|s| s.0 == bb).expect("series");
        s.1.push((get(x, "S"), ms));
        s.2.push((get(x, "S"), sd));
    }
    if let Some(path) = plot {
        veloq_lab::plot::attention(path, &series)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
