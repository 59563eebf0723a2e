//! Generation: prefill the prompt in chunks, then decode token by token with the request's
//! [`Sampler`], streaming text as it comes.

use std::time::Instant;

use tokenizers::Tokenizer;

use crate::cache::ModelCache;
use crate::config::fp16_bytes;
use crate::error::{Error, Result};
use crate::model::{decode, encode, encode_parts, Logits, Model, Role};
use crate::prefill::{prefill, DEFAULT_CHUNK};
use crate::runner::Forward;
use crate::sampling::{Sampler, SamplingOptions};
use crate::text::TextStream;

#[derive(Clone, Debug)]
/// How [`generate`] samples and feeds the prompt.
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How the next token is chosen.
    pub sampling: SamplingOptions,
    /// Wrap the prompt in the model's chat template when it has one.
    pub chat: bool,
    /// Prompt tokens per forward pass (see [`crate::prefill`]).
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_tokens: 128, sampling: SamplingOptions::greedy(), chat: true, prefill_chunk: DEFAULT_CHUNK }
    }
}

impl GenerateOptions {
    /// Refuses sampling settings that would silently mean something else (a top-p of 7, a NaN
    /// temperature) before any work is done; token ids are checked against `vocab`.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(Error::Config("max_tokens must be at least 1".into()));
        }
        self.sampling.validate(vocab)?;
        if self.prefill_chunk == 0 {
            return Err(Error::Config("the prefill chunk must be at least one token".into()));
        }
        Ok(())
    }
}

/// What generation reports as it goes.
#[derive(Clone, Copy, Debug)]
pub enum Event<'a> {
    /// `done` of `total` prompt tokens are in the caches.
    /// `done` of `total` prompt tokens are in the caches.
    Prefilled {
        /// Prompt tokens fed so far.
        done: usize,
        /// Prompt tokens in all.
        total: usize,
    },
    /// New text of the completion.
    Text(&'a str),
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-sequence token.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The caches reached the model's context.
    Context,
    /// The request's time limit ran out (the server's `--request-timeout`).
    TimeLimit,
}

#[derive(Clone, Debug)]
/// What a generation produced, and how fast.
pub struct GenerateOutput {
    /// Tokens fed before generating.
    pub prompt_tokens: usize,
    /// Generated tokens (the end-of-sequence one included).
    pub tokens: Vec<u32>,
    /// Their text.
    pub text: String,
    /// Why it stopped.
    pub finish: Finish,
    /// Seconds of prefill (to the first token).
    pub prefill_s: f64,
    /// Seconds of decode after it.
    pub decode_s: f64,
    /// Bytes the caches hold at the end.
    pub kv_resident_bytes: usize,
    /// Bytes an f16 cache of the same length would hold.
    pub kv_fp16_bytes: usize,
}

impl GenerateOutput {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s
    }
    /// Generated tokens per second of decode (the first token is the prefill's).
    pub fn decode_tok_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_s
    }
}

/// Generates after `prompt` (in the chat template when `opts.chat`), streaming the text to `on_text`.
pub fn generate(
    model: &dyn Forward,
    tok: &Tokenizer,
    caches: &mut ModelCache,
    prompt: &str,
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateOutput> {
    let prompt_ids = prompt_ids(model.model(), tok, prompt, opts.chat)?;
    generate_ids(model, tok, caches, &prompt_ids, opts, &mut |e| {
        if let Event::Text(s) = e {
            on_text(s)
        }
    })
}

/// The token ids `generate` feeds for `prompt`: in the chat template when `chat`, after a BOS when
/// the model asks for one.
pub fn prompt_ids(model: &Model, tok: &Tokenizer, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    if chat {
        return chat_ids(model, tok, &[(Role::User, prompt)]);
    }
    let mut ids = encode(tok, prompt)?;
    with_bos(model, &mut ids);
    Ok(ids)
}

/// The token ids of a conversation in the model's chat template, up to its next reply, after a
/// BOS when the model asks for one. Control tokens typed inside a message are text (see
/// [`encode_parts`]).
pub fn chat_ids(model: &Model, tok: &Tokenizer, messages: &[(Role, &str)]) -> Result<Vec<u32>> {
    let mut ids = encode_parts(tok, &model.chat_template(tok).render_parts(messages, tok)?)?;
    with_bos(model, &mut ids);
    Ok(ids)
}

/// Puts the model's BOS first in `ids` when the file asks for one and it is not there yet.
pub fn with_bos(model: &Model, ids: &mut Vec<u32>) {
    if let Some(bos) = model.info.bos {
        if ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
    }
}

/// Continues the sequence in slot 0 with `prompt_ids` (prefilled in chunks) and generates after
/// them. The last generated token is not fed back (nothing attends to it yet): a follow-up turn
/// starts with it, see [`crate::chat::Chat`].
pub fn generate_ids(
    runner: &dyn Forward,
    tok: &Tokenizer,
    caches: &mut ModelCache,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<GenerateOutput> {
    let model = runner.model();
    opts.validate(model.info.vocab)?;
    let mut proc = Sampler::new(opts.sampling.clone(), prompt_ids);
    let start = Instant::now();
    let logits = prefill(runner, caches, 0, prompt_ids, opts.prefill_chunk, &mut |done, total| {
        on_event(Event::Prefilled { done, total })
    })?;
    let mut next = proc.sample(&logits)?;
    let prefill_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut tokens = Vec::new();
    let mut text = TextStream::new(Vec::new());
    let finish = loop {
        tokens.push(next);
        let piece = text.push(tok, next)?;
        if !piece.is_empty() {
            on_event(Event::Text(&piece));
        }
        if model.info.eos_tokens.contains(&next) {
            break Finish::Stop;
        }
        if tokens.len() >= opts.max_tokens {
            break Finish::Length;
        }
        if caches.len(0) >= model.max_context() {
            break Finish::Context;
        }
        let logits = runner.forward(&[next], caches, Logits::Last)?.squeeze(0)?;
        next = proc.sample(&logits)?;
    };
    let rest = text.finish();
    if !rest.is_empty() {
        on_event(Event::Text(&rest));
    }
    let decode_s = start.elapsed().as_secs_f64();
    let len = caches.len(0);
    Ok(GenerateOutput {
        prompt_tokens: prompt_ids.len(),
        text: decode(tok, &tokens)?,
        tokens,
        finish,
        prefill_s,
        decode_s,
        kv_resident_bytes: caches.resident_bytes(),
        kv_fp16_bytes: fp16_bytes(model, len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_settings_are_validated() {
        let ok = GenerateOptions::default();
        assert!(ok.validate(100).is_ok());
        let sampling = |s: SamplingOptions| GenerateOptions { sampling: s, ..ok.clone() };
        for bad in [
            sampling(SamplingOptions { top_p: Some(7.0), ..SamplingOptions::default() }),
            sampling(SamplingOptions { temperature: -1.0, ..SamplingOptions::default() }),
            sampling(SamplingOptions { logit_bias: vec![(100, 1.0)], ..SamplingOptions::default() }),
            GenerateOptions { max_tokens: 0, ..ok.clone() },
            GenerateOptions { prefill_chunk: 0, ..ok.clone() },
        ] {
            let e = bad.validate(100).unwrap_err().to_string();
            assert!(e.contains("must") || e.contains("vocabulary"), "{bad:?}: {e}");
        }
    }
}
