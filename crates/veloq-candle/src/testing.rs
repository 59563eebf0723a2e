//! Helpers for the unit tests.

/// A seed that differs between runs (tests print it on failure).
pub fn fresh_seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// A random two-layer model (4 query heads over 2 kv heads of 16) on the CPU, for tests of
/// whatever runs a model: `vocab` tokens, `max_context` positions.
pub fn tiny_model(vocab: usize, max_context: usize) -> crate::model::Model {
    tiny_model_seeded(vocab, max_context, fresh_seed())
}

/// [`tiny_model`] with given weights: the same `seed` builds the same model.
pub fn tiny_model_seeded(vocab: usize, max_context: usize, seed: u64) -> crate::model::Model {
    let g = crate::model::Geometry {
        layers: 2,
        hidden: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 96,
        vocab,
        rope_base: 10_000,
    };
    crate::model::Model::synthetic("tiny", g, max_context, &candle_core::Device::Cpu, seed).expect("tiny model")
}

/// A tokenizer of `vocab` words for the tiny model (see [`crate::model::word_tokenizer`]).
pub fn word_tokenizer(vocab: usize) -> tokenizers::Tokenizer {
    crate::model::word_tokenizer(vocab)
}
