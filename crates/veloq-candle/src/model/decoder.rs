//! Pre-norm decoders over GGUF weights, GQA attention through the layer cache. What differs
//! between families — norm placement, q/k norms, biases, activation, RoPE style and bases,
//! sliding-window layers, embedding scale, fused tensors — is read from the family's
//! [`Architecture`] descriptor and the file's metadata, never from its name.
//!
//! A forward pass runs a [`Step`]: one or more sequences, each at its own position with its own
//! number of new tokens, packed into one `[tokens, hidden]` activation. RoPE takes each token's
//! position from the step; the caches check that every sequence continues where its slot ends.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::RmsNorm;

use super::arch::{Activation, Architecture, Norms, RopeStyle, Sliding};
use super::linear::{Along, Fused, Linear};
use super::source::{GgufFile, ModelSource, Weight};
use super::{JinjaTemplate, ModelInfo, Template};
use crate::cache::{ModelCache, Step};
use crate::error::{Error, Result};
use veloq::artifact::ModelIdentity;

/// A layer's q/k/v matrices: three, or one with q, k and v rows one after another.
pub(crate) enum Qkv3 {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// A layer's gate and up matrices: two, or one with the gate's rows then the up's.
pub(crate) enum GateUp {
    Separate { gate: Linear, up: Linear },
    Fused(Linear),
}

pub(crate) struct Layer {
    pub(crate) attn_norm: RmsNorm,
    pub(crate) qkv: Qkv3,
    pub(crate) wo: Linear,
    pub(crate) bias: Option<(Tensor, Tensor, Tensor)>,
    pub(crate) ffn_norm: RmsNorm,
    pub(crate) gate_up: GateUp,
    pub(crate) down: Linear,
    /// Per-head q/k norms (Gemma 3, Qwen3).
    pub(crate) qk_norm: Option<(RmsNorm, RmsNorm)>,
    /// Norms on the attention and MLP outputs (Gemma 3).
    pub(crate) post_norms: Option<(RmsNorm, RmsNorm)>,
    /// Sliding-window layer: attends the last `window` positions, with the local RoPE tables.
    pub(crate) window: Option<usize>,
}

/// A decoder's weights and tables: what a forward pass reads. Holds no cache and no device
/// state: the caches are passed to every pass, CUDA graphs belong to a
/// [`Runner`](crate::runner::Runner).
pub struct Model {
    /// Geometry, vocabulary facts and the family's descriptor.
    pub info: ModelInfo,
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: RmsNorm,
    pub(crate) output: Linear,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    /// RoPE tables of sliding-window layers, when their base differs (Gemma 3: 10,000).
    pub(crate) local_rope: Option<(Tensor, Tensor)>,
    pub(crate) embed_scale: f64,
    pub(crate) attn_scale: f64,
    pub(crate) max_context: usize,
    pub(crate) device: Device,
}

/// How a model is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Longest context (prompts + generated) any forward pass may reach: sizes the RoPE tables.
    pub max_context: usize,
    /// What the weight matrices are multiplied as.
    pub weights: Weights,
}

impl LoadOptions {
    /// Quantized weights as stored, up to `max_context` positions.
    pub fn new(max_context: usize) -> Self {
        Self { max_context, weights: Weights::Stored }
    }
}

/// What a GGUF file's quantized weight matrices become when loaded (float matrices are f16 on
/// CUDA and f32 on the CPU whatever this says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Weights {
    /// Blocks as stored, multiplied by the quantized kernels (the smallest).
    #[default]
    Stored,
    /// Dequantized to f16: on CUDA a step's products go through veloq's fused GEMV (up to 8
    /// rows) and cuBLAS's tensor cores (more: prompt chunks, large batches), where candle's
    /// quantized kernels are slow; about 2× the bytes of 8-bit blocks and 3× those of 4-bit ones.
    F16,
    /// Dequantized to f32: the same matmul arithmetic on every device (candle's quantized CUDA
    /// and CPU matmuls round differently); the largest and slowest.
    F32,
}

impl Weights {
    /// Every form, as `FromStr` and `Display` spell them.
    pub const ALL: [Weights; 3] = [Weights::Stored, Weights::F16, Weights::F32];
}

impl std::fmt::Display for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Weights::Stored => "stored",
            Weights::F16 => "f16",
            Weights::F32 => "f32",
        })
    }
}

impl std::str::FromStr for Weights {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Weights::ALL.into_iter().find(|w| w.to_string() == s).ok_or_else(|| {
            Error::Config(format!("unknown weight form {s:?}: stored (as in the file), f16 or f32 (dequantized)"))
        })
    }
}

impl Model {
    /// Loads a model from `source` (a GGUF file, or weights in memory) onto `device`.
    pub fn load(source: &mut dyn ModelSource, options: &LoadOptions, device: &Device) -> Result<Self> {
        let origin = source.origin();
        let bad = |reason: String| Error::Model { path: origin.clone(), reason };
        let md = source.metadata();
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| bad("no general.architecture".into()))?;
        let arch = Architecture::named(&arch_name)?;
        let meta = Meta { md, arch: arch.name, bad: &bad };
        let n_heads = meta.usize("attention.head_count")?;
        let n_kv = meta.usize("attention.head_count_kv")?;
        let n_layers = meta.usize("block_count")?;
        let hidden = meta.usize("embedding_length")?;
        if n_heads == 0 || n_kv == 0 || !n_heads.is_multiple_of(n_kv) {
            return Err(bad(format!("{n_heads} heads and {n_kv} kv-heads do not group")));
        }
        let head_dim = meta.opt_usize("attention.key_length")?.unwrap_or(hidden / n_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {head_dim}: RoPE needs an even, non-zero head dimension")));
        }
        let eps = meta.opt_f32("attention.layer_norm_rms_epsilon").unwrap_or(1e-5) as f64;
        let rope_base = meta.opt_f32("rope.freq_base").unwrap_or(10000.0);
        let rope_scale = match arch.linear_rope_scaling {
            true => meta.opt_f32("rope.scaling.factor").filter(|f| *f > 0.0).unwrap_or(1.0),
            false => 1.0,
        };
        let sliding = meta.opt_usize("attention.sliding_window")?.filter(|&w| w > 0);
        let pattern = meta.opt_usize("attention.sliding_window_pattern")?;
        let train_context = meta.opt_usize("context_length")?;
        let name = md
            .get("general.name")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_else(|| origin.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default());
        let (eos_tokens, bos, vocab) = vocabulary(md);
        let chat_template = jinja_template(md);

        let weights = options.weights;
        let embed_w =
            source.tensor("token_embd.weight", device)?.ok_or_else(|| bad("no tensor token_embd.weight".into()))?;
        // Embeddings are gathered by row: float tables keep their type (random f16 weights), GGUF
        // blocks become f32 rows.
        let embed = match &embed_w {
            Weight::Dense(t) => t.clone(),
            Weight::Quantized(q) => q.dequantize(device)?,
        };
        // Tied embeddings when the file has no separate output matrix.
        let output = match source.tensor("output.weight", device)? {
            Some(w) => Linear::new(w, device, weights)?,
            None => Linear::new(embed_w, device, weights)?,
        };
        let norm_of = |w: Weight| -> Result<RmsNorm> { Ok(RmsNorm::new(w.to_f32(device)?, eps)) };
        let norm = norm_of(
            source.tensor("output_norm.weight", device)?.ok_or_else(|| bad("no tensor output_norm.weight".into()))?,
        )?;
        if sliding.is_none() && matches!(arch.sliding, Sliding::AllButEveryNth { .. }) {
            return Err(bad(format!("missing metadata {}.attention.sliding_window", arch.name)));
        }
        let mut layers = Vec::with_capacity(n_layers);
        for i in 0..n_layers {
            let p = format!("blk.{i}");
            let mut opt = |n: &str| source.tensor(&format!("{p}.{n}"), device);
            let fused_qkv = opt("attn_qkv.weight")?;
            let gate = opt("ffn_gate.weight")?;
            let mut get = |n: &str| -> Result<Weight> {
                source
                    .tensor(&format!("{p}.{n}"), device)?
                    .ok_or_else(|| Error::Model { path: origin.clone(), reason: format!("no tensor {p}.{n}") })
            };
            let mut linear = |n: &str| -> Result<Linear> { Linear::new(get(&format!("{n}.weight"))?, device, weights) };
            // Separate matrices in veloq's CPU layout become one (one product each).
            let qkv = match fused_qkv {
                Some(w) => Qkv3::Fused(Linear::new(w, device, weights)?),
                None => {
                    let (q, k, v) = (linear("attn_q")?, linear("attn_k")?, linear("attn_v")?);
                    match Linear::stack(&[&q, &k, &v]) {
                        Some(qkv) => Qkv3::Fused(qkv),
                        None => Qkv3::Separate { q, k, v },
                    }
                }
            };
            let wo = linear("attn_output")?;
            let gate_up = match gate {
                Some(g) => {
                    let (gate, up) = (Linear::new(g, device, weights)?, linear("ffn_up")?);
                    // The fused form's halves are gate and up.
                    match (gate.rows() == up.rows()).then(|| Linear::stack(&[&gate, &up])).flatten() {
                        Some(both) => GateUp::Fused(both),
                        None => GateUp::Separate { gate, up },
                    }
                }
                None => GateUp::Fused(linear("ffn_up")?),
            };
            let down = linear("ffn_down")?;
            let mut norm = |n: &str| -> Result<RmsNorm> { norm_of(get(&format!("{n}.weight"))?) };
            let qk_norm = match arch.qk_norm {
                true => Some((norm("attn_q_norm")?, norm("attn_k_norm")?)),
                false => None,
            };
            let post_norms = match arch.norms {
                Norms::PreAndPost => Some((norm("post_attention_norm")?, norm("post_ffw_norm")?)),
                Norms::Pre => None,
            };
            let (attn_norm, ffn_norm) = (norm("attn_norm")?, norm("ffn_norm")?);
            let bias = match arch.qkv_bias {
                true => {
                    let mut b = |n: &str| -> Result<Tensor> { get(&format!("{n}.bias"))?.to_f32(device) };
                    Some((b("attn_q")?, b("attn_k")?, b("attn_v")?))
                }
                false => None,
            };
            let window = sliding.filter(|_| arch.slides(i, pattern));
            layers.push(Layer { attn_norm, qkv, wo, bias, ffn_norm, gate_up, down, qk_norm, post_norms, window });
        }
        // Llama 3.1's frequency factors (`rope_freqs`) divide the rotation frequencies.
        let factors = match source.tensor("rope_freqs.weight", device)? {
            Some(w) => Some(w.to_f32(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        if source.tensor("rope_factors_long.weight", device)?.is_some() {
            return Err(bad(
                "LongRoPE (rope_factors_long: Phi-3 128k) is not supported; the 4k-context files are".into()
            ));
        }
        let max_context = options.max_context;
        let (cos, sin) = rope_tables(head_dim, rope_base, rope_scale, factors.as_deref(), max_context, device)?;
        let local_rope = match (arch.local_rope_base, sliding) {
            (Some(base), Some(_)) => Some(rope_tables(head_dim, base, 1.0, None, max_context, device)?),
            _ => None,
        };
        let info = ModelInfo {
            identity: ModelIdentity { name, architecture: arch_name, n_layers, n_kv_heads: n_kv, head_dim },
            arch,
            n_heads,
            hidden,
            vocab: if vocab > 0 { vocab } else { embed.dim(0)? },
            rope_base,
            train_context,
            eos_tokens,
            bos,
            chat_template,
        };
        Ok(Self {
            embed_scale: if arch.embed_scale_sqrt_hidden { (hidden as f64).sqrt() } else { 1.0 },
            attn_scale: arch.query_scale(head_dim, hidden, n_heads, n_layers),
            info,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            local_rope,
            max_context,
            device: device.clone(),
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// What prompts are rendered with: the file's own chat template, else the family's written
    /// out (detected from the vocabulary's markers first).
    pub fn chat_template(&self, tok: &tokenizers::Tokenizer) -> Template {
        match &self.info.chat_template {
            Some(j) => Template::Jinja(j.clone()),
            None => Template::Builtin(self.info.arch.chat_template(tok)),
        }
    }

    /// Positions any forward pass may reach.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Bytes of the weight matrices a decode step reads (every layer's and the output head; the
    /// embedding table contributes one row per token, not counted).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let qkv = match &l.qkv {
                    Qkv3::Separate { q, k, v } => q.bytes() + k.bytes() + v.bytes(),
                    Qkv3::Fused(w) => w.bytes(),
                };
                let gate_up = match &l.gate_up {
                    GateUp::Separate { gate, up } => gate.bytes() + up.bytes(),
                    GateUp::Fused(w) => w.bytes(),
                };
                qkv + gate_up + l.wo.bytes() + l.down.bytes()
            })
            .sum();
        layers + self.output.bytes()
    }

    /// Layer `layer`'s attention output projection as f32 `[hidden, heads × head_dim]` (read
    /// through the layer's own product, so any weight format gives the matrix it applies): what
    /// an error in a head's values becomes in the residual stream, for codecs that weigh it.
    pub fn attention_output(&self, layer: usize) -> Result<Tensor> {
        let l = self.layers.get(layer).ok_or_else(|| Error::Config(format!("no layer {layer}")))?;
        let n = self.info.n_heads * self.info.identity.head_dim;
        let eye = Tensor::eye(n, DType::F32, self.embed.device())?;
        // Row i of eye·Wᵀ is W's column i.
        Ok(l.wo.forward(&eye)?.t()?.contiguous()?.to_dtype(DType::F32)?)
    }

    /// The window of a sliding-window layer, `None` for layers that see every position.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.layers.get(layer).and_then(|l| l.window)
    }

    /// The RoPE tables layer `layer` rotates its queries and keys by: cosines and sines,
    /// `[max context, head_dim / 2]` each (a sliding-window layer's local tables where they differ).
    pub fn rope_tables(&self, layer: usize) -> (&Tensor, &Tensor) {
        match (&self.local_rope, self.layer_window(layer)) {
            (Some((c, s)), Some(_)) => (c, s),
            _ => (&self.cos, &self.sin),
        }
    }

    /// Runs `tokens` for the sequence in slot 0, continuing where its caches end: logits of every
    /// token or of the last ([`Logits`]).
    pub fn forward(&self, tokens: &[u32], cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
        if tokens.is_empty() {
            return Err(Error::Config("forward needs at least one token".into()));
        }
        let step = Step::single(0, cache.len(0), tokens.len())?;
        self.forward_step(tokens, &step, cache, logits)
    }

    /// Runs one step: `tokens` packed in the step's order (each sequence's new tokens after the
    /// previous sequence's), every sequence at its own position, appending to `cache`'s slots.
    /// Returns logits `[tokens, vocab]` ([`Logits::All`]) or `[sequences, vocab]` for each
    /// sequence's last token ([`Logits::Last`]).
    pub fn forward_step(&self, tokens: &[u32], step: &Step, cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
        self.check_step(tokens, step, cache)?;
        if self.device.is_cpu() && rayon::current_thread_index().is_none() {
            // On a thread-pool thread, each product's parallel loop starts by work stealing from
            // a neighbour, not by waking the pool from outside and sleeping until it finishes
            // (two wake-ups per product, hundreds a step); and the other threads keep stealing
            // through the serial work between loops instead of falling asleep after a few idle
            // rounds and being woken by the next loop.
            let done = AtomicBool::new(false);
            return rayon::scope(|s| {
                let (me, done) = (rayon::current_thread_index(), &done);
                for _ in 1..rayon::current_num_threads() {
                    s.spawn(move |_| keep_stealing(done, me));
                }
                let out = self.run_step(tokens, step, cache, logits);
                done.store(true, Ordering::Release);
                out
            });
        }
        self.run_step(tokens, step, cache, logits)
    }

    fn run_step(&self, tokens: &[u32], step: &Step, cache: &mut ModelCache, logits: Logits) -> Result<Tensor> {
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

    /// Refuses a step that does not fit the model: caches of another depth, a token count that
    /// is not the step's, positions past the context, token ids outside the vocabulary.
    pub(crate) fn check_step(&self, tokens: &[u32], step: &Step, cache: &ModelCache) -> Result<()> {
        let n_caches = cache.layers().len();
        if n_caches != self.layers.len() {
            return Err(Error::Shape(format!("{n_caches} caches for {} layers", self.layers.len())));
        }
        let n = step.tokens();
        if tokens.len() != n {
            return Err(Error::Shape(format!("{} tokens for a step of {n}", tokens.len())));
        }
        if step.end() > self.max_context {
            return Err(Error::ContextOverflow { requested: step.end(), max: self.max_context });
        }
        let vocab = self.embed.dim(0)?;
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(Error::Token { id: bad, vocab });
        }
        Ok(())
    }

    /// The layers (a runner beside the model replays them).
    #[cfg(feature = "cuda")]
    pub(crate) fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// The residual stream `[tokens, hidden]` (f32) of token ids `[tokens]` on the model's device.
    pub(crate) fn embed_tokens(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.embed.index_select(ids, 0)?.to_dtype(DType::F32)?;
        Ok(if self.embed_scale != 1.0 { (x * self.embed_scale)? } else { x })
    }

    /// Each token's RoPE rows for `positions` `[tokens]` (u32): `[tokens, 1, head_dim / 2]`.
    pub(crate) fn rope_rows(&self, positions: &Tensor) -> Result<RopeRows> {
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
    pub(crate) fn qkv(&self, layer: &Layer, x: &Tensor, rope: &RopeRows, into: Option<&Tensor>) -> Result<Qkv> {
        let info = &self.info;
        let (nh, nkv, hd) = (info.n_heads, info.identity.n_kv_heads, info.identity.head_dim);
        let n = x.dim(0)?;
        let (cos, sin) = match (&rope.local, layer.window) {
            (Some((c, s)), Some(_)) => (c, s),
            _ => (&rope.cos, &rope.sin),
        };
        let neox = info.arch.rope == RopeStyle::NeoX;
        // Tokens as the batch of candle's RoPE ([tokens, heads, 1, head_dim]), each with its row.
        let rope = |x: Tensor, heads: usize| -> Result<Tensor> {
            let x = x.reshape((n, heads, 1, hd))?.contiguous()?;
            let y = if neox {
                candle_nn::rotary_emb::rope(&x, cos, sin)?
            } else {
                candle_nn::rotary_emb::rope_i(&x, cos, sin)?
            };
            Ok(y.reshape((n, heads, hd))?)
        };
        // The norm, the three products and (interleaved) RoPE in one launch where veloq's GEMV
        // takes the weights; nothing may sit between them (biases, q/k norms).
        if let (Qkv3::Separate { q: wq, k: wk, v: wv }, None, None) = (&layer.qkv, &layer.bias, &layer.qk_norm) {
            let rope_fused = !neox;
            let along = Along {
                norm: Some(&layer.attn_norm),
                rope: rope_fused.then_some((cos, sin)),
                into: into.filter(|_| rope_fused),
                ..Along::default()
            };
            if let Some(out) = Linear::fused(&[wq, wk, wv], x, Fused::Each, along)? {
                let p = &out.parts;
                let (q, k, v) = (p[0].reshape((n, nh, hd))?, p[1].reshape((n, nkv, hd))?, p[2].reshape((n, nkv, hd))?);
                return Ok(if neox {
                    Qkv { q: rope(q, nh)?, k: rope(k, nkv)?, v, packed: None }
                } else {
                    Qkv { q, k, v, packed: Some(out.flat) }
                });
            }
        }
        let ws = match &layer.qkv {
            Qkv3::Separate { q, k, v } => vec![q, k, v],
            Qkv3::Fused(w) => vec![w],
        };
        let products = match normed_f16(x, &layer.attn_norm, &ws)? {
            Some(p) => p.iter().map(|t| t.to_dtype(DType::F32)).collect::<candle_core::Result<Vec<_>>>()?,
            None => {
                let h = layer.attn_norm.forward(x)?;
                ws.iter().map(|w| w.forward(&h)).collect::<candle_core::Result<Vec<_>>>()?
            }
        };
        let (mut q, mut k, mut v) = match &products[..] {
            [q, k, v] => (q.clone(), k.clone(), v.clone()),
            [all] => {
                let (qn, kn) = (nh * hd, nkv * hd);
                (all.narrow(1, 0, qn)?, all.narrow(1, qn, kn)?, all.narrow(1, qn + kn, kn)?)
            }
            _ => unreachable!("one or three q/k/v products"),
        };
        if let Some((bq, bk, bv)) = &layer.bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        let (mut q, mut k) = (q.reshape((n, nh, hd))?, k.reshape((n, nkv, hd))?);
        if let Some((qn, kn)) = &layer.qk_norm {
            q = qn.forward(&q.contiguous()?)?;
            k = kn.forward(&k.contiguous()?)?;
        }
        Ok(Qkv { q: rope(q, nh)?, k: rope(k, nkv)?, v: v.reshape((n, nkv, hd))?.contiguous()?, packed: None })
    }

    /// The residual stream after a layer: attention output `y` `[tokens, heads, D]` projected and
    /// added, then the MLP's. Where veloq's GEMV takes the weights, three launches: the output
    /// projection adding into the stream, the MLP's norm with its gated pair, the down projection
    /// adding (Gemma's norms after attention and MLP sit between, so not there); they update `x`
    /// in place and return it.
    pub(crate) fn residual(&self, layer: &Layer, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let a = y.reshape((n, y.elem_count() / n.max(1)))?;
        let plain = layer.post_norms.is_none();
        let into = |w: &Linear, a: &Tensor, x: &Tensor| -> Result<Option<Tensor>> {
            let along = Along { residual: Some(x), in_place: true, ..Along::default() };
            Ok(if plain { Linear::fused(&[w], a, Fused::Each, along)?.map(|mut p| p.parts.remove(0)) } else { None })
        };
        let added = match into(&layer.wo, &a, x)? {
            None if plain => add_product_f16(x, &a, &layer.wo)?,
            done => done,
        };
        let x = match added {
            Some(x) => x,
            None => {
                let mut o = layer.wo.forward(&a)?;
                if let Some((post_attn, _)) = &layer.post_norms {
                    o = post_attn.forward(&o)?;
                }
                (x + o)?
            }
        };
        let act = self.info.arch.activation;
        // veloq's GEMV first (a decode step's few rows), then the f16 row path, then candle's.
        let gated = match gated_gemv(layer, &x, act)? {
            Some(g) => g,
            None => {
                if plain {
                    if let Some(x) = mlp_f16(layer, &x, act)? {
                        return Ok(x);
                    }
                }
                self.gated(layer, &x, act)?
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

    /// The MLP's gated activations `act(x·gateᵀ) ⊙ (x·upᵀ)` of the normed stream through
    /// candle's products.
    fn gated(&self, layer: &Layer, x: &Tensor, act: Activation) -> Result<Tensor> {
        let apply = |gate: Tensor| -> Result<Tensor> {
            Ok(match act {
                Activation::Silu => candle_nn::ops::silu(&gate)?,
                Activation::GeluTanh => gate.gelu()?,
            })
        };
        match &layer.gate_up {
            GateUp::Separate { gate, up } => {
                let h = layer.ffn_norm.forward(x)?;
                Ok((apply(gate.forward(&h)?)? * up.forward(&h)?)?)
            }
            GateUp::Fused(w) => {
                let h = layer.ffn_norm.forward(x)?;
                let both = w.forward(&h)?;
                let ffn = both.dim(D::Minus1)? / 2;
                Ok((apply(both.narrow(D::Minus1, 0, ffn)?)? * both.narrow(D::Minus1, ffn, ffn)?)?)
            }
        }
    }

    /// Logits (f32) of residual rows `x`.
    pub(crate) fn head(&self, x: &Tensor) -> Result<Tensor> {
        let along = Along { norm: Some(&self.norm), ..Along::default() };
        if let Some(mut p) = Linear::fused(&[&self.output], x, Fused::Each, along)? {
            return Ok(p.parts.remove(0));
        }
        let x = self.norm.forward(x)?;
        Ok(self.output.forward(&x)?.to_dtype(DType::F32)?)
    }
}

/// The MLP's gated activations in one launch where veloq's GEMV takes the two separate matrices
/// (a decode step's few rows); `None` elsewhere.
fn gated_gemv(layer: &Layer, x: &Tensor, act: Activation) -> candle_core::Result<Option<Tensor>> {
    let GateUp::Separate { gate, up } = &layer.gate_up else {
        return Ok(None);
    };
    let how = match act {
        Activation::Silu => Fused::GatedSilu,
        Activation::GeluTanh => Fused::GatedGeluTanh,
    };
    let along = Along { norm: Some(&layer.ffn_norm), ..Along::default() };
    Ok(Linear::fused(&[gate, up], x, how, along)?.map(|mut g| g.parts.remove(0)))
}

/// The f16 products `norm(x) · wᵀ` of every matrix of `ws` where the stream and every matrix
/// take the f16 row path on CUDA (`f16_rows`: no casts beside the products); `None` elsewhere.
fn normed_f16(x: &Tensor, norm: &RmsNorm, ws: &[&Linear]) -> candle_core::Result<Option<Vec<Tensor>>> {
    #[cfg(feature = "cuda")]
    if let (true, Some(ws)) = (super::f16_rows::applies(x), super::f16_rows::weights(ws)) {
        if let Some(h) = super::f16_rows::norm(x, norm)? {
            return ws.iter().map(|w| super::f16_rows::product(&h, w)).collect::<candle_core::Result<_>>().map(Some);
        }
    }
    let _ = (x, norm, ws);
    Ok(None)
}

/// `x += a · wᵀ` in place through an f16 product where `w` takes the f16 row path; `None`
/// (nothing done) elsewhere.
fn add_product_f16(x: &Tensor, a: &Tensor, w: &Linear) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let (true, Some(w)) = (super::f16_rows::applies(x), w.f16_cuda()) {
        let o = super::f16_rows::product(&a.to_dtype(DType::F16)?, w)?;
        return super::f16_rows::add_into(x, &o).map(Some);
    }
    let _ = (x, a, w);
    Ok(None)
}

/// The MLP added into `x` in place on the f16 row path (norm, gate and up products, the gated
/// activation and the down product all in f16); `None` (nothing done) where a matrix or the norm
/// does not take it.
fn mlp_f16(layer: &Layer, x: &Tensor, act: Activation) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(down) = layer.down.f16_cuda() {
        let ws = match &layer.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up],
            GateUp::Fused(w) => vec![w],
        };
        let Some(p) = normed_f16(x, &layer.ffn_norm, &ws)? else {
            return Ok(None);
        };
        let (gate, up) = match &p[..] {
            [g, u] => (g.clone(), u.clone()),
            [both] => {
                let ffn = both.dim(D::Minus1)? / 2;
                (both.narrow(D::Minus1, 0, ffn)?, both.narrow(D::Minus1, ffn, ffn)?)
            }
            _ => unreachable!("one or two gate/up products"),
        };
        let a = super::f16_rows::gated(&gate, &up, act)?;
        let d = super::f16_rows::product(&a, down)?;
        return super::f16_rows::add_into(x, &d).map(Some);
    }
    let _ = (layer, x, act);
    Ok(None)
}

/// How long a step's helper spins with nothing to steal before it leaves the thread to sleep.
const IDLE_SPIN: Duration = Duration::from_micros(500);

/// Runs the pool's pending jobs until `done`, spinning when there are none: a step's helper on
/// another thread of the pool. It returns at once on the step's own thread (`step`: it may pick
/// this job up while it waits inside a loop, and the step would never finish), and after
/// [`IDLE_SPIN`] with nothing to do (a helper picked up by a thread that is itself inside another
/// step's wait holds that step back for at most this long).
fn keep_stealing(done: &AtomicBool, step: Option<usize>) {
    if rayon::current_thread_index() == step {
        return;
    }
    let mut idle_since = None;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle_since = None,
            Some(rayon::Yield::Idle) => {
                if idle_since.get_or_insert_with(Instant::now).elapsed() > IDLE_SPIN {
                    return;
                }
                std::hint::spin_loop();
            }
            None => return,
        }
    }
}

/// A layer's queries, keys and values ([`Model::qkv`]).
pub(crate) struct Qkv {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    /// q, k and v one after another in one buffer, when one launch wrote them so (the buffer
    /// `Model::qkv` was given, or one the CUDA graphs copy into theirs at once).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) packed: Option<Tensor>,
}

/// Each token's RoPE rows in one step (global tables, and the local ones of sliding layers).
pub(crate) struct RopeRows {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    pub(crate) local: Option<(Tensor, Tensor)>,
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
/// scaling), each frequency divided by its factor when `factors` are given (Llama 3.1).
pub(crate) fn rope_tables(
    head_dim: usize,
    base: f32,
    scale: f32,
    factors: Option<&[f32]>,
    max_context: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| {
            let f = factors.and_then(|f| f.get(i)).copied().unwrap_or(1.0);
            1.0 / base.powf(2.0 * i as f32 / head_dim as f32) / scale / f
        })
        .collect();
    let inv = Tensor::new(inv.as_slice(), device)?.reshape((1, head_dim / 2))?;
    let t = Tensor::arange(0u32, max_context as u32, device)?.to_dtype(DType::F32)?.reshape((max_context, 1))?;
    let freqs = t.matmul(&inv)?;
    Ok((freqs.cos()?, freqs.sin()?))
}

/// A family's metadata keys (`<arch>.<key>`), read with errors that name the file and key.
struct Meta<'a> {
    md: &'a std::collections::HashMap<String, gguf_file::Value>,
    arch: &'a str,
    bad: &'a dyn Fn(String) -> Error,
}

impl Meta<'_> {
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.md.get(&format!("{}.{key}", self.arch)) {
            None => Ok(None),
            Some(v) => {
                v.to_u32().map(|v| Some(v as usize)).map_err(|e| (self.bad)(format!("{}.{key}: {e}", self.arch)))
            }
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| (self.bad)(format!("missing metadata {}.{key}", self.arch)))
    }

    fn opt_f32(&self, key: &str) -> Option<f32> {
        self.md.get(&format!("{}.{key}", self.arch)).and_then(|v| v.to_f32().ok())
    }
}

/// End-of-generation tokens (the file's EOS and the chat end markers of common templates), the
/// BOS a prompt starts with when the file asks for one, and the vocabulary size (0 if unknown).
/// The file's chat template with its BOS and EOS token text; a template minijinja cannot parse
/// is left out (the family's written-out template serves, as llama.cpp falls back to ChatML).
fn jinja_template(md: &std::collections::HashMap<String, gguf_file::Value>) -> Option<Arc<JinjaTemplate>> {
    let source = md.get("tokenizer.chat_template")?.to_string().ok()?;
    let tokens = md.get("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok());
    let text = |key: &str| -> String {
        let id = md.get(key).and_then(|v| v.to_u32().ok());
        let t = id.and_then(|id| tokens.and_then(|t| t.get(id as usize)).and_then(|v| v.to_string().ok()).cloned());
        t.unwrap_or_default()
    };
    JinjaTemplate::new(source.clone(), text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id"))
        .ok()
        .map(Arc::new)
}

fn vocabulary(md: &std::collections::HashMap<String, gguf_file::Value>) -> (Vec<u32>, Option<u32>, usize) {
    let mut eos = Vec::new();
    if let Some(v) = md.get("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()) {
        eos.push(v);
    }
    let spm = md.get("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).is_some_and(|m| m == "llama");
    let add_bos = md.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(spm);
    let bos = md.get("tokenizer.ggml.bos_token_id").and_then(|v| v.to_u32().ok()).filter(|_| add_bos);
    let tokens = md.get("tokenizer.ggml.tokens").and_then(|v| v.to_vec().ok());
    if let Some(tokens) = tokens {
        for (i, t) in tokens.iter().enumerate() {
            if let Ok(s) = t.to_string() {
                let end =
                    matches!(s.as_str(), "<|im_end|>" | "<|eot_id|>" | "<|endoftext|>" | "<end_of_turn>" | "<|end|>");
                if end && !eos.contains(&(i as u32)) {
                    eos.push(i as u32);
                }
            }
        }
    }
    (eos, bos, tokens.map_or(0, |t| t.len()))
}

impl Model {
    /// Loads a GGUF model and its tokenizer on the CPU.
    pub fn open(path: &Path, max_context: usize) -> Result<(Self, tokenizers::Tokenizer)> {
        Self::open_with(path, &LoadOptions::new(max_context), &Device::Cpu)
    }

    /// Loads a GGUF model (weights on `device`) and its tokenizer.
    pub fn open_with(path: &Path, options: &LoadOptions, device: &Device) -> Result<(Self, tokenizers::Tokenizer)> {
        let mut file = GgufFile::open(path)?;
        let tok = super::load_tokenizer(file.content())?;
        let model = Self::load(&mut file, options, device)?;
        Ok((model, tok))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::SeqStep;
    use crate::config::CacheConfig;
    use veloq::kernels::KernelChoice;

    /// The output projection read back is the matrix the layer applies, in its orientation:
    /// `W x` from it equals the layer's own product on random rows.
    #[test]
    fn attention_output_is_the_matrix_the_layer_applies() {
        let m = crate::testing::tiny_model(50, 32);
        let w = m.attention_output(1).unwrap();
        assert_eq!(w.dims(), &[64, 64]);
        let mut s = crate::testing::fresh_seed() | 1;
        let x: Vec<f32> = (0..3 * 64)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        let x = Tensor::from_vec(x, (3, 64), &Device::Cpu).unwrap();
        let want = m.layers[1].wo.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        let got = x.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
        // Both sides are f32 dot products of the same 64 terms (|w| ~ 0.02, |x| ≤ 0.5) summed in
        // different orders (whatever SIMD width the CPU's GEMM picks): they differ by at most
        // about 64 · 2⁻²⁴ · Σ|wx| ≈ 1e-6, well inside 1e-5 on any x86-64 CPU.
        for (a, b) in want.iter().flatten().zip(got.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
        }
        assert!(m.attention_output(2).is_err(), "the tiny model has two layers");
    }

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
                    let want = m.forward(t, &mut alone[*slot], Logits::Last).unwrap();
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
            assert!(matches!(e, Error::Position { slot: 0, expected: 5, got: 3 }), "{e}");
            let e = m.forward_step(&[50], &Step::single(0, 5, 1).unwrap(), &mut batch, Logits::Last).unwrap_err();
            assert!(matches!(e, Error::Token { id: 50, vocab: 50 }), "{e}");
        }
    }

    /// The bytes floor of `bench runner` counts every weight matrix once: 7 per layer and the
    /// output head (f32 on the CPU: 4 bytes a weight; norms and the embedding table are not read
    /// whole).
    #[test]
    fn weight_bytes_count_every_matrix() {
        let m = crate::testing::tiny_model(50, 32);
        let (hidden, q, kv, ffn, layers, vocab) = (64, 4 * 16, 2 * 16, 96, 2, 50);
        let per_layer = 2 * hidden * q + 2 * hidden * kv + 3 * hidden * ffn;
        assert_eq!(m.weight_bytes(), 4 * (layers * per_layer + vocab * hidden));
    }
}
