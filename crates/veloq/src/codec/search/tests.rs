use half::f16;

use super::reference::search_rows_naive;
use super::*;
use crate::codec::codebook::{Granularity, PqShape};
use crate::codec::pack::unpack;
use crate::testing::{books, fresh_seed, normal, rng};

fn unpacked(packed: &[u8], n: usize, bits: u32) -> Vec<u16> {
    let mut codes = vec![0u16; n];
    unpack(packed, bits, &mut codes).unwrap();
    codes
}

fn fused<T: Element>(x: &[T], dim: usize, books: &CodebookSet, metric: Metric) -> Vec<u16> {
    let shape = books.shape();
    let n = x.len() / shape.sub_dim;
    let mut out = vec![0xA5u8; packed_len(n, shape.bits)]; // poisoned
    search_rows(x, dim, books, metric, &mut out).unwrap();
    unpacked(&out, n, shape.bits)
}

fn dist(x: &[f32], c: &[f32]) -> f64 {
    x.iter().zip(c).map(|(a, b)| ((a - b) as f64).powi(2)).sum()
}

/// Reconstruction MSE of sub-vectors of `x` under `codes`, in f64.
fn mse(x: &[f32], dim: usize, books: &CodebookSet, codes: &[u16]) -> f64 {
    let sd = books.shape().sub_dim;
    let m = dim / sd;
    let total: f64 = codes
        .iter()
        .enumerate()
        .map(|(i, &c)| dist(&x[i * sd..(i + 1) * sd], books.book(i % m).centroid(c as usize)))
        .sum();
    total / x.len() as f64
}

/// (rows, dim, sub_dim, bits, granularity): odd row counts, every sub_dim, head dims 64–256.
const SHAPES: &[(usize, usize, usize, u32, Granularity)] = &[
    (1, 64, 8, 8, Granularity::PerLayer),
    (7, 64, 4, 8, Granularity::PerSubspace),
    (129, 128, 8, 8, Granularity::PerLayer),
    (65, 128, 2, 4, Granularity::PerSubspace),
    (200, 96, 4, 6, Granularity::PerLayer),
    (77, 256, 4, 8, Granularity::PerSubspace),
    (33, 80, 8, 12, Granularity::PerLayer),
    (300, 128, 8, 10, Granularity::PerSubspace),
    (513, 64, 2, 5, Granularity::PerLayer),
];

#[test]
fn exact_metric_is_bit_identical_to_reference() {
    let seed = fresh_seed();
    let mut rng = rng(seed);
    for &(rows, dim, sd, bits, gran) in SHAPES {
        let shape = PqShape::new(sd, bits).unwrap();
        let books = books(&mut rng, shape, gran, dim / sd);
        let x = normal(&mut rng, rows * dim, 1.0);
        let want = search_rows_naive(&x, dim, &books);
        assert_eq!(fused(&x, dim, &books, Metric::Exact), want, "seed {seed} shape {rows}x{dim} sd{sd} b{bits}");
    }
}

#[test]
fn simd_and_portable_lanes_agree() {
    let seed = fresh_seed();
    let mut rng = rng(seed);
    let select = lanes::select();
    for &(_, dim, sd, bits, gran) in SHAPES {
        let shape = PqShape::new(sd, bits).unwrap();
        let books = books(&mut rng, shape, gran, dim / sd);
        for _ in 0..20 {
            let mut xt = [[0.0f32; LANES]; 8];
            for row in xt.iter_mut().take(sd) {
                row.copy_from_slice(&normal(&mut rng, LANES, 1.0));
            }
            let a = select(&xt[..sd], books.book(0), Metric::Exact);
            let b = lanes::portable::search(&xt[..sd], books.book(0), Metric::Exact);
            assert_eq!(a, b, "seed {seed}");
            // Expanded: FMA and separate multiply-add round differently; the ranking value agrees
            // closely and the index may differ only where the values tie within that rounding.
            let a = select(&xt[..sd], books.book(0), Metric::Expanded);
            let b = lanes::portable::search(&xt[..sd], books.book(0), Metric::Expanded);
            for l in 0..LANES {
                assert!((a.1[l] - b.1[l]).abs() < 1e-4, "seed {seed}");
            }
        }
    }
}

/// The expanded form may pick a different centroid only on a near-tie, and then the two
/// candidates' true distances agree to rounding; overall reconstruction error is unchanged.
#[test]
fn expanded_metric_differs_only_on_near_ties() {
    let seed = fresh_seed();
    let mut rng = rng(seed);
    for &(rows, dim, sd, bits, gran) in SHAPES {
        let shape = PqShape::new(sd, bits).unwrap();
        let books = books(&mut rng, shape, gran, dim / sd);
        let x = normal(&mut rng, rows * dim, 1.0);
        let want = search_rows_naive(&x, dim, &books);
        let got = fused(&x, dim, &books, Metric::Expanded);
        let m = dim / sd;
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                let xi = &x[i * sd..(i + 1) * sd];
                let (dg, dw) = (
                    dist(xi, books.book(i % m).centroid(g as usize)),
                    dist(xi, books.book(i % m).centroid(w as usize)),
                );
                let scale: f64 = xi.iter().map(|v| (v * v) as f64).sum::<f64>() + 1.0;
                assert!((dg - dw).abs() <= 1e-5 * scale, "seed {seed}: not a near-tie: {dg} vs {dw}");
            }
        }
        let (a, b) = (mse(&x, dim, &books, &got), mse(&x, dim, &books, &want));
        assert!((a - b).abs() <= 1e-6 * b, "seed {seed}: mse {a} vs {b}");
    }
}

/// f16 inputs: indices may differ from the f32 reference only where f16 rounding can flip the
/// ranking, and the reconstruction MSE against the original f32 data agrees within 1%.
#[test]
fn f16_inputs_agree_up_to_rounding() {
    let seed = fresh_seed();
    let mut rng = rng(seed);
    for &(rows, dim, sd, bits, gran) in SHAPES {
        let shape = PqShape::new(sd, bits).unwrap();
        let books = books(&mut rng, shape, gran, dim / sd);
        let x = normal(&mut rng, rows.max(64) * dim, 1.0);
        let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let want = search_rows_naive(&x, dim, &books);
        for metric in [Metric::Exact, Metric::Expanded] {
            let got = fused(&xh, dim, &books, metric);
            let m = dim / sd;
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                if g != w {
                    let xi = &x[i * sd..(i + 1) * sd];
                    let book = books.book(i % m);
                    let (cg, cw) = (book.centroid(g as usize), book.centroid(w as usize));
                    // |d(x,cg) − d(x,cw)| ≤ 2 |x − x_h| · |cg − cw| bounds what rounding x can flip.
                    let err: f64 =
                        xi.iter().map(|&v| ((v - f16::from_f32(v).to_f32()) as f64).powi(2)).sum::<f64>().sqrt();
                    let gap = dist(cg, cw).sqrt();
                    let slack = 2.0 * err * gap + 1e-5 * (1.0 + xi.iter().map(|v| (v * v) as f64).sum::<f64>());
                    assert!((dist(xi, cg) - dist(xi, cw)).abs() <= slack, "seed {seed}");
                }
            }
            let (a, b) = (mse(&x, dim, &books, &got), mse(&x, dim, &books, &want));
            assert!((a - b).abs() <= 0.01 * b, "seed {seed}: f16 mse {a} vs f32 {b}");
        }
    }
}

#[test]
fn ties_go_to_the_lowest_index() {
    let shape = PqShape::new(4, 4).unwrap();
    let mut c = normal(&mut rng(3), 16 * 4, 1.0);
    // Centroids 5, 9 and 12 identical; inputs equal to them.
    for k in [9usize, 12] {
        let src: Vec<f32> = c[5 * 4..6 * 4].to_vec();
        c[k * 4..(k + 1) * 4].copy_from_slice(&src);
    }
    let book = Codebook::new(4, c.clone()).unwrap();
    let books = CodebookSet::new(shape, Granularity::PerLayer, 2, vec![book]).unwrap();
    let x: Vec<f32> = c[5 * 4..6 * 4].iter().chain(&c[9 * 4..10 * 4]).copied().collect();
    for metric in [Metric::Exact, Metric::Expanded] {
        assert_eq!(fused(&x, 8, &books, metric), vec![5, 5], "{metric:?}");
    }
    assert_eq!(search_rows_naive(&x, 8, &books), vec![5, 5]);
}

#[test]
fn non_finite_input_is_an_error() {
    let shape = PqShape::new(8, 8).unwrap();
    let books = books(&mut rng(1), shape, Granularity::PerLayer, 8);
    let mut x = normal(&mut rng(2), 100 * 64, 1.0);
    x[777] = f32::NAN;
    let mut out = vec![0u8; packed_len(100 * 8, 8)];
    for metric in [Metric::Exact, Metric::Expanded] {
        let err = search_rows(&x, 64, &books, metric, &mut out).unwrap_err();
        assert!(err.to_string().contains("non-finite"), "{err}");
    }
}

#[test]
fn wrong_output_size_is_an_error() {
    let shape = PqShape::new(8, 8).unwrap();
    let books = books(&mut rng(1), shape, Granularity::PerLayer, 8);
    let x = normal(&mut rng(2), 10 * 64, 1.0);
    let mut out = vec![0u8; 79];
    assert!(search_rows(&x, 64, &books, Metric::Exact, &mut out).is_err());
    assert!(search_rows(&x[..63], 64, &books, Metric::Exact, &mut out).is_err());
}

#[test]
fn assign_points_reports_true_distances() {
    let seed = fresh_seed();
    let mut rng = rng(seed);
    for sd in [2, 4, 8] {
        let shape = PqShape::new(sd, 6).unwrap();
        let books = books(&mut rng, shape, Granularity::PerLayer, 1);
        let n = 1000 + sd;
        let x = normal(&mut rng, n * sd, 1.0);
        let want = search_rows_naive(&x, sd, &books);
        for metric in [Metric::Exact, Metric::Expanded] {
            let (mut codes, mut d) = (vec![0u16; n], vec![0.0f32; n]);
            assign_points(&x, books.book(0), metric, &mut codes, &mut d);
            for i in 0..n {
                let true_d = dist(&x[i * sd..(i + 1) * sd], books.book(0).centroid(codes[i] as usize));
                assert!((d[i] as f64 - true_d).abs() < 1e-4 * (1.0 + true_d), "seed {seed}");
            }
            if metric == Metric::Exact {
                assert_eq!(codes, want, "seed {seed}");
            }
        }
    }
}
