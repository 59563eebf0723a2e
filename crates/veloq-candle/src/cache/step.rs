//! What one forward pass runs: which sequences (cache slots), at which start positions, with how
//! many new tokens each. Positions come from the caller, not from the caches, so sequences at
//! different positions (a ragged batch, a chunk of a long prompt beside decode steps) share one
//! pass. Tokens, keys, values and queries of a step are packed: sequence after sequence, in the
//! order of [`Step::seqs`].

use std::ops::Range;

use crate::error::{Error, Result};

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqStep {
    /// Which of the caches' sequences.
    pub slot: usize,
    /// Position of its first new token (what its caches hold before the step).
    pub start: usize,
    /// New tokens.
    pub len: usize,
}

/// A forward pass over one or more sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    seqs: Vec<SeqStep>,
    /// Packed row where each sequence starts, and the total at the end.
    offsets: Vec<usize>,
}

impl Step {
    /// A step over `seqs`: each takes at least one token, no slot twice.
    pub fn new(seqs: Vec<SeqStep>) -> Result<Self> {
        if seqs.is_empty() {
            return Err(Error::Config("a step needs at least one sequence".into()));
        }
        for (i, s) in seqs.iter().enumerate() {
            if s.len == 0 {
                return Err(Error::Config(format!("sequence in slot {} takes no tokens", s.slot)));
            }
            if seqs[..i].iter().any(|o| o.slot == s.slot) {
                return Err(Error::Config(format!("slot {} appears twice in one step", s.slot)));
            }
        }
        let mut offsets = Vec::with_capacity(seqs.len() + 1);
        offsets.push(0);
        for s in &seqs {
            offsets.push(offsets.last().copied().unwrap_or(0) + s.len);
        }
        Ok(Self { seqs, offsets })
    }

    /// `len` tokens of the sequence in `slot`, from position `start`.
    pub fn single(slot: usize, start: usize, len: usize) -> Result<Self> {
        Self::new(vec![SeqStep { slot, start, len }])
    }

    /// One token for each of the sequences in slots `0..starts.len()`, at `starts[slot]`.
    pub fn decode(starts: &[usize]) -> Result<Self> {
        Self::new(starts.iter().enumerate().map(|(slot, &start)| SeqStep { slot, start, len: 1 }).collect())
    }

    /// The sequences, in packing order.
    pub fn seqs(&self) -> &[SeqStep] {
        &self.seqs
    }

    /// Tokens of the whole step.
    pub fn tokens(&self) -> usize {
        self.offsets[self.seqs.len()]
    }

    /// Packed rows of sequence `i` (its index in [`seqs`](Self::seqs)).
    pub fn rows(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// The position of every packed token.
    pub fn positions(&self) -> Vec<u32> {
        self.seqs.iter().flat_map(|s| (s.start..s.start + s.len).map(|p| p as u32)).collect()
    }

    /// Whether every sequence takes one token (a decode step).
    pub fn is_decode(&self) -> bool {
        self.seqs.iter().all(|s| s.len == 1)
    }

    /// The last position any sequence reaches, plus one.
    pub fn end(&self) -> usize {
        self.seqs.iter().map(|s| s.start + s.len).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_ragged_sequences_and_refuses_bad_ones() {
        let s = Step::new(vec![SeqStep { slot: 2, start: 10, len: 3 }, SeqStep { slot: 0, start: 0, len: 1 }]).unwrap();
        assert_eq!(s.tokens(), 4);
        assert_eq!((s.rows(0), s.rows(1)), (0..3, 3..4));
        assert_eq!(s.positions(), vec![10, 11, 12, 0]);
        assert!(!s.is_decode());
        assert_eq!(s.end(), 13);
        assert!(Step::decode(&[5, 9]).unwrap().is_decode());
        assert!(Step::new(vec![]).is_err());
        assert!(Step::single(0, 0, 0).is_err());
        assert!(Step::new(vec![SeqStep { slot: 1, start: 0, len: 1 }, SeqStep { slot: 1, start: 1, len: 1 }]).is_err());
    }
}
