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

/// `Chat` renders every turn in the file's own template (Llama 3.1's system header and all) and
/// feeds only what the caches do not hold: the second turn's prompt is the whole conversation as
/// the template renders it, of which the caches already held at least the first turn (the random
/// model's reply, bytes that are not UTF-8, does not come back as the same tokens; SmolLM2's
/// does, `smollm2.rs`).
#[test]
fn chat_turns_follow_the_files_template_and_feed_only_the_new_turn() {
    use veloq_candle::chat::Chat;
    use veloq_candle::config::CacheConfig;
    use veloq_candle::generate::{chat_ids, GenerateOptions};
    use veloq_candle::model::Role;
    use veloq_candle::sampling::SamplingOptions;

    let (model, tok) = Model::open(&fixture::path("llama3-chat-tiny", "gguf"), 1024).unwrap();
    let opts = GenerateOptions { max_tokens: 6, sampling: SamplingOptions::greedy(), ..GenerateOptions::default() };
    let mut chat = Chat::new(&model, &tok, CacheConfig::fp16().build(&model).unwrap());
    let first = chat.say("Name a river.", &opts, &mut |_| {}).unwrap();
    let reply = first.text.clone();
    let second = chat.say("And a lake?", &opts, &mut |_| {}).unwrap();
    let whole = chat_ids(
        &model,
        &tok,
        &[(Role::User, "Name a river."), (Role::Assistant, &reply), (Role::User, "And a lake?")],
    )
    .unwrap();
    assert_eq!(&chat.history()[..whole.len()], &whole[..], "the second turn's prompt is the file's rendering");
    assert!(tok.decode(&whole, false).unwrap().contains("Cutting Knowledge Date"), "Llama 3.1's own system header");
    assert!(
        second.prompt_tokens <= whole.len() - first.prompt_tokens,
        "fed {} of {} (the first turn held {})",
        second.prompt_tokens,
        whole.len(),
        first.prompt_tokens
    );
    assert_eq!(chat.caches().len(0), whole.len() + second.tokens.len() - 1);
    assert_eq!(chat.messages().len(), 4);
}
