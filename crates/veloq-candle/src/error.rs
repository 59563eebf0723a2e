//! Errors of the cache and model layer.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Codec(#[from] veloq::Error),
    #[error("model file {path}: {reason}")]
    Model { path: PathBuf, reason: String },
    #[error("unsupported architecture {0:?} (supported: llama, mistral, qwen2, gemma3; Llama 3, SmolLM2 and Falcon3 GGUFs use llama)")]
    Architecture(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("context of {requested} tokens exceeds the configured maximum of {max}")]
    ContextOverflow { requested: usize, max: usize },
    #[error("{0}")]
    Config(String),
    #[error("method {method}: evaluation token {at} repeats the text it was calibrated on; evaluate on a different text")]
    CalibrationOverlap { method: String, at: usize },
}

pub type Result<T> = std::result::Result<T, Error>;
