//! Models with random weights built in memory, for measuring speed and memory at a real model's
//! geometry without its file (attention and matmul costs do not depend on weight values). f16
//! weights (candle's f16 matmul), f32 activations, the Llama forward pass.

use candle_core::quantized::QMatMul;

use super::linear::Linear;
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
}

impl Model {
    /// A model of `geometry` with N(0, 0.02²) f16 weights, unit norms, on `device` (from `seed`
    /// on GPUs; unseeded on the CPU).
    pub fn synthetic(name: &str, geometry: Geometry, max_context: usize, device: &Device, seed: u64) -> Result<Self> {
        let g = geometry;
        if g.heads == 0 || g.kv_heads == 0 || !g.heads.is_multiple_of(g.kv_heads) || !g.head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "{} heads, {} kv heads of {}: heads must group, head_dim even",
                g.heads, g.kv_heads, g.head_dim
            )));
        }
        // candle's CPU generator cannot be seeded; device generators can.
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let w = |rows: usize, cols: usize| -> Result<Linear> {
            Ok(QMatMul::TensorF16(Tensor::randn(0f32, 0.02, (rows, cols), device)?.to_dtype(DType::F16)?).into())
        };
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
            identity: ModelIdentity {
                name: name.into(),
                architecture: "llama".into(),
                n_layers: g.layers,
                n_kv_heads: g.kv_heads,
                head_dim: g.head_dim,
            },
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
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{SeqStep, Step};
    use crate::config::CacheConfig;
    use crate::model::Logits;
    use veloq::kernels::select::KernelChoice;

    /// A tiny random model runs ragged steps — sequences at different positions with different
    /// token counts, one slot idle — and each sequence gets the logits it gets alone, on the CPU
    /// kernels and on the portable backend.
    #[test]
    fn ragged_steps_match_single_sequences() {
        let m = crate::testing::tiny_model(50, 32);
        // (slot, tokens) per step.
        let steps: [&[(usize, &[u32])]; 3] = [
            &[(0, &[1, 2, 3]), (2, &[40])],
            &[(2, &[7, 8]), (0, &[5]), (1, &[9, 10, 11, 12])],
            &[(1, &[3]), (0, &[4]), (2, &[6])],
        ];
        for kernels in [KernelChoice::Auto, KernelChoice::Forbid] {
            let cfg = CacheConfig { kernels, ..CacheConfig::fp16() };
            let mut batch = cfg.build_batch(&m, 3).unwrap();
            let mut alone: Vec<_> = (0..3).map(|_| cfg.build(&m).unwrap()).collect();
            for (n, seqs) in steps.iter().enumerate() {
                let step = Step::new(
                    seqs.iter()
                        .map(|(slot, t)| SeqStep { slot: *slot, start: batch.len(*slot), len: t.len() })
                        .collect(),
                )
                .unwrap();
                let tokens: Vec<u32> = seqs.iter().flat_map(|(_, t)| t.iter().copied()).collect();
                let got = m.forward_step(&tokens, &step, &mut batch, Logits::Last).unwrap();
                for (i, (slot, t)) in seqs.iter().enumerate() {
                    let want = m.forward(t, &mut alone[*slot], false).unwrap();
                    let err = (want - got.narrow(0, i, 1).unwrap())
                        .unwrap()
                        .abs()
                        .unwrap()
                        .max_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap();
                    assert!(err < 1e-3, "{kernels:?} step {n}, slot {slot}: {err}");
                }
            }
            assert_eq!((batch.len(0), batch.len(1), batch.len(2)), (5, 5, 4));
            let e = m.forward_step(&[1], &Step::single(0, 3, 1).unwrap(), &mut batch, Logits::Last).unwrap_err();
            assert!(matches!(e, crate::Error::Position { slot: 0, expected: 5, got: 3 }), "{e}");
        }
        assert!(Geometry::LLAMA_3_1_8B.parameters() > 8_000_000_000);
    }

    /// The bytes floor of `bench runner` counts every weight matrix once: 7 per layer and the
    /// output head, 2 bytes per f16 weight (norms and the embedding table are not read whole).
    #[test]
    fn weight_bytes_count_every_matrix() {
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
        let m = Model::synthetic("t", g, 32, &candle_core::Device::Cpu, 0).unwrap();
        let (q, kv) = (g.heads * g.head_dim, g.kv_heads * g.head_dim);
        let per_layer = 2 * g.hidden * q + 2 * g.hidden * kv + 3 * g.hidden * g.ffn;
        assert_eq!(m.weight_bytes(), 2 * (g.layers * per_layer + g.vocab * g.hidden));
    }
}
