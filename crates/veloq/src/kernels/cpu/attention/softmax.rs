//! The running state of an online softmax (flash attention's `m`, `l`): scores arrive in tiles,
//! the maximum may move, and what was accumulated so far is rescaled when it does.

/// Running maximum score and sum of weights of one query head; the weighted sum it scales lives
/// beside it in the caller's buffer (weights are `exp(score − m)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Softmax {
    /// Largest score so far.
    pub m: f32,
    /// Sum of `exp(score − m)` so far.
    pub l: f32,
}

impl Default for Softmax {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl Softmax {
    /// Nothing attended yet.
    pub const EMPTY: Self = Self { m: f32::NEG_INFINITY, l: 0.0 };

    /// Turns `scores` into weights relative to the running maximum (−∞ weighs 0) and adds them to
    /// the sum; when the maximum moves, `acc` (what the earlier weights accumulated) and the sum
    /// are rescaled first.
    #[inline]
    pub fn fold(&mut self, scores: &mut [f32], acc: &mut [f32]) {
        let f = self.fold_weights(scores);
        if f != 1.0 {
            acc.iter_mut().for_each(|a| *a *= f);
        }
    }

    /// [`fold`](Self::fold) for a weighted sum the caller keeps in its own layout: returns the
    /// factor that sum must be scaled by (1 when the maximum did not move or nothing was summed).
    #[inline]
    pub fn fold_weights(&mut self, scores: &mut [f32]) -> f32 {
        let top = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let f = if top > self.m { self.move_max(top) } else { 1.0 };
        if self.m == f32::NEG_INFINITY {
            scores.fill(0.0);
            return f;
        }
        let m = self.m;
        let mut sum = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - m).exp();
            sum += *s;
        }
        self.l += sum;
        f
    }

    /// Moves the reference maximum up to `m`, rescaling the sum; returns the factor for what the
    /// earlier weights accumulated (1 when there were none).
    #[inline]
    fn move_max(&mut self, m: f32) -> f32 {
        let f = if self.l != 0.0 { (self.m - m).exp() } else { 1.0 };
        self.l *= f;
        self.m = m;
        f
    }

    /// Moves the reference maximum up to `m`, rescaling the sum and `acc`.
    #[inline]
    fn rescale(&mut self, m: f32, acc: &mut [f32]) {
        let f = self.move_max(m);
        if f != 1.0 {
            acc.iter_mut().for_each(|a| *a *= f);
        }
    }

    /// Merges another partial (`other`, its weighted sum `other_acc`) into this one (`acc`).
    pub fn merge(&mut self, acc: &mut [f32], other: Softmax, other_acc: &[f32]) {
        if other.l == 0.0 {
            return;
        }
        if other.m > self.m {
            self.rescale(other.m, acc);
        }
        let f = (other.m - self.m).exp();
        self.l += f * other.l;
        acc.iter_mut().zip(other_acc).for_each(|(a, b)| *a += f * b);
    }

    /// Divides the weighted sum by the total weight (0 where nothing was attended).
    pub fn finish(&self, acc: &mut [f32]) {
        let inv = if self.l > 0.0 { 1.0 / self.l } else { 0.0 };
        acc.iter_mut().for_each(|a| *a *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, normal, rng};

    /// Folding scores tile by tile, and merging two halves, equal one softmax over all of them.
    #[test]
    fn tiles_and_merges_equal_one_softmax() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let n = 97;
        let mut scores = normal(&mut r, n, 4.0);
        scores[13] = f32::NEG_INFINITY;
        let values = normal(&mut r, n * 3, 1.0);
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = scores.iter().map(|s| ((s - m) as f64).exp()).collect();
        let total: f64 = w.iter().sum();
        let want: Vec<f64> =
            (0..3).map(|d| (0..n).map(|i| w[i] * values[i * 3 + d] as f64).sum::<f64>() / total).collect();
        let run = |lo: usize, hi: usize, tile: usize| {
            let (mut s, mut acc) = (Softmax::EMPTY, vec![0.0f32; 3]);
            for t0 in (lo..hi).step_by(tile) {
                let t1 = (t0 + tile).min(hi);
                let mut sc = scores[t0..t1].to_vec();
                s.fold(&mut sc, &mut acc);
                for (i, wi) in sc.iter().enumerate() {
                    for d in 0..3 {
                        acc[d] += wi * values[(t0 + i) * 3 + d];
                    }
                }
            }
            (s, acc)
        };
        for tile in [1, 7, 64, 200] {
            let (s, mut acc) = run(0, n, tile);
            s.finish(&mut acc);
            for d in 0..3 {
                assert!((acc[d] as f64 - want[d]).abs() < 1e-5, "seed {seed} tile {tile}: {} vs {}", acc[d], want[d]);
            }
        }
        let (mut a, mut acc_a) = run(0, 40, 16);
        let (b, acc_b) = run(40, n, 16);
        a.merge(&mut acc_a, b, &acc_b);
        a.finish(&mut acc_a);
        for d in 0..3 {
            assert!((acc_a[d] as f64 - want[d]).abs() < 1e-5, "seed {seed} merged: {} vs {}", acc_a[d], want[d]);
        }
        // An empty partial changes nothing, and merges into an empty one.
        let (mut e, mut acc_e) = (Softmax::EMPTY, vec![0.0f32; 3]);
        e.merge(&mut acc_e, a, &acc_a);
        assert_eq!((e, acc_e.clone()), (a, acc_a.clone()));
        a.merge(&mut acc_a, Softmax::EMPTY, &[0.0; 3]);
        assert_eq!(acc_a, acc_e);
    }
}
