//! Models with random weights built in memory, for measuring speed and memory at a real model's
//! geometry without its file (attention and matmul costs do not depend on weight values). f16
//! weights (candle's f16 matmul), f32 activations, the Llama forward pass.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Tensor};
use candle_nn::RmsNorm;

use super::decoder::{rope_tables, Activation, Layer, Model};
use super::ModelInfo;
use crate::error::{Error, Result};
use veloq::artifact::ModelIdentity;

/// A Llama-family geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope_base: u32,
}

impl Geometry {
    /// Llama 3.1 8B: 32 layers, 32 query heads, 8 kv heads of 128, MLP 14,336, vocabulary 128,256.
    pub const LLAMA_3_1_8B: Self = Self { layers: 32, hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128, ffn: 14336, vocab: 128_256, rope_base: 500_000 };

    /// Parameters (embeddings and output head counted once each).
    pub fn parameters(&self) -> usize {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        self.layers * (h * q * 2 + h * kv * 2 + 3 * h * self.ffn + 2 * h) + 2 * self.vocab * h + h
    }
}

impl Model {
    /// A model of `geometry` with N(0, 0.02²) f16 weights, unit norms, on `device` (from `seed`
    /// on GPUs; unseeded on the CPU).
    pub fn synthetic(name: &str, geometry: Geometry, max_context: usize, device: &Device, seed: u64) -> Result<Self> {
        let g = geometry;
        if g.heads == 0 || g.kv_heads == 0 || g.heads % g.kv_heads != 0 || g.head_dim % 2 != 0 {
            return Err(Error::Config(format!("{} heads, {} kv heads of {}: heads must group, head_dim even", g.heads, g.kv_heads, g.head_dim)));
        }
        // candle's CPU generator cannot be seeded; device generators can.
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let w = |rows: usize, cols: usize| -> Result<QMatMul> { Ok(QMatMul::TensorF16(Tensor::randn(0f32, 0.02, (rows, cols), device)?.to_dtype(DType::F16)?)) };
        let norm = || -> Result<RmsNorm> { Ok(RmsNorm::new(Tensor::ones(g.hidden, DType::F32, device)?, 1e-5)) };
        let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
        let layers = (0..g.layers)
            .map(|_| {
                Ok(Layer {
                    attn_norm: norm()?,
                    wq: w(q, g.hidden)?,
                    wk: w(kv, g.hidden)?,
                    wv: w(kv, g.hidden)?,
                    wo: w(g.hidden, q)?,
                    bias: None,
                    ffn_norm: norm()?,
                    gate: w(g.ffn, g.hidden)?,
                    up: w(g.ffn, g.hidden)?,
                    down: w(g.hidden, g.ffn)?,
                    qk_norm: None,
                    post_norms: None,
                    window: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (cos, sin) = rope_tables(g.head_dim, g.rope_base as f32, 1.0, max_context, device)?;
        let info = ModelInfo {
            identity: ModelIdentity { name: name.into(), architecture: "llama".into(), n_layers: g.layers, n_kv_heads: g.kv_heads, head_dim: g.head_dim },
            n_heads: g.heads,
            hidden: g.hidden,
            vocab: g.vocab,
            rope_base: g.rope_base as f32,
            train_context: None,
            eos_tokens: Vec::new(),
            bos: None,
        };
        Ok(Self {
            info,
            embed: Tensor::randn(0f32, 1.0, (g.vocab, g.hidden), device)?.to_dtype(DType::F16)?,
            layers,
            norm: norm()?,
            output: w(g.vocab, g.hidden)?,
            neox: false,
            cos,
            sin,
            local_rope: None,
            activation: Activation::Silu,
            embed_scale: 1.0,
            attn_scale: 1.0 / (g.head_dim as f64).sqrt(),
            max_context,
            device: device.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CacheConfig;

    /// A tiny random model decodes a batch on the CPU through the device-tensor fp16 cache, and
    /// each sequence of the batch gets the logits it gets alone.
    #[test]
    fn tiny_batch_matches_single_sequences() {
        let g = Geometry { layers: 2, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 96, vocab: 50, rope_base: 10_000 };
        let dev = Device::Cpu;
        let m = Model::synthetic("tiny", g, 32, &dev, crate::testing::fresh_seed()).unwrap();
        let prompts: [&[u32]; 3] = [&[1, 2, 3], &[7, 8, 9], &[40, 0, 12]];
        let mut caches = CacheConfig::fp16().build_batch(&m, 3).unwrap();
        let mut all = vec![m.forward_batch(&prompts, &mut caches, false).unwrap()];
        all.push(m.forward_batch(&[&[5], &[6], &[49]], &mut caches, false).unwrap());
        for (s, (p, next)) in prompts.iter().zip([5u32, 6, 49]).enumerate() {
            let mut one = CacheConfig::fp16().build(&m).unwrap();
            let a = m.forward(p, &mut one, false).unwrap();
            let b = m.forward(&[next], &mut one, false).unwrap();
            for (alone, batched) in [a, b].iter().zip(&all) {
                let err = (alone - batched.get(s).unwrap()).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(err < 1e-3, "sequence {s}: {err}");
            }
        }
        assert!(Geometry::LLAMA_3_1_8B.parameters() > 8_000_000_000);
        assert!(CacheConfig::kivi(2, 32).build_batch(&m, 2).is_err());
    }
}
