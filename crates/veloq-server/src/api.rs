//! The OpenAI wire format: request bodies as clients send them, checked field by field into what
//! the engine runs, and the responses, stream chunks and errors they expect back.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use veloq_candle::model::Tokenizer;
use veloq_candle::sampling::{SamplingOptions, TokenLogprob};

use veloq_candle::engine::{Request, Summary};
use veloq_candle::generate::Finish;
use veloq_candle::grammar::Grammar;

use crate::tools::{calls_text, response_text, Call, Tool, ToolChoice, ToolFormat, Tools};
use veloq_candle::model::{Role, Template, Transcript};

/// An error as OpenAI's API returns it: a status and `{"error": {message, type, param, code}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (`Retry-After`).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400: the request cannot run as sent.
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
            retry_after: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    pub fn status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// `stop`: one string or several.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Clone, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields both endpoints share (fields no endpoint reads are refused by
/// [`check_fields`]).
#[derive(Deserialize, Debug, Clone, Default)]
pub struct Sampling {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM's and llama.cpp's extension; 0 or -1 turn it off, as there.
    pub top_k: Option<i64>,
    /// vLLM's and llama.cpp's extension; 0 turns it off.
    pub min_p: Option<f64>,
    /// vLLM's extension (llama.cpp's `repeat_penalty`); 1 turns it off.
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string, as OpenAI writes it) → bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logprobs: Option<Value>,
    /// An extension llama.cpp's server and vLLM share: generate through end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
}

/// A message's content: a string, or parts of which only text is understood.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug, Clone)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant turn's calls (a tool loop resends them).
    pub tool_calls: Option<Vec<MessageCall>>,
    /// A `tool` message's call (shown to templates that take tools; Hermes' format has none).
    pub tool_call_id: Option<String>,
    /// The speaker's or the function's name (shown to templates that take tools).
    pub name: Option<String>,
}

/// An entry of an assistant message's `tool_calls`.
#[derive(Deserialize, Debug, Clone)]
pub struct MessageCall {
    pub id: Option<String>,
    pub function: Call,
}

/// What only chat completions take (the shared fields are read into [`Sampling`] from the same
/// body, so an error names its field).
#[derive(Deserialize, Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub max_completion_tokens: Option<u64>,
    pub top_logprobs: Option<u64>,
    pub response_format: Option<ResponseFormat>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// `false`: at most the first call of a reply is returned.
    pub parallel_tool_calls: Option<bool>,
    /// Variables for the model's chat template (an extension llama.cpp's server and vLLM share).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// OpenAI's `response_format`: free text, any JSON object, or JSON under a schema (always
/// enforced by the token mask, so `strict` changes nothing).
#[derive(Deserialize, Debug, Clone)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `description` and `strict` are type-checked and change nothing: the token mask enforces every
/// schema, strict or not.
#[derive(Deserialize, Debug, Clone)]
#[allow(dead_code)]
pub struct JsonSchemaFormat {
    pub name: String,
    pub description: Option<String>,
    /// Without one, any JSON object.
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

/// `prompt`: a string, one string in a list, token ids, or one list of token ids in a list (as
/// lm-evaluation-harness sends a batch of one).
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// What only text completions take.
#[derive(Deserialize, Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
}

/// A request body as `T`: malformed JSON and wrong types are 400s that name the field.
pub fn from_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let (path, inner) = (e.path().to_string(), e.into_inner());
        let what = if inner.is_data() { "invalid request" } else { "malformed JSON" };
        match path.as_str() {
            "." | "" => ApiError::invalid(None, format!("{what}: {inner}")),
            field => ApiError::invalid(None, format!("{what}: {field}: {inner}")),
        }
    })
}

/// The fields both endpoints read; `user` is OpenAI's end-user identifier, which changes no output.
const SHARED_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "ignore_eos",
    "user",
];
/// What chat completions read besides; the tool and format fields only in their "not used" form.
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
];
/// What text completions read besides.
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "echo", "suffix", "best_of"];

/// Refuses, naming it, every field of the body that the endpoint does not read: an unknown field
/// (a typo, or an OpenAI feature veloq does not have). A field is never silently ignored.
pub fn check_fields(body: &[u8], endpoint: &[&'static str]) -> Result<(), ApiError> {
    let Ok(Value::Object(fields)) = serde_json::from_slice::<Value>(body) else {
        return Ok(()); // the typed parse reports what is wrong with it
    };
    match fields.keys().find(|name| !SHARED_FIELDS.iter().chain(endpoint).any(|f| f == name)) {
        Some(name) => Err(ApiError::invalid(
            None,
            format!("unrecognized request argument {name:?}: veloq serve does not read it"),
        )),
        None => Ok(()),
    }
}

/// OpenAI's own bound on stop strings.
const MAX_STOPS: usize = 4;

/// OpenAI's bound on `n`, the choices of one request.
const MAX_CHOICES: u64 = 128;

/// OpenAI's bound on text completions' `logprobs`.
const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// OpenAI's bound on `top_logprobs`.
const MAX_TOP_LOGPROBS: u64 = 20;

impl ChatRequest {
    /// The tools the request offers, unless it offers none or says `tool_choice: "none"`.
    pub fn tools(&self, format: ToolFormat) -> Result<Option<Tools>, ApiError> {
        Tools::of(self.tools.as_deref(), self.tool_choice.as_ref(), format)
    }

    /// The conversation for the model's template: when it `takes_tools`, the messages, calls
    /// (arguments as objects) and results as they are, with the tools offered; else plain
    /// (role, text) messages with the tools in Hermes' markup ([`messages`](Self::messages)).
    /// `chat_template_kwargs` needs the file's own template (a written-out one has no variables).
    pub fn transcript(&self, tools: Option<&Tools>, template: &Template) -> Result<Transcript, ApiError> {
        let kwargs = self.chat_template_kwargs.clone().unwrap_or_default();
        if !kwargs.is_empty() && matches!(template, Template::Builtin(_)) {
            return Err(ApiError::invalid(
                Some("chat_template_kwargs"),
                "this model's file has no chat template of its own (its family's is written out), so it takes no template variables",
            ));
        }
        if !template.takes_tools() {
            let messages = self.messages(tools)?;
            let m: Vec<(Role, &str)> = messages.iter().map(|(r, t)| (*r, t.as_str())).collect();
            return Ok(Transcript { kwargs, ..Transcript::of(&m) });
        }
        let texts = self.plain_texts()?;
        let messages = self
            .messages
            .iter()
            .zip(texts)
            .map(|(m, (role, text))| {
                let mut v = serde_json::Map::new();
                let role = if m.role == "tool" { "tool" } else { role.name() };
                v.insert("role".into(), json!(role));
                v.insert("content".into(), json!(text));
                if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    let calls: Vec<Value> = calls
                        .iter()
                        .map(|c| {
                            let arguments = serde_json::from_str::<Value>(&c.function.arguments)
                                .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
                            json!({"id": c.id, "type": "function",
                                   "function": {"name": c.function.name, "arguments": arguments}})
                        })
                        .collect();
                    v.insert("tool_calls".into(), Value::Array(calls));
                }
                if let Some(id) = &m.tool_call_id {
                    v.insert("tool_call_id".into(), json!(id));
                }
                if let Some(name) = &m.name {
                    v.insert("name".into(), json!(name));
                }
                Value::Object(v)
            })
            .collect();
        Ok(Transcript { messages, tools: tools.map(Tools::entries).unwrap_or_default(), kwargs })
    }

    /// What the completion must spell, if anything: a forced tool call, or the response format.
    pub fn grammar(&self, tools: Option<&Tools>) -> Result<Option<Grammar>, ApiError> {
        let forced = tools.and_then(Tools::grammar);
        let format = self.format_grammar()?;
        match (forced, format) {
            (Some(_), Some(_)) => Err(ApiError::invalid(
                Some("tool_choice"),
                "a forced tool call and a response_format cannot both shape one reply",
            )),
            (forced, format) => Ok(forced.or(format)),
        }
    }

    fn format_grammar(&self) -> Result<Option<Grammar>, ApiError> {
        Ok(match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(Grammar::JsonObject),
            Some(ResponseFormat::JsonSchema { json_schema: f }) => {
                let bad = |why: String| ApiError::invalid(Some("response_format"), why);
                if f.name.is_empty() || f.name.len() > 64 {
                    return Err(bad(format!("json_schema.name must have 1 to 64 characters, got {:?}", f.name)));
                }
                match &f.schema {
                    None => Some(Grammar::JsonObject),
                    Some(v @ Value::Object(_)) => Some(Grammar::JsonSchema(v.clone())),
                    Some(v) => return Err(bad(format!("json_schema.schema must be a JSON Schema object, got {v}"))),
                }
            }
        })
    }

    /// How many alternatives each token's log-probability comes with, when `logprobs` is on.
    pub fn logprobs(&self, s: &Sampling) -> Result<Option<usize>, ApiError> {
        match (s.logprobs_on()?, self.top_logprobs) {
            (_, Some(n)) if n > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}"),
            )),
            (false, Some(n)) if n > 0 => {
                Err(ApiError::invalid(Some("top_logprobs"), "top_logprobs needs logprobs: true"))
            }
            (false, _) => Ok(None),
            (true, n) => Ok(Some(n.unwrap_or(0) as usize)),
        }
    }

    /// The conversation as (role, text) messages, as the model reads it: `tools` offered in the
    /// system turn, assistant calls and tool results in Hermes' markup.
    pub fn messages(&self, tools: Option<&Tools>) -> Result<Vec<(Role, String)>, ApiError> {
        let mut out = self.message_texts()?;
        if let Some(t) = tools {
            match out.first_mut() {
                Some((Role::System, text)) => *text = format!("{text}\n\n{}", t.system_text()),
                _ => out.insert(0, (Role::System, t.system_text())),
            }
        }
        Ok(out)
    }

    /// [`plain_texts`](Self::plain_texts) with calls and results in Hermes' markup.
    fn message_texts(&self) -> Result<Vec<(Role, String)>, ApiError> {
        let texts = self.plain_texts()?;
        Ok(self
            .messages
            .iter()
            .zip(texts)
            .map(|(m, (role, text))| {
                let text = match (m.role.as_str(), &m.tool_calls) {
                    ("tool", _) => response_text(&text),
                    (_, Some(calls)) if !calls.is_empty() => {
                        let calls: Vec<Call> = calls.iter().map(|c| c.function.clone()).collect();
                        let calls = calls_text(&calls);
                        if text.is_empty() {
                            calls
                        } else {
                            format!("{text}\n{calls}")
                        }
                    }
                    _ => text,
                };
                (role, text)
            })
            .collect())
    }

    /// Each message's role and text, as a template reads them (`tool` results as user turns).
    fn plain_texts(&self) -> Result<Vec<(Role, String)>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(Some("messages"), "messages must hold at least one message"));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "system" | "developer" => Role::System,
                    "user" | "tool" => Role::User,
                    "assistant" => Role::Assistant,
                    other => {
                        let roles = "system, developer, user, assistant, tool";
                        let why = format!("messages[{i}].role {other:?} is not supported ({roles})");
                        return Err(ApiError::invalid(Some("messages"), why));
                    }
                };
                if m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()) && m.role != "assistant" {
                    return Err(ApiError::invalid(
                        Some("messages"),
                        format!("messages[{i}]: only assistant messages carry tool_calls"),
                    ));
                }
                let text = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut out = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => out.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::invalid(
                                        Some("messages"),
                                        format!(
                                        "messages[{i}]: content parts of type {kind:?} are not supported (text only)"
                                    ),
                                    ))
                                }
                            }
                        }
                        out
                    }
                };
                Ok((role, text))
            })
            .collect()
    }
}

impl Sampling {
    /// Checks the fields and builds the engine's request for `prompt` over a vocabulary of
    /// `vocab` tokens; `default_max` tokens when the client gives no limit.
    pub fn request(
        &self,
        prompt: Vec<u32>,
        max_tokens: Option<u64>,
        default_max: usize,
        vocab: usize,
        logprobs: Option<usize>,
    ) -> Result<Request, ApiError> {
        let open_ended = max_tokens.or(self.max_tokens).is_none();
        let max_tokens = match max_tokens.or(self.max_tokens) {
            Some(0) => return Err(ApiError::invalid(Some("max_tokens"), "max_tokens must be at least 1")),
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
            None => default_max.max(1),
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                Some("temperature"),
                format!("temperature must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_k = match self.top_k {
            None | Some(0) | Some(-1) => None,
            Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
            Some(k) => {
                return Err(ApiError::invalid(Some("top_k"), format!("top_k must be ≥ 1 (0 or -1: off), got {k}")))
            }
        };
        let mut logit_bias = Vec::new();
        for (token, &bias) in self.logit_bias.iter().flatten() {
            let id = token.parse::<u32>().map_err(|_| {
                ApiError::invalid(Some("logit_bias"), format!("logit_bias keys are token ids, got {token:?}"))
            })?;
            logit_bias.push((id, bias as f32));
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) if v.len() > MAX_STOPS => {
                return Err(ApiError::invalid(
                    Some("stop"),
                    format!("at most {MAX_STOPS} stop sequences, got {}", v.len()),
                ))
            }
            Some(Stop::Many(v)) => v.clone(),
        };
        let sampling = SamplingOptions {
            temperature,
            top_p: self.top_p,
            top_k,
            min_p: self.min_p.filter(|&p| p != 0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            logit_bias,
            seed: self.seed.unwrap_or_else(fresh_seed),
        };
        sampling.check(vocab).map_err(|e| ApiError::invalid(Some(e.field), e.message))?;
        Ok(Request {
            prompt,
            max_tokens,
            open_ended,
            sampling,
            logprobs,
            prompt_logprobs: None,
            stop,
            ignore_eos: self.ignore_eos,
            grammar: None,
            time_limit: None,
        })
    }

    /// The requests that serve `n` choices of `request`: choice `i` samples with the seed plus
    /// `i`, so a seeded request repeats choice by choice; an error naming `n` beyond its range.
    pub fn choices(&self, request: Request) -> Result<Vec<Request>, ApiError> {
        let n = match self.n.unwrap_or(1) {
            n @ 1..=MAX_CHOICES => n as usize,
            n => return Err(ApiError::invalid(Some("n"), format!("n must be between 1 and {MAX_CHOICES}, got {n}"))),
        };
        Ok((0..n as u64)
            .map(|i| {
                let mut r = request.clone();
                r.sampling.seed = r.sampling.seed.wrapping_add(i);
                r
            })
            .collect())
    }

    /// Whether `logprobs` is on (`true`); an error for anything but a boolean or null.
    fn logprobs_on(&self) -> Result<bool, ApiError> {
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(false),
            Some(Value::Bool(true)) => Ok(true),
            Some(v) => Err(ApiError::invalid(
                Some("logprobs"),
                format!(
                    "logprobs is true or false here, got {v} (text completions' numeric logprobs are not supported)"
                ),
            )),
        }
    }

    /// Text completions: `logprobs` as OpenAI's legacy integer, the alternatives each generated
    /// token comes with (0 to 5), or off.
    pub fn completion_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(k) if k <= MAX_COMPLETION_LOGPROBS => Ok(Some(k as usize)),
                _ => Err(ApiError::invalid(
                    Some("logprobs"),
                    format!("logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}, got {n}"),
                )),
            },
            Some(v) => Err(ApiError::invalid(
                Some("logprobs"),
                format!("text completions take logprobs as an integer from 0 to {MAX_COMPLETION_LOGPROBS}, got {v}"),
            )),
        }
    }

    /// Whether the client asked for a usage chunk at the end of a stream.
    pub fn stream_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

/// A seed for requests that give none: different for every request.
fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ N.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
}

/// One token's entry of `logprobs.content`: its text, log-probability and UTF-8 bytes, and the
/// alternatives' the same way.
pub fn logprob_json(tok: &Tokenizer, lp: &TokenLogprob) -> Value {
    let entry = |t: u32, logprob: f32| {
        let text = tok.decode(&[t], false).unwrap_or_default();
        json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
    };
    let mut e = entry(lp.token, lp.logprob);
    e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
    e
}

/// A prompt token's entry: [`logprob_json`]'s, or for the first token (nothing precedes it) its
/// text with a null log-probability and no alternatives, as OpenAI's `echo` reports it.
pub fn prompt_logprob_json(tok: &Tokenizer, token: u32, lp: Option<&TokenLogprob>) -> Value {
    match lp {
        Some(lp) => logprob_json(tok, lp),
        None => {
            let text = tok.decode(&[token], false).unwrap_or_default();
            json!({"token": text, "logprob": null, "bytes": text.as_bytes(), "top_logprobs": null})
        }
    }
}

/// Text completions' `logprobs` in OpenAI's legacy shape, from chat-style entries
/// ([`logprob_json`]): the tokens' texts, their log-probabilities, the alternatives as
/// `{text: logprob}` and where each token's text starts, counted in characters from `offset`.
pub fn legacy_logprobs(entries: &[Value], offset: usize) -> Value {
    let text = |e: &Value| e["token"].as_str().unwrap_or_default().to_string();
    let mut at = offset;
    let text_offset: Vec<usize> = entries
        .iter()
        .map(|e| {
            let start = at;
            at += text(e).chars().count();
            start
        })
        .collect();
    let top: Vec<Value> = entries
        .iter()
        .map(|e| match e["top_logprobs"].as_array() {
            Some(alternatives) => Value::Object(alternatives.iter().map(|a| (text(a), a["logprob"].clone())).collect()),
            None => Value::Null,
        })
        .collect();
    json!({
        "tokens": entries.iter().map(text).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length | Finish::Context | Finish::TimeLimit => "length",
    }
}

#[derive(Serialize, Debug, Clone, Copy)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptDetails,
}

/// OpenAI's breakdown of the prompt: the tokens served from the prefix cache.
#[derive(Serialize, Debug, Clone, Copy)]
pub struct PromptDetails {
    pub cached_tokens: usize,
}

impl Usage {
    /// The counts of a request's choices: its prompt once (with the first choice's cached
    /// share, as every choice reads the same prompt), the completions added up.
    pub fn of(choices: &[&Summary]) -> Self {
        let (prompt_tokens, cached_tokens) = choices.first().map_or((0, 0), |s| (s.prompt_tokens, s.cached_tokens));
        let completion_tokens = choices.iter().map(|s| s.completion_tokens).sum();
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptDetails { cached_tokens },
        }
    }
}

/// One finished choice of a whole (not streamed) response.
#[derive(Clone, Debug)]
pub struct Choice {
    /// What the choice begins with before its completion: the prompt, when `echo` asked for it.
    pub echo: Option<String>,
    pub text: String,
    pub summary: Summary,
    /// Each token's entry, when the request asked for them.
    pub logprobs: Option<Vec<Value>>,
    /// The tool calls the reply made (then its text is the calls' markup, not content).
    pub calls: Vec<Call>,
}

/// Which endpoint a response belongs to: the two differ in object names and in where the text goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// The pieces every response of one request shares.
#[derive(Clone, Debug)]
pub struct Reply {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Reply {
    /// The whole response of a request that did not stream: its choices, in order.
    pub fn full(&self, choices: &[Choice]) -> Value {
        let body: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let reason = finish_reason(c.summary.finish);
                match self.kind {
                    Kind::Chat if !c.calls.is_empty() => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": null,
                                    "tool_calls": self.tool_calls(index, &c.calls, false)},
                        "logprobs": c.logprobs.as_ref().map(|l| json!({"content": l})),
                        "finish_reason": "tool_calls",
                    }),
                    Kind::Chat => json!({
                        "index": index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": c.logprobs.as_ref().map(|l| json!({"content": l})),
                        "finish_reason": reason,
                    }),
                    Kind::Completion => {
                        let logprobs = c.logprobs.as_deref().map(|l| legacy_logprobs(l, 0));
                        let text = format!("{}{}", c.echo.as_deref().unwrap_or_default(), c.text);
                        json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
                    }
                }
            })
            .collect();
        let summaries: Vec<&Summary> = choices.iter().map(|c| &c.summary).collect();
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": body,
            "usage": Usage::of(&summaries),
        })
    }

    /// Calls as OpenAI lists them (streamed entries also carry their place in the list), each
    /// with an id unique to this response: nine letters and digits, the only ids Mistral's
    /// template takes back.
    fn tool_calls(&self, choice: usize, calls: &[Call], streamed: bool) -> Vec<Value> {
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut v = json!({"id": call_id(&format!("{}-{choice}-{k}", self.id)), "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}});
                if streamed {
                    v["index"] = json!(k);
                }
                v
            })
            .collect()
    }

    /// A stream chunk of choice `index` carrying its tool calls whole.
    pub fn tool_chunk(&self, index: usize, calls: &[Call]) -> Value {
        let delta = json!({"tool_calls": self.tool_calls(index, calls, true)});
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
               "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]})
    }

    /// A stream chunk of choice `index`: new text (chat: the first chunk carries the role), or
    /// its end with OpenAI's `finish_reason`; a text completion's entries are placed from
    /// `offset`, the characters of its text sent before.
    pub fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        first: bool,
        reason: Option<&str>,
        logprobs: Option<&[Value]>,
        offset: usize,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                let logprobs = logprobs.map(|c| json!({"content": c}));
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
            }
            Kind::Completion => {
                let logprobs = logprobs.filter(|l| !l.is_empty()).map(|l| legacy_logprobs(l, offset));
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": reason})
            }
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]})
    }

    /// The last chunk of a stream whose client asked for usage: no choices, the counts.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

/// Nine letters and digits from `key` (FNV-1a, base 62).
fn call_id(key: &str) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use veloq_candle::model::{ChatTemplate, JinjaTemplate};

    /// The request a body gives, its choices checked.
    fn sampling(body: &str) -> Result<Request, ApiError> {
        let s = from_body::<Sampling>(body.as_bytes())?;
        let r = s.request(vec![1, 2], None, 16, 100, None)?;
        s.choices(r.clone())?;
        Ok(r)
    }

    #[test]
    fn choices_repeat_the_request_with_successive_seeds() {
        let s = from_body::<Sampling>(br#"{"n": 3, "seed": 7, "temperature": 0.8}"#).unwrap();
        let r = s.request(vec![1, 2], None, 16, 100, None).unwrap();
        let c = s.choices(r.clone()).unwrap();
        assert_eq!(c.iter().map(|q| q.sampling.seed).collect::<Vec<_>>(), vec![7, 8, 9]);
        assert!(c.iter().all(|q| q.prompt == r.prompt && q.sampling.temperature == 0.8));
        let s = from_body::<Sampling>(format!(r#"{{"n": 2, "seed": {}}}"#, u64::MAX).as_bytes()).unwrap();
        let c = s.choices(s.request(vec![1], None, 16, 100, None).unwrap()).unwrap();
        assert_eq!((c[0].sampling.seed, c[1].sampling.seed), (u64::MAX, 0), "seeds wrap");
        let s = from_body::<Sampling>(b"{}").unwrap();
        assert_eq!(s.choices(s.request(vec![1], None, 16, 100, None).unwrap()).unwrap().len(), 1);
    }

    #[test]
    fn fields_are_checked_and_defaulted_as_openai_does() {
        let r = sampling(r#"{"prompt": "x", "seed": 3}"#).unwrap();
        let o = &r.sampling;
        assert_eq!((r.max_tokens, o.temperature, o.top_p, o.seed), (16, 1.0, None, 3));
        assert_eq!((o.top_k, o.min_p, o.presence_penalty, o.repetition_penalty), (None, None, 0.0, 1.0));
        let r = sampling(r#"{"prompt": "x", "max_tokens": 5, "temperature": 0, "stop": "\n"}"#).unwrap();
        assert_eq!((r.max_tokens, r.sampling.temperature, r.stop.clone()), (5, 0.0, vec!["\n".to_string()]));
        let r = sampling(
            r#"{"top_k": 40, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "repetition_penalty": 1.1, "logit_bias": {"7": -100, "42": 3.5}}"#,
        )
        .unwrap();
        let o = r.sampling;
        assert_eq!((o.top_k, o.min_p, o.presence_penalty, o.frequency_penalty), (Some(40), Some(0.05), 0.5, -0.5));
        assert_eq!((o.repetition_penalty, o.logit_bias), (1.1, vec![(42, 3.5), (7, -100.0)]));
        for off in [r#"{"top_k": 0}"#, r#"{"top_k": -1}"#] {
            assert_eq!(sampling(off).unwrap().sampling.top_k, None, "{off} turns top-k off");
        }
        for (body, param) in [
            (r#"{"prompt": "x", "top_p": 7}"#, "top_p"),
            (r#"{"prompt": "x", "top_p": 0}"#, "top_p"),
            (r#"{"prompt": "x", "temperature": -1}"#, "temperature"),
            (r#"{"prompt": "x", "temperature": 2.5}"#, "temperature"),
            (r#"{"prompt": "x", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"prompt": "x", "n": 0}"#, "n"),
            (r#"{"prompt": "x", "n": 129}"#, "n"),
            (r#"{"top_k": -2}"#, "top_k"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"presence_penalty": 2.5}"#, "presence_penalty"),
            (r#"{"frequency_penalty": -3}"#, "frequency_penalty"),
            (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
            (r#"{"logit_bias": {"x": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"100": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"5": 200}}"#, "logit_bias"),
            (r#"{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
        ] {
            let e = sampling(body).unwrap_err();
            assert_eq!((e.status, e.param), (400, Some(param)), "{body}: {e:?}");
        }
        // logprobs: chat's boolean with top_logprobs ≤ 20; text completions refuse them.
        let lp = |body: &str| {
            let b = body.as_bytes();
            from_body::<ChatRequest>(b).unwrap().logprobs(&from_body::<Sampling>(b).unwrap())
        };
        let m = r#""messages": []"#;
        assert_eq!(lp(&format!(r#"{{{m}}}"#)).unwrap(), None);
        assert_eq!(lp(&format!(r#"{{{m}, "logprobs": true}}"#)).unwrap(), Some(0));
        assert_eq!(lp(&format!(r#"{{{m}, "logprobs": true, "top_logprobs": 5}}"#)).unwrap(), Some(5));
        for (body, param) in [
            (format!(r#"{{{m}, "logprobs": true, "top_logprobs": 21}}"#), "top_logprobs"),
            (format!(r#"{{{m}, "top_logprobs": 2}}"#), "top_logprobs"),
            (format!(r#"{{{m}, "logprobs": 3}}"#), "logprobs"),
        ] {
            assert_eq!(lp(&body).unwrap_err().param, Some(param), "{body}");
        }
        let clp = |body: &str| from_body::<Sampling>(body.as_bytes()).unwrap().completion_logprobs();
        assert_eq!((clp(r#"{"logprobs": 3}"#).unwrap(), clp(r#"{"logprobs": null}"#).unwrap()), (Some(3), None));
        for bad in [r#"{"logprobs": 6}"#, r#"{"logprobs": true}"#, r#"{"logprobs": -1}"#] {
            assert_eq!(clp(bad).unwrap_err().param, Some("logprobs"), "{bad}");
        }
        // Wrong types never reach the checks: the parse refuses them, naming the field.
        for (body, field) in [(r#"{"max_tokens": "ten"}"#, "max_tokens"), (r#"{"seed": -1}"#, "seed")] {
            let e = sampling(body).unwrap_err();
            assert!(e.message.contains(field) && e.message.starts_with("invalid request"), "{e:?}");
        }
        assert!(from_body::<CompletionRequest>(br#"{"prompt": 5}"#).is_err());
        assert!(from_body::<Sampling>(b"{").unwrap_err().message.starts_with("malformed JSON"));
    }

    /// Every field is read or refused by name.
    #[test]
    fn fields_no_endpoint_reads_are_refused_by_name() {
        let chat = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "x"}}]{extra}}}"#);
        for ok in [
            "",
            r#", "tools": [], "tool_choice": "none", "parallel_tool_calls": false"#,
            r#", "response_format": {"type": "text"}, "top_logprobs": null, "user": "u-1""#,
            r#", "tool_choice": "auto", "top_k": 5, "min_p": 0.1, "logit_bias": {"3": 1}"#,
        ] {
            assert!(check_fields(chat(ok).as_bytes(), CHAT_FIELDS).is_ok(), "{ok}");
        }
        for (extra, says) in [
            (r#", "max_token": 5"#, "\"max_token\""),
            (r#", "functions": [{"name": "f"}]"#, "\"functions\""),
            (r#", "prompt": "x""#, "\"prompt\""),
        ] {
            let e = check_fields(chat(extra).as_bytes(), CHAT_FIELDS).unwrap_err();
            assert!(e.status == 400 && e.message.contains(says), "{extra}: {e:?}");
        }
        let e = check_fields(br#"{"prompt": "x", "messages": []}"#, COMPLETION_FIELDS).unwrap_err();
        assert!(e.message.contains("\"messages\""), "{e:?}");
        assert!(check_fields(br#"{"prompt": "x", "echo": false, "best_of": 1}"#, COMPLETION_FIELDS).is_ok());
    }

    #[test]
    fn legacy_logprobs_place_each_token_in_the_text() {
        let entry = |t: &str, lp: f64, alt: &[(&str, f64)]| {
            let top: Vec<Value> = alt.iter().map(|(a, l)| json!({"token": a, "logprob": l})).collect();
            json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": top})
        };
        let l = legacy_logprobs(&[entry(" Par", -0.5, &[(" Par", -0.5), (" Lyon", -2.0)]), entry("ís", -0.25, &[])], 7);
        assert_eq!(l["tokens"], json!([" Par", "ís"]));
        assert_eq!(l["token_logprobs"], json!([-0.5, -0.25]));
        assert_eq!(l["top_logprobs"], json!([{" Par": -0.5, " Lyon": -2.0}, {}]));
        assert_eq!(l["text_offset"], json!([7, 11]), "characters, not bytes");
    }

    #[test]
    fn response_formats_become_grammars() {
        let g = |format: &str| {
            let body = format!(r#"{{"messages": [], "response_format": {format}}}"#);
            from_body::<ChatRequest>(body.as_bytes()).and_then(|r| r.grammar(None))
        };
        assert_eq!(g(r#"{"type": "text"}"#).unwrap(), None);
        assert_eq!(g(r#"{"type": "json_object"}"#).unwrap(), Some(Grammar::JsonObject));
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
        let f = json!({"type": "json_schema", "json_schema": {"name": "place", "strict": true, "schema": schema}});
        assert_eq!(g(&f.to_string()).unwrap(), Some(Grammar::JsonSchema(schema)));
        assert_eq!(g(r#"{"type": "json_schema", "json_schema": {"name": "any"}}"#).unwrap(), Some(Grammar::JsonObject));
        for (bad, says) in [
            (r#"{"type": "xml"}"#, "response_format"),
            (r#"{"type": "json_schema"}"#, "json_schema"),
            (r#"{"type": "json_schema", "json_schema": {"name": "", "schema": {}}}"#, "name"),
            (r#"{"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}"#, "schema"),
        ] {
            let e = g(bad).unwrap_err();
            assert!(e.status == 400 && e.message.contains(says), "{bad}: {e:?}");
        }
    }

    #[test]
    fn messages_take_text_content_in_either_form() {
        let c: ChatRequest = serde_json::from_str(
            r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.messages(None).unwrap(), vec![(Role::System, "Be brief.".into()), (Role::User, "hi".into())]);
        let c: ChatRequest = serde_json::from_str(r#"{"messages": [{"role": "robot", "content": "x"}]}"#).unwrap();
        assert!(c.messages(None).unwrap_err().message.contains("robot"));
        let c: ChatRequest = serde_json::from_str(r#"{"messages": []}"#).unwrap();
        assert_eq!(c.messages(None).unwrap_err().param, Some("messages"));
    }

    /// A tool loop's second request: the tools in the system turn (added to the client's own),
    /// the assistant's call and the tool's result in Hermes' markup.
    #[test]
    fn a_tool_loop_reads_as_hermes_markup() {
        let c: ChatRequest = serde_json::from_value(json!({
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        }))
        .unwrap();
        let tools = c.tools(ToolFormat::Hermes).unwrap();
        let m = c.messages(tools.as_ref()).unwrap();
        assert_eq!(m.len(), 4);
        assert!(m[0].1.starts_with("Be brief.\n\n# Tools") && m[0].1.contains("\"get_weather\""), "{}", m[0].1);
        assert_eq!(
            m[2],
            (
                Role::Assistant,
                "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>".into()
            )
        );
        assert_eq!(m[3], (Role::User, "<tool_response>\n18 C, sunny\n</tool_response>".into()));
        // Without a system message the tools make one; "none" offers nothing.
        let mut plain = c.clone();
        plain.messages.remove(0);
        assert_eq!(plain.messages(tools.as_ref()).unwrap()[0].0, Role::System);
        plain.tool_choice = Some(ToolChoice::Mode("none".into()));
        assert!(plain.tools(ToolFormat::Hermes).unwrap().is_none());
        let bad: ChatRequest = serde_json::from_value(json!({"messages": [{"role": "user", "content": "x",
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}))
        .unwrap();
        assert!(bad.messages(None).unwrap_err().message.contains("only assistant"));
    }

    /// A template that takes tools gets the messages as they are: calls with their ids and
    /// arguments as objects, the `tool` role, the tools offered and `chat_template_kwargs`; one that
    /// takes none gets plain messages in Hermes' markup. Call ids are nine letters and digits.
    #[test]
    fn a_tool_loop_goes_to_a_template_that_takes_tools_as_it_is() {
        let c: ChatRequest = serde_json::from_value(json!({
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call0A1b2", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]},
                {"role": "tool", "tool_call_id": "call0A1b2", "name": "get_weather", "content": "18 C"}
            ],
            "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
            "chat_template_kwargs": {"date_string": "26 Jul 2024"}
        }))
        .unwrap();
        let tools = c.tools(ToolFormat::Llama3).unwrap();
        let llama3 = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tools }}";
        let native = Template::Jinja(std::sync::Arc::new(JinjaTemplate::new(llama3, "", "").unwrap()));
        let t = c.transcript(tools.as_ref(), &native).unwrap();
        assert_eq!(t.kwargs["date_string"], "26 Jul 2024");
        assert_eq!(t.messages[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(
            t.messages[2],
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call0A1b2", "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]})
        );
        // Arguments keep the client's order (the template shows them as they are).
        assert_eq!(
            t.messages[2]["tool_calls"][0]["function"]["arguments"].to_string(),
            r#"{"city":"Paris","unit":"C"}"#
        );
        assert_eq!(
            t.messages[3],
            json!({"role": "tool", "content": "18 C", "tool_call_id": "call0A1b2", "name": "get_weather"})
        );
        assert_eq!(
            t.tools,
            vec![json!({"type": "function", "function": {"name": "get_weather", "description": "Weather",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})]
        );
        let plain = Template::Jinja(std::sync::Arc::new(JinjaTemplate::new("{{ messages }}", "", "").unwrap()));
        let hermes = c.transcript(tools.as_ref(), &plain).unwrap();
        assert!(
            hermes.tools.is_empty() && hermes.messages[3]["content"].as_str().unwrap().starts_with("<tool_response>")
        );
        // A written-out template has no variables: the field is refused by name.
        let e = c.transcript(tools.as_ref(), &Template::Builtin(ChatTemplate::ChatMl)).unwrap_err();
        assert_eq!((e.status, e.param), (400, Some("chat_template_kwargs")), "{e:?}");
        let ids: Vec<String> = (0..3).map(|k| call_id(&format!("chatcmpl-1-0-{k}"))).collect();
        assert!(ids.iter().all(|id| id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric())), "{ids:?}");
        assert!(ids[0] != ids[1] && ids[1] != ids[2]);
    }
}
