//! The storage policy of every cache, written once and device-free: where each sequence's
//! positions live (f16 sink rows, codes, an f16 ring of recent rows, or rows a step brought that
//! wait for its commit), which rows a step's new keys and values go to, when rows are coded, and
//! what a truncation undoes. Backends execute the [`Move`]s it plans and attend over the
//! [`SeqView`]s it describes; they never decide.
//!
//! Per sequence, positions in order: the sink (the first `sink` positions, f16 for good), the coded
//! span (or, on sliding-window layers, positions dropped for good), the ring (recent rows, f16),
//! then the rows of the current step that did not fit the ring ("staged": the backend keeps the
//! step's input until [`Residency::commit`]). Codes are written only at a commit, from rows every
//! query has already attended, so codes are always older than every query: attention over them
//! needs no mask.

use std::ops::Range;

use super::step::Step;
use crate::error::{Error, Result};

/// How a layer keeps positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Every position in f16 rows (the fp16 baseline).
    Dense {
        /// Positions one sequence may reach.
        capacity: usize,
    },
    /// A sliding-window layer: a query sees the `window` most recent positions, itself included;
    /// f16 rows, only the last `window − 1` kept between steps.
    Sliding {
        /// Positions a query sees.
        window: usize,
        /// Positions one sequence may reach.
        capacity: usize,
    },
    /// A coded cache: `sink` f16 positions, then codes, then `keep`–`keep + block − 1` recent f16
    /// positions (a ring of `keep + block` rows), coded `block` at a time.
    Coded {
        /// First positions kept as f16 rows for good (attention sinks).
        sink: usize,
        /// Recent positions that stay f16 after a commit.
        keep: usize,
        /// Positions coded at a time (whole blocks, aligned after the sink).
        block: usize,
        /// Positions one sequence may reach.
        capacity: usize,
    },
}

/// What one sequence's storage holds: see [`Policy::footprint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// f16 storage rows touched (sink and ring; every position for dense caches).
    pub rows: usize,
    /// Coded positions.
    pub coded: usize,
}

/// When rows become codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coding {
    /// Recent positions that stay f16 after a commit.
    pub keep: usize,
    /// Positions coded at a time (codes are written in whole blocks, aligned after the sink).
    pub block: usize,
}

impl Policy {
    /// A coded cache: `sink` f16 positions, then codes, then `keep`–`keep + block − 1` recent f16
    /// positions.
    pub fn coded(sink: usize, keep: usize, block: usize, capacity: usize) -> Self {
        Policy::Coded { sink, keep, block, capacity }
    }

    /// Every position in f16 rows (the fp16 baseline).
    pub fn dense(capacity: usize) -> Self {
        Policy::Dense { capacity }
    }

    /// A sliding-window layer: only the `window` most recent positions are ever attended, so only
    /// the last `window − 1` are kept between steps.
    pub fn sliding(window: usize, capacity: usize) -> Self {
        Policy::Sliding { window, capacity }
    }

    /// First positions kept as f16 rows for good (0 unless coded).
    pub fn sink(&self) -> usize {
        match *self {
            Policy::Coded { sink, .. } => sink,
            _ => 0,
        }
    }

    /// f16 rows after the sink, used as a ring (every position for dense caches).
    pub fn ring(&self) -> usize {
        match *self {
            Policy::Dense { capacity } => capacity,
            Policy::Sliding { window, capacity } => window.min(capacity),
            Policy::Coded { keep, block, .. } => keep + block,
        }
    }

    /// Positions one sequence may reach.
    pub fn capacity(&self) -> usize {
        match *self {
            Policy::Dense { capacity } | Policy::Sliding { capacity, .. } | Policy::Coded { capacity, .. } => capacity,
        }
    }

    /// When rows become codes (coded caches).
    pub fn coding(&self) -> Option<Coding> {
        match *self {
            Policy::Coded { keep, block, .. } => Some(Coding { keep, block }),
            _ => None,
        }
    }

    /// The window of a sliding-window layer.
    pub fn window(&self) -> Option<usize> {
        match *self {
            Policy::Sliding { window, .. } => Some(window),
            _ => None,
        }
    }

    /// f16 rows each sequence holds (sink then ring).
    pub fn rows(&self) -> usize {
        self.sink() + self.ring()
    }

    /// Where a sequence grown from empty to `positions` keeps them once its steps are committed:
    /// the storage rows it has touched and its coded positions. What a slot's storage must hold,
    /// whatever steps brought the positions (commits code whole blocks beyond the recent rows).
    pub fn footprint(&self, positions: usize) -> Footprint {
        let positions = positions.min(self.capacity());
        let coded = match self.coding() {
            Some(c) => positions.saturating_sub(self.sink() + c.keep) / c.block * c.block,
            None => 0,
        };
        Footprint { rows: positions.min(self.rows()), coded }
    }

    fn check(&self) -> Result<()> {
        let bad = |why: &str| Err(Error::Config(format!("cache policy {self:?}: {why}")));
        match *self {
            _ if self.capacity() == 0 => bad("the capacity must be positive"),
            Policy::Coded { block: 0, .. } => bad("a coded cache needs a positive block"),
            Policy::Sliding { window: 0, .. } => bad("a sliding window needs a positive window"),
            _ => Ok(()),
        }?;
        Ok(())
    }
}

/// Rows of one sequence addressed as a ring: the `i`-th is row `base + (start + i) mod wrap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRun {
    /// First row of the run's region (0 for the sink, the sink size for the ring).
    pub base: usize,
    /// Offset of the run's first row within its region.
    pub start: usize,
    /// Rows of the region (indices wrap at it).
    pub wrap: usize,
}

impl RowRun {
    /// Row of the `i`-th position of the run.
    pub fn row(&self, i: usize) -> usize {
        self.base + (self.start + i) % self.wrap
    }

    /// `n` rows from the start as at most two runs of consecutive rows: (first row, count).
    pub fn parts(&self, n: usize) -> impl Iterator<Item = (usize, usize)> {
        let first = n.min(self.wrap - self.start % self.wrap);
        [(self.row(0), first), (self.base, n - first)].into_iter().filter(|p| p.1 > 0)
    }
}

/// Rows `src..src + n` of the step's input (packed) into the sequence's rows `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Put {
    /// Sequence slot.
    pub slot: usize,
    /// First input row (packed, of the step).
    pub src: usize,
    /// Rows.
    pub n: usize,
    /// Where they go.
    pub to: RowRun,
}

/// Codes positions `at..at + ring.1 + input.1` of the coded span: the oldest `ring.1` ring rows
/// (from `ring.0`), then input rows `input.0..`. `at` and the length are multiples of the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quantize {
    /// Sequence slot.
    pub slot: usize,
    /// First coded position written (after the sink).
    pub at: usize,
    /// Ring rows coded first: their run, from the oldest, and how many.
    pub ring: (RowRun, usize),
    /// Input rows coded after them: first packed row, how many.
    pub input: (usize, usize),
}

impl Quantize {
    /// Positions coded.
    pub fn len(&self) -> usize {
        self.ring.1 + self.input.1
    }
    /// Whether nothing is coded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Decodes coded positions `keep..keep + n` back into rows `to`, then drops every code from
/// `keep` on (a truncation that cuts into the codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restore {
    /// Sequence slot.
    pub slot: usize,
    /// Coded positions kept.
    pub keep: usize,
    /// Positions after them decoded back into rows.
    pub n: usize,
    /// Rows they go to.
    pub to: RowRun,
}

/// One change to a backend's storage, in the order it must happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Move {
    /// Rows from the step's input.
    Put(Put),
    /// Rows into codes.
    Quantize(Quantize),
    /// Codes back into rows.
    Restore(Restore),
    /// Storage rows of `slot` from `rows` on hold nothing any more (a truncation, a freed slot):
    /// a backend that allocates as sequences grow may give them back.
    Release {
        /// Sequence slot.
        slot: usize,
        /// Rows still in use, from the first.
        rows: usize,
    },
}

/// What one sequence's queries of a step attend: its sink rows (row `i` holds position `i`), its
/// coded span (positions `n_sink..n_sink + coded`), its ring rows, and the step's own rows still
/// in the input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqView {
    /// Sequence slot.
    pub slot: usize,
    /// Packed rows of the step (queries, and the input's keys and values).
    pub queries: Range<usize>,
    /// Position of the first query.
    pub start: usize,
    /// Sink rows holding positions (row `i` holds position `i`).
    pub n_sink: usize,
    /// Coded positions, `n_sink..n_sink + coded`.
    pub coded: usize,
    /// Ring rows from the oldest, `ring_len` of them, at positions `ring_pos0..`.
    pub ring: RowRun,
    /// Ring rows holding positions.
    pub ring_len: usize,
    /// Position of the oldest ring row.
    pub ring_pos0: usize,
    /// Input rows `src..src + n` at positions `pos0..`.
    pub staged: Option<Staged>,
    /// Sliding-window layers: positions a query sees, itself included.
    pub window: Option<usize>,
}

impl SeqView {
    /// Position of query `i`.
    pub fn query_pos(&self, i: usize) -> usize {
        self.start + i
    }

    /// Every f16 row the queries may see, as runs of consecutive rows holding consecutive
    /// positions, oldest first: the sink, the ring (in at most two runs where it wraps), then the
    /// step's own rows still in the input. Codes are not rows: see `coded`.
    pub fn row_spans(&self) -> Vec<RowSpan> {
        let mut out = Vec::with_capacity(4);
        if self.n_sink > 0 {
            out.push(RowSpan { from: RowSource::Stored(0), n: self.n_sink, pos0: 0 });
        }
        let mut pos = self.ring_pos0;
        for (first, n) in self.ring.parts(self.ring_len) {
            out.push(RowSpan { from: RowSource::Stored(first), n, pos0: pos });
            pos += n;
        }
        if let Some(s) = self.staged {
            out.push(RowSpan { from: RowSource::Input(s.src), n: s.n, pos0: s.pos0 });
        }
        out
    }
}

/// Where a run of rows is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSource {
    /// The sequence's stored rows, from this row.
    Stored(usize),
    /// The step's input, from this packed row.
    Input(usize),
}

/// `n` consecutive rows holding positions `pos0..pos0 + n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSpan {
    /// Where the rows are.
    pub from: RowSource,
    /// Rows.
    pub n: usize,
    /// Position of the first.
    pub pos0: usize,
}

/// A step's rows that wait in the input for the commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// First packed input row.
    pub src: usize,
    /// Rows.
    pub n: usize,
    /// Position of the first.
    pub pos0: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SeqState {
    n_sink: usize,
    /// Coded positions (coded caches) or positions dropped for good (sliding windows).
    past: usize,
    ring_head: usize,
    ring_len: usize,
    staged: usize,
    staged_src: usize,
}

impl SeqState {
    fn len(&self) -> usize {
        self.n_sink + self.past + self.ring_len + self.staged
    }
}

/// The positions of every sequence of one layer, and the plans that keep them.
#[derive(Clone, Debug)]
pub struct Residency {
    policy: Policy,
    seqs: Vec<SeqState>,
    /// The step appended and not yet committed.
    pending: Option<Step>,
}

impl Residency {
    /// Bookkeeping for `slots` empty sequences under `policy` (checked).
    pub fn new(policy: Policy, slots: usize) -> Result<Self> {
        policy.check()?;
        if slots == 0 {
            return Err(Error::Config("a cache needs at least one sequence slot".into()));
        }
        Ok(Self { policy, seqs: vec![SeqState::default(); slots], pending: None })
    }

    /// How positions are kept.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
    /// Sequence slots.
    pub fn slots(&self) -> usize {
        self.seqs.len()
    }

    /// Positions the sequence in `slot` holds.
    pub fn len(&self, slot: usize) -> usize {
        self.seqs.get(slot).map_or(0, SeqState::len)
    }

    /// Coded positions of `slot` (0 for dense caches).
    pub fn coded(&self, slot: usize) -> usize {
        match (self.policy.coding(), self.seqs.get(slot)) {
            (Some(_), Some(s)) => s.past,
            _ => 0,
        }
    }

    fn ring_run(&self, s: &SeqState, from: usize) -> RowRun {
        RowRun { base: self.policy.sink(), start: (s.ring_head + from) % self.policy.ring(), wrap: self.policy.ring() }
    }

    fn sink_run(&self, at: usize) -> RowRun {
        RowRun { base: 0, start: at, wrap: self.policy.sink().max(1) }
    }

    /// Checks `step` against the sequences (slots, positions, capacity) without changing anything.
    fn check_step(&self, step: &Step) -> Result<()> {
        if self.pending.is_some() {
            return Err(Error::Config(
                "a step was appended and not committed: call commit before the next append".into(),
            ));
        }
        for s in step.seqs() {
            let Some(state) = self.seqs.get(s.slot) else {
                return Err(Error::Shape(format!(
                    "slot {} of a cache with {} sequence slots",
                    s.slot,
                    self.seqs.len()
                )));
            };
            if s.start != state.len() {
                return Err(Error::Position { slot: s.slot, expected: state.len(), got: s.start });
            }
            if s.start + s.len > self.policy.capacity() {
                return Err(Error::ContextOverflow { requested: s.start + s.len, max: self.policy.capacity() });
            }
        }
        Ok(())
    }

    /// Plans a step's append: its rows go to the sink while it fills, then to the ring where they
    /// fit; the rest wait in the input (staged) until [`commit`](Self::commit). Nothing changes
    /// when the step is refused.
    pub fn append(&mut self, step: &Step) -> Result<Vec<Put>> {
        self.check_step(step)?;
        let p = self.policy;
        let mut puts = Vec::new();
        for (i, s) in step.seqs().iter().enumerate() {
            let src = step.rows(i).start;
            let mut st = self.seqs[s.slot];
            let to_sink = if st.len() < p.sink() { (p.sink() - st.n_sink).min(s.len) } else { 0 };
            if to_sink > 0 {
                puts.push(Put { slot: s.slot, src, n: to_sink, to: self.sink_run(st.n_sink) });
                st.n_sink += to_sink;
            }
            if let Some(w) = p.window() {
                // The step's first query sees from s.start + 1 − w on: older rows go for good.
                let drop = (s.start + 1).saturating_sub(w).saturating_sub(st.n_sink + st.past).min(st.ring_len);
                st.past += drop;
                st.ring_head = (st.ring_head + drop) % p.ring();
                st.ring_len -= drop;
            }
            let rest = s.len - to_sink;
            if rest > 0 && st.ring_len + rest <= p.ring() {
                puts.push(Put { slot: s.slot, src: src + to_sink, n: rest, to: self.ring_run(&st, st.ring_len) });
                st.ring_len += rest;
            } else if rest > 0 {
                (st.staged, st.staged_src) = (rest, src + to_sink);
            }
            self.seqs[s.slot] = st;
        }
        self.pending = Some(step.clone());
        Ok(puts)
    }

    /// What each sequence of the appended `step` attends.
    pub fn views(&self, step: &Step) -> Result<Vec<SeqView>> {
        if self.pending.as_ref() != Some(step) {
            return Err(Error::Config("attend takes the step that was just appended".into()));
        }
        Ok(step
            .seqs()
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let st = &self.seqs[s.slot];
                let ring_pos0 = st.n_sink + st.past;
                SeqView {
                    slot: s.slot,
                    queries: step.rows(i),
                    start: s.start,
                    n_sink: st.n_sink,
                    coded: if self.policy.coding().is_some() { st.past } else { 0 },
                    ring: self.ring_run(st, 0),
                    ring_len: st.ring_len,
                    ring_pos0,
                    staged: (st.staged > 0).then_some(Staged {
                        src: st.staged_src,
                        n: st.staged,
                        pos0: ring_pos0 + st.ring_len,
                    }),
                    window: self.policy.window(),
                }
            })
            .collect())
    }

    /// Whether a step is appended and not committed.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Settles the appended step (its staged rows into codes and the ring) and codes what the ring
    /// holds beyond the policy's recent rows; sliding windows drop what no later query sees.
    pub fn commit(&mut self) -> Vec<Move> {
        let p = self.policy;
        let Some(step) = self.pending.take() else { return Vec::new() };
        let mut moves = Vec::new();
        for s in step.seqs() {
            let mut st = self.seqs[s.slot];
            let slot = s.slot;
            match p {
                Policy::Coded { keep, block, .. } => {
                    let c = Coding { keep, block };
                    let total = st.ring_len + st.staged;
                    let n_code = if total >= c.keep + c.block { (total - c.keep) / c.block * c.block } else { 0 };
                    if n_code > 0 {
                        let from_ring = n_code.min(st.ring_len);
                        let from_new = n_code - from_ring;
                        moves.push(Move::Quantize(Quantize {
                            slot,
                            at: st.past,
                            ring: (self.ring_run(&st, 0), from_ring),
                            input: (st.staged_src, from_new),
                        }));
                        st.ring_head = (st.ring_head + from_ring) % p.ring();
                        st.ring_len -= from_ring;
                        st.past += n_code;
                        st.staged -= from_new;
                        st.staged_src += from_new;
                    }
                }
                Policy::Sliding { window: w, .. } => {
                    let keep = w - 1;
                    if st.staged >= keep {
                        // The step's last `keep` rows are all a later query sees.
                        let skip = st.staged - keep;
                        st.past += st.ring_len + skip;
                        (st.ring_head, st.ring_len) = (0, 0);
                        st.staged -= skip;
                        st.staged_src += skip;
                    } else {
                        let drop = (st.ring_len + st.staged).saturating_sub(keep).min(st.ring_len);
                        st.past += drop;
                        st.ring_head = (st.ring_head + drop) % p.ring();
                        st.ring_len -= drop;
                    }
                }
                Policy::Dense { .. } => {}
            }
            if st.staged > 0 {
                moves.push(Move::Put(Put {
                    slot,
                    src: st.staged_src,
                    n: st.staged,
                    to: self.ring_run(&st, st.ring_len),
                }));
                st.ring_len += st.staged;
                st.staged = 0;
            }
            self.seqs[s.slot] = st;
        }
        moves
    }

    /// Plans keeping the first `len` positions of `slot`. A coded sequence is left as growth to
    /// `len` leaves it ([`Policy::footprint`]), so that its storage is what the budget counts for
    /// its length: codes beyond that are decoded back into the ring (those positions were
    /// quantized, so they come back approximately). A sliding window cannot bring back rows it
    /// dropped. Nothing changes when refused.
    pub fn truncate(&mut self, slot: usize, len: usize) -> Result<Vec<Move>> {
        if self.pending.is_some() {
            return Err(Error::Config("truncate after commit, not between append and commit".into()));
        }
        let p = self.policy;
        let Some(&st) = self.seqs.get(slot) else {
            return Err(Error::Shape(format!("slot {slot} of a cache with {} sequence slots", self.seqs.len())));
        };
        let now = st.len();
        if len > now {
            return Err(Error::Config(format!("truncate slot {slot} to {len} positions: it holds {now}")));
        }
        if len == now {
            return Ok(Vec::new());
        }
        let mut moves = Vec::new();
        let mut st = st;
        if len == 0 {
            if p.coding().is_some() && st.past > 0 {
                moves.push(Move::Restore(Restore { slot, keep: 0, n: 0, to: self.ring_run(&st, 0) }));
            }
            st = SeqState::default();
        } else if len >= st.n_sink + st.past {
            if let Some(w) = p.window() {
                // The next query, at `len`, must find its window − 1 predecessors.
                if (len + 1).saturating_sub(w) < st.past {
                    return Err(Error::Config(format!(
                        "cannot truncate a sliding-window layer from {now} to {len} positions: it no longer holds them"
                    )));
                }
            }
            st.ring_len = len - st.n_sink - st.past;
            // Codes past what growth to `len` codes go back into rows, before the ring's oldest.
            let target = p.footprint(len).coded;
            if p.coding().is_some() && target < st.past {
                let (m, ring) = (st.past - target, p.ring());
                st.ring_head = (st.ring_head + ring - m % ring) % ring;
                st.ring_len += m;
                st.past = target;
                moves.push(Move::Restore(Restore { slot, keep: target, n: m, to: self.ring_run(&st, 0) }));
            }
        } else if len <= st.n_sink {
            if st.past > 0 {
                moves.push(Move::Restore(Restore { slot, keep: 0, n: 0, to: self.ring_run(&st, 0) }));
            }
            st = SeqState { n_sink: len, ..SeqState::default() };
        } else {
            if p.coding().is_none() {
                return Err(Error::Config(format!(
                    "cannot truncate slot {slot} to {len}: positions before {} are gone",
                    st.n_sink + st.past
                )));
            }
            // What growth to `len` codes stays coded; the rest of the kept positions become rows.
            let into = len - st.n_sink;
            let keep = p.footprint(len).coded;
            st.ring_head = 0;
            st.ring_len = into - keep;
            moves.push(Move::Restore(Restore { slot, keep, n: into - keep, to: self.ring_run(&st, 0) }));
            st.past = keep;
        }
        // Dense rows hold position i in row i, so a cut frees every row past it; a ring is in
        // use wherever its head went, so only an empty sequence frees it.
        let rows = match (len, p) {
            (0, _) => 0,
            (_, Policy::Dense { .. }) => len,
            _ => p.rows(),
        };
        if rows < p.rows() {
            moves.push(Move::Release { slot, rows });
        }
        self.seqs[slot] = st;
        Ok(moves)
    }

    /// Makes the empty `to` hold what `from` holds, at the same rows: returns the storage
    /// `from` uses (its first `rows` rows and `coded` codes), which the backend copies. Sequences
    /// that share a prompt then prefill it once. Nothing changes when refused.
    pub fn fork(&mut self, from: usize, to: usize) -> Result<Footprint> {
        if self.pending.is_some() {
            return Err(Error::Config("fork after commit, not between append and commit".into()));
        }
        let slots = self.seqs.len();
        let (Some(&st), Some(dst)) = (self.seqs.get(from), self.seqs.get(to)) else {
            return Err(Error::Shape(format!("fork slot {from} into {to}: the cache has {slots} sequence slots")));
        };
        if from == to || dst.len() > 0 {
            return Err(Error::Config(format!(
                "fork slot {from} into {to}: the destination must be another, empty slot (it holds {})",
                dst.len()
            )));
        }
        // Dense rows hold position i in row i; a ring that never moved its head uses its first
        // rows; otherwise any ring row may be in use.
        let rows = match self.policy {
            Policy::Dense { .. } => st.len(),
            _ if st.past == 0 && st.ring_head == 0 => st.n_sink + st.ring_len,
            p => p.rows(),
        };
        self.seqs[to] = st;
        Ok(Footprint { rows, coded: self.coded(from) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::step::SeqStep;

    /// A stand-in backend that stores positions instead of keys: rows and codes hold the position
    /// they were given, so every view can be checked against the truth.
    struct Shadow {
        rows: Vec<Vec<Option<usize>>>,
        codes: Vec<Vec<usize>>,
        input: Vec<usize>,
    }

    impl Shadow {
        fn apply_put(&mut self, p: &Put) {
            for i in 0..p.n {
                self.rows[p.slot][p.to.row(i)] = Some(self.input[p.src + i]);
            }
        }
        fn apply(&mut self, m: &Move, block: usize) {
            match m {
                Move::Put(p) => self.apply_put(p),
                Move::Quantize(q) => {
                    assert_eq!(q.at, self.codes[q.slot].len(), "codes are written in order");
                    assert_eq!((q.at % block, q.len() % block), (0, 0), "whole, aligned blocks");
                    for i in 0..q.ring.1 {
                        let r = q.ring.0.row(i);
                        self.codes[q.slot].push(self.rows[q.slot][r].take().expect("coding an empty ring row"));
                    }
                    for i in 0..q.input.1 {
                        self.codes[q.slot].push(self.input[q.input.0 + i]);
                    }
                }
                Move::Restore(r) => {
                    for i in 0..r.n {
                        self.rows[r.slot][r.to.row(i)] = Some(self.codes[r.slot][r.keep + i]);
                    }
                    self.codes[r.slot].truncate(r.keep);
                }
                // Released rows are forgotten: a view that still reached one would find nothing.
                Move::Release { slot, rows } => self.rows[*slot][*rows..].iter_mut().for_each(|r| *r = None),
            }
        }
        /// Every position a view says is reachable, with where it is.
        fn visible(&self, v: &SeqView) -> Vec<usize> {
            let mut out: Vec<usize> = (0..v.n_sink).map(|r| self.rows[v.slot][r].expect("sink row")).collect();
            out.extend(&self.codes[v.slot][..v.coded]);
            for i in 0..v.ring_len {
                let pos = self.rows[v.slot][v.ring.row(i)].expect("ring row");
                assert_eq!(pos, v.ring_pos0 + i, "ring rows in position order");
                out.push(pos);
            }
            if let Some(s) = v.staged {
                out.extend((0..s.n).map(|i| self.input[s.src + i]));
                assert_eq!(self.input[s.src], s.pos0);
            }
            out
        }
    }

    fn xorshift(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    /// A sequence grown from empty by random steps holds, after every commit, what its policy's
    /// footprint says: that many coded positions, and no storage row past the footprint's rows.
    #[test]
    fn footprint_is_what_growth_leaves() {
        let mut seed = crate::testing::fresh_seed() | 1;
        let start_seed = seed;
        for policy in
            [Policy::coded(4, 16, 8, 3000), Policy::coded(0, 5, 3, 3000), Policy::dense(3000), Policy::sliding(7, 3000)]
        {
            let mut r = Residency::new(policy, 1).unwrap();
            let mut touched = 0;
            while r.len(0) < 2900 {
                let roll = xorshift(&mut seed) as usize;
                let len = if roll.is_multiple_of(3) { 1 + (roll >> 8) % 200 } else { 1 }.min(3000 - r.len(0));
                let step = Step::single(0, r.len(0), len).unwrap();
                let puts = r.append(&step).unwrap();
                let moves = r.commit();
                let rows =
                    puts.iter().chain(moves.iter().filter_map(|m| if let Move::Put(p) = m { Some(p) } else { None }));
                for p in rows {
                    touched = touched.max((0..p.n).map(|i| p.to.row(i) + 1).max().unwrap_or(0));
                }
                let f = policy.footprint(r.len(0));
                assert_eq!(r.coded(0), f.coded, "seed {start_seed}: {policy:?} at {}", r.len(0));
                assert!(touched <= f.rows, "seed {start_seed}: row {touched} touched, footprint {f:?}");
            }
        }
    }

    /// Random ragged steps, commits, truncations and forks on three slots: every view reaches exactly the
    /// positions its queries need (all before them, or the window), codes stay older than every
    /// query, coded caches keep `keep..keep + block` recent rows, and rows never hold stale data.
    #[test]
    fn views_reach_exactly_what_queries_need() {
        let mut seed = crate::testing::fresh_seed() | 1;
        let start_seed = seed;
        for policy in [
            Policy::coded(4, 16, 8, 8000),
            Policy::coded(0, 5, 3, 8000),
            Policy::dense(8000),
            Policy::sliding(7, 8000),
            Policy::coded(2, 8, 8, 8000),
        ] {
            let mut r = Residency::new(policy, 3).unwrap();
            let block = policy.coding().map_or(1, |c| c.block);
            let mut sh =
                Shadow { rows: vec![vec![None; policy.rows()]; 3], codes: vec![Vec::new(); 3], input: Vec::new() };
            let (mut restores, mut staged, mut most_coded, mut forks) = (0, 0, 0, 0);
            for round in 0..300 {
                let roll = xorshift(&mut seed);
                if roll.is_multiple_of(11) {
                    // A fork: a slot emptied, then given what another holds (the copy of the
                    // storage the fork names, as a backend makes it).
                    let from = (roll as usize >> 8) % 3;
                    let to = (from + 1 + (roll as usize >> 12) % 2) % 3;
                    r.truncate(to, 0).unwrap().iter().for_each(|m| sh.apply(m, block));
                    let held = r.fork(from, to).unwrap();
                    assert_eq!(r.len(to), r.len(from));
                    assert!(r.fork(from, to).is_err() || r.len(from) == 0, "a fork needs an empty destination");
                    for row in 0..held.rows {
                        sh.rows[to][row] = sh.rows[from][row];
                    }
                    sh.codes[to] = sh.codes[from][..held.coded].to_vec();
                    forks += usize::from(r.len(from) > 0);
                    continue;
                }
                if roll.is_multiple_of(13) {
                    let slot = (roll as usize >> 8) % 3;
                    let len = r.len(slot);
                    let to = if len == 0 { 0 } else { (roll as usize >> 16) % (len + 1) };
                    match r.truncate(slot, to) {
                        Ok(moves) => {
                            restores += moves.iter().filter(|m| matches!(m, Move::Restore(x) if x.n > 0)).count();
                            moves.iter().for_each(|m| sh.apply(m, block));
                            assert_eq!(
                                r.coded(slot),
                                policy.footprint(to).coded,
                                "seed {start_seed}: a cut to {to} codes what growth to it codes ({policy:?})"
                            );
                        }
                        Err(_) => assert!(
                            policy.window().is_some(),
                            "seed {start_seed}: only sliding windows refuse truncations"
                        ),
                    }
                    continue;
                }
                let n_seqs = 1 + (roll as usize >> 4) % 3;
                let seqs: Vec<SeqStep> = (0..n_seqs)
                    .map(|i| {
                        let slot = (i + (roll as usize >> 10)) % 3;
                        let len = if (roll >> (20 + i)) & 1 == 0 { 1 } else { 1 + (xorshift(&mut seed) as usize) % 40 };
                        SeqStep { slot, start: r.len(slot), len: len.min(policy.capacity() - r.len(slot)).max(1) }
                    })
                    .collect();
                if seqs.iter().any(|s| s.start + s.len > policy.capacity()) {
                    break;
                }
                let step = Step::new(seqs).unwrap();
                sh.input = step.positions().iter().map(|&p| p as usize).collect();
                let puts = r.append(&step).unwrap();
                puts.iter().for_each(|p| sh.apply_put(p));
                for v in r.views(&step).unwrap() {
                    staged += usize::from(v.staged.is_some());
                    most_coded = most_coded.max(v.coded);
                    let mut seen = sh.visible(&v);
                    assert!(
                        seen.windows(2).all(|w| w[0] < w[1]),
                        "seed {start_seed} round {round}: out of order {seen:?}"
                    );
                    seen.sort_unstable();
                    let last = v.query_pos(v.queries.len() - 1);
                    let first_needed = policy.window().map_or(0, |w| (v.start + 1).saturating_sub(w));
                    let want: Vec<usize> = (first_needed..=last).collect();
                    let from = seen.partition_point(|&p| p < first_needed);
                    assert_eq!(
                        &seen[from..],
                        &want[..],
                        "seed {start_seed} round {round} policy {policy:?}: view {v:?}"
                    );
                    assert!(policy.window().is_some() || from == 0, "non-sliding caches keep everything");
                    let coded = &sh.codes[v.slot][..v.coded];
                    assert!(coded.iter().all(|&p| p < v.start), "codes older than every query");
                }
                for m in r.commit() {
                    sh.apply(&m, block);
                }
                for s in step.seqs() {
                    let st = r.seqs[s.slot];
                    if let Some(c) = policy.coding() {
                        assert!(st.ring_len < c.keep + c.block, "ring after a commit: {st:?}");
                        assert_eq!(sh.codes[s.slot].len(), st.past);
                    }
                    if let Some(w) = policy.window() {
                        assert!(st.ring_len < w, "sliding ring after a commit: {st:?}");
                    }
                    assert_eq!(st.staged, 0);
                }
            }
            // The run reached what it tests: forks, steps too long for the ring, codes, cuts into codes.
            assert!(forks > 0, "seed {start_seed}: no fork under {policy:?}");
            assert!(
                staged > 0 || policy.coding().is_none() && policy.window().is_none(),
                "seed {start_seed}: no staged rows under {policy:?}"
            );
            if policy.coding().is_some() {
                assert!(
                    most_coded > 100 && restores > 0,
                    "seed {start_seed}: {most_coded} coded, {restores} restores under {policy:?}"
                );
            }
        }
    }

    #[test]
    fn refuses_wrong_positions_capacity_and_order() {
        let mut r = Residency::new(Policy::coded(4, 16, 8, 50), 2).unwrap();
        let e = r.append(&Step::single(0, 3, 1).unwrap()).unwrap_err();
        assert!(matches!(e, Error::Position { slot: 0, expected: 0, got: 3 }), "{e}");
        let e = r.append(&Step::single(1, 0, 51).unwrap()).unwrap_err();
        assert!(matches!(e, Error::ContextOverflow { requested: 51, max: 50 }), "{e}");
        assert!(r.append(&Step::single(2, 0, 1).unwrap()).is_err());
        assert_eq!((r.len(0), r.len(1)), (0, 0), "refused steps change nothing");
        let step = Step::single(0, 0, 30).unwrap();
        r.append(&step).unwrap();
        assert!(r.append(&Step::single(1, 0, 1).unwrap()).is_err(), "append before commit");
        assert!(r.views(&Step::single(0, 0, 29).unwrap()).is_err(), "views of another step");
        assert!(r.truncate(0, 3).is_err(), "truncate before commit");
        r.commit();
        assert_eq!((r.len(0), r.coded(0)), (30, 8));
        assert!(Residency::new(Policy::coded(0, 4, 0, 10), 1).is_err());
        assert!(Residency::new(Policy::sliding(0, 10), 1).is_err());
        assert!(Residency::new(Policy::dense(10), 0).is_err());
    }
}
