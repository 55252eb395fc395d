//! Inputs the grammar compiler recurses on: a JSON schema whose `$ref`s chain a thousand
//! definitions, a Lark grammar whose rules do, regular expressions nested deep, JSON nested past
//! what the parser takes. Each one, on every way in (OpenAI's `response_format`, vLLM's
//! `structured_outputs` and `guided_*`, LoRAX's parameters, tool parameters, a batch's input
//! file), is a 400 that names the limit, while another tenant's stream runs on to its end.

use std::sync::{Arc, Mutex};

use loraplex::bench::http::{Request, multipart};
use serde_json::{Value, json};

use super::common::*;

/// A schema whose `$ref`s chain `n` definitions.
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("A{i}"), json!({"$ref": format!("#/$defs/A{}", i + 1)}));
    }
    defs.insert(format!("A{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/A0", "$defs": defs})
}

/// A schema of objects whose one property refers to the next object, `n` deep.
fn property_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("A{i}"), json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/A{}", i + 1)}}}));
    }
    defs.insert(format!("A{n}"), json!({"type": "integer"}));
    json!({"$ref": "#/$defs/A0", "$defs": defs})
}

/// A Lark grammar of `n` rules, each naming the next.
fn rule_chain(n: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        g.push_str(&format!("r{i}: \"a\" r{} | \"b\"\n", i + 1));
    }
    g.push_str(&format!("r{n}: \"end\"\n"));
    g
}

/// The same with tokens.
fn token_chain(n: usize) -> String {
    let mut g = String::from("start: T0\n");
    for i in 0..n {
        g.push_str(&format!("T{i}: \"a\" T{} | \"b\"\n", i + 1));
    }
    g.push_str(&format!("T{n}: \"end\"\n"));
    g
}

/// (case, route, body, a string the 400 contains).
fn table() -> Vec<(String, &'static str, Value, &'static str)> {
    let deep = ref_chain(1500);
    let props = property_chain(700);
    let rules = rule_chain(1500);
    let tokens = token_chain(1500);
    let nested_regex = format!("{}a{}", "(".repeat(1500), ")".repeat(1500));
    let lib_regex = format!("{}a{}", "(".repeat(400), ")".repeat(400));
    let embedded = format!("start: \"x\" j\nj: %json {}\n", ref_chain(1500));
    let m = MODEL;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let (cmp, chat) = ("/v1/completions", "/v1/chat/completions");
    let deep_enough = "levels deep";
    let mut out = Vec::new();
    let mut c = |name: &str, route, body, needle| out.push((name.to_string(), route, body, needle));
    for (what, schema) in [("a $ref chain", &deep), ("a property chain", &props)] {
        c(
            &format!("response_format json_schema, {what}"),
            chat,
            json!({"model": m, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
            deep_enough,
        );
        c(
            &format!("response_format json_schema strict, {what}"),
            chat,
            json!({"model": m, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            deep_enough,
        );
        c(
            &format!("response_format json_object with a schema (LoRAX's), {what}"),
            chat,
            json!({"model": m, "messages": msgs, "response_format": {"type": "json_object", "schema": schema}}),
            deep_enough,
        );
        c(&format!("guided_json, {what}"), cmp, json!({"model": m, "prompt": "x", "guided_json": schema}), deep_enough);
        c(&format!("guided_json as text, {what}"), cmp, json!({"model": m, "prompt": "x", "guided_json": schema.to_string()}), deep_enough);
        c(&format!("structured_outputs.json, {what}"), cmp, json!({"model": m, "prompt": "x", "structured_outputs": {"json": schema}}), deep_enough);
        c(
            &format!("structured_outputs.json on chat, {what}"),
            chat,
            json!({"model": m, "messages": msgs, "structured_outputs": {"json": schema}}),
            deep_enough,
        );
        c(
            &format!("lorax generate, {what}"),
            "/generate",
            json!({"inputs": "x", "parameters": {"response_format": {"type": "json_object", "schema": schema}}}),
            deep_enough,
        );
        c(
            &format!("lorax generate_stream, {what}"),
            "/generate_stream",
            json!({"inputs": "x", "parameters": {"response_format": {"type": "json_object", "schema": schema}}}),
            deep_enough,
        );
    }
    for (what, grammar) in [("a rule chain", &rules), ("a token chain", &tokens), ("a $ref chain inside Lark", &embedded)] {
        c(&format!("guided_grammar, {what}"), cmp, json!({"model": m, "prompt": "x", "guided_grammar": grammar}), deep_enough);
        c(&format!("structured_outputs.grammar, {what}"), cmp, json!({"model": m, "prompt": "x", "structured_outputs": {"grammar": grammar}}), deep_enough);
        c(&format!("guided_grammar on chat, {what}"), chat, json!({"model": m, "messages": msgs, "guided_grammar": grammar}), deep_enough);
    }
    c("guided_regex nested past the limit", cmp, json!({"model": m, "prompt": "x", "guided_regex": nested_regex}), deep_enough);
    c("structured_outputs.regex nested past the limit", cmp, json!({"model": m, "prompt": "x", "structured_outputs": {"regex": nested_regex}}), deep_enough);
    c("guided_regex nested past the regex parser's own limit", cmp, json!({"model": m, "prompt": "x", "guided_regex": lib_regex}), "nest");
    out
}

/// A JSON body nested `n` arrays deep inside a schema.
fn nested_body(n: usize) -> String {
    format!("{{\"model\": \"{MODEL}\", \"prompt\": \"x\", \"guided_json\": {{\"enum\": {}1{}}}}}", "[".repeat(n), "]".repeat(n))
}

#[test]
fn deep_specifications_are_refused_on_every_route_while_another_tenants_stream_runs_on() {
    for db in databases() {
        let env = Env::start(&db, &[]);
        let (_, attacker) = env.tenant("attacker", json!({}));
        let (_, bystander) = env.tenant("bystander", json!({}));
        let mut cases = Cases::default();
        // The bystander's stream, started first: every token, and its end.
        let events: Arc<Mutex<Vec<String>>> = Arc::default();
        let stream = {
            let (client, key, events) = (env.http.clone(), bystander.clone(), events.clone());
            std::thread::spawn(move || {
                let body = json!({"model": MODEL, "prompt": "a long answer", "max_tokens": 300, "ignore_eos": true, "stream": true,
                    "stream_options": {"include_usage": true}})
                .to_string();
                client.stream(&Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes()), |data, _| {
                    events.lock().unwrap().push(data.to_string());
                    true
                })
            })
        };
        env.wait_for("the bystander's first token", 60, || !events.lock().unwrap().is_empty());
        for (name, route, body, needle) in table() {
            let res = env.call(Some(&attacker), "POST", route, Some(body));
            cases.check(&name, &res, 400, needle);
            if needle == "levels deep" {
                cases.ok(&format!("{name}: names the limit"), res.text().contains("at most 1000"), res.text());
            }
        }
        for n in [130, 5000] {
            let body = nested_body(n);
            let res = env.http.send(&Request::new("POST", "/v1/completions").key(&attacker).body("application/json", body.as_bytes())).unwrap();
            cases.check(&format!("JSON nested {n} deep"), &res, 400, "recursion limit");
        }
        // A batch's input file with such a line is refused at upload, naming the line.
        let line = |id: &str, body: Value| json!({"custom_id": id, "method": "POST", "url": "/v1/completions", "body": body}).to_string();
        let file = [
            line("fine", json!({"model": MODEL, "prompt": "x", "max_tokens": 2})),
            line("deep-schema", json!({"model": MODEL, "prompt": "x", "guided_json": ref_chain(1500)})),
            line("deep-grammar", json!({"model": MODEL, "prompt": "x", "guided_grammar": rule_chain(1500)})),
        ]
        .join("\n");
        let (ctype, form) = multipart(&[("purpose", b"batch"), ("file", file.as_bytes())]);
        let res = env.http.send(&Request::new("POST", "/v1/files").key(&attacker).body(&ctype, &form)).unwrap();
        cases.check("a batch file with deep lines", &res, 400, "levels deep");
        let lines: Vec<Value> = res.json()["error"]["lines"].as_array().cloned().unwrap_or_default();
        let named: Vec<&str> = lines.iter().filter_map(|l| l["custom_id"].as_str()).collect();
        cases.ok("the batch file's refusal names both deep lines", named == ["deep-schema", "deep-grammar"], format!("{lines:?}"));

        let (status, _) = stream.join().unwrap().unwrap();
        let events = events.lock().unwrap().clone();
        let usage = events.iter().rev().find_map(|e| serde_json::from_str::<Value>(e).ok().filter(|v| v["usage"].is_object()));
        let tokens = usage.as_ref().and_then(|u| u["usage"]["completion_tokens"].as_u64()).unwrap_or(0);
        cases.ok("the bystander's stream answered 200", status == 200, status);
        cases.ok("the bystander's stream ran to its end", events.last().map(String::as_str) == Some("[DONE]"), format!("{:?}", events.last()));
        cases.ok("the bystander got all 300 tokens", tokens == 300, tokens);
        cases.check("the attacker is still served", &env.complete(&attacker, MODEL, 2), 200, "choices");
        let shallow = json!({"model": MODEL, "prompt": "x", "max_tokens": 8, "guided_json": ref_chain(40)});
        cases.check("a schema within the limit still compiles", &env.call(Some(&attacker), "POST", "/v1/completions", Some(shallow)), 200, "choices");
        cases.finish(&format!("deep inputs on {}", env.kind()));
    }
}

/// A tiny model whose context holds a prompt of tens of thousands of tokens: a tool's
/// parameters reach the model's prompt (its template renders them), so only a long context lets
/// a deep schema get as far as the grammar compiler.
fn long_context_model(dir: &std::path::Path) {
    use loraplex::synth::{FileDType, Preset, SynthOptions, synthesize_model};
    synthesize_model(&SynthOptions { out: dir.to_path_buf(), preset: Preset::Tiny, seed: 3, dtype: FileDType::F32, kv_heads: None }).unwrap();
    for (file, key) in [("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")] {
        let path = dir.join(file);
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        v[key] = json!(131072);
        std::fs::write(&path, v.to_string()).unwrap();
    }
}

#[test]
fn deep_tool_parameters_are_refused_before_compiling_and_the_server_keeps_serving() {
    let model = tempfile::tempdir().unwrap();
    long_context_model(model.path());
    let model_dir = model.path().display().to_string();
    let env = Env::start(&Db::Sqlite, &["--model", &model_dir, "--served-model-name", MODEL]);
    let (_, key) = env.tenant("attacker", json!({}));
    let mut cases = Cases::default();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for (what, schema) in [("a $ref chain", ref_chain(1100)), ("a property chain", property_chain(400))] {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": schema}}]);
        for (how, choice) in [("auto", json!("auto")), ("required", json!("required")), ("named", json!({"type": "function", "function": {"name": "f"}}))] {
            let body = json!({"model": MODEL, "messages": msgs, "tools": tools, "tool_choice": choice, "max_tokens": 4});
            let res = env.call(Some(&key), "POST", "/v1/chat/completions", Some(body));
            cases.check(&format!("tool parameters ({how}), {what}"), &res, 400, "levels deep");
        }
    }
    cases.check("still serving", &env.complete(&key, MODEL, 2), 200, "choices");
    cases.finish("deep tool parameters");
}
