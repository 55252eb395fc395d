//! Tool calls on the chat endpoint: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
//!
//! The tools reach the model through its chat template (the `tools` variable, and the
//! `tool_use` template where the tokenizer has one, as transformers does). A template that never
//! reads `tools` would drop them silently; for such a model the tools and the call format are
//! described in the system message instead.
//!
//! A call is written the way Hermes- and Qwen-style templates teach it:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call. Unless
//! `tool_choice` is `none`, the output is constrained by a grammar built from the tools: with
//! `auto` either free text (which may not open a call block) or calls, with `required` one or more
//! calls, with a named function one call of it; every call's arguments are generated under
//! that function's JSON schema (strictly: a schema the compiler cannot enforce whole is a 400), so
//! the `tool_calls` returned always parse and validate.

use serde_json::{Value, json};

use super::ApiError;
use crate::grammar::{GrammarSpec, compact_json};
use crate::tokenizer::{ChatMessage, ChatTemplateOptions, Marked, Tokenizer, TokenizerError};

/// The most tools one request may offer.
pub const MAX_TOOLS: usize = 128;
/// The most calls one answer may make (with parallel calls).
pub const MAX_PARALLEL_CALLS: usize = 16;
/// What opens and closes one call in the output.
pub const CALL_OPEN: &str = "<tool_call>\n";
pub const CALL_CLOSE: &str = "\n</tool_call>";

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::Invalid(msg.into())
}

/// What the model may or must do with the tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Answer in text; no call is read from the output.
    None,
    /// Text, or calls.
    Auto,
    /// One call or more.
    Required,
    /// One call of this function.
    Named(String),
}

#[derive(Debug, Clone, PartialEq)]
struct Function {
    name: String,
    parameters: Value,
}

/// A request's tools, checked.
#[derive(Debug, PartialEq)]
pub struct ToolSet {
    /// As sent, for the template.
    tools: Value,
    functions: Vec<Function>,
    pub choice: ToolChoice,
    parallel: bool,
}

/// One call read from the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments object as compact JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's shape, with a fresh id.
    pub fn to_json(&self) -> Value {
        json!({"id": crate::store::random_id("call"), "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// `text` as a Lark string literal (JSON's string syntax).
fn lark_string(text: &str) -> String {
    serde_json::Value::String(text.to_owned()).to_string()
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn choice_of(v: Option<&Value>, any_tools: bool) -> Result<ToolChoice, ApiError> {
    let shape = || invalid("`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    Ok(match v {
        None | Some(Value::Null) if any_tools => ToolChoice::Auto,
        None | Some(Value::Null) => ToolChoice::None,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(shape()),
        },
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(shape());
            }
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).ok_or_else(shape)?;
            ToolChoice::Named(name.to_owned())
        }
        Some(_) => return Err(shape()),
    })
}

impl ToolSet {
    /// Reads and checks the tool fields; `None` when the request offers no tools.
    pub fn parse(tools: Option<Vec<Value>>, choice: Option<&Value>, parallel: Option<bool>) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        let choice = choice_of(choice, !tools.is_empty())?;
        if tools.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(invalid("`tool_choice` names a call, but the request offers no `tools`")),
            };
        }
        if tools.len() > MAX_TOOLS {
            return Err(invalid(format!("at most {MAX_TOOLS} tools per request; given: {}", tools.len())));
        }
        let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(invalid(format!("`tools[{i}].type` must be \"function\"")));
            }
            let Some(Value::Object(f)) = tool.get("function") else {
                return Err(invalid(format!("`tools[{i}].function` must be an object with a `name`")));
            };
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if !valid_name(name) {
                let shown: String = name.chars().take(70).collect();
                return Err(invalid(format!("`tools[{i}].function.name` {shown:?} must be 1 to 64 letters, digits, `_` or `-`")));
            }
            if functions.iter().any(|g| g.name == name) {
                return Err(invalid(format!("two tools are named {name:?}")));
            }
            if f.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
                return Err(invalid(format!("`tools[{i}].function.description` must be a string")));
            }
            if f.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
                return Err(invalid(format!("`tools[{i}].function.strict` must be a boolean")));
            }
            // A function without parameters takes an empty object.
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => return Err(invalid(format!("`tools[{i}].function.parameters` must be a JSON schema object"))),
            };
            functions.push(Function { name: name.to_owned(), parameters });
        }
        if let ToolChoice::Named(name) = &choice
            && !functions.iter().any(|f| &f.name == name)
        {
            let shown: String = name.chars().take(70).collect();
            return Err(invalid(format!("`tool_choice` names {shown:?}, which is not among the `tools`")));
        }
        Ok(Some(Self { tools: Value::Array(tools), functions, choice, parallel: parallel.unwrap_or(true) }))
    }

    /// Whether calls are read from the output.
    pub fn calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The grammar the output must follow; `None` with `tool_choice: none`. Builds JSON text of
    /// every schema: CPU work for the blocking pool.
    ///
    /// Each function's call is a rule of its own whose arguments are its schema as a document
    /// of its own (`%json`), so that the schema's references (`#/$defs/...`, as pydantic writes
    /// them) resolve against the schema itself. With parallel calls, a newline after a complete
    /// call may open another call or end the answer: the grammar never holds a model that wrote
    /// the newline to a further call, and it ends after at most [`MAX_PARALLEL_CALLS`].
    pub fn grammar(&self) -> Result<Option<GrammarSpec>, ApiError> {
        let offered: Vec<&Function> = match &self.choice {
            ToolChoice::None => return Ok(None),
            ToolChoice::Auto | ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(name) => self.functions.iter().filter(|f| &f.name == name).collect(),
        };
        let refused = |e: String| invalid(format!("the tools' schemas are refused: {e}"));
        let open = lark_string(CALL_OPEN);
        let close = lark_string(CALL_CLOSE);
        let mut rules = String::new();
        let mut alternatives = Vec::with_capacity(offered.len());
        for (i, f) in offered.iter().enumerate() {
            let schema = compact_json(f.parameters.clone()).map_err(|e| refused(format!("`{}`: {e}", f.name)))?;
            let schema = serde_json::to_string(&schema).map_err(|e| refused(e.to_string()))?;
            // The name is letters, digits, `_` and `-` (checked): nothing to escape.
            let head = lark_string(&format!("{{\"name\": \"{}\", \"arguments\": ", f.name));
            rules.push_str(&format!("call_{i}: {open} {head} arguments_{i} \"}}\" {close}\narguments_{i}: %json {schema}\n"));
            alternatives.push(format!("call_{i}"));
        }
        let several = self.parallel && !matches!(self.choice, ToolChoice::Named(_));
        let calls = if several { format!("call (\"\\n\" call)~0..{} \"\\n\"?", MAX_PARALLEL_CALLS - 1) } else { "call \"\\n\"?".to_string() };
        let start = if self.choice == ToolChoice::Auto { "TEXT | calls" } else { "calls" };
        let lark = format!("start: {start}\ncalls: {calls}\ncall: {}\n{rules}TEXT: /(.|\\n)+/ & ~/<tool_call>(.|\\n)*/\n", alternatives.join(" | "));
        Ok(Some(GrammarSpec::Tools(lark)))
    }

    /// The calls in a generated text: `Some` when it is call blocks, one after another, of which
    /// at least one is whole (a last one cut short, by the token limit say, is left out, as is
    /// a newline after the last); `None` for text.
    pub fn read_calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        if !self.calls() {
            return None;
        }
        let mut rest = text;
        let mut calls = Vec::new();
        loop {
            let Some(body) = rest.strip_prefix(CALL_OPEN) else {
                // Past a whole call: the start of one more, cut short, or nothing.
                return (!calls.is_empty() && CALL_OPEN.starts_with(rest)).then_some(calls);
            };
            let Some(end) = body.find(CALL_CLOSE) else { return (!calls.is_empty()).then_some(calls) };
            let call: Value = serde_json::from_str(&body[..end]).ok()?;
            let name = call.get("name")?.as_str()?.to_owned();
            let arguments = serde_json::to_string(call.get("arguments")?).ok()?;
            calls.push(ToolCall { name, arguments });
            rest = &body[end + CALL_CLOSE.len()..];
            if rest.is_empty() {
                return Some(calls);
            }
            rest = rest.strip_prefix('\n')?;
        }
    }

    /// Whether `text` (a stream's first characters) may still become a call block.
    pub fn may_open_call(&self, text: &str) -> bool {
        self.calls() && (text.starts_with(CALL_OPEN) || CALL_OPEN.starts_with(text))
    }

    /// The system message's description of the tools, for a template that does not read them.
    fn describe(&self, tools: &Value) -> String {
        let mut text = String::from(
            "You can call functions. To call one, answer with only <tool_call>\n{\"name\": NAME, \"arguments\": ARGUMENTS}\n</tool_call>, \
             a block per call. The functions:\n",
        );
        if let Value::Array(tools) = tools {
            for t in tools {
                text.push_str(&t.get("function").map(Value::to_string).unwrap_or_default());
                text.push('\n');
            }
        }
        text
    }
}

/// A call's `arguments` as templates expect them: an object, not the JSON text OpenAI sends.
fn arguments_as_objects(messages: &mut [ChatMessage]) {
    for m in messages {
        for call in m.tool_calls.iter_mut().flatten() {
            if let Some(args) = call.get_mut("function").and_then(|f| f.get_mut("arguments"))
                && let Some(text) = args.as_str()
                && let Ok(parsed) = serde_json::from_str::<Value>(text)
            {
                *args = parsed;
            }
        }
    }
}

/// The chat's calls and tool results as text, for a template that knows nothing of tools.
fn calls_as_text(messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    messages
        .into_iter()
        .map(|m| {
            if let Some(calls) = &m.tool_calls {
                let mut content = m.content.clone();
                for c in calls {
                    let f = c.get("function").cloned().unwrap_or(Value::Null);
                    let field = |k: &str| f.get(k).map_or_else(|| "null".to_owned(), Value::to_string);
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("{CALL_OPEN}{{\"name\": {}, \"arguments\": {}}}{CALL_CLOSE}", field("name"), field("arguments")));
                }
                ChatMessage::new(m.role, content)
            } else if m.role == "tool" {
                ChatMessage::new("user", format!("<tool_response>\n{}\n</tool_response>", m.content))
            } else {
                m
            }
        })
        .collect()
}

/// Renders a chat for generation, with its tools (CPU work: the blocking pool). Special tokens'
/// strings in what the client sent are marked first, to be tokenized as text
/// ([`Tokenizer::encode_marked`]).
pub fn render(tokenizer: &Tokenizer, mut messages: Vec<ChatMessage>, tools: Option<&ToolSet>) -> Result<(String, Marked), TokenizerError> {
    arguments_as_objects(&mut messages);
    let mut tools_json = tools.map(|set| set.tools.clone());
    let marked = tokenizer.mark_special_strings(&mut messages, tools_json.as_mut());
    let Some(set) = tools else { return Ok((tokenizer.apply_chat_template(&messages, true)?, marked)) };
    let tools_json = tools_json.unwrap_or(Value::Null);
    if tokenizer.chat_template_reads_tools(true) {
        let options = ChatTemplateOptions { template_name: tokenizer.chat_template_for(true), tools: Some(&tools_json), ..Default::default() };
        return Ok((tokenizer.apply_chat_template_with(&messages, true, &options)?, marked));
    }
    let mut messages = calls_as_text(messages);
    if set.calls() {
        let described = set.describe(&tools_json);
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{described}", first.content);
            }
            _ => messages.insert(0, ChatMessage::new("system", described)),
        }
    }
    Ok((tokenizer.apply_chat_template(&messages, true)?, marked))
}

#[cfg(test)]
mod tests;
