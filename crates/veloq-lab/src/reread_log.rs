//! Which coded positions the rescoring attention reads again at each decode step, and how many of
//! them the sequence's step before did not: the rows a cache would have to gather from its
//! off-device copy per step if it kept the last step's exact rows on the device (kernels
//! NOTES.md, "Plan: exact rows at the top-scoring positions"). Counted per (decode step, layer,
//! kv head), the unit a gather serves: the union of the positions its query heads chose.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use serde::Serialize;

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

    /// Positions per followed triple that no earlier decode step chose.
    pub fn unseen_per_head(&self) -> f64 {
        self.new_vs_seen as f64 / self.followed.max(1) as f64
    }
}

/// One (layer, slot)'s decode so far: the position of its last step, what that step chose per kv
/// head, and everything its decode steps chose.
struct Track {
    pos: usize,
    last: Vec<BTreeSet<usize>>,
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
        let mut seen = Vec::with_capacity(chosen.len());
        for (h, now) in chosen.iter().enumerate() {
            counts.heads += 1;
            counts.rows += now.len() as u64;
            let mut all = BTreeSet::new();
            if let Some(t) = &prior {
                counts.followed += 1;
                counts.followed_rows += now.len() as u64;
                counts.new_vs_last += now.difference(&t.last[h]).count() as u64;
                counts.new_vs_seen += now.difference(&t.seen[h]).count() as u64;
                all.clone_from(&t.seen[h]);
            }
            all.extend(now.iter().copied());
            seen.push(all);
        }
        tracks.insert((layer, slot), Track { pos, last: chosen, seen });
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
        assert_eq!(c.new_per_head(), 1.0);
    }
}
