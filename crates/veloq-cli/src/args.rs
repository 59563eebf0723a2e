//! The flags every command that runs a model shares, turned into the library's typed options.
//! This is the binary's edge: the only place `VELOQ_*` variables are read (through clap, as
//! defaults of the flags they stand for).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::builder::BoolishValueParser;
use clap::Args;

use veloq::kernels::{GemvShape, GemvShapes, KernelChoice, KernelOptions};
use veloq_candle::model::Weights;
use veloq_candle::runtime::{self, calibration_path, CudaOptions, Device, Loaded, RunOptions};
use veloq_candle::Method;

/// Where models, texts and calibrations live.
#[derive(Args, Clone, Debug)]
pub struct Files {
    /// GGUF model file (scripts/fetch-data puts SmolLM2 in the cache directory).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Calibration artifact of a VecInfer method (`veloq calibrate`); default
    /// <cache-dir>/<model>.<method>.safetensors.
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Models, texts, calibrations and compiled kernels.
    #[arg(long, env = "VELOQ_CACHE", default_value_os_t = veloq::paths::default_cache_dir())]
    pub cache_dir: PathBuf,
}

impl Files {
    /// The model file, or SmolLM2-135M-Instruct in the cache directory.
    pub fn model(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(|| self.cache_dir.join("smollm2-135m-instruct.q4_1.gguf"))
    }

    /// The calibration file of `method`, or its default place.
    pub fn calibration(&self, method: &Method) -> PathBuf {
        self.calibration.clone().unwrap_or_else(|| calibration_path(&self.cache_dir, &self.model(), method))
    }

    /// A novel of `scripts/fetch-data` (`persuasion`, `emma`…).
    pub fn text(&self, name: &str) -> PathBuf {
        self.cache_dir.join("austen").join(format!("{name}.txt"))
    }
}

/// How the CUDA paths run (defaults: every fast path on). Each flag's variable sets it too.
#[derive(Args, Clone, Debug)]
pub struct CudaFlags {
    /// Decode steps replayed from CUDA graphs.
    #[arg(long, env = "VELOQ_CUDA_GRAPHS", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub cuda_graphs: bool,
    /// f16 weights of decode steps through veloq's GEMV (off: cuBLAS).
    #[arg(long, env = "VELOQ_CUDA_GEMV", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub cuda_gemv: bool,
    /// f16 weights of prompt chunks multiplied as f16 activations, veloq's row kernels between
    /// the products (off: candle's f32 path, casts around every product).
    #[arg(long, env = "VELOQ_CUDA_F16_ROWS", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub cuda_f16_rows: bool,
    /// The quantize kernel scans a 2-D book's candidate lists, not every centroid (same codes).
    #[arg(long, env = "VELOQ_CUDA_CANDIDATE_LISTS", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub cuda_candidate_lists: bool,
    /// Kernels overlap their predecessor's tail (programmatic dependent launch, sm_90+).
    #[arg(long, env = "VELOQ_PDL", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub overlapped_launches: bool,
    /// Cache flushes on a second stream.
    #[arg(long, env = "VELOQ_FLUSH_STREAM", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub flush_stream: bool,
    /// Device memory a step frees kept for the next step (off: given back to the driver at every
    /// synchronisation, the driver's default).
    #[arg(long, env = "VELOQ_KEEP_FREED_MEMORY", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub keep_freed_memory: bool,
    /// Sequences at different positions decode in one batch's launches (off: a batch's launches
    /// per group of sequences laid out alike).
    #[arg(long, env = "VELOQ_CUDA_RAGGED_DECODE", default_value = "on", action = clap::ArgAction::Set, value_parser = BoolishValueParser::new(), value_name = "on|off")]
    pub cuda_ragged_decode: bool,
    /// GEMV launch shape R,U,T for one activation row (`veloq-lab bench cuda --gemv-sweep`).
    #[arg(long, env = "VELOQ_GEMV", value_name = "R,U,T")]
    pub gemv_shape: Option<GemvShape>,
    /// GEMV launch shape R,U,T for 2–8 rows (R a multiple of 8).
    #[arg(long, env = "VELOQ_GEMV_MMA", value_name = "R,U,T")]
    pub gemv_shape_batch: Option<GemvShape>,
    /// Directory of compiled kernels (`off`: compile in every process); default
    /// <cache-dir>/kernels.
    #[arg(long, env = "VELOQ_KERNEL_CACHE")]
    pub kernel_cache: Option<PathBuf>,
}

/// Points the CUDA driver's cache of translated PTX under `cache_dir` (`<cache_dir>/nv`) unless
/// `CUDA_CACHE_PATH` is set ([`veloq_candle::cuda_options::driver_cache_dir`]); in CUDA builds
/// only. Call first thing in `main`, while the process has one thread.
pub fn place_driver_cache(cache_dir: &std::path::Path) {
    #[cfg(feature = "cuda")]
    {
        use veloq_candle::cuda_options::{driver_cache_dir, DRIVER_CACHE_VAR};
        if let Some(dir) = driver_cache_dir(cache_dir, std::env::var_os(DRIVER_CACHE_VAR).as_deref()) {
            std::env::set_var(DRIVER_CACHE_VAR, dir);
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = cache_dir;
}

impl CudaFlags {
    /// The library's options, compiled kernels under `cache_dir` unless told otherwise.
    pub fn options(&self, cache_dir: &std::path::Path) -> CudaOptions {
        let kernel_cache = match &self.kernel_cache {
            Some(p) if p.as_os_str() == "off" || p.as_os_str() == "0" => None,
            Some(p) => Some(p.clone()),
            None => Some(cache_dir.join("kernels")),
        };
        CudaOptions {
            graphs: self.cuda_graphs,
            gemv: self.cuda_gemv,
            f16_rows: self.cuda_f16_rows,
            flush_stream: self.flush_stream,
            keep_freed_memory: self.keep_freed_memory,
            ragged_decode: self.cuda_ragged_decode,
            kernels: KernelOptions {
                overlapped_launches: self.overlapped_launches,
                kernel_cache,
                gemv: GemvShapes { one_row: self.gemv_shape, many_rows: self.gemv_shape_batch },
                candidate_lists: self.cuda_candidate_lists,
            },
        }
    }
}

/// A model and its caches, as `generate`, `chat` and `serve` take them.
#[derive(Args, Clone, Debug)]
pub struct Run {
    #[command(flatten)]
    /// Model, calibration and cache directory.
    pub files: Files,
    /// Cache method: fp16, vq-4 (default), vq-2, vq-k4v2, kivi-2, rlm-4… (bits per element in
    /// the name; `veloq methods` lists them).
    #[arg(long, default_value = "vq-4")]
    pub method: Method,
    /// Longest context (prompts + generated) the caches accept (GPU caches reserve it up front).
    #[arg(long, default_value_t = 8192)]
    pub max_context: usize,
    /// cpu, cuda or cuda:N (CUDA needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Fused kernels: auto (where they exist), require (fail if they do not), forbid (portable
    /// candle-ops path).
    #[arg(long, value_enum, default_value_t = KernelChoice::Auto)]
    pub kernels: KernelChoice,
    /// What the GGUF's quantized weights are multiplied as: stored (its blocks, the smallest),
    /// f16 (dequantized: on CUDA fused GEMV and tensor-core products, faster where candle's
    /// quantized kernels are slow — prompt chunks and batches), f32 (dequantized: the same
    /// arithmetic on every device, the slowest).
    #[arg(long, default_value = "stored")]
    pub weights: Weights,
    #[command(flatten)]
    /// The CUDA paths.
    pub cuda: CudaFlags,
}

impl Run {
    /// The library's run options.
    pub fn options(&self) -> RunOptions {
        RunOptions {
            device: self.device,
            kernels: self.kernels,
            max_context: self.max_context,
            weights: self.weights,
            cuda: self.cuda.options(&self.files.cache_dir),
        }
    }

    /// Loads the model with its tokenizer and configures its caches.
    pub fn load(&self) -> Result<Loaded> {
        let model = self.files.model();
        // A calibration given for a method that takes none goes to the library, which refuses it
        // by name rather than dropping it.
        let cal = match &self.files.calibration {
            Some(given) => Some(given.clone()),
            None => self.method.needs_calibration().then(|| self.files.calibration(&self.method)),
        };
        if let Some(c) = cal.as_ref().filter(|c| self.method.needs_calibration() && !c.exists()) {
            anyhow::bail!(
                "no calibration for {} at {} (make one with `veloq calibrate --model {} --method {}`)",
                self.method,
                c.display(),
                model.display(),
                self.method
            );
        }
        runtime::load(&model, &self.method, cal.as_deref(), &self.options())
            .with_context(|| format!("loading {} with {}", model.display(), self.method))
    }
}
