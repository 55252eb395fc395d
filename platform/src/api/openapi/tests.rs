//! Structural checks of the document: what a client generator or a fuzzer would trip over.

use std::collections::{BTreeSet, HashSet};

use serde_json::Value;

use super::{ROUTES, document};

const METHODS: [&str; 8] = ["get", "put", "post", "delete", "options", "head", "patch", "trace"];

fn doc() -> Value {
    document("0.0.0-test")
}

/// The value a local `$ref` (`#/a/b`) points at.
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    doc.pointer(reference.strip_prefix('#')?)
}

/// `value`, or what it refers to.
fn deref<'a>(doc: &'a Value, value: &'a Value) -> &'a Value {
    match value.get("$ref").and_then(Value::as_str) {
        Some(reference) => resolve(doc, reference).unwrap_or_else(|| panic!("unresolved {reference}")),
        None => value,
    }
}

/// Every `$ref` in `value`, with where it is.
fn refs(value: &Value, at: &str, out: &mut Vec<(String, String)>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if k == "$ref" {
                    out.push((at.to_string(), v.as_str().unwrap_or_else(|| panic!("{at}: $ref is not a string")).to_string()));
                } else {
                    refs(v, &format!("{at}/{k}"), out);
                }
            }
        }
        Value::Array(items) => items.iter().enumerate().for_each(|(i, v)| refs(v, &format!("{at}/{i}"), out)),
        _ => {}
    }
}

/// Every operation: (method, path, operation).
fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("a path item") {
            assert!(METHODS.contains(&method.as_str()), "{path}: {method} is not a method");
            out.push((method.clone(), path.clone(), op));
        }
    }
    out
}

#[test]
fn every_route_is_an_operation_with_responses() {
    let doc = doc();
    assert_eq!(doc["openapi"], "3.0.3");
    let ops = operations(&doc);
    assert_eq!(ops.len(), ROUTES.len(), "one operation per route");
    let mut ids = HashSet::new();
    for &(method, path, summary, scope) in ROUTES {
        let op = &doc["paths"][path][method];
        assert!(op.is_object(), "{method} {path} is missing");
        assert_eq!(op["summary"], summary);
        assert!(ids.insert(op["operationId"].as_str().expect("operationId").to_string()), "{method} {path}: duplicate operationId");
        let responses = op["responses"].as_object().unwrap_or_else(|| panic!("{method} {path} has no responses"));
        // Success is a 2xx, or for the redirects to the console a 302.
        assert!(responses.keys().any(|s| s.starts_with('2') || s == "302"), "{method} {path} documents no success");
        for (status, response) in responses {
            let code: u16 = status.parse().unwrap_or_else(|_| panic!("{method} {path}: status {status}"));
            assert!((200..600).contains(&code), "{method} {path}: status {status}");
            assert_ne!(code, 499, "{method} {path}: no client sees 499");
            let response = deref(&doc, response);
            assert!(response["description"].is_string(), "{method} {path} {status} has no description");
            if code >= 400 {
                // LoRAX's routes answer in LoRAX's shape.
                let schema = if path.starts_with("/generate") { "#/components/schemas/LoraxError" } else { "#/components/schemas/Error" };
                assert_eq!(response["content"]["application/json"]["schema"]["$ref"], schema, "{method} {path} {status}");
            }
            if code == 429 || code == 503 {
                assert_eq!(response["headers"]["Retry-After"]["required"], true, "{method} {path} {status} without Retry-After");
            }
            if code == 204 {
                assert!(response.get("content").is_none(), "{method} {path}: 204 has no body");
            }
            for (media, body) in response.get("content").and_then(Value::as_object).into_iter().flatten() {
                assert!(body["schema"].is_object(), "{method} {path} {status} {media} has no schema");
            }
        }
        let secured = op["security"].as_array().is_some_and(|s| !s.is_empty());
        assert_eq!(secured, scope != "none", "{method} {path}: security");
        if secured {
            assert_eq!(op["x-scope"], scope);
            for status in ["401", "403"] {
                assert!(responses.contains_key(status), "{method} {path} needs a key but does not document {status}");
            }
            for requirement in op["security"].as_array().into_iter().flatten() {
                for scheme in requirement.as_object().expect("a security requirement").keys() {
                    assert!(doc["components"]["securitySchemes"][scheme].is_object(), "{method} {path}: unknown security scheme {scheme}");
                }
            }
        }
        if let Some(body) = op.get("requestBody") {
            assert!(method != "get" && method != "delete", "{method} {path} has a body");
            assert!(responses.contains_key("400"), "{method} {path} takes a body but documents no 400");
            for (media, content) in body["content"].as_object().expect("requestBody content") {
                assert!(content["schema"].is_object(), "{method} {path} {media} has no schema");
            }
        }
    }
}

#[test]
fn every_ref_resolves() {
    let doc = doc();
    let mut all = Vec::new();
    refs(&doc, "#", &mut all);
    assert!(all.len() > 50, "{}", all.len());
    for (at, reference) in &all {
        assert!(reference.starts_with("#/components/"), "{at}: {reference} is not a local component");
        assert!(resolve(&doc, reference).is_some_and(Value::is_object), "{at}: {reference} does not resolve");
    }
    // And every component is used.
    let used: BTreeSet<&str> = all.iter().map(|(_, r)| r.as_str()).collect();
    for kind in ["schemas", "responses"] {
        for name in doc["components"][kind].as_object().expect("components").keys() {
            let reference = format!("#/components/{kind}/{name}");
            assert!(used.contains(reference.as_str()), "{reference} is never used");
        }
    }
}

#[test]
fn every_path_parameter_is_declared() {
    let doc = doc();
    for (method, path, op) in operations(&doc) {
        let in_path: BTreeSet<&str> = path.split('/').filter_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))).collect();
        let params: Vec<&Value> = op.get("parameters").and_then(Value::as_array).into_iter().flatten().map(|p| deref(&doc, p)).collect();
        let declared: BTreeSet<&str> = params.iter().filter(|p| p["in"] == "path").map(|p| p["name"].as_str().expect("a name")).collect();
        assert_eq!(in_path, declared, "{method} {path}");
        let mut seen = HashSet::new();
        for p in &params {
            let (name, place) = (p["name"].as_str().expect("a name"), p["in"].as_str().expect("in"));
            assert!(["path", "query", "header", "cookie"].contains(&place), "{method} {path}: {name} in {place}");
            assert!(seen.insert((name, place)), "{method} {path}: {name} declared twice");
            assert!(p["schema"].is_object(), "{method} {path}: {name} has no schema");
            if place == "path" {
                assert_eq!(p["required"], true, "{method} {path}: path parameter {name} must be required");
            }
        }
    }
}

/// Walks every schema object under `value`.
fn each_schema<'a>(value: &'a Value, at: &str, f: &mut dyn FnMut(&str, &'a Value)) {
    let Some(map) = value.as_object() else { return };
    f(at, value);
    for key in ["items", "additionalProperties", "x-contentSchema", "not"] {
        if let Some(v) = map.get(key) {
            each_schema(v, &format!("{at}/{key}"), f);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        for (i, v) in map.get(key).and_then(Value::as_array).into_iter().flatten().enumerate() {
            each_schema(v, &format!("{at}/{key}/{i}"), f);
        }
    }
    for (name, v) in map.get("properties").and_then(Value::as_object).into_iter().flatten() {
        each_schema(v, &format!("{at}/properties/{name}"), f);
    }
}

#[test]
fn schemas_are_consistent() {
    let doc = doc();
    for (name, schema) in doc["components"]["schemas"].as_object().expect("schemas") {
        each_schema(schema, name, &mut |at, s| {
            let properties = s.get("properties").and_then(Value::as_object);
            if let Some(required) = s.get("required") {
                assert!(required.as_array().is_some_and(|r| !r.is_empty()), "{at}: OpenAPI 3.0 wants `required` to list something");
            }
            for required in s.get("required").and_then(Value::as_array).into_iter().flatten() {
                let required = required.as_str().expect("a property name");
                assert!(properties.is_some_and(|p| p.contains_key(required)), "{at}: required {required} is not a property");
            }
            if let (Some(min), Some(max)) = (s.get("minimum").and_then(Value::as_f64), s.get("maximum").and_then(Value::as_f64)) {
                assert!(min <= max, "{at}: minimum {min} > maximum {max}");
            }
            if let Some(t) = s.get("type") {
                let t = t.as_str().expect("OpenAPI 3.0 types are strings");
                assert!(["object", "array", "string", "integer", "number", "boolean"].contains(&t), "{at}: type {t}");
                assert!(t != "array" || s.get("items").is_some(), "{at}: an array needs items");
            }
            if s.get("$ref").is_some() {
                assert_eq!(s.as_object().map(|m| m.len()), Some(1), "{at}: siblings of $ref are ignored in OpenAPI 3.0");
            }
        });
    }
    // The examples of request bodies name only their properties.
    for (method, path, op) in operations(&doc) {
        for content in op.get("requestBody").and_then(|b| b["content"].as_object()).into_iter().flatten().map(|(_, c)| c) {
            let schema = deref(&doc, &content["schema"]);
            let named = content.get("examples").and_then(Value::as_object).into_iter().flatten().map(|(_, e)| &e["value"]);
            for example in content.get("example").into_iter().chain(named) {
                let example = example.as_object().unwrap_or_else(|| panic!("{method} {path}: an example is not an object"));
                for key in example.keys() {
                    assert!(schema["properties"].get(key).is_some(), "{method} {path}: the example's {key} is not a property");
                }
                for required in schema["required"].as_array().into_iter().flatten() {
                    assert!(example.contains_key(required.as_str().unwrap_or_default()), "{method} {path}: an example lacks {required}");
                }
            }
        }
    }
}
