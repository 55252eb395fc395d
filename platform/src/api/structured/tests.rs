//! The request fields that ask for structured output, in every spelling.

use serde_json::json;

use super::*;

fn msg(r: Result<Option<GrammarSpec>, ApiError>) -> String {
    r.expect_err("refused").to_string()
}

#[test]
fn openai_and_lorax_response_format() {
    assert_eq!(response_format(None).unwrap(), None);
    assert_eq!(response_format(Some(&json!({"type": "text"}))).unwrap(), None);
    assert_eq!(response_format(Some(&json!({"type": "json_object"}))).unwrap(), Some(GrammarSpec::JsonObject));
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    // Strict: enforced whole.
    let strict = response_format(Some(&json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}))).unwrap();
    assert_eq!(strict, Some(GrammarSpec::JsonSchema(schema.clone())));
    // Not strict: lenient.
    let Some(GrammarSpec::JsonSchema(lenient)) =
        response_format(Some(&json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))).unwrap()
    else {
        panic!("a schema")
    };
    assert_eq!(lenient["x-guidance"]["lenient"], json!(true));
    // LoRAX: a schema next to json_object, enforced.
    assert_eq!(response_format(Some(&json!({"type": "json_object", "schema": schema}))).unwrap(), Some(GrammarSpec::JsonSchema(schema.clone())));
    // A schema given as JSON text.
    assert_eq!(response_format(Some(&json!({"type": "json_object", "schema": schema.to_string()}))).unwrap(), Some(GrammarSpec::JsonSchema(schema.clone())));
    for (v, needle) in [
        (json!("json"), "must be an object"),
        (json!({}), "needs a string `type`"),
        (json!({"type": "yaml"}), "\"yaml\""),
        (json!({"type": "json_schema"}), "json_schema"),
        (json!({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}), "strict"),
        (json!({"type": "json_schema", "json_schema": {"schema": 5}}), "JSON schema"),
        (json!({"type": "json_object", "schema": "{not json"}), "not valid JSON"),
    ] {
        let m = msg(response_format(Some(&v)));
        assert!(m.contains(needle), "{v}: {m}");
    }
}

#[test]
fn vllm_structured_outputs_and_guided_fields() {
    let schema = json!({"type": "array", "items": {"type": "integer"}, "maxItems": 3});
    assert!(matches!(structured_outputs(Some(&json!({"json": schema}))).unwrap(), Some(GrammarSpec::JsonSchema(_))));
    assert_eq!(structured_outputs(Some(&json!({"regex": "[a-z]+"}))).unwrap(), Some(GrammarSpec::Regex("[a-z]+".into())));
    assert_eq!(structured_outputs(Some(&json!({"choice": ["yes", "no"]}))).unwrap(), Some(GrammarSpec::Choice(vec!["yes".into(), "no".into()])));
    assert_eq!(structured_outputs(Some(&json!({"grammar": "start: \"a\""}))).unwrap(), Some(GrammarSpec::Lark("start: \"a\"".into())));
    assert_eq!(structured_outputs(Some(&json!({"json_object": true, "backend": "xgrammar"}))).unwrap(), Some(GrammarSpec::JsonObject));
    assert_eq!(structured_outputs(Some(&json!({"regex": null, "json_object": false}))).unwrap(), None);
    let Some(GrammarSpec::JsonSchema(ws)) = structured_outputs(Some(&json!({"json_object": true, "whitespace_pattern": " ?"}))).unwrap() else {
        panic!("a schema")
    };
    assert_eq!(ws["x-guidance"]["whitespace_pattern"], json!(" ?"));
    for (v, needle) in [
        (json!({"regex": "a", "choice": ["b"]}), "give one constraint"),
        (json!({"choice": []}), "at least one"),
        (json!({"choice": ["a", ""]}), "empty string"),
        (json!({"choice": "a"}), "list of strings"),
        (json!({"structural_tag": "x"}), "structural_tag"),
        (json!({"backend": "magic", "regex": "a"}), "backend"),
        (json!({"regex": "a", "whitespace_pattern": " "}), "only to JSON"),
        (json!({"whitespace_pattern": " "}), "needs a JSON"),
        (json!(["regex"]), "must be an object"),
    ] {
        let m = msg(structured_outputs(Some(&v)));
        assert!(m.contains(needle), "{v}: {m}");
    }

    let g = Guided { regex: Some("[0-9]{3}".into()), ..Guided::default() };
    assert_eq!(guided(&g).unwrap(), Some(GrammarSpec::Regex("[0-9]{3}".into())));
    let g = Guided { json: Some(json!(schema.to_string())), backend: Some("outlines".into()), ..Guided::default() };
    assert!(matches!(guided(&g).unwrap(), Some(GrammarSpec::JsonSchema(_))));
    let g = Guided { regex: Some("a".into()), grammar: Some("start: \"a\"".into()), ..Guided::default() };
    assert!(msg(guided(&g)).contains("`guided_regex` and `guided_grammar`"));
    let g = Guided { choice: Some(vec!["a".repeat(3); MAX_CHOICES + 1]), ..Guided::default() };
    assert!(msg(guided(&g)).contains("at most"));
    let g = Guided { backend: Some("nope".into()), ..Guided::default() };
    assert!(msg(guided(&g)).contains("guided_decoding_backend"));
    assert_eq!(guided(&Guided::default()).unwrap(), None);
}
