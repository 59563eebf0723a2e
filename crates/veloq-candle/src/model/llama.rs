//! The Llama family (Llama 2/3, SmolLM2, Mistral, Falcon3 as `llama`; Qwen2 with its q/k/v
//! biases and NeoX RoPE): pre-norm decoder, GQA attention through the layer cache, SwiGLU MLP.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, Module, Tensor};
use candle_transformers::quantized_nn::RmsNorm;

use super::ModelInfo;
use crate::cache::LayerCache;
use crate::error::{Error, Result};
use veloq::artifact::ModelIdentity;

struct Layer {
    attn_norm: RmsNorm,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    bias: Option<(Tensor, Tensor, Tensor)>,
    ffn_norm: RmsNorm,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

pub struct Model {
    pub info: ModelInfo,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: QMatMul,
    neox: bool,
    cos: Tensor,
    sin: Tensor,
    max_context: usize,
    device: Device,
}

impl Model {
    /// Loads a GGUF file; `max_context` sizes the RoPE tables and bounds every forward call.
    pub fn load(path: &Path, max_context: usize, device: &Device) -> Result<(Self, gguf_file::Content)> {
        let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(|e| bad(e.to_string()))?;
        let mut reader = BufReader::new(file);
        let ct = gguf_file::Content::read(&mut reader).map_err(|e| bad(format!("not a readable GGUF file (truncated or corrupt?): {e}")))?;
        let md = |k: &str| ct.metadata.get(k);
        let arch = md("general.architecture").and_then(|v| v.to_string().ok()).cloned().ok_or_else(|| bad("no general.architecture".into()))?;
        let neox = match arch.as_str() {
            "llama" | "mistral" => false,
            "qwen2" => true,
            other => return Err(Error::Architecture(other.to_string())),
        };
        let get_u = |k: &str| -> Result<usize> {
            md(&format!("{arch}.{k}"))
                .ok_or_else(|| bad(format!("missing metadata {arch}.{k}")))?
                .to_u32()
                .map(|v| v as usize)
                .map_err(|e| bad(format!("{arch}.{k}: {e}")))
        };
        let n_heads = get_u("attention.head_count")?;
        let n_kv = get_u("attention.head_count_kv")?;
        let n_layers = get_u("block_count")?;
        let hidden = get_u("embedding_length")?;
        let head_dim = get_u("attention.key_length").unwrap_or(hidden / n_heads);
        let eps = md(&format!("{arch}.attention.layer_norm_rms_epsilon")).and_then(|v| v.to_f32().ok()).unwrap_or(1e-5) as f64;
        let rope_base = md(&format!("{arch}.rope.freq_base")).and_then(|v| v.to_f32().ok()).unwrap_or(10000.0);
        let train_context = get_u("context_length").ok();
        if n_heads == 0 || n_kv == 0 || n_heads % n_kv != 0 {
            return Err(bad(format!("{n_heads} heads and {n_kv} kv-heads do not group")));
        }
        let name = md("general.name").and_then(|v| v.to_string().ok()).cloned().unwrap_or_else(|| {
            path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        });
        let mut eos_tokens = Vec::new();
        if let Some(v) = md("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()) {
            eos_tokens.push(v);
        }
        let vocab = md("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok()).map(|v| v.len()).unwrap_or(0);
        // Chat end markers of common templates end generation too.
        if let Some(tokens) = md("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok()) {
            for (i, t) in tokens.iter().enumerate() {
                if let Ok(s) = t.to_string() {
                    if matches!(s.as_str(), "<|im_end|>" | "<|eot_id|>" | "<|endoftext|>") && !eos_tokens.contains(&(i as u32)) {
                        eos_tokens.push(i as u32);
                    }
                }
            }
        }

        let mut tensor = |name: &str| ct.tensor(&mut reader, name, device).map_err(|e| bad(format!("tensor {name}: {e}")));
        let embed_q = tensor("token_embd.weight")?;
        let embed = embed_q.dequantize(device)?;
        // Tied embeddings when the file has no separate output matrix.
        let output = QMatMul::from_qtensor(match tensor("output.weight") {
            Ok(t) => t,
            Err(_) => embed_q,
        })?;
        let norm = RmsNorm::from_qtensor(tensor("output_norm.weight")?, eps)?;
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let p = format!("blk.{i}");
            let mut q = |n: &str| -> Result<QMatMul> { Ok(QMatMul::from_qtensor(tensor(&format!("{p}.{n}.weight"))?)?) };
            let (wq, wk, wv, wo) = (q("attn_q")?, q("attn_k")?, q("attn_v")?, q("attn_output")?);
            let (gate, up, down) = (q("ffn_gate")?, q("ffn_up")?, q("ffn_down")?);
            let bias = if arch == "qwen2" {
                let mut b = |n: &str| -> Result<Tensor> { Ok(tensor(&format!("{p}.{n}.bias"))?.dequantize(device)?) };
                Some((b("attn_q")?, b("attn_k")?, b("attn_v")?))
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: RmsNorm::from_qtensor(tensor(&format!("{p}.attn_norm.weight"))?, eps)?,
                ffn_norm: RmsNorm::from_qtensor(tensor(&format!("{p}.ffn_norm.weight"))?, eps)?,
                wq,
                wk,
                wv,
                wo,
                bias,
                gate,
                up,
                down,
            });
        }
        let (cos, sin) = rope_tables(head_dim, rope_base, max_context, device)?;
        let info = ModelInfo {
            identity: ModelIdentity { name, architecture: arch, n_layers, n_kv_heads: n_kv, head_dim },
            n_heads,
            hidden,
            vocab: if vocab > 0 { vocab } else { embed.dim(0)? },
            rope_base,
            train_context,
            eos_tokens,
        };
        let model = Self { info, embed, layers, norm, output, neox, cos, sin, max_context, device: device.clone() };
        Ok((model, ct))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Runs `tokens` at positions `caches[0].len()..`, appending to the caches. Returns logits
    /// `[T, vocab]` for every position when `all_logits`, else `[1, vocab]` for the last.
    pub fn forward(&self, tokens: &[u32], caches: &mut [Box<dyn LayerCache>], all_logits: bool) -> Result<Tensor> {
        if caches.len() != self.layers.len() {
            return Err(Error::Config(format!("{} caches for {} layers", caches.len(), self.layers.len())));
        }
        let pos = caches[0].len();
        let t = tokens.len();
        if t == 0 {
            return Err(Error::Config("forward needs at least one token".into()));
        }
        if pos + t > self.max_context {
            return Err(Error::ContextOverflow { requested: pos + t, max: self.max_context });
        }
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= self.embed.dim(0).unwrap_or(0)) {
            return Err(Error::Config(format!("token id {bad} outside the vocabulary")));
        }
        let info = &self.info;
        let (nh, nkv, hd) = (info.n_heads, info.identity.n_kv_heads, info.identity.head_dim);
        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?.unsqueeze(0)?; // [1, T, hidden]
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let scale = 1.0 / (hd as f64).sqrt();
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let h = layer.attn_norm.forward(&x)?;
            let (mut q, mut k, mut v) = (layer.wq.forward(&h)?, layer.wk.forward(&h)?, layer.wv.forward(&h)?);
            if let Some((bq, bk, bv)) = &layer.bias {
                q = q.broadcast_add(bq)?;
                k = k.broadcast_add(bk)?;
                v = v.broadcast_add(bv)?;
            }
            let q = q.reshape((1, t, nh, hd))?.transpose(1, 2)?.contiguous()?;
            let k = k.reshape((1, t, nkv, hd))?.transpose(1, 2)?.contiguous()?;
            let v = v.reshape((1, t, nkv, hd))?.transpose(1, 2)?.contiguous()?;
            let (q, k) = if self.neox {
                (candle_nn::rotary_emb::rope(&q, &cos, &sin)?, candle_nn::rotary_emb::rope(&k, &cos, &sin)?)
            } else {
                (candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?, candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?)
            };
            cache.append(&k, &v)?;
            let y = cache.attend(&q, scale)?; // [1, nh, T, hd]
            let y = y.transpose(1, 2)?.reshape((1, t, nh * hd))?;
            x = (x + layer.wo.forward(&y)?)?;
            let h = layer.ffn_norm.forward(&x)?;
            let mlp = layer.down.forward(&(candle_nn::ops::silu(&layer.gate.forward(&h)?)? * layer.up.forward(&h)?)?)?;
            x = (x + mlp)?;
        }
        let x = if all_logits { x } else { x.narrow(1, t - 1, 1)? };
        let x = self.norm.forward(&x)?;
        Ok(self.output.forward(&x)?.squeeze(0)?.to_dtype(DType::F32)?)
    }
}

/// cos/sin tables `[max_context, head_dim/2]` for RoPE.
fn rope_tables(head_dim: usize, base: f32, max_context: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1.0 / base.powf(i as f32 / head_dim as f32)).collect();
    let inv = Tensor::new(inv.as_slice(), device)?.reshape((1, head_dim / 2))?;
    let t = Tensor::arange(0u32, max_context as u32, device)?.to_dtype(DType::F32)?.reshape((max_context, 1))?;
    let freqs = t.matmul(&inv)?;
    Ok((freqs.cos()?, freqs.sin()?))
}


impl Model {
    /// Loads a GGUF model and its tokenizer on the CPU.
    pub fn open(path: &Path, max_context: usize) -> Result<(Self, tokenizers::Tokenizer)> {
        let (model, ct) = Self::load(path, max_context, &Device::Cpu)?;
        let tok = super::load_tokenizer(&ct)?;
        Ok((model, tok))
    }
}
