//! A continuous-batching engine: requests in, streamed text out, every running sequence in one
//! forward pass per step, inside a KV memory budget.
//!
//! One worker thread owns the model and the caches (one [`ModelCache`] with a slot per sequence).
//! Each step it takes in new requests, drops those whose client went away, admits what fits the
//! budget ([`schedule::Admission`]: worst case = prompt + `max_tokens` positions at the method's
//! real bytes, first come first served), and runs one [`Forward::forward_step`] over every decoding
//! sequence's next token plus chunks of the prompts being prefilled ([`schedule::plan`]), so a long
//! prompt never stalls the streams already running. A finished or abandoned sequence frees its
//! slot, its storage and its reservation at once — or, with [`EngineConfig::prefix_cache`], gives
//! back its reservation and stays resident, so that a request whose prompt starts with what it
//! holds (the next turn of a chat, a shared system prompt) feeds only the rest of its prompt;
//! resident sequences give way, least recently used first, to requests that need the room. A
//! request whose prompt shares a long prefix with a *running* sequence (the `n` choices of one
//! prompt, a system prompt concurrent users send) waits for it to hold that prefix and starts
//! from a copy of its cache ([`ModelCache::fork`]); so does one that shares too little of a
//! resident sequence to take its slot over. Where the caches share what a fork does not change
//! (the CPU's code blocks), the budget counts it once: the shared bytes leave the fork's
//! reservation and the source's slot stays pinned while the fork runs or stays resident.
//!
//! The engine knows nothing of HTTP: a request comes with a [`Sink`] that receives its
//! [`Event`]s and tells whether anyone still listens.

pub mod schedule;
pub mod stats;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokenizers::Tokenizer;

use self::schedule::{plan, Admission, Progress};
use self::stats::Ledger;
pub use self::stats::Stats;
use candle_core::Tensor;

use crate::cache::{ModelCache, Step};
use crate::config::CacheConfig;
use crate::error::{Error, Result};
use crate::generate::Finish;
use crate::grammar::{Constraint, Grammar, Grammars};
use crate::model::{Logits, Model};
use crate::prefill::DEFAULT_CHUNK;
use crate::runner::Forward;
use crate::sampling::{Sampler, SamplingOptions, TokenLogprob};
use crate::text::TextStream;

/// A prompt always advances by at least this many tokens a step, however many sequences decode.
const MIN_PREFILL: usize = 16;

/// Prompt tokens a request must share with a running sequence to start from a copy of its cache
/// (a fork) instead of feeding them: below this, waiting for the other sequence and copying its
/// storage saves less than it costs.
const MIN_FORK: usize = 32;

/// How the engine shares the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Bytes the caches may hold in all: the tables every sequence shares plus each sequence's
    /// storage.
    pub kv_budget: usize,
    /// Sequences at once, at most (cache slots; device caches reserve every slot, so there the
    /// budget may allow fewer).
    pub max_seqs: usize,
    /// Tokens per forward pass: every decoding sequence's one, then prompt chunks in the rest.
    pub step_tokens: usize,
    /// Keep finished sequences resident while the budget and slots allow, and start a request
    /// whose prompt begins with one of them from what it holds; start a request whose prompt
    /// shares a long prefix with a running one from a copy of its cache (a fork).
    pub prefix_cache: bool,
    /// What admission reserves for a request.
    pub reserve: Reserve,
}

/// What admission reserves of the KV budget for a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reserve {
    /// A request that states its `max_tokens` reserves its worst case; an open-ended one
    /// ([`Request::open_ended`]: a chat without `max_tokens`, whose limit is the rest of the
    /// context) reserves its prompt and [`OPEN_AHEAD`] positions, then grows as
    /// [`Grow`](Self::Grow) does — so a server does not hold a whole context idle for every such
    /// chat, and only open-ended sequences are ever preempted.
    #[default]
    Auto,
    /// Its worst case (prompt + `max_tokens` positions) up front: an admitted request always
    /// finishes without waiting again, and a request that may run long holds its memory idle.
    WorstCase,
    /// Its prompt up front, then its storage as it grows; when the budget runs short the most
    /// recently arrived growing sequence is preempted — its slot given up, its progress kept, and
    /// it waits at the head of the queue to feed its prompt and output again (vLLM's recompute).
    Grow,
}

/// Positions an open-ended request reserves beyond its prompt under [`Reserve::Auto`]: most chat
/// replies end within them.
pub const OPEN_AHEAD: usize = 256;

impl std::str::FromStr for Reserve {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Reserve::Auto),
            "worst-case" => Ok(Reserve::WorstCase),
            "grow" => Ok(Reserve::Grow),
            _ => Err(format!("unknown reservation {s:?}: auto, worst-case or grow")),
        }
    }
}

impl std::fmt::Display for Reserve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reserve::Auto => "auto",
            Reserve::WorstCase => "worst-case",
            Reserve::Grow => "grow",
        })
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_budget: 2 << 30,
            max_seqs: 64,
            step_tokens: DEFAULT_CHUNK,
            prefix_cache: true,
            reserve: Reserve::Auto,
        }
    }
}

/// One completion to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// Prompt token ids (the chat template and BOS already applied).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// The client named no limit: `max_tokens` is the rest of the context, and under
    /// [`Reserve::Auto`] the request reserves what it grows into instead of all of it.
    pub open_ended: bool,
    /// How the next token is chosen (the request's own seeded sampler).
    pub sampling: SamplingOptions,
    /// Report each generated token's log-probability with this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability under the tokens before it, with this many
    /// alternatives (the first token has none): what `echo` with `logprobs` answers, and what a
    /// loglikelihood evaluation scores. Such a request feeds its whole prompt (no resident prefix
    /// is reused: its logits are needed).
    pub prompt_logprobs: Option<usize>,
    /// The completion ends before the first of these.
    pub stop: Vec<String>,
    /// Run to `max_tokens` through end-of-sequence tokens (benchmarks: every request the same
    /// length whatever the model says).
    pub ignore_eos: bool,
    /// What the completion must spell (a token mask at every step); it ends where the grammar
    /// does. Not with `ignore_eos`.
    pub grammar: Option<Grammar>,
    /// The request ends ([`Finish::TimeLimit`]) once this long has passed since its submission,
    /// queued or running, with what it has generated by then.
    pub time_limit: Option<Duration>,
}

/// What a request's sink receives, in order: `Admitted`, `Text`…, then `Done` or `Failed`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// KV memory is reserved and the prompt is being fed.
    Admitted,
    /// More completion text (never part of a stop string).
    Text(String),
    /// The next generated token's log-probability (requests that ask for them; sent before the
    /// text it adds; not for an end-of-sequence token unless the request scores its prompt).
    Logprob(TokenLogprob),
    /// The next prompt token and its log-probability (requests that ask for them: every prompt
    /// token in order, after `Admitted` and before any `Text`; `None` for the first, which
    /// nothing precedes).
    PromptLogprob(u32, Option<TokenLogprob>),
    /// The completion ended.
    Done(Summary),
    /// The engine failed while running it (its slot is freed).
    Failed(String),
}

/// How a completion ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// End of sequence or a stop string ([`Finish::Stop`]), or the token limit.
    pub finish: Finish,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, the tokens a resident sequence already held (not fed again).
    pub cached_tokens: usize,
    /// Tokens generated (an end-of-sequence token not counted).
    pub completion_tokens: usize,
    /// From submission to admission.
    pub queued: Duration,
    /// From submission to the first generated token.
    pub first_token: Duration,
    /// From submission to the end.
    pub total: Duration,
    /// Times it was preempted (its memory given back, then fed again where it stopped).
    pub preemptions: usize,
}

/// Where a request's events go.
pub trait Sink: Send {
    /// Delivers an event; false when nobody listens any more (the request is then cancelled).
    fn send(&mut self, event: Event) -> bool;
    /// Whether anybody still listens (checked before every step, so a client that left during a
    /// long prompt frees its memory without waiting for text to bounce).
    fn alive(&self) -> bool;
}

/// Why a request was refused before it was queued.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Rejected {
    /// Prompt and completion do not fit the context.
    #[error(
        "this model's maximum context length is {max} tokens, but {} were requested ({prompt} in the prompt, {max_tokens} for the completion)",
        prompt.saturating_add(*max_tokens)
    )]
    Context {
        /// Prompt tokens.
        prompt: usize,
        /// Completion tokens asked for.
        max_tokens: usize,
        /// The context.
        max: usize,
    },
    /// Even alone, the request's worst case exceeds the KV budget.
    #[error("the request needs {need} bytes of KV cache at most, but the server's budget holds {budget} bytes for sequences")]
    Budget {
        /// Bytes the request may take.
        need: usize,
        /// Bytes sequences may take in all.
        budget: usize,
    },
    /// The grammar cannot be used (a schema llguidance cannot compile, or with `ignore_eos`).
    #[error("{0}")]
    Grammar(String),
    /// Bad settings (an empty prompt, a temperature out of range).
    #[error("{0}")]
    Invalid(String),
    /// The engine has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

/// What the engine was started with, fixed for its life.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    /// The cache method's name.
    pub method: String,
    /// Tokens of the model's vocabulary.
    pub vocab: usize,
    /// Positions a sequence may reach (prompt and completion).
    pub max_context: usize,
    /// Sequences at once, at most.
    pub slots: usize,
    /// The budget the engine was given.
    pub kv_budget: usize,
    /// Bytes of the tables every sequence shares (codebooks, scales), counted in the budget.
    pub shared_bytes: usize,
    /// Storage bytes per position of a long sequence (device caches: the slot's reservation per
    /// position of its capacity).
    pub bytes_per_position: f64,
    /// `sequence_bytes[n]`: what a sequence of `n` positions takes.
    sequence_bytes: Arc<[usize]>,
}

impl EngineInfo {
    /// Bytes a sequence of `positions` positions takes in the caches, its worst case.
    pub fn sequence_bytes(&self, positions: usize) -> usize {
        self.sequence_bytes[positions.min(self.sequence_bytes.len() - 1)]
    }

    /// Bytes of the budget left for sequences.
    pub fn sequence_budget(&self) -> usize {
        self.kv_budget.saturating_sub(self.shared_bytes)
    }
}

/// A submitted request as the worker holds it.
struct Job {
    /// Unique among the engine's requests (assigned when queued).
    id: u64,
    req: Request,
    sink: Box<dyn Sink>,
    arrived: Instant,
    need: usize,
    /// Tokens to feed once admitted: the prompt, and after a preemption its output so far too.
    feed: Vec<u32>,
    /// A preempted request's progress.
    carry: Option<Carry>,
    /// Its place in its grammar, when it has one.
    constraint: Option<Constraint>,
    /// Admitted without what it will read from a fork's source; off once that went wrong (the
    /// fork did not happen and the budget could not hold it whole).
    fork_discount: bool,
}

impl Job {
    /// The tokens a resident prefix may stand for: its feed, or none for a request scoring its
    /// prompt (it needs every prompt token's logits).
    fn reusable(&self) -> &[u32] {
        if self.req.prompt_logprobs.is_some() {
            &[]
        } else {
            &self.feed
        }
    }
}

/// What a preempted sequence had done, kept while it waits to run again.
struct Carry {
    /// Prompt tokens whose log-probabilities were sent.
    scored: usize,
    out: Vec<u32>,
    sampler: Sampler,
    text: TextStream,
    /// Prompt tokens its first admission took from the cache; `None` for a request sent back to
    /// the queue before it fed anything, whose next admission's count stands.
    cached: Option<usize>,
    admitted: Instant,
    first: Option<Instant>,
    preemptions: usize,
}

/// A running engine: submit requests, read its stats. Dropping it stops the worker (running
/// requests get [`Event::Failed`]).
pub struct Engine {
    info: EngineInfo,
    grammars: Grammars,
    tx: Mutex<Option<Sender<Job>>>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    worker: Option<JoinHandle<()>>,
}

impl Engine {
    /// Builds the caches for as many sequences as the budget and `max_seqs` allow and starts the
    /// worker thread that runs `model`.
    pub fn start(runner: Arc<dyn Forward>, tok: Arc<Tokenizer>, cache: CacheConfig, cfg: EngineConfig) -> Result<Self> {
        let model = runner.model();
        if cfg.step_tokens == 0 || cfg.max_seqs == 0 {
            return Err(Error::Config("the engine needs at least one slot and one token per step".into()));
        }
        let max_context = cache.capacity.unwrap_or(model.max_context()).min(model.max_context());
        let cache = CacheConfig { capacity: Some(max_context), ..cache };
        // One slot first: what is shared, what a sequence of each length takes.
        let probe = cache.build_batch(model, 1)?;
        let reserve = probe.sequence_bytes(0);
        let shared = probe.resident_bytes().saturating_sub(reserve);
        let sequence_bytes: Arc<[usize]> = (0..=max_context).map(|n| probe.sequence_bytes(n)).collect();
        drop(probe);
        if cfg.kv_budget <= shared {
            return Err(Error::Config(format!(
                "a KV budget of {} bytes does not hold the {shared} bytes of tables every sequence shares",
                cfg.kv_budget
            )));
        }
        let for_seqs = cfg.kv_budget - shared;
        let slots = match reserve {
            0 => cfg.max_seqs,
            r => cfg.max_seqs.min(for_seqs / r),
        };
        if slots == 0 {
            return Err(Error::Config(format!(
                "a KV budget of {} bytes holds no sequence: this device reserves {reserve} bytes per slot of {max_context} positions (lower the context or raise the budget)",
                cfg.kv_budget
            )));
        }
        let span = 1024.min(max_context);
        let bytes_per_position = match reserve {
            0 => (sequence_bytes[max_context] - sequence_bytes[max_context - span]) as f64 / span as f64,
            r => r as f64 / max_context as f64,
        };
        let info = EngineInfo {
            method: cache.name(),
            vocab: model.info.vocab,
            max_context,
            slots,
            kv_budget: cfg.kv_budget,
            shared_bytes: shared,
            bytes_per_position,
            sequence_bytes,
        };
        let caches = cache.build_batch(model, slots)?;
        let grammars = Grammars::new(tok.clone(), model.info.eos_tokens.clone(), model.info.vocab);
        let (tx, rx) = mpsc::channel();
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut w = Worker {
            model: runner.clone(),
            tok,
            cache,
            empty_bytes: caches.resident_bytes(),
            caches,
            adm: Admission::new(if reserve == 0 { for_seqs } else { slots * reserve }, slots),
            live: Vec::new(),
            rx,
            ledger: ledger.clone(),
            stop: stop.clone(),
            info: info.clone(),
            step_tokens: cfg.step_tokens,
            prefix_cache: cfg.prefix_cache,
            reserve: cfg.reserve,
            next_id: 1,
        };
        let worker = std::thread::Builder::new()
            .name("veloq-engine".into())
            .spawn(move || w.run())
            .map_err(|e| Error::Config(format!("starting the engine thread: {e}")))?;
        Ok(Self { info, grammars, tx: Mutex::new(Some(tx)), ledger, stop, worker: Some(worker) })
    }

    /// What the engine runs with.
    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Checks `req` (context, budget, settings) and queues it; its events go to `sink`.
    pub fn submit(&self, req: Request, sink: Box<dyn Sink>) -> std::result::Result<(), Rejected> {
        let refuse = |r: Rejected| {
            self.ledger.lock().expect("ledger").stats.rejected += 1;
            Err(r)
        };
        if req.prompt.is_empty() {
            return refuse(Rejected::Invalid("the prompt has no tokens".into()));
        }
        if req.max_tokens == 0 {
            return refuse(Rejected::Invalid("max_tokens must be at least 1".into()));
        }
        if let Err(e) = req.sampling.check(self.info.vocab) {
            return refuse(Rejected::Invalid(e.message));
        }
        let positions = req.prompt.len().saturating_add(req.max_tokens);
        if positions > self.info.max_context {
            let (prompt, max_tokens, max) = (req.prompt.len(), req.max_tokens, self.info.max_context);
            return refuse(Rejected::Context { prompt, max_tokens, max });
        }
        let need = self.info.sequence_bytes(positions);
        if need > self.info.sequence_budget() {
            return refuse(Rejected::Budget { need, budget: self.info.sequence_budget() });
        }
        let constraint = match &req.grammar {
            None => None,
            Some(_) if req.ignore_eos => {
                return refuse(Rejected::Grammar("a grammar ends the completion: not with ignore_eos".into()))
            }
            // The first grammar builds the vocabulary's trie (once per engine).
            Some(g) => match self.grammars.compile(g) {
                Ok(c) => Some(c),
                Err(e) => return refuse(Rejected::Grammar(e.to_string())),
            },
        };
        let feed = req.prompt.clone();
        let job =
            Job { id: 0, req, sink, arrived: Instant::now(), need, feed, carry: None, constraint, fork_discount: true };
        let tx = self.tx.lock().expect("sender");
        match tx.as_ref() {
            Some(t) if t.send(job).is_ok() => Ok(()),
            _ => Err(Rejected::Stopped),
        }
    }

    /// Counters, KV memory in use and recent speeds.
    pub fn stats(&self) -> Stats {
        self.ledger.lock().expect("ledger").snapshot()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.tx.lock().expect("sender").take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// An admitted request.
struct Live {
    job: Job,
    slot: usize,
    reserved: usize,
    /// Prompt tokens a resident sequence already held at its first admission.
    cached: usize,
    /// Tokens of `job.feed` in the caches.
    fed: usize,
    /// Generated tokens; the last is not in the caches yet.
    out: Vec<u32>,
    /// Of those, how many were fed as part of `job.feed` (a preempted sequence's earlier output).
    resumed_at: usize,
    sampler: Sampler,
    text: TextStream,
    admitted: Instant,
    first: Option<Instant>,
    /// Times it was preempted so far.
    preemptions: usize,
    /// Set once the request is over (its slot is freed after the step).
    done: Option<Outcome>,
    /// Prompt tokens whose log-probabilities were sent (requests that ask for them).
    scored: usize,
    /// The raw logits after the last prompt token fed, while the next one's log-probability is
    /// still to be sent (a prompt fed over several steps).
    scoring: Option<Vec<f32>>,
    /// Waiting, its slot empty, for a running sequence to hold a prefix of its prompt, to start
    /// from a copy of it.
    follows: Option<Follow>,
    /// Started from a fork whose blocks it shares with the source's slot: those bytes are the
    /// source's (its slot pinned meanwhile, and after, while this one stays resident), not in
    /// `reserved`.
    borrowed: Option<Borrow>,
}

/// Bytes a forked sequence reads from another slot's storage instead of its own.
#[derive(Clone, Copy, Debug)]
struct Borrow {
    slot: usize,
    bytes: usize,
}

/// What a request waits for before it starts from a fork: the running request `source` holding
/// `at` positions, all of them a prefix of the waiting one's prompt.
#[derive(Clone, Copy, Debug)]
struct Follow {
    source: u64,
    at: usize,
}

impl Live {
    /// Bytes of its storage that another slot's reservation covers.
    fn borrowed(&self) -> usize {
        self.borrowed.map_or(0, |b| b.bytes)
    }

    /// The tokens the caches hold for this sequence, in order, once they hold them: the feed,
    /// then every generated token since (the last is not in the caches yet).
    fn history(&self) -> impl Iterator<Item = &u32> {
        self.job.feed.iter().chain(&self.out[self.resumed_at..])
    }
}

enum Outcome {
    Finished(Finish),
    Cancelled,
    /// This request alone failed (its grammar refused a step).
    Failed(String),
}

struct Worker {
    model: Arc<dyn Forward>,
    tok: Arc<Tokenizer>,
    cache: CacheConfig,
    caches: ModelCache,
    /// What the caches hold with every slot empty.
    empty_bytes: usize,
    adm: Admission<Job>,
    /// Admitted requests, oldest first.
    live: Vec<Live>,
    rx: Receiver<Job>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    info: EngineInfo,
    step_tokens: usize,
    prefix_cache: bool,
    reserve: Reserve,
    /// The next request's id.
    next_id: u64,
}

impl Worker {
    fn run(&mut self) {
        loop {
            self.publish();
            if !self.intake() {
                break;
            }
            self.admit();
            self.publish();
            if self.live.is_empty() {
                continue;
            }
            if let Err(e) = self.step() {
                self.fail_all(&e.to_string());
            }
            self.retire();
        }
        self.fail_all("the engine has stopped");
        self.publish();
    }

    /// Takes new requests (waiting for one when idle) and drops those whose client left. False
    /// when the engine should stop.
    fn intake(&mut self) -> bool {
        if self.stop.load(Ordering::Relaxed) {
            return false;
        }
        if self.live.is_empty() && self.adm.waiting() == 0 {
            match self.rx.recv() {
                Ok(job) => self.queue(job),
                Err(_) => return false,
            }
        }
        loop {
            match self.rx.try_recv() {
                Ok(job) => self.queue(job),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return !self.stop.load(Ordering::Relaxed),
            }
        }
        let now = Instant::now();
        let expired = |j: &Job| j.req.time_limit.is_some_and(|t| now >= j.arrived + t);
        let gone = self.adm.retain_waiting(|j| j.sink.alive() && !expired(j));
        let (mut cancelled, mut finished) = (0, 0);
        for mut j in gone {
            if !j.sink.alive() {
                cancelled += 1;
                continue;
            }
            // Out of time while queued: it ends with nothing generated.
            finished += 1;
            let waited = now - j.arrived;
            j.sink.send(Event::Done(Summary {
                finish: Finish::TimeLimit,
                prompt_tokens: j.req.prompt.len(),
                cached_tokens: 0,
                completion_tokens: j.carry.as_ref().map_or(0, |c| c.out.len()),
                queued: waited,
                first_token: waited,
                total: waited,
                preemptions: j.carry.as_ref().map_or(0, |c| c.preemptions),
            }));
        }
        {
            let mut ledger = self.ledger.lock().expect("ledger");
            ledger.stats.cancelled += cancelled;
            ledger.stats.finished += finished;
        }
        for l in &mut self.live {
            if !l.job.sink.alive() {
                l.done = Some(Outcome::Cancelled);
            } else if expired(&l.job) {
                l.done = Some(Outcome::Finished(Finish::TimeLimit));
            }
        }
        self.retire();
        true
    }

    fn queue(&mut self, mut job: Job) {
        job.id = self.next_id;
        self.next_id += 1;
        let bytes = self.admission_bytes(&job);
        self.adm.push(job, bytes);
    }

    /// What admission reserves for `job`: its worst case, or what its feed takes and one more
    /// (open-ended requests under `Auto`: [`OPEN_AHEAD`] more).
    fn admission_bytes(&self, job: &Job) -> usize {
        let ahead = match (self.reserve, job.req.open_ended) {
            (Reserve::WorstCase, _) | (Reserve::Auto, false) => return job.need,
            (Reserve::Grow, _) => 1,
            (Reserve::Auto, true) => OPEN_AHEAD,
        };
        self.info.sequence_bytes(job.feed.len() + ahead).min(job.need)
    }

    /// Where `job`, admitted now without taking a resident over, will start from a fork — the
    /// running sequence that holds (or feeds) most of its prompt, else the resident one — and the
    /// bytes it will read from that slot instead of its own.
    fn planned_fork(&self, job: &Job) -> Option<(usize, usize)> {
        if !job.fork_discount {
            return None;
        }
        let (slot, at) = match self.running_source(job, 0) {
            Some(f) => (self.live.iter().find(|l| l.job.id == f.source)?.slot, f.at),
            None => self.resident_source(job, 0)?,
        };
        Some((slot, self.caches.fork_shares(at))).filter(|&(_, bytes)| bytes > 0)
    }

    fn admit(&mut self) {
        loop {
            // A request that will start from a fork is admitted without what it will read from
            // the source, whose slot is pinned from then on.
            let plan = self.adm.front().and_then(|j| self.planned_fork(j));
            let Some(a) = self.adm.admit(Job::reusable, plan) else { break };
            let borrowed = plan.filter(|_| a.discount > 0).map(|(slot, _)| Borrow { slot, bytes: a.discount });
            let (mut job, slot, reserved) = (a.item, a.slot, a.bytes);
            let mut broken = a.evicted.iter().find_map(|&e| self.caches.truncate(e, 0).err());
            // A slot keeps the shared prefix; a layer that cannot cut there (a sliding window
            // that no longer holds it) makes the request start from scratch.
            let mut cached = a.reuse;
            // A running sequence that holds (or is feeding) more of the prompt than any resident
            // one: start from a copy of it once it holds that much.
            let follows = self.running_source(&job, cached);
            if follows.is_some() {
                cached = 0;
            }
            if self.caches.truncate(slot, cached).is_err() {
                cached = 0;
                broken = broken.or(self.caches.truncate(slot, 0).err());
            }
            // A resident sequence that shares more than that, too little of what it holds to be
            // taken over (a system prompt before another user's finished conversation): a copy.
            let resident = follows.is_none().then(|| self.resident_source(&job, cached)).flatten();
            let mut copied = false;
            if let Some((from, n)) = resident {
                // Refused (a sliding window that no longer holds the cut): the prompt is fed whole.
                copied = self.caches.truncate(slot, 0).and_then(|_| self.caches.fork(from, slot, n)).is_ok();
                cached = if copied { n } else { 0 };
                if !copied {
                    broken = broken.or(self.caches.truncate(slot, 0).err());
                }
            }
            if cached > 0 {
                let mut ledger = self.ledger.lock().expect("ledger");
                match copied {
                    true => ledger.stats.forks += 1,
                    false => ledger.stats.prefix_hits += 1,
                }
                ledger.stats.cached_prompt_tokens += cached as u64;
            }
            let resumed = job.carry.is_some();
            let carry = job.carry.take().unwrap_or_else(|| {
                let r = &job.req;
                Carry {
                    scored: 0,
                    out: Vec::new(),
                    sampler: Sampler::new(r.sampling.clone(), &r.prompt),
                    text: TextStream::new(r.stop.clone()),
                    cached: Some(cached),
                    admitted: Instant::now(),
                    first: None,
                    preemptions: 0,
                }
            });
            // A preempted request was told once; it only resumes.
            let alive = if resumed { job.sink.alive() } else { job.sink.send(Event::Admitted) };
            let done = (!alive).then_some(Outcome::Cancelled);
            self.live.push(Live {
                job,
                slot,
                reserved,
                cached: carry.cached.unwrap_or(cached),
                fed: cached,
                resumed_at: carry.out.len(),
                out: carry.out,
                sampler: carry.sampler,
                text: carry.text,
                admitted: carry.admitted,
                first: carry.first,
                preemptions: carry.preemptions,
                done,
                scored: carry.scored,
                scoring: None,
                follows,
                borrowed,
            });
            // What it reads from the resident it copied, or nothing if it feeds its prompt itself;
            // a follower settles once it forks.
            if follows.is_none() {
                let i = self.live.len() - 1;
                let from = resident.filter(|_| copied).map(|(from, _)| from);
                match self.credit(i, from) {
                    Ok(true) => {}
                    Ok(false) => broken = broken.or(self.requeue(i).err()),
                    Err(e) => broken = broken.or(Some(e)),
                }
            }
            if let Some(e) = broken {
                self.fail_all(&format!("emptying a cache slot failed: {e}"));
            }
        }
        self.retire();
    }

    /// The running sequence a request would start from a copy of: the one whose history shares
    /// the longest prefix with its prompt (at least [`MIN_FORK`] tokens and more than the `cached`
    /// its own slot keeps; the last prompt token is always fed, for its logits), and how many.
    /// None where prefixes are not reused or the request scores its prompt.
    fn running_source(&self, job: &Job, cached: usize) -> Option<Follow> {
        let feed = job.reusable();
        if !self.prefix_cache || feed.is_empty() {
            return None;
        }
        self.live
            .iter()
            .filter(|l| l.follows.is_none() && l.done.is_none())
            .map(|l| {
                let shared = l.history().zip(feed).take_while(|(a, b)| a == b).count();
                Follow { source: l.job.id, at: shared.min(feed.len() - 1) }
            })
            .filter(|f| f.at >= MIN_FORK && f.at > cached)
            .max_by_key(|f| f.at)
    }

    /// The resident (finished) sequence a request would start from a copy of, by the same rule:
    /// its slot and how many positions it shares.
    fn resident_source(&self, job: &Job, cached: usize) -> Option<(usize, usize)> {
        if !self.prefix_cache {
            return None;
        }
        // A request scoring its prompt has nothing reusable, so no resident matches it.
        self.adm.resident_prefix(job.reusable()).filter(|&(_, n)| n >= MIN_FORK && n > cached)
    }

    /// Starts each waiting request whose source now holds its prefix from a copy of it; one
    /// whose source stopped running (finished, cancelled, preempted) feeds its prompt itself.
    fn fork_followers(&mut self) -> Result<()> {
        let mut whole = Vec::new();
        for i in 0..self.live.len() {
            let Some(f) = self.live[i].follows else { continue };
            let source = self.live.iter().find(|l| l.job.id == f.source).map(|l| l.slot);
            let slot = match source {
                Some(s) if self.caches.len(s) >= f.at => Some(s),
                Some(_) => continue,
                None => None,
            };
            let to = self.live[i].slot;
            self.live[i].follows = None;
            // A sliding-window layer cannot cut back below what it holds: the source's chunks
            // stop at `at` while a request waits for it, so a cut is rare; then it feeds itself.
            let forked = match slot {
                Some(s) if self.caches.fork(s, to, f.at).is_ok() => Some(s),
                Some(_) => {
                    self.caches.truncate(to, 0)?;
                    None
                }
                None => None,
            };
            if !self.credit(i, forked)? {
                whole.push(i);
                continue;
            }
            if forked.is_some() {
                let l = &mut self.live[i];
                (l.fed, l.cached) = (f.at, f.at);
                let mut ledger = self.ledger.lock().expect("ledger");
                ledger.stats.forks += 1;
                ledger.stats.cached_prompt_tokens += f.at as u64;
            }
        }
        for i in whole.into_iter().rev() {
            self.requeue(i)?;
        }
        Ok(())
    }

    /// Live `i`'s credit becomes what it really reads: what it shares with `from`'s storage after
    /// a fork, or nothing (`None`: it feeds its prompt itself). Its reservation gives back what it
    /// reads beyond what it was admitted without, or grows by what it reads less (giving up
    /// resident sequences if need be); `false`, nothing changed, when the budget cannot hold that.
    fn credit(&mut self, i: usize, from: Option<usize>) -> Result<bool> {
        let (slot, reserved, old) = (self.live[i].slot, self.live[i].reserved, self.live[i].borrowed);
        let alone = reserved + old.map_or(0, |b| b.bytes);
        let new = from.map(|f| Borrow { slot: f, bytes: self.caches.shared_bytes(slot).min(alone) });
        let new = new.filter(|b| b.bytes > 0);
        let want = alone - new.map_or(0, |b| b.bytes);
        // Pinned first, so that growing cannot give the new source up.
        if let Some(n) = new {
            self.adm.pin(n.slot);
        }
        if want > reserved {
            let Some(evicted) = self.adm.grow(want - reserved) else {
                if let Some(n) = new {
                    self.adm.repay(n.slot);
                }
                return Ok(false);
            };
            for e in evicted {
                self.caches.truncate(e, 0)?;
            }
        } else {
            self.adm.unreserve(reserved - want);
        }
        if let Some(o) = old {
            self.adm.repay(o.slot);
        }
        let l = &mut self.live[i];
        (l.reserved, l.borrowed) = (want, new);
        Ok(true)
    }

    /// Live `i` was admitted without what it would read from a fork that did not happen, and the
    /// budget cannot hold it whole now: it goes back to the head of the queue, to be admitted
    /// whole.
    fn requeue(&mut self, i: usize) -> Result<()> {
        self.back_to_queue(i, false)
    }

    /// One forward pass over every live sequence, then their new tokens.
    fn step(&mut self) -> Result<()> {
        if self.reserve != Reserve::WorstCase {
            self.grow()?;
        }
        self.fork_followers()?;
        // A prompt that others wait on stops its chunk where they will copy it.
        let stop_at = |l: &Live| {
            self.live
                .iter()
                .filter_map(|w| w.follows.filter(|f| f.source == l.job.id && f.at > l.fed).map(|f| f.at))
                .min()
                .unwrap_or(usize::MAX)
        };
        let progress: Vec<Progress> = self
            .live
            .iter()
            .filter(|l| l.follows.is_none())
            .map(|l| Progress {
                slot: l.slot,
                held: self.caches.len(l.slot),
                prompt_left: (l.job.feed.len() - l.fed).min(stop_at(l).saturating_sub(l.fed)),
            })
            .collect();
        let seqs = plan(&progress, self.step_tokens, MIN_PREFILL);
        if seqs.is_empty() {
            return Ok(());
        }
        let mut at = vec![usize::MAX; self.caches.slots()];
        self.live.iter().enumerate().for_each(|(i, l)| at[l.slot] = i);
        let mut tokens = Vec::with_capacity(seqs.iter().map(|s| s.len).sum());
        for s in &seqs {
            let l = &self.live[at[s.slot]];
            match l.job.feed.len() - l.fed {
                0 => tokens.push(*l.out.last().expect("a decoding sequence has a token")),
                _ => tokens.extend(&l.job.feed[l.fed..l.fed + s.len]),
            }
        }
        let t0 = Instant::now();
        // A step that feeds prompt tokens a request scores computes every token's logits.
        let scores = |l: &Live| l.job.req.prompt_logprobs.is_some() && l.scored < l.job.req.prompt.len();
        let all = seqs.iter().any(|s| {
            let l = &self.live[at[s.slot]];
            l.fed < l.job.feed.len() && scores(l)
        });
        let step = Step::new(seqs.clone())?;
        let logits =
            self.model.forward_step(&tokens, &step, &mut self.caches, if all { Logits::All } else { Logits::Last })?;
        let (every, logits) = match all {
            false => (None, logits),
            true => {
                let mut end = 0u32;
                let last: Vec<u32> = seqs
                    .iter()
                    .map(|s| {
                        end += s.len as u32;
                        end - 1
                    })
                    .collect();
                let index = Tensor::new(last.as_slice(), logits.device())?;
                let last = logits.index_select(&index, 0)?;
                (Some(logits), last)
            }
        };
        let (mut prompt_fed, mut sampled) = (0, 0);
        let mut greedy: Option<Vec<u32>> = None;
        let mut offset = 0;
        for (row, s) in seqs.iter().enumerate() {
            let l = &mut self.live[at[s.slot]];
            let first = offset;
            offset += s.len;
            if let (Some(every), true, true) = (&every, l.fed < l.job.feed.len(), scores(l)) {
                if !Self::score(every, first, s.len, l) {
                    continue;
                }
            }
            if l.fed < l.job.feed.len() {
                l.fed += s.len;
                prompt_fed += s.len;
                if l.fed < l.job.feed.len() {
                    continue;
                }
            }
            // Plain greedy rows take one argmax over the batch on the device.
            let plain = l.job.req.sampling.plain_greedy() && l.job.req.logprobs.is_none();
            let (next, logprob) = if plain && l.job.constraint.is_none() {
                if greedy.is_none() {
                    greedy = Some(logits.argmax(candle_core::D::Minus1)?.to_vec1::<u32>()?);
                }
                (greedy.as_ref().expect("just set")[row], None)
            } else if l.job.req.logprobs.is_some() || l.job.constraint.is_some() {
                // The sampler adjusts its copy in place (after the grammar's mask); the
                // log-probabilities are the raw logits'.
                let raw = logits.get(row)?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
                let mut work = raw.clone();
                if let Some(Err(e)) = l.job.constraint.as_mut().map(|c| c.mask(&mut work)) {
                    l.done = Some(Outcome::Failed(e.to_string()));
                    continue;
                }
                let next = l.sampler.next(&mut work);
                (next, l.job.req.logprobs.map(|n| TokenLogprob::of(&raw, next, n)))
            } else {
                (l.sampler.sample(&logits.get(row)?)?, None)
            };
            sampled += 1;
            let (max, held) = (self.info.max_context, self.caches.len(l.slot));
            Self::take(self.model.model(), &self.tok, l, next, logprob, max, held)?;
        }
        self.ledger.lock().expect("ledger").step(t0.elapsed(), prompt_fed, sampled);
        Ok(())
    }

    /// Sends the log-probabilities of the prompt tokens this step fed for `l` (`len` rows of
    /// `every` from `first`: the step's logits for each token), each under the logits before it,
    /// and keeps the last row for the next step's first token. False when the client has gone.
    fn score(every: &Tensor, first: usize, len: usize, l: &mut Live) -> bool {
        let n = l.job.req.prompt_logprobs.unwrap_or(0);
        let prompt = &l.job.req.prompt;
        let rows = match every.narrow(0, first, len).and_then(|r| r.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>())
        {
            Ok(r) => r,
            Err(e) => {
                l.done = Some(Outcome::Failed(format!("prompt log-probabilities: {e}")));
                return false;
            }
        };
        for (j, row) in rows.into_iter().enumerate() {
            let at = l.fed + j;
            if at >= l.scored && at < prompt.len() {
                let lp = match at {
                    0 => None,
                    _ => l.scoring.as_ref().map(|prev| TokenLogprob::of(prev, prompt[at], n)),
                };
                if !l.job.sink.send(Event::PromptLogprob(prompt[at], lp)) {
                    l.done = Some(Outcome::Cancelled);
                    return false;
                }
                l.scored = at + 1;
            }
            l.scoring = (at + 1 < prompt.len()).then_some(row);
        }
        true
    }

    /// A sequence's next token: its text to the client, and whether it ends here.
    fn take(
        model: &Model,
        tok: &Tokenizer,
        l: &mut Live,
        next: u32,
        logprob: Option<TokenLogprob>,
        max_context: usize,
        held: usize,
    ) -> Result<()> {
        l.first.get_or_insert_with(Instant::now);
        let eos = !l.job.req.ignore_eos && model.info.eos_tokens.contains(&next);
        // A grammar follows every token but the end; once complete, nothing may follow.
        let mut complete = false;
        if let (Some(c), false) = (l.job.constraint.as_mut(), eos) {
            if let Err(e) = c.accept(next) {
                l.done = Some(Outcome::Failed(e.to_string()));
                return Ok(());
            }
            complete = c.finished();
        }
        // A request scoring its prompt (`echo`) gets the end-of-sequence token's entry too: a
        // loglikelihood harness counts one entry per generated token.
        if let (true, Some(lp), true) = (eos, &logprob, l.job.req.prompt_logprobs.is_some()) {
            if !l.job.sink.send(Event::Logprob(lp.clone())) {
                l.done = Some(Outcome::Cancelled);
                return Ok(());
            }
        }
        if !eos {
            l.out.push(next);
            if let Some(lp) = logprob {
                if !l.job.sink.send(Event::Logprob(lp)) {
                    l.done = Some(Outcome::Cancelled);
                    return Ok(());
                }
            }
            let piece = l.text.push(tok, next)?;
            if !piece.is_empty() && !l.job.sink.send(Event::Text(piece)) {
                l.done = Some(Outcome::Cancelled);
                return Ok(());
            }
        }
        l.done = if eos || complete || l.text.stopped() {
            Some(Outcome::Finished(Finish::Stop))
        } else if l.out.len() >= l.job.req.max_tokens {
            Some(Outcome::Finished(Finish::Length))
        } else if held >= max_context {
            Some(Outcome::Finished(Finish::Context))
        } else {
            None
        };
        Ok(())
    }

    /// Frees every sequence that is over, then tells the clients (so the stats they may read next
    /// already count the freed memory).
    fn retire(&mut self) {
        let (over, live): (Vec<Live>, Vec<Live>) =
            std::mem::take(&mut self.live).into_iter().partition(|l| l.done.is_some());
        self.live = live;
        if over.is_empty() {
            return;
        }
        let mut broken = None;
        for l in &over {
            if let Err(e) = self.give_back(l) {
                broken = Some(e);
            }
        }
        {
            let mut ledger = self.ledger.lock().expect("ledger");
            for l in &over {
                match l.done {
                    Some(Outcome::Cancelled) => ledger.stats.cancelled += 1,
                    Some(Outcome::Failed(_)) => ledger.stats.failed += 1,
                    _ => ledger.stats.finished += 1,
                }
            }
        }
        self.publish();
        let now = Instant::now();
        for mut l in over {
            let finish = match l.done.take() {
                Some(Outcome::Finished(f)) => f,
                Some(Outcome::Failed(why)) => {
                    l.job.sink.send(Event::Failed(why));
                    continue;
                }
                _ => continue,
            };
            let rest = l.text.finish();
            if !rest.is_empty() {
                l.job.sink.send(Event::Text(rest));
            }
            l.job.sink.send(Event::Done(Summary {
                finish,
                prompt_tokens: l.job.req.prompt.len(),
                cached_tokens: l.cached,
                completion_tokens: l.out.len(),
                queued: l.admitted - l.job.arrived,
                first_token: l.first.unwrap_or(now) - l.job.arrived,
                total: now - l.job.arrived,
                preemptions: l.preemptions,
            }));
        }
        if let Some(e) = broken {
            // The caches are out of step with the bookkeeping: start them afresh.
            self.fail_all(&format!("freeing a sequence failed: {e}"));
        }
    }

    /// A sequence that stops running gives back its reservation; its slot stays resident for its
    /// prefix (with the prefix cache; a fork still reading its source's blocks, counting only its
    /// own) or is emptied.
    fn give_back(&mut self, l: &Live) -> Result<()> {
        let held = self.caches.len(l.slot);
        if self.prefix_cache && held > 0 {
            let tokens: Vec<u32> = l.history().copied().take(held).collect();
            let own = self.info.sequence_bytes(held).saturating_sub(l.borrowed());
            self.adm.park(l.slot, l.reserved, own, tokens, l.borrowed.map(|b| b.slot));
            return Ok(());
        }
        if let Some(b) = l.borrowed {
            self.adm.repay(b.slot);
        }
        // A slot others read is always parked (it holds what they read), except one that stopped
        // before holding anything: a request admitted to fork it then feeds itself.
        let emptied = self.caches.truncate(l.slot, 0);
        self.adm.release(l.slot, l.reserved);
        emptied
    }

    /// Grows the reservations of the sequences about to decode to what their next position takes,
    /// preempting the most recently arrived growing sequences (those not holding their worst
    /// case) while the budget cannot hold them all.
    fn grow(&mut self) -> Result<()> {
        loop {
            let extra: Vec<usize> = self
                .live
                .iter()
                .map(|l| {
                    let next = (self.caches.len(l.slot) + 1).min(self.info.max_context);
                    let decoding = l.fed == l.job.feed.len();
                    if decoding {
                        self.info.sequence_bytes(next).saturating_sub(l.reserved + l.borrowed())
                    } else {
                        0
                    }
                })
                .collect();
            let total: usize = extra.iter().sum();
            if total == 0 {
                return Ok(());
            }
            if let Some(evicted) = self.adm.grow(total) {
                for e in evicted {
                    self.caches.truncate(e, 0)?;
                }
                self.live.iter_mut().zip(extra).for_each(|(l, x)| l.reserved += x);
                return Ok(());
            }
            // Before anyone is preempted: a fork that alone reads a resident source takes over the
            // bytes it shares, and the source, which holds at least those, gives the rest back.
            let settled = (0..self.live.len()).find_map(|i| {
                let b = self.live[i].borrowed?;
                Some((i, b, self.adm.settle(b.slot, b.bytes)?))
            });
            if let Some((i, b, emptied)) = settled {
                for e in emptied {
                    self.caches.truncate(e, 0)?;
                }
                let l = &mut self.live[i];
                (l.reserved, l.borrowed) = (l.reserved + b.bytes, None);
                continue;
            }
            if self.live.len() == 1 {
                // Alone, a request always fits: its worst case was checked at submission.
                return Err(Error::Config("the KV budget cannot hold one sequence's next position".into()));
            }
            let growing = (0..self.live.len()).filter(|&i| {
                let l = &self.live[i];
                l.reserved + l.borrowed() < l.job.need
            });
            let newest = growing.max_by_key(|&i| self.live[i].job.arrived).expect("a sequence that needs more grows");
            self.preempt(newest)?;
        }
    }

    /// Takes a running sequence out (its memory given back) and queues it first, to feed its
    /// prompt and output again and go on where it stopped.
    fn preempt(&mut self, i: usize) -> Result<()> {
        self.back_to_queue(i, true)
    }

    /// Takes live `i` out (its memory given back) and queues it first; a preempted one counts.
    fn back_to_queue(&mut self, i: usize, preempted: bool) -> Result<()> {
        let l = self.live.remove(i);
        let given = self.give_back(&l);
        let Live { mut job, out, sampler, text, cached, admitted, first, scored, preemptions, .. } = l;
        job.feed = job.req.prompt.iter().chain(&out).copied().collect();
        let cached = (preempted || preemptions > 0).then_some(cached);
        let preemptions = preemptions + usize::from(preempted);
        job.carry = Some(Carry { scored, out, sampler, text, cached, admitted, first, preemptions });
        job.fork_discount &= preempted;
        let bytes = self.admission_bytes(&job);
        self.adm.push_front(job, bytes);
        if preempted {
            self.ledger.lock().expect("ledger").stats.preempted += 1;
        }
        given
    }

    /// Ends every running request with `why` and rebuilds the caches (a failed step may leave
    /// them half-appended).
    fn fail_all(&mut self, why: &str) {
        let live = std::mem::take(&mut self.live);
        let resident = self.adm.forget_resident();
        if live.is_empty() && resident.is_empty() {
            return;
        }
        let mut ledger = self.ledger.lock().expect("ledger");
        for mut l in live {
            l.job.sink.send(Event::Failed(why.to_string()));
            self.adm.release(l.slot, l.reserved);
            ledger.stats.failed += 1;
        }
        drop(ledger);
        match self.cache.build_batch(self.model.model(), self.caches.slots()) {
            Ok(c) => self.caches = c,
            Err(e) => {
                eprintln!("veloq engine: rebuilding the caches failed ({e}); stopping");
                self.stop.store(true, Ordering::Relaxed);
            }
        }
    }

    /// The stats of the moment: queue, running sequences, KV memory measured from the caches.
    fn publish(&self) {
        let resident = self.caches.resident_bytes();
        let mut ledger = self.ledger.lock().expect("ledger");
        let s = &mut ledger.stats;
        s.running = self.live.len();
        s.queued = self.adm.waiting();
        s.peak_running = s.peak_running.max(s.running);
        s.kv_reserved_bytes = self.adm.reserved();
        (s.resident_prefixes, s.kv_prefix_bytes) = self.adm.resident();
        s.kv_resident_bytes = resident;
        s.kv_borrowed_bytes = self.live.iter().map(Live::borrowed).sum();
        // Storage that grows with its sequences is measured; storage reserved per slot is in use
        // for every slot that holds a sequence.
        s.kv_sequence_bytes = match self.info.sequence_bytes(0) {
            0 => resident.saturating_sub(self.empty_bytes),
            slot => slot * (self.live.len() + s.resident_prefixes),
        };
    }
}

#[cfg(test)]
mod tests;
