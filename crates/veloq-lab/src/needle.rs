//! Needle-in-a-haystack (passkey) retrieval: a five-digit key hidden at a chosen depth of a long
//! context and asked for at its end, answered by greedy decoding. Perplexity on short windows
//! hides what a compressed cache does to a copy head's sharp attention on one far position; this
//! measures it. Prompt building and scoring are model-free (and tested as such); [`answer`] runs
//! a batch of cases through one cache.

use veloq_candle::cache::{SeqStep, Step};
use veloq_candle::error::{Error, Result};
use veloq_candle::generate::with_bos;
use veloq_candle::model::{decode, encode, ChatTemplate, Logits, Model, Tokenizer};

use crate::source::CacheSource;

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
    with_bos(model, &mut prefix);
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

/// Greedy continuations (`max_tokens` each, cut at an end-of-sequence token) of several prompts
/// through one cache of `cfg` with a slot per prompt. They are prefilled together, `chunk` tokens
/// of each per forward pass (a ragged step once the shorter ones are done), and decoded together:
/// a GPU runs the whole grid cell as one batch instead of one small model call after another.
pub fn answers(
    model: &Model,
    tok: &Tokenizer,
    cfg: &dyn CacheSource,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    chunk: usize,
) -> Result<Vec<String>> {
    answer_ids(model, cfg, prompts, max_tokens, chunk)?.iter().map(|o| decode(tok, o)).collect()
}

/// [`answers`] as token ids, without the end-of-sequence token.
pub fn answer_ids(
    model: &Model,
    cfg: &dyn CacheSource,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    chunk: usize,
) -> Result<Vec<Vec<u32>>> {
    if prompts.iter().any(|p| p.is_empty()) || max_tokens == 0 || chunk == 0 {
        return Err(Error::Config("answers need non-empty prompts, a token to generate and a chunk".into()));
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let mut caches = cfg.build(model, prompts.len(), Some(longest + max_tokens))?;
    let argmax = |logits: &candle_core::Tensor| -> Result<Vec<u32>> {
        Ok(logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?)
    };
    // Prefill: each step takes the next `chunk` of every prompt not yet done.
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut fed = vec![0usize; prompts.len()];
    loop {
        let seqs: Vec<SeqStep> = (0..prompts.len())
            .filter(|&i| fed[i] < prompts[i].len())
            .map(|i| SeqStep { slot: i, start: fed[i], len: chunk.min(prompts[i].len() - fed[i]) })
            .collect();
        if seqs.is_empty() {
            break;
        }
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| &prompts[s.slot][s.start..s.start + s.len]).copied().collect();
        let next = argmax(&model.forward_step(&tokens, &Step::new(seqs.clone())?, &mut caches, Logits::Last)?)?;
        for (s, t) in seqs.iter().zip(next) {
            fed[s.slot] += s.len;
            if fed[s.slot] == prompts[s.slot].len() {
                out[s.slot].push(t);
            }
        }
    }
    // Decode: every sequence that has not ended takes its last token.
    let ended = |o: &Vec<u32>| o.len() >= max_tokens || o.last().is_some_and(|t| model.info.eos_tokens.contains(t));
    loop {
        let live: Vec<usize> = (0..prompts.len()).filter(|&i| !ended(&out[i])).collect();
        if live.is_empty() {
            break;
        }
        let seqs: Vec<SeqStep> = live.iter().map(|&i| SeqStep { slot: i, start: caches.len(i), len: 1 }).collect();
        let tokens: Vec<u32> = live.iter().map(|&i| *out[i].last().expect("prefilled")).collect();
        let next = argmax(&model.forward_step(&tokens, &Step::new(seqs)?, &mut caches, Logits::Last)?)?;
        live.iter().zip(next).for_each(|(&i, t)| out[i].push(t));
    }
    for o in &mut out {
        if let Some(end) = o.iter().position(|t| model.info.eos_tokens.contains(t)) {
            o.truncate(end);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use veloq_candle::config::CacheConfig;

    /// A batch of prompts of different lengths, prefilled in ragged chunks and decoded together,
    /// gives each prompt's own greedy tokens (compared while the single run's top two logits are
    /// apart by more than the batch's rounding could move them).
    #[test]
    fn a_batch_answers_as_each_prompt_alone() {
        let model = crate::testing::tiny_model(97, 64);
        let seed = crate::testing::fresh_seed();
        let mut rng = seed;
        let prompts: Vec<Vec<u32>> = [9usize, 23, 17]
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| {
                        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (rng >> 33) as u32 % 97
                    })
                    .collect()
            })
            .collect();
        let cfg = CacheConfig::fp16();
        let batch = answer_ids(&model, &cfg, &prompts, 6, 5).unwrap();
        let mut compared = 0;
        for (p, got) in prompts.iter().zip(&batch) {
            assert_eq!(got.len(), 6, "no eos in a synthetic model: every answer runs to max_tokens");
            let mut caches = cfg.build(&model).unwrap();
            let mut logits = model.forward(p, &mut caches, Logits::Last).unwrap();
            for &t in got {
                let row = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
                if row[order[0]] - row[order[1]] < 1e-4 {
                    break;
                }
                assert_eq!(t, order[0] as u32, "prompt of {} tokens, seed {seed}", p.len());
                compared += 1;
                logits = model.forward(&[t], &mut caches, Logits::Last).unwrap();
            }
        }
        assert!(compared >= 9, "only {compared} tokens compared, seed {seed}");
    }

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
