//! The quality harness on the real SmolLM2 GGUF: calibration determinism, refusal to evaluate on
//! calibration text, and every method's reconstruction error on real held-out activations.

use std::path::PathBuf;
use std::sync::OnceLock;

use veloq::codec::block::BlockCodec;
use veloq::codec::codebook::PqShape;
use veloq::codec::kivi::{KiviAxis, KiviCodec};
use veloq::codec::lloyd_max::LloydMaxCodec;
use veloq::codec::vecinfer::CodecSpec;
use veloq_candle::collect::{calibrate, collect_activations, Activations};
use veloq_candle::config::CacheConfig;
use veloq_candle::model::{encode, Model};
use veloq_candle::Error;
use veloq_lab::eval::{evaluate, EvalConfig};
use veloq_lab::source::sources;

fn cache_dir() -> PathBuf {
    std::env::var_os("VELOQ_CACHE").map(PathBuf::from).unwrap_or_else(veloq::paths::default_cache_dir)
}

fn tokens(name: &str, tok: &veloq_candle::model::Tokenizer) -> Vec<u32> {
    let p = cache_dir().join("austen").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-data)", p.display()));
    encode(tok, &text).unwrap()
}

struct Fixture {
    model: Model,
    persuasion: Vec<u32>,
    emma: Vec<u32>,
    /// Activations of the first 512 tokens of Persuasion (calibration).
    calib: Activations,
    /// Activations of 256 tokens of Emma (held out).
    held_out: Activations,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let path = cache_dir().join("smollm2-135m-instruct.q4_1.gguf");
        let (model, tok) =
            Model::open(&path, 1024).unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-data)", path.display()));
        let persuasion = tokens("persuasion.txt", &tok);
        let emma = tokens("emma.txt", &tok);
        let calib = collect_activations(&model, &persuasion[..512], 512, &mut |_| {}).unwrap();
        let held_out = collect_activations(&model, &emma[4096..4096 + 256], 256, &mut |_| {}).unwrap();
        Fixture { model, persuasion, emma, calib, held_out }
    })
}

fn shape() -> PqShape {
    PqShape::new(4, 8).unwrap()
}

/// Same activations and seed → byte-identical artifact, also on one thread; another seed differs.
#[test]
fn calibration_is_deterministic() {
    let f = fixture();
    let run = |seed| {
        calibrate(&f.model, &f.calib, CodecSpec::keys(shape()), CodecSpec::values(shape()), seed, &mut |_| {})
            .unwrap()
            .to_bytes()
            .unwrap()
    };
    let a = run(3);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let b = pool.install(|| run(3));
    assert_eq!(a, b, "same seed, different bytes");
    assert_ne!(a, run(4), "another seed gave the same codebooks");
}

/// Evaluating a calibrated method on its own calibration text is refused; on another novel it runs
/// and scores fp16 as the reference (KL 0, top-1 100%) and the 2-bit cache below it.
#[test]
fn evaluation_refuses_calibration_text() {
    let f = fixture();
    let cal =
        calibrate(&f.model, &f.calib, CodecSpec::keys(shape()), CodecSpec::values(shape()), 0, &mut |_| {}).unwrap();
    let methods = vec![("fp16".to_string(), CacheConfig::fp16()), ("vq-2".to_string(), CacheConfig::vecinfer(cal))];
    let cfg = EvalConfig { ctx: 128, windows: 1, step: 16 };
    match evaluate(&f.model, &f.persuasion[200..], &sources(&methods), cfg, &mut |_| {}) {
        Err(Error::CalibrationOverlap { method, at }) => {
            assert_eq!(method, "vq-2");
            assert!(at < 128, "overlap reported at {at}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let s = evaluate(&f.model, &f.emma[4096..], &sources(&methods), cfg, &mut |_| {}).unwrap();
    assert_eq!((s[0].scored, s[1].scored), (63, 63));
    assert_eq!((s[0].kl(), s[0].top1()), (0.0, 1.0));
    assert!(s[0].ppl() > 2.0 && s[0].ppl() < 100.0, "fp16 perplexity {}", s[0].ppl());
    assert!(s[1].kl() > 0.0 && s[1].kl() < 1.0, "2-bit KL {}", s[1].kl());
    assert!(s[1].resident_bytes * 3 < s[0].resident_bytes, "{} vs {}", s[1].resident_bytes, s[0].resident_bytes);
}

/// Relative squared error ‖x − x̂‖² / ‖x‖² of a codec over every layer's held-out keys or values.
/// One layer's key and value codecs.
type CodecPair = (Box<dyn BlockCodec>, Box<dyn BlockCodec>);

fn rel_err(codecs: &[CodecPair], keys: bool) -> f64 {
    let f = fixture();
    let (mut e, mut s) = (0.0f64, 0.0f64);
    for (l, (kc, vc)) in f.held_out.layers.iter().zip(codecs) {
        let (x, c) = if keys { (&l.keys, kc) } else { (&l.values, vc) };
        let mut y = vec![f32::NAN; x.len()];
        c.decode(&c.encode_vec(x).unwrap(), &mut y).unwrap();
        e += x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
        s += x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
    }
    e / s
}

/// Every method's round trip on real held-out keys and values (Emma; VecInfer calibrated on
/// Persuasion) stays within its bound, and more bits always mean less error. Bounds: measured
/// values (printed) with about 30% headroom; Lloyd–Max is also held to the Gaussian theory.
#[test]
fn codec_errors_on_real_activations() {
    let f = fixture();
    let id = &f.model.info.identity;
    let (h, d, n) = (id.n_kv_heads, id.head_dim, id.n_layers);
    let mut rows: Vec<(String, f64, f64)> = Vec::new();
    let mut check = |name: String, codecs: Vec<(Box<dyn BlockCodec>, Box<dyn BlockCodec>)>| {
        let (k, v) = (rel_err(&codecs, true), rel_err(&codecs, false));
        println!("{name:<12} keys {k:.4} values {v:.4}");
        rows.push((name, k, v));
    };
    let cal =
        calibrate(&f.model, &f.calib, CodecSpec::keys(shape()), CodecSpec::values(shape()), 0, &mut |_| {}).unwrap();
    check(
        "vq-2".into(),
        cal.layers
            .iter()
            .map(|l| (Box::new(l.keys.clone()) as Box<dyn BlockCodec>, Box::new(l.values.clone()) as _))
            .collect(),
    );
    for bits in [2u32, 4] {
        check(
            format!("kivi-{bits}"),
            (0..n)
                .map(|_| {
                    (
                        Box::new(KiviCodec::new(h, d, bits, 32, KiviAxis::PerChannel).unwrap()) as Box<dyn BlockCodec>,
                        Box::new(KiviCodec::new(h, d, bits, 32, KiviAxis::PerToken).unwrap()) as _,
                    )
                })
                .collect(),
        );
    }
    for bits in [2u32, 3, 4] {
        check(
            format!("rlm-{bits}"),
            (0..n as u64)
                .map(|i| {
                    (
                        Box::new(LloydMaxCodec::new(h, d, bits, 2 * i).unwrap()) as Box<dyn BlockCodec>,
                        Box::new(LloydMaxCodec::new(h, d, bits, 2 * i + 1).unwrap()) as _,
                    )
                })
                .collect(),
        );
    }
    let get = |name: &str| rows.iter().find(|r| r.0 == name).map(|r| (r.1, r.2)).unwrap();
    let bound = |name: &str, k: f64, v: f64| {
        let (gk, gv) = get(name);
        assert!(gk > 0.0 && gk <= k, "{name} keys {gk} > {k}");
        assert!(gv > 0.0 && gv <= v, "{name} values {gv} > {v}");
    };
    BOUNDS.iter().for_each(|&(name, k, v)| bound(name, k, v));
    for (lo, hi) in [("kivi-2", "kivi-4"), ("rlm-2", "rlm-3"), ("rlm-3", "rlm-4")] {
        let (a, b) = (get(lo), get(hi));
        assert!(b.0 < a.0 && b.1 < a.1, "{hi} not better than {lo}: {b:?} vs {a:?}");
    }
}

/// (method, key bound, value bound) on relative squared error. Measured (2026-11-30): vq-2
/// 0.038/0.105 (0.065/0.113 before centering), kivi-2 0.038/0.167, kivi-4 0.0015/0.0067, rlm-2 0.106/0.114, rlm-3 0.031/0.033,
/// rlm-4 0.0087/0.0091. Lloyd–Max bounds are also the Gaussian distortion (0.1175, 0.0345,
/// 0.0095) × 1.3: the rotation must make real heads nearly Gaussian.
const BOUNDS: &[(&str, f64, f64)] = &[
    ("vq-2", 0.05, 0.14),
    ("kivi-2", 0.05, 0.22),
    ("kivi-4", 0.002, 0.009),
    ("rlm-2", 0.1175 * 1.3, 0.1175 * 1.3),
    ("rlm-3", 0.0345 * 1.3, 0.0345 * 1.3),
    ("rlm-4", 0.0095 * 1.3, 0.0095 * 1.3),
];
