//! Normalised Walsh–Hadamard rotation, applied in place by the O(D log D) butterfly.
//!
//! Quantization error spreads evenly over channels after a Hadamard rotation, so one codebook fits
//! all sub-spaces better. The normalised matrix H = H₂⊗…⊗H₂ / √D is symmetric and orthogonal
//! (H·H = I), so the same call rotates and un-rotates. Head dims that are not a power of two
//! (80, 96 in Phi-class models) get a block-diagonal Hadamard over power-of-two blocks taken
//! largest first (80 = 64 + 16, 96 = 64 + 32); that is still symmetric and orthogonal.

use crate::error::{Error, Result};

/// Largest head dimension supported; keeps every scratch buffer on the stack.
pub const MAX_HEAD_DIM: usize = 512;

/// A (block-diagonal) normalised Hadamard transform for one head dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hadamard {
    dim: usize,
    /// (offset, len) of each power-of-two block, len ≥ 2 unless dim is odd.
    blocks: Vec<(usize, usize)>,
}

impl Hadamard {
    /// Builds the rotation for `dim`. Fails for dims with a block of 1 (odd dims): a 1×1 block
    /// leaves a channel unrotated, which silently defeats the point of rotating.
    pub fn new(dim: usize) -> Result<Self> {
        if dim == 0 || dim > MAX_HEAD_DIM {
            return Err(Error::Config(format!("Hadamard: head_dim {dim} outside 1..={MAX_HEAD_DIM}")));
        }
        if dim % 2 == 1 {
            return Err(Error::Config(format!("Hadamard: odd head_dim {dim} would leave a channel unrotated")));
        }
        let mut blocks = Vec::new();
        let mut offset = 0;
        let mut rest = dim;
        while rest > 0 {
            let len = 1usize << (usize::BITS - 1 - rest.leading_zeros());
            blocks.push((offset, len));
            offset += len;
            rest -= len;
        }
        Ok(Self { dim, blocks })
    }

    /// Its dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// True when the transform is one full Hadamard (power-of-two dim).
    pub fn is_full(&self) -> bool {
        self.blocks.len() == 1
    }

    /// Rotates `x` (length `dim`) in place; applying it twice restores `x` up to rounding.
    #[inline]
    pub fn apply(&self, x: &mut [f32]) {
        debug_assert_eq!(x.len(), self.dim);
        for &(off, len) in &self.blocks {
            fwht_normalised(&mut x[off..off + len]);
        }
    }

    /// Rotates every row of a row-major [rows, dim] buffer.
    pub fn apply_rows(&self, data: &mut [f32]) {
        for row in data.chunks_exact_mut(self.dim) {
            self.apply(row);
        }
    }
}

/// In-place fast Walsh–Hadamard transform scaled by 1/√n (n a power of two).
#[inline]
pub fn fwht_normalised(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = (*u + *v, *u - *v);
                *u = s;
                *v = d;
            }
        }
        h *= 2;
    }
    let scale = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Dense matrix of the transform, built by applying it to unit vectors.
    fn dense(h: &Hadamard) -> Vec<f32> {
        let d = h.dim();
        let mut m = vec![0.0; d * d];
        for i in 0..d {
            let mut e = vec![0.0; d];
            e[i] = 1.0;
            h.apply(&mut e);
            m[i * d..(i + 1) * d].copy_from_slice(&e);
        }
        m
    }

    #[test]
    fn matches_sylvester_construction_for_4() {
        let h = Hadamard::new(4).unwrap();
        let m = dense(&h);
        let s = [1., 1., 1., 1., 1., -1., 1., -1., 1., 1., -1., -1., 1., -1., -1., 1.];
        for (a, b) in m.iter().zip(s) {
            assert!((a - b * 0.5).abs() < 1e-7, "{m:?}");
        }
    }

    #[test]
    fn block_layout_for_non_power_of_two() {
        assert_eq!(Hadamard::new(80).unwrap().blocks, vec![(0, 64), (64, 16)]);
        assert_eq!(Hadamard::new(96).unwrap().blocks, vec![(0, 64), (64, 32)]);
        assert!(Hadamard::new(128).unwrap().is_full());
        assert!(Hadamard::new(0).is_err());
        assert!(Hadamard::new(7).is_err());
        assert!(Hadamard::new(1024).is_err());
    }

    proptest! {
        /// H·H = I and Hᵀ = H, checked on the dense matrix for every supported shape family.
        #[test]
        fn orthogonal_and_symmetric(dim in prop::sample::select(vec![2usize, 4, 8, 16, 32, 64, 80, 96, 128, 256])) {
            let h = Hadamard::new(dim).unwrap();
            let m = dense(&h);
            for i in 0..dim {
                for j in 0..dim {
                    prop_assert!((m[i * dim + j] - m[j * dim + i]).abs() < 1e-6);
                    let dot: f32 = (0..dim).map(|k| m[i * dim + k] * m[k * dim + j]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    prop_assert!((dot - want).abs() < 1e-5, "({i},{j}) = {dot}");
                }
            }
        }

        /// Rotation preserves the norm and applying it twice restores the input.
        #[test]
        fn involution_on_random_vectors(dim in prop::sample::select(vec![64usize, 80, 96, 128, 256]),
                                        seed in any::<u64>()) {
            use rand::{Rng, SeedableRng};
            let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
            let x: Vec<f32> = (0..dim).map(|_| rng.random_range(-4.0f32..4.0)).collect();
            let mut y = x.clone();
            let h = Hadamard::new(dim).unwrap();
            h.apply(&mut y);
            let (nx, ny): (f32, f32) = (x.iter().map(|v| v * v).sum(), y.iter().map(|v| v * v).sum());
            prop_assert!((nx - ny).abs() <= 1e-4 * nx.max(1.0));
            h.apply(&mut y);
            for (a, b) in x.iter().zip(&y) {
                prop_assert!((a - b).abs() < 1e-5);
            }
        }
    }
}
