//! The tokenizer, built from the GGUF's own vocabulary and merges (no tokenizer.json needed).

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{PreTokenizerWrapper, Tokenizer};

use crate::error::{Error, Result};

/// Builds the tokenizer of a gpt2-style (BPE) GGUF vocabulary. candle falls back to a
/// prefix-space ByteLevel pre-tokenizer for `pre` values it does not know, which splits chat markup
/// wrongly for SmolLM2 (`smollm`): that one gets its real pipeline (single digits, ByteLevel
/// without prefix space).
pub fn load_tokenizer(ct: &gguf_file::Content) -> Result<Tokenizer> {
    let mut tok = Tokenizer::from_gguf(ct).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let pre = ct.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
    if pre == "smollm" {
        let seq = Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]);
        tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(seq)));
    }
    Ok(tok)
}

/// Chat templates we can apply without a Jinja engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n…<|im_end|>` (SmolLM2, Qwen2).
    ChatMl,
    /// No template: the prompt is fed as is.
    Raw,
}

impl ChatTemplate {
    /// ChatML when the vocabulary has its markers.
    pub fn detect(tok: &Tokenizer) -> Self {
        if tok.token_to_id("<|im_start|>").is_some() && tok.token_to_id("<|im_end|>").is_some() {
            ChatTemplate::ChatMl
        } else {
            ChatTemplate::Raw
        }
    }

    pub fn apply(self, prompt: &str) -> String {
        match self {
            ChatTemplate::ChatMl => format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"),
            ChatTemplate::Raw => prompt.to_string(),
        }
    }
}

pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?.get_ids().to_vec())
}

pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, true).map_err(|e| Error::Tokenizer(e.to_string()))
}
