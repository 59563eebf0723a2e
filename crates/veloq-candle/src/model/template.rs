//! Chat templates written out (ChatML, Gemma's turns, Llama 3's headers, Phi-3's tags): a
//! conversation rendered up to where the model's reply begins, a follow-up turn, what closes a
//! reply. Which one a model takes: its vocabulary's markers, else its family's
//! ([`Architecture::chat_template`](super::arch::Architecture::chat_template)).

use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;

/// Who said a message of a conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Instructions for the assistant (Gemma has no system turn: they open the first user turn).
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
}

impl Role {
    /// The role's name in chat templates and OpenAI's API.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// A conversation as OpenAI's API and Hugging Face's chat templates write it, for a template that
/// reads more than (role, text) pairs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Transcript {
    /// JSON messages: `role`, `content` (text), and where they apply `tool_calls` (each with
    /// `id`, `type` and `function` {`name`, `arguments` as an object}), `tool_call_id`, `name`.
    pub messages: Vec<Value>,
    /// The functions offered, as OpenAI's `tools` entries.
    pub tools: Vec<Value>,
    /// More template variables (`chat_template_kwargs`: `date_string`, `enable_thinking`…).
    pub kwargs: Map<String, Value>,
}

impl Transcript {
    /// Plain (role, text) messages.
    pub fn of(messages: &[(Role, &str)]) -> Self {
        let messages = messages.iter().map(|(r, c)| json!({"role": r.name(), "content": c})).collect();
        Self { messages, ..Self::default() }
    }

    /// The messages as (role, text) pairs, when that is all there is: no tools, no template
    /// variables, no calls, text content, system, user and assistant roles only.
    pub fn plain(&self) -> Option<Vec<(Role, &str)>> {
        if !self.tools.is_empty() || !self.kwargs.is_empty() {
            return None;
        }
        self.messages
            .iter()
            .map(|m| {
                let m = m.as_object()?;
                if m.keys().any(|k| k != "role" && k != "content") {
                    return None;
                }
                let role = match m.get("role")?.as_str()? {
                    "system" => Role::System,
                    "user" => Role::User,
                    "assistant" => Role::Assistant,
                    _ => return None,
                };
                Some((role, m.get("content")?.as_str()?))
            })
            .collect()
    }
}

/// A piece of a rendered conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// The template's own text: its control tokens are markup.
    Markup(String),
    /// A message's text: whatever it spells is text.
    Content(String),
}

impl Part {
    /// The piece's text.
    pub fn text(&self) -> &str {
        match self {
            Part::Markup(s) | Part::Content(s) => s,
        }
    }
}

/// Chat templates we can apply without a Jinja engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\n…<|im_end|>` (SmolLM2, Qwen2).
    ChatMl,
    /// `<bos><start_of_turn>user\n…<end_of_turn>\n<start_of_turn>model\n` (Gemma).
    Gemma,
    /// `<|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>` (Llama 3; the BOS is the
    /// file's).
    Llama3,
    /// `<|user|>\n…<|end|>\n<|assistant|>\n` (Phi-3).
    Phi3,
    /// No template: the prompt is fed as is.
    Raw,
}

impl ChatTemplate {
    /// The template whose markers the vocabulary has ([`Raw`](Self::Raw) if none's).
    pub fn detect(tok: &Tokenizer) -> Self {
        let has = |t: &[&str]| t.iter().all(|t| tok.token_to_id(t).is_some());
        if has(&["<|im_start|>", "<|im_end|>"]) {
            ChatTemplate::ChatMl
        } else if has(&["<start_of_turn>", "<end_of_turn>"]) {
            ChatTemplate::Gemma
        } else if has(&["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]) {
            ChatTemplate::Llama3
        } else if has(&["<|user|>", "<|assistant|>", "<|end|>"]) {
            ChatTemplate::Phi3
        } else {
            ChatTemplate::Raw
        }
    }

    /// A conversation's first user turn, up to where the model's reply begins.
    pub fn apply(self, prompt: &str) -> String {
        match self {
            ChatTemplate::Gemma => format!("<bos>{}", self.turn(prompt)),
            _ => self.turn(prompt),
        }
    }

    /// A user turn (first or later), up to where the model's reply begins.
    pub fn turn(self, prompt: &str) -> String {
        match self {
            ChatTemplate::ChatMl => format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"),
            ChatTemplate::Gemma => format!("<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"),
            ChatTemplate::Llama3 => format!(
                "<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
            ),
            ChatTemplate::Phi3 => format!("<|user|>\n{prompt}<|end|>\n<|assistant|>\n"),
            ChatTemplate::Raw => prompt.to_string(),
        }
    }

    /// A whole conversation, up to where the model's next reply begins: `render(&[(User, p)])` is
    /// [`apply`](Self::apply)`(p)`.
    pub fn render(self, messages: &[(Role, &str)]) -> String {
        self.render_parts(messages).iter().map(Part::text).collect()
    }

    /// [`render`](Self::render) as the template's markup and the messages' own text apart, so
    /// that control tokens typed inside a message can be tokenized as the text they spell.
    pub fn render_parts(self, messages: &[(Role, &str)]) -> Vec<Part> {
        let mut out = Vec::new();
        let markup = |out: &mut Vec<Part>, m: String| match out.last_mut() {
            Some(Part::Markup(prev)) => prev.push_str(&m),
            _ => out.push(Part::Markup(m)),
        };
        let content = |out: &mut Vec<Part>, t: String| {
            if !t.is_empty() {
                out.push(Part::Content(t))
            }
        };
        match self {
            ChatTemplate::ChatMl => {
                for &(role, text) in messages {
                    let role = role.name();
                    markup(&mut out, format!("<|im_start|>{role}\n"));
                    content(&mut out, text.to_string());
                    markup(&mut out, "<|im_end|>\n".into());
                }
                markup(&mut out, "<|im_start|>assistant\n".into());
            }
            ChatTemplate::Gemma => {
                markup(&mut out, "<bos>".into());
                let system: Vec<&str> = messages.iter().filter(|m| m.0 == Role::System).map(|m| m.1).collect();
                let mut pending = (!system.is_empty()).then(|| system.join("\n\n"));
                for &(role, text) in messages.iter().filter(|m| m.0 != Role::System) {
                    let (role, text) = match (role, pending.take()) {
                        (Role::User, Some(sys)) => ("user", format!("{sys}\n\n{text}")),
                        (r, sys) => {
                            pending = sys;
                            (if r == Role::User { "user" } else { "model" }, text.to_string())
                        }
                    };
                    markup(&mut out, format!("<start_of_turn>{role}\n"));
                    content(&mut out, text);
                    markup(&mut out, "<end_of_turn>\n".into());
                }
                if let Some(sys) = pending {
                    markup(&mut out, "<start_of_turn>user\n".into());
                    content(&mut out, sys);
                    markup(&mut out, "<end_of_turn>\n".into());
                }
                markup(&mut out, "<start_of_turn>model\n".into());
            }
            ChatTemplate::Llama3 | ChatTemplate::Phi3 => {
                let end = if self == ChatTemplate::Llama3 { "<|eot_id|>" } else { "<|end|>\n" };
                for &(role, text) in messages {
                    markup(&mut out, self.message_start(role));
                    content(&mut out, text.to_string());
                    markup(&mut out, end.into());
                }
                markup(&mut out, self.message_start(Role::Assistant));
            }
            ChatTemplate::Raw => {
                for (i, m) in messages.iter().enumerate() {
                    if i > 0 {
                        markup(&mut out, "\n".into());
                    }
                    content(&mut out, m.1.to_string());
                }
            }
        }
        out
    }

    /// Where a message of `role` begins (Llama 3 and Phi-3).
    fn message_start(self, role: Role) -> String {
        let name = role.name();
        match self {
            ChatTemplate::Llama3 => format!("<|start_header_id|>{name}<|end_header_id|>\n\n"),
            _ => format!("<|{name}|>\n"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversations_render_in_each_template() {
        use Role::*;
        for t in
            [ChatTemplate::ChatMl, ChatTemplate::Gemma, ChatTemplate::Llama3, ChatTemplate::Phi3, ChatTemplate::Raw]
        {
            assert_eq!(t.render(&[(User, "hi")]), t.apply("hi"), "{t:?}: one user turn is apply");
        }
        let talk = [(System, "Be brief."), (User, "hi"), (Assistant, "hello"), (User, "why?")];
        assert_eq!(
            ChatTemplate::ChatMl.render(&talk),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nwhy?<|im_end|>\n<|im_start|>assistant\n"
        );
        // Gemma has no system turn: the instructions open the first user turn.
        assert_eq!(
            ChatTemplate::Gemma.render(&talk),
            "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n<start_of_turn>user\nwhy?<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            ChatTemplate::Llama3.render(&talk),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nwhy?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            ChatTemplate::Phi3.render(&talk),
            "<|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\nhello<|end|>\n<|user|>\nwhy?<|end|>\n<|assistant|>\n"
        );
    }
}
