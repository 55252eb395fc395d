//! Chat templates: compiled once with minijinja and rendered the way transformers renders them
//! with jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`,
//! `strftime_now`, a Python `json.dumps`-style `tojson`, Python string methods, and Python's way
//! of printing `None`, booleans, lists and dicts; those Python pieces live in `pycompat`).

use std::collections::BTreeMap;

use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};

use super::config::TemplateSource;
use super::pycompat::{python_formatter, strftime_now, tojson_filter};
use super::{ChatMessage, TokenizerError};

/// Name under which the template used by default is stored.
pub(crate) const DEFAULT_TEMPLATE: &str = "default";

/// Extra inputs for [`super::Tokenizer::apply_chat_template_with`].
#[derive(Debug, Default, Clone, Copy)]
pub struct ChatTemplateOptions<'a> {
    /// Which named template to use (`None`: the default one).
    pub template_name: Option<&'a str>,
    /// Passed to the template as `tools` (transformers passes `None` when absent, and so do we).
    pub tools: Option<&'a serde_json::Value>,
    /// Passed to the template as `documents` (`None` when absent).
    pub documents: Option<&'a serde_json::Value>,
    /// Further template variables (for example `enable_thinking`); they override special token
    /// variables but not `messages`, `tools`, `documents` or `add_generation_prompt`.
    pub extra_context: Option<&'a serde_json::Map<String, serde_json::Value>>,
}

/// The error `raise_exception` raises; found again in the error chain after rendering.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// All chat templates of one tokenizer, compiled into one environment.
pub(crate) struct ChatTemplates {
    env: Environment<'static>,
    names: Vec<String>,
    /// The templates whose source mentions `tools`.
    tool_aware: Vec<String>,
    /// Special token strings (`bos_token`, ...) passed to every render.
    token_context: BTreeMap<String, Value>,
}

impl std::fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplates").field("names", &self.names).finish_non_exhaustive()
    }
}

impl ChatTemplates {
    /// Compiles every template; a syntax error names the file the template came from.
    pub(crate) fn compile(sources: Vec<TemplateSource>, token_context: BTreeMap<String, Value>) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson_filter);

        let mut names = Vec::with_capacity(sources.len());
        let mut tool_aware = Vec::new();
        for TemplateSource { name, source, path } in sources {
            let source = rewrite_generation_tags(&source);
            if source.contains("tools") && !tool_aware.contains(&name) {
                tool_aware.push(name.clone());
            }
            env.add_template_owned(name.clone(), source).map_err(|e| TokenizerError::TemplateSyntax {
                path: path.clone(),
                name: name.clone(),
                message: e.to_string(),
            })?;
            if !names.contains(&name) {
                names.push(name);
            }
        }
        Ok(Self { env, names, tool_aware, token_context })
    }

    /// Whether template `name` (`None`: the default) mentions the `tools` variable.
    pub(crate) fn reads_tools(&self, name: Option<&str>) -> bool {
        let name = name.unwrap_or(DEFAULT_TEMPLATE);
        self.tool_aware.iter().any(|n| n == name)
    }

    pub(crate) fn names(&self) -> &[String] {
        &self.names
    }

    pub(crate) fn has_default(&self) -> bool {
        self.names.iter().any(|n| n == DEFAULT_TEMPLATE)
    }

    pub(crate) fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool, options: &ChatTemplateOptions<'_>) -> Result<String, TokenizerError> {
        let name = match options.template_name {
            Some(name) => name,
            None if self.has_default() => DEFAULT_TEMPLATE,
            None => {
                return Err(TokenizerError::NoDefaultChatTemplate { available: self.names.clone() });
            }
        };
        let template = self.env.get_template(name).map_err(|_| TokenizerError::UnknownChatTemplate { name: name.to_owned(), available: self.names.clone() })?;

        let mut ctx = self.token_context.clone();
        if let Some(extra) = options.extra_context {
            for (key, value) in extra {
                ctx.insert(key.clone(), Value::from_serialize(value));
            }
        }
        let optional = |v: Option<&serde_json::Value>| v.map_or(Value::from(()), Value::from_serialize);
        ctx.insert("tools".into(), optional(options.tools));
        ctx.insert("documents".into(), optional(options.documents));
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));

        template.render(ctx).map_err(render_error)
    }
}

/// Turns a render failure into a tokenizer error, recognising `raise_exception`.
fn render_error(err: Error) -> TokenizerError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TokenizerError::TemplateException(raised.0.clone());
        }
        source = e.source();
    }
    TokenizerError::TemplateRender(err.to_string())
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// transformers' `{% generation %}...{% endgeneration %}` marks assistant text for masks; when
/// rendering a prompt it just renders its body. minijinja has no such tag, so it becomes
/// `{% if true %}...{% endif %}`, keeping any whitespace-control markers.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let inner = &tag[2..];
        let marker_len = usize::from(inner.starts_with(['-', '+']));
        let after_marker = &inner[marker_len..];
        let body = after_marker.trim_start();
        let word_len = body.find(|c: char| !c.is_ascii_alphanumeric() && c != '_').unwrap_or(body.len());
        let replacement = match &body[..word_len] {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(replacement) => {
                out.push_str("{%");
                out.push_str(&inner[..marker_len]);
                out.push(' ');
                out.push_str(replacement);
                rest = &body[word_len..];
            }
            None => {
                out.push_str("{%");
                rest = inner;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Renders a template source directly (no files); used by tests.
#[cfg(test)]
fn render_source(source: &str, messages: &[ChatMessage], extra: BTreeMap<String, Value>) -> Result<String, TokenizerError> {
    let templates = ChatTemplates::compile(
        vec![TemplateSource { name: DEFAULT_TEMPLATE.into(), source: source.into(), path: std::path::PathBuf::from("test.jinja") }],
        extra,
    )?;
    templates.render(messages, false, &ChatTemplateOptions::default())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::ChatTemplateOptions;
    use super::super::tests::{edited_copy, load, load_err};
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(role, content)
    }

    fn render(source: &str) -> String {
        match render_source(source, &[msg("user", "hi")], BTreeMap::new()) {
            Ok(s) => s,
            Err(e) => panic!("render of {source:?} failed: {e}"),
        }
    }

    #[test]
    fn raise_exception_becomes_template_exception() {
        let src = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversation must start with system') }}{% endif %}ok";
        let err = render_source(src, &[msg("user", "x")], BTreeMap::new()).err();
        match err {
            Some(TokenizerError::TemplateException(m)) => {
                assert_eq!(m, "Conversation must start with system")
            }
            other => panic!("expected TemplateException, got {other:?}"),
        }
        assert_eq!(render_source(src, &[msg("system", "x")], BTreeMap::new()).ok().as_deref(), Some("ok"));
    }

    #[test]
    fn other_render_errors_are_not_template_exceptions() {
        let err = render_source("{{ messages[0].content.nope() }}", &[msg("user", "x")], BTreeMap::new()).err();
        assert!(matches!(err, Some(TokenizerError::TemplateRender(_))), "{err:?}");
    }

    #[test]
    fn syntax_error_names_the_source_file() {
        let err = render_source("{% for m in messages %}", &[], BTreeMap::new()).err();
        match err {
            Some(e @ TokenizerError::TemplateSyntax { .. }) => {
                assert!(e.to_string().contains("test.jinja"), "{e}")
            }
            other => panic!("expected TemplateSyntax, got {other:?}"),
        }
    }

    #[test]
    fn trim_and_lstrip_blocks_like_transformers() {
        let src = "{% for m in messages %}\n    {% if true %}\n[{{ m.role }}]\n    {% endif %}\n{% endfor %}\n";
        // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it,
        // and the single trailing newline of the source is dropped (keep_trailing_newline=False).
        assert_eq!(render(src), "[user]\n");
    }

    #[test]
    fn loop_controls_and_pycompat_methods() {
        assert_eq!(render("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"), "02");
        assert_eq!(render("{{ '  x y  '.strip() }}|{{ 'abc'.startswith('ab') }}|{{ 'a,b'.split(',') }}|{{ 'Hi'.upper() }}"), "x y|True|['a', 'b']|HI");
        assert_eq!(render("{% for k, v in {'b': 1, 'a': 2}.items() %}{{ k }}{{ v }}{% endfor %}"), "b1a2");
    }

    #[test]
    fn python_style_printing() {
        assert_eq!(
            render("{{ none }}|{{ true }}|{{ false }}|{{ [1, 'x', none, 2.5] }}|{{ {'k': \"it's\"} }}"),
            "None|True|False|[1, 'x', None, 2.5]|{'k': \"it's\"}"
        );
        assert_eq!(render("{{ tools }}|{{ tools is none }}|{{ documents is none }}"), "None|True|True");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        // Python: json.dumps({"name": "f", "args": [1, 2.0, None, True], "s": "é<&>\"\n"}, ensure_ascii=False)
        assert_eq!(
            render(r#"{{ {"name": "f", "args": [1, 2.0, none, true], "s": "é<&>\"\n"} | tojson }}"#),
            r#"{"name": "f", "args": [1, 2.0, null, true], "s": "é<&>\"\n"}"#
        );
        assert_eq!(render("{{ {'a': [1, {}], 'b': []} | tojson(indent=2) }}"), "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
        assert_eq!(render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=[',', ':']) }}"), r#"{"a":2,"b":1}"#);
        assert_eq!(render("{{ 'é🙂' | tojson(ensure_ascii=true) }}"), r#""\u00e9\ud83d\ude42""#);
        assert_eq!(render("{{ [1e16, 1e-05, 0.0001, 123.5] | tojson }}"), "[1e+16, 1e-05, 0.0001, 123.5]");
        assert!(render_source("{{ nothing | tojson }}", &[], BTreeMap::new()).is_err());
    }

    #[test]
    fn tojson_keeps_message_field_order() {
        assert_eq!(render("{{ messages[0] | tojson }}"), r#"{"role": "user", "content": "hi"}"#);
    }

    #[test]
    fn generation_tags_render_their_body() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}{% endif %}"),
            "a{%- if true -%}b{% endif %}c{% if x %}{% endif %}"
        );
        assert_eq!(render("{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"), "<hi>");
    }

    #[test]
    fn strftime_now_is_available() {
        let now = render("{{ strftime_now('%Y') }}");
        assert!(now.len() == 4 && now.starts_with('2'), "{now}");
    }

    #[test]
    fn special_tokens_are_template_variables() {
        let mut ctx = BTreeMap::new();
        ctx.insert("bos_token".to_owned(), Value::from("<s>"));
        let out = render_source("{{ bos_token }}{{ eos_token }}{{ messages[0].content }}", &[msg("user", "x")], ctx);
        assert_eq!(out.ok().as_deref(), Some("<s>x"));
    }

    #[test]
    fn chat_template_file_and_named_templates() {
        let dir = edited_copy(|_, cfg| {
            cfg["chat_template"] = json!([
                {"name": "default", "template": "D{{ messages | length }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}"},
            ]);
        });
        let tok = load(&dir);
        let messages = [ChatMessage::new("user", "hi")];
        assert_eq!(tok.chat_template_names(), ["default", "tool_use"]);
        assert_eq!(tok.apply_chat_template(&messages, false).ok().as_deref(), Some("D1"));
        let tools = json!([{"type": "function"}, {"type": "function"}]);
        let options = ChatTemplateOptions { template_name: Some("tool_use"), tools: Some(&tools), ..Default::default() };
        assert_eq!(tok.apply_chat_template_with(&messages, false, &options).ok().as_deref(), Some("T2"));
        let options = ChatTemplateOptions { template_name: Some("nope"), ..Default::default() };
        assert!(matches!(tok.apply_chat_template_with(&messages, false, &options), Err(TokenizerError::UnknownChatTemplate { .. })));

        // chat_template.jinja takes precedence over the config key.
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ bos_token }}J{{ extra }}\n").expect("write");
        let tok = load(&dir);
        assert_eq!(tok.apply_chat_template(&messages, false).ok().as_deref(), Some("<s>J"));
        let mut extra = serde_json::Map::new();
        extra.insert("extra".into(), json!("!"));
        let options = ChatTemplateOptions { extra_context: Some(&extra), ..Default::default() };
        assert_eq!(tok.apply_chat_template_with(&messages, false, &options).ok().as_deref(), Some("<s>J!"));

        // Without any template.
        let dir = edited_copy(|_, cfg| {
            cfg.as_object_mut().map(|o| o.remove("chat_template"));
        });
        let tok = load(&dir);
        assert!(!tok.has_chat_template());
        assert!(matches!(tok.apply_chat_template(&messages, true), Err(TokenizerError::NoChatTemplate)));
    }

    #[test]
    fn raise_exception_from_config_template_is_an_error() {
        let dir = edited_copy(|_, cfg| {
            cfg["chat_template"] = json!(
                "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('Tool messages are not supported: ' + m['content']) }}{% endif %}{{ m['content'] }}{% endfor %}"
            );
        });
        let tok = load(&dir);
        let ok = tok.apply_chat_template(&[ChatMessage::new("user", "hi")], true);
        assert_eq!(ok.ok().as_deref(), Some("hi"));
        let err = tok.apply_chat_template(&[ChatMessage::new("tool", "x")], true);
        match err {
            Err(TokenizerError::TemplateException(m)) => {
                assert_eq!(m, "Tool messages are not supported: x")
            }
            other => panic!("expected TemplateException, got {other:?}"),
        }
        assert!(tok.encode_chat(&[ChatMessage::new("tool", "x")], true).is_err());
    }

    #[test]
    fn bad_template_fails_at_load_naming_the_file() {
        let dir = edited_copy(|_, cfg| cfg["chat_template"] = json!("{% for message in messages %}{{ message['content'] }"));
        let err = load_err(dir.path());
        assert!(matches!(err, TokenizerError::TemplateSyntax { .. }), "{err}");
        assert!(err.to_string().contains(&dir.path().join("tokenizer_config.json").display().to_string()), "{err}");

        let dir = edited_copy(|_, _| {});
        std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").expect("write");
        let err = load_err(dir.path());
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }
}
