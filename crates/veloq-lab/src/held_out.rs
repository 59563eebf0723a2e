//! The setup the codec experiments (`examples/`) share: SmolLM2 from the data cache, activations
//! with queries on 4,096 calibration tokens of *Persuasion* (2,048-position passes) and on 2,048
//! held-out tokens of *Emma*, so a codec trained on one is scored on the other.

use std::path::PathBuf;

use anyhow::Result;

use veloq_candle::collect::{record, Activations, Queries};
use veloq_candle::model::{encode, Model};

/// The model, then calibration and held-out activations. `cache`: the data cache of
/// `scripts/fetch-data` (default `~/.cache/veloq`).
pub fn smollm2_activations(cache: Option<PathBuf>) -> Result<(Model, Activations, Activations)> {
    let cache = match cache {
        Some(c) => c,
        None => PathBuf::from(std::env::var("HOME")?).join(".cache/veloq"),
    };
    let (model, tok) = Model::open(&cache.join("smollm2-135m-instruct.q4_1.gguf"), 8192)?;
    let calib = encode(&tok, &std::fs::read_to_string(cache.join("austen/persuasion.txt"))?)?;
    let held = encode(&tok, &std::fs::read_to_string(cache.join("austen/emma.txt"))?)?;
    let a = record(&model, &calib[..4096], 2048, Queries::All, &mut |_| {})?;
    let b = record(&model, &held[4000..4000 + 2048], 2048, Queries::All, &mut |_| {})?;
    Ok((model, a, b))
}
