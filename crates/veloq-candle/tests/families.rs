//! Qwen3 and Phi-3 against independent references: `scripts/fixtures/{qwen3,phi3}_tiny.py` wrote a
//! tiny random GGUF of each family and the logits of its NumPy transcription of Hugging Face's
//! forward pass. Each family is a descriptor (`model::arch`); these check that the descriptor and
//! the file's metadata give the decoder the family's geometry, windows and chat template, and the
//! reference's logits at every position, prefilled at once and decoded token by token.

use veloq_candle::config::fp16_bytes;
use veloq_candle::model::{ChatTemplate, Model};

mod support;

use support::fixture;

/// q/k norms, NeoX RoPE, head_dim 32 from the file's key length (q is 128 wide over a 64-wide
/// residual stream), tied output; every layer sees every position.
#[test]
fn qwen3_logits_match_the_reference_forward_pass() {
    let (model, tokens, _) = fixture::load("qwen3-tiny");
    let id = &model.info.identity;
    assert_eq!((id.architecture.as_str(), id.n_layers, id.n_kv_heads, id.head_dim), ("qwen3", 2, 2, 32));
    assert_eq!(model.info.n_heads, 4);
    assert_eq!((0..2).map(|i| model.layer_window(i)).collect::<Vec<_>>(), vec![None, None]);
    let (worst, caches) = fixture::check_logits("qwen3-tiny", 1e-3);
    assert!(worst > 0.0, "f16 keys and values cannot give the f64 reference exactly");
    assert!(caches.layers().iter().all(|c| c.len(0) == tokens.len()));
    assert_eq!(fp16_bytes(&model, tokens.len()), 2 * tokens.len() * 2 * 32 * 2 * 2);
}

/// Fused q/k/v and gate/up matrices, NeoX RoPE, a 7-position window on every layer, a separate
/// output matrix.
#[test]
fn phi3_logits_match_the_reference_forward_pass() {
    let (model, tokens, _) = fixture::load("phi3-tiny");
    let id = &model.info.identity;
    assert_eq!((id.architecture.as_str(), id.n_layers, id.n_kv_heads, id.head_dim), ("phi3", 2, 2, 32));
    assert_eq!((0..2).map(|i| model.layer_window(i)).collect::<Vec<_>>(), vec![Some(7), Some(7)]);
    let (_, caches) = fixture::check_logits("phi3-tiny", 1e-3);
    // A sliding layer keeps its window, not the 20 positions seen.
    for c in caches.layers() {
        assert_eq!(c.len(0), tokens.len());
        assert!(c.resident_bytes() <= 7 * 2 * 32 * 2 * 2, "a sliding layer holds {} bytes", c.resident_bytes());
    }
    assert_eq!(fp16_bytes(&model, tokens.len()), 2 * 7 * 2 * 32 * 2 * 2);
}

/// The fixtures' byte vocabularies carry no chat markers, so each family's own template applies.
#[test]
fn families_fall_back_to_their_own_chat_templates() {
    for (name, want) in [("qwen3-tiny", ChatTemplate::ChatMl), ("phi3-tiny", ChatTemplate::Phi3)] {
        let (model, tok) = Model::open(&fixture::path(name, "gguf"), 64).unwrap();
        assert_eq!(model.info.arch.chat_template(&tok), want, "{name}");
    }
}
