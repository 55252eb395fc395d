//! Structured output on the API: the fields that ask for it, in OpenAI's, vLLM's and LoRAX's
//! spellings, read into one [`GrammarSpec`], and the compile of that specification on the
//! blocking pool.
//!
//! - OpenAI `response_format`: `{"type": "text"}`, `{"type": "json_object"}`,
//!   `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`; LoRAX's
//!   `{"type": "json_object", "schema": {...}}` is read the same way (the schema enforced).
//! - vLLM `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object"}`,
//!   and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields.
//!
//! A request names at most one constraint. Grammars are Lark in llguidance's dialect. JSON
//! schemas not marked `strict` are compiled in llguidance's lenient mode (keywords it cannot
//! enforce are skipped); strict ones are enforced whole or refused with the keyword named.
//! What the compiler refuses, and specifications over the size cap, are 400s with its message.

use std::sync::Arc;

use serde_json::Value;

use super::tools::ToolSet;
use super::{ApiError, AppState};
use crate::grammar::{CompiledGrammar, GrammarCompiler, GrammarError, GrammarLimits, GrammarSpec};

/// The most strings a choice list may have.
pub const MAX_CHOICES: usize = 4096;

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::Invalid(msg.into())
}

/// The constraint fields of vLLM's older spelling, as sent.
#[derive(Debug, Default, Clone)]
pub struct Guided {
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub whitespace_pattern: Option<String>,
    pub backend: Option<String>,
}

/// The backends vLLM lets a request name; every one gets the same constraint here.
const BACKENDS: [&str; 6] = ["auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer"];

/// A JSON schema given as an object or as JSON text (vLLM accepts both).
fn schema_value(field: &str, v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::String(text) => serde_json::from_str(text).map_err(|e| invalid(format!("`{field}` is not valid JSON: {e}"))),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(invalid(format!("`{field}` must be a JSON schema (an object, or its JSON text)"))),
    }
}

fn choice(field: &str, items: &[String]) -> Result<GrammarSpec, ApiError> {
    if items.is_empty() {
        return Err(invalid(format!("`{field}` must list at least one string")));
    }
    if items.len() > MAX_CHOICES {
        return Err(invalid(format!("`{field}` may list at most {MAX_CHOICES} strings; given: {}", items.len())));
    }
    if items.iter().any(String::is_empty) {
        return Err(invalid(format!("`{field}` must not contain an empty string")));
    }
    Ok(GrammarSpec::Choice(items.to_vec()))
}

/// A JSON spec with vLLM's whitespace pattern, if one was given.
fn with_whitespace(spec: GrammarSpec, pattern: Option<&str>) -> Result<GrammarSpec, ApiError> {
    let Some(pattern) = pattern else { return Ok(spec) };
    match spec {
        GrammarSpec::JsonSchema(mut schema) => {
            let Value::Object(map) = &mut schema else { return Ok(GrammarSpec::JsonSchema(schema)) };
            if let Value::Object(options) = map.entry("x-guidance").or_insert_with(|| serde_json::json!({})) {
                options.insert("whitespace_pattern".into(), Value::String(pattern.to_owned()));
            }
            Ok(GrammarSpec::JsonSchema(schema))
        }
        GrammarSpec::JsonObject => with_whitespace(GrammarSpec::JsonSchema(serde_json::json!({"type": "object"})), Some(pattern)),
        _ => Err(invalid("a whitespace pattern applies only to JSON output")),
    }
}

/// OpenAI's (and LoRAX's) `response_format`; `None` for plain text.
pub fn response_format(v: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(map)) => map,
        Some(_) => return Err(invalid("`response_format` must be an object with a `type`")),
    };
    match map.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        // LoRAX sends its schema next to the type, and enforces it.
        Some("json_object") => match map.get("schema") {
            None | Some(Value::Null) => Ok(Some(GrammarSpec::JsonObject)),
            Some(s) => Ok(Some(GrammarSpec::json_schema(schema_value("response_format.schema", s)?, true))),
        },
        Some("json_schema") => {
            let Some(Value::Object(js)) = map.get("json_schema") else {
                return Err(invalid("`response_format.json_schema` must be an object with the `schema`"));
            };
            if js.get("name").is_some_and(|n| !n.is_string()) {
                return Err(invalid("`response_format.json_schema.name` must be a string"));
            }
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(invalid("`response_format.json_schema.strict` must be a boolean")),
            };
            // Without a schema, any JSON value.
            let schema = match js.get("schema") {
                None | Some(Value::Null) => serde_json::json!({}),
                Some(s) => schema_value("response_format.json_schema.schema", s)?,
            };
            Ok(Some(GrammarSpec::json_schema(schema, strict)))
        }
        Some(other) => {
            let shown: String = other.chars().take(40).collect();
            Err(invalid(format!("`response_format.type` must be one of text, json_object, json_schema; given: {shown:?}")))
        }
        None => Err(invalid("`response_format` needs a string `type`: text, json_object or json_schema")),
    }
}

/// vLLM's `structured_outputs` object.
pub fn structured_outputs(v: Option<&Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let map = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(map)) => map,
        Some(_) => return Err(invalid("`structured_outputs` must be an object")),
    };
    let mut found: Vec<(&'static str, GrammarSpec)> = Vec::new();
    let mut whitespace = None;
    for (key, value) in map {
        let field = |name: &str| format!("structured_outputs.{name}");
        match key.as_str() {
            "json" if !value.is_null() => found.push(("structured_outputs.json", GrammarSpec::json_schema(schema_value(&field("json"), value)?, false))),
            "regex" if !value.is_null() => {
                let rx = value.as_str().ok_or_else(|| invalid("`structured_outputs.regex` must be a string"))?;
                found.push(("structured_outputs.regex", GrammarSpec::Regex(rx.to_owned())));
            }
            "choice" if !value.is_null() => {
                let items: Vec<String> = serde_json::from_value(value.clone()).map_err(|_| invalid("`structured_outputs.choice` must be a list of strings"))?;
                found.push(("structured_outputs.choice", choice(&field("choice"), &items)?));
            }
            "grammar" if !value.is_null() => {
                let g = value.as_str().ok_or_else(|| invalid("`structured_outputs.grammar` must be a string"))?;
                found.push(("structured_outputs.grammar", GrammarSpec::Lark(g.to_owned())));
            }
            "json_object" => match value {
                Value::Bool(true) => found.push(("structured_outputs.json_object", GrammarSpec::JsonObject)),
                Value::Bool(false) | Value::Null => {}
                _ => return Err(invalid("`structured_outputs.json_object` must be a boolean")),
            },
            "whitespace_pattern" if !value.is_null() => {
                whitespace = Some(value.as_str().ok_or_else(|| invalid("`structured_outputs.whitespace_pattern` must be a string"))?.to_owned());
            }
            // JSON is generated without whitespace between tokens already; a fallback is never
            // taken (a refused schema is an error).
            "disable_any_whitespace" | "disable_fallback" if value.is_boolean() || value.is_null() => {}
            "backend" if value.is_null() || value.as_str().is_some_and(|b| BACKENDS.contains(&b)) => {}
            "json" | "regex" | "choice" | "grammar" | "whitespace_pattern" => {}
            other => {
                let shown: String = other.chars().take(40).collect();
                return Err(invalid(format!(
                    "`structured_outputs.{shown}` is not supported (or has the wrong type); give one of json, regex, choice, grammar, json_object"
                )));
            }
        }
    }
    let spec = one(found)?;
    match spec {
        Some(spec) => with_whitespace(spec, whitespace.as_deref()).map(Some),
        None if whitespace.is_some() => Err(invalid("`structured_outputs.whitespace_pattern` needs a JSON constraint")),
        None => Ok(None),
    }
}

/// vLLM's older `guided_*` fields.
pub fn guided(g: &Guided) -> Result<Option<GrammarSpec>, ApiError> {
    if let Some(b) = &g.backend
        && !BACKENDS.contains(&b.as_str())
    {
        let shown: String = b.chars().take(40).collect();
        return Err(invalid(format!("`guided_decoding_backend` {shown:?} is not one of {}", BACKENDS.join(", "))));
    }
    let mut found = Vec::new();
    if let Some(v) = g.json.as_ref().filter(|v| !v.is_null()) {
        found.push(("guided_json", GrammarSpec::json_schema(schema_value("guided_json", v)?, false)));
    }
    if let Some(rx) = &g.regex {
        found.push(("guided_regex", GrammarSpec::Regex(rx.clone())));
    }
    if let Some(items) = &g.choice {
        found.push(("guided_choice", choice("guided_choice", items)?));
    }
    if let Some(grammar) = &g.grammar {
        found.push(("guided_grammar", GrammarSpec::Lark(grammar.clone())));
    }
    match one(found)? {
        Some(spec) => with_whitespace(spec, g.whitespace_pattern.as_deref()).map(Some),
        None if g.whitespace_pattern.is_some() => Err(invalid("`guided_whitespace_pattern` needs `guided_json`")),
        None => Ok(None),
    }
}

/// At most one constraint, from whichever fields named one.
pub fn one(found: Vec<(&'static str, GrammarSpec)>) -> Result<Option<GrammarSpec>, ApiError> {
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.into_iter().next().map(|(_, spec)| spec)),
        _ => {
            let names: Vec<String> = found.iter().map(|(n, _)| format!("`{n}`")).collect();
            Err(invalid(format!("give one constraint on the output; this request gives {}", names.join(" and "))))
        }
    }
}

/// The grammar compiler for the served tokenizer, built on first use (it reads the whole
/// vocabulary: call it on the blocking pool).
fn compiler(state: &AppState) -> Result<Arc<GrammarCompiler>, GrammarError> {
    state.grammar.get_or_init(|| GrammarCompiler::new(state.tokenizer.clone(), &state.end_tokens, state.settings.grammar.clone()).map(Arc::new)).clone()
}

fn refused(e: GrammarError) -> ApiError {
    ApiError::Invalid(e.to_string())
}

/// What a request's output must follow, before it is compiled.
#[derive(Debug, Clone)]
pub enum GrammarSource {
    Spec(GrammarSpec),
    /// The grammar of the request's tools (built on the blocking pool).
    Tools(Arc<ToolSet>),
}

/// The checks made before a compile (size, then depth), for a constraint that is not compiled
/// now: a line of a batch's input file.
pub fn check(source: &GrammarSource, limits: &GrammarLimits) -> Result<(), ApiError> {
    let spec = match source {
        GrammarSource::Spec(spec) => std::borrow::Cow::Borrowed(spec),
        GrammarSource::Tools(tools) => match tools.grammar()? {
            Some(spec) => std::borrow::Cow::Owned(spec),
            None => return Ok(()),
        },
    };
    limits.check(&spec).map_err(refused)
}

/// Compiles the request's grammar (or takes it from the cache) on the grammar pool's deep
/// stacks; `None` when its tools constrain nothing (`tool_choice: none`). The size and depth
/// caps are checked first (the size here, before the job is queued; both again in the compiler);
/// llguidance's fuel bounds the compile's time and its state limits its memory.
pub async fn compile(state: &AppState, source: GrammarSource, tenant: &str) -> Result<Option<CompiledGrammar>, ApiError> {
    let max = state.settings.grammar.max_spec_bytes;
    if let GrammarSource::Spec(spec) = &source
        && spec.size() > max
    {
        return Err(refused(GrammarError::TooLarge { what: spec.kind(), size: spec.size(), max }));
    }
    let st = state.clone();
    let tenant = tenant.to_owned();
    state
        .grammars
        .run(move || {
            let spec = match source {
                GrammarSource::Spec(spec) => spec,
                GrammarSource::Tools(tools) => match tools.grammar()? {
                    Some(spec) => spec,
                    None => return Ok(None),
                },
            };
            compiler(&st).and_then(|c| c.compile_for(&spec, &tenant)).map(Some).map_err(refused)
        })
        .await?
}

#[cfg(test)]
mod tests;
