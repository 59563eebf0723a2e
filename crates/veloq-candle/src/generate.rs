//! Generation: prefill the prompt in chunks, then decode token by token with the request's
//! [`Sampler`], streaming text as it comes.

use std::time::Instant;

use tokenizers::Tokenizer;

use crate::cache::ModelCache;
use crate::config::fp16_bytes;
use crate::error::{Error, Result};
use crate::model::{decode, encode, encode_parts, Logits, Model, Role, Transcript};
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
    transcript_ids(model, tok, &Transcript::of(messages))
}

/// [`chat_ids`] of a transcript: tools, calls and their results as the file's template shows them
/// (a written-out template takes plain messages only, see [`Template::takes_tools`](crate::model::Template::takes_tools)).
pub fn transcript_ids(model: &Model, tok: &Tokenizer, transcript: &Transcript) -> Result<Vec<u32>> {
    let mut ids = encode_parts(tok, &model.chat_template(tok).transcript_parts(transcript, tok)?)?;
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
    let mut d = Decoding::start(runner, caches, prompt_ids, opts, &mut |done, total| {
        on_event(Event::Prefilled { done, total })
    })?;
    while let Some(piece) = d.step(runner, tok, caches)? {
        if !piece.is_empty() {
            on_event(Event::Text(&piece));
        }
    }
    d.output(runner, tok, caches)
}

/// Generation pulled one token at a time by its caller: [`generate_ids`] is a loop over it, and an
/// iterator that stops early (Python's `for piece in model.generate(..., stream=True)`) just drops
/// it, leaving the caches with what was fed. It borrows nothing between calls: each step is handed
/// the runner, tokenizer and caches it started with.
pub struct Decoding {
    sampler: Sampler,
    /// Sampled, not yet taken into the output.
    next: u32,
    tokens: Vec<u32>,
    text: TextStream,
    finish: Option<Finish>,
    flushed: bool,
    max_tokens: usize,
    prompt_tokens: usize,
    prefill_s: f64,
    decode_start: Instant,
    decode_s: f64,
}

impl Decoding {
    /// Validates `opts`, prefills `prompt_ids` into slot 0 (reporting `done, total` prompt tokens
    /// as chunks go in) and samples the first token.
    pub fn start(
        runner: &dyn Forward,
        caches: &mut ModelCache,
        prompt_ids: &[u32],
        opts: &GenerateOptions,
        on_prefill: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        opts.validate(runner.model().info.vocab)?;
        let mut sampler = Sampler::new(opts.sampling.clone(), prompt_ids);
        let start = Instant::now();
        let logits = prefill(runner, caches, 0, prompt_ids, opts.prefill_chunk, on_prefill)?;
        let next = sampler.sample(&logits)?;
        Ok(Self {
            sampler,
            next,
            tokens: Vec::new(),
            text: TextStream::new(Vec::new()),
            finish: None,
            flushed: false,
            max_tokens: opts.max_tokens,
            prompt_tokens: prompt_ids.len(),
            prefill_s: start.elapsed().as_secs_f64(),
            decode_start: Instant::now(),
            decode_s: 0.0,
        })
    }

    /// Takes the sampled token and, unless it ends generation, feeds it and samples the next. The
    /// text it completes (empty while a character is still partial), then what the stream held
    /// back once generation has ended, then `None`.
    pub fn step(&mut self, runner: &dyn Forward, tok: &Tokenizer, caches: &mut ModelCache) -> Result<Option<String>> {
        if self.finish.is_some() {
            if self.flushed {
                return Ok(None);
            }
            self.flushed = true;
            let rest = self.text.finish();
            return Ok((!rest.is_empty()).then_some(rest));
        }
        let model = runner.model();
        let next = self.next;
        self.tokens.push(next);
        let piece = self.text.push(tok, next)?;
        self.finish = if model.info.eos_tokens.contains(&next) {
            Some(Finish::Stop)
        } else if self.tokens.len() >= self.max_tokens {
            Some(Finish::Length)
        } else if caches.len(0) >= model.max_context() {
            Some(Finish::Context)
        } else {
            let logits = runner.forward(&[next], caches, Logits::Last)?.squeeze(0)?;
            self.next = self.sampler.sample(&logits)?;
            None
        };
        if self.finish.is_some() {
            self.decode_s = self.decode_start.elapsed().as_secs_f64();
        }
        Ok(Some(piece))
    }

    /// Why generation ended, once it has.
    pub fn finish(&self) -> Option<Finish> {
        self.finish
    }

    /// Tokens taken so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// What was generated, with its timings and the caches' size. Before the end, the tokens so
    /// far, as if `max_tokens` had been reached.
    pub fn output(&self, runner: &dyn Forward, tok: &Tokenizer, caches: &ModelCache) -> Result<GenerateOutput> {
        let decode_s = match self.finish {
            Some(_) => self.decode_s,
            None => self.decode_start.elapsed().as_secs_f64(),
        };
        Ok(GenerateOutput {
            prompt_tokens: self.prompt_tokens,
            text: decode(tok, &self.tokens)?,
            tokens: self.tokens.clone(),
            finish: self.finish.unwrap_or(Finish::Length),
            prefill_s: self.prefill_s,
            decode_s,
            kv_resident_bytes: caches.resident_bytes(),
            kv_fp16_bytes: fp16_bytes(runner.model(), caches.len(0)),
        })
    }
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
