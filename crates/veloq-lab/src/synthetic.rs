//! Random-weight models (`--model synthetic:llama8b`): a real model's geometry without its file,
//! for measuring speed and memory where the weights' values do not matter (attention and matmul
//! costs do not depend on them). The weights go through the library's own loader as an in-memory
//! source; their calibrations are k-means on random draws shaped like keys; their tokenizer names
//! token `i` the word `w{i}`.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device, Tensor};

use veloq::artifact::{Calibration, LayerCodecs};
use veloq::calibrate::{train_codec, KMeansConfig, TextFingerprint};
use veloq::codec::codebook::{Granularity, PqShape};
use veloq::codec::vecinfer::{CodecSpec, VecInferCodec};
use veloq_candle::method::Vq;
use veloq_candle::model::source::{MemorySource, Weight};
use veloq_candle::model::{LoadOptions, Model};

/// A Llama-family geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Decoder blocks.
    pub layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// MLP width.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RoPE base.
    pub rope_base: u32,
}

impl Geometry {
    /// Llama 3.1 8B: 32 layers, 32 query heads, 8 kv heads of 128, MLP 14,336, vocabulary 128,256.
    pub const LLAMA_3_1_8B: Self = Self {
        layers: 32,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        vocab: 128_256,
        rope_base: 500_000,
    };

    /// Parameters (embeddings and output head counted once each).
    pub fn parameters(&self) -> usize {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        self.layers * (h * q * 2 + h * kv * 2 + 3 * h * self.ffn + 2 * h) + 2 * self.vocab * h + h
    }

    /// A model of this geometry with N(0, 0.02²) f16 weights and unit norms on `device`
    /// (from `seed` on GPUs; candle's CPU generator cannot be seeded).
    pub fn model(&self, name: &str, max_context: usize, device: &Device, seed: u64) -> Result<Model> {
        let g = *self;
        if g.heads == 0 || g.kv_heads == 0 || !g.heads.is_multiple_of(g.kv_heads) || !g.head_dim.is_multiple_of(2) {
            bail!("{} heads, {} kv heads of {}: heads must group, head_dim even", g.heads, g.kv_heads, g.head_dim);
        }
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let mut tensors = HashMap::new();
        let mut put = |name: String, t: Tensor| {
            tensors.insert(name, Weight::Dense(t));
        };
        let w = |rows: usize, cols: usize| Tensor::randn(0f32, 0.02, (rows, cols), device)?.to_dtype(DType::F16);
        let ones = || Tensor::ones(g.hidden, DType::F32, device);
        let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
        put("token_embd.weight".into(), Tensor::randn(0f32, 1.0, (g.vocab, g.hidden), device)?.to_dtype(DType::F16)?);
        put("output.weight".into(), w(g.vocab, g.hidden)?);
        put("output_norm.weight".into(), ones()?);
        for i in 0..g.layers {
            for (n, rows, cols) in [
                ("attn_q", q, g.hidden),
                ("attn_k", kv, g.hidden),
                ("attn_v", kv, g.hidden),
                ("attn_output", g.hidden, q),
                ("ffn_gate", g.ffn, g.hidden),
                ("ffn_up", g.ffn, g.hidden),
                ("ffn_down", g.hidden, g.ffn),
            ] {
                put(format!("blk.{i}.{n}.weight"), w(rows, cols)?);
            }
            put(format!("blk.{i}.attn_norm.weight"), ones()?);
            put(format!("blk.{i}.ffn_norm.weight"), ones()?);
        }
        let u = |v: usize| Value::U32(v as u32);
        let metadata: HashMap<String, Value> = [
            ("general.architecture", Value::String("llama".into())),
            ("general.name", Value::String(name.into())),
            ("llama.block_count", u(g.layers)),
            ("llama.embedding_length", u(g.hidden)),
            ("llama.attention.head_count", u(g.heads)),
            ("llama.attention.head_count_kv", u(g.kv_heads)),
            ("llama.attention.key_length", u(g.head_dim)),
            ("llama.rope.freq_base", Value::F32(g.rope_base as f32)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let mut source = MemorySource { label: name.into(), metadata, tensors };
        Ok(Model::load(&mut source, &LoadOptions::new(max_context), device)?)
    }
}

/// The geometry and label behind `synthetic:NAME`.
pub fn geometry(name: &str) -> Result<(Geometry, &'static str)> {
    Ok(match name {
        "llama8b" => (Geometry::LLAMA_3_1_8B, "llama-3.1-8b-geometry-random"),
        other => bail!("unknown synthetic model {other:?} (synthetic:llama8b)"),
    })
}

/// Gaussian stream (xorshift + Box–Muller): fresh, never zero, outlier channels like real keys.
pub struct Rng(pub u64);

impl Rng {
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f32 {
        ((-2.0 * self.uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.uniform()).cos()) as f32
    }

    /// `rows` head vectors of `d` channels, two outlier channels scaled by 8 and one shifted by 2.
    pub fn rows(&mut self, rows: usize, d: usize) -> Vec<f32> {
        (0..rows * d)
            .map(|i| {
                self.normal() * if i % d == 3 || i % d == d / 2 { 8.0 } else { 1.0 }
                    + if i % d == 5 { 2.0 } else { 0.0 }
            })
            .collect()
    }
}

/// A VecInfer codec of `spec` trained (8 Lloyd iterations) on random key-like rows.
pub fn codec(rng: &mut Rng, heads: usize, d: usize, spec: &CodecSpec) -> Result<VecInferCodec> {
    let bits = spec.shape.bits;
    let train = rng.rows(((4 << bits) / heads).max(600) * heads, d);
    Ok(train_codec(&train, heads, d, spec, &KMeansConfig { max_iter: 8, ..KMeansConfig::new(1 << bits, rng.0) })?.0)
}

/// [`codec`] with default key or value specs of `sub_dim` × `bits` and `granularity`.
pub fn codec_of(
    rng: &mut Rng,
    heads: usize,
    d: usize,
    (sub_dim, bits): (usize, u32),
    granularity: Granularity,
    keys: bool,
) -> Result<VecInferCodec> {
    let shape = PqShape::new(sub_dim, bits)?;
    let spec = if keys { CodecSpec::keys(shape) } else { CodecSpec::values(shape) };
    codec(rng, heads, d, &CodecSpec { granularity, ..spec })
}

/// Random codebooks of method `vq` for every layer of a model (one trained pair, shared).
pub fn synthetic_calibration(model: &Model, vq: &Vq, rng: &mut Rng) -> Result<Calibration> {
    let id = model.info.identity.clone();
    let keys = codec(rng, id.n_kv_heads, id.head_dim, &vq.keys)?;
    let values = codec(rng, id.n_kv_heads, id.head_dim, &vq.values)?;
    let layer = || LayerCodecs { keys: keys.clone(), values: values.clone() };
    Ok(Calibration {
        keys: vq.keys,
        values: vq.values,
        seed: rng.0,
        calibration_tokens: 0,
        text: TextFingerprint::default(),
        value_weights: veloq::calibrate::ValueWeights::Uniform,
        layers: (0..id.n_layers).map(|_| layer()).collect(),
        model: id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes floor of `bench runner` counts every weight matrix once: 7 per layer and the
    /// output head (f32 on the CPU; norms and the embedding table are not read whole).
    #[test]
    fn synthetic_models_load_through_the_library() {
        let g = Geometry {
            layers: 3,
            hidden: 16,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            ffn: 40,
            vocab: 50,
            rope_base: 10_000,
        };
        let m = g.model("t", 32, &Device::Cpu, 0).unwrap();
        let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
        let per_layer = 2 * g.hidden * q + 2 * g.hidden * kv + 3 * g.hidden * g.ffn;
        assert_eq!(m.weight_bytes(), 4 * (g.layers * per_layer + g.vocab * g.hidden));
        assert_eq!(m.info.identity.n_kv_heads, 2);
        assert!(Geometry::LLAMA_3_1_8B.parameters() > 8_000_000_000);
        let Ok(veloq_candle::Method::VecInfer(vq)) = "vq-2".parse() else { panic!() };
        let cal = synthetic_calibration(&m, &vq, &mut Rng(7)).unwrap();
        assert_eq!(cal.layers.len(), 3);
        assert!(veloq_candle::CacheConfig::vecinfer(cal).build(&m).is_ok());
    }
}
