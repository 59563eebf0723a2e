//! `veloq calibrate`: collect post-RoPE keys and values on real text, train the codebooks of a
//! VecInfer method, write the artifact where `generate`, `chat` and `serve` look for it.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;

use veloq::calibrate::ValueWeights;
use veloq_candle::collect::{calibrate_text, CalibrateOptions, Progress};
use veloq_candle::model::Model;
use veloq_candle::Method;

use crate::args::Files;
use crate::progress::bar;

/// `veloq calibrate`'s flags.
#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    /// Model, text and cache directory.
    pub files: Files,
    /// The VecInfer method to train codebooks for: vq-4 (default: 256 centroids per 2 channels,
    /// retrieval level with fp16), vq-2, vq-k4v2, vq-3… (`veloq methods`).
    #[arg(long, default_value = "vq-4")]
    pub method: Method,
    /// Calibration text (default: Persuasion, from scripts/fetch-data).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens of text to calibrate on.
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Positions per forward pass while collecting. Post-RoPE keys depend on position, so make it
    /// at least the context you will run (codecs calibrated on short windows code long contexts
    /// worse: results/README.md, "calibration window").
    #[arg(long, default_value_t = 8192)]
    pub window: usize,
    /// k-means seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// What the value codebooks' k-means weighs each row by: `uniform`, or `attention` (the
    /// attention each position receives while coded, on the text's own queries: lower KL at the
    /// same bits, most at 2-bit values; results/README.md, "value books by attention").
    #[arg(long, default_value = "uniform")]
    pub value_weights: ValueWeights,
    /// Where to write (default: <cache-dir>/<model>.<method>.safetensors).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Calibrates and writes the artifact.
pub fn run(a: Args) -> Result<()> {
    let Method::VecInfer(vq) = a.method else {
        bail!("{} needs no calibration: only VecInfer methods (vq-…) have codebooks", a.method);
    };
    let model_path = a.files.model();
    let (model, tok) =
        Model::open(&model_path, a.window.max(512)).with_context(|| format!("loading {}", model_path.display()))?;
    let text_path = a.text.clone().unwrap_or_else(|| a.files.text("persuasion"));
    let text = std::fs::read_to_string(&text_path)
        .with_context(|| format!("reading {} (run scripts/fetch-data)", text_path.display()))?;
    let opts = CalibrateOptions { tokens: a.tokens, window: a.window, seed: a.seed, value_weights: a.value_weights };
    let (collecting, training) =
        (bar(a.tokens as u64, "collecting"), bar(model.info.identity.n_layers as u64, "k-means"));
    let cal = calibrate_text(&model, &tok, &text, vq, &opts, &mut |p| match p {
        Progress::Collecting(n, _) => collecting.set_position(n as u64),
        Progress::Training(n, _) => {
            collecting.finish();
            training.set_position(n as u64)
        }
    })
    .with_context(|| format!("calibrating on {}", text_path.display()))?;
    training.finish();
    let out = a.out.clone().unwrap_or_else(|| a.files.calibration(&a.method));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    cal.save(&out)?;
    eprintln!(
        "wrote {}: {} for {} layers ({}; {:.2} bits/element at 4k tokens with the codebooks), {} calibration tokens, {} value weights",
        out.display(),
        a.method,
        cal.layers.len(),
        a.method.describe(model.info.identity.head_dim),
        cal.bits_per_element(4096),
        cal.calibration_tokens,
        cal.value_weights
    );
    Ok(())
}
