//! Constrained decoding: a completion that must spell a grammar (a JSON object, a JSON schema)
//! gets a token mask at every step from [`llguidance`], so its output always parses — how
//! vLLM, SGLang and mistral.rs serve OpenAI's `response_format`.
//!
//! [`Grammars`] holds what every constrained request of one tokenizer shares (the vocabulary's
//! byte trie and llguidance's parser factory, built on first use); [`Grammars::compile`] turns a
//! [`Grammar`] into a [`Constraint`], one request's parser state.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::{DecoderWrapper, Tokenizer};

use crate::error::{Error, Result};

/// What a constrained completion must spell.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A JSON value valid under this schema (OpenAI's `json_schema`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect, which may inline JSON schemas (`%json {…}`): a
    /// forced tool call's markup around its arguments.
    Lark(String),
}

impl Grammar {
    /// The schema llguidance compiles: compact JSON (no free whitespace between tokens, which a
    /// small model can otherwise emit until `max_tokens` runs out).
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// `schema` asking for compact JSON (no free whitespace between tokens, which a small model can
/// otherwise emit until `max_tokens` runs out), unless it says otherwise.
pub fn compact(mut schema: Value) -> Value {
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// The vocabulary as llguidance reads it: each token's bytes in a trie, and the tokenizer.
struct Vocabulary {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        let text = String::from_utf8_lossy(s);
        self.tok.encode(text.as_ref(), false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
}

/// What every constrained request over one tokenizer shares.
pub struct Grammars {
    tok: Arc<Tokenizer>,
    /// End-of-sequence tokens: allowed exactly where the grammar may end.
    eos: Vec<u32>,
    /// Logits per step (the model's vocabulary, which may pad the tokenizer's).
    vocab: usize,
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
}

impl Grammars {
    /// For a model whose end-of-sequence tokens are `eos` and whose logits have `vocab` entries.
    pub fn new(tok: Arc<Tokenizer>, eos: Vec<u32>, vocab: usize) -> Self {
        Self { tok, eos, vocab, factory: OnceLock::new() }
    }

    fn factory(&self) -> Result<&ParserFactory> {
        self.factory
            .get_or_init(|| {
                let words = token_bytes(&self.tok);
                let eos = *self.eos.first().ok_or_else(|| "the model names no end-of-sequence token".to_string())?;
                let info = TokRxInfo::new(words.len() as u32, eos);
                let trie = TokTrie::from(&info, &words);
                let env: llguidance::toktrie::TokEnv = Arc::new(Vocabulary { trie, tok: self.tok.clone() });
                let mut f = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                f.quiet();
                Ok(f)
            })
            .as_ref()
            .map_err(|e| Error::Config(format!("constrained decoding is unavailable: {e}")))
    }

    /// A request's parser for `g`; an error that says what is wrong with a schema it cannot
    /// compile.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint> {
        let parser = self
            .factory()?
            .create_parser(g.top_level())
            .map_err(|e| Error::Config(format!("the schema cannot be compiled: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Config(format!("the schema cannot be compiled: {e}")));
        }
        Ok(Constraint { matcher, eos: self.eos.clone(), vocab: self.vocab })
    }
}

/// One request's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    eos: Vec<u32>,
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("finished", &self.finished()).finish()
    }
}

impl Constraint {
    /// Sets every logit the grammar does not allow next to −∞ (end-of-sequence tokens only where
    /// the grammar may end).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = self.matcher.compute_mask().map_err(|e| Error::Config(format!("grammar: {e}")))?;
        let may_end = self.eos.first().is_some_and(|&e| allowed.is_allowed(e));
        for (t, l) in logits.iter_mut().enumerate().take(self.vocab) {
            let ok = if self.eos.contains(&(t as u32)) {
                may_end
            } else {
                t < allowed.len() && allowed.is_allowed(t as u32)
            };
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past a generated token (not an end-of-sequence one).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| Error::Config(format!("grammar: {e}")))
    }

    /// Whether the grammar is complete and nothing may follow (the completion ends here).
    pub fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Each token's bytes as llguidance spells them: control tokens as `0xFF` then their text (so
/// the grammar never produces them), byte-level BPE pieces (gpt2, Llama 3, SmolLM2) through the
/// inverse of its byte-to-character table, SentencePiece pieces with `▁` as a space and `<0xNN>`
/// as the byte NN.
pub fn token_bytes(tok: &Tokenizer) -> Vec<Vec<u8>> {
    let n = tok.get_vocab_size(true);
    let specials: std::collections::HashSet<u32> =
        tok.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
    let byte_level = matches!(tok.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
    let unmap = byte_level.then(byte_level_chars);
    (0..n as u32)
        .map(|id| {
            let Some(piece) = tok.id_to_token(id) else { return Vec::new() };
            if specials.contains(&id) {
                return [&[TokTrie::SPECIAL_TOKEN_MARKER], piece.as_bytes()].concat();
            }
            if let Some(unmap) = &unmap {
                return piece.chars().filter_map(|c| unmap.get(&c).copied()).collect();
            }
            match piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')) {
                Some(hex) if hex.len() == 2 => u8::from_str_radix(hex, 16).map(|b| vec![b]).unwrap_or_default(),
                _ => piece.replace('▁', " ").into_bytes(),
            }
        })
        .collect()
}

/// Byte-level BPE's character for each byte, inverted: printable Latin-1 bytes stand for
/// themselves, the other 68 are shifted to the characters from U+0100 on, in byte order.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                shifted += 1;
                (char::from_u32(255 + shifted).expect("a Latin Extended character"), b)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_with_gpt2s_space_and_newline() {
        let t = byte_level_chars();
        assert_eq!(t.len(), 256);
        let bytes: std::collections::HashSet<u8> = t.values().copied().collect();
        assert_eq!(bytes.len(), 256);
        // The two characters every byte-level vocabulary is full of.
        assert_eq!((t[&'Ġ'], t[&'Ċ'], t[&'a']), (b' ', b'\n', b'a'));
    }

    #[test]
    fn a_schema_gets_compact_json_unless_it_says_otherwise() {
        let s = compact(json!({"type": "object", "x-guidance": {"whitespace_flexible": true}}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], true);
        assert_eq!(compact(json!({"type": "object"}))["x-guidance"]["whitespace_flexible"], false);
    }
}
