//! Random-weight models by name (`--model synthetic:llama8b`): a real model's geometry without its
//! file, for measuring speed and memory where the weights' values do not matter. Their
//! calibrations are k-means on random draws shaped like keys; their tokenizer names token `i` the
//! word `w{i}`.

use anyhow::{bail, Result};

use veloq::artifact::{Calibration, LayerCodecs};
use veloq::calibrate::{train_codec, KMeansConfig, TextFingerprint};
use veloq::codec::codebook::{Granularity, PqShape};
use veloq::codec::vecinfer::{CodecSpec, VecInferCodec};
use veloq_candle::model::{Geometry, Model};

/// The geometry behind `synthetic:NAME`.
pub fn geometry(name: &str) -> Result<(Geometry, &'static str)> {
    Ok(match name {
        "llama8b" => (Geometry::LLAMA_3_1_8B, "llama-3.1-8b-geometry-random"),
        other => bail!("unknown synthetic model {other:?} (synthetic:llama8b)"),
    })
}

/// Gaussian stream (xorshift + Box–Muller): fresh, never zero, outlier channels like real keys.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f32 {
        ((-2.0 * self.next().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.next()).cos()) as f32
    }
    pub fn rows(&mut self, rows: usize, d: usize) -> Vec<f32> {
        (0..rows * d)
            .map(|i| {
                self.normal() * if i % d == 3 || i % d == d / 2 { 8.0 } else { 1.0 }
                    + if i % d == 5 { 2.0 } else { 0.0 }
            })
            .collect()
    }
}

pub fn codec(
    rng: &mut Rng,
    heads: usize,
    d: usize,
    sd: usize,
    bits: u32,
    granularity: Granularity,
    keys: bool,
) -> Result<VecInferCodec> {
    let shape = PqShape::new(sd, bits)?;
    let spec = if keys {
        CodecSpec { granularity, ..CodecSpec::keys(shape) }
    } else {
        CodecSpec { granularity, ..CodecSpec::values(shape) }
    };
    let train = rng.rows(((4 << bits) / heads).max(600) * heads, d);
    Ok(train_codec(&train, heads, d, &spec, &KMeansConfig { max_iter: 8, ..KMeansConfig::new(1 << bits, rng.0) })?.0)
}

/// Random 2-bit VecInfer codebooks (sub_dim 4, 256 centroids, like the real calibration) for
/// every layer of a synthetic model.
pub fn synthetic_calibration(model: &Model, rng: &mut Rng) -> Result<Calibration> {
    let id = model.info.identity.clone();
    let keys = codec(rng, id.n_kv_heads, id.head_dim, 4, 8, Granularity::PerLayer, true)?;
    let values = codec(rng, id.n_kv_heads, id.head_dim, 4, 8, Granularity::PerLayer, false)?;
    let layer = || LayerCodecs { keys: keys.clone(), values: values.clone() };
    let shape = PqShape::new(4, 8)?;
    Ok(Calibration {
        keys: CodecSpec::keys(shape),
        values: CodecSpec::values(shape),
        seed: rng.0,
        calibration_tokens: 0,
        text: TextFingerprint::default(),
        layers: (0..id.n_layers).map(|_| layer()).collect(),
        model: id,
    })
}
