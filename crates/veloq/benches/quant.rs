//! Criterion: block-quantized weight products at SmolLM2's shapes (width 576, MLP 1,536), one
//! token (a decode step) and four, Q4_1 and Q8_0 — `kernels::cpu::quant::Packed::matmul`, whatever
//! path it dispatches to on this CPU.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

use veloq::kernels::cpu::quant::{Format, Packed, BLOCK};

/// `m × k` weights of `format` with realistic scales.
fn weights(format: Format, rng: &mut impl Rng, m: usize, k: usize) -> Vec<u8> {
    let mut w = Vec::with_capacity(m * k / BLOCK * format.block_bytes());
    for _ in 0..m * k / BLOCK {
        let d = rng.random_range(0.002f32..0.02);
        w.extend(f16::from_f32(d).to_le_bytes());
        match format {
            Format::Q4_1 => {
                w.extend(f16::from_f32(-8.0 * d).to_le_bytes());
                w.extend((0..16).map(|_| rng.random::<u8>()));
            }
            Format::Q8_0 => w.extend((0..32).map(|_| rng.random::<u8>())),
        }
    }
    w
}

fn products(c: &mut Criterion) {
    let mut g = c.benchmark_group("quant_matmul");
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(7);
    for format in [Format::Q4_1, Format::Q8_0] {
        for (m, k) in [(1536usize, 576usize), (576, 1536)] {
            let w = weights(format, &mut rng, m, k);
            let packed = Packed::new(format, &w, m, k).unwrap();
            for n in [1usize, 4] {
                let x: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let mut out = vec![0f32; n * m];
                g.throughput(Throughput::Bytes(w.len() as u64));
                g.bench_with_input(BenchmarkId::new(format!("{format:?}_{m}x{k}"), n), &n, |b, &n| {
                    b.iter(|| packed.matmul(&x, n, &mut out).unwrap())
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, products);
criterion_main!(benches);
