//! `veloq calibrate`: collect post-RoPE keys and values on real text, train the codebooks, write
//! the artifact.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use indicatif::{ProgressBar, ProgressStyle};

use veloq::codec::codebook::{Granularity, PqShape};
use veloq::codec::smooth::SmoothRule;
use veloq::codec::vecinfer::CodecSpec;
use veloq_candle::collect::{calibrate, collect_activations};
use veloq_candle::model::{encode, Model};

use crate::generate::{default_calibration, default_model};

#[derive(ClapArgs)]
pub struct Args {
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Calibration text (default: Persuasion, from scripts/fetch-data).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens of text to calibrate on.
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Positions per forward pass while collecting. Post-RoPE keys depend on position, so make it
    /// at least the context you will run: on SmolLM2 at ctx 2048, codecs calibrated with
    /// 512-position windows gave KL 0.144, with 2048-position windows 0.074 (`veloq eval`).
    #[arg(long, default_value_t = 8192)]
    pub window: usize,
    /// Keys: 8-bit codes per 2 channels (4 bits/element) by default. 2-bit keys (sub_dim 4) lose
    /// the needle in long contexts: their score noise (≈1.2 in scaled q·k) spreads a retrieval
    /// head's attention over the haystack (README, "Needle in a haystack").
    #[arg(long, default_value_t = 2)]
    pub key_sub_dim: usize,
    #[arg(long, default_value_t = 8)]
    pub key_bits: u32,
    /// Values: 8-bit codes per 2 channels (4 bits/element) by default. With 2-bit values
    /// (sub_dim 4) SmolLM2 loses retrieval at 8k tokens (21 prompts fp16 answered and it did not,
    /// against 2 the other way); with 4-bit values it stays within the noise at every length.
    #[arg(long, default_value_t = 2)]
    pub value_sub_dim: usize,
    #[arg(long, default_value_t = 8)]
    pub value_bits: u32,
    /// per_layer or per_subspace
    #[arg(long, default_value = "per_layer")]
    pub granularity: String,
    /// Key smoothing: sqrt_max_abs (default, measured best), max_abs, query_rms (from the
    /// queries' second moments; measured no better for retrieval) or none
    #[arg(long, default_value = "sqrt_max_abs")]
    pub smooth: String,
    /// Do not subtract the calibrated per-channel mean before quantizing.
    #[arg(long)]
    pub no_center: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn default_text() -> PathBuf {
    veloq::artifact::default_dir().join("austen/persuasion.txt")
}

/// The CLI's progress bar: message, bar, count, elapsed time and estimate.
pub fn bar(len: u64, msg: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} {elapsed} (eta {eta})")
            .unwrap()
            .progress_chars("=> "),
    );
    b.set_message(msg.to_string());
    b
}

pub fn run(a: Args) -> Result<()> {
    let model_path = a.model.clone().unwrap_or_else(default_model);
    let (model, tok) =
        Model::open(&model_path, a.window.max(512)).with_context(|| format!("loading {}", model_path.display()))?;
    let text_path = a.text.clone().unwrap_or_else(default_text);
    let text = std::fs::read_to_string(&text_path)
        .with_context(|| format!("reading {} (run scripts/fetch-data)", text_path.display()))?;
    let mut ids = encode(&tok, &text)?;
    if ids.len() < a.tokens {
        bail!("{} has {} tokens, fewer than the {} asked for", text_path.display(), ids.len(), a.tokens);
    }
    ids.truncate(a.tokens);
    let granularity = Granularity::parse(&a.granularity)?;
    let smooth = if a.smooth == "none" { None } else { Some(SmoothRule::parse(&a.smooth)?) };
    let keys = CodecSpec {
        shape: PqShape::new(a.key_sub_dim, a.key_bits)?,
        granularity,
        center: !a.no_center,
        smooth,
        rotate: true,
    };
    let values = CodecSpec {
        shape: PqShape::new(a.value_sub_dim, a.value_bits)?,
        granularity,
        center: !a.no_center,
        smooth: None,
        rotate: true,
    };
    let b = bar(ids.len() as u64, "collecting");
    let acts = collect_activations(&model, &ids, a.window, &mut |n| b.set_position(n as u64))?;
    b.finish();
    let b = bar(acts.layers.len() as u64, "k-means");
    let cal = calibrate(&model, &acts, keys, values, a.seed, &mut |n| b.set_position(n as u64))?;
    b.finish();
    let out = a.out.clone().unwrap_or_else(|| default_calibration(&model_path));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    cal.save(&out)?;
    eprintln!(
        "wrote {}: {} layers, keys {}b/{} values {}b/{} ({:.2} bits/element at 4k tokens incl. codebooks), {} calibration tokens",
        out.display(),
        cal.layers.len(),
        a.key_bits,
        a.key_sub_dim,
        a.value_bits,
        a.value_sub_dim,
        cal.bits_per_element(4096),
        ids.len()
    );
    Ok(())
}
