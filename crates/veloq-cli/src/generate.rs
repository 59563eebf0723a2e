//! `veloq generate`: stream a completion and report speed and KV memory.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;

use veloq_candle::config::fp16_bytes;
use veloq_candle::generate::{generate_ids, prompt_ids, Event, GenerateOptions};
use veloq_candle::runtime::Loaded;
use veloq_candle::sampling::SamplingOptions;
use veloq_candle::units::human_bytes as human;
use veloq_candle::Method;

use crate::args::Run;

/// Sampling and prefill settings: shared by `generate` and `chat`.
#[derive(ClapArgs, Clone)]
pub struct Sampling {
    #[arg(long, default_value_t = 128)]
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1].
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep only tokens at least this fraction as likely as the most likely one, in [0, 1].
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Penalise tokens of the prompt and the completion (1 = none; llama.cpp's --repeat-penalty).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f64,
    /// Subtracted from the logit of every token the completion already holds, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub presence_penalty: f64,
    /// Subtracted from a token's logit per time the completion holds it, in [-2, 2].
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub frequency_penalty: f64,
    #[arg(long, default_value_t = 299792458)]
    /// Seed of the sampler.
    pub seed: u64,
    /// Prompt tokens per forward pass (chunked prefill; llama.cpp's micro-batch is 512 too).
    #[arg(long, default_value_t = veloq_candle::prefill::DEFAULT_CHUNK)]
    pub prefill_chunk: usize,
}

impl Sampling {
    /// The library's options (`chat`: in the model's chat template), checked.
    pub fn options(&self, chat: bool) -> Result<GenerateOptions> {
        let sampling = SamplingOptions {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repeat_penalty,
            logit_bias: Vec::new(),
            seed: self.seed,
        };
        let opts = GenerateOptions { max_tokens: self.max_tokens, sampling, chat, prefill_chunk: self.prefill_chunk };
        // Token ids are checked against the model's vocabulary once it is loaded.
        opts.validate(usize::MAX)?;
        Ok(opts)
    }
}

#[derive(ClapArgs)]
/// `veloq generate`'s flags.
pub struct Args {
    #[command(flatten)]
    /// Model and caches.
    pub run: Run,
    #[command(flatten)]
    /// Sampling.
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

/// The KV line of a report: bytes held, against fp16 at the same length for caches that grow with
/// their sequences (the CPU's), or at the same reservation for those that reserve `max_context`
/// up front (GPU caches, the portable backend).
pub fn kv_report(l: &Loaded, caches: &veloq_candle::cache::ModelCache) -> String {
    let (resident, positions, max) = (caches.resident_bytes(), caches.len(0), l.model().max_context());
    let reserves = caches.sequence_bytes(0) == caches.sequence_bytes(max);
    let (fp16, what) = if reserves {
        (fp16_bytes(l.model(), max), format!("reserved for {max} positions"))
    } else {
        (fp16_bytes(l.model(), positions), "resident".to_string())
    };
    if l.cache.method == Method::Fp16 {
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
    /// A printer that shows a bar for prompts longer than `chunk`.
    pub fn new(chunk: usize) -> Self {
        Self { bar: None, chunk }
    }

    /// Shows one generation event.
    pub fn event(&mut self, e: Event<'_>) {
        match e {
            Event::Prefilled { done, total } if total > self.chunk => {
                let bar = self.bar.get_or_insert_with(|| crate::progress::bar(total as u64, "prefill"));
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

/// Generates and reports speed and KV memory on stderr.
pub fn run(a: Args) -> Result<()> {
    let prompt = read_prompt(&a)?;
    let opts = a.sampling.options(!a.raw)?;
    let l = a.run.load()?;
    let mut caches = l.cache.build(l.model())?;
    let ids = prompt_ids(l.model(), &l.tokenizer, &prompt, opts.chat)?;
    let mut printer = Printer::new(opts.prefill_chunk);
    let out = generate_ids(&l.runner, &l.tokenizer, &mut caches, &ids, &opts, &mut |e| printer.event(e))?;
    println!();
    std::io::stdout().flush()?;
    eprintln!(
        "[{}] prompt {} tok, prefill {:.1} tok/s | generated {} tok, decode {:.1} tok/s | {}",
        l.cache.name(),
        out.prompt_tokens,
        out.prefill_tok_s(),
        out.tokens.len(),
        out.decode_tok_s(),
        kv_report(&l, &caches),
    );
    Ok(())
}
