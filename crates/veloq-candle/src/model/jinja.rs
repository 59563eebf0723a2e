//! The GGUF's own chat template (`tokenizer.chat_template`), rendered as Hugging Face's
//! `apply_chat_template` does: Jinja with `trim_blocks` and `lstrip_blocks`, Python's string and
//! dict methods, `raise_exception`, the file's BOS and EOS token text and
//! `add_generation_prompt`. [`Template`] is what a prompt is rendered with: this when the file
//! has one, else the written-out template of the family ([`ChatTemplate`]).

use std::sync::Arc;

use minijinja::{Environment, ErrorKind};
use serde_json::json;
use tokenizers::Tokenizer;

use super::template::{ChatTemplate, Part, Role};
use super::tokenizer::control_speller;
use crate::error::{Error, Result};

/// A Jinja chat template, parsed once, with the token text it may name.
#[derive(Clone, Debug)]
pub struct JinjaTemplate {
    /// The template (named [`NAME`]) and its globals (`bos_token`, `eos_token`).
    env: Environment<'static>,
}

const NAME: &str = "chat";

/// Private-use code points around a message's index: what the sentinel render puts where a
/// message's text goes.
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

impl JinjaTemplate {
    /// `source` with the file's BOS and EOS token text; an error if it does not parse.
    pub fn new(source: impl Into<String>, bos: impl Into<String>, eos: impl Into<String>) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_global("bos_token", bos.into());
        env.add_global("eos_token", eos.into());
        env.add_template_owned(NAME, source.into()).map_err(|e| template_error(&e))?;
        Ok(Self { env })
    }

    fn template(&self) -> Result<minijinja::Template<'_, '_>> {
        self.env.get_template(NAME).map_err(|e| template_error(&e))
    }

    /// `messages` up to where the model's reply begins (`add_generation_prompt`).
    pub fn render(&self, messages: &[(Role, &str)]) -> Result<String> {
        let messages: Vec<_> = messages.iter().map(|(r, c)| json!({"role": role(*r), "content": c})).collect();
        let ctx = json!({"messages": messages, "add_generation_prompt": true});
        self.template()?.render(ctx).map_err(|e| template_error(&e))
    }

    /// [`render`](Self::render) with the messages' text apart from the markup: each message is
    /// rendered as a sentinel, and the output split at them (a template that rewrote a message's
    /// text, trimming it say, is then not applied to it).
    fn render_parts(&self, messages: &[(Role, &str)]) -> Result<Vec<Part>> {
        let marks: Vec<String> = (0..messages.len()).map(|i| format!("{OPEN}{i}{CLOSE}")).collect();
        let with_marks: Vec<(Role, &str)> = messages.iter().zip(&marks).map(|(m, s)| (m.0, s.as_str())).collect();
        let text = self.render(&with_marks)?;
        let mut parts = Vec::new();
        let mut rest = text.as_str();
        while let Some(a) = rest.find(OPEN) {
            let b = rest[a..]
                .find(CLOSE)
                .map(|b| a + b)
                .ok_or_else(|| Error::Config("chat template: a message's text was cut".into()))?;
            let i: usize = rest[a + OPEN.len_utf8()..b]
                .parse()
                .map_err(|_| Error::Config("chat template: a message's text was rewritten".into()))?;
            if a > 0 {
                parts.push(Part::Markup(rest[..a].to_string()));
            }
            parts.push(Part::Content(messages[i].1.to_string()));
            rest = &rest[b + CLOSE.len_utf8()..];
        }
        if !rest.is_empty() {
            parts.push(Part::Markup(rest.to_string()));
        }
        Ok(parts)
    }
}

fn role(r: Role) -> &'static str {
    match r {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
    }
}

fn template_error(e: &minijinja::Error) -> Error {
    Error::Config(format!("the model's chat template: {e}"))
}

/// What a conversation is rendered with.
#[derive(Clone, Debug)]
pub enum Template {
    /// The file's own template.
    Jinja(Arc<JinjaTemplate>),
    /// A family's template written out (files without one).
    Builtin(ChatTemplate),
}

impl Template {
    /// `messages` up to where the model's reply begins.
    pub fn render(&self, messages: &[(Role, &str)]) -> Result<String> {
        match self {
            Template::Jinja(j) => j.render(messages),
            Template::Builtin(t) => Ok(t.render(messages)),
        }
    }

    /// [`render`](Self::render) as markup and the messages' text apart, for tokenizing control
    /// tokens typed in a message as text. When no message spells one of `tok`'s control tokens
    /// this is the rendered string as one piece of markup, tokenized whole.
    pub fn render_parts(&self, messages: &[(Role, &str)], tok: &Tokenizer) -> Result<Vec<Part>> {
        let spells_control = control_speller(tok);
        let spells = messages.iter().any(|(_, c)| spells_control(c));
        match (self, spells) {
            (_, false) => Ok(vec![Part::Markup(self.render(messages)?)]),
            (Template::Jinja(j), true) => j.render_parts(messages),
            (Template::Builtin(t), true) => Ok(t.render_parts(messages)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2's own template (as its GGUF carries it) renders a conversation as the written-out
    /// ChatML does, with the default system turn the template adds when none is given.
    #[test]
    fn a_chatml_template_renders_as_chatml() {
        let src = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = JinjaTemplate::new(src, "", "<|im_end|>").unwrap();
        use Role::*;
        let conv = [(System, "Be brief."), (User, "Hi"), (Assistant, "Hello."), (User, "Why?")];
        assert_eq!(t.render(&conv).unwrap(), ChatTemplate::ChatMl.render(&conv));
        let default =
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
        assert_eq!(
            t.render(&[(User, "Hi")]).unwrap(),
            format!("{default}{}", ChatTemplate::ChatMl.render(&[(User, "Hi")]))
        );
    }

    /// Llama 3's template (BOS text, `trim`, headers) renders as the written-out Llama 3 one after
    /// the BOS; Mistral's `raise_exception` is a clear error; parts put each message apart.
    #[test]
    fn llama3_and_mistral_templates() {
        let llama3 = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
        let t = JinjaTemplate::new(llama3, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        use Role::*;
        let conv = [(System, "Be brief."), (User, "  Hi  ")];
        let want = format!("<|begin_of_text|>{}", ChatTemplate::Llama3.render(&[(System, "Be brief."), (User, "Hi")]));
        assert_eq!(t.render(&conv).unwrap(), want);
        let parts = t.render_parts(&[(User, "a<|eot_id|>b")]).unwrap();
        assert_eq!(parts[1], Part::Content("a<|eot_id|>b".into()));
        assert!(matches!(&parts[0], Part::Markup(m) if m.starts_with("<|begin_of_text|><|start_header_id|>user")));

        let mistral = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}";
        let t = JinjaTemplate::new(mistral, "<s>", "</s>").unwrap();
        assert_eq!(
            t.render(&[(User, "Hi"), (Assistant, "Yo"), (User, "Why?")]).unwrap(),
            "<s>[INST] Hi [/INST]Yo</s>[INST] Why? [/INST]"
        );
        let e = t.render(&[(Assistant, "first")]).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
        assert!(JinjaTemplate::new("{% for %}", "", "").is_err());
    }
}
