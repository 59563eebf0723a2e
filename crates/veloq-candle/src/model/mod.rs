//! Models over GGUF weights: geometry from the file's metadata, our own forward pass (so the
//! cache contract is the only place keys and values live), candle's quantized matmul (veloq's kernel for Q4_1 weights on the CPU).

mod decoder;
#[cfg(feature = "cuda")]
mod graph;
mod linear;
mod synthetic;
mod tokenizer;

pub use decoder::{Logits, Model};
#[cfg(feature = "cuda")]
pub use graph::StepPhases;
/// Whether f16 weights on CUDA take veloq's GEMV for decode steps (on by default, `VELOQ_CUDA_GEMV=0`
/// turns it off): off, candle's matmul (cuBLAS), the path before it.
#[cfg(feature = "cuda")]
pub use linear::gemv::set as set_cuda_gemv;
pub use synthetic::Geometry;
pub use tokenizer::{decode, encode, load_tokenizer, word_tokenizer, ChatTemplate, Role};
pub use tokenizers::Tokenizer;

use veloq::artifact::ModelIdentity;

/// What the runner and the caches need to know about a model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub identity: ModelIdentity,
    pub n_heads: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub rope_base: f32,
    /// Context the model was trained for (GGUF `context_length`), if recorded.
    pub train_context: Option<usize>,
    pub eos_tokens: Vec<u32>,
    /// Token every prompt starts with, when the file asks for one (`tokenizer.ggml.add_bos_token`,
    /// which SentencePiece vocabularies default to).
    pub bos: Option<u32>,
}
