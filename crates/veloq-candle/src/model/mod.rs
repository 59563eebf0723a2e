//! Models over GGUF weights: the family's descriptor and the file's metadata give the geometry
//! ([`arch`]), weights come from a file or from memory ([`source`]), our own forward pass runs
//! them (so the cache contract is the only place keys and values live), candle's quantized matmul
//! multiplies (veloq's kernels for Q4_1 weights on the CPU and f16 weights on CUDA).

pub mod arch;
mod decoder;
#[cfg(feature = "cuda")]
mod f16_rows;
mod jinja;
mod linear;
pub mod source;
mod template;
mod tokenizer;

pub use decoder::{LoadOptions, Logits, Model, Weights};
#[cfg(feature = "cuda")]
pub(crate) use decoder::{Qkv, RopeRows};
pub use jinja::{JinjaTemplate, Template};
pub use template::{ChatTemplate, Part, Role, Transcript};
pub use tokenizer::{decode, encode, encode_parts, load_tokenizer, word_tokenizer};
pub use tokenizers::Tokenizer;

use veloq::artifact::ModelIdentity;

/// What the runner and the caches need to know about a model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// Name, architecture and the geometry a calibration must match.
    pub identity: ModelIdentity,
    /// The family's descriptor.
    pub arch: &'static arch::Architecture,
    /// Query heads.
    pub n_heads: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Tokens of the vocabulary.
    pub vocab: usize,
    /// RoPE base of the global layers.
    pub rope_base: f32,
    /// Context the model was trained for (GGUF `context_length`), if recorded.
    pub train_context: Option<usize>,
    /// Tokens that end a completion (the file's EOS and the chat templates' end markers).
    pub eos_tokens: Vec<u32>,
    /// Token every prompt starts with, when the file asks for one (`tokenizer.ggml.add_bos_token`,
    /// which SentencePiece vocabularies default to).
    pub bos: Option<u32>,
    /// The file's own chat template (`tokenizer.chat_template`), when it has one that parses.
    pub chat_template: Option<std::sync::Arc<JinjaTemplate>>,
}
