//! The cache conformance suite: every property is one test body, run on every (cache, backend)
//! pair by the `conformance!` macro (in the manner of candle's `test_device!`): coded VecInfer
//! and dense fp16 and sliding-window caches on the CPU, portable (candle ops) and, built with
//! `--features cuda` on a GPU, CUDA backends; the scalar baselines (KIVI, Lloyd–Max) on the CPU
//! and portable backends (the latter is what serves them on a GPU).
//!
//! Every output is checked against an f64 reference over what the cache should hold: an
//! independent model of the storage policy (sink, coded span, recent rows) keeps each position's
//! value as the cache stores it — f16-rounded, or decoded from the CPU codec's codes once coded —
//! and attends over it with the causal (or sliding) mask. Inputs are fresh random draws each run
//! (the seed is printed on failure), keys with outlier channels like real ones.
//!
//! The CUDA pairs exist in builds with the `cuda` feature; there a missing GPU fails them unless
//! `VELOQ_SKIP_CUDA_TESTS=1` says to skip (as candle's device tests do).

use std::sync::Arc;

use candle_core::{Device, Tensor};
use half::f16;

use veloq::calibrate::{train_codec, KMeansConfig};
use veloq::codec::block::{BlockCodec, ScalarForm};
use veloq::codec::codebook::PqShape;
use veloq::codec::hadamard::Hadamard;
use veloq::codec::kivi::{KiviAxis, KiviCodec};
use veloq::codec::lloyd_max::LloydMaxCodec;
use veloq::codec::vecinfer::{CodecSpec, VecInferCodec};
use veloq_candle::cache::{CpuBackend, Heads, KvCache, LayerCache, Policy, SeqStep, Step, TensorBackend};
use veloq_candle::Error;

mod support;
use support::shadow::{round_f16, Shadow, Window, DEFAULT_WINDOW};

/// Where a cache runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Cpu,
    Portable,
    #[allow(dead_code)]
    Cuda,
}

/// Which cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Method {
    VecInfer,
    Fp16,
    /// Dense, attending the last `w` positions.
    Sliding(usize),
    Kivi,
    LloydMax,
}

/// A fresh seed each run, or `CONFORMANCE_SEED` to replay the one a failure printed.
fn seed() -> u64 {
    if let Some(s) = std::env::var("CONFORMANCE_SEED").ok().and_then(|s| s.parse().ok()) {
        return s;
    }
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
        ^ (std::process::id() as u64) << 40
}

/// Gaussian draws from a xorshift stream; `outliers` scales every 7th channel by 6 and shifts
/// every 5th by 1.5, like real keys.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self, n: usize, outliers: bool) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let g =
                    ((-2.0 * self.uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.uniform()).cos()) as f32;
                if outliers {
                    g * if i % 7 == 3 { 6.0 } else { 1.0 } + if i % 5 == 1 { 1.5 } else { 0.0 }
                } else {
                    g
                }
            })
            .collect()
    }
}

/// A coded method's key and value codecs, and the VecInfer ones again as themselves (the
/// VecInfer backends take them typed).
type Codecs = (Arc<dyn BlockCodec>, Arc<dyn BlockCodec>, Option<(VecInferCodec, VecInferCodec)>);

/// Key and value codecs of a coded method, trained (VecInfer: 2-bit, 256 centroids of 4) on
/// draws like the test's.
fn codecs(method: Method, heads: Heads, rng: &mut Rng) -> Option<Codecs> {
    let (kv, d) = (heads.kv, heads.dim);
    match method {
        Method::VecInfer => {
            let shape = PqShape::new(4, 8).unwrap();
            let train = rng.normal(300 * kv * d, true);
            let k = train_codec(&train, kv, d, &CodecSpec::keys(shape), &KMeansConfig::new(256, rng.0)).unwrap().0;
            let train = rng.normal(300 * kv * d, false);
            let v =
                train_codec(&train, kv, d, &CodecSpec::values(shape), &KMeansConfig::new(256, rng.0 ^ 1)).unwrap().0;
            Some((Arc::new(k.clone()), Arc::new(v.clone()), Some((k, v))))
        }
        Method::Kivi => Some((
            Arc::new(KiviCodec::new(kv, d, 2, 32, KiviAxis::PerChannel).unwrap()),
            Arc::new(KiviCodec::new(kv, d, 2, 32, KiviAxis::PerToken).unwrap()),
            None,
        )),
        Method::LloydMax => Some((
            Arc::new(LloydMaxCodec::new(kv, d, 3, rng.0).unwrap()),
            Arc::new(LloydMaxCodec::new(kv, d, 3, rng.0 ^ 7).unwrap()),
            None,
        )),
        Method::Fp16 | Method::Sliding(_) => None,
    }
}

/// The device of `kind`. CUDA (pairs built with the `cuda` feature) opens as the library sets it
/// up (`runtime::Device::open`: event tracking off, flushes on their own stream); without a GPU
/// the test fails, unless `VELOQ_SKIP_CUDA_TESTS=1` says to skip it (`None`).
fn device(kind: Kind) -> Option<Device> {
    match kind {
        Kind::Cpu | Kind::Portable => Some(Device::Cpu),
        Kind::Cuda => match veloq_candle::runtime::Device::Cuda(0).open(&Default::default()) {
            Ok(d) => Some(d),
            Err(e) if std::env::var("VELOQ_SKIP_CUDA_TESTS").is_ok_and(|v| v == "1") => {
                eprintln!("skipped (VELOQ_SKIP_CUDA_TESTS=1): {e}");
                None
            }
            Err(e) => panic!("no CUDA device ({e}); set VELOQ_SKIP_CUDA_TESTS=1 to skip the CUDA pairs"),
        },
    }
}

/// The cache under test and the reference model of what it holds.
struct Case {
    cache: Box<dyn LayerCache>,
    shadow: Shadow,
    heads: Heads,
    device: Device,
    kind: Kind,
    method: Method,
    /// VecInfer's codecs, typed: rows are drawn away from near-ties of their search.
    vecinfer: Option<(VecInferCodec, VecInferCodec)>,
}

/// Whether every sub-vector of `row` (`[kv, D]`) has one clear nearest centroid: the runner-up
/// is farther by more than a thousandth of the scale of the distances. Two searches in f32
/// that sum in different orders (the CPU kernel, candle's matmul, the CUDA kernel) may pick
/// either centroid of a closer pair; both are correct codes, but the reference can hold only
/// one, and a flipped key sub-vector moves a score by O(|q|·|c₁ − c₂|). Drawing rows in
/// general position keeps the check exact without loosening it for every input.
fn clear_codes(codec: &VecInferCodec, row: &[f32]) -> bool {
    let d = codec.head_dim();
    let sd = codec.shape().sub_dim;
    let mut x = vec![0.0f32; d];
    row.chunks_exact(d).enumerate().all(|(h, head)| {
        codec.transform().forward(h, head, &mut x);
        x.chunks_exact(sd).enumerate().all(|(j, sub)| {
            let book = codec.books().book(j);
            let (mut best, mut second) = (f64::INFINITY, f64::INFINITY);
            for c in book.centroids().chunks_exact(sd) {
                let dist: f64 = sub.iter().zip(c).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum();
                if dist < best {
                    (best, second) = (dist, best);
                } else if dist < second {
                    second = dist;
                }
            }
            let scale: f64 = sub.iter().map(|&a| (a as f64).powi(2)).sum::<f64>() + best + 1e-6;
            second - best > 1e-3 * scale
        })
    })
}

/// Whether every element of `row` (`[kv, D]`, as stored: f16), rotated and divided by its rms as
/// the Lloyd–Max codec does, is clear of the level boundaries by 1e-4, and the rms of its f16
/// rounding boundaries. The CPU codec rotates by a butterfly and the tensor ops by a matmul; they
/// round apart, and an element on a boundary may take either level (both correct codes, one
/// reference). Other codecs: always clear.
fn clear_levels(codec: &dyn BlockCodec, row: &[f32]) -> bool {
    let Some(ScalarForm::LloydMax { signs, bounds, .. }) = codec.scalar_form() else { return true };
    let d = codec.head_dim();
    let had = Hadamard::new(d).unwrap();
    round_f16(row).chunks_exact(d).all(|head| {
        let mut y: Vec<f32> = head.iter().zip(signs).map(|(x, s)| x * s).collect();
        had.apply(&mut y);
        // The rms is stored as f16: it too must not sit on a rounding boundary.
        let exact = (y.iter().map(|a| a * a).sum::<f32>() / d as f32).sqrt();
        let rms = f16::from_f32(exact);
        let steady = [1.0 - 1e-5, 1.0 + 1e-5].iter().all(|f| f16::from_f32(exact * f) == rms);
        steady && y.iter().all(|&v| bounds.iter().all(|&b| (v / rms.to_f32() - b).abs() > 1e-4))
    })
}

impl Case {
    fn new(kind: Kind, method: Method, heads: Heads, slots: usize, window: Window, rng: &mut Rng) -> Option<Case> {
        let device = device(kind)?;
        let capacity = 4096;
        let codecs = codecs(method, heads, rng);
        let vecinfer = codecs.as_ref().and_then(|c| c.2.clone());
        let block = match &codecs {
            Some((k, v, _)) => lcm(lcm(window.block, k.block_tokens()), v.block_tokens()),
            None => window.block,
        };
        let window = Window { block, ..window };
        let policy = match method {
            Method::Fp16 => Policy::dense(capacity),
            Method::Sliding(w) => Policy::sliding(w, capacity),
            _ => Policy::coded(window.sink, window.keep, block, capacity),
        };
        let rows = policy.rows();
        let cache: Box<dyn LayerCache> = match (kind, &codecs) {
            (Kind::Cpu, None) => {
                Box::new(KvCache::new(policy, slots, heads, CpuBackend::dense(heads, slots, rows)).unwrap())
            }
            (Kind::Cpu, Some((_, _, Some((k, v))))) => Box::new(
                KvCache::new(
                    policy,
                    slots,
                    heads,
                    CpuBackend::vecinfer(heads, slots, rows, Arc::new(k.clone()), Arc::new(v.clone()), block).unwrap(),
                )
                .unwrap(),
            ),
            (Kind::Cpu, Some((k, v, None))) => Box::new(
                KvCache::new(
                    policy,
                    slots,
                    heads,
                    CpuBackend::decoding(heads, slots, rows, k.clone(), v.clone(), block).unwrap(),
                )
                .unwrap(),
            ),
            (Kind::Portable, None) => Box::new(
                KvCache::new(policy, slots, heads, TensorBackend::dense(heads, slots, rows, &device).unwrap()).unwrap(),
            ),
            (Kind::Portable, Some((_, _, Some((k, v))))) => Box::new(
                KvCache::new(
                    policy,
                    slots,
                    heads,
                    TensorBackend::vecinfer(heads, slots, rows, capacity, k, v, &device).unwrap(),
                )
                .unwrap(),
            ),
            (Kind::Portable | Kind::Cuda, Some((k, v, None))) => Box::new(
                KvCache::new(
                    policy,
                    slots,
                    heads,
                    TensorBackend::scalar(heads, slots, rows, capacity, &**k, &**v, &device).unwrap(),
                )
                .unwrap(),
            ),
            (Kind::Cuda, c) => cuda_cache(
                policy,
                slots,
                heads,
                c.as_ref().map(|c| c.2.as_ref().expect("scalar codes are served above")),
                &device,
            ),
        };
        let sliding = if let Method::Sliding(w) = method { Some(w) } else { None };
        let shadow = Shadow::new(slots, window, sliding, codecs.map(|c| (c.0, c.1)));
        Some(Case { cache, shadow, heads, device, kind, method, vecinfer })
    }

    /// Relative error the backend is held to: the CPU and portable paths compute in f32, the CUDA
    /// decode kernel scores with f16 centroids on tensor cores; a wrong code path or mask errs by
    /// O(1). Rows are drawn without near-ties ([`clear_codes`]), so every search picks the
    /// reference's codes.
    ///
    /// Rows a truncation brought back from codes were decoded through a rotation, which the
    /// portable backend applies by a matmul and the CPU codec by a butterfly: an element whose
    /// decoded value sits on an f16 rounding midpoint may come back one f16 step (2⁻¹⁰ relative)
    /// from the reference's, which alone moves an output by up to a few 1e-4. Steps that attend
    /// such rows are held to 2e-3 there; a lost or misplaced row errs by O(0.1).
    fn bound(&self, restored: bool) -> f64 {
        match (self.kind, self.method) {
            (Kind::Cuda, Method::VecInfer) => 1e-2,
            (Kind::Cuda, _) => 2e-3,
            (Kind::Portable, Method::VecInfer | Method::LloydMax) if restored => 2e-3,
            _ => 1e-4,
        }
    }

    /// Runs one step: `seqs` as (slot, new tokens); appends random keys and values, attends random
    /// queries, checks the output against the reference, commits. Returns the worst relative error
    /// over the step's sequences.
    fn step(&mut self, seqs: &[(usize, usize)], rng: &mut Rng) -> f64 {
        self.run(seqs, rng, true)
    }

    /// [`step`](Self::step), checking the output against the reference when `check`.
    fn run(&mut self, seqs: &[(usize, usize)], rng: &mut Rng, check: bool) -> f64 {
        let Heads { q: hq, kv, dim: d } = self.heads;
        let step =
            Step::new(seqs.iter().map(|&(slot, len)| SeqStep { slot, start: self.cache.len(slot), len }).collect())
                .unwrap();
        let n = step.tokens();
        let (k, v) = (self.draw_rows(n, true, 0, rng), self.draw_rows(n, false, 1, rng));
        let q = rng.normal(n * hq * d, false);
        let t = |x: &[f32], h: usize| Tensor::from_slice(x, (n, h, d), &self.device).unwrap();
        self.cache.append(&t(&k, kv), &t(&v, kv), &step).unwrap();
        // Half the steps attend into a buffer poisoned with NaN (how CUDA graphs take it): every
        // row must be written, with what `attend` returns.
        let out = if rng.uniform() < 0.5 {
            self.cache.attend(&t(&q, hq), &step, 0.125).unwrap()
        } else {
            let buf = t(&vec![f32::NAN; n * hq * d], hq);
            self.cache.attend_into(&t(&q, hq), &step, 0.125, &buf).unwrap();
            buf
        };
        let out = out.to_device(&Device::Cpu).unwrap();
        let out: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
        let row = kv * d;
        let mut worst = 0.0f64;
        for (i, s) in step.seqs().iter().enumerate() {
            let r = step.rows(i);
            self.shadow.push(s.slot, &k[r.start * row..r.end * row], &v[r.start * row..r.end * row], row);
            if !check {
                continue;
            }
            let want = self.reference(s.slot, s.start, &q[r.start * hq * d..r.end * hq * d]);
            let got = &out[r.start * hq * d..r.end * hq * d];
            let (e, nrm) =
                got.iter().zip(&want).fold((0.0, 0.0), |(e, nrm), (&a, &b)| (e + (a as f64 - b).powi(2), nrm + b * b));
            assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
            worst = worst.max((e / nrm).sqrt());
        }
        self.cache.commit().unwrap();
        for s in step.seqs() {
            self.shadow.commit(s.slot);
            assert_eq!(self.cache.len(s.slot), self.shadow.keys[s.slot].len());
        }
        worst
    }

    /// `n` random key (`outliers`) or value rows, each redrawn until the VecInfer codec (`which`:
    /// 0 keys, 1 values) has no near-tie in it (see [`clear_codes`]), nor Lloyd–Max a value on a
    /// boundary ([`clear_levels`]).
    fn draw_rows(&self, n: usize, outliers: bool, which: usize, rng: &mut Rng) -> Vec<f32> {
        let row = self.heads.kv * self.heads.dim;
        let mut out = Vec::with_capacity(n * row);
        for _ in 0..n {
            let codec = self.vecinfer.as_ref().map(|c| if which == 0 { &c.0 } else { &c.1 });
            let scalar = self.shadow.codecs.as_ref().map(|c| if which == 0 { &c.0 } else { &c.1 });
            let mut r = rng.normal(row, outliers);
            while codec.is_some_and(|c| !clear_codes(c, &r)) || scalar.is_some_and(|c| !clear_levels(&**c, &r)) {
                r = rng.normal(row, outliers);
            }
            out.extend(r);
        }
        out
    }

    /// f64 attention of `q` (`[t, hq, D]`, queries at positions `start..`) over what `slot` holds.
    fn reference(&self, slot: usize, start: usize, q: &[f32]) -> Vec<f64> {
        let Heads { q: hq, kv, dim: d } = self.heads;
        self.shadow.attend(slot, start, q, (hq, kv, d), 0.125)
    }

    fn check(&mut self, what: &str, seqs: &[(usize, usize)], rng: &mut Rng, seed: u64) {
        let restored = seqs.iter().any(|&(slot, _)| self.shadow.restored[slot].is_some());
        let e = self.step(seqs, rng);
        if std::env::var("CONFORMANCE_VERBOSE").is_ok() {
            eprintln!(
                "{:?} {:?} {what}: {e:.2e}{}",
                self.kind,
                self.method,
                if restored { " (restored rows)" } else { "" }
            );
        }
        let bound = self.bound(restored);
        assert!(
            e <= bound,
            "seed {seed}, {:?} {:?} {:?}, {what}: relative error {e:.2e} > {:.0e}",
            self.kind,
            self.method,
            self.heads,
            bound
        );
    }

    fn fork(&mut self, from: usize, to: usize) {
        self.cache.fork(from, to).unwrap();
        self.shadow.fork(from, to);
        assert_eq!(self.cache.len(to), self.cache.len(from));
    }

    fn truncate(&mut self, slot: usize, len: usize) {
        self.cache.truncate(slot, len).unwrap();
        self.shadow.truncate(slot, len);
        assert_eq!(self.cache.len(slot), len);
    }
}

#[cfg(feature = "cuda")]
fn cuda_cache(
    policy: Policy,
    slots: usize,
    heads: Heads,
    codecs: Option<&(VecInferCodec, VecInferCodec)>,
    device: &Device,
) -> Box<dyn LayerCache> {
    use veloq_candle::cache::{CudaBackend, CudaRuntime};
    let rt = CudaRuntime::new(device).unwrap();
    let backend = match codecs {
        // Codes decoded for the prefill kernels in blocks of 200 (not 8,192): prompts here cross
        // block boundaries, where blocks merge into one set of partials.
        Some((k, v)) => CudaBackend::vecinfer(rt, heads, slots, policy.rows(), policy.capacity(), k, v, device)
            .unwrap()
            .with_decode_block(200),
        None => CudaBackend::dense(rt, heads, slots, policy.rows(), device).unwrap(),
    };
    Box::new(KvCache::new(policy, slots, heads, backend).unwrap())
}

#[cfg(not(feature = "cuda"))]
fn cuda_cache(
    _: Policy,
    _: usize,
    _: Heads,
    _: Option<&(VecInferCodec, VecInferCodec)>,
    _: &Device,
) -> Box<dyn LayerCache> {
    unreachable!("no CUDA device in a build without the cuda feature")
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// The geometries every property runs on: GQA groups 1–8, head_dim 64/128/256.
const GEOMETRIES: [Heads; 4] = [
    Heads { q: 6, kv: 2, dim: 64 },
    Heads { q: 8, kv: 1, dim: 128 },
    Heads { q: 2, kv: 2, dim: 256 },
    Heads { q: 12, kv: 3, dim: 64 },
];

// ---- the properties ----

/// A prompt of odd length, then single tokens across several flushes: every output equals the
/// reference (codes, sink and recent rows merged), at every geometry.
fn prefill_then_decode(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    for heads in GEOMETRIES {
        let Some(mut c) = Case::new(kind, method, heads, 1, DEFAULT_WINDOW, &mut rng) else { return };
        c.check("prefill of 37", &[(0, 37)], &mut rng, seed);
        for i in 0..30 {
            c.check(&format!("decode step {i}"), &[(0, 1)], &mut rng, seed);
        }
    }
}

/// Sinks and windows of several sizes (no sink, a window of 8, blocks of 16), lengths landing
/// just before, on and after each flush boundary.
fn sinks_windows_and_flush_boundaries(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    let heads = Heads { q: 4, kv: 2, dim: 64 };
    for window in [
        Window { sink: 0, keep: 8, block: 8 },
        Window { sink: 4, keep: 16, block: 16 },
        Window { sink: 1, keep: 5, block: 8 },
    ] {
        let Some(mut c) = Case::new(kind, method, heads, 1, window, &mut rng) else { return };
        let w = c.shadow.window;
        // Up to one short of the first flush, exactly onto it, then past it in odd steps.
        c.check("to one short of a flush", &[(0, w.sink + w.keep + w.block - 1)], &mut rng, seed);
        c.check("onto the flush", &[(0, 1)], &mut rng, seed);
        for n in [1, w.block - 1, 1, w.block, 2 * w.block + 3, 1] {
            c.check(&format!("{n} more"), &[(0, n)], &mut rng, seed);
        }
    }
}

/// Truncations: inside the recent rows, into the codes (the cut block comes back decoded), into
/// the sink, to zero; decoding continues correctly after each.
fn truncation(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    let heads = Heads { q: 6, kv: 3, dim: 64 };
    let Some(mut c) = Case::new(kind, method, heads, 1, DEFAULT_WINDOW, &mut rng) else { return };
    c.check("prompt", &[(0, 90)], &mut rng, seed);
    // A sliding layer keeps only what later queries see, so it can only start over.
    let cuts: &[usize] = if let Method::Sliding(_) = method { &[0] } else { &[88, 61, 29, 3, 0] };
    for &cut in cuts {
        let len = c.cache.len(0);
        c.truncate(0, cut.min(len));
        c.check(&format!("after truncating to {cut}"), &[(0, 1)], &mut rng, seed);
        for i in 0..12 {
            c.check(&format!("decode {i} after {cut}"), &[(0, 1)], &mut rng, seed);
        }
        c.check(&format!("a turn after {cut}"), &[(0, 21)], &mut rng, seed);
    }
    if let Method::Sliding(_) = method {
        let len = c.cache.len(0);
        let e = c.cache.truncate(0, len - 1).unwrap_err();
        assert!(e.to_string().contains("no longer holds"), "{e}");
        assert_eq!(c.cache.len(0), len, "a refused truncation changes nothing");
    }
}

/// Forks: a prompt long enough for codes, copied into another slot, then both go on with
/// different tokens; each attends exactly the shared prefix and its own continuation. A fork of
/// a fork, taken after its source went on, holds what the source held then, and outlives it. A
/// fork needs another, empty slot (refusals change nothing); a forked sequence's storage is what a
/// grown one's is, less what it shares with its source (the CPU shares code blocks, counted once).
fn forks(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    for heads in [Heads { q: 6, kv: 2, dim: 64 }, Heads { q: 4, kv: 1, dim: 128 }] {
        let Some(mut c) = Case::new(kind, method, heads, 3, DEFAULT_WINDOW, &mut rng) else { return };
        c.check("a prompt", &[(0, 90)], &mut rng, seed);
        let before = c.cache.resident_bytes();
        c.fork(0, 1);
        let shared = c.cache.shared_bytes(1);
        assert_eq!(shared, c.cache.shared_bytes(0), "a fork and its source share the same blocks");
        assert_eq!(shared, c.cache.fork_shares(90), "what a fork shares is known ahead");
        if kind == Kind::Cpu {
            let grown = c.cache.resident_bytes() - before;
            assert_eq!(grown + shared, c.cache.sequence_bytes(90), "a fork's storage is a grown sequence's");
            // Codes are shared; rows, which change, are not.
            let coded = !matches!(method, Method::Fp16 | Method::Sliding(_));
            assert_eq!(shared > 0, coded, "{shared} B shared");
        } else {
            assert_eq!(shared, 0, "device backends copy");
        }
        c.check("both decode", &[(0, 1), (1, 1)], &mut rng, seed);
        for i in 0..12 {
            c.check(&format!("decode {i} after the fork"), &[(1, 1), (0, 1)], &mut rng, seed);
        }
        c.check("a turn on the fork", &[(1, 21), (0, 1)], &mut rng, seed);
        for (from, to) in [(1, 1), (1, 0), (0, 3)] {
            let lens = (c.cache.len(0), c.cache.len(1));
            assert!(c.cache.fork(from, to).is_err(), "fork {from} into {to} must be refused");
            assert_eq!((c.cache.len(0), c.cache.len(1)), lens, "a refused fork changes nothing");
        }
        c.fork(1, 2);
        c.check("the source goes on", &[(1, 17)], &mut rng, seed);
        for i in 0..10 {
            c.check(&format!("three decode {i}"), &[(2, 1), (0, 1), (1, 1)], &mut rng, seed);
        }
        c.truncate(1, 0);
        c.check("a fork outlives its source", &[(2, 5)], &mut rng, seed);
        c.truncate(2, 0);
        assert_eq!(c.cache.shared_bytes(0), 0, "freed forks share nothing");
        c.check("freed forks, the first goes on", &[(0, 3)], &mut rng, seed);
        c.fork(0, 2);
        c.check("a fork into a freed slot", &[(2, 4), (0, 1)], &mut rng, seed);
    }
}

/// Several sequences at different positions in one step, some with many tokens (a new prompt
/// beside decode steps), some idle: each attends only its own positions. Twelve query heads on
/// one kv head take the CUDA lookup-table kernel (tensor cores take at most 8).
fn ragged_batches(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    for heads in [Heads { q: 6, kv: 2, dim: 64 }, Heads { q: 8, kv: 1, dim: 128 }, Heads { q: 12, kv: 1, dim: 64 }] {
        let Some(mut c) = Case::new(kind, method, heads, 4, DEFAULT_WINDOW, &mut rng) else { return };
        c.check("two prompts", &[(0, 30), (2, 7)], &mut rng, seed);
        c.check("a prompt beside decodes", &[(2, 1), (1, 45), (0, 1)], &mut rng, seed);
        for i in 0..20 {
            c.check(&format!("ragged decode {i}"), &[(0, 1), (1, 1), (2, 1)], &mut rng, seed);
        }
        c.check("a late prompt and a turn", &[(3, 33), (1, 1), (0, 9)], &mut rng, seed);
        c.truncate(1, 0);
        c.check("a freed slot reused", &[(1, 5), (3, 1), (2, 1), (0, 1)], &mut rng, seed);
        for i in 0..12 {
            c.check(&format!("all four {i}"), &[(3, 1), (2, 1), (1, 1), (0, 1)], &mut rng, seed);
        }
    }
}

/// Follow-up turns: many queries at once after codes exist (longer than the recent rows, so
/// they attend the step's own rows from its input), then decoding on.
fn turns_after_codes(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    for heads in GEOMETRIES {
        let Some(mut c) = Case::new(kind, method, heads, 1, DEFAULT_WINDOW, &mut rng) else { return };
        c.check("first turn", &[(0, 120)], &mut rng, seed);
        for (n, turn) in [5usize, 64, 2, 300, 17].into_iter().enumerate() {
            c.check(&format!("turn {n} of {turn}"), &[(0, turn)], &mut rng, seed);
            c.check(&format!("decode after turn {n}"), &[(0, 1)], &mut rng, seed);
        }
    }
}

/// Blocks of queries longer than a backend's query tile (the CUDA prefill runs 1,024 queries per
/// launch): a turn of 1,100 after codes exist, and two prompts of different lengths in one step,
/// each query attending exactly its own prefix.
fn long_blocks(kind: Kind, method: Method) {
    let seed = seed();
    let mut rng = Rng(seed | 1);
    for heads in [Heads { q: 6, kv: 2, dim: 64 }, Heads { q: 8, kv: 1, dim: 128 }] {
        let Some(mut c) = Case::new(kind, method, heads, 2, DEFAULT_WINDOW, &mut rng) else { return };
        c.check("a prompt", &[(0, 300)], &mut rng, seed);
        c.check("a turn of 1,100", &[(0, 1100)], &mut rng, seed);
        c.check("decode after it", &[(0, 1)], &mut rng, seed);
        // A wide pool: a lone sequence's few (head, tile) tasks split its positions into shares
        // (the CPU backend) whose partials merge.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
        pool.install(|| c.check("decode with its positions shared out", &[(0, 1)], &mut rng, seed));
        c.check("two prompts at once", &[(1, 1030), (0, 70)], &mut rng, seed);
    }
}

/// Bad input is a clear error and changes nothing: a step at the wrong position, keys of the
/// wrong shape, values out of step with keys (their own shape checked), attend without append,
/// a context over capacity.
fn bad_input(kind: Kind, method: Method) {
    let mut rng = Rng(seed() | 1);
    let heads = Heads { q: 4, kv: 2, dim: 64 };
    let Some(mut c) = Case::new(kind, method, heads, 2, DEFAULT_WINDOW, &mut rng) else { return };
    let dev = c.device.clone();
    let z = |n: usize, h: usize, d: usize| Tensor::zeros((n, h, d), candle_core::DType::F32, &dev).unwrap();
    let e = c.cache.append(&z(3, 2, 64), &z(3, 2, 64), &Step::single(0, 5, 3).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Position { slot: 0, expected: 0, got: 5 }), "{e}");
    let e = c.cache.append(&z(3, 3, 64), &z(3, 2, 64), &Step::single(0, 0, 3).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Shape(_)), "{e}");
    let e = c.cache.append(&z(3, 2, 64), &z(2, 2, 64), &Step::single(0, 0, 3).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Shape(_)) && e.to_string().contains("values"), "mis-shaped values: {e}");
    let e = c.cache.append(&z(3, 2, 64), &z(3, 2, 32), &Step::single(0, 0, 3).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Shape(_)), "{e}");
    assert!(c.cache.attend(&z(1, 4, 64), &Step::single(0, 0, 1).unwrap(), 0.1).is_err());
    let e = c.cache.append(&z(1, 2, 64), &z(1, 2, 64), &Step::single(1, 0, 5000).unwrap());
    assert!(e.is_err(), "a step past the capacity must be refused");
    assert_eq!((c.cache.len(0), c.cache.len(1)), (0, 0), "refused steps change nothing");
    // The cache still works after the refusals.
    c.check("after refusals", &[(0, 9), (1, 2)], &mut rng, 0);
}

/// Resident bytes are what the storage holds, and a coded cache holds fewer than a dense one.
/// A sequence's bytes (what admission budgets per request) are exactly what its slot's storage
/// grows by, however its steps came (a prompt in chunks, decode steps, beside another sequence),
/// and freeing the slots gives all of it back; device backends reserve every slot up front, so
/// theirs never move.
fn resident_bytes(kind: Kind, method: Method) {
    let mut rng = Rng(seed() | 1);
    let heads = Heads { q: 4, kv: 2, dim: 64 };
    let Some(mut c) = Case::new(kind, method, heads, 2, DEFAULT_WINDOW, &mut rng) else { return };
    let empty = c.cache.resident_bytes();
    let reserved = c.cache.sequence_bytes(0);
    assert_eq!(c.cache.sequence_bytes(1) == reserved, kind != Kind::Cpu, "only device backends reserve slots");
    assert!(empty >= 2 * reserved, "{empty} B resident, two slots of {reserved} B reserved");
    let grown = |c: &Case| c.cache.resident_bytes() - empty;
    let expect = |c: &Case| match kind {
        Kind::Cpu => c.cache.sequence_bytes(c.cache.len(0)) + c.cache.sequence_bytes(c.cache.len(1)),
        _ => 0,
    };
    for (what, seqs) in [
        ("a prompt", vec![(0, 300)]),
        ("a prompt in a chunk", vec![(0, 512)]),
        ("a prompt beside a decode", vec![(1, 77), (0, 1)]),
        ("decode steps", vec![(0, 1), (1, 1)]),
    ] {
        for _ in 0..if what == "decode steps" { 37 } else { 1 } {
            c.run(&seqs, &mut rng, false);
        }
        assert_eq!(grown(&c), expect(&c), "{what}: lengths {} and {}", c.cache.len(0), c.cache.len(1));
    }
    let after = c.cache.resident_bytes();
    let (n, f16_bytes) = (c.cache.len(0), c.cache.len(0) * heads.kv * heads.dim * 2 * 2);
    match (kind, method) {
        // Host memory grows with what is written; 2-bit codes are an eighth of f16, plus the
        // sink and the recent rows.
        (Kind::Cpu, Method::VecInfer) => {
            assert!(c.cache.sequence_bytes(n) * 5 < f16_bytes, "{after} B vs {f16_bytes} B of f16")
        }
        (Kind::Cpu, Method::Fp16) => {
            let own = c.cache.sequence_bytes(n);
            assert!(own >= f16_bytes && own < 2 * f16_bytes, "{own} B vs {f16_bytes} B of f16")
        }
        _ => {}
    }
    c.truncate(0, 0);
    c.truncate(1, 0);
    assert_eq!(c.cache.resident_bytes(), empty, "freed slots give their storage back");
    c.check("a freed slot reused", &[(0, 40), (1, 3)], &mut rng, 0);
}

/// Instantiates every property for one (cache, backend) pair: a module, a test per property.
macro_rules! conformance {
    ($pair:ident, $kind:expr, $method:expr) => {
        mod $pair {
            use super::*;
            conformance!(@tests $kind, $method; prefill_then_decode, sinks_windows_and_flush_boundaries, truncation, ragged_batches, forks, turns_after_codes, long_blocks, bad_input, resident_bytes);
        }
    };
    (@tests $kind:expr, $method:expr; $($property:ident),*) => {
        $(
            #[test]
            fn $property() {
                super::$property($kind, $method)
            }
        )*
    };
}

conformance!(vecinfer_cpu, Kind::Cpu, Method::VecInfer);
conformance!(vecinfer_portable, Kind::Portable, Method::VecInfer);
conformance!(fp16_cpu, Kind::Cpu, Method::Fp16);
conformance!(fp16_portable, Kind::Portable, Method::Fp16);
conformance!(sliding_cpu, Kind::Cpu, Method::Sliding(13));
conformance!(sliding_portable, Kind::Portable, Method::Sliding(13));
conformance!(kivi_cpu, Kind::Cpu, Method::Kivi);
conformance!(lloyd_max_cpu, Kind::Cpu, Method::LloydMax);
conformance!(kivi_portable, Kind::Portable, Method::Kivi);
conformance!(lloyd_max_portable, Kind::Portable, Method::LloydMax);
#[cfg(feature = "cuda")]
conformance!(vecinfer_cuda, Kind::Cuda, Method::VecInfer);
#[cfg(feature = "cuda")]
conformance!(fp16_cuda, Kind::Cuda, Method::Fp16);
#[cfg(feature = "cuda")]
conformance!(sliding_cuda, Kind::Cuda, Method::Sliding(13));
#[cfg(feature = "cuda")]
conformance!(kivi_cuda, Kind::Cuda, Method::Kivi);
#[cfg(feature = "cuda")]
conformance!(lloyd_max_cuda, Kind::Cuda, Method::LloydMax);
