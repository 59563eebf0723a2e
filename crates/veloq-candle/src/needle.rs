//! Needle-in-a-haystack (passkey) retrieval: a five-digit key hidden at a chosen depth of a long
//! context and asked for at its end, answered by greedy decoding. Perplexity on short windows
//! hides what a compressed cache does to a copy head's sharp attention on one far position; this
//! measures it. Prompt building and scoring are model-free (and tested as such); [`answer`] runs
//! one case through a fresh cache.

use crate::config::CacheConfig;
use crate::error::{Error, Result};
use crate::generate::{generate_ids, GenerateOptions};
use crate::model::{encode, ChatTemplate, Model, Tokenizer};

/// The repeated filler haystack of the passkey papers.
pub const FILLER: &str = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";

/// The sentence that carries the key (said twice, as in the passkey task).
pub fn needle(key: u32) -> String {
    format!(" The pass key is {key}. Remember it. {key} is the pass key. ")
}

/// What follows the haystack without a chat template: the question, and the start of the answer
/// the model completes.
pub const QUESTION: &str = "\n\nWhat is the pass key? The pass key is";

/// The question inside a chat turn (instruct models answer it; they do not complete a sentence).
pub const CHAT_QUESTION: &str = "\n\nWhat is the pass key in the text above? Answer with the number only.";

/// The tokens around the haystack: `(prefix, suffix)`. Raw: BOS (if the model takes one) and
/// [`QUESTION`]; chat: the template's opening (BOS included) and [`CHAT_QUESTION`] with the
/// template's close, so the answer is the assistant's reply.
pub fn frame(model: &Model, tok: &Tokenizer, chat: bool) -> Result<(Vec<u32>, Vec<u32>)> {
    const HOLE: &str = "\u{1}";
    let template = if chat { ChatTemplate::detect(tok) } else { ChatTemplate::Raw };
    let question = if matches!(template, ChatTemplate::Raw) { QUESTION } else { CHAT_QUESTION };
    let text = template.apply(&format!("{HOLE}{question}"));
    let (before, after) = text.split_once(HOLE).expect("the template keeps the prompt");
    let mut prefix = encode(tok, before)?;
    if let Some(bos) = model.info.bos {
        if prefix.first() != Some(&bos) {
            prefix.insert(0, bos);
        }
    }
    Ok((prefix, encode(tok, after)?))
}

/// Tokens of one case, `length` in all: `prefix`, the haystack's first tokens with the needle's
/// inserted after a fraction `depth` (0 = first, 1 = last) of them, then `suffix` (the question).
/// Errors when the haystack is too short or `length` leaves no room for it.
pub fn prompt(
    prefix: &[u32],
    haystack: &[u32],
    needle: &[u32],
    question: &[u32],
    length: usize,
    depth: f64,
) -> Result<Vec<u32>> {
    let fixed = prefix.len() + needle.len() + question.len();
    if !(0.0..=1.0).contains(&depth) {
        return Err(Error::Config(format!("needle depth {depth} is outside 0..=1")));
    }
    let room = length
        .checked_sub(fixed)
        .filter(|&r| r > 0)
        .ok_or_else(|| Error::Config(format!("{length} tokens leave no room for a haystack next to {fixed}")))?;
    if haystack.len() < room {
        return Err(Error::Config(format!("the haystack has {} tokens, {room} are needed", haystack.len())));
    }
    let at = (depth * room as f64).round() as usize;
    let mut ids = Vec::with_capacity(length);
    ids.extend_from_slice(prefix);
    ids.extend_from_slice(&haystack[..at]);
    ids.extend_from_slice(needle);
    ids.extend_from_slice(&haystack[at..room]);
    ids.extend_from_slice(question);
    Ok(ids)
}

/// `FILLER` repeated to at least `tokens` tokens.
pub fn filler(tok: &Tokenizer, tokens: usize) -> Result<Vec<u32>> {
    let one = encode(tok, FILLER)?;
    if one.is_empty() {
        return Err(Error::Tokenizer("the filler encodes to no tokens".into()));
    }
    Ok(one.iter().copied().cycle().take(tokens).collect())
}

/// Whether `answer` gives `key`: its first run of digits, exactly (a dropped, changed or extra
/// digit is a miss, as are digits split by punctuation).
pub fn correct(answer: &str, key: u32) -> bool {
    let digits: String =
        answer.chars().skip_while(|c| !c.is_ascii_digit()).take_while(|c| c.is_ascii_digit()).collect();
    digits == key.to_string()
}

/// The 95% Wilson score interval of `k` successes in `n` trials (`(0, 1)` when `n` is 0).
pub fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, n, p) = (1.96f64, n as f64, k as f64 / n as f64);
    let centre = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / (1.0 + z * z / n);
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// Five-digit keys from `seed` (the same for every method, so methods answer the same prompts).
pub fn keys(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            10_000 + (s % 90_000) as u32
        })
        .collect()
}

/// Greedy continuation (`max_tokens`) of `ids` through a fresh cache of `cfg`.
pub fn answer(model: &Model, tok: &Tokenizer, cfg: &CacheConfig, ids: &[u32], max_tokens: usize) -> Result<String> {
    let mut caches = cfg.build(model)?;
    let opts = GenerateOptions { max_tokens, temperature: 0.0, ..GenerateOptions::default() };
    Ok(generate_ids(model, tok, &mut caches, ids, &opts, &mut |_| {})?.text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exact_key_counts_and_a_near_miss_does_not() {
        assert!(correct(" 61750.", 61750));
        assert!(correct("61750", 61750));
        assert!(correct(" is 61750, remember", 61750));
        // The misses seen with 2-bit keys: a digit dropped, changed, or added.
        assert!(!correct(" 6175.", 61750));
        assert!(!correct(" 29772.", 29972));
        assert!(!correct(" 617500", 61750));
        assert!(!correct(" 61,750", 61750));
        assert!(!correct(" unknown", 61750));
        assert!(!correct("", 61750));
    }

    #[test]
    fn the_needle_sits_at_its_depth_and_the_prompt_has_its_length() {
        let hay: Vec<u32> = (100..1100).collect();
        let (needle, question) = (vec![1, 2, 3], vec![7, 8]);
        for (depth, at) in [(0.0, 0usize), (0.5, 48), (1.0, 95)] {
            let ids = prompt(&[9], &hay, &needle, &question, 101, depth).unwrap();
            assert_eq!(ids.len(), 101);
            assert_eq!(ids[0], 9);
            assert_eq!(&ids[1 + at..1 + at + 3], &needle[..], "depth {depth}");
            assert_eq!(&ids[99..], &question[..]);
            // The haystack around the needle is its first tokens, in order.
            let rest: Vec<u32> = ids[1..99].iter().copied().filter(|&t| t >= 100).collect();
            assert_eq!(rest, (100..195).collect::<Vec<u32>>());
        }
        assert!(prompt(&[], &hay, &needle, &question, 5, 0.5).is_err(), "no room");
        assert!(prompt(&[], &hay[..10], &needle, &question, 101, 0.5).is_err(), "short haystack");
        assert!(prompt(&[], &hay, &needle, &question, 101, 1.5).is_err(), "depth past the end");
    }

    #[test]
    fn wilson_intervals_cover_the_rate() {
        let (lo, hi) = wilson(13, 36);
        assert!(lo < 13.0 / 36.0 && 13.0 / 36.0 < hi && lo > 0.2 && hi < 0.55, "{lo} {hi}");
        assert_eq!(wilson(0, 0), (0.0, 1.0));
        let (lo, hi) = wilson(10, 10);
        assert!(lo > 0.65 && hi == 1.0, "{lo} {hi}");
    }

    #[test]
    fn keys_have_five_digits_and_repeat_per_seed() {
        let k = keys(3, 50);
        assert!(k.iter().all(|&x| (10_000..100_000).contains(&x)));
        assert_eq!(k, keys(3, 50));
        assert_ne!(k, keys(4, 50));
    }
}
