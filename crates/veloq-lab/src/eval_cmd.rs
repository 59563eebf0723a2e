//! `veloq eval`: perplexity, KL from fp16 and top-1 agreement of every cache method on real text,
//! at one or more context lengths, in one run. Calibrates on one novel and evaluates on another,
//! and refuses to run when the two overlap.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, Subcommand};
use serde_json::json;
use veloq::calibrate::ValueWeights;

use veloq::calibrate::TextFingerprint;
use veloq_candle::config::{CacheConfig, WindowConfig};
use veloq_candle::model::Model;
use veloq_candle::Method;
use veloq_cli::args::Files;
use veloq_cli::progress::bar;
use veloq_lab::book_cache::BookCache;
use veloq_lab::calibrations::{calibration_tokens, calibrations, chosen_methods, config, read_tokens, set_f16_rows};
use veloq_lab::eval::{evaluate, total_tokens, EvalConfig, MethodScore};
use veloq_lab::plot;

use crate::candidate_args::CandidateArgs;
use veloq_lab::source::{sources, CacheSource};

#[derive(ClapArgs)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Another evaluation instead of perplexity (`veloq eval needle --help`).
    #[command(subcommand)]
    pub mode: Option<EvalMode>,
    #[command(flatten)]
    pub files: Files,
    /// Evaluation text (default: Pride and Prejudice, the text of ANCHORS.md's llama.cpp runs).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Calibration text for the VecInfer methods (default: Persuasion).
    #[arg(long)]
    pub calib_text: Option<PathBuf>,
    #[arg(long, default_value_t = 8192)]
    pub calib_tokens: usize,
    /// Positions per forward pass while collecting calibration activations (default: the longest
    /// --ctx). Post-RoPE keys depend on position, so codecs must see every position they will code.
    #[arg(long)]
    pub calib_window: Option<usize>,
    /// Context lengths, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    pub ctx: Vec<usize>,
    /// Windows per context length: one number for all, or one per --ctx entry.
    #[arg(long, value_delimiter = ',', default_value = "4")]
    pub windows: Vec<usize>,
    /// Tokens per teacher-forced forward call (default: the caches' flush block, so queries see
    /// about as many exact recent positions as during decode).
    #[arg(long, default_value_t = 8)]
    pub step: usize,
    /// Methods, comma separated (default: all; see --list); fp16, the reference, always runs.
    #[arg(long, value_delimiter = ',')]
    pub methods: Vec<Method>,
    /// Print the method names and exit.
    #[arg(long)]
    pub list: bool,
    /// Positions every coded method (and candidate) keeps in f16 beside its codes, `SINK/RECENT`
    /// (first positions for good / recent ones after a flush; default 4/16, 0/16 for `/no-sink`).
    #[arg(long)]
    pub f16_rows: Option<WindowConfig>,
    #[command(flatten)]
    pub candidates: CandidateArgs,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// What the VecInfer methods' value codebooks weigh rows by (`veloq calibrate
    /// --value-weights`): uniform or attention.
    #[arg(long, default_value = "uniform")]
    pub value_weights: ValueWeights,
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// PNG figure prefix: writes PREFIX-ctx{N}.png (ΔPPL and KL against bits per element).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Re-draw the figures and tables of an earlier run's JSON (with --plot) instead of evaluating.
    #[arg(long)]
    pub replot: Option<PathBuf>,
}

#[derive(Subcommand)]
pub enum EvalMode {
    /// Needle in a haystack: passkey retrieval over context lengths × depths, per method.
    Needle(Box<crate::needle_cmd::Args>),
}

/// Runs the evaluation (or the needle grid).
pub fn run(a: Args) -> Result<()> {
    if let Some(EvalMode::Needle(n)) = a.mode {
        return crate::needle_cmd::run(*n);
    }
    if a.list {
        for m in Method::catalogue() {
            println!("{:<20} {}", m.to_string(), m.describe(64));
        }
        return Ok(());
    }
    let chosen = chosen_methods(&a.methods);
    let model_path = a.files.model();
    if let Some(json) = &a.replot {
        return replot(json, &model_path, &chosen, &a);
    }
    let max_ctx = a.ctx.iter().copied().max().context("no --ctx")?;
    let (model, tok) = Model::open(&model_path, max_ctx.max(a.calib_window.unwrap_or(0)).max(512))
        .with_context(|| format!("loading {}", model_path.display()))?;
    a.candidates.check_on(model.device(), a.seed)?;
    let eval_path = a.text.clone().unwrap_or_else(|| a.files.text("prideprejudice"));
    let calib_path = a.calib_text.clone().unwrap_or_else(|| a.files.text("persuasion"));
    let eval_tokens = read_tokens(&tok, &eval_path)?;
    let calib = calibration_tokens(&tok, &calib_path, a.calib_tokens)?;
    let windows: Vec<usize> = match a.windows.len() {
        1 => vec![a.windows[0]; a.ctx.len()],
        n if n == a.ctx.len() => a.windows.clone(),
        n => bail!("--windows has {n} entries for {} context lengths", a.ctx.len()),
    };
    let used = a.ctx.iter().zip(&windows).map(|(c, w)| c * w).max().unwrap_or(0).min(eval_tokens.len());
    if let Some(at) = TextFingerprint::of_tokens(&calib).first_overlap(&eval_tokens[..used]) {
        bail!(
            "calibration text {} and evaluation text {} overlap (evaluation token {at} repeats calibration text); \
             calibrate and evaluate on different texts",
            calib_path.display(),
            eval_path.display()
        );
    }
    let calib_window = a.calib_window.unwrap_or(max_ctx);
    let cals =
        calibrations(&model, &model_path, &calib, &chosen, a.seed, calib_window, a.value_weights, &a.files.cache_dir)?;
    let hd = model.info.identity.head_dim;
    let mut candidates = a.candidates.build(
        &model,
        &calib,
        calib_window,
        &chosen,
        &cals,
        a.seed,
        Some(BookCache::new(&a.files.cache_dir, &model_path)?),
    )?;
    let mut methods: Vec<(String, CacheConfig)> =
        chosen.iter().zip(cals).map(|(m, c)| Ok((m.to_string(), config(*m, c)?))).collect::<Result<_>>()?;
    set_f16_rows(a.f16_rows, &mut methods, &mut candidates);
    let mut runs_on = sources(&methods);
    runs_on.extend(candidates.iter().map(|c| (c.label.clone(), &c.simulation as &dyn CacheSource)));
    let descriptions: Vec<String> =
        chosen.iter().map(|m| m.describe(hd)).chain(candidates.iter().map(|c| c.description.clone())).collect();
    let mut runs = Vec::new();
    for (&ctx, &windows) in a.ctx.iter().zip(&windows) {
        let cfg = EvalConfig { ctx, windows, step: a.step };
        let b = bar(total_tokens(&cfg, runs_on.len()) as u64, &format!("eval ctx {ctx}"));
        let started = std::time::Instant::now();
        let scores = evaluate(&model, &eval_tokens, &runs_on, cfg, &mut |n| b.set_position(n as u64))?;
        b.finish();
        print_table(ctx, windows, &scores);
        if let Some(prefix) = &a.plot {
            let path = PathBuf::from(format!("{}-ctx{ctx}.png", prefix.display()));
            plot::quality(&path, ctx, &scores)?;
            eprintln!("wrote {}", path.display());
        }
        runs.push(json!({
            "ctx": ctx, "windows": windows, "scored_tokens": scores[0].scored,
            "seconds": started.elapsed().as_secs_f64(),
            "methods": scores.iter().zip(&descriptions).map(|(s, d)| row_json(s, &scores[0], d)).collect::<Vec<_>>(),
        }));
    }
    let out = json!({
        "model": model.info.identity.name,
        "eval_text": eval_path.file_name().map(|s| s.to_string_lossy().into_owned()),
        "calib_text": calib_path.file_name().map(|s| s.to_string_lossy().into_owned()),
        "calib_tokens": a.calib_tokens,
        "calib_window": calib_window,
        "value_weights": a.value_weights.name(),
        "f16_rows": a.f16_rows.map(|w| w.to_string()),
        "outlier_rows": a.candidates.outlier_rows,
        "per_head": a.candidates.per_head,
        "rescore": a.candidates.rescore,
        "rescore_keys": a.candidates.rescore_keys,
        "step": a.step,
        // The coded methods' recent window (fp16, always first, has none of its own).
        "f16_window": methods.iter().find(|(_, c)| c.method != Method::Fp16).unwrap_or(&methods[0]).1.window.window,
        "seed": a.seed,
        "runs": runs,
    });
    crate::bench::write_json(&a.json, &out)
}

/// Figures and tables from an earlier run's JSON; stream bits (absent from older files) are
/// recomputed from the same cache configurations (calibrations come from the on-disk cache).
fn replot(json: &Path, model_path: &Path, chosen: &[Method], a: &Args) -> Result<()> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json)?)?;
    let runs = v["runs"].as_array().context("no runs in the JSON")?;
    let missing = runs
        .iter()
        .flat_map(|r| r["methods"].as_array().into_iter().flatten())
        .any(|m| m["stream_bits_per_element"].is_null());
    // Only older files lack stream bits; those calibrations are rebuilt (or found in the cache) with
    // the window the run used (512 before the JSON recorded it).
    let stream: Vec<(String, f64)> = if missing {
        let window = a.calib_window.or(v["calib_window"].as_u64().map(|w| w as usize)).unwrap_or(512);
        let (model, tok) = Model::open(model_path, window.max(512))?;
        let calib_path = a.calib_text.clone().unwrap_or_else(|| a.files.text("persuasion"));
        let calib_tokens = read_tokens(&tok, &calib_path)?;
        let calib_tokens = &calib_tokens[..a.calib_tokens.min(calib_tokens.len())];
        let cals = calibrations(
            &model,
            model_path,
            calib_tokens,
            chosen,
            a.seed,
            window,
            a.value_weights,
            &a.files.cache_dir,
        )?;
        chosen
            .iter()
            .zip(cals)
            .map(|(m, c)| Ok((m.to_string(), config(*m, c)?.stream_bits_per_element(&model)?)))
            .collect::<Result<_>>()?
    } else {
        Vec::new()
    };
    for run in runs {
        let ctx = run["ctx"].as_u64().context("ctx")? as usize;
        let scores: Vec<MethodScore> = run["methods"]
            .as_array()
            .context("methods")?
            .iter()
            .map(|m| {
                let label = m["method"].as_str().unwrap_or("?").to_string();
                let scored = m["scored_tokens"].as_u64().unwrap_or(0) as usize;
                let f = |k: &str| m[k].as_f64().unwrap_or(f64::NAN);
                MethodScore {
                    stream_bits: m["stream_bits_per_element"]
                        .as_f64()
                        .or_else(|| stream.iter().find(|s| s.0 == label).map(|s| s.1))
                        .unwrap_or(f64::NAN),
                    label,
                    code_bits: f("code_bits_per_element"),
                    resident_bytes: m["resident_kv_bytes"].as_u64().unwrap_or(0) as usize,
                    scored,
                    nll_sum: f("ppl").ln() * scored as f64,
                    kl_sum: f("kl") * scored as f64,
                    top1_same: (f("top1_agreement") * scored as f64).round() as usize,
                }
            })
            .collect();
        print_table(ctx, run["windows"].as_u64().unwrap_or(0) as usize, &scores);
        if let Some(prefix) = &a.plot {
            let path = PathBuf::from(format!("{}-ctx{ctx}.png", prefix.display()));
            plot::quality(&path, ctx, &scores)?;
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn row_json(s: &MethodScore, reference: &MethodScore, description: &str) -> serde_json::Value {
    json!({
        "method": s.label, "description": description, "code_bits_per_element": s.code_bits,
        "stream_bits_per_element": s.stream_bits,
        "resident_kv_bytes": s.resident_bytes, "ppl": s.ppl(), "delta_ppl": s.ppl() - reference.ppl(),
        "kl": s.kl(), "top1_agreement": s.top1(), "scored_tokens": s.scored,
    })
}

fn print_table(ctx: usize, windows: usize, scores: &[MethodScore]) {
    let r = &scores[0];
    println!("\nctx {ctx}, {windows} windows, {} scored tokens", r.scored);
    println!(
        "| method | stream bits/elem | bits/elem, all metadata at ctx | resident KV KiB | PPL | ΔPPL | KL | top-1 |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for s in scores {
        println!(
            "| {} | {:.2} | {:.2} | {:.0} | {:.3} | {:+.3} | {:.4} | {:.1}% |",
            s.label,
            s.stream_bits,
            s.code_bits,
            s.resident_bytes as f64 / 1024.0,
            s.ppl(),
            s.ppl() - r.ppl(),
            s.kl(),
            100.0 * s.top1()
        );
    }
}
