//! Prompts token for token as llama.cpp's `llama-server --jinja` builds them:
//! `scripts/fixtures/chat_templates.py` wrote tiny random GGUFs carrying Llama 3.1's and Mistral
//! Nemo's own templates over byte-level BPE vocabularies with their control tokens (llama.cpp's
//! `llama-bpe` and `tekken` splits), and, for a few conversations (a system turn, several turns,
//! digits and non-ASCII text, tools offered, a tool call and its result), the token ids
//! llama-server fed; the real SmolLM2 file too (its template takes no tools).

use serde_json::Value;
use veloq_candle::generate::transcript_ids;
use veloq_candle::model::{Model, Template, Transcript};

mod support;

use support::{cache_dir, fixture};

/// Every conversation of `<name>.chat.json` rendered and tokenized by veloq over `gguf`, against
/// llama-server's ids.
fn matches_llama_server(name: &str, gguf: &std::path::Path) {
    let (model, tok) = Model::open(gguf, 64).unwrap();
    let cases: Vec<Value> = serde_json::from_slice(&std::fs::read(fixture::path(name, "chat.json")).unwrap()).unwrap();
    assert!(!cases.is_empty());
    for case in &cases {
        let request = &case["request"];
        let array = |k: &str| request.get(k).and_then(Value::as_array).cloned().unwrap_or_default();
        let kwargs = request["chat_template_kwargs"].as_object().cloned().unwrap_or_default();
        let transcript = Transcript { messages: array("messages"), tools: array("tools"), kwargs };
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = transcript_ids(&model, &tok, &transcript).unwrap();
        let Template::Jinja(template) = model.chat_template(&tok) else { panic!("{name} carries its template") };
        assert_eq!(
            got,
            want,
            "{name}, {}: veloq renders\n{:?}\nllama-server rendered\n{:?}",
            case["name"],
            template.render_transcript(&transcript),
            case["prompt"]
        );
    }
}

#[test]
fn llama3_prompts_match_llama_server() {
    matches_llama_server("llama3-chat-tiny", &fixture::path("llama3-chat-tiny", "gguf"));
}

#[test]
fn mistral_prompts_match_llama_server() {
    matches_llama_server("mistral-chat-tiny", &fixture::path("mistral-chat-tiny", "gguf"));
}

#[test]
fn smollm2_prompts_match_llama_server() {
    let gguf = cache_dir().join("smollm2-135m-instruct.q4_1.gguf");
    assert!(gguf.exists(), "{} is missing: run scripts/fetch-data", gguf.display());
    matches_llama_server("smollm2", &gguf);
}
