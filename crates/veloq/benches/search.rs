//! Criterion: fused nearest-centroid search (both distance forms) against the materialising
//! reference, and k-means training of a 256×8 codebook. `veloq bench search` adds peak memory.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rand_xoshiro::Xoshiro256PlusPlus;

use veloq::calibrate::{kmeans, KMeansConfig};
use veloq::codec::codebook::{Codebook, CodebookSet, Granularity, PqShape};
use veloq::codec::pack::packed_len;
use veloq::codec::search::reference::search_rows_naive;
use veloq::codec::search::search_rows;
use veloq::codec::search::Metric;

fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Xoshiro256PlusPlus::seed_from_u64(seed);
    let d = Normal::new(0.0f32, 1.0).unwrap();
    (0..n).map(|_| d.sample(&mut r)).collect()
}

fn search(c: &mut Criterion) {
    let mut g = c.benchmark_group("nearest_centroid");
    g.sample_size(10);
    for (s, d, h, sd) in [(128usize, 128usize, 8usize, 8usize), (512, 128, 8, 8), (1024, 256, 4, 4)] {
        let shape = PqShape::new(sd, 8).unwrap();
        let books = CodebookSet::new(
            shape,
            Granularity::PerLayer,
            d / sd,
            vec![Codebook::new(sd, normal(256 * sd, 1)).unwrap()],
        )
        .unwrap();
        let x = normal(s * h * d, 2);
        let n = s * h * d / sd;
        let mut out = vec![0u8; packed_len(n, 8)];
        g.throughput(Throughput::Elements(n as u64));
        let id = format!("S{s}_D{d}_H{h}_sd{sd}");
        for metric in [Metric::Exact, Metric::Expanded] {
            g.bench_function(BenchmarkId::new(format!("fused_{}", metric.name()), &id), |b| {
                b.iter(|| search_rows(&x, d, &books, metric, &mut out).unwrap())
            });
        }
        g.bench_function(BenchmarkId::new("naive", &id), |b| b.iter(|| search_rows_naive(&x, d, &books)));
    }
    g.finish();
}

fn train(c: &mut Criterion) {
    let mut g = c.benchmark_group("kmeans");
    g.sample_size(10);
    let x = normal((1 << 20) * 8, 3);
    g.bench_function("256x8_1M_subvectors_10_iters", |b| {
        b.iter(|| {
            kmeans(&x, 8, &KMeansConfig { max_iter: 10, tol: 0.0, ..KMeansConfig::new(256, 1) }, &|_, _| {}).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, search, train);
criterion_main!(benches);
