//! Which text a calibration saw, kept small enough for the artifact's metadata: hashes of the
//! calibration tokens' 32-token shingles at stride 32. Any evaluation span sharing 63 or more
//! consecutive tokens with the calibration text contains one of those shingles at some offset, so
//! [`TextFingerprint::first_overlap`] finds it. Evaluating on calibration text flatters every
//! calibrated method; veloq refuses to.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

/// Tokens per shingle.
pub const SHINGLE: usize = 32;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
/// Which text a calibration saw: hashes of its 32-token shingles.
pub struct TextFingerprint {
    /// Shingle hashes in text order (deterministic artifact bytes).
    pub hashes: Vec<u64>,
}

impl TextFingerprint {
    /// The fingerprint of `tokens`.
    pub fn of_tokens(tokens: &[u32]) -> Self {
        Self { hashes: tokens.chunks_exact(SHINGLE).map(hash).collect() }
    }

    /// Position in `tokens` of the first shingle the fingerprinted text also holds.
    pub fn first_overlap(&self, tokens: &[u32]) -> Option<usize> {
        if self.hashes.is_empty() {
            return None;
        }
        let set: HashSet<u64> = self.hashes.iter().copied().collect();
        tokens.windows(SHINGLE).position(|w| set.contains(&hash(w)))
    }
}

/// FNV-1a over the token ids' bytes.
fn hash(tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for t in tokens {
        for b in t.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, rng};
    use rand::Rng;

    #[test]
    fn finds_any_long_overlap_and_nothing_else() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let calib: Vec<u32> = (0..4096).map(|_| r.random_range(0..50_000)).collect();
        let fp = TextFingerprint::of_tokens(&calib);
        let fresh: Vec<u32> = (0..2048).map(|_| r.random_range(0..50_000)).collect();
        assert_eq!(fp.first_overlap(&fresh), None, "seed {seed}");
        // 63 shared tokens at an arbitrary offset always contain a whole stride-aligned shingle.
        let start = r.random_range(0..4096 - 63);
        let mut eval = fresh.clone();
        eval.splice(500..500, calib[start..start + 63].iter().copied());
        let at = fp.first_overlap(&eval).unwrap_or_else(|| panic!("seed {seed}: missed overlap at {start}"));
        assert!((500..500 + 63).contains(&at), "seed {seed}: {at}");
        assert_eq!(TextFingerprint::default().first_overlap(&eval), None);
    }
}
