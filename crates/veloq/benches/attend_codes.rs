//! Criterion: decode attention over VecInfer codes on the CPU, the three forms side by side for the
//! queries that share a kv head (a GQA group at decode): lookup tables per query
//! ([`codes::attend`], once per query), the queries' tables interleaved (`codes::attend_group`,
//! up to `GROUP` queries a pass) and tiles decoded into code space once and shared by matrix
//! products ([`codes::attend_many`]). The cache picks between them by the group's size; this
//! measures where each wins.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rand_xoshiro::Xoshiro256PlusPlus;

use veloq::calibrate::{train_codec, KMeansConfig};
use veloq::codec::codebook::PqShape;
use veloq::codec::vecinfer::CodecSpec;
use veloq::kernels::cpu::attention::codes::GROUP;
use veloq::kernels::cpu::attention::{codes, CodeBlock, CodeBlocks, CodesScratch, LutCodec, Softmax};

fn normal(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Xoshiro256PlusPlus::seed_from_u64(seed);
    let d = Normal::new(0.0f32, 1.0).unwrap();
    (0..n).map(|_| d.sample(&mut r)).collect()
}

fn attend(c: &mut Criterion) {
    let mut g = c.benchmark_group("attend_codes");
    g.sample_size(20);
    let (heads, block, len) = (1usize, 16usize, 4096usize);
    // SmolLM2's head (D 64) at the default 4 bits (sub_dim 2) and at 2 bits (sub_dim 4); Llama's (D 128) at 2.
    for (d, sd) in [(64usize, 2usize), (64, 4), (128, 4)] {
        let shape = PqShape::new(sd, 8).unwrap();
        let train = normal(2000 * heads * d, 1);
        let spec = |keys: bool| if keys { CodecSpec::keys(shape) } else { CodecSpec::values(shape) };
        let codec = |keys: bool, seed: u64| {
            Arc::new(train_codec(&train, heads, d, &spec(keys), &KMeansConfig::new(256, seed)).unwrap().0)
        };
        let (kc, vc) = (codec(true, 1), codec(false, 2));
        let x = normal(len * heads * d, 3);
        let n = block * heads * d;
        let kb: Vec<CodeBlock> = x.chunks(n).map(|r| kc.encode_vec(r).unwrap().into()).collect();
        let vb: Vec<CodeBlock> = x.chunks(n).map(|r| vc.encode_vec(r).unwrap().into()).collect();
        let blocks = CodeBlocks { keys: &kb, values: &vb, block, heads, len };
        let (kl, vl) = (LutCodec::new(kc), LutCodec::new(vc));
        for t in [1usize, 2, 3, 4, 8, 16] {
            let qs: Vec<f32> = normal(t * d, 4 + t as u64).iter().map(|q| q * 0.125).collect();
            let id = format!("D{d}_sd{sd}_S{len}_q{t}");
            g.throughput(Throughput::Elements((len * t) as u64));
            let mut s = CodesScratch::default();
            let mut out = vec![0.0f32; t * d];
            g.bench_function(BenchmarkId::new("tables", &id), |b| {
                b.iter(|| {
                    for (q, o) in qs.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                        std::hint::black_box(codes::attend(&kl, &vl, &blocks, 0, q, o, &mut s));
                    }
                })
            });
            let mut stats = vec![Softmax::EMPTY; t];
            g.bench_function(BenchmarkId::new("group", &id), |b| {
                b.iter(|| {
                    for ((q, o), st) in qs.chunks(GROUP * d).zip(out.chunks_mut(GROUP * d)).zip(stats.chunks_mut(GROUP))
                    {
                        codes::attend_group(&kl, &vl, &blocks, 0, q, st, o, &mut s);
                    }
                })
            });
            g.bench_function(BenchmarkId::new("tiles", &id), |b| {
                b.iter(|| codes::attend_many(&kl, &vl, &blocks, 0, &qs, &mut stats, &mut out, &mut s))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, attend);
criterion_main!(benches);
