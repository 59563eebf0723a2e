//! Candidate lists for the nearest-centroid search of a 2-D codebook (sub-vectors of 2, the
//! default's format): the plane around the centroids is cut into a `cells × cells` grid, and each
//! cell lists the centroids that can be nearest to any point in it, so a search scans a handful
//! of centroids instead of all of them. The GPU quantize kernel reads these lists; a point outside
//! the grid (or not finite) is searched against every centroid.
//!
//! The lists are exact, not approximate: for the distance as the kernel computes it in f32
//! ([`distance`]: ‖c‖² − 2 x·c with fused multiply-adds in a fixed order), the list of a point's
//! cell holds every centroid that could win the full scan, ties included, so the scan over the
//! list in ascending index order returns the same index as the scan over every centroid. Why:
//! the winner `w` of the full scan is within the rounding slack `Δ` of the true nearest `n` in
//! exact distance, `d(x, w)² ≤ d(x, n)² + Δ ≤ U + Δ` where `U` is the cell's smallest farthest
//! distance to any centroid, and `d(x, w)² ≥` `w`'s nearest distance to the cell; a centroid is
//! listed when that nearest distance is at most `U + Δ`. Cells are widened by a hundredth of
//! their width so that a point whose cell index rounds to a neighbour still lies inside the cell
//! its list was built for. `Δ` bounds the f32 rounding of the distance and of the stored norms
//! with a factor of 4 to spare: a larger slack only lengthens lists.

use crate::codec::codebook::Codebook;

/// Cells per axis.
pub const CELLS: usize = 64;
/// Most list entries a grid may hold (a byte each; more means cells too coarse to pay).
pub const MAX_ENTRIES: usize = 16 * 1024;
/// The grid spans the centroids' bounding box widened by this fraction of its extent each side.
const MARGIN: f64 = 0.5;
/// f32's unit roundoff.
const U: f64 = f32::EPSILON as f64 / 2.0;

/// The distance of `x` to centroid `k` of `book` up to ‖x‖², exactly as the kernels compute it:
/// `fma(−2, fma(x₁, c₁, x₀·c₀), ‖c‖²)`.
pub fn distance(book: &Codebook, x: [f32; 2], k: usize) -> f32 {
    let c = book.centroid(k);
    let dot = x[1].mul_add(c[1], x[0] * c[0]);
    (-2.0f32).mul_add(dot, book.norms()[k])
}

/// Nearest of `candidates` (ascending indices) to `x` by [`distance`]: lower distance, then the
/// lower index (the first in the scan).
fn scan(book: &Codebook, x: [f32; 2], candidates: impl Iterator<Item = usize>) -> usize {
    let (mut best, mut bi) = (f32::MAX, 0);
    for k in candidates {
        let d = distance(book, x, k);
        if d < best {
            (best, bi) = (d, k);
        }
    }
    bi
}

/// The full scan: every centroid in order (what the kernels do without a grid).
pub fn nearest_scan(book: &Codebook, x: [f32; 2]) -> usize {
    scan(book, x, 0..book.len())
}

/// A 2-D codebook's candidate lists.
#[derive(Clone, Debug, PartialEq)]
pub struct NearestGrid {
    /// The grid's lower corner.
    pub lo: [f32; 2],
    /// Cells per unit along each axis: a point's cell is `⌊(x − lo)·inv⌋` (f32 arithmetic).
    pub inv: [f32; 2],
    /// Cell `i·CELLS + j` (i along x₀) lists `entries[offsets[c]..offsets[c + 1]]`.
    pub offsets: Vec<u16>,
    /// Centroid indices, ascending within each cell.
    pub entries: Vec<u8>,
}

impl NearestGrid {
    /// The lists of `book`, or `None` where a grid does not apply: not 2-D, more than 256
    /// centroids (the entries are bytes), all centroids on a line along an axis, or lists longer
    /// than [`MAX_ENTRIES`] in all.
    pub fn build(book: &Codebook) -> Option<Self> {
        if book.sub_dim() != 2 || book.len() > 256 {
            return None;
        }
        let c: Vec<[f64; 2]> =
            (0..book.len()).map(|k| [book.centroid(k)[0] as f64, book.centroid(k)[1] as f64]).collect();
        let (mut lo, mut hi) = ([f64::MAX; 2], [f64::MIN; 2]);
        for p in &c {
            for a in 0..2 {
                lo[a] = lo[a].min(p[a]);
                hi[a] = hi[a].max(p[a]);
            }
        }
        if (0..2).any(|a| hi[a] - lo[a] <= 0.0) {
            return None;
        }
        let lo32 = [0, 1].map(|a| (lo[a] - MARGIN * (hi[a] - lo[a])) as f32);
        let inv = [0, 1].map(|a| (CELLS as f64 / ((1.0 + 2.0 * MARGIN) * (hi[a] - lo[a]))) as f32);
        // The cells as the kernel finds them, from the f32 corner and scale.
        let edge = |a: usize, i: usize| lo32[a] as f64 + i as f64 / inv[a] as f64;
        let width = [0, 1].map(|a| 1.0 / inv[a] as f64);
        // Rounding slack: |computed − exact| ≤ u(5‖c‖² + 12‖x‖‖c‖) per distance (the norms' f32
        // sum, the two fused multiply-adds, the last one), twice over (winner and nearest), ×4.
        let reach = [0, 1].map(|a| edge(a, 0).abs().max(edge(a, CELLS).abs()) + width[a]);
        let xmax = reach[0].hypot(reach[1]);
        let cmax = c.iter().map(|p| p[0].hypot(p[1])).fold(0.0, f64::max);
        let slack = 8.0 * U * (5.0 * cmax * cmax + 12.0 * xmax * cmax);
        let mut offsets = Vec::with_capacity(CELLS * CELLS + 1);
        let mut entries = Vec::new();
        offsets.push(0u16);
        let mut near = vec![0.0f64; c.len()];
        for i in 0..CELLS {
            for j in 0..CELLS {
                let cell =
                    [(i, 0), (j, 1)].map(|(n, a)| (edge(a, n) - width[a] / 100.0, edge(a, n + 1) + width[a] / 100.0));
                let mut bound = f64::MAX;
                for (k, p) in c.iter().enumerate() {
                    let (mut nd, mut fd) = (0.0, 0.0);
                    for a in 0..2 {
                        let (l, h) = cell[a];
                        let gap = (l - p[a]).max(p[a] - h).max(0.0);
                        let far = (p[a] - l).abs().max((p[a] - h).abs());
                        nd += gap * gap;
                        fd += far * far;
                    }
                    near[k] = nd;
                    bound = bound.min(fd);
                }
                entries.extend((0..c.len()).filter(|&k| near[k] <= bound + slack).map(|k| k as u8));
                if entries.len() > MAX_ENTRIES {
                    return None;
                }
                offsets.push(entries.len() as u16);
            }
        }
        Some(Self { lo: lo32, inv, offsets, entries })
    }

    /// The cell of `x` (as the kernel computes it), or `None` outside the grid or not finite.
    pub fn cell(&self, x: [f32; 2]) -> Option<usize> {
        let f = [0, 1].map(|a| (x[a] - self.lo[a]) * self.inv[a]);
        let inside = |v: f32| v >= 0.0 && v < CELLS as f32;
        (inside(f[0]) && inside(f[1])).then(|| f[0] as usize * CELLS + f[1] as usize)
    }

    /// The candidates of `x`'s cell, or `None` where `x` needs the full scan.
    pub fn candidates(&self, x: [f32; 2]) -> Option<&[u8]> {
        let c = self.cell(x)?;
        Some(&self.entries[self.offsets[c] as usize..self.offsets[c + 1] as usize])
    }

    /// The nearest centroid of `x`: the scan over its cell's list, or over every centroid
    /// outside the grid. Equal to [`nearest_scan`] for every `x` (the module's argument).
    pub fn nearest(&self, book: &Codebook, x: [f32; 2]) -> usize {
        match self.candidates(x) {
            Some(list) => scan(book, x, list.iter().map(|&k| k as usize)),
            None => nearest_scan(book, x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fresh_seed, rng};
    use rand::Rng;
    use rand_distr::{Distribution, Normal};
    use rand_xoshiro::Xoshiro256PlusPlus as StdRng;

    /// Clustered centroids (k-means-like: dense in the middle), with duplicates and points on a
    /// shared line among them, so that ties exist.
    fn book(rng: &mut StdRng, k: usize) -> Codebook {
        let n = Normal::new(0.0f32, 1.0).unwrap();
        let scale = rng.random_range(0.05f32..20.0);
        let mut c: Vec<f32> = (0..k * 2).map(|_| n.sample(rng) * scale).collect();
        for _ in 0..k / 16 {
            let (a, b) = (rng.random_range(0..k), rng.random_range(0..k));
            let (x, y) = (c[2 * a], c[2 * a + 1]);
            c[2 * b] = x;
            c[2 * b + 1] = y;
        }
        Codebook::new(2, c).unwrap()
    }

    /// Points where the scan's answer is fragile: equidistant from two centroids, on cell edges,
    /// on centroids, far outside, and spread like the data.
    fn points(rng: &mut StdRng, b: &Codebook, g: &NearestGrid, n: usize) -> Vec<[f32; 2]> {
        let k = b.len();
        let normal = Normal::new(0.0f32, 1.0).unwrap();
        let spread = (0..k).map(|i| b.centroid(i)[0].abs().max(b.centroid(i)[1].abs())).fold(0.0, f32::max);
        (0..n)
            .map(|i| {
                let (p, q) = (b.centroid(rng.random_range(0..k)), b.centroid(rng.random_range(0..k)));
                match i % 6 {
                    0 => [(p[0] + q[0]) / 2.0, (p[1] + q[1]) / 2.0],
                    1 => {
                        let (ci, cj) = (rng.random_range(0..=CELLS), rng.random_range(0..=CELLS));
                        [g.lo[0] + ci as f32 / g.inv[0], g.lo[1] + cj as f32 / g.inv[1]]
                    }
                    2 => [p[0], p[1]],
                    3 => [normal.sample(rng) * spread * 4.0, normal.sample(rng) * spread * 4.0],
                    _ => [p[0] + normal.sample(rng) * spread / 16.0, p[1] + normal.sample(rng) * spread / 16.0],
                }
            })
            .collect()
    }

    #[test]
    fn the_grid_returns_the_full_scans_index_for_every_point() {
        let seed = fresh_seed();
        let mut rng = rng(seed);
        for round in 0..12 {
            let k = [16, 64, 256][round % 3];
            let b = book(&mut rng, k);
            let g = NearestGrid::build(&b).expect("a 2-D book of ≤ 256 centroids has a grid");
            let pts = points(&mut rng, &b, &g, 20_000);
            let mut listed = 0;
            for x in &pts {
                assert_eq!(
                    g.nearest(&b, *x),
                    nearest_scan(&b, *x),
                    "seed {seed}, book {round} ({k} centroids), point {x:?}"
                );
                listed += g.candidates(*x).map_or(0, |l| l.len());
            }
            // The grid is only worth its tables if a list is a small part of the book.
            assert!(listed < pts.len() * k / 4, "book {round}: {listed} candidates for {} points of {k}", pts.len());
        }
    }

    #[test]
    fn every_list_is_ascending_and_holds_each_centroids_own_cell() {
        let seed = fresh_seed();
        let mut rng = rng(seed);
        let b = book(&mut rng, 256);
        let g = NearestGrid::build(&b).unwrap();
        assert_eq!(g.offsets.len(), CELLS * CELLS + 1);
        for w in g.offsets.windows(2) {
            let list = &g.entries[w[0] as usize..w[1] as usize];
            assert!(!list.is_empty() && list.windows(2).all(|p| p[0] < p[1]));
        }
        // A point on a centroid is nearest to it (or to an identical one listed earlier).
        for k in 0..b.len() {
            let c = [b.centroid(k)[0], b.centroid(k)[1]];
            let list = g.candidates(c).expect("centroids lie inside the grid");
            assert!(list.iter().any(|&i| b.centroid(i as usize) == b.centroid(k)));
        }
    }

    #[test]
    fn books_without_a_grid_are_refused() {
        assert!(NearestGrid::build(&Codebook::new(4, vec![0.5; 64]).unwrap()).is_none());
        assert!(NearestGrid::build(&Codebook::new(2, vec![0.5; 2 * 300]).unwrap()).is_none());
        // All on one vertical line: no extent along x₀.
        let line: Vec<f32> = (0..32).flat_map(|i| [1.0, i as f32]).collect();
        assert!(NearestGrid::build(&Codebook::new(2, line).unwrap()).is_none());
        // Outside the grid and not finite: the full scan.
        let mut rng = rng(7);
        let b = book(&mut rng, 64);
        let g = NearestGrid::build(&b).unwrap();
        for x in [[f32::NAN, 0.0], [f32::INFINITY, 1.0], [1e30, -1e30]] {
            assert!(g.candidates(x).is_none());
            assert_eq!(g.nearest(&b, x), nearest_scan(&b, x));
        }
    }
}
