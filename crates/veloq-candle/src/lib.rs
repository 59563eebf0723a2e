//! veloq on candle: the cache contract and its implementations (fp16, VecInfer), models over GGUF
//! weights, generation, and activation collection for calibration.

pub mod cache;
pub mod chat;
pub mod collect;
pub mod config;
pub mod engine;
pub mod error;
pub mod eval;
pub mod generate;
pub mod model;
pub mod needle;
pub mod prefill;
pub mod probe;
pub mod text;

#[cfg(test)]
mod testing;

pub use error::{Error, Result};
