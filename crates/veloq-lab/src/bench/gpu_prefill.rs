//! `veloq bench gpu-prefill`: long prompts on CUDA in the Llama-3.1-8B geometry (random f16
//! weights, random 2-bit codebooks): per method and prompt length, the chunked prefill's tok/s and
//! the allocator's peak above what was in use before it; then one chunk's attention at the end of
//! the prompt (one layer: append + attend of `chunk` queries over everything before them) timed
//! alone, on the host's clock and on the GPU's (launches queued, as the anchor is timed), next to
//! PyTorch's SDPA (flash) on the same shapes from `scripts/device/sdpa_prefill.py`, which the same
//! device call runs first (`--sdpa` its JSON).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use clap::Args as ClapArgs;
use serde_json::{json, Value};

use veloq::kernels::cuda::Gpu;
use veloq::kernels::KernelOptions;
use veloq_candle::cache::{CudaRuntime, ModelCache, Step};
use veloq_candle::config::CacheConfig;
use veloq_candle::model::Model;
use veloq_candle::prefill::prefill;
use veloq_candle::runtime::{CudaOptions, Device as VDevice};
use veloq_candle::Method;
use veloq_lab::synthetic::Geometry;

use super::cuda::Rng;
use super::write_json;
use veloq_candle::units::human_bytes as human;
use veloq_lab::synthetic::synthetic_calibration;

#[derive(ClapArgs)]
pub struct Args {
    /// Prompt lengths (tokens).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
    lengths: Vec<usize>,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = veloq_candle::prefill::DEFAULT_CHUNK)]
    chunk: usize,
    /// Caches: fp16 and/or vecinfer.
    #[arg(long, value_delimiter = ',', default_value = "vecinfer,fp16")]
    methods: Vec<String>,
    /// Prompt lengths above this are timed for attention only (a full prefill of the fp16 cache
    /// past it is long on a single call's clock).
    #[arg(long, default_value_t = usize::MAX)]
    full_up_to: usize,
    /// Timed repetitions of the one-chunk attention (median).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// The VecInfer method beside fp16 (random codebooks of its shape).
    #[arg(long, default_value = "vq-2")]
    method: Method,
    /// SDPA timings from scripts/device/sdpa_prefill.py, run in the same call.
    #[arg(long)]
    sdpa: Option<PathBuf>,
    /// Whether device memory freed by one chunk stays in the allocator's pool for the next (off:
    /// given back to the driver at every synchronisation); several to time them side by side.
    #[arg(long, value_delimiter = ',', default_value = "on", value_parser = clap::builder::BoolishValueParser::new(), value_name = "on|off")]
    keep_freed_memory: Vec<bool>,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

/// Random `[n, heads, d]` f32 on `dev` (drawn there: the fill writes 128k positions per layer).
fn random(n: usize, heads: usize, d: usize, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, (n, heads, d), dev)?)
}

/// One chunk's timings: median seconds of the host's clock around each rep (launches included,
/// each rep waited for), of the host's clock until its last launch was issued (before the wait),
/// and of the GPU's events around it with the rep queued behind a 2 GiB memset (the host's
/// launches hidden, as the SDPA anchor's `do_bench` times).
struct ChunkTimes {
    host: f64,
    enqueue: f64,
    gpu: f64,
}

/// One layer's append + attend of `chunk` queries after the `len` positions the cache holds (the
/// step is committed and cut off again after each rep, untimed), timed both ways.
fn chunk_attention(caches: &mut ModelCache, model: &Model, gpu: &Gpu, chunk: usize, reps: usize) -> Result<ChunkTimes> {
    use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    let dev = model.device().clone();
    let (hq, kv, d) = (model.info.n_heads, model.info.identity.n_kv_heads, model.info.identity.head_dim);
    let len = caches.len(0);
    let (k, v, q) = (random(chunk, kv, d, &dev)?, random(chunk, kv, d, &dev)?, random(chunk, hq, d, &dev)?);
    let step = Step::single(0, len, chunk)?;
    let layer = &mut caches.layers_mut()[0];
    let scale = 1.0 / (d as f32).sqrt();
    let stream = gpu.stream();
    let mut queue = stream.alloc_zeros::<u8>(2 << 30)?;
    let (mut host, mut enqueue, mut events) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..2 * (reps.max(1) + 1) {
        let queued = rep % 2 == 1;
        sync(&dev)?;
        let t0 = Instant::now();
        let start = if queued {
            stream.memset_zeros(&mut queue)?;
            Some(stream.record_event(Some(CU_EVENT_DEFAULT))?)
        } else {
            None
        };
        layer.append(&k, &v, &step)?;
        layer.attend(&q, &step, scale)?;
        match start {
            Some(a) => events.push((a, stream.record_event(Some(CU_EVENT_DEFAULT))?)),
            None => {
                enqueue.push(t0.elapsed().as_secs_f64());
                sync(&dev)?;
                host.push(t0.elapsed().as_secs_f64());
            }
        }
        layer.commit()?;
        layer.truncate(0, len)?;
    }
    sync(&dev)?;
    let mut gpu_s = events.iter().map(|(a, b)| Ok(a.elapsed_ms(b)? as f64 / 1e3)).collect::<Result<Vec<_>>>()?;
    let median = |t: &mut Vec<f64>| {
        t.remove(0); // the first of each: the host's first rep compiles and allocates
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    Ok(ChunkTimes { host: median(&mut host), enqueue: median(&mut enqueue), gpu: median(&mut gpu_s) })
}

/// SDPA's milliseconds for one chunk at `len` positions of context, from the script's JSON.
fn sdpa_ms(sdpa: &Value, len: usize, chunk: usize) -> Option<(f64, String)> {
    sdpa["rows"].as_array()?.iter().find_map(|r| {
        (r["context"].as_u64() == Some(len as u64) && r["queries"].as_u64() == Some(chunk as u64))
            .then(|| Some((r["ms"].as_f64()?, r["backend"].as_str().unwrap_or("?").to_string())))?
    })
}

pub fn run(a: Args) -> Result<()> {
    let dev = VDevice::Cuda(0).open(&CudaOptions::default())?;
    let Device::Cuda(cuda) = &dev else { unreachable!("a CUDA device opens as candle's CUDA device") };
    let gpu = Gpu::from_stream(cuda.cuda_stream(), KernelOptions::default())?;
    let Method::VecInfer(vq) = a.method else { anyhow::bail!("--method takes a VecInfer method (vq-…)") };
    let sdpa: Value = match &a.sdpa {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p).with_context(|| p.display().to_string())?)?,
        None => Value::Null,
    };
    let mut rng = Rng(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos() as u64 | 1);
    let longest = a.lengths.iter().max().copied().unwrap_or(8192);
    let g = Geometry::LLAMA_3_1_8B;
    let model = g.model("llama-3.1-8b-geometry-random", longest + a.chunk, &dev, 7)?;
    let cal = synthetic_calibration(&model, &vq, &mut rng)?;
    println!(
        "{} ({} SMs); Llama-3.1-8B geometry, random f16 weights ({:.1} B parameters), chunks of {}",
        gpu.name(),
        gpu.multiprocessors(),
        g.parameters() as f64 / 1e9,
        a.chunk
    );
    println!(
        "{:>9} {:>22} {:>7} | {:>9} {:>9} {:>11} {:>11} | {:>11} {:>11} {:>11} {:>11} {:>7} {:>7}",
        "prompt",
        "method",
        "freed",
        "tok/s",
        "secs",
        "peak alloc",
        "KV",
        "chunk attn",
        "enqueued",
        "GPU time",
        "SDPA",
        "vs SDPA",
        "GPU vs"
    );
    let vocab = model.info.vocab;
    let mut rows = Vec::new();
    let cases = a.methods.iter().flat_map(|m| a.keep_freed_memory.iter().map(move |&k| (m, k)));
    for (name, keep) in cases {
        let cfg = match name.as_str() {
            "fp16" => CacheConfig::fp16(),
            "vecinfer" => CacheConfig::vecinfer(cal.clone()),
            other => anyhow::bail!("unknown method {other:?} (fp16, vecinfer)"),
        };
        CudaRuntime::configure(&dev, &CudaOptions { keep_freed_memory: keep, ..CudaOptions::default() })?;
        let freed = if keep { "kept" } else { "given" };
        for &len in &a.lengths {
            let mut caches = cfg.build(&model)?;
            let ids: Vec<u32> = (0..len).map(|_| (rng.uniform() * vocab as f64) as u32 % vocab as u32).collect();
            sync(&dev)?;
            let used0 = gpu.pool_memory()?.used;
            gpu.reset_peak_memory()?;
            let full = len <= a.full_up_to;
            let t0 = Instant::now();
            if full {
                prefill(&model, &mut caches, 0, &ids, a.chunk, &mut |_, _| {})?;
            } else {
                fill(&mut caches, &model, len, a.chunk)?;
            }
            sync(&dev)?;
            let secs = t0.elapsed().as_secs_f64();
            let peak = gpu.pool_memory()?.peak.saturating_sub(used0);
            let kv = caches.resident_bytes();
            let ChunkTimes { host: attn, enqueue, gpu: attn_gpu } =
                chunk_attention(&mut caches, &model, &gpu, a.chunk, a.reps)?;
            let base = sdpa_ms(&sdpa, len, a.chunk);
            let tok_s = full.then(|| len as f64 / secs);
            println!(
                "{len:>9} {:>22} {freed:>7} | {:>9} {:>9} {:>11} {:>11} | {:>9.3}ms {:>9.3}ms {:>9.3}ms {:>11} {:>7} {:>7}",
                cfg.name(),
                tok_s.map_or("n/a".into(), |t| format!("{t:.0}")),
                if full { format!("{secs:.1}") } else { "n/a".into() },
                if full { human(peak) } else { "n/a".into() },
                human(kv),
                attn * 1e3,
                enqueue * 1e3,
                attn_gpu * 1e3,
                base.as_ref().map_or("n/a".into(), |(ms, _)| format!("{ms:.3}ms")),
                base.as_ref().map_or("n/a".into(), |(ms, _)| format!("{:.2}×", ms / (attn * 1e3))),
                base.as_ref().map_or("n/a".into(), |(ms, _)| format!("{:.2}×", ms / (attn_gpu * 1e3)))
            );
            rows.push(json!({
                "method": cfg.name(), "keep_freed_memory": keep, "prompt": len, "chunk": a.chunk, "full_prefill": full,
                "tok_s": tok_s, "secs": full.then_some(secs), "peak_bytes_above_start": full.then_some(peak),
                "kv_bytes": kv, "chunk_attention_ms": attn * 1e3, "chunk_enqueued_ms": enqueue * 1e3,
                "chunk_attention_gpu_ms": attn_gpu * 1e3,
                "sdpa_ms": base.as_ref().map(|b| b.0), "sdpa_backend": base.as_ref().map(|b| b.1.clone()),
            }));
        }
    }
    println!("freed: device memory freed by a chunk kept in the allocator's pool or given back to the driver at each synchronisation; chunk attn: one layer's append + attend of {} queries after the prompt (median of {}, host clock, each rep waited for); enqueued: the same until its last launch was issued; GPU time: the same between events, queued behind a 2 GiB memset (launches hidden, as SDPA's do_bench); SDPA: the same queries over the same positions in f16, {} query heads, causal (lower right), flash where it runs; vs SDPA > 1 means veloq is faster", a.chunk, a.reps, model.info.n_heads);
    write_json(
        &a.json,
        &json!({"device": gpu.name(), "model": "llama-3.1-8b-geometry-random", "chunk": a.chunk, "rows": rows, "sdpa": sdpa}),
    )
}

/// Fills the caches with `len` random keys and values per layer, `chunk` at a time (for lengths
/// only the attention is timed at).
fn fill(caches: &mut ModelCache, model: &Model, len: usize, chunk: usize) -> Result<()> {
    let dev = model.device().clone();
    let (kv, d) = (model.info.identity.n_kv_heads, model.info.identity.head_dim);
    for start in (0..len).step_by(chunk) {
        let n = chunk.min(len - start);
        let step = Step::single(0, start, n)?;
        let (k, v) = (random(n, kv, d, &dev)?, random(n, kv, d, &dev)?);
        for layer in caches.layers_mut() {
            layer.append(&k, &v, &step)?;
            layer.commit()?;
        }
    }
    Ok(())
}
