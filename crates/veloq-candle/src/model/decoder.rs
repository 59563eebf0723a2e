//! Pre-norm decoders over GGUF weights, GQA attention through the layer cache:
//! - the Llama family (Llama 2/3, SmolLM2, Mistral, Falcon3 as `llama`; Qwen2 with its q/k/v biases
//!   and NeoX RoPE), SwiGLU MLP;
//! - Gemma 3 (`gemma3`): embeddings × √hidden, per-head q/k RMS norms, norms after attention and
//!   after the MLP too, GELU (tanh) gated MLP, NeoX RoPE with base 10,000 on sliding-window layers
//!   and the file's base (and linear scaling) on global ones; every `sliding_window_pattern`-th layer
//!   (6) is global, the others see the last `sliding_window` positions (their caches keep only
//!   those).
//!
//! A forward pass runs a [`Step`]: one or more sequences, each at its own position with its own
//! number of new tokens, packed into one `[tokens, hidden]` activation. RoPE takes each token's
//! position from the step; the caches check that every sequence continues where its slot ends.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::RmsNorm;

#[cfg(feature = "cuda")]
use super::graph::StepPhases;
use super::linear::{Along, Fused, Linear};
use super::ModelInfo;
use crate::cache::{ModelCache, Step};
use crate::error::{Error, Result};
use veloq::artifact::ModelIdentity;

pub(super) struct Layer {
    pub(super) attn_norm: RmsNorm,
    pub(super) wq: Linear,
    pub(super) wk: Linear,
    pub(super) wv: Linear,
    pub(super) wo: Linear,
    pub(super) bias: Option<(Tensor, Tensor, Tensor)>,
    pub(super) ffn_norm: RmsNorm,
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
    /// Gemma 3: per-head q/k norms, norms on the attention and MLP outputs.
    pub(super) qk_norm: Option<(RmsNorm, RmsNorm)>,
    pub(super) post_norms: Option<(RmsNorm, RmsNorm)>,
    /// Sliding-window layer: attends the last `window` positions, with the local RoPE tables.
    pub(super) window: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Activation {
    Silu,
    GeluTanh,
}

pub struct Model {
    pub info: ModelInfo,
    pub(super) embed: Tensor,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: RmsNorm,
    pub(super) output: Linear,
    pub(super) neox: bool,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    /// RoPE tables of sliding-window layers (Gemma 3: base 10,000).
    pub(super) local_rope: Option<(Tensor, Tensor)>,
    pub(super) activation: Activation,
    pub(super) embed_scale: f64,
    pub(super) attn_scale: f64,
    pub(super) max_context: usize,
    pub(super) device: Device,
    #[cfg(feature = "cuda")]
    pub(super) graphs: super::graph::Graphs,
}

impl Model {
    /// Loads a GGUF file; `max_context` sizes the RoPE tables and bounds every forward call.
    pub fn load(path: &Path, max_context: usize, device: &Device) -> Result<(Self, gguf_file::Content)> {
        let bad = |reason: String| Error::Model { path: path.to_path_buf(), reason };
        let file = File::open(path).map_err(|e| bad(e.to_string()))?;
        let mut reader = BufReader::new(file);
        let ct = gguf_file::Content::read(&mut reader)
            .map_err(|e| bad(format!("not a readable GGUF file (truncated or corrupt?): {e}")))?;
        let md = |k: &str| ct.metadata.get(k);
        let arch = md("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| bad("no general.architecture".into()))?;
        let neox = match arch.as_str() {
            "llama" | "mistral" => false,
            "qwen2" | "gemma3" => true,
            other => return Err(Error::Architecture(other.to_string())),
        };
        let gemma = arch == "gemma3";
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
        let eps = md(&format!("{arch}.attention.layer_norm_rms_epsilon")).and_then(|v| v.to_f32().ok()).unwrap_or(1e-5)
            as f64;
        let rope_base = md(&format!("{arch}.rope.freq_base")).and_then(|v| v.to_f32().ok()).unwrap_or(10000.0);
        let get_f = |k: &str| md(&format!("{arch}.{k}")).and_then(|v| v.to_f32().ok());
        // Gemma 3: linear RoPE scaling on global layers (4B and up), windows on the others.
        let rope_scale = if gemma { get_f("rope.scaling.factor").filter(|f| *f > 0.0).unwrap_or(1.0) } else { 1.0 };
        let sliding = if gemma { Some(get_u("attention.sliding_window")?) } else { None };
        let pattern = get_u("attention.sliding_window_pattern").unwrap_or(6).max(1);
        let train_context = get_u("context_length").ok();
        if n_heads == 0 || n_kv == 0 || n_heads % n_kv != 0 {
            return Err(bad(format!("{n_heads} heads and {n_kv} kv-heads do not group")));
        }
        let name = md("general.name")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
        let mut eos_tokens = Vec::new();
        if let Some(v) = md("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()) {
            eos_tokens.push(v);
        }
        let spm = md("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).is_some_and(|m| m == "llama");
        let add_bos = md("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(spm);
        let bos = md("tokenizer.ggml.bos_token_id").and_then(|v| v.to_u32().ok()).filter(|_| add_bos);
        let vocab = md("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok()).map(|v| v.len()).unwrap_or(0);
        // Chat end markers of common templates end generation too.
        if let Some(tokens) = md("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok()) {
            for (i, t) in tokens.iter().enumerate() {
                if let Ok(s) = t.to_string() {
                    if matches!(s.as_str(), "<|im_end|>" | "<|eot_id|>" | "<|endoftext|>" | "<end_of_turn>")
                        && !eos_tokens.contains(&(i as u32))
                    {
                        eos_tokens.push(i as u32);
                    }
                }
            }
        }

        let mut tensor =
            |name: &str| ct.tensor(&mut reader, name, device).map_err(|e| bad(format!("tensor {name}: {e}")));
        let embed_q = tensor("token_embd.weight")?;
        let embed = embed_q.dequantize(device)?;
        // Tied embeddings when the file has no separate output matrix.
        let output = Linear::new(match tensor("output.weight") {
            Ok(t) => t,
            Err(_) => embed_q,
        })?;
        let norm = RmsNorm::new(tensor("output_norm.weight")?.dequantize(device)?, eps);
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let p = format!("blk.{i}");
            let mut q = |n: &str| -> Result<Linear> { Linear::new(tensor(&format!("{p}.{n}.weight"))?) };
            let (wq, wk, wv, wo) = (q("attn_q")?, q("attn_k")?, q("attn_v")?, q("attn_output")?);
            let (gate, up, down) = (q("ffn_gate")?, q("ffn_up")?, q("ffn_down")?);
            let mut norm = |n: &str| -> Result<RmsNorm> {
                Ok(RmsNorm::new(tensor(&format!("{p}.{n}.weight"))?.dequantize(device)?, eps))
            };
            let (qk_norm, post_norms) = if gemma {
                (
                    Some((norm("attn_q_norm")?, norm("attn_k_norm")?)),
                    Some((norm("post_attention_norm")?, norm("post_ffw_norm")?)),
                )
            } else {
                (None, None)
            };
            let window = sliding.filter(|_| (i + 1) % pattern != 0);
            let bias = if arch == "qwen2" {
                let mut b = |n: &str| -> Result<Tensor> { Ok(tensor(&format!("{p}.{n}.bias"))?.dequantize(device)?) };
                Some((b("attn_q")?, b("attn_k")?, b("attn_v")?))
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: RmsNorm::new(tensor(&format!("{p}.attn_norm.weight"))?.dequantize(device)?, eps),
                ffn_norm: RmsNorm::new(tensor(&format!("{p}.ffn_norm.weight"))?.dequantize(device)?, eps),
                wq,
                wk,
                wv,
                wo,
                bias,
                gate,
                up,
                down,
                qk_norm,
                post_norms,
                window,
            });
        }
        let (cos, sin) = rope_tables(head_dim, rope_base, rope_scale, max_context, device)?;
        let local_rope = if gemma { Some(rope_tables(head_dim, 10_000.0, 1.0, max_context, device)?) } else { None };
        // Gemma 3 scales queries by 1/√head_dim, except the 27B (62 layers): 1/√(hidden/heads).
        let attn_scale = if gemma && n_layers == 62 {
            1.0 / ((hidden / n_heads) as f64).sqrt()
        } else {
            1.0 / (head_dim as f64).sqrt()
        };
        let info = ModelInfo {
            identity: ModelIdentity { name, architecture: arch, n_layers, n_kv_heads: n_kv, head_dim },
            n_heads,
            hidden,
            vocab: if vocab > 0 { vocab } else { embed.dim(0)? },
            rope_base,
            train_context,
            eos_tokens,
            bos,
        };
        let model = Self {
            info,
            embed,
            layers,
            norm,
            output,
            neox,
            cos,
            sin,
            local_rope,
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            embed_scale: if gemma { (hidden as f64).sqrt() } else { 1.0 },
            attn_scale,
            max_context,
            device: device.clone(),
            #[cfg(feature = "cuda")]
            graphs: Default::default(),
        };
        Ok((model, ct))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Decode steps on CUDA replayed from CUDA graphs (on by default; `VELOQ_CUDA_GRAPHS=0`
    /// starts with them off). Off, every step issues its operations one by one.
    #[cfg(feature = "cuda")]
    pub fn set_cuda_graphs(&self, on: bool) {
        self.graphs.set(on)
    }

    /// CUDA graph launches issued so far (one per segment between attention calls).
    #[cfg(feature = "cuda")]
    pub fn cuda_graph_launches(&self) -> usize {
        self.graphs.launches()
    }

    /// Starts (sums from zero) or stops timing CUDA-graph decode steps part by part with CUDA
    /// events: the segments' products, rows in, attention, flushes (see [`StepPhases`]).
    #[cfg(feature = "cuda")]
    pub fn set_step_phases(&self, on: bool) {
        self.graphs.set_phases(on)
    }

    /// What timed graph steps spent in each part since [`set_step_phases`](Self::set_step_phases).
    #[cfg(feature = "cuda")]
    pub fn step_phases(&self) -> Option<StepPhases> {
        self.graphs.phases()
    }

    /// Bytes of the weight matrices a decode step reads (every layer's and the output head; the
    /// embedding table contributes one row per token, not counted).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down].iter().map(|w| w.bytes()).sum::<usize>())
            .sum();
        layers + self.output.bytes()
    }

    /// The window of a sliding-window layer, `None` for layers that see every position.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.layers.get(layer).and_then(|l| l.window)
    }

    /// Runs `tokens` for the sequence in slot 0, continuing where its caches end. Returns logits
    /// `[T, vocab]` for every position when `all_logits`, else `[1, vocab]` for the last.
    pub fn forward(&self, tokens: &[u32], cache: &mut ModelCache, all_logits: bool) -> Result<Tensor> {
        if tokens.is_empty() {
            return Err(Error::Config("forward needs at least one token".into()));
        }
        let step = Step::single(0, cache.len(0), tokens.len())?;
        self.forward_step(tokens, &step, cache, if all_logits { Logits::All } else { Logits::Last })
    }

    /// Runs one step: `tokens` packed in the step's order (each sequence's new tokens after the
    /// previous sequence's), every sequence at its own position, appending to `cache`'s slots.
    /// Returns logits `[tokens, vocab]` ([`Logits::All`]) or `[sequences, vocab]` for each
    /// sequence's last token ([`Logits::Last`]).
    pub fn forward_step(&self, tokens: &[u32], step: &Step, cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
        let n_caches = cache.layers_mut().len();
        if n_caches != self.layers.len() {
            return Err(Error::Config(format!("{n_caches} caches for {} layers", self.layers.len())));
        }
        let n = step.tokens();
        if tokens.len() != n {
            return Err(Error::Shape(format!("{} tokens for a step of {n}", tokens.len())));
        }
        if step.end() > self.max_context {
            return Err(Error::ContextOverflow { requested: step.end(), max: self.max_context });
        }
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= self.embed.dim(0).unwrap_or(0)) {
            return Err(Error::Config(format!("token id {bad} outside the vocabulary")));
        }
        #[cfg(feature = "cuda")]
        if let Some(out) = self.graphs.forward(self, tokens, step, cache)? {
            return Ok(out);
        }
        let caches = cache.layers_mut();
        let mut x = self.embed_tokens(&Tensor::new(tokens, &self.device)?)?;
        let rope = self.rope_rows(&Tensor::new(step.positions().as_slice(), &self.device)?)?;
        let scale = self.attn_scale as f32;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let Qkv { q, k, v, .. } = self.qkv(layer, &x, &rope, None)?;
            cache.append(&k, &v, step)?;
            let y = cache.attend(&q, step, scale)?; // [tokens, nh, hd]
            cache.commit()?;
            x = self.residual(layer, &x, &y)?;
        }
        let x = match logits {
            Logits::All => x,
            Logits::Last => {
                let last: Vec<u32> = (0..step.seqs().len()).map(|i| (step.rows(i).end - 1) as u32).collect();
                x.index_select(&Tensor::new(last.as_slice(), &self.device)?, 0)?
            }
        };
        self.head(&x)
    }

    /// The residual stream `[tokens, hidden]` (f32) of token ids `[tokens]` on the model's device.
    pub(super) fn embed_tokens(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.embed.index_select(ids, 0)?.to_dtype(DType::F32)?;
        Ok(if self.embed_scale != 1.0 { (x * self.embed_scale)? } else { x })
    }

    /// Each token's RoPE rows for `positions` `[tokens]` (u32): `[tokens, 1, head_dim / 2]`.
    pub(super) fn rope_rows(&self, positions: &Tensor) -> Result<RopeRows> {
        let rows = |t: &Tensor| -> Result<Tensor> { Ok(t.index_select(positions, 0)?.unsqueeze(1)?) };
        let local = match &self.local_rope {
            Some((c, s)) => Some((rows(c)?, rows(s)?)),
            None => None,
        };
        Ok(RopeRows { cos: rows(&self.cos)?, sin: rows(&self.sin)?, local })
    }

    /// A layer's queries `[tokens, heads, D]`, keys and values `[tokens, kv heads, D]` (f32,
    /// contiguous, RoPE applied) from the residual stream. Where one launch writes all three,
    /// it writes them into `into` when given (q, k, v one after another: a CUDA graph's fixed
    /// buffer) and `packed` is that buffer.
    pub(super) fn qkv(&self, layer: &Layer, x: &Tensor, rope: &RopeRows, into: Option<&Tensor>) -> Result<Qkv> {
        let info = &self.info;
        let (nh, nkv, hd) = (info.n_heads, info.identity.n_kv_heads, info.identity.head_dim);
        let n = x.dim(0)?;
        let (cos, sin) = match (&rope.local, layer.window) {
            (Some((c, s)), Some(_)) => (c, s),
            _ => (&rope.cos, &rope.sin),
        };
        // Tokens as the batch of candle's RoPE ([tokens, heads, 1, head_dim]), each with its row.
        let rope = |x: Tensor, heads: usize| -> Result<Tensor> {
            let x = x.reshape((n, heads, 1, hd))?.contiguous()?;
            let y = if self.neox {
                candle_nn::rotary_emb::rope(&x, cos, sin)?
            } else {
                candle_nn::rotary_emb::rope_i(&x, cos, sin)?
            };
            Ok(y.reshape((n, heads, hd))?)
        };
        // The norm, the three products and (interleaved) RoPE in one launch where veloq's GEMV
        // takes the weights; nothing may sit between them (biases, Gemma's q/k norms).
        if layer.bias.is_none() && layer.qk_norm.is_none() {
            let rope_fused = !self.neox;
            let along = Along {
                norm: Some(&layer.attn_norm),
                rope: rope_fused.then_some((cos, sin)),
                into: into.filter(|_| rope_fused),
                ..Along::default()
            };
            if let Some(out) = Linear::fused(&[&layer.wq, &layer.wk, &layer.wv], x, Fused::Each, along)? {
                let p = &out.parts;
                let (q, k, v) = (p[0].reshape((n, nh, hd))?, p[1].reshape((n, nkv, hd))?, p[2].reshape((n, nkv, hd))?);
                return Ok(if self.neox {
                    Qkv { q: rope(q, nh)?, k: rope(k, nkv)?, v, packed: None }
                } else {
                    Qkv { q, k, v, packed: Some(out.flat) }
                });
            }
        }
        let h = layer.attn_norm.forward(x)?;
        let (mut q, mut k, mut v) = (layer.wq.forward(&h)?, layer.wk.forward(&h)?, layer.wv.forward(&h)?);
        if let Some((bq, bk, bv)) = &layer.bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        let (mut q, mut k) = (q.reshape((n, nh, hd))?, k.reshape((n, nkv, hd))?);
        if let Some((qn, kn)) = &layer.qk_norm {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        Ok(Qkv { q: rope(q, nh)?, k: rope(k, nkv)?, v: v.reshape((n, nkv, hd))?.contiguous()?, packed: None })
    }

    /// The residual stream after a layer: attention output `y` `[tokens, heads, D]` projected and
    /// added, then the MLP's. Where veloq's GEMV takes the weights, three launches: the output
    /// projection adding into the stream, the MLP's norm with its gated pair, the down projection
    /// adding (Gemma's norms after attention and MLP sit between, so not there); they update `x`
    /// in place and return it.
    pub(super) fn residual(&self, layer: &Layer, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let a = y.reshape((n, y.elem_count() / n.max(1)))?;
        let plain = layer.post_norms.is_none();
        let into = |w: &Linear, a: &Tensor, x: &Tensor| -> Result<Option<Tensor>> {
            let along = Along { residual: Some(x), in_place: true, ..Along::default() };
            Ok(if plain { Linear::fused(&[w], a, Fused::Each, along)?.map(|mut p| p.parts.remove(0)) } else { None })
        };
        let x = match into(&layer.wo, &a, x)? {
            Some(x) => x,
            None => {
                let mut o = layer.wo.forward(&a)?;
                if let Some((post_attn, _)) = &layer.post_norms {
                    o = post_attn.forward(&o)?;
                }
                (x + o)?
            }
        };
        let how = match self.activation {
            Activation::Silu => Fused::GatedSilu,
            Activation::GeluTanh => Fused::GatedGeluTanh,
        };
        let along = Along { norm: Some(&layer.ffn_norm), ..Along::default() };
        let gated = match Linear::fused(&[&layer.gate, &layer.up], &x, how, along)? {
            Some(mut g) => g.parts.remove(0),
            None => {
                let h = layer.ffn_norm.forward(&x)?;
                let gate = layer.gate.forward(&h)?;
                let gate = match self.activation {
                    Activation::Silu => candle_nn::ops::silu(&gate)?,
                    Activation::GeluTanh => gate.gelu()?,
                };
                (gate * layer.up.forward(&h)?)?
            }
        };
        if let Some(x) = into(&layer.down, &gated, &x)? {
            return Ok(x);
        }
        let mut mlp = layer.down.forward(&gated)?;
        if let Some((_, post_ffn)) = &layer.post_norms {
            mlp = post_ffn.forward(&mlp)?;
        }
        Ok((x + mlp)?)
    }

    /// Logits (f32) of residual rows `x`.
    pub(super) fn head(&self, x: &Tensor) -> Result<Tensor> {
        let along = Along { norm: Some(&self.norm), ..Along::default() };
        if let Some(mut p) = Linear::fused(&[&self.output], x, Fused::Each, along)? {
            return Ok(p.parts.remove(0));
        }
        let x = self.norm.forward(x)?;
        Ok(self.output.forward(&x)?.to_dtype(DType::F32)?)
    }
}

/// A layer's queries, keys and values ([`Model::qkv`]).
pub(super) struct Qkv {
    pub(super) q: Tensor,
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    /// q, k and v one after another in one buffer, when one launch wrote them so (the buffer
    /// `Model::qkv` was given, or one the CUDA graphs copy into theirs at once).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) packed: Option<Tensor>,
}

/// Each token's RoPE rows in one step (global tables, and the local ones of sliding layers).
pub(super) struct RopeRows {
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    pub(super) local: Option<(Tensor, Tensor)>,
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Every token's: `[tokens, vocab]`.
    All,
    /// Each sequence's last token's: `[sequences, vocab]`.
    Last,
}

/// cos/sin tables `[max_context, head_dim/2]` for RoPE; positions divided by `scale` (linear
/// scaling).
pub(super) fn rope_tables(
    head_dim: usize,
    base: f32,
    scale: f32,
    max_context: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim).step_by(2).map(|i| 1.0 / base.powf(i as f32 / head_dim as f32) / scale).collect();
    let inv = Tensor::new(inv.as_slice(), device)?.reshape((1, head_dim / 2))?;
    let t = Tensor::arange(0u32, max_context as u32, device)?.to_dtype(DType::F32)?.reshape((max_context, 1))?;
    let freqs = t.matmul(&inv)?;
    Ok((freqs.cos()?, freqs.sin()?))
}

impl Model {
    /// Loads a GGUF model and its tokenizer on the CPU.
    pub fn open(path: &Path, max_context: usize) -> Result<(Self, tokenizers::Tokenizer)> {
        Self::open_on(path, max_context, &Device::Cpu)
    }

    /// Loads a GGUF model (weights on `device`) and its tokenizer.
    pub fn open_on(path: &Path, max_context: usize, device: &Device) -> Result<(Self, tokenizers::Tokenizer)> {
        let (model, ct) = Self::load(path, max_context, device)?;
        let tok = super::load_tokenizer(&ct)?;
        Ok((model, tok))
    }
}
