//! `veloq-lab bench …`: each benchmark prints a table and can write JSON.

use anyhow::Result;
use clap::Subcommand;

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod gpu_prefill;
pub mod prefill;
pub mod roofline;
#[cfg(feature = "cuda")]
pub mod runner;
pub mod search;
pub mod serve;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Nearest-centroid search: naive materialising reference vs fused kernel (time, peak memory).
    Search(search::Args),
    /// Decode tok/s of the fp16 and VecInfer caches at several contexts on the real model.
    Decode(decode::Args),
    /// Long prompts on the CPU: chunked prefill and decode after it, fp16 and VecInfer next to
    /// llama.cpp's llama-bench, at several thread counts, with the memory the prefill adds.
    Prefill(prefill::Args),
    /// Serving under load: veloq serve with each cache (and llama-server with f16 / q4_0 KV) at the
    /// same KV budget; 4k-context capacity, aggregate tok/s, TTFT and ITL at several concurrencies.
    Serve(serve::Args),
    /// CUDA kernels: correctness against the CPU path, then timings (build with --features cuda).
    #[cfg(feature = "cuda")]
    Cuda(cuda::Args),
    /// The runner on CUDA: cache checks, CPU/CUDA agreement, decode tok/s and peak memory of fp16
    /// vs VecInfer at long contexts (real SmolLM2 and a random Llama-3.1-8B geometry).
    #[cfg(feature = "cuda")]
    Runner(runner::Args),
    /// Long prompts on CUDA, Llama-3.1-8B geometry: chunked prefill tok/s and peak memory of fp16
    /// and VecInfer at 8k–128k, one chunk's attention next to PyTorch's SDPA.
    #[cfg(feature = "cuda")]
    GpuPrefill(gpu_prefill::Args),
    /// The 8B geometry's weight products through candle (with and without veloq's cuBLAS
    /// workspace), cublasGemmEx and cuBLASLt, PyTorch's rate beside them.
    #[cfg(feature = "cuda")]
    Gemm(gemm::Args),
}

impl BenchCommand {
    /// `--cache-dir` of the benchmarks that load a model file; `None` for those that take none.
    pub fn cache_dir(&self) -> Option<&std::path::PathBuf> {
        match self {
            BenchCommand::Decode(a) => Some(&a.files.cache_dir),
            BenchCommand::Prefill(a) => Some(&a.files.cache_dir),
            BenchCommand::Serve(a) => Some(&a.files.cache_dir),
            #[cfg(feature = "cuda")]
            BenchCommand::Runner(a) => Some(&a.files.cache_dir),
            _ => None,
        }
    }
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Search(a) => search::run(a),
        BenchCommand::Decode(a) => decode::run(a),
        BenchCommand::Prefill(a) => prefill::run(a),
        BenchCommand::Serve(a) => serve::run(a),
        #[cfg(feature = "cuda")]
        BenchCommand::Cuda(a) => cuda::run(a),
        #[cfg(feature = "cuda")]
        BenchCommand::Runner(a) => runner::run(a),
        #[cfg(feature = "cuda")]
        BenchCommand::GpuPrefill(a) => gpu_prefill::run(a),
        #[cfg(feature = "cuda")]
        BenchCommand::Gemm(a) => gemm::run(a),
    }
}

/// The caches of `method` for `model`, a VecInfer method's calibration from `files` (its
/// `--calibration`, else the method's default file in the cache directory).
pub fn cache_for(
    files: &veloq_cli::args::Files,
    method: &veloq_candle::Method,
    model: &veloq_candle::model::Model,
) -> Result<veloq_candle::CacheConfig> {
    use anyhow::Context;
    let cal = match method.needs_calibration() {
        true => {
            let path = files.calibration(method);
            let cal = veloq::artifact::Calibration::load_for(&path, &model.info.identity).with_context(|| {
                format!("calibration {} (make it with `veloq calibrate --method {method}`)", path.display())
            })?;
            Some(cal)
        }
        false => None,
    };
    Ok(veloq_candle::CacheConfig::new(*method, cal)?)
}

/// Median of `reps` timed runs of `f`, in seconds.
pub fn median_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let s = std::time::Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

pub fn write_json(path: &Option<std::path::PathBuf>, value: &serde_json::Value) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(value)?)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}
