//! The scheduler's two decisions, model-free: who gets in (admission by KV memory, first come
//! first served, reusing the prefixes finished sequences left resident) and what one forward pass
//! runs (every decoding sequence's token, then prompt chunks in what is left of the step).

use std::collections::VecDeque;

use crate::cache::SeqStep;

/// KV memory and slots for sequences: a request is admitted when its worst case (its prompt and
/// all the tokens it may generate, at the method's real bytes) fits in what is left of the budget
/// and a slot is free; otherwise it waits, in order of arrival.
///
/// A finished sequence may stay resident ([`park`](Self::park)): its slot keeps its positions, and
/// a later request whose prompt starts with the same tokens (the next turn of a chat, the same
/// system prompt) takes that slot and feeds only the rest. Resident sequences count in the budget
/// and give way, least recently used first, to any request that needs their bytes or slot.
///
/// A sequence started from a fork may read blocks its source holds instead of copies: those
/// bytes leave its reservation ([`unreserve`](Self::unreserve)) and are counted once, in the
/// source's reservation or resident bytes, and the source's slot is pinned ([`pin`](Self::pin)) —
/// never taken over nor given up — while any borrower holds them, running or resident (a resident
/// borrower counts only its own bytes and gives way before its source).
#[derive(Clone, Debug)]
pub struct Admission<T> {
    /// Bytes sequences may take in all.
    budget: usize,
    reserved: usize,
    free: Vec<usize>,
    queue: VecDeque<(T, usize)>,
    /// Finished sequences kept for their prefixes, least recently used first.
    idle: VecDeque<Resident>,
    idle_bytes: usize,
    /// Per slot, the sequences (running or resident) that read blocks it holds.
    pins: Vec<u32>,
}

/// A finished sequence left in its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Resident {
    slot: usize,
    /// What it holds besides what it reads from `lender`.
    bytes: usize,
    tokens: Vec<u32>,
    /// The slot whose blocks it reads (pinned while it stays).
    lender: Option<usize>,
}

/// An admitted item and what the caches must do before it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted<T> {
    /// The request.
    pub item: T,
    /// Its slot.
    pub slot: usize,
    /// Bytes reserved for it.
    pub bytes: usize,
    /// Bytes it was admitted without: what it expects to read from the fork's source (pinned
    /// when this is not 0; 0 when it takes a resident over instead).
    pub discount: usize,
    /// Positions of the slot to keep: the prompt's first `reuse` tokens are already there (0: the
    /// slot must be emptied first if it is not).
    pub reuse: usize,
    /// Resident sequences given up to make room: empty these slots.
    pub evicted: Vec<usize>,
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<T> Admission<T> {
    /// `budget` bytes over `slots` sequence slots.
    pub fn new(budget: usize, slots: usize) -> Self {
        Self {
            budget,
            reserved: 0,
            free: (0..slots).rev().collect(),
            queue: VecDeque::new(),
            idle: VecDeque::new(),
            idle_bytes: 0,
            pins: vec![0; slots],
        }
    }

    /// Whether `slot` holds blocks another sequence reads.
    fn pinned(&self, slot: usize) -> bool {
        self.pins[slot] > 0
    }

    /// Residents to give up (indices into `idle`), least recently used first, until `enough`
    /// holds for the room and slots they free besides `room` and `slots`; those at `keep` are not
    /// given up, and the one at `taken` (in `keep`) is taken over: it stops reading its lender. A
    /// resident others read goes only after them. `None` if even all of them fall short.
    fn give_way(
        &self,
        mut room: usize,
        mut slots: usize,
        keep: &[usize],
        taken: Option<usize>,
        enough: impl Fn(usize, usize) -> bool,
    ) -> Option<Vec<usize>> {
        let mut pins = self.pins.clone();
        if let Some(l) = taken.and_then(|i| self.idle[i].lender) {
            pins[l] -= 1;
        }
        let mut out: Vec<usize> = Vec::new();
        while !enough(room, slots) {
            let (i, r) = self
                .idle
                .iter()
                .enumerate()
                .find(|&(i, r)| !keep.contains(&i) && !out.contains(&i) && pins[r.slot] == 0)?;
            out.push(i);
            room += r.bytes;
            slots += 1;
            if let Some(l) = r.lender {
                pins[l] -= 1;
            }
        }
        Some(out)
    }

    /// Takes the residents at `gone` (indices into `idle`) out: their bytes and their hold on
    /// their lenders go; returns them in order.
    fn remove_idle(&mut self, gone: &[usize]) -> Vec<Resident> {
        let mut out = Vec::new();
        for (i, r) in std::mem::take(&mut self.idle).into_iter().enumerate() {
            if !gone.contains(&i) {
                self.idle.push_back(r);
                continue;
            }
            self.idle_bytes -= r.bytes;
            if let Some(l) = r.lender {
                self.pins[l] -= 1;
            }
            out.push(r);
        }
        out
    }

    /// A running sequence reads (or is about to read) blocks `slot` holds: `slot` stays as it is,
    /// neither taken over nor given up, until [`repay`](Self::repay).
    pub fn pin(&mut self, slot: usize) {
        self.pins[slot] += 1;
    }

    /// The only running borrower of the resident `slot` takes over the `bytes` it reads from it:
    /// they join its reservation, and the resident is given up with the residents that read it
    /// (returns the slots to empty). Refused (`None`, nothing changed) when `slot` is not
    /// resident, another running sequence reads it, or a resident that reads it is read in turn.
    /// A sequence that needs the room its source holds gets it this way before anyone is
    /// preempted.
    pub fn settle(&mut self, slot: usize, bytes: usize) -> Option<Vec<usize>> {
        let at = self.idle.iter().position(|r| r.slot == slot)?;
        let readers: Vec<usize> = (0..self.idle.len()).filter(|&i| self.idle[i].lender == Some(slot)).collect();
        if self.pins[slot] as usize != 1 + readers.len() || readers.iter().any(|&i| self.pinned(self.idle[i].slot)) {
            return None;
        }
        let gone: Vec<usize> = readers.into_iter().chain([at]).collect();
        let slots: Vec<usize> = self.remove_idle(&gone).into_iter().map(|r| r.slot).collect();
        debug_assert_eq!(self.pins[slot], 1);
        self.pins[slot] = 0;
        self.free.extend(&slots);
        self.reserved += bytes;
        Some(slots)
    }

    /// `bytes` leave the reservations (a sequence reads them from another's storage).
    pub fn unreserve(&mut self, bytes: usize) {
        self.reserved -= bytes;
    }

    /// The first waiting item.
    pub fn front(&self) -> Option<&T> {
        self.queue.front().map(|(t, _)| t)
    }

    /// A running borrower of `slot`'s blocks stopped running and gives them up (it gives back its
    /// own reservation separately). One that stays resident keeps reading them instead
    /// ([`park`](Self::park) with its lender).
    pub fn repay(&mut self, slot: usize) {
        debug_assert!(self.pins[slot] > 0, "slot {slot} repaid more than lent");
        self.pins[slot] -= 1;
    }

    /// Queues `item`, which needs `bytes` once admitted.
    pub fn push(&mut self, item: T, bytes: usize) {
        self.queue.push_back((item, bytes));
    }

    /// Queues a preempted `item` ahead of every other: it is admitted again first.
    pub fn push_front(&mut self, item: T, bytes: usize) {
        self.queue.push_front((item, bytes));
    }

    /// Grows an admitted sequence's reservation by `extra` bytes, giving up resident sequences
    /// (least recently used first) if that is what it takes; returns the slots to empty, or
    /// `None` (and changes nothing) when even that does not make room.
    pub fn grow(&mut self, extra: usize) -> Option<Vec<usize>> {
        let room = self.budget.saturating_sub(self.reserved + self.idle_bytes);
        let gone = self.give_way(room, 0, &[], None, |room, _| room >= extra)?;
        let slots: Vec<usize> = self.remove_idle(&gone).into_iter().map(|r| r.slot).collect();
        self.free.extend(&slots);
        self.reserved += extra;
        Some(slots)
    }

    /// The first waiting item, with a slot and its bytes reserved, if it fits now (after giving
    /// up resident sequences if need be). Later items never pass an earlier one that does not fit
    /// (no starvation of long requests). `prompt` reads an item's prompt tokens.
    ///
    /// A resident sequence is reused when it shares a prefix with the prompt covering at least
    /// half of what it holds (so a reuse never throws away most of another conversation); the
    /// longest such prefix wins, the most recent on a tie. The prompt's last token is always fed
    /// (its logits start the completion).
    ///
    /// An item that will start from a fork of the running or resident sequence in `fork.0` needs
    /// `fork.1` bytes less (what it will read from it): unless it takes a resident over, it is
    /// admitted without them, and that slot is pinned ([`pin`](Self::pin)) and kept — unless the
    /// source is resident and holds the room the item needs: then the item is admitted whole
    /// (`discount` 0) and the source may be given up.
    pub fn admit(&mut self, prompt: impl Fn(&T) -> &[u32], fork: Option<(usize, usize)>) -> Option<Admitted<T>> {
        let (item, bytes) = self.queue.front()?;
        let (p, mut bytes) = (prompt(item), *bytes);
        let best = self
            .idle
            .iter()
            .enumerate()
            .filter(|(_, r)| !self.pinned(r.slot))
            .map(|(i, r)| (i, common_prefix(&r.tokens, p).min(p.len().saturating_sub(1))))
            .filter(|&(i, n)| n > 0 && 2 * n >= self.idle[i].tokens.len())
            .max_by_key(|&(i, n)| (n, i));
        // What is free now, then resident sequences given up oldest first until the item fits.
        // A resident taken over gives its bytes and slot to the item, which reserves all it needs
        // (what the resident read from a lender included).
        let mut room = self.budget.saturating_sub(self.reserved + self.idle_bytes);
        let mut slots = self.free.len();
        if let Some((i, _)) = best {
            room += self.idle[i].bytes;
            slots += 1;
        }
        let keep = best.map(|(i, _)| i);
        // With the fork's discount, its source kept; or, when a resident source holds the room
        // the item needs, without it (the source given up, the item feeding its prompt itself).
        let try_with = |fork: Option<(usize, usize)>| {
            let need = bytes - fork.map_or(0, |(_, d)| d);
            let fork_source = fork.and_then(|(s, _)| self.idle.iter().position(|r| r.slot == s));
            let kept: Vec<usize> = keep.into_iter().chain(fork_source).collect();
            self.give_way(room, slots, &kept, keep, |room, slots| room >= need && slots > 0).map(|e| (e, fork))
        };
        let fork = fork.filter(|_| best.is_none()).map(|(s, d)| (s, d.min(bytes))).filter(|&(_, d)| d > 0);
        let (evict, fork) = try_with(fork).or_else(|| fork.and_then(|_| try_with(None)))?;
        let (source, discount) = fork.map_or((None, 0), |(s, d)| (Some(s), d));
        bytes -= discount;
        let (item, _) = self.queue.pop_front()?;
        let taken = best.map(|(i, n)| (self.idle[i].slot, n));
        if let Some(s) = source {
            self.pin(s);
        }
        let gone: Vec<usize> = evict.iter().copied().chain(keep).collect();
        let mut evicted = Vec::new();
        for r in self.remove_idle(&gone) {
            if taken.is_none_or(|(t, _)| t != r.slot) {
                evicted.push(r.slot);
                self.free.push(r.slot);
            }
        }
        let (slot, reuse) = match taken {
            Some(t) => t,
            None => (self.free.pop()?, 0),
        };
        self.reserved += bytes;
        Some(Admitted { item, slot, bytes, discount, reuse, evicted })
    }

    /// A finished sequence gives back its slot and bytes.
    pub fn release(&mut self, slot: usize, bytes: usize) {
        debug_assert!(!self.free.contains(&slot), "slot {slot} released twice");
        self.reserved -= bytes;
        self.free.push(slot);
    }

    /// A finished sequence gives back its reservation but stays in its slot, holding `tokens`
    /// (the positions its caches hold), for a later prompt that starts the same: `bytes` of its
    /// own, and what it reads from `lender`'s slot (a fork; the [`pin`](Self::pin) it took stays
    /// until it goes).
    pub fn park(&mut self, slot: usize, reserved: usize, bytes: usize, tokens: Vec<u32>, lender: Option<usize>) {
        self.reserved -= reserved;
        self.idle_bytes += bytes;
        self.idle.push_back(Resident { slot, bytes, tokens, lender });
    }

    /// Gives up every resident sequence (the caches were rebuilt empty); returns their slots.
    pub fn forget_resident(&mut self) -> Vec<usize> {
        self.idle_bytes = 0;
        self.pins.iter_mut().for_each(|p| *p = 0);
        let slots: Vec<usize> = self.idle.drain(..).map(|r| r.slot).collect();
        self.free.extend(&slots);
        slots
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

    /// The resident sequence sharing the longest prefix with `prompt` (its last token left to
    /// feed) and how many tokens, the slot left where it is: what a request may copy when the
    /// share is too small to take the slot over.
    pub fn resident_prefix(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        self.idle
            .iter()
            .map(|r| (r.slot, common_prefix(&r.tokens, prompt).min(prompt.len().saturating_sub(1))))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
    }

    /// Finished sequences resident for their prefixes, and the bytes they hold.
    pub fn resident(&self) -> (usize, usize) {
        (self.idle.len(), self.idle_bytes)
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
        fn no_prompt<'a>(_: &'a &str) -> &'a [u32] {
            &[]
        }
        let (first, s0) = a.admit(no_prompt, None).map(|x| (x.item, x.slot)).unwrap();
        let (second, s1) = a.admit(no_prompt, None).map(|x| (x.item, x.slot)).unwrap();
        assert_eq!((first, second), ("a", "b"));
        assert_ne!(s0, s1);
        // c needs 30 with 90 reserved: it waits, and d (which would fit) does not pass it.
        assert!(a.admit(no_prompt, None).is_none());
        assert_eq!((a.waiting(), a.reserved()), (2, 90));
        a.release(s0, 40);
        let (third, s2) = a.admit(no_prompt, None).map(|x| (x.item, x.slot)).unwrap();
        assert_eq!(third, "c");
        // d fits the bytes (85 reserved) and takes the last slot; then no slot is left.
        assert_eq!(a.admit(no_prompt, None).map(|x| x.item), Some("d"));
        a.push("e", 1);
        assert!(a.admit(no_prompt, None).is_none(), "three slots, three sequences");
        assert_eq!(a.retain_waiting(|&t| t != "e"), vec!["e"]);
        a.release(s1, 50);
        a.release(s2, 30);
        assert_eq!(a.reserved(), 5);
    }

    #[test]
    fn resident_prefixes_are_reused_and_give_way_oldest_first() {
        fn prompt(t: &Vec<u32>) -> &[u32] {
            t
        }
        let mut a: Admission<Vec<u32>> = Admission::new(100, 3);
        // Two finished conversations resident (20 and 30 bytes), one slot free.
        a.push(vec![1, 2, 3, 4], 40);
        a.push(vec![7, 8, 9], 40);
        let x = a.admit(prompt, None).unwrap();
        let y = a.admit(prompt, None).unwrap();
        assert_eq!((x.reuse, y.reuse, a.reserved()), (0, 0, 80));
        a.park(x.slot, 40, 20, vec![1, 2, 3, 4, 5, 6], None);
        a.park(y.slot, 40, 30, vec![7, 8, 9, 10], None);
        assert_eq!((a.reserved(), a.resident()), (0, (2, 50)));
        // The next turn of the first: its history plus new tokens; the last prompt token is fed.
        a.push(vec![1, 2, 3, 4, 5, 6, 11, 12], 45);
        let t = a.admit(prompt, None).unwrap();
        assert_eq!((t.slot, t.reuse, t.evicted.clone()), (x.slot, 6, vec![]));
        assert_eq!((a.reserved(), a.resident()), (45, (1, 30)));
        // A prompt equal to what a slot holds still feeds its last token.
        a.release(t.slot, 45);
        a.park(t.slot, 0, 10, vec![5, 5], None);
        a.push(vec![5, 5], 10);
        let t = a.admit(prompt, None).unwrap();
        assert_eq!((t.slot, t.reuse), (x.slot, 1));
        a.release(t.slot, 10);
        // A prefix shorter than half of what a slot holds does not take it: the free slot is used.
        a.push(vec![7, 99], 10);
        let t = a.admit(prompt, None).unwrap();
        assert_eq!((t.reuse, t.evicted.clone(), a.resident()), (0, vec![], (1, 30)));
        assert!(t.slot != y.slot);
        a.release(t.slot, 10);
        // Needing more than is free gives up resident sequences, least recently used first.
        a.park(x.slot, 0, 25, vec![3, 3, 3], None);
        assert_eq!(a.resident(), (2, 55));
        a.push(vec![42], 60);
        let t = a.admit(prompt, None).unwrap();
        assert_eq!((t.reuse, t.evicted.clone(), a.resident()), (0, vec![y.slot], (1, 25)));
        a.push(vec![43], 40);
        let t = a.admit(prompt, None).unwrap();
        assert_eq!((t.evicted.clone(), a.reserved(), a.resident()), (vec![x.slot], 100, (0, 0)));
        // Nothing left to give up: the next waits, and nothing changed.
        a.push(vec![44], 1);
        assert!(a.admit(prompt, None).is_none());
        assert_eq!((a.waiting(), a.reserved()), (1, 100));
    }

    /// A resident sequence whose blocks a running fork reads is neither given up nor taken over
    /// until the fork repays; the borrowed bytes leave the fork's reservation meanwhile.
    #[test]
    fn lent_residents_stay_until_repaid() {
        fn prompt(t: &Vec<u32>) -> &[u32] {
            t
        }
        let mut a: Admission<Vec<u32>> = Admission::new(100, 3);
        let source = vec![1, 2, 3, 4, 5, 6];
        a.push(source.clone(), 40);
        let s = a.admit(prompt, None).unwrap();
        a.park(s.slot, 40, 40, source.clone(), None);
        // A fork of the resident (too short a share to take it over): admitted whole, then 30 of its 50 bytes read from the resident.
        a.push(vec![1, 9, 9], 50);
        let f = a.admit(prompt, None).unwrap();
        assert_eq!(f.evicted, Vec::<usize>::new());
        a.pin(s.slot);
        a.unreserve(30);
        assert_eq!(a.reserved(), 20);
        // The same prompt again would take the resident over; pinned, it gets a free slot instead.
        a.push(source.clone(), 30);
        let again = a.admit(prompt, None).unwrap();
        assert_eq!((again.reuse, again.evicted.is_empty()), (0, true));
        assert_ne!(again.slot, s.slot);
        // No slot left but the pinned resident's: nothing fits, nothing is given up.
        a.push(vec![7], 1);
        assert!(a.admit(prompt, None).is_none());
        assert_eq!(a.grow(100), None);
        assert_eq!(a.resident(), (1, 40));
        // Repaid, the resident gives way.
        a.repay(s.slot);
        a.release(again.slot, 30);
        assert_eq!(a.grow(100 - 20 - 40 + 1), Some(vec![s.slot]));
    }

    /// The one running borrower of a resident takes its shared bytes over and the resident goes,
    /// with the residents that read it; a resident two running sequences read, or a slot not
    /// resident, is refused and nothing changes.
    #[test]
    fn a_sole_borrower_settles_its_resident_source() {
        let mut a: Admission<Vec<u32>> = Admission::new(100, 5);
        let mut slots = Vec::new();
        for (prompt, bytes) in [(vec![1, 2, 3, 4], 40), (vec![5, 6, 7, 8], 20), (vec![9, 9, 9], 30)] {
            a.push(prompt.clone(), bytes);
            let s = a.admit(|t: &Vec<u32>| t, None).unwrap();
            slots.push(s.slot);
        }
        let (first, second, reader, free) = (slots[0], slots[1], slots[2], 4);
        a.park(first, 40, 40, vec![1, 2, 3, 4], None);
        a.park(second, 20, 20, vec![5, 6, 7, 8], None);
        // A finished fork of the first stays resident reading 25 of its 30 bytes from it.
        a.pin(first);
        a.unreserve(25);
        a.park(reader, 5, 5, vec![9, 9, 9], Some(first));
        a.pin(first);
        a.pin(second);
        a.pin(second);
        assert_eq!(a.settle(second, 15), None, "two running sequences read it");
        assert_eq!(a.settle(free, 15), None, "not resident");
        assert_eq!((a.reserved(), a.resident()), (0, (3, 65)));
        let mut gone = a.settle(first, 30).unwrap();
        gone.sort();
        assert_eq!(gone, vec![first, reader], "the source goes with the resident that reads it");
        assert_eq!((a.reserved(), a.resident()), (30, (1, 20)));
        // Their slots are free again.
        for _ in 0..2 {
            a.push(vec![7], 1);
            let s = a.admit(|t: &Vec<u32>| t, None).unwrap().slot;
            assert!(s == first || s == reader, "{s}");
        }
    }

    /// A resident fork counts its own bytes only and keeps its source: the source gives way after
    /// it, least recently used or not.
    #[test]
    fn resident_forks_give_way_before_their_source() {
        let mut a: Admission<Vec<u32>> = Admission::new(120, 4);
        let mut slots = Vec::new();
        for prompt in [vec![1, 1, 1, 1], vec![2, 2, 2, 2], vec![3, 3, 3, 3]] {
            a.push(prompt, 40);
            slots.push(a.admit(|t: &Vec<u32>| t, None).unwrap().slot);
        }
        let (source, fork, other) = (slots[0], slots[1], slots[2]);
        a.park(source, 40, 40, vec![1, 1, 1, 1], None);
        // The fork read 30 bytes from the source; it parks with its 10 own bytes.
        a.pin(source);
        a.unreserve(30);
        a.park(fork, 10, 10, vec![1, 1, 5, 5], Some(source));
        a.park(other, 40, 40, vec![3, 3, 3, 3], None);
        assert_eq!((a.reserved(), a.resident()), (0, (3, 90)), "the shared bytes counted once");
        // 15 bytes more than are free: the oldest resident, the source, is read by the fork, which
        // goes first; that is not enough, so the source goes next (before the more recent `other`).
        let mut gone = a.grow(30 + 15).unwrap();
        gone.sort();
        let mut want = vec![source, fork];
        want.sort();
        assert_eq!(gone, want);
        assert_eq!((a.reserved(), a.resident()), (45, (1, 40)));
    }

    /// A request that takes over a resident fork reserves all it needs itself, so the fork's
    /// source no longer holds anything for it and gives way if the room is needed; a request
    /// planned to fork a resident source that holds the room it needs is admitted whole instead,
    /// the source given up. (Either used to leave the request waiting with nothing running.)
    #[test]
    fn a_resident_source_gives_way_when_its_readers_no_longer_need_it() {
        fn prompt(t: &Vec<u32>) -> &[u32] {
            t
        }
        let mut a: Admission<Vec<u32>> = Admission::new(100, 4);
        a.push(vec![1, 1, 1, 1], 50);
        let source = a.admit(prompt, None).unwrap().slot;
        a.park(source, 50, 50, vec![1, 1, 1, 1], None);
        a.push(vec![2, 2, 2, 2], 40);
        let fork = a.admit(prompt, None).unwrap().slot;
        a.pin(source);
        a.unreserve(30);
        a.park(fork, 10, 10, vec![2, 2, 2, 2], Some(source));
        assert_eq!(a.resident(), (2, 60));
        // The fork's next turn takes it over and needs 90: the source goes.
        a.push(vec![2, 2, 2, 2, 3], 90);
        let t = a.admit(prompt, None).unwrap();
        assert_eq!((t.slot, t.reuse, t.evicted, t.discount), (fork, 4, vec![source], 0));
        assert_eq!((a.reserved(), a.resident()), (90, (0, 0)));
        a.release(t.slot, 90);
        // A resident source of 60 and a request of 70 planned to read 20 of it: 50 do not fit
        // beside the source, 70 fit without it.
        a.push(vec![1, 1, 1, 1], 60);
        let s = a.admit(prompt, None).unwrap().slot;
        a.park(s, 60, 60, vec![1, 1, 1, 1], None);
        a.push(vec![1, 5], 70);
        let f = a.admit(prompt, Some((s, 20))).unwrap();
        assert_eq!((f.discount, f.bytes, f.evicted), (0, 70, vec![s]));
        assert_eq!((a.reserved(), a.resident()), (70, (0, 0)));
    }

    /// What a random run of admissions, forks, finishes, growth and settlements must keep: the
    /// reservations and resident bytes are what was handed out; nothing is over the budget after
    /// an admission or a growth; no slot is given twice; every slot whose blocks a sequence reads
    /// (running or resident) is still running or resident — shared bytes are always counted by
    /// someone; and with nothing running, nothing waits.
    mod bookkeeping {
        use std::collections::BTreeMap;

        use proptest::prelude::*;

        use super::super::Admission;

        #[derive(Clone, Debug)]
        enum Op {
            /// Queue a prompt (tokens from a small alphabet, so prefixes repeat) needing `bytes`,
            /// then admit what fits; the first admitted expects to fork running or resident
            /// sequence `fork.0` and read `fork.1` of what that holds, admitted without it.
            Submit { prompt: Vec<u32>, bytes: usize, fork: Option<(usize, f64)> },
            /// Running sequence `who` (an index among the running) starts reading `share` (a
            /// fraction of its reservation) from running or resident sequence `from`.
            Lend { who: usize, from: usize, share: f64 },
            /// Running sequence `who` finishes: parked with `keep` of its reservation, or freed.
            Finish { who: usize, park: bool, keep: f64 },
            /// Every running sequence together needs `extra` more bytes.
            Grow { extra: usize },
            /// Running borrower `who` takes over what it reads.
            Settle { who: usize },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                3 => (prop::collection::vec(0u32..3, 1..6), 1usize..40, prop::option::of((0usize..16, 0.0f64..1.0)))
                    .prop_map(|(prompt, bytes, fork)| Op::Submit { prompt, bytes, fork }),
                2 => (0usize..8, 0usize..16, 0.0f64..1.0).prop_map(|(who, from, share)| Op::Lend { who, from, share }),
                2 => (0usize..8, any::<bool>(), 0.0f64..1.0).prop_map(|(who, park, keep)| Op::Finish { who, park, keep }),
                1 => (0usize..60).prop_map(|extra| Op::Grow { extra }),
                1 => (0usize..8).prop_map(|who| Op::Settle { who }),
            ]
        }

        /// A running sequence as the test sees it.
        #[derive(Clone, Debug)]
        struct Run {
            slot: usize,
            prompt: Vec<u32>,
            reserved: usize,
            /// The slot it reads from and how many bytes.
            lent: Option<(usize, usize)>,
        }

        /// What the test expects the admission to hold.
        #[derive(Default)]
        struct Model {
            running: Vec<Run>,
            /// Resident slot → (bytes, lender).
            resident: BTreeMap<usize, (usize, Option<usize>)>,
        }

        impl Model {
            /// Running and resident slots but `but`, with the bytes each holds.
            fn holders(&self, but: usize) -> Vec<(usize, usize)> {
                let running = self.running.iter().map(|r| (r.slot, r.reserved));
                running.chain(self.resident.iter().map(|(&s, r)| (s, r.0))).filter(|h| h.0 != but).collect()
            }

            fn gone(&mut self, slots: &[usize]) {
                for s in slots {
                    assert!(self.resident.remove(s).is_some(), "slot {s} given up but not resident");
                }
            }

            fn check(&self, a: &Admission<Vec<u32>>, budget: usize) {
                let reserved: usize = self.running.iter().map(|r| r.reserved).sum();
                let idle: usize = self.resident.values().map(|r| r.0).sum();
                assert_eq!((a.reserved(), a.resident()), (reserved, (self.resident.len(), idle)));
                assert!(reserved + idle <= budget, "{reserved} + {idle} over {budget}");
                let held = |s: usize| self.resident.contains_key(&s) || self.running.iter().any(|r| r.slot == s);
                for r in &self.running {
                    assert!(r.lent.is_none_or(|(l, _)| held(l)), "{r:?} reads a slot given up");
                }
                for (s, (_, lender)) in &self.resident {
                    assert!(lender.is_none_or(held), "resident {s} reads a slot given up");
                }
                let mut slots: Vec<usize> =
                    self.running.iter().map(|r| r.slot).chain(self.resident.keys().copied()).collect();
                slots.sort();
                slots.dedup();
                assert_eq!(slots.len(), self.running.len() + self.resident.len(), "a slot given twice");
            }
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(400))]
            #[test]
            fn shared_bytes_stay_counted(ops in prop::collection::vec(op(), 1..80)) {
                let budget = 100;
                let mut a: Admission<Vec<u32>> = Admission::new(budget, 6);
                let mut m = Model::default();
                for op in ops {
                    match op {
                        Op::Submit { prompt, bytes, fork } => {
                            a.push(prompt, bytes);
                            let holders = m.holders(usize::MAX);
                            let mut plan = fork.and_then(|(i, share)| {
                                let &(slot, has) = holders.get(i % holders.len().max(1))?;
                                Some((slot, ((bytes as f64 * share) as usize).min(has)))
                            });
                            while let Some(x) = a.admit(|t: &Vec<u32>| t, plan) {
                                m.gone(&x.evicted);
                                if x.reuse > 0 {
                                    m.gone(&[x.slot]);
                                    assert_eq!(x.discount, 0, "a takeover is admitted whole");
                                }
                                let lent = plan.filter(|_| x.discount > 0).map(|(source, _)| (source, x.discount));
                                m.running.push(Run { slot: x.slot, prompt: x.item, reserved: x.bytes, lent });
                                plan = None;
                            }
                            // Nothing running frees room later: whatever waits must fit now (every
                            // item fits the budget once the residents give way).
                            assert!(!m.running.is_empty() || a.waiting() == 0, "nothing runs and {} wait", a.waiting());
                        }
                        Op::Lend { who, from, share } => {
                            // As in the engine: a sequence just forked into its slot reads from one
                            // other, at most what that one holds, and nothing reads from it yet.
                            let n = m.running.len();
                            if n == 0 || m.running[who % n].lent.is_some() {
                                continue;
                            }
                            let me = m.running[who % n].slot;
                            let read = m.running.iter().filter_map(|r| r.lent).chain(m.resident.values().filter_map(|r| r.1.map(|l| (l, 0))));
                            if read.map(|l| l.0).any(|l| l == me) {
                                continue;
                            }
                            let holders = m.holders(me);
                            let Some(&(from, has)) = holders.get(from % holders.len().max(1)) else { continue };
                            let r = &mut m.running[who % n];
                            let bytes = ((r.reserved as f64 * share) as usize).min(has);
                            a.pin(from);
                            a.unreserve(bytes);
                            r.reserved -= bytes;
                            r.lent = Some((from, bytes));
                        }
                        Op::Finish { who, park, keep } => {
                            if m.running.is_empty() {
                                continue;
                            }
                            let n = m.running.len();
                            let r = m.running.remove(who % n);
                            // As in the engine: a sequence others read stays resident.
                            let read = m.running.iter().filter_map(|x| x.lent.map(|l| l.0)).chain(m.resident.values().filter_map(|x| x.1)).any(|l| l == r.slot);
                            if park || read {
                                // It holds at least what others read from it.
                                let lent = m.running.iter().filter_map(|x| x.lent).filter(|l| l.0 == r.slot).map(|l| l.1).max();
                                let own = ((r.reserved as f64 * keep) as usize).max(lent.unwrap_or(0));
                                a.park(r.slot, r.reserved, own, r.prompt.clone(), r.lent.map(|l| l.0));
                                m.resident.insert(r.slot, (own, r.lent.map(|l| l.0)));
                            } else {
                                if let Some((l, _)) = r.lent {
                                    a.repay(l);
                                }
                                a.release(r.slot, r.reserved);
                            }
                        }
                        Op::Grow { extra } => {
                            if m.running.is_empty() {
                                continue;
                            }
                            if let Some(gone) = a.grow(extra) {
                                m.gone(&gone);
                                m.running[0].reserved += extra;
                            }
                        }
                        Op::Settle { who } => {
                            let n = m.running.len();
                            let Some((l, bytes)) = m.running.get(who % n.max(1)).and_then(|r| r.lent) else { continue };
                            if let Some(gone) = a.settle(l, bytes) {
                                assert!(gone.contains(&l));
                                m.gone(&gone);
                                let r = &mut m.running[who % n];
                                r.reserved += bytes;
                                r.lent = None;
                            }
                        }
                    }
                    m.check(&a, budget);
                }
            }
        }
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
