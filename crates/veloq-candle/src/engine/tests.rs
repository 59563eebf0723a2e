//! The engine on a tiny random model: batched requests answer as each would alone, admission keeps
//! to the budget, abandoned requests free their memory, bad requests are refused up front.

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::cache::SeqStep;
use crate::engine::Reserve;
use crate::sampling::{SamplingOptions, TokenLogprob};
use crate::testing::{fresh_seed, tiny_model_seeded, word_tokenizer};

const VOCAB: usize = 97;
const CONTEXT: usize = 256;

/// A sink that forwards events to a channel, and stops listening after `listen` texts.
struct TestSink {
    tx: mpsc::Sender<Event>,
    /// Holds the engine inside its admission of this request until a message arrives.
    gate: Option<mpsc::Receiver<()>>,
    texts: usize,
    listen: usize,
    gone: Arc<Mutex<bool>>,
    /// The engine's polls (one a step) answered alive once admitted, before the client leaves.
    polls: Option<AtomicUsize>,
    admitted: bool,
}

impl Sink for TestSink {
    fn send(&mut self, e: Event) -> bool {
        if let (Event::Admitted, Some(gate)) = (&e, self.gate.take()) {
            let _ = gate.recv_timeout(Duration::from_secs(60));
        }
        self.admitted |= matches!(e, Event::Admitted);
        if matches!(e, Event::Text(_)) {
            self.texts += 1;
            if self.texts > self.listen {
                *self.gone.lock().unwrap() = true;
                return false;
            }
        }
        let _ = self.tx.send(e);
        true
    }
    fn alive(&self) -> bool {
        if let (true, Some(polls)) = (self.admitted, &self.polls) {
            let left = polls.load(Ordering::Relaxed);
            if left == 0 {
                return false;
            }
            polls.store(left - 1, Ordering::Relaxed);
        }
        !*self.gone.lock().unwrap()
    }
}

fn test_sink(listen: usize) -> (TestSink, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    let gone = Arc::new(Mutex::new(false));
    (TestSink { tx, gate: None, texts: 0, listen, gone, polls: None, admitted: false }, rx)
}

fn sink(listen: usize) -> (Box<dyn Sink>, mpsc::Receiver<Event>) {
    let (s, rx) = test_sink(listen);
    (Box::new(s), rx)
}

/// A sink that holds the engine inside this request's admission until the returned sender sends
/// (so that requests submitted meanwhile find it running with nothing fed yet).
fn gated_sink() -> (Box<dyn Sink>, mpsc::Receiver<Event>, mpsc::Sender<()>) {
    let (open, gate) = mpsc::channel();
    let (s, rx) = test_sink(usize::MAX);
    (Box::new(TestSink { gate: Some(gate), ..s }), rx, open)
}

/// Events until the end of a request.
fn events(rx: &mpsc::Receiver<Event>) -> Vec<Event> {
    let mut out = Vec::new();
    while let Ok(e) = rx.recv_timeout(Duration::from_secs(60)) {
        let end = matches!(e, Event::Done(_) | Event::Failed(_));
        out.push(e);
        if end {
            break;
        }
    }
    out
}

/// A xorshift generator: the tests' random prompts and loads, reproducible from a seed.
struct Xorshift(u64);

impl Xorshift {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// The next number below `n`.
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    /// `n` random tokens.
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(VOCAB) as u32).collect()
    }
}

fn prompts(seed: u64, lens: &[usize]) -> Vec<Vec<u32>> {
    let mut rng = Xorshift::new(seed);
    lens.iter().map(|&n| rng.tokens(n)).collect()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        max_tokens,
        open_ended: false,
        sampling: SamplingOptions::greedy(),
        logprobs: None,
        prompt_logprobs: None,
        stop: Vec::new(),
        ignore_eos: false,
        grammar: None,
        time_limit: None,
    }
}

fn sampled(prompt: Vec<u32>, max_tokens: usize, sampling: SamplingOptions) -> Request {
    Request { sampling, ..greedy(prompt, max_tokens) }
}

fn nucleus(seed: u64) -> SamplingOptions {
    SamplingOptions { temperature: 0.9, top_p: Some(0.95), seed, ..Default::default() }
}

/// Greedy tokens of `prompt` alone, by plain forward passes (the reference), with the top-two
/// logit margin at each step.
fn alone(model: &Model, prompt: &[u32], n: usize) -> Vec<(u32, f32)> {
    alone_with(model, prompt, n, &SamplingOptions::greedy())
}

/// [`alone`] with a greedy request's bias and penalties (margins of the adjusted logits).
fn alone_with(model: &Model, prompt: &[u32], n: usize, opts: &SamplingOptions) -> Vec<(u32, f32)> {
    alone_on(model, &CacheConfig::fp16(), prompt, n, opts)
}

/// [`alone_with`] over caches of `cache`.
fn alone_on(model: &Model, cache: &CacheConfig, prompt: &[u32], n: usize, opts: &SamplingOptions) -> Vec<(u32, f32)> {
    let mut caches = cache.build(model).unwrap();
    let mut logits = model.forward(prompt, &mut caches, crate::model::Logits::Last).unwrap();
    let mut sampler = Sampler::new(opts.clone(), prompt);
    let mut out = Vec::new();
    for _ in 0..n {
        let mut row = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        let mut adjusted = row.clone();
        sampler.adjust(&mut adjusted);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| adjusted[b].total_cmp(&adjusted[a]));
        let t = sampler.next(&mut row);
        assert_eq!(t, order[0] as u32);
        out.push((t, adjusted[order[0]] - adjusted[order[1]]));
        let step = Step::new(vec![SeqStep { slot: 0, start: caches.len(0), len: 1 }]).unwrap();
        logits = model.forward_step(&[t], &step, &mut caches, Logits::Last).unwrap();
    }
    out
}

/// An engine with the default settings and fp16 caches over a tiny model of `seed`.
fn fp16_engine(seed: u64) -> Engine {
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    Engine::start(model, Arc::new(word_tokenizer(VOCAB)), CacheConfig::fp16(), EngineConfig::default()).unwrap()
}

fn text_of(events: &[Event]) -> String {
    events.iter().filter_map(|e| if let Event::Text(t) = e { Some(t.as_str()) } else { None }).collect()
}

/// Batched requests answer as each would alone, token for token while the reference's choice is
/// clear. A random model sometimes ties early (a margin under 1e-3 ends a prompt's comparison), so
/// fresh models are drawn until 30 tokens have been compared — every one of them asserted.
#[test]
fn requests_in_one_batch_answer_as_each_alone() {
    let (mut compared, mut seeds) = (0, Vec::new());
    while compared < 30 && seeds.len() < 5 {
        let seed = fresh_seed();
        seeds.push(seed);
        compared += batch_answers_as_alone(seed);
    }
    assert!(compared >= 30, "seeds {seeds:?}: only {compared} tokens had clear margins");
}

/// One model of `seed`: five requests in one engine against each alone; the tokens compared.
fn batch_answers_as_alone(seed: u64) -> usize {
    let tok = Arc::new(word_tokenizer(VOCAB));
    let cfg = EngineConfig { step_tokens: 24, ..EngineConfig::default() };
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    let engine = Engine::start(model.clone(), tok.clone(), CacheConfig::fp16(), cfg).unwrap();
    // Prompts longer than a step's tokens are prefilled in chunks beside the others' decoding.
    let ps = prompts(seed, &[9, 40, 17, 70, 3]);
    let rxs: Vec<_> = ps
        .iter()
        .map(|p| {
            let (s, rx) = sink(usize::MAX);
            engine.submit(greedy(p.clone(), 12), s).unwrap();
            rx
        })
        .collect();
    let mut compared = 0;
    for (p, rx) in ps.iter().zip(&rxs) {
        let ev = events(rx);
        assert_eq!(ev.first(), Some(&Event::Admitted), "seed {seed}");
        let Some(Event::Done(sum)) = ev.last() else { panic!("seed {seed}: {ev:?}") };
        assert_eq!((sum.prompt_tokens, sum.completion_tokens, sum.finish), (p.len(), 12, Finish::Length));
        let what = format!("seed {seed}: prompt of {}", p.len());
        compared += agree_while_clear(&tokens_of(&ev), &alone(&model, p, 12), 1e-3, &what);
    }
    let s = engine.stats();
    assert_eq!((s.running, s.queued, s.finished, s.kv_reserved_bytes), (0, 0, 5, 0));
    // Finished sequences stay resident for their prefixes: what the caches hold is theirs.
    assert_eq!((s.resident_prefixes, s.kv_sequence_bytes), (5, s.kv_prefix_bytes), "{s:?}");
    assert!(s.peak_running >= 2, "the requests ran together: {s:?}");
    assert_eq!(s.generated_tokens, 60);
    assert_eq!(s.prompt_tokens, ps.iter().map(Vec::len).sum::<usize>() as u64);
    compared
}

#[test]
fn admission_keeps_to_the_budget_and_frees_what_finishes() {
    let seed = fresh_seed();
    let tok = Arc::new(word_tokenizer(VOCAB));
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    // Room for the shared tables and two sequences of 100 positions, not three.
    let probe = CacheConfig::fp16().build(&model).unwrap();
    let one = probe.sequence_bytes(100);
    let cfg = EngineConfig { kv_budget: probe.resident_bytes() + 2 * one + one / 2, ..EngineConfig::default() };
    let engine = Engine::start(model, tok, CacheConfig::fp16(), cfg).unwrap();
    assert_eq!(engine.info().sequence_bytes(100), one);
    let rxs: Vec<_> = prompts(seed, &[60, 60, 60, 60, 60])
        .into_iter()
        .map(|p| {
            let (s, rx) = sink(usize::MAX);
            engine.submit(greedy(p, 40), s).unwrap();
            rx
        })
        .collect();
    for rx in &rxs {
        assert!(matches!(events(rx).last(), Some(Event::Done(_))));
    }
    let s = engine.stats();
    assert_eq!(s.peak_running, 2, "{s:?}");
    assert_eq!((s.finished, s.kv_reserved_bytes), (5, 0), "{s:?}");
    // Resident sequences gave way to the later requests: never more than the budget's two.
    assert_eq!((s.resident_prefixes, s.kv_sequence_bytes), (2, s.kv_prefix_bytes), "{s:?}");
}

#[test]
fn a_client_that_leaves_frees_its_sequence() {
    let seed = fresh_seed();
    let engine = fp16_engine(seed);
    let ps = prompts(seed, &[20, 30]);
    let (leaver, rx_leaver) = sink(3);
    engine.submit(greedy(ps[0].clone(), 200), leaver).unwrap();
    let (stayer, rx_stayer) = sink(usize::MAX);
    engine.submit(greedy(ps[1].clone(), 50), stayer).unwrap();
    let ev = events(&rx_stayer);
    assert!(matches!(ev.last(), Some(Event::Done(s)) if s.completion_tokens == 50), "{ev:?}");
    let left: Vec<Event> = rx_leaver.try_iter().collect();
    assert_eq!(left.iter().filter(|e| matches!(e, Event::Text(_))).count(), 3);
    assert!(!left.iter().any(|e| matches!(e, Event::Done(_))), "a cancelled request gets no end: {left:?}");
    let s = engine.stats();
    assert_eq!((s.cancelled, s.finished, s.running, s.kv_reserved_bytes), (1, 1, 0, 0));
    assert_eq!(s.kv_sequence_bytes, s.kv_prefix_bytes, "{s:?}");
    // Without the prefix cache every slot is emptied at once.
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    let cfg = EngineConfig { prefix_cache: false, ..EngineConfig::default() };
    let engine = Engine::start(model, Arc::new(word_tokenizer(VOCAB)), CacheConfig::fp16(), cfg).unwrap();
    let (leaver, _rx) = sink(3);
    engine.submit(greedy(ps[0].clone(), 200), leaver).unwrap();
    let (stayer, rx_stayer) = sink(usize::MAX);
    engine.submit(greedy(ps[1].clone(), 50), stayer).unwrap();
    assert!(matches!(events(&rx_stayer).last(), Some(Event::Done(_))));
    let s = engine.stats();
    assert_eq!(
        (s.cancelled, s.finished, s.kv_reserved_bytes, s.kv_sequence_bytes, s.resident_prefixes),
        (1, 1, 0, 0, 0)
    );
}

/// How many of `got` agree with the reference `want` (its tokens and top-two margins) before its
/// first choice by less than `clear`: batching changes the summation order, so a choice that
/// close may go either way. Panics at the first disagreement, saying `what`.
fn agree_while_clear(got: &[u32], want: &[(u32, f32)], clear: f32, what: &str) -> usize {
    let n = want.iter().take_while(|(_, margin)| *margin >= clear).count().min(got.len());
    for (i, (g, (w, _))) in got.iter().zip(want).take(n).enumerate() {
        assert_eq!(g, w, "{what}: token {i}");
    }
    n
}

/// Generated token ids from a request's text (the word tokenizer spells token `i` as `wi`).
fn tokens_of(events: &[Event]) -> Vec<u32> {
    text_of(events).split_whitespace().map(|w| w.trim_start_matches('w').parse().unwrap()).collect()
}

/// Checks that each of `got` is a greedy choice of the reference fed `prompt` then `got` itself by
/// plain forward passes: its logit is the step's largest, within what summation order may change.
fn greedy_along(model: &Model, prompt: &[u32], got: &[u32], seed: u64) {
    let mut caches = CacheConfig::fp16().build(model).unwrap();
    let mut logits = model.forward(prompt, &mut caches, Logits::Last).unwrap();
    for (i, &t) in got.iter().enumerate() {
        let row = logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        let best = row.iter().copied().fold(f32::MIN, f32::max);
        assert!(
            row[t as usize] >= best - 1e-3,
            "seed {seed}: token {i} of a prompt of {}: {t} is not greedy",
            prompt.len()
        );
        let step = Step::new(vec![SeqStep { slot: 0, start: caches.len(0), len: 1 }]).unwrap();
        logits = model.forward_step(&[t], &step, &mut caches, Logits::Last).unwrap();
    }
}

/// The prefix tests' engine: a random model of `seed`, fp16 caches, 32 tokens a step.
fn prefix_engine(seed: u64) -> (Arc<Model>, Engine) {
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    let cfg = EngineConfig { step_tokens: 32, ..EngineConfig::default() };
    let engine = Engine::start(model.clone(), Arc::new(word_tokenizer(VOCAB)), CacheConfig::fp16(), cfg).unwrap();
    (model, engine)
}

/// A greedy request of `n` tokens run to its end: its tokens and summary.
fn run_greedy(engine: &Engine, prompt: &[u32], n: usize, seed: u64) -> (Vec<u32>, Summary) {
    let (s, rx) = sink(usize::MAX);
    engine.submit(greedy(prompt.to_vec(), n), s).unwrap();
    let ev = events(&rx);
    let Some(Event::Done(sum)) = ev.last().cloned() else { panic!("seed {seed}: {ev:?}") };
    (tokens_of(&ev), sum)
}

#[test]
fn a_resident_prefix_is_reused_and_answers_as_a_fresh_prompt() {
    let seed = fresh_seed();
    let (model, engine) = prefix_engine(seed);
    let run = |prompt: Vec<u32>, n: usize| run_greedy(&engine, &prompt, n, seed);
    let ps = prompts(seed, &[50, 12, 9]);
    // A first turn, then the next: its whole history (prompt and answer) and a new message.
    let (answer, first) = run(ps[0].clone(), 10);
    assert_eq!((answer.len(), first.cached_tokens), (10, 0), "seed {seed}");
    let turn: Vec<u32> = ps[0].iter().chain(&answer).chain(&ps[1]).copied().collect();
    let (got, second) = run(turn.clone(), 10);
    // The caches held the prompt and every answer token but the last (never fed).
    assert_eq!((second.prompt_tokens, second.cached_tokens), (turn.len(), 50 + 9), "seed {seed}");
    greedy_along(&model, &turn, &got, seed);
    // A prompt that shares most of what a slot holds cuts it there and feeds the rest.
    let branch: Vec<u32> = turn[..60].iter().chain(&ps[2]).copied().collect();
    let (got, third) = run(branch.clone(), 10);
    assert_eq!(third.cached_tokens, 60, "seed {seed}");
    greedy_along(&model, &branch, &got, seed);
    // The same prompt again feeds only its last token.
    let (got, again) = run(branch.clone(), 10);
    assert_eq!(again.cached_tokens, branch.len() - 1, "seed {seed}");
    greedy_along(&model, &branch, &got, seed);
    let s = engine.stats();
    assert_eq!((s.prefix_hits, s.cached_prompt_tokens), (3, (59 + 60 + branch.len() - 1) as u64), "{s:?}");
    // Fed: the first prompt whole, then only what was not resident.
    let fed = 50 + (turn.len() - 59) + (branch.len() - 60) + 1;
    assert_eq!(s.prompt_tokens, fed as u64, "{s:?}");
}

/// Requests whose prompts share a long prefix with a running one (the choices of one prompt, a
/// common system prompt) wait for it to hold that prefix and start from a copy of its cache: the
/// shared part is fed once, and each answers as it would alone.
#[test]
fn requests_sharing_a_prompt_fork_the_running_one() {
    let seed = fresh_seed();
    let (model, engine) = prefix_engine(seed);
    let ps = prompts(seed, &[100, 7, 20]);
    let mut other: Vec<u32> = ps[0][..70].iter().chain(&ps[2]).copied().collect();
    // It parts from the first prompt exactly there (a random token could match by chance).
    other[70] = (ps[0][70] + 1) % VOCAB as u32;
    // The first request holds the engine in its admission until the others are queued, so they
    // find it running with its prompt partly fed.
    let (first, first_rx, open) = gated_sink();
    engine.submit(greedy(ps[0].clone(), 8), first).unwrap();
    let mut rxs = vec![first_rx];
    for p in [ps[0].clone(), ps[0].clone(), other.clone(), ps[1].clone()] {
        let (s, rx) = sink(usize::MAX);
        engine.submit(greedy(p, 8), s).unwrap();
        rxs.push(rx);
    }
    open.send(()).unwrap();
    let done: Vec<(Vec<u32>, Summary)> = rxs
        .iter()
        .map(|rx| {
            let ev = events(rx);
            let Some(Event::Done(sum)) = ev.last().cloned() else { panic!("seed {seed}: {ev:?}") };
            (tokens_of(&ev), sum)
        })
        .collect();
    let cached: Vec<usize> = done.iter().map(|d| d.1.cached_tokens).collect();
    // The same prompt twice: all but its last token copied; a prompt sharing 70 tokens: those;
    // a short unrelated prompt: nothing.
    assert_eq!(cached, vec![0, 99, 99, 70, 0], "seed {seed}");
    for ((got, _), p) in done.iter().zip([&ps[0], &ps[0], &ps[0], &other, &ps[1]]) {
        greedy_along(&model, p, got, seed);
    }
    let s = engine.stats();
    assert_eq!((s.forks, s.cached_prompt_tokens), (3, 99 + 99 + 70), "{s:?}");
    assert_eq!(s.prompt_tokens, (100 + 1 + 1 + 20 + 7) as u64, "the shared prefix is fed once: {s:?}");
}

/// A resident sequence whose prefix a request shares, too little of what it holds to be taken
/// over (a system prompt before another user's finished conversation), is copied: the request
/// feeds only the rest, and the resident stays for its own next turn.
#[test]
fn a_short_shared_prefix_is_copied_from_a_resident_sequence() {
    let seed = fresh_seed();
    let (model, engine) = prefix_engine(seed);
    let run = |prompt: &[u32]| run_greedy(&engine, prompt, 10, seed);
    let ps = prompts(seed, &[60, 60, 40, 9]);
    let cat = |parts: &[&[u32]]| parts.concat();
    let a = cat(&[&ps[0], &ps[1]]);
    let (answer, _) = run(&a);
    // 60 shared tokens of the 129 the first conversation holds: copied, not taken over.
    let mut b = cat(&[&ps[0], &ps[2]]);
    // It parts from the first conversation exactly there (a random token could match by chance).
    b[60] = (a[60] + 1) % VOCAB as u32;
    let (got, second) = run(&b);
    assert_eq!(second.cached_tokens, 60, "seed {seed}");
    greedy_along(&model, &b, &got, seed);
    // The first conversation's next turn still finds it whole.
    let c = cat(&[&a, &answer, &ps[3]]);
    let (got, third) = run(&c);
    assert_eq!(third.cached_tokens, a.len() + answer.len() - 1, "seed {seed}");
    greedy_along(&model, &c, &got, seed);
    let s = engine.stats();
    assert_eq!((s.forks, s.prefix_hits), (1, 1), "{s:?}");
    assert_eq!(s.prompt_tokens as usize, a.len() + (b.len() - 60) + (c.len() - third.cached_tokens), "{s:?}");
}

/// A tiny random model and its caches: 4-bit KIVI unless told (coded: on the CPU its forks share
/// code blocks).
struct Tiny {
    model: Arc<Model>,
    tok: Arc<tokenizers::Tokenizer>,
    cache: CacheConfig,
    /// The caches of one sequence, for their byte counts.
    probe: ModelCache,
    /// Bytes of the tables every sequence shares.
    tables: usize,
}

impl Tiny {
    fn new(seed: u64) -> Self {
        Self::with(seed, CacheConfig::kivi(4, 16))
    }

    /// The same fixture over other caches.
    fn with(seed: u64, cache: CacheConfig) -> Self {
        let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
        let probe = cache.build(&model).unwrap();
        let tables = probe.resident_bytes() - probe.sequence_bytes(0);
        Self { model, tok: Arc::new(word_tokenizer(VOCAB)), cache, probe, tables }
    }

    fn engine(&self, cfg: EngineConfig) -> Engine {
        Engine::start(self.model.clone(), self.tok.clone(), self.cache.clone(), cfg).unwrap()
    }
}

/// Forks of a coded cache read their source's code blocks instead of copies, and admission counts
/// those bytes once, from their admission on: a budget with room for 2.1 whole sequences (two,
/// were forks copies or credited only once they hold the fork) runs a prompt's four requests at
/// once, each answering as the prompt alone does on the same cache.
#[test]
fn forks_share_their_source_codes_and_the_budget_counts_them_once() {
    let seed = fresh_seed();
    let c = Tiny::new(seed);
    let (prompt, n) = (prompts(seed, &[200]).remove(0), 8);
    let need = c.probe.sequence_bytes(prompt.len() + n);
    let engine = c.engine(EngineConfig {
        kv_budget: c.tables + 2 * need + need / 10,
        step_tokens: 32,
        ..EngineConfig::default()
    });
    // The reference: the prompt alone on a fresh engine with the same caches.
    let alone = c.engine(EngineConfig::default());
    let (want, _) = run_greedy(&alone, &prompt, n, seed);
    // The first request holds the engine in its admission until the others are queued.
    let (first, first_rx, open) = gated_sink();
    engine.submit(greedy(prompt.clone(), n), first).unwrap();
    let mut rxs = vec![first_rx];
    for _ in 0..3 {
        let (s, rx) = sink(usize::MAX);
        engine.submit(greedy(prompt.clone(), n), s).unwrap();
        rxs.push(rx);
    }
    open.send(()).unwrap();
    for rx in &rxs {
        let ev = events(rx);
        assert!(matches!(ev.last(), Some(Event::Done(_))), "seed {seed}: {ev:?}");
        assert_eq!(tokens_of(&ev), want, "seed {seed}: a fork answers as the prompt alone");
    }
    let s = engine.stats();
    assert_eq!((s.forks, s.peak_running), (3, 4), "{s:?}");
    assert_eq!((s.finished, s.kv_reserved_bytes, s.kv_borrowed_bytes), (4, 0, 0), "{s:?}");
    // Resident, the forks go on reading the first one's codes: the caches hold them once, and the
    // budget counts them once.
    assert_eq!((s.resident_prefixes, s.kv_prefix_bytes), (4, s.kv_sequence_bytes), "{s:?}");
}

/// A fork that outgrows the room its finished source leaves takes the shared bytes over (the
/// source's slot given up, the fork's reservation grown by them) instead of failing: a resident
/// source stays pinned only while nothing needs its room.
#[test]
fn a_lone_fork_takes_over_what_it_shares_when_it_needs_the_room() {
    let seed = fresh_seed();
    let c = Tiny::new(seed);
    // Room for the first conversation resident and the second's prompt, not for both grown.
    let engine = c.engine(EngineConfig {
        kv_budget: c.tables + c.probe.sequence_bytes(240) + c.probe.sequence_bytes(130),
        reserve: Reserve::Grow,
        step_tokens: 32,
        ..EngineConfig::default()
    });
    let ps = prompts(seed, &[200, 20]);
    let (_, first) = run_greedy(&engine, &ps[0], 40, seed);
    assert_eq!(first.completion_tokens, 40, "seed {seed}");
    // 100 shared tokens of the 239 it holds: a copy (a fork), not a takeover.
    let mut second: Vec<u32> = ps[0][..100].iter().chain(&ps[1]).copied().collect();
    second[100] = (ps[0][100] + 1) % VOCAB as u32;
    let (_, sum) = run_greedy(&engine, &second, 130, seed);
    assert_eq!((sum.cached_tokens, sum.completion_tokens, sum.finish), (100, 130, Finish::Length), "seed {seed}");
    let s = engine.stats();
    assert_eq!((s.forks, s.failed, s.preempted, s.kv_reserved_bytes), (1, 0, 0, 0), "{s:?}");
    // The first conversation gave way; the second stays resident.
    assert_eq!(s.resident_prefixes, 1, "{s:?}");
}

/// A request admitted without the bytes it would share with a running source whose client leaves
/// before it holds the prefix: the request cannot fork, the budget cannot hold it whole while the
/// source's prefix stays resident for it, so it goes back to the head of the queue and is admitted
/// whole, taking that prefix over — the prompt is fed once in all, and it answers as alone.
#[test]
fn a_fork_that_cannot_happen_goes_back_to_the_queue() {
    let seed = fresh_seed();
    let c = Tiny::new(seed);
    let (prompt, n) = (prompts(seed, &[200]).remove(0), 8);
    let need = c.probe.sequence_bytes(prompt.len() + n);
    // Room for the source whole and the follower without what it shares, not for both whole.
    let own = need - c.probe.fork_shares(prompt.len() - 1);
    let engine = c.engine(EngineConfig {
        kv_budget: c.tables + need + own + need / 10,
        step_tokens: 32,
        ..EngineConfig::default()
    });
    let (want, _) = run_greedy(&c.engine(EngineConfig::default()), &prompt, n, seed);
    // The source's client leaves after five steps with the follower admitted (the source then
    // holds 6 × 32 of the 199 positions the follower waits for).
    let (source, _source_rx) = test_sink(usize::MAX);
    let (open, gate) = mpsc::channel();
    let source = TestSink { gate: Some(gate), polls: Some(AtomicUsize::new(5)), ..source };
    engine.submit(greedy(prompt.clone(), n), Box::new(source)).unwrap();
    let (follower, rx) = sink(usize::MAX);
    engine.submit(greedy(prompt.clone(), n), follower).unwrap();
    open.send(()).unwrap();
    let ev = events(&rx);
    let Some(Event::Done(sum)) = ev.last().cloned() else { panic!("seed {seed}: {ev:?}") };
    assert_eq!(tokens_of(&ev), want, "seed {seed}: the requeued request answers as the prompt alone");
    let s = engine.stats();
    assert_eq!((s.cancelled, s.finished, s.forks, s.prefix_hits), (1, 1, 0, 1), "{s:?}");
    assert_eq!(sum.cached_tokens as u64, s.cached_prompt_tokens, "{s:?}");
    assert!(sum.cached_tokens > 0 && sum.cached_tokens < prompt.len() - 1, "seed {seed}: {sum:?}");
    assert_eq!(s.prompt_tokens, prompt.len() as u64, "seed {seed}: fed once in all: {s:?}");
    assert_eq!((s.kv_reserved_bytes, s.kv_borrowed_bytes), (0, 0), "{s:?}");
}

/// Random loads under small budgets and every reserve policy, over fp16 caches and a coded one
/// (KIVI: on the CPU its forks share code blocks): prompts that share a document (whole, cut, or
/// not at all), clients that leave while queued, prefilling or decoding, a second wave over the
/// first's resident prefixes. Whatever was shared, pinned, taken over, preempted or sent back to
/// the queue, no request waits for ever, every request that stays answers as it does alone, and
/// once idle the engine holds no reservation and no credit. (Its first version found two ways
/// for admission to wait for ever with nothing running.)
#[test]
fn random_loads_with_shared_prefixes_answer_as_alone_and_settle_to_zero() {
    let mut compared = 0;
    for i in 0..8 {
        let cache = if i % 2 == 0 { CacheConfig::fp16() } else { CacheConfig::kivi(4, 16) };
        compared += random_shared_load(fresh_seed(), cache);
    }
    assert!(compared >= 100, "only {compared} tokens had clear margins");
}

/// One random load; the tokens compared with the reference.
fn random_shared_load(seed: u64, cache: CacheConfig) -> usize {
    let mut rng = Xorshift::new(seed);
    let dense = matches!(cache.method, crate::Method::Fp16);
    let c = Tiny::with(seed, cache);
    let n = 40 + rng.below(100);
    let doc = rng.tokens(n);
    let reserve = [Reserve::Auto, Reserve::Grow, Reserve::WorstCase][rng.below(3)];
    let step_tokens = 16 + rng.below(48);
    // A load: (prompt, max tokens, how its client leaves).
    let wave = |rng: &mut Xorshift| -> Vec<(Vec<u32>, usize, Option<Leave>)> {
        let n = 3 + rng.below(5);
        (0..n)
            .map(|_| {
                let shared = match rng.below(3) {
                    0 => doc.len(),
                    1 => 1 + rng.below(doc.len()),
                    _ => 0,
                };
                let own = 1 + rng.below(12);
                let prompt: Vec<u32> = doc[..shared].iter().copied().chain(rng.tokens(own)).collect();
                let leave = match rng.below(6) {
                    0 => Some(Leave::Polls(rng.below(4))),
                    1 => Some(Leave::Texts(rng.below(4))),
                    _ => None,
                };
                (prompt, 2 + rng.below(10), leave)
            })
            .collect()
    };
    let loads = [wave(&mut rng), wave(&mut rng)];
    let longest = loads.iter().flatten().map(|(p, n, _)| p.len() + n).max().unwrap();
    let need = c.probe.sequence_bytes(longest);
    let budget = c.tables + need + need * rng.below(200) / 100;
    let engine = c.engine(EngineConfig { kv_budget: budget, reserve, step_tokens, ..EngineConfig::default() });
    let case = format!(
        "seed {seed}: {reserve:?}, {step_tokens} tokens a step, budget {:.2} sequences",
        (budget - c.tables) as f64 / need as f64
    );
    let (mut submitted, mut compared) = (0, 0);
    for load in &loads {
        // The first request holds the engine in its admission until the rest are queued.
        let (open, gate) = mpsc::channel();
        let mut gate = Some(gate);
        let mut rxs = Vec::new();
        for (i, (prompt, n, leave)) in load.iter().enumerate() {
            let (s, rx) = test_sink(match leave {
                Some(Leave::Texts(t)) => *t,
                _ => usize::MAX,
            });
            let polls = match leave {
                Some(Leave::Polls(p)) => Some(AtomicUsize::new(*p)),
                _ => None,
            };
            let gate = if i == 0 { gate.take() } else { None };
            let s = TestSink { polls, gate, ..s };
            engine.submit(greedy(prompt.clone(), *n), Box::new(s)).unwrap();
            rxs.push(rx);
        }
        open.send(()).unwrap();
        submitted += load.len();
        for ((prompt, n, leave), rx) in load.iter().zip(&rxs) {
            let ev = events(rx);
            if leave.is_some() {
                continue;
            }
            let Some(Event::Done(sum)) = ev.last() else { panic!("{case}: {ev:?}") };
            // A cut inside the codes brings positions back as decoded rows (a takeover or a fork
            // that cuts its source's positions): such a prefix is the codec's approximation of a
            // fresh one.
            if dense || (sum.cached_tokens == 0 && sum.preemptions == 0) {
                let want = alone_on(&c.model, &c.cache, prompt, *n, &SamplingOptions::greedy());
                let what = format!("{case}: a prompt of {} tokens", prompt.len());
                compared += agree_while_clear(&tokens_of(&ev), &want, 1e-3, &what);
            }
        }
    }
    // Idle: nothing running nor queued (a client that left is noticed at the next poll).
    let mut s = engine.stats();
    for _ in 0..600 {
        if s.running == 0 && s.queued == 0 && (s.finished + s.cancelled) as usize == submitted {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        s = engine.stats();
    }
    assert_eq!((s.running, s.queued, s.failed, s.rejected), (0, 0, 0, 0), "{case}: {s:?}");
    assert_eq!((s.finished + s.cancelled) as usize, submitted, "{case}: {s:?}");
    assert_eq!((s.kv_reserved_bytes, s.kv_borrowed_bytes), (0, 0), "{case}: {s:?}");
    // Counted bytes are the bytes held (fp16), or cover them where forks share codes (a taken
    // over fork's shared blocks may be counted twice): never fewer.
    match dense {
        true => assert_eq!(s.kv_prefix_bytes, s.kv_sequence_bytes, "{case}: resident bytes are the bytes held: {s:?}"),
        false => assert!(s.kv_sequence_bytes <= s.kv_prefix_bytes, "{case}: more held than counted: {s:?}"),
    }
    compared
}

/// How a random load's client leaves: after this many of the engine's polls once admitted, or
/// after this many texts.
#[derive(Clone, Copy, Debug)]
enum Leave {
    Polls(usize),
    Texts(usize),
}

#[test]
fn bad_requests_are_refused_before_they_queue() {
    let tok = Arc::new(word_tokenizer(VOCAB));
    // Room for one sequence of 256 positions (one storage block), not of 350.
    let model = Arc::new(tiny_model_seeded(VOCAB, 1024, 7));
    let probe = CacheConfig::fp16().build(&model).unwrap();
    let cfg = EngineConfig { kv_budget: probe.resident_bytes() + probe.sequence_bytes(256), ..Default::default() };
    let engine = Engine::start(model, tok, CacheConfig::fp16(), cfg).unwrap();
    let submit = |r: Request| engine.submit(r, sink(usize::MAX).0).unwrap_err();
    let e = submit(greedy(vec![1; 1000], 100));
    assert!(matches!(e, Rejected::Context { prompt: 1000, max_tokens: 100, max: 1024 }), "{e}");
    assert!(e.to_string().contains("maximum context length is 1024 tokens"), "{e}");
    assert!(matches!(submit(greedy(vec![1; 200], 150)), Rejected::Budget { .. }));
    assert!(matches!(submit(greedy(vec![1; 4], usize::MAX)), Rejected::Context { .. }), "no overflow");
    assert!(matches!(submit(greedy(Vec::new(), 4)), Rejected::Invalid(_)));
    assert!(matches!(submit(greedy(vec![1; 4], 0)), Rejected::Invalid(_)));
    let e =
        submit(sampled(vec![1; 4], 4, SamplingOptions { top_p: Some(7.0), temperature: 0.5, ..Default::default() }));
    assert!(e.to_string().contains("top_p"), "{e}");
    assert_eq!(engine.stats().rejected, 6);
    // The engine still serves.
    let (s, rx) = sink(usize::MAX);
    engine.submit(greedy(vec![1, 2, 3], 4), s).unwrap();
    assert!(matches!(events(&rx).last(), Some(Event::Done(_))));
}

#[test]
fn stop_strings_end_a_completion_and_seeds_repeat() {
    let seed = fresh_seed();
    let engine = fp16_engine(seed);
    let p = prompts(seed, &[12]).remove(0);
    let text = |seed: u64| {
        let (s, rx) = sink(usize::MAX);
        engine.submit(sampled(p.clone(), 30, nucleus(seed)), s).unwrap();
        text_of(&events(&rx))
    };
    let (a, b) = (text(5), text(5));
    assert_eq!(a, b, "the same seed gives the same completion");
    // Stop at the fifth word of that completion: the text ends before it.
    let words: Vec<&str> = a.split_whitespace().collect();
    let stop = format!(" {}", words[4]);
    let first = a.find(&stop).unwrap();
    let (s, rx) = sink(usize::MAX);
    engine.submit(Request { stop: vec![stop], ..sampled(p.clone(), 30, nucleus(5)) }, s).unwrap();
    let ev = events(&rx);
    assert_eq!(text_of(&ev), a[..first]);
    assert!(matches!(ev.last(), Some(Event::Done(s)) if s.finish == Finish::Stop), "{ev:?}");
}

/// A request's bias and penalties reach its own sampler, beside plain greedy rows of the same
/// batch: +100 on one token makes every step choose it, and penalised requests give the tokens
/// a sampler with their options picks over plain forward passes (compared while the adjusted
/// logits' margins are clear of batched rounding, which is ~1e-6 at these logits); fresh models
/// are drawn until 16 tokens have been compared.
#[test]
fn bias_and_penalties_apply_per_request() {
    let (mut compared, mut seeds) = (0, Vec::new());
    while compared < 16 && seeds.len() < 5 {
        let seed = fresh_seed();
        seeds.push(seed);
        compared += bias_and_penalties(seed);
    }
    assert!(compared >= 16, "seeds {seeds:?}: only {compared} tokens had clear margins");
}

/// One model of `seed`: a biased request and penalised ones beside a greedy one; the tokens compared.
fn bias_and_penalties(seed: u64) -> usize {
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    let engine =
        Engine::start(model.clone(), Arc::new(word_tokenizer(VOCAB)), CacheConfig::fp16(), EngineConfig::default())
            .unwrap();
    let p = prompts(seed, &[9, 11, 10, 13, 8]);
    let forced = 5u32;
    let penalised = SamplingOptions {
        presence_penalty: 1.0,
        frequency_penalty: 2.0,
        repetition_penalty: 1.3,
        ..Default::default()
    };
    let rep_only = SamplingOptions { repetition_penalty: 0.7, ..Default::default() };
    let ask = |r: Request| {
        let (s, rx) = sink(usize::MAX);
        engine.submit(r, s).unwrap();
        rx
    };
    let cases = [(&p[1], penalised.clone()), (&p[2], penalised), (&p[3], rep_only), (&p[4], SamplingOptions::greedy())];
    let rx_bias =
        ask(sampled(p[0].clone(), 12, SamplingOptions { logit_bias: vec![(forced, 100.0)], ..Default::default() }));
    let rxs: Vec<_> = cases.iter().map(|(prompt, o)| ask(sampled((*prompt).clone(), 12, o.clone()))).collect();
    let words = |rx| tokens_of(&events(&rx));
    assert_eq!(words(rx_bias), vec![forced; 12]);
    let mut compared = 0;
    for (rx, (prompt, opts)) in rxs.into_iter().zip(&cases) {
        let want = alone_with(&model, prompt, 12, opts);
        compared += agree_while_clear(&words(rx), &want, 1e-4, &format!("seed {seed} {opts:?}"));
    }
    compared
}

/// A request that asks for log-probabilities gets one per generated token, before its text: the
/// token generated, greedy's choice at the top of the alternatives, descending, all ≤ 0.
#[test]
fn logprobs_come_with_each_token() {
    let seed = fresh_seed();
    let engine = fp16_engine(seed);
    let p = prompts(seed, &[10]).remove(0);
    let (s, rx) = sink(usize::MAX);
    engine.submit(Request { logprobs: Some(3), ..greedy(p, 12) }, s).unwrap();
    let ev = events(&rx);
    let lps: Vec<&TokenLogprob> =
        ev.iter().filter_map(|e| if let Event::Logprob(l) = e { Some(l) } else { None }).collect();
    let words: Vec<u32> = text_of(&ev).split_whitespace().map(|w| w.trim_start_matches('w').parse().unwrap()).collect();
    assert_eq!(lps.iter().map(|l| l.token).collect::<Vec<_>>(), words);
    for l in lps {
        assert_eq!(l.top.len(), 3);
        assert_eq!((l.top[0].0, l.top[0].1), (l.token, l.logprob), "greedy takes the most likely: {l:?}");
        assert!(l.top.windows(2).all(|w| w[0].1 >= w[1].1) && l.logprob <= 0.0, "{l:?}");
    }
    assert!(matches!(ev.first(), Some(Event::Admitted)) && matches!(ev.get(1), Some(Event::Logprob(_))), "{ev:?}");
}

#[test]
fn growing_reservations_admit_more_and_preempted_sequences_resume_exactly() {
    let seed = fresh_seed();
    let tok = Arc::new(word_tokenizer(VOCAB));
    let model = Arc::new(tiny_model_seeded(VOCAB, 1024, seed));
    // Room for two sequences of 600 positions (storage grows in blocks of positions): worst-case
    // admission runs two at a time.
    let probe = CacheConfig::fp16().build(&model).unwrap();
    let budget = probe.resident_bytes() + 2 * probe.sequence_bytes(600);
    assert!(probe.sequence_bytes(41) * 4 <= 2 * probe.sequence_bytes(600), "four prompts fit");
    let ps = prompts(seed, &[40, 40, 40, 40]);
    let run = |reserve: Reserve| {
        let cfg = EngineConfig { kv_budget: budget, reserve, step_tokens: 64, ..EngineConfig::default() };
        let engine = Engine::start(model.clone(), tok.clone(), CacheConfig::fp16(), cfg).unwrap();
        let rxs: Vec<_> = ps
            .iter()
            .map(|p| {
                let (s, rx) = sink(usize::MAX);
                engine.submit(greedy(p.clone(), 560), s).unwrap();
                rx
            })
            .collect();
        let outs: Vec<Vec<Event>> = rxs.iter().map(events).collect();
        (outs, engine.stats())
    };
    let (worst, ws) = run(Reserve::WorstCase);
    let (grow, gs) = run(Reserve::Grow);
    assert_eq!((ws.peak_running, ws.preempted), (2, 0), "{ws:?}");
    // Growing admits all four (their prompts fit) and preempts the newest as they grow.
    assert_eq!(gs.peak_running, 4, "{gs:?}");
    assert!(gs.preempted >= 1, "{gs:?}");
    assert_eq!((gs.finished, gs.failed, gs.kv_reserved_bytes), (4, 0, 0), "{gs:?}");
    for ((p, w), g) in ps.iter().zip(&worst).zip(&grow) {
        // One admission each, one end; the text of a resumed sequence goes on where it stopped.
        assert_eq!(g.iter().filter(|e| matches!(e, Event::Admitted)).count(), 1, "seed {seed}");
        let (Some(Event::Done(a)), Some(Event::Done(b))) = (w.last(), g.last()) else { panic!("seed {seed}") };
        assert_eq!((a.completion_tokens, b.completion_tokens, b.prompt_tokens), (560, 560, 40), "seed {seed}");
        greedy_along(&model, p, &tokens_of(g), seed);
    }
}

/// `Auto`: a request that names its limit reserves its worst case and is never preempted; an
/// open-ended one reserves its prompt and `OPEN_AHEAD` positions and grows, and gives way first —
/// even to a newer request (under `Grow` the newest gives way, whatever it stated).
#[test]
fn open_ended_requests_grow_and_give_way_to_stated_ones() {
    let seed = fresh_seed();
    let tok = Arc::new(word_tokenizer(VOCAB));
    let model = Arc::new(tiny_model_seeded(VOCAB, 1024, seed));
    let probe = CacheConfig::fp16().build(&model).unwrap();
    // Two open-ended chats (40 + up to 900) and a newer stated request (40 + 700) start together
    // — the budget holds exactly what Auto reserves for the three — and run out of memory while
    // all three decode.
    let (open, stated) = (probe.sequence_bytes(40 + OPEN_AHEAD), probe.sequence_bytes(740));
    let budget = probe.resident_bytes() + 2 * open + stated;
    assert!(3 * stated > 2 * open + stated && probe.sequence_bytes(940) <= 2 * open + stated);
    let ps = prompts(seed, &[40, 40, 40]);
    let run = |reserve: Reserve| {
        let cfg = EngineConfig { kv_budget: budget, reserve, step_tokens: 64, ..EngineConfig::default() };
        let engine = Engine::start(model.clone(), tok.clone(), CacheConfig::fp16(), cfg).unwrap();
        let rxs: Vec<_> = ps
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (s, rx) = sink(usize::MAX);
                let req = match i {
                    2 => greedy(p.clone(), 700),
                    _ => Request { open_ended: true, ..greedy(p.clone(), 900) },
                };
                engine.submit(req, s).unwrap();
                std::thread::sleep(Duration::from_millis(5));
                rx
            })
            .collect();
        let outs: Vec<Vec<Event>> = rxs.iter().map(events).collect();
        (outs, engine.stats())
    };
    let preemptions = |evs: &[Event]| match evs.last() {
        Some(Event::Done(s)) => s.preemptions,
        e => panic!("seed {seed}: {e:?}"),
    };
    let (auto, stats) = run(Reserve::Auto);
    assert_eq!((stats.peak_running, stats.finished, stats.failed, stats.kv_reserved_bytes), (3, 3, 0, 0), "{stats:?}");
    assert_eq!(preemptions(&auto[2]), 0, "seed {seed}: the stated request kept its memory");
    assert!(preemptions(&auto[0]) + preemptions(&auto[1]) >= 1, "seed {seed}: {stats:?}");
    for (p, evs) in ps.iter().zip(&auto) {
        greedy_along(&model, p, &tokens_of(evs), seed);
    }
    let (grow, _) = run(Reserve::Grow);
    assert!(preemptions(&grow[2]) >= 1, "seed {seed}: under Grow the newest gives way");
    for ((a, g), n) in auto.iter().zip(&grow).zip([900, 900, 700]) {
        assert_eq!((tokens_of(a).len(), tokens_of(a)), (n, tokens_of(g)), "seed {seed}");
    }
}

#[test]
fn a_time_limit_ends_a_request_running_or_queued() {
    let seed = fresh_seed();
    const LONG: usize = 1024;
    let tok = Arc::new(word_tokenizer(VOCAB));
    let model = Arc::new(tiny_model_seeded(VOCAB, LONG, seed));
    // Room for one whole-context sequence at a time.
    let probe = CacheConfig::fp16().build(&model).unwrap();
    let cfg =
        EngineConfig { kv_budget: probe.resident_bytes() + probe.sequence_bytes(LONG), ..EngineConfig::default() };
    let engine = Engine::start(model, tok, CacheConfig::fp16(), cfg).unwrap();
    let ps = prompts(seed, &[40, 40, 40]);
    let long = |p: &Vec<u32>, limit: Option<Duration>| Request {
        ignore_eos: true,
        time_limit: limit,
        ..greedy(p.clone(), LONG - p.len())
    };
    // 984 forward passes take far longer than a millisecond: the first ends on its limit, the
    // second (no limit) runs to its length, the third runs out of time while the second holds the
    // budget.
    let rxs: Vec<_> = [Some(Duration::from_millis(1)), None, Some(Duration::from_millis(1))]
        .iter()
        .zip(&ps)
        .map(|(&limit, p)| {
            let (s, rx) = sink(usize::MAX);
            engine.submit(long(p, limit), s).unwrap();
            rx
        })
        .collect();
    let ends: Vec<Summary> = rxs
        .iter()
        .map(|rx| match events(rx).last() {
            Some(Event::Done(s)) => *s,
            other => panic!("seed {seed}: {other:?}"),
        })
        .collect();
    assert!(ends[0].finish == Finish::TimeLimit && ends[0].completion_tokens < LONG - 40, "{:?}", ends[0]);
    assert_eq!((ends[1].finish, ends[1].completion_tokens), (Finish::Length, LONG - 40));
    assert_eq!((ends[2].finish, ends[2].completion_tokens), (Finish::TimeLimit, 0), "{:?}", ends[2]);
    assert!(ends[2].queued >= Duration::from_millis(1));
    let s = engine.stats();
    assert_eq!((s.finished, s.kv_reserved_bytes, s.running, s.queued), (3, 0, 0, 0), "{s:?}");
}

/// A request that scores its prompt gets every prompt token's log-probability under the tokens
/// before it (the first has none), in order and before its text, equal to a one-shot forward pass
/// over the prompt's logits — though the prompt is fed over several steps beside another
/// sequence, and though a second identical request finds the first resident (it reuses nothing).
#[test]
fn prompt_logprobs_equal_a_one_shot_forward_pass() {
    let seed = fresh_seed();
    let model = Arc::new(tiny_model_seeded(VOCAB, CONTEXT, seed));
    let cfg = EngineConfig { step_tokens: 32, ..EngineConfig::default() };
    let engine = Engine::start(model.clone(), Arc::new(word_tokenizer(VOCAB)), CacheConfig::fp16(), cfg).unwrap();
    let ps = prompts(seed, &[100, 30]);
    let mut caches = CacheConfig::fp16().build(&model).unwrap();
    let all = model.forward(&ps[0], &mut caches, Logits::All).unwrap().to_dtype(candle_core::DType::F32).unwrap();
    let rows = all.to_vec2::<f32>().unwrap();
    let plain = {
        let (s, rx) = sink(usize::MAX);
        engine.submit(greedy(ps[0].clone(), 5), s).unwrap();
        text_of(&events(&rx))
    };
    for round in 0..2 {
        let (s, rx) = sink(usize::MAX);
        engine.submit(Request { prompt_logprobs: Some(2), ..greedy(ps[0].clone(), 5) }, s).unwrap();
        let (other, orx) = sink(usize::MAX);
        engine.submit(greedy(ps[1].clone(), 40), other).unwrap();
        let ev = events(&rx);
        assert!(matches!(events(&orx).last(), Some(Event::Done(_))));
        let scored: Vec<(u32, Option<TokenLogprob>)> = ev
            .iter()
            .filter_map(|e| if let Event::PromptLogprob(t, l) = e { Some((*t, l.clone())) } else { None })
            .collect();
        let first_text = ev.iter().position(|e| matches!(e, Event::Text(_))).unwrap();
        let last_scored = ev.iter().rposition(|e| matches!(e, Event::PromptLogprob(..))).unwrap();
        assert!(last_scored < first_text, "round {round}: prompt entries come before the text");
        assert_eq!(scored.iter().map(|s| s.0).collect::<Vec<_>>(), ps[0], "round {round}");
        assert!(scored[0].1.is_none());
        for (i, (t, lp)) in scored.iter().enumerate().skip(1) {
            let want = TokenLogprob::of(&rows[i - 1], *t, 2);
            let got = lp.as_ref().unwrap();
            assert!(
                (got.logprob - want.logprob).abs() < 1e-3,
                "seed {seed} round {round} token {i}: {got:?} vs {want:?}"
            );
            assert_eq!(got.top.len(), 2);
            assert!(got.top[0].1 >= got.top[1].1 && got.top[0].1 >= got.logprob - 1e-6);
        }
        assert_eq!(text_of(&ev), plain, "round {round}: scoring changes no output");
    }
}
