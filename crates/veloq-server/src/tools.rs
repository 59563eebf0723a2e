//! OpenAI's tools, in the format of the model's family ([`ToolFormat`]): a template that takes
//! tools (Llama 3.1, Mistral, Qwen 2.5…) is given them, the calls and the results as they are;
//! for one that takes none, they are written in the Hermes format many fine-tunes are trained on
//! (the functions' signatures in the system turn, a call as
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, a result as a `<tool_response>` in a
//! user turn). A reply that starts with a call is returned as `tool_calls`; `tool_choice:
//! required` or a named function forces one call through the grammar, so its arguments always
//! parse and match the function's parameters.

use serde::Deserialize;
use serde_json::{json, Value};

use veloq_candle::grammar::{compact, Grammar};
use veloq_candle::model::Template;

use crate::api::ApiError;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One entry of `tools`.
#[derive(Deserialize, Debug, Clone)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Function,
}

/// A function the model may call. `strict` is type-checked and changes nothing: a forced call
/// always matches `parameters`.
#[derive(Deserialize, Debug, Clone)]
#[allow(dead_code)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
    pub strict: Option<bool>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or one function by name.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named {
        #[serde(rename = "type")]
        kind: String,
        function: Named,
    },
}

#[derive(Deserialize, Debug, Clone)]
pub struct Named {
    pub name: String,
}

/// A call the model made, as an assistant message's `function` or the server's answer carries it.
#[derive(Deserialize, Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// How a family writes a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call (Hermes, Qwen).
    Hermes,
    /// The reply is one `{"name": …, "parameters": {…}}` object (Llama 3.1's custom tools).
    Llama3,
    /// `[TOOL_CALLS]` (a control token, not in the text) then `[{"name": …, "arguments": {…}}, …]`
    /// (Mistral).
    Mistral,
}

impl ToolFormat {
    /// The format the model's template shows calls in: Mistral's and Llama 3's by their markup,
    /// else Hermes' (also what a template without tools is given).
    pub fn of(template: &Template) -> Self {
        match template {
            Template::Jinja(j) if j.takes_tools() && j.source().contains("[TOOL_CALLS]") => ToolFormat::Mistral,
            Template::Jinja(j) if j.takes_tools() && j.source().contains("<tool_call>") => ToolFormat::Hermes,
            Template::Jinja(j)
                if j.takes_tools()
                    && j.source().contains("<|start_header_id|>")
                    && j.source().contains("\"parameters\"") =>
            {
                ToolFormat::Llama3
            }
            _ => ToolFormat::Hermes,
        }
    }

    /// The key a call's arguments go under.
    fn arguments(self) -> &'static str {
        match self {
            ToolFormat::Llama3 => "parameters",
            ToolFormat::Hermes | ToolFormat::Mistral => "arguments",
        }
    }
}

/// What the model must or may do with the tools of one request.
#[derive(Clone, Debug, PartialEq)]
enum Mode {
    Auto,
    /// One call, to any of them.
    Required,
    /// One call, to this one.
    Named(String),
}

/// The tools of a request that uses them.
#[derive(Clone, Debug)]
pub struct Tools {
    functions: Vec<Function>,
    mode: Mode,
    format: ToolFormat,
}

impl Tools {
    /// The request's tools, or `None` when it offers none or says `"none"`; a 400 naming the
    /// field for anything malformed.
    pub fn of(
        tools: Option<&[Tool]>,
        choice: Option<&ToolChoice>,
        format: ToolFormat,
    ) -> Result<Option<Self>, ApiError> {
        let bad = |field: &'static str, why: String| ApiError::invalid(Some(field), why);
        let tools = tools.unwrap_or_default();
        let mut functions = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(bad("tools", format!("tools[{i}].type must be \"function\", got {:?}", t.kind)));
            }
            let f = &t.function;
            let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
            if f.name.is_empty() || f.name.len() > 64 || !f.name.chars().all(valid) {
                return Err(bad(
                    "tools",
                    format!("tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {:?}", f.name),
                ));
            }
            if functions.iter().any(|g: &Function| g.name == f.name) {
                return Err(bad("tools", format!("tools[{i}]: a second function named {:?}", f.name)));
            }
            if let Some(p) = &f.parameters {
                if !p.is_object() {
                    return Err(bad("tools", format!("tools[{i}].function.parameters must be a JSON Schema object")));
                }
            }
            functions.push(f.clone());
        }
        let mode = match choice {
            None => Mode::Auto,
            Some(ToolChoice::Mode(m)) => match m.as_str() {
                "none" => return Ok(None),
                "auto" => Mode::Auto,
                "required" => Mode::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!("tool_choice must be none, auto, required or a function, got {other:?}"),
                    ))
                }
            },
            Some(ToolChoice::Named { kind, function }) => {
                if kind != "function" {
                    return Err(bad("tool_choice", format!("tool_choice.type must be \"function\", got {kind:?}")));
                }
                if !functions.iter().any(|f| f.name == function.name) {
                    return Err(bad(
                        "tool_choice",
                        format!("tool_choice names {:?}, which is not in tools", function.name),
                    ));
                }
                Mode::Named(function.name.clone())
            }
        };
        if functions.is_empty() {
            return match mode {
                Mode::Auto => Ok(None),
                _ => Err(bad("tool_choice", "tool_choice asks for a call but tools is empty".into())),
            };
        }
        Ok(Some(Self { functions, mode, format }))
    }

    fn parameters(f: &Function) -> Value {
        f.parameters.clone().unwrap_or_else(|| json!({"type": "object"}))
    }

    /// The functions as OpenAI's `tools` entries, for a template that takes them.
    pub fn entries(&self) -> Vec<Value> {
        self.functions
            .iter()
            .map(|f| {
                let mut function = serde_json::Map::new();
                function.insert("name".into(), json!(f.name));
                if let Some(d) = &f.description {
                    function.insert("description".into(), json!(d));
                }
                function.insert("parameters".into(), Self::parameters(f));
                json!({"type": "function", "function": function})
            })
            .collect()
    }

    /// The system turn's text that offers the functions, in Hermes' words.
    pub fn system_text(&self) -> String {
        let signatures: Vec<String> = self
            .functions
            .iter()
            .map(|f| {
                json!({"type": "function", "function": {"name": f.name, "description": f.description,
                       "parameters": Self::parameters(f)}})
                .to_string()
            })
            .collect();
        format!(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
            signatures.join("\n")
        )
    }

    /// Whether the request forces one call (`required`, a named function).
    pub fn forces_call(&self) -> bool {
        self.mode != Mode::Auto
    }

    /// The grammar that forces one call (`required`, a named function), or `None` (`auto`).
    pub fn grammar(&self) -> Option<Grammar> {
        let allowed: Vec<&Function> = match &self.mode {
            Mode::Auto => return None,
            Mode::Required => self.functions.iter().collect(),
            Mode::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let arguments = self.format.arguments();
        let calls: Vec<Value> = allowed
            .iter()
            .map(|f| {
                json!({"type": "object", "additionalProperties": false, "required": ["name", arguments],
                       "properties": {"name": {"const": f.name}, arguments: Self::parameters(f)}})
            })
            .collect();
        let schema = compact(json!({"anyOf": calls}));
        Some(Grammar::Lark(match self.format {
            ToolFormat::Hermes => format!("start: \"{OPEN}\\n\" call \"\\n{CLOSE}\"\ncall: %json {schema}\n"),
            ToolFormat::Llama3 => format!("start: call\ncall: %json {schema}\n"),
            ToolFormat::Mistral => format!("start: \"[\" call \"]\"\ncall: %json {schema}\n"),
        }))
    }

    /// The calls of a reply that starts with one (after white space), in the format of the
    /// family; `None` when the reply is text or names a function not offered.
    pub fn parse(&self, text: &str) -> Option<Vec<Call>> {
        let text = text.trim_start();
        let calls = match self.format {
            ToolFormat::Hermes => Self::parse_hermes(text)?,
            ToolFormat::Llama3 => {
                let text = text.strip_prefix("<|python_tag|>").unwrap_or(text);
                vec![Self::call(&serde_json::from_str(text.trim_end()).ok()?, self.format.arguments())?]
            }
            ToolFormat::Mistral => {
                let text = text.strip_prefix("[TOOL_CALLS]").unwrap_or(text);
                let list: Vec<Value> = serde_json::from_str(text.trim_end()).ok()?;
                list.iter().map(|v| Self::call(v, self.format.arguments())).collect::<Option<Vec<_>>>()?
            }
        };
        let known = calls.iter().all(|c| self.functions.iter().any(|f| f.name == c.name));
        (known && !calls.is_empty()).then_some(calls)
    }

    /// A call object `{"name": …, <arguments>: {…} or "…"}`.
    fn call(v: &Value, arguments: &str) -> Option<Call> {
        let name = v.get("name")?.as_str()?;
        let arguments = match v.get(arguments).or_else(|| v.get("arguments")) {
            Some(Value::String(s)) => s.clone(),
            Some(a @ Value::Object(_)) => a.to_string(),
            None => "{}".to_string(),
            Some(_) => return None,
        };
        Some(Call { name: name.to_string(), arguments })
    }

    /// Every well-formed `<tool_call>` block of a reply that starts with one.
    fn parse_hermes(text: &str) -> Option<Vec<Call>> {
        let mut rest = text.strip_prefix(OPEN)?;
        let mut calls = Vec::new();
        loop {
            let (body, after) = rest.split_once(CLOSE).unwrap_or((rest, ""));
            calls.push(Self::call(&serde_json::from_str(body.trim()).ok()?, ToolFormat::Hermes.arguments())?);
            match after.trim_start().strip_prefix(OPEN) {
                Some(next) => rest = next,
                None => return Some(calls),
            }
        }
    }

    /// Whether a reply that begins with `text` may still turn out to be a call (a stream holds
    /// such text back until it knows).
    pub fn may_be_call(&self, text: &str) -> bool {
        let t = text.trim_start();
        let opens = |open: &str| t.starts_with(open) || open.starts_with(t);
        match self.format {
            ToolFormat::Hermes => opens(OPEN),
            ToolFormat::Llama3 => opens("{") || opens("<|python_tag|>"),
            ToolFormat::Mistral => opens("[") || opens("[TOOL_CALLS]"),
        }
    }
}

/// An assistant message's calls as the model writes them (what it is shown of its own turn).
pub fn calls_text(calls: &[Call]) -> String {
    calls
        .iter()
        .map(|c| {
            let arguments = serde_json::from_str::<Value>(&c.arguments).unwrap_or(Value::String(c.arguments.clone()));
            format!("{OPEN}\n{}\n{CLOSE}", json!({"name": c.name, "arguments": arguments}))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A tool's result as the model reads it, inside a user turn.
pub fn response_text(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Result<Option<Tools>, ApiError> {
        let t: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
        .unwrap();
        let c: Option<ToolChoice> = serde_json::from_value(choice).unwrap();
        Tools::of(Some(&t), c.as_ref(), ToolFormat::Hermes)
    }

    #[test]
    fn choices_decide_whether_and_which_call_is_forced() {
        assert!(tools(json!("none")).unwrap().is_none());
        assert_eq!(tools(json!(null)).unwrap().unwrap().grammar(), None);
        assert_eq!(tools(json!("auto")).unwrap().unwrap().grammar(), None);
        let Some(Grammar::Lark(g)) = tools(json!("required")).unwrap().unwrap().grammar() else { panic!() };
        assert!(g.contains("\"get_weather\"") && g.contains("\"now\"") && g.starts_with("start: \"<tool_call>"), "{g}");
        let named = json!({"type": "function", "function": {"name": "now"}});
        let Some(Grammar::Lark(g)) = tools(named).unwrap().unwrap().grammar() else { panic!() };
        assert!(g.contains("\"now\"") && !g.contains("get_weather"), "{g}");
        for (choice, says) in [
            (json!("sometimes"), "tool_choice must be"),
            (json!({"type": "function", "function": {"name": "nope"}}), "not in tools"),
        ] {
            let e = tools(choice).unwrap_err();
            assert!(e.status == 400 && e.message.contains(says), "{e:?}");
        }
        let e = Tools::of(Some(&[]), Some(&ToolChoice::Mode("required".into())), ToolFormat::Hermes).unwrap_err();
        assert!(e.message.contains("tools is empty"), "{e:?}");
        let bad: Vec<Tool> =
            serde_json::from_value(json!([{"type": "function", "function": {"name": "a b"}}])).unwrap();
        assert!(Tools::of(Some(&bad), None, ToolFormat::Hermes).unwrap_err().message.contains("function.name"));
    }

    #[test]
    fn calls_are_parsed_only_from_a_reply_that_starts_with_one() {
        let t = tools(json!("auto")).unwrap().unwrap();
        let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let got = t.parse(&format!("  {one}")).unwrap();
        assert_eq!(got, vec![Call { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }]);
        let two = format!("{one}\n<tool_call>{{\"name\": \"now\", \"arguments\": {{}}}}</tool_call>");
        assert_eq!(t.parse(&two).unwrap().len(), 2);
        // An unclosed last call at the end of the reply (cut by the end of sequence) still counts.
        assert_eq!(t.parse("<tool_call>{\"name\": \"now\"}").unwrap()[0].arguments, "{}");
        for text in [
            "It is sunny. <tool_call>{\"name\": \"now\"}</tool_call>",
            "<tool_call>{\"name\": \"launch\"}</tool_call>",
            "<tool_call>{\"name\": \"now\",</tool_call>",
            "plain text",
        ] {
            assert_eq!(t.parse(text), None, "{text}");
        }
        assert!(t.may_be_call(" <tool") && t.may_be_call("<tool_call>{\"na") && !t.may_be_call("Hi"));
        // What the model is shown of its own earlier call parses back to the same call.
        assert_eq!(t.parse(&calls_text(&got)).unwrap(), got);
    }

    /// Llama 3's reply is one `{"name", "parameters"}` object, Mistral's a list after
    /// `[TOOL_CALLS]`; a forced call's grammar spells each family's own form.
    #[test]
    fn llama3_and_mistral_calls() {
        let of = |format| {
            let t: Vec<Tool> = serde_json::from_value(json!([{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
            .unwrap();
            Tools::of(Some(&t), Some(&ToolChoice::Mode("required".into())), format).unwrap().unwrap()
        };
        let paris = vec![Call { name: "get_weather".into(), arguments: r#"{"city":"Paris"}"#.into() }];
        let llama = of(ToolFormat::Llama3);
        assert_eq!(llama.parse(r#" {"name": "get_weather", "parameters": {"city": "Paris"}}"#), Some(paris.clone()));
        assert_eq!(
            llama.parse(r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}"#),
            Some(paris.clone())
        );
        assert_eq!(llama.parse(r#"{"name": "launch", "parameters": {}}"#), None);
        assert_eq!(llama.parse("It is sunny."), None);
        assert!(llama.may_be_call(" {\"na") && !llama.may_be_call("It"));
        let Some(Grammar::Lark(g)) = llama.grammar() else { panic!() };
        assert!(g.starts_with("start: call\n") && g.contains("\"parameters\"") && !g.contains("\"arguments\""), "{g}");

        let mistral = of(ToolFormat::Mistral);
        let two = r#"[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}, {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}]"#;
        let got = mistral.parse(two).unwrap();
        assert_eq!((got.len(), &got[0]), (2, &paris[0]));
        assert_eq!(got[1].arguments, r#"{"city":"Rome"}"#);
        assert_eq!(mistral.parse(&format!("[TOOL_CALLS]{two}")).unwrap().len(), 2);
        assert_eq!(mistral.parse("[1, 2]"), None);
        assert_eq!(mistral.parse("[]"), None);
        assert!(mistral.may_be_call("[{") && mistral.may_be_call("[TOOL") && !mistral.may_be_call("Sure"));
        let Some(Grammar::Lark(g)) = mistral.grammar() else { panic!() };
        assert!(g.starts_with("start: \"[\" call \"]\"") && g.contains("\"arguments\""), "{g}");
    }
}
