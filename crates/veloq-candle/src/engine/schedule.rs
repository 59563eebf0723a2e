//! The scheduler's two decisions, model-free: who gets in (admission by KV memory, first come
//! first served) and what one forward pass runs (every decoding sequence's token, then prompt
//! chunks in what is left of the step).

use std::collections::VecDeque;

use crate::cache::SeqStep;

/// KV memory and slots for sequences: a request is admitted when its worst case (its prompt and
/// all the tokens it may generate, at the method's real bytes) fits in what is left of the budget
/// and a slot is free; otherwise it waits, in order of arrival.
#[derive(Clone, Debug)]
pub struct Admission<T> {
    /// Bytes sequences may take in all.
    budget: usize,
    reserved: usize,
    free: Vec<usize>,
    queue: VecDeque<(T, usize)>,
}

impl<T> Admission<T> {
    /// `budget` bytes over `slots` sequence slots.
    pub fn new(budget: usize, slots: usize) -> Self {
        Self { budget, reserved: 0, free: (0..slots).rev().collect(), queue: VecDeque::new() }
    }

    /// Queues `item`, which needs `bytes` once admitted.
    pub fn push(&mut self, item: T, bytes: usize) {
        self.queue.push_back((item, bytes));
    }

    /// The first waiting item, with a slot and its bytes reserved, if it fits now. Later items
    /// never pass an earlier one that does not fit (no starvation of long requests).
    pub fn admit(&mut self) -> Option<(T, usize, usize)> {
        let &(_, bytes) = self.queue.front()?;
        if self.reserved + bytes > self.budget || self.free.is_empty() {
            return None;
        }
        let (item, bytes) = self.queue.pop_front()?;
        let slot = self.free.pop()?;
        self.reserved += bytes;
        Some((item, slot, bytes))
    }

    /// A finished sequence gives back its slot and bytes.
    pub fn release(&mut self, slot: usize, bytes: usize) {
        debug_assert!(!self.free.contains(&slot), "slot {slot} released twice");
        self.reserved -= bytes;
        self.free.push(slot);
    }

    /// Drops waiting items that `keep` refuses (cancelled before admission); returns them.
    pub fn retain_waiting(&mut self, mut keep: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut gone = Vec::new();
        for (t, bytes) in std::mem::take(&mut self.queue) {
            if keep(&t) {
                self.queue.push_back((t, bytes));
            } else {
                gone.push(t);
            }
        }
        gone
    }

    /// Items waiting.
    pub fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Bytes reserved by admitted sequences.
    pub fn reserved(&self) -> usize {
        self.reserved
    }

    /// Bytes sequences may take in all.
    pub fn budget(&self) -> usize {
        self.budget
    }
}

/// A sequence as the step planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Its cache slot.
    pub slot: usize,
    /// Positions its caches hold.
    pub held: usize,
    /// Prompt tokens not yet fed (0 once decoding).
    pub prompt_left: usize,
}

/// One forward pass over `seqs` (in admission order): each decoding sequence takes one token and
/// prompts share the rest of `step_tokens` in chunks. Decoding streams never wait for a prompt.
/// The oldest prompt always advances by a quarter of the step (so none starves), the rest goes to
/// the prompts with the fewest tokens left (so a long prompt does not hold back the first token
/// of the short ones behind it, and a step carries few prompts: a device launches per sequence),
/// then back to the oldest. The prompts get at least `min_prefill` tokens in all however many
/// sequences decode.
pub fn plan(seqs: &[Progress], step_tokens: usize, min_prefill: usize) -> Vec<SeqStep> {
    let mut out: Vec<SeqStep> =
        seqs.iter().filter(|s| s.prompt_left == 0).map(|s| SeqStep { slot: s.slot, start: s.held, len: 1 }).collect();
    let prompts: Vec<&Progress> = seqs.iter().filter(|s| s.prompt_left > 0).collect();
    let Some(oldest) = prompts.first() else { return out };
    let mut left = step_tokens.saturating_sub(out.len()).max(min_prefill);
    let mut take = vec![0usize; prompts.len()];
    take[0] = oldest.prompt_left.min((left / 4).max(min_prefill)).min(left);
    left -= take[0];
    let mut order: Vec<usize> = (1..prompts.len()).collect();
    order.sort_by_key(|&i| prompts[i].prompt_left);
    for i in order {
        take[i] = prompts[i].prompt_left.min(left);
        left -= take[i];
    }
    let more = (oldest.prompt_left - take[0]).min(left);
    take[0] += more;
    out.extend(prompts.iter().zip(&take).filter(|(_, &n)| n > 0).map(|(p, &len)| SeqStep {
        slot: p.slot,
        start: p.held,
        len,
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_is_first_come_first_served_within_the_budget() {
        let mut a = Admission::new(100, 3);
        for (name, bytes) in [("a", 40), ("b", 50), ("c", 30), ("d", 5)] {
            a.push(name, bytes);
        }
        let (first, s0, _) = a.admit().unwrap();
        let (second, s1, _) = a.admit().unwrap();
        assert_eq!((first, second), ("a", "b"));
        assert_ne!(s0, s1);
        // c needs 30 with 90 reserved: it waits, and d (which would fit) does not pass it.
        assert!(a.admit().is_none());
        assert_eq!((a.waiting(), a.reserved()), (2, 90));
        a.release(s0, 40);
        let (third, s2, _) = a.admit().unwrap();
        assert_eq!(third, "c");
        // d fits the bytes (85 reserved) and takes the last slot; then no slot is left.
        assert_eq!(a.admit().map(|x| x.0), Some("d"));
        a.push("e", 1);
        assert!(a.admit().is_none(), "three slots, three sequences");
        assert_eq!(a.retain_waiting(|&t| t != "e"), vec!["e"]);
        a.release(s1, 50);
        a.release(s2, 30);
        assert_eq!(a.reserved(), 5);
    }

    #[test]
    fn decodes_go_first_and_prompts_share_the_rest() {
        let p = |slot, held, prompt_left| Progress { slot, held, prompt_left };
        let seqs = [p(3, 0, 1000), p(0, 40, 0), p(1, 0, 30), p(2, 7, 0)];
        let step = plan(&seqs, 512, 16);
        // Two decodes, then the prompts in admission order: the short one whole, the long one the rest.
        assert_eq!(
            step,
            vec![
                SeqStep { slot: 0, start: 40, len: 1 },
                SeqStep { slot: 2, start: 7, len: 1 },
                SeqStep { slot: 3, start: 0, len: 480 },
                SeqStep { slot: 1, start: 0, len: 30 },
            ]
        );
        // The oldest takes a quarter, the shortest the rest; the next step finishes it.
        let step = plan(&[p(1, 0, 900), p(3, 510, 490), p(4, 0, 800)], 512, 16);
        assert_eq!(step, vec![SeqStep { slot: 1, start: 0, len: 128 }, SeqStep { slot: 3, start: 510, len: 384 }]);
        let step = plan(&[p(1, 128, 772), p(3, 894, 106), p(4, 0, 800)], 512, 16);
        assert_eq!(step.iter().map(|s| (s.slot, s.len)).collect::<Vec<_>>(), vec![(1, 128), (3, 106), (4, 278)]);
        // Short prompts behind a long one all start at once when they fit.
        let step = plan(&[p(1, 0, 4000), p(4, 0, 12), p(5, 0, 200), p(6, 0, 90)], 512, 16);
        assert_eq!(
            step.iter().map(|s| (s.slot, s.len)).collect::<Vec<_>>(),
            vec![(1, 210), (4, 12), (5, 200), (6, 90)]
        );
        // Many decoders still leave the prompts their minimum.
        let many: Vec<Progress> = (0..600).map(|i| p(i, 9, 0)).chain([p(600, 0, 100)]).collect();
        let step = plan(&many, 512, 16);
        assert_eq!(step.len(), 601);
        assert_eq!(step.last(), Some(&SeqStep { slot: 600, start: 0, len: 16 }));
        // Fewer tokens than a quarter of a step's minimum: all to the oldest.
        let crowd: Vec<Progress> = (0..20).map(|i| p(i, 0, 50)).collect();
        assert_eq!(plan(&crowd, 16, 16), vec![SeqStep { slot: 0, start: 0, len: 16 }]);
        assert!(plan(&[], 512, 16).is_empty());
        // Every token of the step is accounted for, and no prompt gets more than it has.
        for (budget, lens) in [(512, vec![3, 7, 1000, 2]), (100, vec![40, 40, 40]), (64, vec![1])] {
            let seqs: Vec<Progress> = lens.iter().enumerate().map(|(i, &n)| p(i, 0, n)).collect();
            let step = plan(&seqs, budget, 16);
            let total: usize = step.iter().map(|s| s.len).sum();
            assert_eq!(total, budget.min(lens.iter().sum()));
            assert!(step.iter().all(|s| s.len <= lens[s.slot]));
        }
    }
}
