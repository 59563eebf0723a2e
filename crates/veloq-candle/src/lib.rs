#![warn(missing_docs)]
//! veloq on candle: the cache contract and its backends, models over GGUF weights described by
//! data, the runner, generation, chat, calibration and the continuous-batching engine, and the
//! typed front door ([`runtime`], [`Method`]) the CLI, the server, the lab and the Python binding
//! stand on.

pub mod cache;
pub mod chat;
pub mod collect;
pub mod config;
pub mod cuda_options;
pub mod engine;
pub mod error;
pub mod generate;
pub mod grammar;
pub mod interop;
pub mod method;
pub mod model;
pub mod prefill;
pub mod runner;
pub mod runtime;
pub mod sampling;
pub mod text;
pub mod units;

#[cfg(test)]
mod testing;

pub use config::CacheConfig;
pub use error::{Error, Result};
pub use method::Method;
pub use runner::{Forward, Runner};
