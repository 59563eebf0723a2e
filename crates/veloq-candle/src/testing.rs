//! Helpers for the unit tests.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use candle_core::{Device, Tensor};

use crate::model::source::{MemorySource, Weight};
use crate::model::{LoadOptions, Model};

/// A seed that differs between runs (tests print it on failure).
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// A random two-layer Llama-family model (4 query heads over 2 kv heads of 16) on the CPU, for
/// tests of whatever runs a model: `vocab` tokens, `max_context` positions.
pub fn tiny_model(vocab: usize, max_context: usize) -> Model {
    tiny_model_seeded(vocab, max_context, fresh_seed())
}

/// [`tiny_model`] with given weights: the same `seed` builds the same model.
pub fn tiny_model_seeded(vocab: usize, max_context: usize, seed: u64) -> Model {
    let (layers, hidden, heads, kv, hd, ffn) = (2usize, 64usize, 4usize, 2usize, 16usize, 96usize);
    let mut state = seed | 1;
    let mut normal = |n: usize, std: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let mut u = || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
                };
                let (a, b) = (u(), u());
                ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32 * std
            })
            .collect()
    };
    let mut tensors = HashMap::new();
    let mut put = |name: String, dims: &[usize], values: Vec<f32>| {
        tensors.insert(name, Weight::Dense(Tensor::from_vec(values, dims, &Device::Cpu).expect("a weight")));
    };
    put("token_embd.weight".into(), &[vocab, hidden], normal(vocab * hidden, 1.0));
    put("output.weight".into(), &[vocab, hidden], normal(vocab * hidden, 0.02));
    put("output_norm.weight".into(), &[hidden], vec![1.0; hidden]);
    for i in 0..layers {
        for (n, rows, cols) in [
            ("attn_q", heads * hd, hidden),
            ("attn_k", kv * hd, hidden),
            ("attn_v", kv * hd, hidden),
            ("attn_output", hidden, heads * hd),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ] {
            put(format!("blk.{i}.{n}.weight"), &[rows, cols], normal(rows * cols, 0.02));
        }
        put(format!("blk.{i}.attn_norm.weight"), &[hidden], vec![1.0; hidden]);
        put(format!("blk.{i}.ffn_norm.weight"), &[hidden], vec![1.0; hidden]);
    }
    let metadata: HashMap<String, Value> = [
        ("general.architecture", Value::String("llama".into())),
        ("llama.block_count", Value::U32(layers as u32)),
        ("llama.embedding_length", Value::U32(hidden as u32)),
        ("llama.attention.head_count", Value::U32(heads as u32)),
        ("llama.attention.head_count_kv", Value::U32(kv as u32)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut source = MemorySource { label: "tiny".into(), metadata, tensors };
    Model::load(&mut source, &LoadOptions::new(max_context), &Device::Cpu).expect("tiny model")
}

/// A tokenizer of `vocab` words for the tiny model (see [`crate::model::word_tokenizer`]).
pub fn word_tokenizer(vocab: usize) -> tokenizers::Tokenizer {
    crate::model::word_tokenizer(vocab)
}
