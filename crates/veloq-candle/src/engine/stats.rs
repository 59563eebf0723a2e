//! What the engine reports while it runs: counters, the KV memory in use, and recent speeds.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Seconds of recent steps the speeds are averaged over.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// A snapshot of the engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Sequences admitted and not finished.
    pub running: usize,
    /// Requests waiting for KV memory or a slot.
    pub queued: usize,
    /// Most sequences that ran at once.
    pub peak_running: usize,
    /// Requests that ended normally (a stop, the token limit or the context).
    pub finished: u64,
    /// Requests whose client went away (queued or running).
    pub cancelled: u64,
    /// Requests refused at submission (context, budget, settings).
    pub rejected: u64,
    /// Requests that failed inside the engine.
    pub failed: u64,
    /// Times a running sequence was preempted to make room (each resumed later).
    pub preempted: u64,
    /// Prompt tokens fed to the model.
    pub prompt_tokens: u64,
    /// Requests that started from a resident sequence's prefix.
    pub prefix_hits: u64,
    /// Requests that started from a copy of a running or resident sequence's prefix (the choices
    /// of one prompt, a system prompt that other requests share).
    pub forks: u64,
    /// Prompt tokens those requests and the prefix hits found resident (not fed again).
    pub cached_prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Forward passes run.
    pub steps: u64,
    /// Bytes the admitted sequences reserved (their worst cases).
    pub kv_reserved_bytes: usize,
    /// Finished sequences kept resident for their prefixes.
    pub resident_prefixes: usize,
    /// Bytes those hold (counted in the budget; given up when a request needs the room).
    pub kv_prefix_bytes: usize,
    /// Bytes the sequences' storage holds now: measured from the caches where storage grows with
    /// the sequences (the CPU), the running slots' reservations where it is reserved (GPUs).
    pub kv_sequence_bytes: usize,
    /// Bytes the caches hold now, shared tables included, measured.
    pub kv_resident_bytes: usize,
    /// Bytes running forks read from their source's storage instead of a copy of their own
    /// (counted once, in the source's reservation or resident bytes).
    pub kv_borrowed_bytes: usize,
    /// Prompt tokens per second over the last seconds of work.
    pub prefill_tok_s: f64,
    /// Generated tokens per second over the last seconds of work.
    pub decode_tok_s: f64,
}

/// The engine's running account: a [`Stats`] plus the recent steps its speeds come from.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    pub stats: Stats,
    /// (end of step, its duration, prompt tokens, generated tokens), newest last.
    recent: VecDeque<(Instant, Duration, usize, usize)>,
}

impl Ledger {
    /// Records a forward pass that took `took` and fed `prompt` prompt tokens and sampled
    /// `generated` tokens.
    pub fn step(&mut self, took: Duration, prompt: usize, generated: usize) {
        let now = Instant::now();
        self.stats.steps += 1;
        self.stats.prompt_tokens += prompt as u64;
        self.stats.generated_tokens += generated as u64;
        self.recent.push_back((now, took, prompt, generated));
        while self.recent.front().is_some_and(|&(t, ..)| now.duration_since(t) > RATE_WINDOW) {
            self.recent.pop_front();
        }
    }

    /// The stats with speeds over the recent window: tokens over the wall time from the start of
    /// the window's first step to now (idle time counts, so an idle engine's speeds fall to 0).
    pub fn snapshot(&self) -> Stats {
        let now = Instant::now();
        let mut s = self.stats.clone();
        let live: Vec<_> = self.recent.iter().filter(|&&(t, ..)| now.duration_since(t) <= RATE_WINDOW).collect();
        if let Some(&&(t0, took0, ..)) = live.first() {
            let secs = (now.duration_since(t0) + took0).as_secs_f64().max(1e-6);
            s.prefill_tok_s = live.iter().map(|r| r.2).sum::<usize>() as f64 / secs;
            s.decode_tok_s = live.iter().map(|r| r.3).sum::<usize>() as f64 / secs;
        }
        s
    }
}
