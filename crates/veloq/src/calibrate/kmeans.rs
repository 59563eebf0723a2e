//! k-means for codebook training: k-means++ seeding on a sample, Lloyd iterations with the fused
//! nearest-centroid kernel for the assignment, empty clusters re-seeded from the worst-fit points.
//!
//! Deterministic for a seed whatever the thread count: assignment is per point, and the centroid
//! update sums fixed chunks in f64 and adds the chunk sums in order.

use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rayon::prelude::*;

use crate::codec::codebook::Codebook;
use crate::codec::search::{assign_points, Metric};
use crate::error::{check_finite, Error, Result};

#[derive(Clone, Debug)]
/// How k-means runs.
pub struct KMeansConfig {
    /// Number of centroids.
    pub k: usize,
    /// Lloyd iterations at most.
    pub max_iter: usize,
    /// Stop when an iteration lowers the mean squared error by less than this fraction.
    pub tol: f64,
    /// Seed of the seeding and sampling.
    pub seed: u64,
    /// Points drawn for k-means++ seeding (seeding costs k passes over them).
    pub init_sample: usize,
    /// Points used for training at most; a larger input is subsampled (deterministically).
    pub max_points: usize,
}

impl KMeansConfig {
    /// `k` centroids, the default iterations and sample.
    pub fn new(k: usize, seed: u64) -> Self {
        Self { k, max_iter: 30, tol: 1e-4, seed, init_sample: 32 * 1024, max_points: 1 << 21 }
    }
}

/// How a run went; `mse` holds the mean squared error per point after each assignment.
#[derive(Clone, Debug, PartialEq)]
pub struct KMeansReport {
    /// Points clustered (after sampling).
    pub points: usize,
    /// Lloyd iterations run.
    pub iterations: usize,
    /// Whether the assignments stopped changing.
    pub converged: bool,
    /// Mean squared error after each iteration.
    pub mse: Vec<f64>,
    /// Empty clusters re-seeded over the whole run.
    pub reseeded: usize,
}

impl KMeansReport {
    /// The last iteration's mean squared error.
    pub fn final_mse(&self) -> f64 {
        *self.mse.last().unwrap_or(&f64::NAN)
    }
}

/// Clusters `points` (`[n, dim]`, dim ∈ {2, 4, 8}) and returns the codebook and the report.
/// `on_iter(iteration, mse)` is called after each assignment (for progress bars).
pub fn kmeans(
    points: &[f32],
    dim: usize,
    cfg: &KMeansConfig,
    on_iter: &(dyn Fn(usize, f64) + Sync),
) -> Result<(Codebook, KMeansReport)> {
    if dim == 0 || !points.len().is_multiple_of(dim) {
        return Err(Error::Shape(format!("k-means: {} values are not whole points of {dim}", points.len())));
    }
    let n_all = points.len() / dim;
    if cfg.k == 0 || n_all < cfg.k {
        return Err(Error::Config(format!("k-means: {n_all} points cannot train {} centroids", cfg.k)));
    }
    check_finite("k-means input", points)?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(cfg.seed);
    let owned;
    let points = if n_all > cfg.max_points {
        owned = gather(points, dim, &sample_indices(&mut rng, n_all, cfg.max_points));
        &owned[..]
    } else {
        points
    };
    let n = points.len() / dim;

    let mut centroids = seed_plus_plus(points, dim, cfg.k, cfg.init_sample, &mut rng)?;
    let (mut codes, mut dist) = (vec![0u16; n], vec![0.0f32; n]);
    let mut report = KMeansReport { points: n, iterations: 0, converged: false, mse: Vec::new(), reseeded: 0 };
    loop {
        let book = Codebook::new(dim, centroids.clone())?;
        assign_points(points, &book, Metric::Expanded, &mut codes, &mut dist);
        let mse = dist.par_iter().map(|&d| d as f64).sum::<f64>() / n as f64;
        on_iter(report.iterations, mse);
        if let Some(&prev) = report.mse.last() {
            if prev - mse <= cfg.tol * prev {
                report.converged = true;
            }
        }
        report.mse.push(mse);
        if report.converged || report.iterations == cfg.max_iter {
            return Ok((book, report));
        }
        report.reseeded += update(points, dim, &codes, &dist, &mut centroids);
        report.iterations += 1;
    }
}

/// Recomputes each centroid as the mean of its points; empty clusters take the points that fit
/// their centroid worst. Returns how many were re-seeded.
fn update(points: &[f32], dim: usize, codes: &[u16], dist: &[f32], centroids: &mut [f32]) -> usize {
    let k = centroids.len() / dim;
    let n = codes.len();
    let chunk = 4096.max(n.div_ceil(64));
    let partial: Vec<(Vec<f64>, Vec<u64>)> = codes
        .par_chunks(chunk)
        .enumerate()
        .map(|(t, cs)| {
            let (mut sums, mut counts) = (vec![0.0f64; k * dim], vec![0u64; k]);
            for (i, &c) in cs.iter().enumerate() {
                let p = &points[(t * chunk + i) * dim..][..dim];
                let s = &mut sums[c as usize * dim..][..dim];
                for d in 0..dim {
                    s[d] += p[d] as f64;
                }
                counts[c as usize] += 1;
            }
            (sums, counts)
        })
        .collect();
    let (mut sums, mut counts) = (vec![0.0f64; k * dim], vec![0u64; k]);
    for (s, c) in partial {
        sums.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        counts.iter_mut().zip(c).for_each(|(a, b)| *a += b);
    }
    let empty: Vec<usize> = (0..k).filter(|&c| counts[c] == 0).collect();
    if !empty.is_empty() {
        let mut worst: Vec<usize> = (0..n).collect();
        worst.select_nth_unstable_by(empty.len() - 1, |&a, &b| dist[b].total_cmp(&dist[a]).then(a.cmp(&b)));
        worst.truncate(empty.len());
        worst.sort_by(|&a, &b| dist[b].total_cmp(&dist[a]).then(a.cmp(&b)));
        for (&c, &p) in empty.iter().zip(&worst) {
            sums[c * dim..(c + 1) * dim]
                .iter_mut()
                .zip(&points[p * dim..(p + 1) * dim])
                .for_each(|(s, &v)| *s = v as f64);
            counts[c] = 1;
        }
    }
    for c in 0..k {
        for d in 0..dim {
            centroids[c * dim + d] = (sums[c * dim + d] / counts[c] as f64) as f32;
        }
    }
    empty.len()
}

/// Greedy k-means++ on a random sample of the points: each step draws `2 + ln k` candidates by D²
/// sampling and keeps the one that lowers the total D² most. Plain k-means++ often misses a small
/// cluster sitting next to a big one (its D² mass is tiny); greedy seeding rarely does.
fn seed_plus_plus(
    points: &[f32],
    dim: usize,
    k: usize,
    sample: usize,
    rng: &mut Xoshiro256PlusPlus,
) -> Result<Vec<f32>> {
    let n = points.len() / dim;
    let sample = gather(points, dim, &sample_indices(rng, n, sample.max(k).min(n)));
    let m = sample.len() / dim;
    let trials = 2 + (k as f64).ln() as usize;
    let mut centroids = Vec::with_capacity(k * dim);
    let first = rng.random_range(0..m);
    centroids.extend_from_slice(&sample[first * dim..(first + 1) * dim]);
    let mut d2 = vec![f32::INFINITY; m];
    relax(&mut d2, &sample, dim, &centroids[..dim]);
    for _ in 1..k {
        let total: f64 = d2.iter().map(|&v| v as f64).sum();
        let pick = if total > 0.0 {
            let mut draws: Vec<f64> = (0..trials).map(|_| rng.random::<f64>() * total).collect();
            draws.sort_by(f64::total_cmp);
            let candidates = inverse_cdf(&d2, &draws);
            // The candidate whose addition leaves the least D² (ties → first drawn in order).
            let mut best = (f64::INFINITY, candidates[0]);
            for &c in &candidates {
                let cand = &sample[c * dim..(c + 1) * dim];
                let cost: f64 =
                    d2.par_iter().zip(sample.par_chunks_exact(dim)).map(|(&d, p)| d.min(sq_dist(p, cand)) as f64).sum();
                if cost < best.0 {
                    best = (cost, c);
                }
            }
            best.1
        } else {
            // Fewer distinct points than k: duplicates are unavoidable; Lloyd re-seeds them.
            rng.random_range(0..m)
        };
        let c = sample[pick * dim..(pick + 1) * dim].to_vec();
        relax(&mut d2, &sample, dim, &c);
        centroids.extend_from_slice(&c);
    }
    Ok(centroids)
}

fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// d2[i] = min(d2[i], ‖p_i − c‖²).
fn relax(d2: &mut [f32], sample: &[f32], dim: usize, c: &[f32]) {
    d2.par_iter_mut().zip(sample.par_chunks_exact(dim)).for_each(|(d, p)| *d = d.min(sq_dist(p, c)));
}

/// Indices where the running sum of `weights` first exceeds each of the sorted `draws`.
fn inverse_cdf(weights: &[f32], draws: &[f64]) -> Vec<usize> {
    let mut out = Vec::with_capacity(draws.len());
    let (mut acc, mut i) = (0.0f64, 0usize);
    for &u in draws {
        while i < weights.len() - 1 && acc + weights[i] as f64 <= u {
            acc += weights[i] as f64;
            i += 1;
        }
        out.push(i);
    }
    out
}

/// `count` distinct indices below `n`, sorted (so gathered data keeps the input's order).
fn sample_indices(rng: &mut Xoshiro256PlusPlus, n: usize, count: usize) -> Vec<usize> {
    if count >= n {
        return (0..n).collect();
    }
    let mut idx = rand::seq::index::sample(rng, n, count).into_vec();
    idx.sort_unstable();
    idx
}

fn gather(points: &[f32], dim: usize, idx: &[usize]) -> Vec<f32> {
    idx.iter().flat_map(|&i| points[i * dim..(i + 1) * dim].iter().copied()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, normal, rng};

    /// Points around `centers` blob centres (σ = 10, redrawn until every pair is ≥ 4 apart, so
    /// blobs of noise σ `spread` ≤ 0.1 are truly separate) with σ·`spread` noise.
    fn blobs(seed: u64, centers: usize, per: usize, dim: usize, spread: f32) -> (Vec<f32>, Vec<f32>) {
        let mut r = rng(seed);
        let c = loop {
            let c = normal(&mut r, centers * dim, 10.0);
            let close =
                (0..centers).any(|a| (0..a).any(|b| sq_dist(&c[a * dim..][..dim], &c[b * dim..][..dim]) < 16.0));
            if !close {
                break c;
            }
        };
        let noise = normal(&mut r, centers * per * dim, spread);
        let mut x = Vec::with_capacity(centers * per * dim);
        for i in 0..centers * per {
            for d in 0..dim {
                x.push(c[(i % centers) * dim + d] + noise[i * dim + d]);
            }
        }
        (x, c)
    }

    #[test]
    fn recovers_separated_blobs() {
        let seed = fresh_seed();
        let (x, _) = blobs(seed, 16, 500, 4, 0.1);
        let cfg = KMeansConfig::new(16, seed);
        let (book, rep) = kmeans(&x, 4, &cfg, &|_, _| {}).unwrap();
        assert_eq!(book.len(), 16);
        // Per-point MSE of the true partition is 4 × 0.01; k-means++ with Lloyd should land there.
        assert!(rep.final_mse() < 0.05, "seed {seed}: {rep:?}");
        assert!(rep.converged, "seed {seed}: {rep:?}");
        for w in rep.mse.windows(2) {
            assert!(w[1] <= w[0] * (1.0 + 1e-6), "seed {seed}: mse rose {rep:?}");
        }
    }

    #[test]
    fn deterministic_for_a_seed_whatever_the_threads() {
        let (x, _) = blobs(7, 40, 300, 8, 1.0);
        let cfg = KMeansConfig { init_sample: 2000, max_points: 10_000, ..KMeansConfig::new(64, 42) };
        let (a, ra) = kmeans(&x, 8, &cfg, &|_, _| {}).unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let (b, rb) = pool.install(|| kmeans(&x, 8, &cfg, &|_, _| {})).unwrap();
        assert_eq!(a, b);
        assert_eq!(ra, rb);
        let (c, _) = kmeans(&x, 8, &KMeansConfig { seed: 43, ..cfg }, &|_, _| {}).unwrap();
        assert_ne!(a, c);
    }

    #[test]
    fn empty_clusters_are_reseeded() {
        // 4 distinct points, 6 clusters: seeding must duplicate centroids, the duplicates lose
        // every tie and come out empty, and the update re-seeds them instead of dividing by zero.
        let (base, _) = blobs(3, 4, 1, 2, 0.0);
        let x: Vec<f32> = base.iter().cycle().take(4 * 2 * 50).copied().collect();
        let (book, rep) = kmeans(&x, 2, &KMeansConfig::new(6, 1), &|_, _| {}).unwrap();
        assert!(book.centroids().iter().all(|v| v.is_finite()));
        assert!(rep.reseeded > 0, "{rep:?}");
        // Zero up to the cancellation in ‖c‖² − 2x·c + ‖x‖² (coordinates ~10, so ulps ~1e-5).
        assert!(rep.final_mse() < 1e-4, "{rep:?}");
    }

    #[test]
    fn rejects_bad_input() {
        assert!(kmeans(&[1.0; 10], 4, &KMeansConfig::new(2, 0), &|_, _| {}).is_err());
        assert!(kmeans(&[1.0; 8], 4, &KMeansConfig::new(4, 0), &|_, _| {}).is_err());
        let mut x = vec![1.0; 400];
        x[5] = f32::NAN;
        assert!(kmeans(&x, 4, &KMeansConfig::new(4, 0), &|_, _| {}).is_err());
    }
}
