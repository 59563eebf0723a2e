#![warn(missing_docs)]
//! veloq's laboratory, beside the product: the evaluation harnesses (perplexity and KL on real
//! text, passkey retrieval in a haystack, per-head attention probes), random-weight models of real
//! geometries, heap measurement, and the figures. The `veloq-lab` binary's benchmarks and
//! commands stand on these.

pub mod book_cache;
pub mod calibrations;
#[cfg(feature = "cuda")]
pub mod cuda_checks;
pub mod eval;
pub mod held_out;
pub mod key_heads;
pub mod linalg;
pub mod measure;
pub mod needle;
pub mod plot;
pub mod probe;
pub mod reread_log;
pub mod rescore;
pub mod second_stage;
pub mod simulate;
pub mod source;
pub mod synthetic;
pub mod turning;

#[cfg(test)]
mod testing;
