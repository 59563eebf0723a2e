//! Helpers for the lab's unit tests.

use crate::synthetic::Geometry;

/// A seed that differs between runs (tests print it on failure).
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// A random two-layer model (4 query heads over 2 kv heads of 16) on the CPU.
pub fn tiny_model(vocab: usize, max_context: usize) -> veloq_candle::model::Model {
    let g = Geometry { layers: 2, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 96, vocab, rope_base: 10_000 };
    g.model("tiny", max_context, &candle_core::Device::Cpu, fresh_seed()).expect("tiny model")
}
