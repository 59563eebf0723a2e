//! Which coded positions the rescoring attention reads again at each decode step, and how many of
//! them the sequence's step before did not: the rows a cache would have to gather from its
//! off-device copy per step if it kept the last step's exact rows on the device, the last
//! [`RECENT`] rows read, or every row read (kernels NOTES.md, "Plan: exact rows at the
//! top-scoring positions"). Counted per (decode step, layer, kv head), the unit a gather serves:
//! the union of the positions its query heads chose.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Mutex;

use serde::Serialize;

/// Rows per (layer, kv head) of the bounded device-side set measured: the most recently read.
pub const RECENT: usize = 256;

/// Sums over (decode step, layer, kv head) triples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RereadCounts {
    /// Triples seen.
    pub heads: u64,
    /// Distinct positions their query heads chose, summed.
    pub rows: u64,
    /// Triples whose sequence's decode step before was seen too (same layer and kv head).
    pub followed: u64,
    /// Distinct positions of the followed triples.
    pub followed_rows: u64,
    /// Of those, positions the step before did not choose.
    pub new_vs_last: u64,
    /// Of those, positions not among the [`RECENT`] most recently read by earlier decode steps.
    pub new_vs_recent: u64,
    /// Of those, positions no earlier decode step of the sequence chose.
    pub new_vs_seen: u64,
}

impl RereadCounts {
    /// Distinct positions per triple.
    pub fn rows_per_head(&self) -> f64 {
        self.rows as f64 / self.heads.max(1) as f64
    }

    /// Positions per followed triple that the step before did not choose.
    pub fn new_per_head(&self) -> f64 {
        self.new_vs_last as f64 / self.followed.max(1) as f64
    }

    /// Positions per followed triple not among the [`RECENT`] most recently read.
    pub fn not_recent_per_head(&self) -> f64 {
        self.new_vs_recent as f64 / self.followed.max(1) as f64
    }

    /// Positions per followed triple that no earlier decode step chose.
    pub fn unseen_per_head(&self) -> f64 {
        self.new_vs_seen as f64 / self.followed.max(1) as f64
    }
}

/// One (layer, slot)'s decode so far, per kv head: the position of its last step, what that step
/// chose, the [`RECENT`] positions read last (least recent first), and everything its decode
/// steps chose.
struct Track {
    pos: usize,
    last: Vec<BTreeSet<usize>>,
    recent: Vec<VecDeque<usize>>,
    seen: Vec<BTreeSet<usize>>,
}

/// The sums and each (layer, slot)'s track.
#[derive(Default)]
struct State {
    counts: RereadCounts,
    tracks: HashMap<(usize, usize), Track>,
}

/// The record, shared by a simulation's layers.
#[derive(Default)]
pub struct RereadLog {
    state: Mutex<State>,
}

impl RereadLog {
    /// Layer `layer`'s decode step at position `pos` of the sequence in `slot` chose `chosen[h]`
    /// (positions) for kv head `h`. A step that does not follow the slot's last one (a new
    /// sequence, a truncation) starts its track afresh.
    pub fn record(&self, layer: usize, slot: usize, pos: usize, chosen: Vec<BTreeSet<usize>>) {
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State { counts, tracks } = &mut *guard;
        let prior = tracks.remove(&(layer, slot)).filter(|t| t.pos + 1 == pos && t.last.len() == chosen.len());
        let (mut recent, mut seen) = match prior {
            Some(t) => {
                for (h, now) in chosen.iter().enumerate() {
                    counts.followed += 1;
                    counts.followed_rows += now.len() as u64;
                    counts.new_vs_last += now.difference(&t.last[h]).count() as u64;
                    counts.new_vs_recent += now.iter().filter(|p| !t.recent[h].contains(p)).count() as u64;
                    counts.new_vs_seen += now.difference(&t.seen[h]).count() as u64;
                }
                (t.recent, t.seen)
            }
            None => (vec![VecDeque::new(); chosen.len()], vec![BTreeSet::new(); chosen.len()]),
        };
        for (h, now) in chosen.iter().enumerate() {
            counts.heads += 1;
            counts.rows += now.len() as u64;
            // This step's rows become the most recent; the least recent leave past RECENT.
            recent[h].retain(|p| !now.contains(p));
            recent[h].extend(now.iter().copied());
            let over = recent[h].len().saturating_sub(RECENT);
            recent[h].drain(..over);
            seen[h].extend(now.iter().copied());
        }
        tracks.insert((layer, slot), Track { pos, last: chosen, recent, seen });
    }

    /// The sums so far.
    pub fn counts(&self) -> RereadCounts {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(xs: &[usize]) -> BTreeSet<usize> {
        xs.iter().copied().collect()
    }

    #[test]
    fn counts_what_the_step_before_and_every_earlier_step_did_not_choose() {
        let log = RereadLog::default();
        log.record(0, 0, 10, vec![set(&[1, 2, 3]), set(&[4])]);
        log.record(0, 0, 11, vec![set(&[2, 3, 5]), set(&[4, 6])]);
        log.record(0, 0, 12, vec![set(&[1, 5, 7]), set(&[6])]);
        // Another layer and a step that does not follow (a new sequence in the slot): no prior.
        log.record(1, 0, 12, vec![set(&[9])]);
        log.record(0, 0, 40, vec![set(&[1]), set(&[2])]);
        let c = log.counts();
        assert_eq!(c.heads, 2 + 2 + 2 + 1 + 2);
        assert_eq!(c.rows, 4 + 5 + 4 + 1 + 2);
        assert_eq!(c.followed, 4);
        assert_eq!(c.followed_rows, 5 + 4);
        // Step 11: {5} and {6} new to the step before and to all before; step 12: {1, 7} new to
        // the step before (1 was chosen at 10), {7} to all before; kv head 1 nothing new.
        assert_eq!(c.new_vs_last, 2 + 2);
        assert_eq!(c.new_vs_seen, 2 + 1);
        // Within RECENT rows the recent set is every row read so far.
        assert_eq!(c.new_vs_recent, c.new_vs_seen);
        assert_eq!(c.new_per_head(), 1.0);
    }

    /// Past RECENT rows the least recently read leave the set: a row read again after RECENT
    /// others counts as new to it, though not to everything read.
    #[test]
    fn the_recent_set_forgets_the_least_recently_read() {
        let log = RereadLog::default();
        log.record(0, 0, 0, vec![set(&[0, 1])]);
        // Row 0 again at once keeps it recent; RECENT − 1 new rows push row 1 out (row 0 stays).
        log.record(0, 0, 1, vec![set(&[0])]);
        let fresh: Vec<usize> = (100..100 + RECENT - 1).collect();
        log.record(0, 0, 2, vec![set(&fresh)]);
        log.record(0, 0, 3, vec![set(&[0, 1])]);
        let c = log.counts();
        // Steps 1–3: nothing new, then the fresh rows, then row 1 (to the recent set) or both.
        assert_eq!(c.new_vs_seen, (RECENT - 1) as u64);
        assert_eq!(c.new_vs_recent, RECENT as u64);
        assert_eq!(c.new_vs_last, RECENT as u64 + 1);
    }
}
