//! The methods a harness compares and their calibrations: fp16 first, then the named methods,
//! each VecInfer one calibrated once from one activation collection and kept under
//! `<cache dir>/eval` (reused only when made from the same tokens with the same seed and window).

use std::path::Path;

use anyhow::{bail, Context, Result};

use veloq::artifact::Calibration;
use veloq::calibrate::TextFingerprint;
use veloq_candle::collect::{calibrate, collect_activations, Activations};
use veloq_candle::config::CacheConfig;
use veloq_candle::method::Vq;
use veloq_candle::model::{encode, Model, Tokenizer};
use veloq_candle::Method;
use veloq_cli::progress::bar;

/// The tokens of the text at `path`.
pub fn read_tokens(tok: &Tokenizer, path: &Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading {} (run scripts/fetch-data)", path.display()))?;
    Ok(encode(tok, &text)?)
}

/// The first `n` tokens of the calibration text at `path` (an error naming it when it is shorter).
pub fn calibration_tokens(tok: &Tokenizer, path: &Path, n: usize) -> Result<Vec<u32>> {
    let mut tokens = read_tokens(tok, path)?;
    if tokens.len() < n {
        bail!("{} has {} tokens, fewer than --calib-tokens {n}", path.display(), tokens.len());
    }
    tokens.truncate(n);
    Ok(tokens)
}

/// Calibrations for the VecInfer methods, trained once from one activation collection and cached
/// under ~/.cache/veloq/eval (reused only when made from the same tokens with the same seed).
pub fn calibrations(
    model: &Model,
    model_path: &Path,
    calib: &[u32],
    chosen: &[Method],
    seed: u64,
    window: usize,
    cache_dir: &Path,
) -> Result<Vec<Option<Calibration>>> {
    let text = TextFingerprint::of_tokens(calib);
    let dir = cache_dir.join("eval");
    std::fs::create_dir_all(&dir)?;
    let stem = model_path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let mut acts: Option<Activations> = None;
    let mut out = Vec::new();
    for method in chosen {
        let Method::VecInfer(Vq { keys, values, .. }) = *method else {
            out.push(None);
            continue;
        };
        let label = method.to_string();
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
        let b = bar(model.info.identity.n_layers as u64, &label);
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

/// The caches of `method` with its calibration (`None` for the methods that take none).
pub fn config(method: Method, cal: Option<Calibration>) -> Result<CacheConfig> {
    Ok(CacheConfig::new(method, cal)?)
}

/// fp16 first, then the named methods (the whole catalogue when none are named).
pub fn chosen_methods(names: &[Method]) -> Vec<Method> {
    let names = if names.is_empty() { Method::catalogue() } else { names.to_vec() };
    std::iter::once(Method::Fp16).chain(names.into_iter().filter(|m| *m != Method::Fp16)).collect()
}
