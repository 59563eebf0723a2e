//! The physical estimate of a serving load (issue 31's anchor): the seconds a server could not beat
//! on this device — every prompt's FLOPs at the device's measured matrix-multiply rate, plus the
//! decode steps at the bytes floor (each step reads the weights once, each generated token reads its
//! sequence's cache once) with as many sequences per step as the KV budget admits. A measured
//! throughput divided by it says how far a server is from the hardware, whatever its baseline.
//!
//! Bounds, not simulations: prefill and decode are added, not overlapped (a real step can carry
//! both, so the estimate may be beaten slightly by that overlap), attention is counted causal over
//! every layer (sliding-window layers do less), and the budget's sequences are assumed always full.

use std::time::Instant;

use anyhow::Result;
use candle_core::quantized::gguf_file::Content;
use candle_core::{DType, Device, Tensor};

use veloq_candle::model::Weights;

/// What the device sustains, measured on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rates {
    /// Dense matrix-multiply FLOP/s (f16 on a GPU, f32 on the CPU: the dtype each device's
    /// prompt products run in).
    pub matmul_flops: f64,
    /// Device-memory bytes/s: the better of a matrix–vector product's weight reads and a large
    /// copy's reads and writes (a copy that allocates its output each time can undersell it).
    pub memory_bytes: f64,
}

impl Rates {
    /// Times a `[rows, inner] · [cols, inner]ᵀ` product (a weight stored output-major, read
    /// transposed, as the model multiplies its weights), and a `[n, 4096]` matrix of `bytes` bytes
    /// times a vector and copied, on `device` (the best of several runs after a warm-up, the device
    /// synchronised around each).
    pub fn measure(device: &Device, (rows, inner, cols): (usize, usize, usize), bytes: usize) -> Result<Self> {
        let dtype = if device.is_cpu() { DType::F32 } else { DType::F16 };
        let randn = |shape: (usize, usize)| Tensor::randn(0f32, 1.0, shape, device)?.to_dtype(dtype);
        let (a, b) = (randn((rows, inner))?, randn((cols, inner))?);
        let matmul = best_seconds(device, || a.matmul(&b.t()?).map(drop))?;
        drop((a, b));
        let width = 4096;
        let big = randn((bytes / dtype.size_in_bytes() / width, width))?;
        let x = randn((width, 1))?;
        let gemv = best_seconds(device, || big.matmul(&x).map(drop))?;
        let copy = best_seconds(device, || big.copy().map(drop))?;
        let size = (big.elem_count() * dtype.size_in_bytes()) as f64;
        Ok(Self {
            matmul_flops: 2.0 * (rows * inner * cols) as f64 / matmul,
            memory_bytes: (size / gemv).max(2.0 * size / copy),
        })
    }
}

/// The fastest of up to 20 runs of `f` (after two warm-ups), stopping once 0.5 s have been spent.
pub(crate) fn best_seconds(device: &Device, mut f: impl FnMut() -> candle_core::Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    device.synchronize()?;
    let (mut best, spent) = (f64::INFINITY, Instant::now());
    for _ in 0..20 {
        let t = Instant::now();
        f()?;
        device.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
        if spent.elapsed().as_secs_f64() > 0.5 {
            break;
        }
    }
    Ok(best)
}

/// A model's work per token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Matrix elements of the decoder blocks (multiply-adds per token).
    pub block_params: f64,
    /// The output head's (vocabulary × width): once per decode token, once per prompt.
    pub head_params: f64,
    /// Bytes of those matrices as the GGUF stores them.
    pub stored_bytes: f64,
    /// Layers × query heads × head dim: multiply-adds per query and cached position, in QKᵀ and
    /// again in PV.
    pub attention_width: f64,
}

impl Cost {
    /// From a GGUF's tensors: the blocks' two-dimensional matrices, and the output head (the token
    /// embeddings when the head is tied to them).
    pub fn of_gguf(content: &Content, layers: usize, heads: usize, head_dim: usize) -> Self {
        let (mut block, mut block_bytes) = (0f64, 0f64);
        let size = |t: &candle_core::quantized::gguf_file::TensorInfo| {
            let n = t.shape.elem_count();
            (n as f64, (n / t.ggml_dtype.block_size() * t.ggml_dtype.type_size()) as f64)
        };
        for (name, t) in &content.tensor_infos {
            if name.starts_with("blk.") && t.shape.rank() == 2 {
                let (n, b) = size(t);
                block += n;
                block_bytes += b;
            }
        }
        let head = content.tensor_infos.get("output.weight").or_else(|| content.tensor_infos.get("token_embd.weight"));
        let (head, head_bytes) = head.map_or((0.0, 0.0), size);
        Self {
            block_params: block,
            head_params: head,
            stored_bytes: block_bytes + head_bytes,
            attention_width: (layers * heads * head_dim) as f64,
        }
    }

    /// From a Llama-family geometry with f16 matrices (the synthetic models).
    pub fn of_geometry(g: &veloq_lab::synthetic::Geometry) -> Self {
        let (h, q, kv) = (g.hidden, g.heads * g.head_dim, g.kv_heads * g.head_dim);
        let block = (g.layers * (2 * h * q + 2 * h * kv + 3 * h * g.ffn)) as f64;
        let head = (g.vocab * h) as f64;
        Self {
            block_params: block,
            head_params: head,
            stored_bytes: 2.0 * (block + head),
            attention_width: (g.layers * g.heads * g.head_dim) as f64,
        }
    }

    /// Bytes a decode step reads from the weights when they are multiplied as `weights`.
    pub fn weight_bytes(&self, weights: Weights) -> f64 {
        let params = self.block_params + self.head_params;
        match weights {
            Weights::Stored => self.stored_bytes,
            Weights::F16 => 2.0 * params,
            Weights::F32 => 4.0 * params,
        }
    }
}

/// One level of a load as the estimate sees it.
#[derive(Clone, Debug)]
pub struct Load<'a> {
    /// Every request's prompt length.
    pub prompts: &'a [usize],
    /// Tokens each request generates.
    pub max_tokens: usize,
    /// Sequences a step can carry: the budget's, at most the clients.
    pub slots: usize,
    /// Cache bytes a generated token reads per earlier position.
    pub kv_bytes_per_position: f64,
    /// Weight bytes a decode step reads.
    pub weight_bytes: f64,
}

impl Load<'_> {
    /// Sequences the budget holds at once when each takes the load's mean context (prompt and
    /// generated tokens) at `bytes_per_position` — memory paged exactly, the best any admission can
    /// do — at most `clients`, at least one.
    pub fn slots(
        budget: usize,
        bytes_per_position: f64,
        prompts: &[usize],
        max_tokens: usize,
        clients: usize,
    ) -> usize {
        let mean = prompts.iter().sum::<usize>() as f64 / prompts.len().max(1) as f64 + max_tokens as f64;
        ((budget as f64 / (mean * bytes_per_position)) as usize).clamp(1, clients.max(1))
    }
}

/// The estimate's parts, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub prefill_s: f64,
    pub decode_s: f64,
}

impl Estimate {
    pub fn seconds(&self) -> f64 {
        self.prefill_s + self.decode_s
    }
}

/// Prompt FLOPs at the matmul rate; decode steps (generated tokens over the slots) at the bytes
/// floor, or at the matmul rate where their FLOPs take longer.
pub fn estimate(cost: &Cost, rates: &Rates, load: &Load) -> Estimate {
    let m = load.max_tokens as f64;
    let mut prefill_flops = 0.0;
    let (mut kv_positions, mut decode_flops) = (0.0, 0.0);
    for &p in load.prompts {
        let p = p as f64;
        // Causal attention: position i attends i + 1 positions, QKᵀ and PV 2 FLOPs each.
        prefill_flops +=
            2.0 * cost.block_params * p + 2.0 * cost.head_params + 2.0 * cost.attention_width * p * (p + 1.0);
        // Token j of m reads the p + j positions before it.
        let read = m * p + m * (m - 1.0) / 2.0;
        kv_positions += read;
        decode_flops += 2.0 * (cost.block_params + cost.head_params) * m + 4.0 * cost.attention_width * read;
    }
    let generated = m * load.prompts.len() as f64;
    let steps = (generated / load.slots.max(1) as f64).ceil();
    let bytes = steps * load.weight_bytes + kv_positions * load.kv_bytes_per_position;
    Estimate {
        prefill_s: prefill_flops / rates.matmul_flops,
        decode_s: (bytes / rates.memory_bytes).max(decode_flops / rates.matmul_flops),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A load small enough to add up by hand: two prompts of 3 and 1 tokens, 2 tokens each.
    #[test]
    fn estimate_adds_up_by_hand() {
        let cost = Cost { block_params: 10.0, head_params: 5.0, stored_bytes: 100.0, attention_width: 2.0 };
        let rates = Rates { matmul_flops: 1000.0, memory_bytes: 50.0 };
        let load = Load { prompts: &[3, 1], max_tokens: 2, slots: 2, kv_bytes_per_position: 4.0, weight_bytes: 100.0 };
        let e = estimate(&cost, &rates, &load);
        // Prefill: 3 tokens: 2·10·3 + 2·5 + 2·2·3·4 = 60 + 10 + 48 = 118; 1 token: 20 + 10 + 2·2·1·2 = 38.
        assert!((e.prefill_s - 156.0 / 1000.0).abs() < 1e-12, "{e:?}");
        // Decode: 4 tokens over 2 slots = 2 steps of 100 bytes; cache reads (3 + 4) + (1 + 2) = 10
        // positions of 4 bytes: 240 bytes at 50 B/s. FLOPs 2·15·2·2 + 4·2·10 = 200 at 1000/s, less.
        assert!((e.decode_s - 240.0 / 50.0).abs() < 1e-12, "{e:?}");
        // More slots, fewer steps: one step of weights.
        let wide = estimate(&cost, &rates, &Load { slots: 4, ..load.clone() });
        assert!((wide.decode_s - 140.0 / 50.0).abs() < 1e-12, "{wide:?}");
        // A slow matmul makes the decode FLOP-bound.
        let slow = estimate(&cost, &Rates { matmul_flops: 10.0, ..rates }, &load);
        assert!((slow.decode_s - 200.0 / 10.0).abs() < 1e-12, "{slow:?}");
    }

    /// The budget's sequences at the mean context, bounded by the clients.
    #[test]
    fn slots_fill_the_budget_at_the_mean_context() {
        // Mean context (100 + 300) / 2 + 50 = 250 positions of 4 bytes: 1,000 bytes a sequence.
        assert_eq!(Load::slots(10_500, 4.0, &[100, 300], 50, 64), 10);
        assert_eq!(Load::slots(10_500, 4.0, &[100, 300], 50, 3), 3);
        assert_eq!(Load::slots(500, 4.0, &[100, 300], 50, 3), 1);
    }

    /// The geometry's matrices are its parameters less the embeddings and norms.
    #[test]
    fn geometry_cost_counts_the_matrices() {
        let g = veloq_lab::synthetic::Geometry::LLAMA_3_1_8B;
        let c = Cost::of_geometry(&g);
        let norms = g.layers * 2 * g.hidden + g.hidden;
        assert_eq!(c.block_params + c.head_params, (g.parameters() - g.vocab * g.hidden - norms) as f64);
        assert_eq!(c.weight_bytes(Weights::Stored), c.weight_bytes(Weights::F16));
        assert_eq!(c.weight_bytes(Weights::F32), 2.0 * c.stored_bytes);
    }

    /// On the CPU the measured product and copy come out as finite positive rates.
    #[test]
    fn rates_measure_on_the_cpu() {
        let r = Rates::measure(&Device::Cpu, (32, 64, 48), 1 << 20).unwrap();
        assert!(r.matmul_flops.is_finite() && r.matmul_flops > 0.0, "{r:?}");
        assert!(r.memory_bytes.is_finite() && r.memory_bytes > 0.0, "{r:?}");
    }
}
