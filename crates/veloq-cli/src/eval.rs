//! `veloq eval`: perplexity, KL from fp16 and top-1 agreement of every cache method on real text,
//! at one or more context lengths, in one run. Calibrates on one novel and evaluates on another,
//! and refuses to run when the two overlap.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, Subcommand};
use serde_json::json;

use veloq::artifact::Calibration;
use veloq::calibrate::TextFingerprint;
use veloq::codec::codebook::{Granularity, PqShape};
use veloq::codec::smooth::SmoothRule;
use veloq::codec::vecinfer::CodecSpec;
use veloq_candle::collect::{calibrate, collect_activations, Activations};
use veloq_candle::config::CacheConfig;
use veloq_candle::eval::{evaluate, total_tokens, EvalConfig, MethodScore};
use veloq_candle::model::{encode, Model, Tokenizer};

use crate::calibrate::{bar, default_text};
use crate::generate::default_model;
use crate::plot;

#[derive(ClapArgs)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    /// Another evaluation instead of perplexity (`veloq eval needle --help`).
    #[command(subcommand)]
    pub mode: Option<EvalMode>,
    #[arg(long)]
    pub model: Option<PathBuf>,
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
    /// Methods, comma separated (default: all; see --list).
    #[arg(long, value_delimiter = ',')]
    pub methods: Vec<String>,
    /// Print the method names and exit.
    #[arg(long)]
    pub list: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
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
    Needle(Box<crate::needle::Args>),
}

#[derive(Clone, Copy)]
pub(crate) struct Vq {
    /// (sub_dim, codebook bits) of keys and of values.
    keys: (usize, u32),
    values: (usize, u32),
    granularity: Granularity,
    /// Subtract the calibrated mean of keys / of values.
    center: (bool, bool),
    /// How keys are smoothed (`None`: not at all).
    smooth: Option<SmoothRule>,
    rotate: bool,
    /// Keep the first positions in f16 (the cache's `sink`); off only for the ablation.
    sink: bool,
}

const fn vq(sub_dim: usize, bits: u32) -> Vq {
    Vq {
        keys: (sub_dim, bits),
        values: (sub_dim, bits),
        granularity: Granularity::PerLayer,
        center: (true, true),
        smooth: Some(SmoothRule::SqrtMaxAbs),
        rotate: true,
        sink: true,
    }
}
const VQ2: Vq = vq(4, 8);

#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Fp16,
    Vq(Vq),
    Kivi(u32),
    Rlm(u32),
}

/// Every method the harness knows, in table order. Families for the figure: the label before the
/// first `-` (vq, kivi, rlm); ablations (`vq-2/…`) and the mixed key/value rates (`vq-k…`) are
/// drawn as single points.
const METHODS: &[(&str, Kind)] = &[
    ("fp16", Kind::Fp16),
    ("vq-1", Kind::Vq(vq(8, 8))),
    ("vq-1.5", Kind::Vq(vq(8, 12))),
    ("vq-2", Kind::Vq(VQ2)),
    ("vq-3", Kind::Vq(vq(4, 12))),
    ("vq-4", Kind::Vq(vq(2, 8))),
    ("vq-k4v2", Kind::Vq(Vq { keys: (2, 8), ..VQ2 })),
    ("vq-k2v4", Kind::Vq(Vq { values: (2, 8), ..VQ2 })),
    ("vq-k3v2", Kind::Vq(Vq { keys: (4, 12), ..VQ2 })),
    ("vq-k4v1", Kind::Vq(Vq { keys: (2, 8), values: (8, 8), ..VQ2 })),
    ("vq-2/query", Kind::Vq(Vq { smooth: Some(SmoothRule::QueryRms), ..VQ2 })),
    ("vq-k3v2/query", Kind::Vq(Vq { keys: (4, 12), smooth: Some(SmoothRule::QueryRms), ..VQ2 })),
    ("vq-k4v2/query", Kind::Vq(Vq { keys: (2, 8), smooth: Some(SmoothRule::QueryRms), ..VQ2 })),
    ("vq-2/per-subspace", Kind::Vq(Vq { granularity: Granularity::PerSubspace, ..VQ2 })),
    ("vq-2/no-center", Kind::Vq(Vq { center: (false, false), ..VQ2 })),
    ("vq-2/center-v", Kind::Vq(Vq { center: (false, true), ..VQ2 })),
    ("vq-2/no-smooth", Kind::Vq(Vq { smooth: None, ..VQ2 })),
    ("vq-2/no-rotate", Kind::Vq(Vq { rotate: false, ..VQ2 })),
    ("vq-2/no-sink", Kind::Vq(Vq { sink: false, ..VQ2 })),
    ("vq-2/plain", Kind::Vq(Vq { center: (false, false), smooth: None, rotate: false, ..VQ2 })),
    ("kivi-2", Kind::Kivi(2)),
    ("kivi-4", Kind::Kivi(4)),
    ("rlm-2", Kind::Rlm(2)),
    ("rlm-3", Kind::Rlm(3)),
    ("rlm-4", Kind::Rlm(4)),
];

fn describe(kind: Kind) -> String {
    match kind {
        Kind::Fp16 => "f16 keys and values".into(),
        Kind::Vq(v) => format!(
            "VecInfer K {}b/{} V {}b/{}, {}{}{}{}{}",
            v.keys.1,
            v.keys.0,
            v.values.1,
            v.values.0,
            v.granularity.name(),
            match v.center {
                (true, true) => ", centered",
                (true, false) => ", keys centered",
                (false, true) => ", values centered",
                (false, false) => "",
            },
            match v.smooth {
                Some(SmoothRule::SqrtMaxAbs) => ", keys smoothed √max|k|",
                Some(SmoothRule::MaxAbs) => ", keys smoothed max|k|",
                Some(SmoothRule::QueryRms) => ", keys weighted by the queries' rms",
                None => ", no smoothing",
            },
            if v.rotate { ", Hadamard" } else { ", no rotation" },
            if v.sink { "" } else { ", no f16 sink" }
        ),
        Kind::Kivi(b) => format!("KIVI {b}-bit, group 32 (keys per channel, values per token)"),
        Kind::Rlm(b) => format!("randomised Hadamard + Gaussian Lloyd–Max {b}-bit, per-vector RMS"),
    }
}

fn specs(kind: Kind) -> Option<(CodecSpec, CodecSpec)> {
    let Kind::Vq(v) = kind else { return None };
    let smooth = v.smooth;
    let side = |(sd, bits): (usize, u32), center, smooth| -> Option<CodecSpec> {
        Some(CodecSpec {
            shape: PqShape::new(sd, bits).ok()?,
            granularity: v.granularity,
            center,
            smooth,
            rotate: v.rotate,
        })
    };
    Some((side(v.keys, v.center.0, smooth)?, side(v.values, v.center.1, None)?))
}

pub(crate) fn read_tokens(tok: &Tokenizer, path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {} (run scripts/fetch-data)", path.display()))?;
    Ok(encode(tok, &text)?)
}

/// The first `n` tokens of the calibration text at `path` (an error naming it when it is shorter).
pub(crate) fn calibration_tokens(tok: &Tokenizer, path: &Path, n: usize) -> Result<Vec<u32>> {
    let mut tokens = read_tokens(tok, path)?;
    if tokens.len() < n {
        bail!("{} has {} tokens, fewer than --calib-tokens {n}", path.display(), tokens.len());
    }
    tokens.truncate(n);
    Ok(tokens)
}

/// Calibrations for the VecInfer methods, trained once from one activation collection and cached
/// under ~/.cache/veloq/eval (reused only when made from the same tokens with the same seed).
pub(crate) fn calibrations(
    model: &Model,
    model_path: &Path,
    calib: &[u32],
    chosen: &[(&str, Kind)],
    seed: u64,
    window: usize,
) -> Result<Vec<Option<Calibration>>> {
    let text = TextFingerprint::of_tokens(calib);
    let dir = veloq::artifact::default_dir().join("eval");
    std::fs::create_dir_all(&dir)?;
    let stem = model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut acts: Option<Activations> = None;
    let mut out = Vec::new();
    for &(label, kind) in chosen {
        let Some((keys, values)) = specs(kind) else {
            out.push(None);
            continue;
        };
        // Named by what was trained, so methods that differ only in cache settings share a file.
        let path = dir.join(format!(
            "{stem}.{:016x}.s{seed}.t{}.w{window}.safetensors",
            fnv(&format!("{keys:?}{values:?}")),
            calib.len()
        ));
        if let Ok(c) = Calibration::load_for(&path, &model.info.identity) {
            if c.text == text && c.keys == keys && c.values == values && c.seed == seed {
                out.push(Some(c));
                continue;
            }
        }
        if acts.is_none() {
            let b = bar(calib.len() as u64, "collecting");
            acts = Some(collect_activations(model, calib, window, &mut |n| b.set_position(n as u64))?);
            b.finish();
        }
        let b = bar(model.info.identity.n_layers as u64, label);
        let cal =
            calibrate(model, acts.as_ref().expect("collected"), keys, values, seed, &mut |n| b.set_position(n as u64))?;
        b.finish();
        cal.save(&path)?;
        out.push(Some(cal));
    }
    Ok(out)
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

pub(crate) fn config(kind: Kind, cal: Option<Calibration>) -> CacheConfig {
    match (kind, cal) {
        (Kind::Vq(v), Some(c)) => {
            let mut config = CacheConfig::vecinfer(c);
            if !v.sink {
                config.window.sink = 0;
            }
            config
        }
        (Kind::Kivi(b), _) => CacheConfig::kivi(b, 32),
        (Kind::Rlm(b), _) => CacheConfig::rot_lloyd_max(b),
        _ => CacheConfig::fp16(),
    }
}

/// fp16 first, then the `names`d methods of [`METHODS`].
pub(crate) fn chosen_methods(names: &[String]) -> Result<Vec<(&'static str, Kind)>> {
    let mut v = vec![METHODS[0]];
    for m in names {
        let found = METHODS
            .iter()
            .find(|(l, _)| l == m)
            .with_context(|| format!("unknown method {m} (see veloq eval --list)"))?;
        if found.0 != "fp16" {
            v.push(*found);
        }
    }
    Ok(v)
}

pub fn run(a: Args) -> Result<()> {
    if let Some(EvalMode::Needle(n)) = a.mode {
        return crate::needle::run(*n);
    }
    if a.list {
        for (label, kind) in METHODS {
            println!("{label:<20} {}", describe(*kind));
        }
        return Ok(());
    }
    let chosen = if a.methods.is_empty() { METHODS.to_vec() } else { chosen_methods(&a.methods)? };
    let model_path = a.model.clone().unwrap_or_else(default_model);
    if let Some(json) = &a.replot {
        return replot(json, &model_path, &chosen, &a);
    }
    let max_ctx = a.ctx.iter().copied().max().context("no --ctx")?;
    let (model, tok) = Model::open(&model_path, max_ctx.max(a.calib_window.unwrap_or(0)).max(512))
        .with_context(|| format!("loading {}", model_path.display()))?;
    let eval_path = a.text.clone().unwrap_or_else(|| default_text().with_file_name("prideprejudice.txt"));
    let calib_path = a.calib_text.clone().unwrap_or_else(default_text);
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
    let cals = calibrations(&model, &model_path, &calib, &chosen, a.seed, calib_window)?;
    let methods: Vec<(String, CacheConfig)> =
        chosen.iter().zip(cals).map(|((l, k), c)| (l.to_string(), config(*k, c))).collect();
    let mut runs = Vec::new();
    for (&ctx, &windows) in a.ctx.iter().zip(&windows) {
        let cfg = EvalConfig { ctx, windows, step: a.step };
        let b = bar(total_tokens(&cfg, methods.len()) as u64, &format!("eval ctx {ctx}"));
        let started = std::time::Instant::now();
        let scores = evaluate(&model, &eval_tokens, &methods, cfg, &mut |n| b.set_position(n as u64))?;
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
            "methods": scores.iter().zip(&chosen).map(|(s, (_, k))| row_json(s, &scores[0], *k)).collect::<Vec<_>>(),
        }));
    }
    let out = json!({
        "model": model.info.identity.name,
        "eval_text": eval_path.file_name().map(|s| s.to_string_lossy().into_owned()),
        "calib_text": calib_path.file_name().map(|s| s.to_string_lossy().into_owned()),
        "calib_tokens": a.calib_tokens,
        "calib_window": calib_window,
        "step": a.step,
        "f16_window": methods[0].1.window.window,
        "seed": a.seed,
        "runs": runs,
    });
    crate::bench::write_json(&a.json, &out)
}

/// Figures and tables from an earlier run's JSON; stream bits (absent from older files) are
/// recomputed from the same cache configurations (calibrations come from the on-disk cache).
fn replot(json: &Path, model_path: &Path, chosen: &[(&str, Kind)], a: &Args) -> Result<()> {
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
        let calib_path = a.calib_text.clone().unwrap_or_else(default_text);
        let calib_tokens = read_tokens(&tok, &calib_path)?;
        let cals = calibrations(
            &model,
            model_path,
            &calib_tokens[..a.calib_tokens.min(calib_tokens.len())],
            chosen,
            a.seed,
            window,
        )?;
        chosen
            .iter()
            .zip(cals)
            .map(|((l, k), c)| Ok((l.to_string(), config(*k, c).stream_bits_per_element(&model)?)))
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

fn row_json(s: &MethodScore, reference: &MethodScore, kind: Kind) -> serde_json::Value {
    json!({
        "method": s.label, "description": describe(kind), "code_bits_per_element": s.code_bits,
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
