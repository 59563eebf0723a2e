#![warn(missing_docs)]
//! Errors of the cache and model layer: each variant names what was wrong, so callers can match on
//! the kind (a full context, a wrong position, a device out of memory) instead of on text.

use std::path::PathBuf;

/// Everything the cache and model layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed in candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The codec crate refused (shapes, artifacts, GPU).
    #[error(transparent)]
    Codec(#[from] veloq::Error),
    /// A model file that cannot be read as the model it claims to be.
    #[error("model file {path}: {reason}")]
    Model {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A GGUF architecture the runner does not implement.
    #[error("unsupported architecture {name:?} (supported: {supported}; Llama 3, SmolLM2, Mistral and Falcon3 GGUFs use llama)")]
    Architecture {
        /// The file's `general.architecture`.
        name: String,
        /// The names the decoder runs.
        supported: String,
    },
    /// A method name outside the vocabulary ([`Method`](crate::Method)'s `FromStr`).
    #[error("{0}")]
    Method(String),
    /// A calibration that does not fit the method or the model, or a method without the
    /// calibration it needs.
    #[error("calibration: {0}")]
    CalibrationMismatch(String),
    /// A device that cannot be opened or used as asked (not compiled in, not present, no fused
    /// kernels for it).
    #[error("device: {0}")]
    Device(String),
    /// The CUDA driver refused an operation of the runner (an event, a graph).
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} outside the vocabulary of {vocab}")]
    Token {
        /// The id.
        id: u32,
        /// Tokens in the vocabulary.
        vocab: usize,
    },
    /// A vocabulary that cannot become a tokenizer, or text it cannot encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A sequence would pass the positions its cache (or the model) was sized for.
    #[error("context of {requested} tokens exceeds the configured maximum of {max}")]
    ContextOverflow {
        /// Positions the step would reach.
        requested: usize,
        /// Positions allowed.
        max: usize,
    },
    /// A step that does not continue a sequence where its cache ends.
    #[error("sequence slot {slot} holds {expected} positions, but the step starts it at position {got}")]
    Position {
        /// The sequence slot.
        slot: usize,
        /// Positions it holds (where the step had to start).
        expected: usize,
        /// Where the step started it.
        got: usize,
    },
    /// Tensors or slots of the wrong shape for the cache or model they were given to.
    #[error("shape: {0}")]
    Shape(String),
    /// The device ran out of memory (for the caches, or for a step's buffers).
    #[error("out of device memory: {0}")]
    OutOfMemory(String),
    /// A configuration or a call that does not fit (a bad option, calls out of order).
    #[error("{0}")]
    Config(String),
    /// Evaluation text that the method was calibrated on.
    #[error(
        "method {method}: evaluation token {at} repeats the text it was calibrated on; evaluate on a different text"
    )]
    CalibrationOverlap {
        /// The method's label.
        method: String,
        /// The first evaluated token inside calibration text.
        at: usize,
    },
}

impl Error {
    /// Whether this is the device running out of memory, however it was reported (our own
    /// variant, the codec crate's, or candle's CUDA error).
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory(_) | Error::Codec(veloq::Error::OutOfMemory(_)) => true,
            Error::Candle(e) => candle_out_of_memory(e),
            _ => false,
        }
    }
}

/// candle reports CUDA failures as boxed driver errors; out of memory is the driver's
/// `CUDA_ERROR_OUT_OF_MEMORY`.
fn candle_out_of_memory(e: &candle_core::Error) -> bool {
    match e {
        candle_core::Error::WithBacktrace { inner, .. }
        | candle_core::Error::Context { inner, .. }
        | candle_core::Error::WithPath { inner, .. } => candle_out_of_memory(inner),
        #[cfg(feature = "cuda")]
        candle_core::Error::Cuda(inner) => {
            use candle_core::cuda_backend::CudaError;
            use cudarc::driver::sys::CUresult;
            inner
                .downcast_ref::<CudaError>()
                .is_some_and(|e| matches!(e, CudaError::Cuda(d) if d.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY))
        }
        _ => false,
    }
}

/// Results of the cache and model layer.
pub type Result<T> = std::result::Result<T, Error>;
