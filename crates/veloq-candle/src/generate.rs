//! Generation: prefill the prompt in one forward pass, then decode token by token with greedy or
//! temperature / top-p sampling, streaming text as it comes.

use std::time::Instant;

use candle_transformers::generation::{LogitsProcessor, Sampling};
use tokenizers::Tokenizer;

use crate::cache::ModelCache;
use crate::config::fp16_bytes;
use crate::error::Result;
use crate::model::{decode, encode, ChatTemplate, Model};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub seed: u64,
    /// Wrap the prompt in the model's chat template when it has one.
    pub chat: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_tokens: 128, temperature: 0.0, top_p: None, seed: 299792458, chat: true }
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Bytes the caches hold at the end.
    pub kv_resident_bytes: usize,
    /// Bytes an f16 cache of the same length would hold.
    pub kv_fp16_bytes: usize,
}

impl GenerateOutput {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s
    }
    pub fn decode_tok_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_s
    }
}

pub fn generate(
    model: &Model,
    tok: &Tokenizer,
    caches: &mut ModelCache,
    prompt: &str,
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    let prompt_ids = prompt_ids(model, tok, prompt, opts.chat)?;
    generate_ids(model, tok, caches, &prompt_ids, opts, on_text)
}

/// The token ids `generate` feeds for `prompt`: in the chat template when `chat`, after a BOS when
/// the model asks for one.
pub fn prompt_ids(model: &Model, tok: &Tokenizer, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    let text = if chat { ChatTemplate::detect(tok).apply(prompt) } else { prompt.to_string() };
    let mut ids = encode(tok, &text)?;
    if let Some(bos) = model.info.bos {
        if ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
    }
    Ok(ids)
}

pub fn generate_ids(
    model: &Model,
    tok: &Tokenizer,
    caches: &mut ModelCache,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    let sampling = if opts.temperature <= 0.0 {
        Sampling::ArgMax
    } else {
        match opts.top_p {
            Some(p) => Sampling::TopP { p, temperature: opts.temperature },
            None => Sampling::All { temperature: opts.temperature },
        }
    };
    let mut proc = LogitsProcessor::from_sampling(opts.seed, sampling);
    let start = Instant::now();
    let logits = model.forward(prompt_ids, caches, false)?.squeeze(0)?;
    let mut next = proc.sample(&logits)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut tokens = Vec::new();
    let mut shown = String::new();
    while tokens.len() < opts.max_tokens {
        tokens.push(next);
        let text = decode(tok, &tokens)?;
        if text.len() > shown.len() && text.is_char_boundary(shown.len()) {
            on_text(&text[shown.len()..]);
            shown = text;
        }
        if model.info.eos_tokens.contains(&next) || tokens.len() == opts.max_tokens {
            break;
        }
        let logits = model.forward(&[next], caches, false)?.squeeze(0)?;
        next = proc.sample(&logits)?;
    }
    let decode_s = start.elapsed().as_secs_f64();
    let len = caches.len(0);
    Ok(GenerateOutput {
        prompt_tokens: prompt_ids.len(),
        text: decode(tok, &tokens)?,
        tokens,
        prefill_s,
        decode_s,
        kv_resident_bytes: caches.resident_bytes(),
        kv_fp16_bytes: fp16_bytes(model, len),
    })
}
