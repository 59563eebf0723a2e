//! `veloq bench runner`: the model runner on a CUDA device, fp16 cache vs VecInfer codes, what a
//! user sees. In one run (the caches' correctness on CUDA is the conformance suite's,
//! `tests/conformance.rs`, which the device smoke script runs):
//! 2. agreement: greedy SmolLM2 on the CPU and on CUDA (fp16 and VecInfer), and the CUDA logits
//!    teacher-forced on the CPU's tokens; on CUDA (SmolLM2 and the 8B), CUDA graphs off and on
//!    (must be identical), and a batch of 8 through veloq's GEMV + graphs against cuBLAS eager
//!    (within rounding);
//! 3. decode tok/s, peak allocator memory and launches per layer-step at each context and batch,
//!    on the real SmolLM2 and on a random-weight Llama-3.1-8B geometry, on each decode path
//!    (`--paths`: eager, CUDA graphs, with or without veloq's GEMV) beside the bytes floor (the
//!    weights and the caches' resident bytes at the copy bandwidth measured in the same run).
//!    Caches are filled with random keys and values (speed does not depend on their values), then
//!    the model decodes; each graph path's step is then timed part by part (CUDA events between
//!    the segments' products, rows in, attention and flushes);
//! 4. the longest context each cache fits in a fixed memory budget (allocated and measured).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::Args as ClapArgs;
use serde_json::{json, Value};

use veloq::artifact::Calibration;
use veloq::kernels::cuda::Gpu;
use veloq_candle::cache::{CudaRuntime, ModelCache, SeqStep, Step};
use veloq_candle::config::CacheConfig;
use veloq_candle::generate::prompt_ids;
use veloq_candle::model::{Logits, Model};
use veloq_candle::runtime::{CudaOptions, Device as VDevice};
use veloq_candle::{Forward, Method, Runner};
use veloq_lab::synthetic::Geometry;

use super::cuda::{copy_bandwidth, Rng};
use super::write_json;
use veloq_candle::units::human_bytes as human;
use veloq_cli::args::{CudaFlags, Files as ModelFiles};
use veloq_lab::synthetic::synthetic_calibration;

#[derive(ClapArgs)]
pub struct Args {
    // The real model (GGUF) and its calibration; default SmolLM2 from scripts/fetch-data.
    #[command(flatten)]
    pub(crate) files: ModelFiles,
    /// Contexts (positions already cached when decoding starts).
    #[arg(long, value_delimiter = ',', default_value = "1024,8192,32768,131072")]
    contexts: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<usize>,
    /// Timed decode steps per case (after 4 untimed); the median step is reported.
    #[arg(long, default_value_t = 24)]
    steps: usize,
    /// Memory budget for the longest-context search, GiB of KV cache (batch 1).
    #[arg(long, default_value_t = 16.0)]
    budget_gib: f64,
    /// Greedy tokens compared between CPU and CUDA.
    #[arg(long, default_value_t = 32)]
    agree_tokens: usize,
    #[arg(long, default_value = "Why is the sky blue? Answer in two sentences.")]
    prompt: String,
    /// Decode paths to time side by side: `graphs` (the default: segments between attention
    /// calls replayed from CUDA graphs, f16 weights through veloq's GEMV), `eager` (every
    /// operation issued one by one, cuBLAS, flushes on the main stream: the path before all of
    /// it), `graphs-cublas`, `eager-gemv`, `graphs-flush-inline` (graphs with the flushes on the
    /// main stream, between the layers' work), `graphs-serial` (graphs with every kernel launched
    /// after the last has finished: no programmatic dependent launch), `eager-release` (eager with
    /// the memory a step frees given back to the driver at each synchronisation).
    #[arg(long, value_delimiter = ',', default_value = "eager,graphs")]
    paths: Vec<String>,
    /// The VecInfer method timed beside fp16, the default's by default (SmolLM2 reads its
    /// calibration file; the 8B geometry gets random codebooks of its shape).
    #[arg(long, default_value_t = Method::default())]
    method: Method,
    /// Models to time: smollm2 (the real file) and/or llama8b (random weights, f16).
    #[arg(long, value_delimiter = ',', default_value = "smollm2,llama8b")]
    models: Vec<String>,
    /// What SmolLM2's quantized weights are multiplied as (stored, f16, f32; the 8B's are f16).
    #[arg(long, default_value = "stored")]
    weights: veloq_candle::model::Weights,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Figure: decode tok/s against context, one line per method, a panel per model and batch.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Redraw the figure (--plot) from this JSON of an earlier run; measures nothing.
    #[arg(long)]
    replot: Option<PathBuf>,
    /// The anchor's JSON (`scripts/device/hf_decode.py`: transformers + torch.compile on the 8B
    /// geometry), drawn beside the 8B panels of the figure.
    #[arg(long)]
    anchor: Option<PathBuf>,
    /// The CUDA options (GEMV launch shapes, kernel cache); each path of --paths sets its own
    /// graphs, GEMV, flush-stream and overlapped-launch switches over them.
    #[command(flatten)]
    cuda: CudaFlags,
}

/// Panels of the figure from the JSON rows: (model, batch) → method → (context, tok/s).
fn figure(runs: &[Value]) -> veloq_lab::plot::Panels {
    let mut panels = veloq_lab::plot::Panels::new();
    for r in runs.iter().filter(|r| r["fits"].as_bool() == Some(true)) {
        let model = r["model"].as_str().unwrap_or("?");
        let title = format!("{}, batch {}", model.split(" (").next().unwrap_or(model), r["batch"]);
        let method = match r["path"].as_str() {
            Some(p) => format!("{} ({p})", r["method"].as_str().unwrap_or("?")),
            None => r["method"].as_str().unwrap_or("?").to_string(),
        };
        let point = (r["context"].as_f64().unwrap_or(0.0), r["tok_s"].as_f64().unwrap_or(0.0));
        let pi = panels.iter().position(|p| p.0 == title).unwrap_or_else(|| {
            panels.push((title, Vec::new()));
            panels.len() - 1
        });
        let lines = &mut panels[pi].1;
        match lines.iter_mut().find(|l| l.0 == method) {
            Some(l) => l.1.push(point),
            None => lines.push((method, vec![point])),
        }
    }
    panels
}

/// The 8B model's label (before the parameter count), which names its figure panels.
const LLAMA8B: &str = "Llama-3.1-8B geometry, random f16 weights";

/// The anchor's rows as lines in the 8B panels ("transformers + torch.compile").
fn anchor_lines(panels: &mut veloq_lab::plot::Panels, anchor: &Value) {
    let name = format!("transformers + torch.compile ({})", anchor["dtype"].as_str().unwrap_or("fp16"));
    for r in anchor["rows"].as_array().into_iter().flatten() {
        let (Some(ctx), Some(tps)) = (r["context"].as_f64(), r["tok_s"].as_f64()) else { continue };
        let title = format!("{LLAMA8B}, batch {}", r["batch"]);
        if let Some(p) = panels.iter_mut().find(|p| p.0 == title) {
            match p.1.iter_mut().find(|l| l.0 == name) {
                Some(l) => l.1.push((ctx, tps)),
                None => p.1.push((name.clone(), vec![(ctx, tps)])),
            }
        }
    }
}

/// The parts of a graph step, bottom first, as `phases_ms_per_step` names them.
const PARTS: [(&str, &str); 5] = [
    ("segments", "segments (products, head)"),
    ("rows_in", "rows in"),
    ("attention", "attention"),
    ("flush", "flushes"),
    ("io", "ids, logits"),
];

/// Stacked bars of where the default path's step goes, per (model, batch): a bar per (context,
/// method), the bytes floor beside it.
fn parts_figure(runs: &[Value]) -> Vec<veloq_lab::plot::Stacks> {
    let mut panels: Vec<veloq_lab::plot::Stacks> = Vec::new();
    for r in runs.iter().filter(|r| r["path"] == "graphs" && r["phases_ms_per_step"].is_object()) {
        let model = r["model"].as_str().unwrap_or("?");
        let title = format!("{}, batch {}: GPU ms a step", model.split(" (").next().unwrap_or(model), r["batch"]);
        let ctx = r["context"].as_u64().unwrap_or(0);
        let method = if r["method"].as_str().unwrap_or("").starts_with("vecinfer") { "VQ" } else { "fp16" };
        let ph = &r["phases_ms_per_step"];
        let bar = (
            format!("{}k {method}", ctx / 1024),
            PARTS.map(|(k, _)| ph[k].as_f64().unwrap_or(0.0)).to_vec(),
            r["floor_ms"].as_f64(),
        );
        match panels.iter_mut().find(|p| p.title == title) {
            Some(p) => p.bars.push(bar),
            None => panels.push(veloq_lab::plot::Stacks { title, bars: vec![bar] }),
        }
    }
    panels
}

fn plot(path: &std::path::Path, json: &Value, anchor: Option<&Value>) -> Result<()> {
    let runs = json["runs"].as_array().cloned().unwrap_or_default();
    let mut panels = figure(&runs);
    if let Some(a) = anchor {
        anchor_lines(&mut panels, a);
    }
    let device = json["device"].as_str().unwrap_or("GPU");
    veloq_lab::plot::speed(path, device, "context (tokens)", "decode tokens/s", &panels)?;
    eprintln!("wrote {}", path.display());
    // Beside it, `<name>-parts.png`: where each graph step's time goes.
    let parts = parts_figure(&runs);
    if !parts.is_empty() {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("runner");
        let out = path.with_file_name(format!("{stem}-parts.png"));
        veloq_lab::plot::stacked(&out, device, "ms per decode step", &PARTS.map(|(_, name)| name), &parts)?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

/// Greedy tokens and per-step logits on `model`; with `forced`, those tokens are fed instead of the
/// model's own choices (teacher forcing).
fn greedy(
    model: &dyn Forward,
    cfg: &CacheConfig,
    prompt: &[u32],
    n: usize,
    forced: Option<&[u32]>,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut caches = cfg.build(model.model())?;
    let mut logits = model.forward(prompt, &mut caches, Logits::Last)?.squeeze(0)?;
    let (mut tokens, mut all) = (Vec::new(), Vec::new());
    for i in 0..n {
        let l = logits.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
        let best = argmax(&l);
        all.push(l);
        let next = forced.map_or(best, |f| f[i]);
        tokens.push(best);
        if i + 1 < n {
            logits = model.forward(&[next], &mut caches, Logits::Last)?.squeeze(0)?;
        }
    }
    Ok((tokens, all))
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
        as u32
}

/// Top-1 minus top-2 logit.
fn margin(x: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in x {
        if v > a {
            (a, b) = (v, a);
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Greedy decoding on the CPU and on CUDA with the same cache method: where the free runs part,
/// and, teacher-forced on the CPU's tokens, how far the CUDA logits are from the CPU's.
fn agreement(cpu: &Model, gpu: &Runner, cfg: &CacheConfig, prompt: &[u32], n: usize) -> Result<Value> {
    let (cpu_tok, cpu_logits) = greedy(cpu, cfg, prompt, n, None)?;
    let (gpu_tok, _) = greedy(gpu, cfg, prompt, n, None)?;
    let (forced_tok, forced_logits) = greedy(gpu, cfg, prompt, n, Some(&cpu_tok))?;
    let first_diff = cpu_tok.iter().zip(&gpu_tok).position(|(a, b)| a != b);
    let top1 = cpu_tok.iter().zip(&forced_tok).filter(|(a, b)| a == b).count();
    let max_dlogit = cpu_logits
        .iter()
        .zip(&forced_logits)
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max))
        .fold(0.0f32, f32::max);
    let at_diff = first_diff.map(|i| json!({"step": i, "cpu_token": cpu_tok[i], "cuda_token": gpu_tok[i], "cpu_top2_margin": margin(&cpu_logits[i]),
        "max_abs_logit_diff_there": cpu_logits[i].iter().zip(&forced_logits[i]).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)}));
    println!(
        "  {:<22} greedy tokens equal: {} of {n}{}; teacher-forced top-1 {top1}/{n}, max |Δlogit| {max_dlogit:.3}",
        cfg.name(),
        first_diff.unwrap_or(n),
        first_diff.map_or(String::new(), |i| format!(
            " (first difference at token {i}: CPU top-2 margin there {:.3})",
            margin(&cpu_logits[i])
        )),
    );
    Ok(json!({"method": cfg.name(), "tokens": n, "equal_prefix": first_diff.unwrap_or(n), "first_difference": at_diff,
              "teacher_forced_top1": top1, "max_abs_logit_diff": max_dlogit, "cpu_tokens": cpu_tok, "cuda_tokens": gpu_tok}))
}

/// Greedy decoding on CUDA with CUDA graphs off and on (same model, same cache method): the
/// replayed segments must give the eager path's tokens; where both runs fed the same tokens, the
/// largest logit difference.
fn graph_agreement(gpu: &Runner, cfg: &CacheConfig, prompt: &[u32], n: usize) -> Result<Value> {
    gpu.set_cuda_graphs(false);
    let (eager, eager_logits) = greedy(gpu, cfg, prompt, n, None)?;
    gpu.set_cuda_graphs(true);
    let launches0 = gpu.cuda_graph_launches();
    let (graphs, graph_logits) = greedy(gpu, cfg, prompt, n, None)?;
    let launched = gpu.cuda_graph_launches() - launches0;
    let same = eager.iter().zip(&graphs).position(|(a, b)| a != b).unwrap_or(n);
    let max_dlogit = eager_logits
        .iter()
        .zip(&graph_logits)
        .take(same + 1)
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max))
        .fold(0.0f32, f32::max);
    println!(
        "  {:<22} CUDA graphs vs eager: greedy tokens equal {same} of {n}, max |Δlogit| {max_dlogit:.4} ({launched} graph launches)",
        cfg.name()
    );
    if launched == 0 {
        anyhow::bail!("{}: the graph path launched no graph", cfg.name());
    }
    // The same kernels replayed: any difference is a replay that read or wrote the wrong buffer.
    if same < n || max_dlogit > 1e-3 {
        anyhow::bail!(
            "{}: CUDA graphs changed the output (tokens equal {same} of {n}, max |Δlogit| {max_dlogit})",
            cfg.name()
        );
    }
    Ok(json!({"method": cfg.name(), "tokens": n, "equal_prefix": same, "max_abs_logit_diff": max_dlogit,
              "graph_launches": launched, "eager_tokens": eager, "graph_tokens": graphs}))
}

/// Decode steps past the agreement's in the flush-stream check: with the default window (sink 4,
/// window 16, flush block 8) a short prompt reaches its first flush within 28 positions.
const FLUSH_CHECK_STEPS: usize = 40;

/// Per decode step: every sequence's token, and the batch's logits end to end.
type Run = (Vec<Vec<u32>>, Vec<Vec<f32>>);

/// What [`batch_run`] saw: the prompts' last logits, one sequence after another, and the steps.
struct BatchRun {
    prompts: Vec<f32>,
    steps: Run,
}

/// `batch` sequences, sequence s prefilled with the prompt less `stride · s` tokens (one chunk
/// each), then `n` greedy decode steps of the whole batch, on `gpu` as its switches stand.
fn batch_run(
    gpu: &Runner,
    cfg: &CacheConfig,
    prompt: &[u32],
    n: usize,
    batch: usize,
    stride: usize,
) -> Result<BatchRun> {
    // Sized to the run, not the model's context (8 sequences of an 8B at 128k do not fit).
    let sized = CacheConfig { capacity: Some(prompt.len() + n + 16), ..cfg.clone() };
    let mut caches = sized.build_batch(gpu.model(), batch)?;
    let (mut tokens, mut prompts) = (Vec::with_capacity(batch), Vec::new());
    for s in 0..batch {
        let p = &prompt[..prompt.len().saturating_sub(stride * s).max(1)];
        let l = gpu.forward_step(p, &Step::single(s, 0, p.len())?, &mut caches, Logits::Last)?;
        let l = l.flatten_all()?.to_vec1::<f32>()?;
        tokens.push(argmax(&l));
        prompts.extend(l);
    }
    let (mut all_tokens, mut all_logits) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let starts: Vec<usize> = (0..batch).map(|s| caches.len(s)).collect();
        let l = gpu.forward_step(&tokens, &Step::decode(&starts)?, &mut caches, Logits::Last)?;
        let rows = l.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        tokens = rows.iter().map(|r| argmax(r)).collect();
        all_tokens.push(tokens.clone());
        all_logits.push(rows.concat());
    }
    Ok(BatchRun { prompts, steps: (all_tokens, all_logits) })
}

/// Batch decoding on CUDA, cuBLAS and eager steps against veloq's GEMV (tensor cores from 2
/// rows, fused q/k/v and gated MLP) replayed from graphs: sequence s of the batch is the prompt
/// less its last s tokens. Both round activations to f16 before the weights; cuBLAS rounds its
/// outputs to f16 as well, so tokens may part at a near-tie. Fails when the first batched step's
/// logits differ by more than 5% of their rms (a wrong product, not rounding). The GEMV run goes
/// on for [`FLUSH_CHECK_STEPS`] more steps (a few flushes of every layer, whatever the prompt) and
/// is repeated with the caches' flushes on the main stream and with every kernel launched after
/// its predecessor ended (no programmatic dependent launch): the same arithmetic, so the logits
/// must be identical (a flush on its own stream, or a kernel started early, that raced the step
/// would change them).
fn batch_agreement(
    gpu: &Runner,
    rt: &CudaRuntime,
    cfg: &CacheConfig,
    prompt: &[u32],
    n: usize,
    batch: usize,
) -> Result<Value> {
    let aside = rt.flushes_aside();
    let overlap = rt.gpu().options().overlapped_launches;
    let run = |fast: bool, flush_aside: bool, overlapped: bool, n: usize| -> Result<Run> {
        gpu.set_cuda_graphs(fast);
        set_cuda(rt, fast, flush_aside, overlapped, true)?;
        Ok(batch_run(gpu, cfg, prompt, n, batch, 1)?.steps)
    };
    let m = n + FLUSH_CHECK_STEPS;
    let (slow, slow_logits) = run(false, aside, overlap, n)?;
    let (mut fast, mut fast_logits) = run(true, aside, overlap, m)?;
    let (inline, inline_logits) = run(true, false, overlap, m)?;
    let (serial, serial_logits) = run(true, aside, !overlap, m)?;
    gpu.set_cuda_graphs(true);
    set_cuda(rt, true, aside, overlap, true)?;
    let stream_same = inline == fast && inline_logits == fast_logits;
    let launch_same = serial == fast && serial_logits == fast_logits;
    fast.truncate(n);
    fast_logits.truncate(n);
    let same = slow.iter().zip(&fast).position(|(a, b)| a != b).unwrap_or(n);
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    let rms = (slow_logits[0].iter().map(|v| v * v).sum::<f32>() / slow_logits[0].len() as f32).sqrt();
    let first = diff(&slow_logits[0], &fast_logits[0]);
    let upto = slow_logits.iter().zip(&fast_logits).take(same + 1).map(|(a, b)| diff(a, b)).fold(0.0f32, f32::max);
    println!(
        "  {:<22} batch {batch}, GEMV + graphs vs cuBLAS eager: every sequence's tokens equal for {same} of {n} steps; \
         first step max |Δlogit| {first:.4} (logits' rms {rms:.2}), {upto:.4} while equal; flushes on {} vs main stream: {}; \
         launches {} vs {}: {}",
        cfg.name(),
        if aside { "their own" } else { "the main" },
        if stream_same { format!("logits identical over {m} steps") } else { "DIFFER".into() },
        if overlap { "overlapped" } else { "serial" },
        if overlap { "serial" } else { "overlapped" },
        if launch_same { format!("identical over {m} steps") } else { "DIFFER".into() }
    );
    if !stream_same {
        anyhow::bail!("{}: batch {batch} logits depend on which stream flushes", cfg.name());
    }
    if !launch_same {
        anyhow::bail!("{}: batch {batch} logits depend on whether launches overlap", cfg.name());
    }
    if first.is_nan() || first > 0.05 * rms {
        anyhow::bail!("{}: batch {batch} logits differ by {first} (rms {rms}) on the first batched step", cfg.name());
    }
    Ok(
        json!({"method": cfg.name(), "batch": batch, "steps": n, "equal_steps": same, "first_step_max_abs_logit_diff": first,
              "logit_rms": rms, "max_abs_logit_diff_while_equal": upto, "cublas_tokens": slow, "gemv_tokens": fast,
              "flushes_aside": aside, "flush_stream_identical": stream_same, "overlapped_launches": overlap,
              "launch_overlap_identical": launch_same}),
    )
}

/// The f16 row path (prompt chunks and batches past the GEMV's rows multiplied as f16
/// activations, veloq's row kernels between the products) against candle's f32 path with a cast
/// on each side of every product: `batch` sequences prefilled (one chunk each), then `n` greedy
/// decode steps of the whole batch, both paths in eager steps. The products and activations
/// round alike; the norm sums in another order, and the f16 roundings that flips compound over
/// the layers as any reordering does (cuBLAS against veloq's GEMV, the check above, differs by
/// as much), so the logits must agree within the bound that check holds: 5% of their rms — after
/// the prompts (a one-chunk prompt attends its own f16 rows) for every cache, after the batched
/// step for fp16 only: with codes, keys that differ by an f16 rounding may take another centroid
/// of a random codebook, which no arithmetic argument bounds (reported, not checked).
fn rows_agreement(
    gpu: &Runner,
    rt: &CudaRuntime,
    cfg: &CacheConfig,
    prompt: &[u32],
    n: usize,
    batch: usize,
) -> Result<Value> {
    let (aside, overlap, was) = (rt.flushes_aside(), rt.gpu().options().overlapped_launches, rt.f16_rows());
    let run = |rows: bool| -> Result<BatchRun> {
        gpu.set_cuda_graphs(false);
        set_cuda_rows(rt, true, rows, aside, overlap, true)?;
        batch_run(gpu, cfg, prompt, n, batch, 3)
    };
    let (slow, fast) = (run(false)?, run(true)?);
    gpu.set_cuda_graphs(true);
    set_cuda_rows(rt, true, was, aside, overlap, true)?;
    let ((f32_tokens, f32_logits), (f16_tokens, f16_logits)) = (&slow.steps, &fast.steps);
    let same = f32_tokens.iter().zip(f16_tokens).position(|(a, b)| a != b).unwrap_or(n);
    let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    let rms = (slow.prompts.iter().map(|v| v * v).sum::<f32>() / slow.prompts.len() as f32).sqrt();
    let prefill = diff(&slow.prompts, &fast.prompts);
    let decode = diff(&f32_logits[0], &f16_logits[0]);
    println!(
        "  {:<22} f16 rows vs f32 path: {batch} prompts (≤ {} tokens) and {n} steps of {batch}: tokens equal for {same} of {n} \
         steps; max |Δlogit| after the prompts {prefill:.4}, first batched step {decode:.4} (logits' rms {rms:.2})",
        cfg.name(),
        prompt.len(),
    );
    // With codes the batched step is reported, not checked (above).
    let checked = match cfg.method {
        veloq_candle::Method::Fp16 => &[("prompts", prefill), ("batched step", decode)][..],
        _ => &[("prompts", prefill)][..],
    };
    for &(what, d) in checked {
        if d.is_nan() || d > 0.05 * rms {
            anyhow::bail!("{}: f16 rows and the f32 path differ by {d} (rms {rms}) after the {what}", cfg.name());
        }
    }
    Ok(
        json!({"method": cfg.name(), "batch": batch, "steps": n, "equal_steps": same, "prompt_max_abs_logit_diff": prefill,
              "first_batched_step_max_abs_logit_diff": decode, "logit_rms": rms, "f32_tokens": f32_tokens, "f16_rows_tokens": f16_tokens}),
    )
}

/// Whether `e` is the device running out of memory (a typed error from the caches or candle).
fn is_oom(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<veloq_candle::Error>().is_some_and(veloq_candle::Error::is_out_of_memory)
            || c.downcast_ref::<veloq::Error>().is_some_and(|e| matches!(e, veloq::Error::OutOfMemory(_)))
    })
}

/// Appends `ctx` random positions to every sequence of every layer's cache (chunks of 4096,
/// committed, never attended: speed does not depend on the values).
fn fill(model: &Model, caches: &mut ModelCache, batch: usize, ctx: usize) -> Result<()> {
    let id = &model.info.identity;
    let mut done = 0;
    while done < ctx {
        let n = (ctx - done).min(4096);
        let shape = (batch * n, id.n_kv_heads, id.head_dim);
        let (k, v) =
            (Tensor::randn(0f32, 1.0, shape, model.device())?, Tensor::randn(0f32, 1.0, shape, model.device())?);
        let step = Step::new((0..batch).map(|slot| SeqStep { slot, start: done, len: n }).collect())?;
        for c in caches.layers_mut() {
            c.append(&k, &v, &step)?;
            c.commit()?;
        }
        done += n;
    }
    Ok(())
}

/// One greedy decode step for every sequence of the batch (the argmax comes back to the host, as
/// in generation).
fn step(model: &Runner, caches: &mut ModelCache, tokens: &mut Vec<u32>) -> Result<()> {
    let starts: Vec<usize> = (0..tokens.len()).map(|s| caches.len(s)).collect();
    let logits = model.forward_step(tokens, &Step::decode(&starts)?, caches, Logits::Last)?;
    *tokens = logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?;
    Ok(())
}

/// Untimed decode steps before timing (host clocks and caches settle).
const WARMUP: usize = 4;

/// Graph steps timed part by part after the medians (two flushes of an 8-row block among them).
const PHASE_STEPS: usize = 16;

/// A decode path: whether the step replays CUDA graphs, whether f16 weights take veloq's GEMV,
/// whether flushes run on their own stream, whether kernels start before their predecessor ends
/// (programmatic dependent launch) and whether freed device memory stays in the pool.
#[derive(Clone)]
struct Path {
    name: String,
    graphs: bool,
    gemv: bool,
    flush_aside: bool,
    overlap: bool,
    keep_freed: bool,
}

impl Path {
    fn set(&self, model: &Runner, rt: &CudaRuntime) -> Result<()> {
        model.set_cuda_graphs(self.graphs);
        set_cuda(rt, self.gemv, self.flush_aside, self.overlap, self.keep_freed)
    }
}

/// The runtime's GEMV, flush-stream, overlapped-launch and pool switches, the rest of its options
/// kept.
fn set_cuda(rt: &CudaRuntime, gemv: bool, flush_stream: bool, overlapped: bool, keep_freed: bool) -> Result<()> {
    set_cuda_rows(rt, gemv, rt.f16_rows(), flush_stream, overlapped, keep_freed)
}

/// [`set_cuda`] with the f16 row path's switch too.
fn set_cuda_rows(
    rt: &CudaRuntime,
    gemv: bool,
    f16_rows: bool,
    flush_stream: bool,
    overlapped: bool,
    keep_freed: bool,
) -> Result<()> {
    let mut kernels = rt.gpu().options();
    kernels.overlapped_launches = overlapped;
    rt.set_options(&CudaOptions {
        graphs: true,
        gemv,
        f16_rows,
        flush_stream,
        keep_freed_memory: keep_freed,
        ragged_decode: true,
        kernels,
    })?;
    Ok(())
}

fn parse_paths(names: &[String]) -> Result<Vec<Path>> {
    names
        .iter()
        .map(|p| {
            let (graphs, gemv, flush_aside, overlap, keep_freed) = match p.as_str() {
                "eager" => (false, false, false, false, true),
                "eager-release" => (false, false, false, false, false),
                "eager-gemv" => (false, true, true, true, true),
                "graphs-cublas" => (true, false, true, true, true),
                "graphs" => (true, true, true, true, true),
                "graphs-flush-inline" => (true, true, false, true, true),
                "graphs-serial" => (true, true, true, false, true),
                other => anyhow::bail!(
                    "unknown decode path {other:?} (eager, eager-release, eager-gemv, graphs-cublas, graphs, graphs-flush-inline, graphs-serial)"
                ),
            };
            Ok(Path { name: p.clone(), graphs, gemv, flush_aside, overlap, keep_freed })
        })
        .collect()
}

/// The methods at one context and batch: for each, the allocator's peak over decode steps with
/// only its caches built (on the last path given); then the decode speed of all that fit, every
/// (method, path) pair with the method's caches, steps interleaved (A, B, A, B, …) so that all see
/// the same host (the host's speed drifts by tens of percent over a run). A row per pair, with the
/// bytes a step reads (weights + the caches' resident bytes) beside the floor they set at `bw`.
#[allow(clippy::too_many_arguments)]
fn cases(
    runner: &Runner,
    methods: &[CacheConfig],
    paths: &[Path],
    batch: usize,
    ctx: usize,
    steps: usize,
    gpu: &Gpu,
    rt: &CudaRuntime,
    bw: f64,
) -> Result<Vec<Value>> {
    let model = runner.model();
    let dev = model.device();
    let np = paths.len();
    let sized: Vec<CacheConfig> = methods
        .iter()
        .map(|m| CacheConfig { capacity: Some(ctx + (steps + WARMUP + PHASE_STEPS) * np + 8), ..m.clone() })
        .collect();
    let build = |cfg: &CacheConfig| -> Result<ModelCache> {
        let mut caches = cfg.build_batch(model, batch)?;
        fill(model, &mut caches, batch, ctx)?;
        Ok(caches)
    };
    if let Some(p) = paths.last() {
        p.set(runner, rt)?;
    }
    // Memory, one method at a time.
    let mut mem = Vec::new();
    for cfg in &sized {
        sync(dev)?;
        let used0 = gpu.pool_memory()?.used;
        let measured = (|| -> Result<(usize, usize)> {
            let mut caches = build(cfg)?;
            sync(dev)?;
            gpu.reset_peak_memory()?;
            let mut tokens = vec![1u32; batch];
            for _ in 0..WARMUP {
                step(runner, &mut caches, &mut tokens)?;
            }
            sync(dev)?;
            Ok((gpu.pool_memory()?.peak.saturating_sub(used0), caches.resident_bytes()))
        })();
        sync(dev)?;
        mem.push(match measured {
            Ok((peak, resident)) => json!({"fits": true, "peak_bytes": peak, "resident_bytes": resident}),
            Err(e) if is_oom(&e) => json!({"fits": false, "error": e.to_string()}),
            Err(e) => return Err(e),
        });
    }
    // Speed: the methods that fit, each on every path, interleaved.
    let fit: Vec<usize> = (0..sized.len()).filter(|&i| mem[i]["fits"].as_bool() == Some(true)).collect();
    let mut caches = fit.iter().map(|&i| build(&sized[i])).collect::<Result<Vec<_>>>()?;
    let pairs: Vec<(usize, usize)> = (0..fit.len()).flat_map(|m| (0..np).map(move |p| (m, p))).collect();
    let mut tokens = vec![vec![1u32; batch]; pairs.len()];
    let mut run = |k: usize, tokens: &mut Vec<u32>| -> Result<()> {
        let (m, p) = pairs[k];
        paths[p].set(runner, rt)?;
        step(runner, &mut caches[m], tokens)
    };
    for _ in 0..WARMUP {
        for (k, t) in tokens.iter_mut().enumerate() {
            run(k, t)?;
        }
    }
    sync(dev)?;
    let mut launches = vec![0usize; pairs.len()];
    let mut times = vec![Vec::with_capacity(steps); pairs.len()];
    for _ in 0..steps {
        for (k, t) in tokens.iter_mut().enumerate() {
            // Each step ends on the host (the argmax comes back): steps time one by one.
            let l0 = rt.launches() + runner.cuda_graph_launches();
            let start = Instant::now();
            run(k, t)?;
            times[k].push(start.elapsed().as_secs_f64());
            launches[k] += rt.launches() + runner.cuda_graph_launches() - l0;
        }
    }
    // Where a graph step's GPU time goes: more steps, CUDA events between the parts (so not in
    // the medians above).
    let mut phases = vec![None; pairs.len()];
    for (k, t) in tokens.iter_mut().enumerate() {
        if paths[pairs[k].1].graphs {
            runner.set_step_phases(true);
            for _ in 0..PHASE_STEPS {
                run(k, t)?;
            }
            phases[k] = runner.step_phases();
            runner.set_step_phases(false);
        }
    }
    let layers = model.info.identity.n_layers;
    let weights = model.weight_bytes();
    let mut rows = Vec::new();
    for (i, m) in mem.iter().enumerate() {
        match fit.iter().position(|&f| f == i) {
            None => rows.extend(paths.iter().map(|p| {
                let mut r = m.clone();
                r["path"] = json!(p.name);
                r
            })),
            Some(mi) => {
                let kv = caches[mi].resident_bytes();
                for (k, &(_, p)) in pairs.iter().enumerate().filter(|(_, &(pm, _))| pm == mi) {
                    times[k].sort_by(f64::total_cmp);
                    let median = times[k][steps / 2];
                    let bytes = weights + kv;
                    let mut row = m.clone();
                    row["path"] = json!(paths[p].name);
                    row["tok_s"] = json!(batch as f64 / median);
                    row["ms_per_step"] = json!(median * 1e3);
                    row["ms_per_step_min_max"] = json!([times[k][0] * 1e3, times[k][steps - 1] * 1e3]);
                    row["launches_per_layer_step"] = json!(launches[k] as f64 / (steps * layers) as f64);
                    row["bytes_per_step"] = json!({"weights": weights, "kv_resident": kv});
                    row["floor_ms"] = json!(bytes as f64 / bw * 1e3);
                    row["vs_floor"] = json!(median / (bytes as f64 / bw));
                    if let Some(ph) = phases[k].filter(|ph| ph.steps > 0) {
                        let per = |ms: f64| ms / ph.steps as f64;
                        row["phases_ms_per_step"] = json!({
                            "steps": ph.steps, "segments": per(ph.segments_ms), "rows_in": per(ph.rows_in_ms),
                            "attention": per(ph.attention_ms), "flush": per(ph.flush_ms), "io": per(ph.io_ms),
                            "total": per(ph.total_ms())});
                    }
                    rows.push(row);
                }
            }
        }
    }
    drop(caches);
    sync(dev)?;
    Ok(rows)
}

/// Bytes the allocator hands out for caches of `capacity` positions (batch 1), measured.
fn allocated(model: &Model, cfg: &CacheConfig, capacity: usize, gpu: &Gpu) -> Result<Option<usize>> {
    sync(model.device())?;
    let used0 = gpu.pool_memory()?.used;
    let cfg = CacheConfig { capacity: Some(capacity), ..cfg.clone() };
    match cfg.build_batch(model, 1) {
        Ok(caches) => {
            sync(model.device())?;
            let bytes = gpu.pool_memory()?.used - used0;
            drop(caches);
            sync(model.device())?;
            Ok(Some(bytes))
        }
        Err(e) if e.is_out_of_memory() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The longest context (a multiple of 1024) whose caches take at most `budget` bytes: bytes are
/// affine in the capacity, measured at two capacities, then the answer and the next 1024 are
/// allocated to confirm.
fn longest_context(model: &Model, cfg: &CacheConfig, budget: usize, gpu: &Gpu) -> Result<Value> {
    let (c0, c1) = (16 * 1024, 32 * 1024);
    let (b0, b1) = (
        allocated(model, cfg, c0, gpu)?.context("16k positions do not fit")?,
        allocated(model, cfg, c1, gpu)?.context("32k positions do not fit")?,
    );
    let per_pos = (b1 - b0) as f64 / (c1 - c0) as f64;
    let fixed = b0 as f64 - per_pos * c0 as f64;
    let mut best = (((budget as f64 - fixed) / per_pos) as usize) / 1024 * 1024;
    // Confirm: the answer fits, one more block does not (step down if the model was optimistic).
    let mut at = allocated(model, cfg, best, gpu)?;
    while best > 1024 && over(at, budget) {
        best -= 1024;
        at = allocated(model, cfg, best, gpu)?;
    }
    let next = allocated(model, cfg, best + 1024, gpu)?;
    Ok(json!({"method": cfg.name(), "budget_bytes": budget, "bytes_per_position": per_pos, "fixed_bytes": fixed,
              "longest_context": best, "bytes_at_longest": at, "bytes_at_next": next,
              "next_exceeds": over(next, budget)}))
}

/// Whether an allocation failed or took more than `budget` bytes.
fn over(bytes: Option<usize>, budget: usize) -> bool {
    bytes.is_none_or(|b| b > budget)
}

pub fn run(a: Args) -> Result<()> {
    let read = |p: &PathBuf| -> Result<Value> {
        Ok(serde_json::from_str(&std::fs::read_to_string(p).with_context(|| p.display().to_string())?)?)
    };
    let anchor = a.anchor.as_ref().map(read).transpose()?;
    if let Some(src) = &a.replot {
        return plot(a.plot.as_deref().context("--replot needs --plot")?, &read(src)?, anchor.as_ref());
    }
    let options = a.cuda.options(&a.files.cache_dir);
    let dev = VDevice::Cuda(0).open(&options)?;
    let Device::Cuda(cuda) = &dev else { unreachable!("a CUDA device opens as candle's CUDA device") };
    let gpu = Gpu::from_stream(cuda.cuda_stream(), options.kernels.clone())?;
    let rt = CudaRuntime::new(&dev)?;
    println!("{} ({} SMs)", gpu.name(), gpu.multiprocessors());
    let paths = parse_paths(&a.paths)?;
    let bw = copy_bandwidth(&gpu)?;
    println!("device-to-device copy: {:.2} TB/s (read + write), the yardstick of the bytes floor", bw / 1e12);
    let mut rng = Rng(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64 | 1);

    let model_path = a.files.model();
    // Every path's steps and the timed-by-part ones advance the same caches.
    let max_ctx =
        a.contexts.iter().max().copied().unwrap_or(1024) + (a.steps + WARMUP + PHASE_STEPS) * a.paths.len() + 64;
    let Method::VecInfer(vq) = a.method else { anyhow::bail!("--method takes a VecInfer method (vq-…)") };
    let cal_path = a.files.calibration(&a.method);
    let mut agree = Vec::new();
    let mut graphs_agree = Vec::new();
    let mut batch_agree = Vec::new();
    let mut rows_agree = Vec::new();
    let mut runs = Vec::new();
    let mut budget = Vec::new();
    for name in &a.models {
        let (model, cal, label) = match name.as_str() {
            "smollm2" => {
                let (gpu_model, tok) = Model::open_with(
                    &model_path,
                    &veloq_candle::model::LoadOptions { max_context: max_ctx, weights: a.weights },
                    &dev,
                )
                .with_context(|| model_path.display().to_string())?;
                let gpu_model = Runner::new(gpu_model, &options);
                let cal = Calibration::load_for(&cal_path, &gpu_model.model().info.identity)
                    .with_context(|| cal_path.display().to_string())?;
                println!(
                    "\n2. agreement, {}: greedy {} tokens, CPU vs CUDA",
                    gpu_model.model().info.identity.name,
                    a.agree_tokens
                );
                let (cpu_model, _) = Model::open(&model_path, 4096)?;
                let prompt = prompt_ids(gpu_model.model(), &tok, &a.prompt, true)?;
                for cfg in [CacheConfig::fp16(), CacheConfig::vecinfer(cal.clone())] {
                    agree.push(
                        agreement(&cpu_model, &gpu_model, &cfg, &prompt, a.agree_tokens)
                            .with_context(|| format!("agreement, {}", cfg.name()))?,
                    );
                    graphs_agree.push(
                        graph_agreement(&gpu_model, &cfg, &prompt, a.agree_tokens)
                            .with_context(|| format!("graphs vs eager, {}", cfg.name()))?,
                    );
                    batch_agree.push(
                        batch_agreement(&gpu_model, &rt, &cfg, &prompt, a.agree_tokens, 8)
                            .with_context(|| format!("batch GEMV vs cuBLAS, {}", cfg.name()))?,
                    );
                }
                (gpu_model, cal, "SmolLM2-135M (real weights)".to_string())
            }
            "llama8b" => {
                let g = Geometry::LLAMA_3_1_8B;
                let model = g.model("llama-3.1-8b-geometry-random", max_ctx, &dev, 7)?;
                let cal = synthetic_calibration(&model, &vq, &mut rng)?;
                let model = Runner::new(model, &options);
                println!(
                    "\n2. agreement, {LLAMA8B}: CUDA graphs vs eager (batch 1), cuBLAS vs veloq's GEMV (batch 8), f16 rows vs the f32 path (batch 12)"
                );
                let vocab = model.model().info.vocab as u64;
                let prompt: Vec<u32> = (0..64u64).map(|i| (i * 7919 % vocab) as u32).collect();
                for cfg in [CacheConfig::fp16(), CacheConfig::vecinfer(cal.clone())] {
                    graphs_agree.push(
                        graph_agreement(&model, &cfg, &prompt, a.agree_tokens.min(8))
                            .with_context(|| format!("graphs vs eager, {}", cfg.name()))?,
                    );
                    batch_agree.push(
                        batch_agreement(&model, &rt, &cfg, &prompt, a.agree_tokens.min(8), 8)
                            .with_context(|| format!("batch GEMV vs cuBLAS, {}", cfg.name()))?,
                    );
                    rows_agree.push(
                        rows_agreement(&model, &rt, &cfg, &prompt, a.agree_tokens.min(8), 12)
                            .with_context(|| format!("f16 rows vs f32 path, {}", cfg.name()))?,
                    );
                }
                (model, cal, format!("{LLAMA8B} ({:.1} B parameters)", g.parameters() as f64 / 1e9))
            }
            other => anyhow::bail!("unknown model {other:?} (smollm2, llama8b)"),
        };
        let methods = [CacheConfig::fp16(), CacheConfig::vecinfer(cal)];
        let runner = model;
        let model = runner.model();
        println!("\n3. decode, {label}: median of {} steps after {WARMUP}, every (method, path) interleaved step by step, caches filled with random keys/values; floor = (weights {} + KV resident) / copy bandwidth", a.steps, human(model.weight_bytes()));
        println!(
            "{:>5} {:>7} | {:>22} {:>13} {:>9} {:>9} {:>8} {:>12} {:>8} | {:>7} {:>7} {:>8}",
            "batch",
            "context",
            "method",
            "path",
            "tok/s",
            "ms/step",
            "floor",
            "peak alloc",
            "launch/L",
            "vs fp16",
            "vs eagr",
            "memory"
        );
        for &batch in &a.batches {
            for &ctx in &a.contexts {
                let rows = cases(&runner, &methods, &paths, batch, ctx, a.steps, &gpu, &rt, bw)
                    .with_context(|| format!("batch {batch} context {ctx}"))?;
                let np = paths.len();
                let get = |m: usize, p: usize, key: &str| rows[m * np + p][key].as_f64();
                for (mi, m) in methods.iter().enumerate() {
                    for (pi, path) in paths.iter().map(|p| &p.name).enumerate() {
                        let mut row = rows[mi * np + pi].clone();
                        match (get(mi, pi, "tok_s"), get(mi, pi, "peak_bytes")) {
                            (Some(tps), Some(peak)) => {
                                let vs = |x: Option<f64>, w: usize| {
                                    x.map_or(format!("{:>w$}", "n/a"), |r| format!("{r:>w$.2}×"))
                                };
                                println!(
                                    "{batch:>5} {ctx:>7} | {:>22} {path:>13} {tps:>9.1} {:>9.2} {:>7.2}× {:>12} {:>8.2} | {:>6} {:>6} {:>7}",
                                    m.name(),
                                    get(mi, pi, "ms_per_step").unwrap_or(0.0),
                                    get(mi, pi, "vs_floor").unwrap_or(0.0),
                                    human(peak as usize),
                                    get(mi, pi, "launches_per_layer_step").unwrap_or(0.0),
                                    vs(get(0, pi, "tok_s").map(|b| tps / b), 6),
                                    vs(get(mi, 0, "tok_s").map(|b| tps / b), 6),
                                    vs(get(0, pi, "peak_bytes").map(|b| peak / b), 7),
                                );
                                let ph = &row["phases_ms_per_step"];
                                if let Some(total) = ph["total"].as_f64() {
                                    let f = |k: &str| ph[k].as_f64().unwrap_or(0.0);
                                    println!(
                                        "{:>15} GPU ms/step by part (events between them, {} steps): segments {:.3}, rows in {:.3}, attention {:.3}, flush {:.3}, ids/logits {:.3} = {total:.3}",
                                        "",
                                        ph["steps"],
                                        f("segments"),
                                        f("rows_in"),
                                        f("attention"),
                                        f("flush"),
                                        f("io")
                                    );
                                }
                            }
                            _ => {
                                println!("{batch:>5} {ctx:>7} | {:>22} {path:>13} does not fit in GPU memory", m.name())
                            }
                        }
                        row["model"] = json!(label);
                        row["method"] = json!(m.name());
                        row["batch"] = json!(batch);
                        row["context"] = json!(ctx);
                        runs.push(row);
                    }
                }
            }
        }
        let budget_bytes = (a.budget_gib * (1u64 << 30) as f64) as usize;
        println!(
            "\n4. longest context in {:.0} GiB of KV cache, {label}, batch 1 (allocated and measured)",
            a.budget_gib
        );
        for m in &methods {
            let r = longest_context(model, m, budget_bytes, &gpu)
                .with_context(|| format!("longest context, {}", m.name()))?;
            println!(
                "  {:>22}: {:>9} positions ({:.0} B/position measured; {} allocated there, the next 1024 {})",
                m.name(),
                r["longest_context"],
                r["bytes_per_position"].as_f64().unwrap_or(0.0),
                r["bytes_at_longest"].as_u64().map_or("?".into(), |b| human(b as usize)),
                if r["next_exceeds"].as_bool() == Some(true) { "exceed it" } else { "fit too" }
            );
            let mut r = r;
            r["model"] = json!(label);
            budget.push(r);
        }
    }
    let out = json!({"bench": "runner", "device": gpu.name(), "steps": a.steps, "copy_bandwidth_bytes_s": bw,
                     "paths": a.paths, "agreement": agree, "graphs_vs_eager": graphs_agree, "batch_gemv_vs_cublas": batch_agree, "f16_rows_vs_f32": rows_agree, "runs": runs, "budget": budget});
    write_json(&a.json, &out)?;
    if let Some(p) = &a.plot {
        // The figure is a convenience: a missing font must not lose the measurements (--replot).
        if let Err(e) = plot(p, &out, anchor.as_ref()) {
            eprintln!("figure not drawn ({e:#}); redraw it with --replot");
        }
    }
    Ok(())
}
