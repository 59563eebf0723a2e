//! `veloq generate`: stream a completion and report speed and KV memory.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args as ClapArgs, ValueEnum};

use veloq::kernels::select::KernelChoice;
use veloq_candle::config::CacheConfig;
use veloq_candle::generate::{generate, GenerateOptions};
use veloq_candle::model::Model;

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum MethodArg {
    Fp16,
    Vecinfer,
}

/// The model file and its calibration, as every command that runs a calibrated model takes them.
#[derive(ClapArgs, Clone)]
pub struct ModelFiles {
    /// GGUF model file (scripts/fetch-data puts SmolLM2 in ~/.cache/veloq).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Calibration artifact (veloq calibrate); default ~/.cache/veloq/<model>.vecinfer.safetensors
    #[arg(long)]
    pub calibration: Option<PathBuf>,
}

impl ModelFiles {
    /// The model file, or the default one.
    pub fn model(&self) -> PathBuf {
        self.model.clone().unwrap_or_else(default_model)
    }

    /// The calibration file, or the default one beside the model's name.
    pub fn calibration(&self) -> PathBuf {
        self.calibration.clone().unwrap_or_else(|| default_calibration(&self.model()))
    }
}

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub files: ModelFiles,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, value_enum, default_value = "vecinfer")]
    pub method: MethodArg,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Longest context (prompt + generated) the caches accept (GPU caches reserve it up front).
    #[arg(long, default_value_t = 8192)]
    pub max_context: usize,
    /// cpu, cuda or cuda:N (CUDA needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Fused kernels: auto (use them where they exist), require (fail if they do not), forbid
    /// (portable candle-ops path).
    #[arg(long, default_value = "auto")]
    pub kernels: String,
    /// Dequantize the GGUF weights to f32 (candle's CANDLE_DEQUANTIZE_ALL): slower and larger, but
    /// the same matmul arithmetic on every device, so greedy output on CUDA matches the CPU's
    /// (candle's quantized CUDA and CPU matmuls round differently).
    #[arg(long)]
    pub dequantize: bool,
}

pub fn default_model() -> PathBuf {
    veloq::artifact::default_dir().join("smollm2-135m-instruct.q4_1.gguf")
}

pub fn default_calibration(model: &std::path::Path) -> PathBuf {
    let stem = model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    veloq::artifact::default_dir().join(format!("{stem}.vecinfer.safetensors"))
}

pub fn run(a: Args) -> Result<()> {
    let model_path = a.files.model();
    if a.dequantize {
        // Read by candle when the weights are loaded, below; nothing else runs yet.
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    }
    let device = crate::device::parse(&a.device)?;
    let kernels = KernelChoice::parse(&a.kernels)?;
    let (model, tok) = Model::open_on(&model_path, a.max_context, &device)
        .with_context(|| format!("loading {}", model_path.display()))?;
    let config = match a.method {
        MethodArg::Fp16 => CacheConfig::fp16(),
        MethodArg::Vecinfer => {
            let cal = a.files.calibration();
            CacheConfig::vecinfer_from_file(&cal, &model).with_context(|| {
                format!(
                    "loading calibration {} (make one with `veloq calibrate --model {}`)",
                    cal.display(),
                    model_path.display()
                )
            })?
        }
    };
    let config = CacheConfig { kernels, ..config };
    let mut caches = config.build(&model)?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        chat: !a.raw,
    };
    let out = generate(&model, &tok, &mut caches, &a.prompt, &opts, &mut |s| {
        print!("{s}");
        let _ = std::io::stdout().flush();
    })?;
    println!();
    std::io::stdout().flush()?;
    // Caches on a GPU reserve --max-context positions up front: compare reservations there.
    let (fp16, what) = if device.is_cpu() {
        (out.kv_fp16_bytes, "resident".to_string())
    } else {
        (veloq_candle::config::fp16_bytes(&model, a.max_context), format!("reserved for {} positions", a.max_context))
    };
    let kv = if matches!(config.method, veloq_candle::config::Method::Fp16) {
        format!("KV cache {} {what}", human(out.kv_resident_bytes))
    } else {
        format!(
            "KV cache {} {what} vs {} for fp16 ({:.2}×)",
            human(out.kv_resident_bytes),
            human(fp16),
            fp16 as f64 / out.kv_resident_bytes.max(1) as f64
        )
    };
    eprintln!(
        "[{}] prompt {} tok, prefill {:.1} tok/s | generated {} tok, decode {:.1} tok/s | {kv}",
        config.name(),
        out.prompt_tokens,
        out.prefill_tok_s(),
        out.tokens.len(),
        out.decode_tok_s(),
    );
    Ok(())
}

pub fn human(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}
