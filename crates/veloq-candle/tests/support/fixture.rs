//! The tiny random GGUF fixtures of `scripts/fixtures/*_tiny.py` and the one check every family
//! passes against its NumPy reference forward pass.

use std::path::PathBuf;

use candle_core::Device;
use veloq_candle::cache::ModelCache;
use veloq_candle::config::CacheConfig;
use veloq_candle::model::source::GgufFile;
use veloq_candle::model::{LoadOptions, Logits, Model};

/// The fixtures' vocabulary: four specials and byte pieces.
pub const VOCAB: usize = 256;

/// A fixture's file `<name>.<ext>` under `tests/fixtures`.
pub fn path(name: &str, ext: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(format!("{name}.{ext}"))
}

fn read_u32(name: &str, ext: &str) -> Vec<u32> {
    std::fs::read(path(name, ext)).unwrap().chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect()
}

/// A fixture's model (loaded from its GGUF, 64 positions), its tokens and the reference logits
/// `[tokens, VOCAB]` row-major.
pub fn load(name: &str) -> (Model, Vec<u32>, Vec<f32>) {
    let mut file = GgufFile::open(&path(name, "gguf")).unwrap();
    let model = Model::load(&mut file, &LoadOptions::new(64), &Device::Cpu).unwrap();
    let tokens = read_u32(name, "tokens.u32");
    let logits = read_u32(name, "logits.f32").into_iter().map(f32::from_bits).collect();
    (model, tokens, logits)
}

/// Largest |ours − reference| over a position's logits, relative to the reference's largest |logit|.
pub fn rel_err(ours: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    ours.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// The index of the largest value.
pub fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold(0, |best, (i, v)| if *v > x[best] { i } else { best })
}

/// Prefill of every position at once, and token by token, against the reference logits at every
/// position: each within `bound` (relative, keys and values being stored in f16) and with the
/// reference's argmax. Returns the worst error and the token-by-token run's caches.
pub fn check_logits(name: &str, bound: f32) -> (f32, ModelCache) {
    let (model, tokens, want) = load(name);
    let mut caches = CacheConfig::fp16().build(&model).unwrap();
    let all = model.forward(&tokens, &mut caches, Logits::All).unwrap().to_vec2::<f32>().unwrap();
    let mut caches = CacheConfig::fp16().build(&model).unwrap();
    let mut worst = 0.0f32;
    for (p, &tok) in tokens.iter().enumerate() {
        let step = model.forward(&[tok], &mut caches, Logits::Last).unwrap().to_vec2::<f32>().unwrap();
        let want = &want[p * VOCAB..(p + 1) * VOCAB];
        for (how, ours) in [("prefill", &all[p]), ("decode", &step[0])] {
            let e = rel_err(ours, want);
            worst = worst.max(e);
            assert!(e < bound, "{name} {how} position {p}: relative error {e}");
            assert_eq!(argmax(ours), argmax(want), "{name} {how} position {p}");
        }
    }
    eprintln!("{name}: worst relative logit error against the reference: {worst:.2e}");
    (worst, caches)
}
