//! Random inputs for tests: fresh draws every run unless a test pins the seed, never zeros.

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};
use rand_xoshiro::Xoshiro256PlusPlus;

use crate::codec::codebook::{Codebook, CodebookSet, Granularity, PqShape};

pub fn rng(seed: u64) -> Xoshiro256PlusPlus {
    Xoshiro256PlusPlus::seed_from_u64(seed)
}

/// A seed that differs between runs (printed by callers on failure).
pub fn fresh_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    t ^ (std::process::id() as u64).rotate_left(32)
}

pub fn normal(rng: &mut impl Rng, n: usize, std: f32) -> Vec<f32> {
    let d = Normal::new(0.0, std).unwrap();
    (0..n).map(|_| d.sample(rng)).collect()
}

/// Gaussian data with a few channels scaled up, like real keys.
pub fn outlier_rows(rng: &mut impl Rng, rows: usize, dim: usize) -> Vec<f32> {
    let mut x = normal(rng, rows * dim, 1.0);
    for r in 0..rows {
        for c in [1usize, dim / 3, dim - 2] {
            x[r * dim + c] *= 12.0;
        }
    }
    x
}

pub fn books(rng: &mut impl Rng, shape: PqShape, granularity: Granularity, subspaces: usize) -> CodebookSet {
    let count = match granularity {
        Granularity::PerLayer => 1,
        Granularity::PerSubspace => subspaces,
    };
    let books = (0..count)
        .map(|_| Codebook::new(shape.sub_dim, normal(rng, shape.centroids() * shape.sub_dim, 1.0)).unwrap())
        .collect();
    CodebookSet::new(shape, granularity, subspaces, books).unwrap()
}
