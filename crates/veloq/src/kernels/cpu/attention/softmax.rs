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
        scores.iter_mut().for_each(|s| *s = exp(*s - m));
        // Eight sums, so the adds vectorise without reassociation flags.
        let mut sums = [0.0f32; 8];
        let chunks = scores.chunks_exact(8);
        let tail: f32 = chunks.remainder().iter().sum();
        for c in chunks {
            (0..8).for_each(|i| sums[i] += c[i]);
        }
        self.l += sums.iter().sum::<f32>() + tail;
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

/// `e^x` for the softmax's arguments (x ≤ 0; −∞ gives 0), in straight-line f32 arithmetic that
/// the compiler vectorises over a slice, where libm's `expf` is a call per element (the softmax's
/// exponentials were a tenth of decode attention). x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by
/// Cephes' degree-6 polynomial (relative error ≈ 1e-7), 2^n put in the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n·LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Below this 2^n leaves the normal range: the result is 0 to f32's precision of a weight.
    const LOW: f32 = -87.0;
    const HIGH: f32 = 88.0;
    let c = x.clamp(LOW, HIGH);
    let n = (c * LOG2E + 0.5).floor();
    let r = c - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    if x < LOW {
        0.0
    } else {
        e * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, normal, rng};

    /// [`exp`] within a few f32 ulps of the exact exponential over the softmax's range, 0 at −∞
    /// and below its floor, 1 at 0.
    #[test]
    fn exp_matches_the_exact_exponential() {
        let seed = fresh_seed();
        let mut r = rng(seed);
        let xs = normal(&mut r, 100_000, 20.0);
        for &x in xs.iter().map(|x| -x.abs()).collect::<Vec<_>>().iter().chain(&[0.0, -1e-30, -86.9, -30.5]) {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            if x < -87.0 {
                assert_eq!(got, 0.0, "seed {seed}: exp({x})");
            } else {
                // Cephes' polynomial is within ~1 ulp on |r| ≤ ln 2 / 2; the reduction, the
                // Horner steps and the final scale round a few times more: 4 ulps. Plain f32
                // arithmetic with no run-time dispatch, so the same bits on every x86-64.
                assert!(
                    (got - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                    "seed {seed}: exp({x}) = {got}, not {want}"
                );
            }
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

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
