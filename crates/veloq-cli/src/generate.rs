//! `veloq generate`: stream a completion and report speed and KV memory.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};

use veloq::kernels::select::KernelChoice;
use veloq_candle::config::CacheConfig;
use veloq_candle::generate::{generate_ids, prompt_ids, Event, GenerateOptions};
use veloq_candle::model::Model;

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum MethodArg {
    Fp16,
    Vecinfer,
    /// KIVI scalar quantization (keys per channel, values per token, groups of 32), `--bits`.
    Kivi,
    /// Calibration-free rotation + Lloyd–Max levels, `--bits`.
    Rlm,
}

impl MethodArg {
    /// The cache of a method that needs no calibration (`None` for VecInfer).
    fn uncalibrated(self, bits: u32) -> Option<CacheConfig> {
        match self {
            Self::Fp16 => Some(CacheConfig::fp16()),
            Self::Vecinfer => None,
            Self::Kivi => Some(CacheConfig::kivi(bits, 32)),
            Self::Rlm => Some(CacheConfig::rot_lloyd_max(bits)),
        }
    }
}

/// The model file and its calibration, as every command that runs a calibrated model takes them.
#[derive(ClapArgs, Clone)]
pub struct ModelFiles {
    /// GGUF model file (scripts/fetch-data puts SmolLM2 in ~/.cache/veloq), or synthetic:llama8b
    /// (random f16 weights of that geometry, random codebooks, words w0… as tokens: for speed).
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

/// How a model and its caches are set up: shared by `generate` and `chat`.
#[derive(ClapArgs, Clone)]
pub struct Runtime {
    #[command(flatten)]
    pub files: ModelFiles,
    #[arg(long, value_enum, default_value = "vecinfer")]
    pub method: MethodArg,
    /// Bits per element of the scalar baselines (kivi: 1–8, rlm: 1–8).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub bits: u32,
    /// Longest context (prompts + generated) the caches accept (GPU caches reserve it up front).
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

/// Sampling and prefill settings: shared by `generate` and `chat`.
#[derive(ClapArgs, Clone)]
pub struct Sampling {
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1].
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
    /// Prompt tokens per forward pass (chunked prefill; llama.cpp's micro-batch is 512 too).
    #[arg(long, default_value_t = veloq_candle::prefill::DEFAULT_CHUNK)]
    pub prefill_chunk: usize,
}

impl Sampling {
    pub fn options(&self, chat: bool) -> Result<GenerateOptions> {
        let opts = GenerateOptions {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            chat,
            prefill_chunk: self.prefill_chunk,
        };
        opts.validate()?;
        Ok(opts)
    }
}

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub runtime: Runtime,
    #[command(flatten)]
    pub sampling: Sampling,
    /// The prompt text.
    #[arg(long, required_unless_present = "prompt_file", conflicts_with = "prompt_file")]
    pub prompt: Option<String>,
    /// Read the prompt from a file (`-`: standard input).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Feed the prompt as is, without the chat template.
    #[arg(long)]
    pub raw: bool,
}

/// A loaded model with its caches, as `--method`, `--device` and `--kernels` ask.
pub struct Loaded {
    pub model: Model,
    pub tok: veloq_candle::model::Tokenizer,
    pub config: CacheConfig,
}

impl Runtime {
    pub fn load(&self) -> Result<Loaded> {
        let model_path = self.files.model();
        if self.dequantize {
            // Read by candle when the weights are loaded, below; nothing else runs yet.
            std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
        }
        let device = crate::device::parse(&self.device)?;
        let kernels = KernelChoice::parse(&self.kernels)?;
        if let Some(name) = model_path.to_str().and_then(|p| p.strip_prefix("synthetic:")) {
            let (g, label) = crate::synthetic::geometry(name)?;
            let model = Model::synthetic(label, g, self.max_context, &device, 7)?;
            let config = match self.method.uncalibrated(self.bits) {
                Some(c) => c,
                None => {
                    let mut rng = crate::synthetic::Rng(0x9E37_79B9_7F4A_7C15);
                    CacheConfig::vecinfer(crate::synthetic::synthetic_calibration(&model, &mut rng)?)
                }
            };
            let tok = veloq_candle::model::word_tokenizer(g.vocab);
            return Ok(Loaded { model, tok, config: CacheConfig { kernels, ..config } });
        }
        let (model, tok) = Model::open_on(&model_path, self.max_context, &device)
            .with_context(|| format!("loading {}", model_path.display()))?;
        let config = match self.method.uncalibrated(self.bits) {
            Some(c) => c,
            None => {
                let cal = self.files.calibration();
                CacheConfig::vecinfer_from_file(&cal, &model).with_context(|| {
                    format!(
                        "loading calibration {} (make one with `veloq calibrate --model {}`)",
                        cal.display(),
                        model_path.display()
                    )
                })?
            }
        };
        Ok(Loaded { model, tok, config: CacheConfig { kernels, ..config } })
    }
}

/// The KV line of a report: bytes held, against fp16 at the same length for caches that grow with
/// their sequences (the CPU's), or at the same reservation for those that reserve `max_context`
/// up front (GPU caches, the portable backend).
pub fn kv_report(l: &Loaded, caches: &veloq_candle::cache::ModelCache) -> String {
    let (resident, positions, max) = (caches.resident_bytes(), caches.len(0), l.model.max_context());
    let reserves = caches.sequence_bytes(0) == caches.sequence_bytes(max);
    let (fp16, what) = if reserves {
        (veloq_candle::config::fp16_bytes(&l.model, max), format!("reserved for {max} positions"))
    } else {
        (veloq_candle::config::fp16_bytes(&l.model, positions), "resident".to_string())
    };
    if matches!(l.config.method, veloq_candle::config::Method::Fp16) {
        format!("KV cache {} {what}", human(resident))
    } else {
        format!(
            "KV cache {} {what} vs {} for fp16 ({:.2}×)",
            human(resident),
            human(fp16),
            fp16 as f64 / resident.max(1) as f64
        )
    }
}

/// Streams generation events: text to stdout, a prefill bar on stderr for prompts longer than a
/// chunk.
pub struct Printer {
    bar: Option<indicatif::ProgressBar>,
    chunk: usize,
}

impl Printer {
    pub fn new(chunk: usize) -> Self {
        Self { bar: None, chunk }
    }

    pub fn event(&mut self, e: Event<'_>) {
        match e {
            Event::Prefilled { done, total } if total > self.chunk => {
                let bar = self.bar.get_or_insert_with(|| crate::calibrate::bar(total as u64, "prefill"));
                bar.set_position(done as u64);
                if done == total {
                    bar.finish_and_clear();
                    self.bar = None;
                }
            }
            Event::Prefilled { .. } => {}
            Event::Text(s) => {
                print!("{s}");
                let _ = std::io::stdout().flush();
            }
        }
    }
}

/// The prompt from `--prompt` or `--prompt-file` (`-` = stdin).
fn read_prompt(a: &Args) -> Result<String> {
    match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Ok(p.clone()),
        (None, Some(path)) if path.as_os_str() == "-" => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("reading the prompt from standard input")?;
            Ok(s)
        }
        (None, Some(path)) => std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display())),
        (None, None) => bail!("give --prompt or --prompt-file"),
    }
}

pub fn default_model() -> PathBuf {
    veloq::artifact::default_dir().join("smollm2-135m-instruct.q4_1.gguf")
}

pub fn default_calibration(model: &std::path::Path) -> PathBuf {
    let stem = model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    veloq::artifact::default_dir().join(format!("{stem}.vecinfer.safetensors"))
}

pub fn run(a: Args) -> Result<()> {
    let prompt = read_prompt(&a)?;
    let opts = a.sampling.options(!a.raw)?;
    let l = a.runtime.load()?;
    let mut caches = l.config.build(&l.model)?;
    let ids = prompt_ids(&l.model, &l.tok, &prompt, opts.chat)?;
    let mut printer = Printer::new(opts.prefill_chunk);
    let out = generate_ids(&l.model, &l.tok, &mut caches, &ids, &opts, &mut |e| printer.event(e))?;
    println!();
    std::io::stdout().flush()?;
    eprintln!(
        "[{}] prompt {} tok, prefill {:.1} tok/s | generated {} tok, decode {:.1} tok/s | {}",
        l.config.name(),
        out.prompt_tokens,
        out.prefill_tok_s(),
        out.tokens.len(),
        out.decode_tok_s(),
        kv_report(&l, &caches),
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
