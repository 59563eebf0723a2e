//! The GGUF's own chat template (`tokenizer.chat_template`), rendered as llama.cpp's
//! `llama-server --jinja` and Hugging Face's `apply_chat_template` do: Jinja with `trim_blocks` and
//! `lstrip_blocks`, Python's string and dict methods and `json.dumps`-style `tojson`,
//! `raise_exception`, `strftime_now` and today's `date_string` (llama.cpp's), the file's BOS and
//! EOS token text, `add_generation_prompt`, the tools offered and tool-call messages.
//! [`Template`] is what a prompt is rendered with: this when the file has one, else the
//! written-out template of the family ([`ChatTemplate`]).

use std::sync::Arc;

use minijinja::{Environment, ErrorKind, Value as JinjaValue};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::template::{ChatTemplate, Part, Role, Transcript};
use super::tokenizer::control_speller;
use crate::error::{Error, Result};

/// A Jinja chat template, parsed once, with the token text it may name.
#[derive(Clone, Debug)]
pub struct JinjaTemplate {
    /// The template (named [`NAME`]) and its globals (`bos_token`, `eos_token`).
    env: Environment<'static>,
    source: String,
}

const NAME: &str = "chat";

/// Private-use code points around a message's index: what the sentinel render puts where a
/// message's text goes.
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

impl JinjaTemplate {
    /// `source` with the file's BOS and EOS token text; an error if it does not parse.
    pub fn new(source: impl Into<String>, bos: impl Into<String>, eos: impl Into<String>) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| -> std::result::Result<String, minijinja::Error> {
            strftime(&format, std::time::SystemTime::now())
                .map_err(|why| minijinja::Error::new(ErrorKind::InvalidOperation, why))
        });
        env.add_filter("tojson", tojson);
        env.add_global("bos_token", bos.into());
        env.add_global("eos_token", eos.into());
        let today = strftime("%d %b %Y", std::time::SystemTime::now()).expect("a fixed format");
        env.add_global("date_string", today);
        env.add_template_owned(NAME, source.clone()).map_err(|e| template_error(&e))?;
        Ok(Self { env, source })
    }

    fn template(&self) -> Result<minijinja::Template<'_, '_>> {
        self.env.get_template(NAME).map_err(|e| template_error(&e))
    }

    /// Whether the template offers tools and shows calls and their results itself (it reads
    /// `tools`).
    pub fn takes_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// `messages` up to where the model's reply begins (`add_generation_prompt`).
    pub fn render(&self, messages: &[(Role, &str)]) -> Result<String> {
        self.render_transcript(&Transcript::of(messages))
    }

    /// A transcript up to where the model's reply begins: its `kwargs` first (they may replace
    /// `date_string`), then `messages`, `tools` when it offers any, `add_generation_prompt`.
    pub fn render_transcript(&self, t: &Transcript) -> Result<String> {
        let mut ctx = t.kwargs.clone();
        ctx.insert("messages".into(), Value::Array(t.messages.clone()));
        if !t.tools.is_empty() {
            ctx.insert("tools".into(), Value::Array(t.tools.clone()));
        }
        ctx.insert("add_generation_prompt".into(), json!(true));
        self.template()?.render(Value::Object(ctx)).map_err(|e| template_error(&e))
    }

    /// [`render_transcript`](Self::render_transcript) with the messages' text apart from the
    /// markup: each message's text is rendered as a sentinel, and the output split at them (a
    /// template that rewrote a message's text, trimming it say, is then not applied to it).
    fn render_parts(&self, t: &Transcript) -> Result<Vec<Part>> {
        let mut marked = t.clone();
        let mut texts = Vec::new();
        for m in marked.messages.iter_mut() {
            if let Some(Value::String(c)) = m.get_mut("content") {
                let mark = format!("{OPEN}{}{CLOSE}", texts.len());
                texts.push(std::mem::replace(c, mark));
            }
        }
        let text = self.render_transcript(&marked)?;
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
            parts.push(Part::Content(texts[i].to_string()));
            rest = &rest[b + CLOSE.len_utf8()..];
        }
        if !rest.is_empty() {
            parts.push(Part::Markup(rest.to_string()));
        }
        Ok(parts)
    }
}

/// Python's `json.dumps(value, ensure_ascii=…, indent=…, sort_keys=…)`, which Hugging Face's
/// `tojson` is (`ensure_ascii` off unless asked): `", "` and `": "` between items on one line,
/// keys in their order, nothing escaped for HTML (minijinja's own `tojson` is compact and escapes
/// `<`, `>`, `&` and `'`).
fn tojson(value: JinjaValue, kwargs: minijinja::value::Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let bad = |e: serde_json::Error| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    };
    let mut value = serde_json::to_value(&value).map_err(bad)?;
    if sort_keys == Some(true) {
        sort_keys_of(&mut value);
    }
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let pad = " ".repeat(n);
            let f = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            serde::Serialize::serialize(&value, &mut serde_json::Serializer::with_formatter(&mut out, f))
                .map_err(bad)?
        }
        None => serde::Serialize::serialize(&value, &mut serde_json::Serializer::with_formatter(&mut out, PythonJson))
            .map_err(bad)?,
    }
    let text = String::from_utf8(out).expect("serde_json writes UTF-8");
    Ok(match ensure_ascii {
        Some(true) => text.encode_utf16().fold(String::new(), |mut s, u| {
            match u {
                0..0x80 => s.push(u as u8 as char),
                _ => s.push_str(&format!("\\u{u:04x}")),
            }
            s
        }),
        _ => text,
    })
}

/// Every object's keys in sorted order, nested ones too.
fn sort_keys_of(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.sort_keys();
            m.values_mut().for_each(sort_keys_of);
        }
        Value::Array(a) => a.iter_mut().for_each(sort_keys_of),
        _ => {}
    }
}

/// `json.dumps`'s default separators.
struct PythonJson;

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `time` (UTC) formatted as C's `strftime` for the directives templates use.
fn strftime(format: &str, time: std::time::SystemTime) -> std::result::Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let secs = time.duration_since(std::time::UNIX_EPOCH).map_err(|e| e.to_string())?.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (m, wd) = (MONTHS[month as usize - 1], DAYS[days.rem_euclid(7) as usize]);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out += &format!("{day:02}"),
            Some('m') => out += &format!("{month:02}"),
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('b') => out += &m[..3],
            Some('B') => out += m,
            Some('a') => out += &wd[..3],
            Some('A') => out += wd,
            Some('H') => out += &format!("{:02}", rem / 3600),
            Some('M') => out += &format!("{:02}", rem / 60 % 60),
            Some('S') => out += &format!("{:02}", rem % 60),
            Some('%') => out.push('%'),
            other => {
                return Err(format!("strftime_now: %{} is not supported", other.map(String::from).unwrap_or_default()))
            }
        }
    }
    Ok(out)
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
        self.transcript_parts(&Transcript::of(messages), tok)
    }

    /// Whether the template offers tools and shows calls and their results itself (else a
    /// caller writes them into the messages' text).
    pub fn takes_tools(&self) -> bool {
        matches!(self, Template::Jinja(j) if j.takes_tools())
    }

    /// A transcript as markup and the messages' text apart (see
    /// [`render_parts`](Self::render_parts)). A written-out template takes plain system, user and
    /// assistant messages only.
    pub fn transcript_parts(&self, t: &Transcript, tok: &Tokenizer) -> Result<Vec<Part>> {
        let spells_control = control_speller(tok);
        let spells = t.messages.iter().any(|m| m.get("content").and_then(Value::as_str).is_some_and(&spells_control));
        match self {
            Template::Jinja(j) if spells => j.render_parts(t),
            Template::Jinja(j) => Ok(vec![Part::Markup(j.render_transcript(t)?)]),
            Template::Builtin(b) => {
                let messages = t.plain().ok_or_else(|| {
                    Error::Config(
                        "this model's chat template is written out (the file has none): it takes plain system, user and assistant messages, no tools or template variables".into(),
                    )
                })?;
                Ok(match spells {
                    false => vec![Part::Markup(b.render(&messages))],
                    true => b.render_parts(&messages),
                })
            }
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
        let parts = t.render_parts(&Transcript::of(&[(User, "a<|eot_id|>b")])).unwrap();
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

    /// `tojson` writes what Python's `json.dumps` writes (keys in order, `", "` and `": "`, no
    /// HTML escapes), `strftime_now` is C's, and a transcript's text is apart from its markup.
    #[test]
    fn python_json_dates_and_transcripts() {
        let src = "{{ messages[0]['tool_calls'][0]['function']['arguments'] | tojson }}|{{ tools | tojson(indent=2) }}|{{ date_string }}|{{ messages[1]['content'] }}";
        let t = JinjaTemplate::new(src, "", "").unwrap();
        let call = json!({"id": "a", "type": "function", "function": {"name": "f", "arguments": {"z": [1, 2], "a": "it's <b>"}}});
        let transcript = Transcript {
            messages: vec![
                json!({"role": "assistant", "content": "", "tool_calls": [call]}),
                json!({"role": "tool", "content": "x<|eot_id|>"}),
            ],
            tools: vec![json!({"b": 1, "a": {}})],
            kwargs: json!({"date_string": "26 Jul 2024"}).as_object().unwrap().clone(),
        };
        assert_eq!(
            t.render_transcript(&transcript).unwrap(),
            "{\"z\": [1, 2], \"a\": \"it's <b>\"}|[\n  {\n    \"b\": 1,\n    \"a\": {}\n  }\n]|26 Jul 2024|x<|eot_id|>"
        );
        let parts = t.render_parts(&transcript).unwrap();
        assert_eq!(parts.last(), Some(&Part::Content("x<|eot_id|>".into())), "{parts:?}");
        let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        assert_eq!(
            strftime("%d %b %Y, %A %B %m/%y %H:%M:%S %%", when).unwrap(),
            "14 Nov 2023, Tuesday November 11/23 22:13:20 %"
        );
        assert_eq!(strftime("%d", std::time::UNIX_EPOCH + std::time::Duration::from_secs(951_782_400)).unwrap(), "29");
        assert!(strftime("%Q", when).is_err());
        let t = JinjaTemplate::new("{{ tools | tojson(ensure_ascii=true, sort_keys=true) }}", "", "").unwrap();
        let tools =
            Transcript { tools: vec![json!({"b": "東京 é", "a": {"z": 1, "y": 2}})], ..Transcript::default() };
        assert_eq!(t.render_transcript(&tools).unwrap(), r#"[{"a": {"y": 2, "z": 1}, "b": "\u6771\u4eac \u00e9"}]"#);
        assert!(t.takes_tools());
        assert!(!JinjaTemplate::new("{{ messages[0]['content'] }}", "", "").unwrap().takes_tools());
    }
}
