//! The next-token rule, with the controls OpenAI-style and llama.cpp-style clients send. Applied
//! in vLLM's order: logit bias, then penalties (presence and frequency over the tokens generated
//! so far, repetition over the prompt and the completion), then greedy at temperature 0, else
//! temperature → top-k → top-p → min-p and a draw from the request's own seeded generator.

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::error::{Error, Result};

/// How the next token is chosen. [`Default`] is greedy with no penalties.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingOptions {
    /// 0 = greedy (the most likely token after bias and penalties).
    pub temperature: f64,
    /// Nucleus sampling: the smallest set of most likely tokens whose mass reaches `top_p`, in (0, 1].
    pub top_p: Option<f64>,
    /// Only the `top_k` most likely tokens (≥ 1).
    pub top_k: Option<usize>,
    /// Only tokens at least `min_p` times as likely as the most likely one, in [0, 1].
    pub min_p: Option<f64>,
    /// Subtracted once from the logit of every token the completion already holds, in [−2, 2].
    pub presence_penalty: f64,
    /// Subtracted from a token's logit once per time the completion holds it, in [−2, 2].
    pub frequency_penalty: f64,
    /// Divides positive and multiplies negative logits of tokens in the prompt or completion
    /// (1 = none), > 0.
    pub repetition_penalty: f64,
    /// Added to the logits of these tokens, each in [−100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: None,
            top_k: None,
            min_p: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: 299792458,
        }
    }
}

/// Which option is wrong and why (the server turns it into a 400 naming the field).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadOption {
    /// The option's name, as the OpenAI API spells it.
    pub field: &'static str,
    /// What is wrong.
    pub message: String,
}

impl SamplingOptions {
    /// Greedy, with these options' defaults otherwise.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Refuses values that would silently mean something else (a top-p of 7, a NaN temperature,
    /// a bias on a token the vocabulary does not have).
    pub fn check(&self, vocab: usize) -> std::result::Result<(), BadOption> {
        let bad = |field, message: String| Err(BadOption { field, message });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", format!("temperature must be a finite number ≥ 0, got {}", self.temperature));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad("top_p", format!("top_p must be in (0, 1], got {p}"));
        }
        if self.top_k == Some(0) {
            return bad("top_k", "top_k must be at least 1".into());
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad("min_p", format!("min_p must be in [0, 1], got {p}"));
        }
        for (field, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, format!("{field} must be in [-2, 2], got {v}"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {}", self.repetition_penalty),
            );
        }
        for &(t, b) in &self.logit_bias {
            if t as usize >= vocab {
                return bad("logit_bias", format!("token {t} is not in the vocabulary ({vocab} tokens)"));
            }
            if !(-100.0..=100.0).contains(&b) {
                return bad("logit_bias", format!("the bias of token {t} must be in [-100, 100], got {b}"));
            }
        }
        Ok(())
    }

    /// [`check`](Self::check) as a library error.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        self.check(vocab).map_err(|e| Error::Config(e.message))
    }

    /// Greedy with no bias or penalty: the argmax of the model's own logits.
    pub fn plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.logit_bias.is_empty() && !self.penalised()
    }

    fn penalised(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// One sequence's sampler: its options, the counts its penalties need, and its generator.
#[derive(Clone, Debug)]
pub struct Sampler {
    opts: SamplingOptions,
    /// Times each token was generated.
    generated: HashMap<u32, u32>,
    /// Tokens of the prompt (the repetition penalty's other half).
    prompt: Vec<u32>,
    rng: Xoshiro256PlusPlus,
    /// Scratch: (token, logit) candidates.
    order: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for a completion of `prompt` (read only by the repetition penalty).
    pub fn new(opts: SamplingOptions, prompt: &[u32]) -> Self {
        let prompt = if opts.repetition_penalty != 1.0 {
            let mut p = prompt.to_vec();
            p.sort_unstable();
            p.dedup();
            p
        } else {
            Vec::new()
        };
        let rng = Xoshiro256PlusPlus::seed_from_u64(opts.seed);
        Self { opts, generated: HashMap::new(), prompt, rng, order: Vec::new() }
    }

    /// The next token from a `[vocab]` logits tensor; the token counts as generated.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        let mut l = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Ok(self.next(&mut l))
    }

    /// The next token from `logits` (overwritten with the biased, penalised values); the token
    /// counts as generated.
    pub fn next(&mut self, logits: &mut [f32]) -> u32 {
        self.adjust(logits);
        let t = if self.opts.temperature <= 0.0 { argmax(logits) } else { self.draw(logits) };
        *self.generated.entry(t).or_insert(0) += 1;
        t
    }

    /// Bias and penalties, in place.
    pub(crate) fn adjust(&self, logits: &mut [f32]) {
        for &(t, b) in &self.opts.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if !self.opts.penalised() {
            return;
        }
        let r = self.opts.repetition_penalty as f32;
        let repeat = |l: &mut f32| *l = if *l > 0.0 { *l / r } else { *l * r };
        if r != 1.0 {
            for &t in &self.prompt {
                if let Some(l) = logits.get_mut(t as usize) {
                    repeat(l);
                }
            }
        }
        for (&t, &n) in &self.generated {
            let Some(l) = logits.get_mut(t as usize) else { continue };
            if r != 1.0 && self.prompt.binary_search(&t).is_err() {
                repeat(l);
            }
            *l -= (self.opts.presence_penalty + self.opts.frequency_penalty * n as f64) as f32;
        }
    }

    /// Temperature, then top-k, top-p and min-p over the candidates, then one draw.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let o = &self.opts;
        let inv_t = 1.0 / o.temperature as f32;
        self.order.clear();
        self.order
            .extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, l * inv_t)));
        if self.order.is_empty() {
            return argmax(logits);
        }
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if let Some(k) = o.top_k.filter(|&k| k < self.order.len()) {
            self.order.select_nth_unstable_by(k - 1, desc);
            self.order.truncate(k);
        }
        if o.top_p.is_some_and(|p| p < 1.0) || o.top_k.is_some() {
            self.order.sort_unstable_by(desc);
        }
        let max = self.order.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let mut w: Vec<f64> = self.order.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        if let Some(p) = o.top_p.filter(|&p| p < 1.0) {
            // Candidates are sorted: keep the shortest head whose mass reaches p.
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let keep = w.iter().position(|x| {
                acc += x;
                acc >= p * total
            });
            w.truncate(keep.map_or(w.len(), |i| i + 1));
        }
        if let Some(m) = o.min_p.filter(|&m| m > 0.0) {
            // The largest weight is exp(0) = 1.
            w.iter_mut().for_each(|x| {
                if *x < m {
                    *x = 0.0
                }
            });
        }
        let total: f64 = w.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (i, x) in w.iter().enumerate() {
            if u < *x {
                return self.order[i].0;
            }
            u -= x;
        }
        // Rounding left u at the very end: the last candidate with any weight.
        let last = w.iter().rposition(|&x| x > 0.0).unwrap_or(0);
        self.order[last].0
    }
}

/// A generated token's log-probability under the model (the log-softmax of its raw logits, before
/// bias, penalties and temperature, as OpenAI and vLLM report it) and the most likely tokens'.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The `n` most likely tokens and theirs, most likely first.
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// `token`'s entry from the raw `logits`, with the `top` most likely alternatives.
    pub fn of(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().filter(|l| l.is_finite()).fold(f32::NEG_INFINITY, f32::max);
        let lse = max as f64 + logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln();
        let lp = |l: f32| (l as f64 - lse) as f32;
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        if top > 0 && top < order.len() {
            order.select_nth_unstable_by(top - 1, desc);
        }
        order.truncate(top);
        order.sort_unstable_by(desc);
        Self {
            token,
            logprob: lp(logits[token as usize]),
            top: order.into_iter().map(|t| (t, lp(logits[t as usize]))).collect(),
        }
    }
}

/// The first index of the largest finite value (0 when there is none).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 {
            best = (i, l);
        }
    }
    best.0 as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fresh_seed;

    fn logits(seed: u64, n: usize) -> Vec<f32> {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        (0..n).map(|_| rng.random::<f32>() * 8.0 - 4.0).collect()
    }

    /// The reference: the distribution the options define, computed directly in f64 over the
    /// whole vocabulary (sort, cut, normalise).
    fn reference(l: &[f32], o: &SamplingOptions) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..l.len()).collect();
        idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let t = o.temperature;
        let mut w: Vec<f64> = idx.iter().map(|&i| ((l[i] as f64 - l[idx[0]] as f64) / t).exp()).collect();
        if let Some(k) = o.top_k {
            w.iter_mut().skip(k).for_each(|x| *x = 0.0);
        }
        if let Some(p) = o.top_p {
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let mut done = false;
            for x in w.iter_mut() {
                if done {
                    *x = 0.0;
                }
                acc += *x;
                done |= acc >= p * total;
            }
        }
        if let Some(m) = o.min_p {
            w.iter_mut().for_each(|x| *x = if *x < m { 0.0 } else { *x });
        }
        let total: f64 = w.iter().sum();
        let mut p = vec![0.0; l.len()];
        idx.iter().zip(&w).for_each(|(&i, &x)| p[i] = x / total);
        p
    }

    /// Draws follow the reference distribution: every draw has positive reference mass, and the
    /// empirical frequencies of 20,000 draws are within 5 standard errors of it (plus 0.002).
    #[test]
    fn draws_follow_the_distribution_the_options_define() {
        let seed = fresh_seed();
        let l = logits(seed, 50);
        let cases = [
            SamplingOptions { temperature: 1.0, ..Default::default() },
            SamplingOptions { temperature: 0.7, top_k: Some(5), ..Default::default() },
            SamplingOptions { temperature: 1.3, top_p: Some(0.6), ..Default::default() },
            SamplingOptions { temperature: 1.0, min_p: Some(0.2), ..Default::default() },
            SamplingOptions {
                temperature: 0.9,
                top_k: Some(20),
                top_p: Some(0.8),
                min_p: Some(0.05),
                ..Default::default()
            },
        ];
        let n = 20_000;
        for (c, o) in cases.into_iter().enumerate() {
            let want = reference(&l, &o);
            let mut s = Sampler::new(SamplingOptions { seed: seed ^ c as u64, ..o.clone() }, &[]);
            let mut count = vec![0usize; l.len()];
            for _ in 0..n {
                // A fresh sampler state each draw: no penalties, so only the generator advances.
                s.generated.clear();
                count[s.next(&mut l.clone()) as usize] += 1;
            }
            for (i, (&k, &p)) in count.iter().zip(&want).enumerate() {
                let f = k as f64 / n as f64;
                assert!(k == 0 || p > 0.0, "seed {seed} case {c}: token {i} drawn outside the allowed set");
                let se = (p * (1.0 - p) / n as f64).sqrt();
                assert!((f - p).abs() <= 5.0 * se + 0.002, "seed {seed} case {c}: token {i} {f} vs {p}");
            }
        }
    }

    /// Greedy takes the argmax after bias and penalties, exactly as written out by hand.
    #[test]
    fn bias_and_penalties_move_the_greedy_choice() {
        let seed = fresh_seed();
        let l = logits(seed, 40);
        let top = argmax(&l);
        let mut s = Sampler::new(SamplingOptions::greedy(), &[]);
        assert_eq!(s.next(&mut l.clone()), top);
        // A bias of -100 removes the top token; +100 on another makes it the choice.
        let other = (top + 7) % 40;
        let mut s = Sampler::new(SamplingOptions { logit_bias: vec![(top, -100.0)], ..Default::default() }, &[]);
        assert_ne!(s.next(&mut l.clone()), top);
        let mut s = Sampler::new(SamplingOptions { logit_bias: vec![(other, 100.0)], ..Default::default() }, &[]);
        assert_eq!(s.next(&mut l.clone()), other);
        // Presence and frequency: after generating `top` twice its logit drops by p + 2f.
        let o = SamplingOptions { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut s = Sampler::new(o, &[]);
        s.generated.insert(top, 2);
        let mut got = l.clone();
        s.adjust(&mut got);
        assert_eq!(got[top as usize], l[top as usize] - 1.0);
        assert!(got.iter().zip(&l).enumerate().all(|(i, (a, b))| i == top as usize || a == b));
        // Repetition: prompt and generated tokens, positive logits divided, negative multiplied.
        let (neg, pos) = ((0..40u32).find(|&i| l[i as usize] < 0.0).unwrap(), top);
        let mut s = Sampler::new(SamplingOptions { repetition_penalty: 2.0, ..Default::default() }, &[neg, neg]);
        s.generated.insert(pos, 1);
        let mut got = l.clone();
        s.adjust(&mut got);
        assert_eq!((got[neg as usize], got[pos as usize]), (l[neg as usize] * 2.0, l[pos as usize] / 2.0));
        assert_eq!(got.iter().zip(&l).filter(|(a, b)| a != b).count(), 2);
    }

    /// Log-probabilities against a direct f64 log-softmax; the alternatives are the top ones.
    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let seed = fresh_seed();
        let l = logits(seed, 300);
        let lse = l.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        let t = (seed % 300) as u32;
        let e = TokenLogprob::of(&l, t, 5);
        assert!((e.logprob as f64 - (l[t as usize] as f64 - lse)).abs() < 1e-5, "{e:?}");
        let mut sorted: Vec<u32> = (0..300).collect();
        sorted.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));
        assert_eq!(e.top.iter().map(|x| x.0).collect::<Vec<_>>(), sorted[..5]);
        assert!(e.top.iter().all(|&(t, lp)| (lp as f64 - (l[t as usize] as f64 - lse)).abs() < 1e-5));
        assert!(TokenLogprob::of(&l, t, 0).top.is_empty());
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let seed = fresh_seed();
        let l = logits(seed, 64);
        let o =
            SamplingOptions { temperature: 1.0, top_p: Some(0.95), frequency_penalty: 0.3, seed, ..Default::default() };
        let run = || {
            let mut s = Sampler::new(o.clone(), &[1, 2, 3]);
            (0..50).map(|_| s.next(&mut l.clone())).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "{a:?}");
    }

    #[test]
    fn bad_options_name_their_field() {
        let ok = SamplingOptions::default();
        assert!(ok.check(10).is_ok());
        let cases = [
            (SamplingOptions { temperature: f64::NAN, ..ok.clone() }, "temperature"),
            (SamplingOptions { top_p: Some(0.0), ..ok.clone() }, "top_p"),
            (SamplingOptions { top_k: Some(0), ..ok.clone() }, "top_k"),
            (SamplingOptions { min_p: Some(1.5), ..ok.clone() }, "min_p"),
            (SamplingOptions { presence_penalty: 3.0, ..ok.clone() }, "presence_penalty"),
            (SamplingOptions { frequency_penalty: -2.5, ..ok.clone() }, "frequency_penalty"),
            (SamplingOptions { repetition_penalty: 0.0, ..ok.clone() }, "repetition_penalty"),
            (SamplingOptions { logit_bias: vec![(10, 1.0)], ..ok.clone() }, "logit_bias"),
            (SamplingOptions { logit_bias: vec![(3, 101.0)], ..ok.clone() }, "logit_bias"),
        ];
        for (o, field) in cases {
            assert_eq!(o.check(10).unwrap_err().field, field, "{o:?}");
        }
    }
}
