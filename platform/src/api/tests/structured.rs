//! Structured output and tool calls through the HTTP routes, on the random-weight tiny model
//! (which never writes JSON on its own): every constrained output validates, in every spelling
//! the API accepts, with and without an adapter; refusals are 400s naming the problem; free
//! requests batched with constrained ones keep their tokens.

use actix_web::http::StatusCode;
use actix_web::test::{TestRequest, call_service, read_body};
use serde_json::{Value, json};

use super::adapters::{files, upload};
use super::*;
use crate::grammar::tests::schemas;

fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content: {v}"))
}

#[actix_web::test]
async fn every_constrained_output_validates_with_and_without_an_adapter() {
    let h = Harness::sqlite(settings()).await;
    let app = app!(h.state);
    let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
    let (config, weights) = files(&h.adapters(1, 5)[0]);
    let (status, _) = upload(&app, &key, &[("name", b"extract"), ("config", &config), ("weights", &weights)]).await;
    assert_eq!(status, StatusCode::CREATED);

    // Fifty-five schemas, through OpenAI's strict json_schema, half of them with the adapter,
    // all at once (so constrained rows share batches); sampled, seeded.
    let schemas = schemas();
    let requests = schemas.iter().enumerate().map(|(i, schema)| {
        let model = if i % 2 == 0 { MODEL } else { "extract" };
        let body = json!({
            "model": model, "messages": [{"role": "user", "content": format!("record {i}")}],
            "max_tokens": 480, "temperature": 1.0, "seed": i,
            "response_format": {"type": "json_schema", "json_schema": {"name": format!("s{i}"), "schema": schema, "strict": true}},
        });
        call(&app, "POST", "/v1/chat/completions", Some(&key), Some(body))
    });
    let answers = futures::future::join_all(requests).await;
    for ((status, v), schema) in answers.iter().zip(&schemas) {
        assert_eq!(*status, StatusCode::OK, "{schema}: {v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{schema}: {v}");
        let out: Value = serde_json::from_str(content(v)).unwrap_or_else(|e| panic!("{schema}: {e}: {v}"));
        let validator = jsonschema::validator_for(schema).unwrap();
        assert!(validator.is_valid(&out), "{schema}: {out}");
    }

    // JSON mode: any object.
    let (s, v) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        Some(&key),
        Some(json!({"model": "extract", "messages": [{"role": "user", "content": "x"}], "max_tokens": 480, "response_format": {"type": "json_object"}, "seed": 3, "temperature": 1.0})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(serde_json::from_str::<Value>(content(&v)).unwrap().is_object(), "{v}");

    // vLLM's fields on completions, greedy and with n > 1.
    let complete = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": "the answer is", "max_tokens": 64, "temperature": 0.9, "seed": 1, "n": 3});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        call(&app, "POST", "/v1/completions", Some(&key), Some(body))
    };
    let texts = |v: &Value| -> Vec<String> { v["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect() };
    let (s, v) = complete(json!({"guided_regex": "[A-Z]{2}-[0-9]{3}"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let rx = regex::Regex::new("^[A-Z]{2}-[0-9]{3}$").unwrap();
    assert!(texts(&v).iter().all(|t| rx.is_match(t)), "{v}");
    let (_, v) = complete(json!({"guided_choice": ["positive", "negative", "neutral"]})).await;
    assert!(texts(&v).iter().all(|t| ["positive", "negative", "neutral"].contains(&t.as_str())), "{v}");
    let (_, v) = complete(json!({"structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0})).await;
    assert!(texts(&v).iter().all(|t| t == "yes" || t == "no"), "{v}");
    let lark = "start: greeting \" \" name\ngreeting: \"hello\" | \"goodbye\"\nname: /[a-z]{1,8}/\n";
    let (s, v) = complete(json!({"structured_outputs": {"grammar": lark}})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let rx = regex::Regex::new("^(hello|goodbye) [a-z]{1,8}$").unwrap();
    assert!(texts(&v).iter().all(|t| rx.is_match(t)), "{v}");
    let schema =
        json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"], "additionalProperties": false});
    let (_, v) = complete(json!({"guided_json": schema, "max_tokens": 480})).await;
    for t in texts(&v) {
        assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&serde_json::from_str(&t).unwrap()), "{t}");
    }
    let (_, v) = complete(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, "max_tokens": 480})).await;
    for t in texts(&v) {
        assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&serde_json::from_str(&t).unwrap()), "{t}");
    }

    // LoRAX: a schema next to json_object, with the adapter, greedy and streamed.
    let lorax = json!({"inputs": "make a record", "parameters": {"adapter_id": "extract", "max_new_tokens": 480, "response_format": {"type": "json_object", "schema": schema}}});
    let (s, v) = call(&app, "POST", "/generate", Some(&key), Some(lorax.clone())).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let generated = v["generated_text"].as_str().unwrap().to_string();
    assert!(jsonschema::validator_for(&schema).unwrap().is_valid(&serde_json::from_str(&generated).unwrap()), "{generated}");
    let res = call_service(&app, TestRequest::post().uri("/generate_stream").insert_header(bearer(&key)).set_json(&lorax).to_request()).await;
    let events = sse_events(&read_body(res).await);
    let streamed: String = events.iter().filter_map(|e| e["token"]["text"].as_str()).filter(|t| !t.is_empty()).collect();
    assert!(streamed.starts_with(&generated), "{streamed:?} vs {generated:?}");
}

#[actix_web::test]
async fn refusals_are_400s_naming_the_problem() {
    let settings = ApiSettings { grammar: crate::grammar::GrammarLimits { max_spec_bytes: 4096, ..Default::default() }, ..settings() };
    let h = Harness::sqlite(settings).await;
    let app = app!(h.state);
    let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let unenforceable = json!({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}});
    let big = json!({"enum": (0..2000).map(|i| format!("value{i}")).collect::<Vec<_>>()});
    let weather = json!({"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}});
    let cases: Vec<(Value, &str)> = vec![
        (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unenforceable, "strict": true}}}), "propertyNames"),
        (json!({"guided_regex": "[a-z"}), "the regular expression is refused"),
        (json!({"structured_outputs": {"grammar": "start: missing_rule"}}), "the grammar is refused"),
        (json!({"guided_json": big}), "at most 4096 are accepted"),
        (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), "give one constraint"),
        (json!({"tools": [weather], "response_format": {"type": "json_object"}}), "cannot also constrain"),
        (json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "v"}}}), "not among the `tools`"),
        (json!({"tool_choice": "required"}), "offers no `tools`"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": unenforceable}}}}], "tool_choice": "required"}),
            "propertyNames",
        ),
        (json!({"response_format": {"type": "xml"}}), "response_format.type"),
    ];
    for (extra, needle) in cases {
        let (s, v) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(chat(extra.clone()))).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{extra}: {v}");
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(needle), "{extra}: {m:?} lacks {needle:?}");
    }
    // Not strict, the same schema is taken (the keyword llguidance cannot enforce is skipped).
    let lenient = chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unenforceable}}}));
    let (s, v) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(lenient)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // LoRAX refuses the same way, and the server still serves.
    let (s, v) = call(
        &app,
        "POST",
        "/generate",
        Some(&key),
        Some(json!({"inputs": "x", "parameters": {"response_format": {"type": "json_object", "schema": unenforceable}}})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, _) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(chat(json!({})))).await;
    assert_eq!(s, StatusCode::OK);
}

/// A free greedy request batched with constrained ones gets exactly the tokens it gets alone.
#[actix_web::test]
async fn free_requests_keep_their_tokens_beside_constrained_ones() {
    let h = Harness::sqlite(settings()).await;
    let app = app!(h.state);
    let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
    let free = json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": true});
    let (_, alone) = call(&app, "POST", "/v1/completions", Some(&key), Some(free.clone())).await;
    let constrained = (0..6).map(|i| {
        let body = json!({"model": MODEL, "prompt": format!("row {i}"), "max_tokens": 200, "temperature": 1.0, "seed": i, "guided_json": schemas()[20 + i]});
        call(&app, "POST", "/v1/completions", Some(&key), Some(body))
    });
    let (beside, _) = futures::future::join(call(&app, "POST", "/v1/completions", Some(&key), Some(free)), futures::future::join_all(constrained)).await;
    assert_eq!(beside.1["choices"][0]["text"], alone["choices"][0]["text"]);
}

#[actix_web::test]
async fn tool_calls_validate_and_stream() {
    let h = Harness::sqlite(settings()).await;
    let app = app!(h.state);
    let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
    let (config, weights) = files(&h.adapters(1, 6)[0]);
    let (status, _) = upload(&app, &key, &[("name", b"agent"), ("config", &config), ("weights", &weights)]).await;
    assert_eq!(status, StatusCode::CREATED);
    // Small: the tiny model's context is 512 tokens of a 512-token vocabulary.
    let order = json!({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 5},
    }, "required": ["id", "qty"], "additionalProperties": false});
    let city = json!({"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]});
    let tools = json!([
        {"type": "function", "function": {"name": "ship_order", "parameters": order, "strict": true}},
        {"type": "function", "function": {"name": "weather", "parameters": city}},
    ]);
    let validators = [("ship_order", jsonschema::validator_for(&order).unwrap()), ("weather", jsonschema::validator_for(&city).unwrap())];
    let ask = |model: &str, choice: Value, seed: u64, stream: bool| {
        json!({"model": model, "messages": [{"role": "user", "content": "ship it"}], "tools": tools, "tool_choice": choice,
               "max_tokens": 96, "temperature": 1.0, "seed": seed, "stream": stream, "parallel_tool_calls": false})
    };
    let check = |calls: &Value| {
        let calls = calls.as_array().unwrap();
        assert!(!calls.is_empty());
        for c in calls {
            assert_eq!(c["type"], "function");
            assert!(c["id"].as_str().unwrap().starts_with("call_"));
            let name = c["function"]["name"].as_str().unwrap();
            let args: Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            let (_, v) = validators.iter().find(|(n, _)| *n == name).unwrap();
            assert!(v.is_valid(&args), "{name}: {args}");
        }
        calls.len()
    };
    for (i, choice) in [json!("required"), json!({"type": "function", "function": {"name": "weather"}}), json!("required")].into_iter().enumerate() {
        for model in [MODEL, "agent"] {
            let (s, v) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(ask(model, choice.clone(), i as u64, false))).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            let message = &v["choices"][0]["message"];
            assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
            assert!(message["content"].is_null(), "{v}");
            let n = check(&message["tool_calls"]);
            if choice.is_object() {
                assert_eq!((n, message["tool_calls"][0]["function"]["name"].as_str()), (1, Some("weather")));
            }
            // Streamed: the same call (same seed), sent whole once the choice ends.
            let res = call_service(
                &app,
                TestRequest::post().uri("/v1/chat/completions").insert_header(bearer(&key)).set_json(ask(model, choice.clone(), i as u64, true)).to_request(),
            )
            .await;
            let events = sse_events(&read_body(res).await);
            let deltas: Vec<&Value> = events.iter().filter_map(|e| e["choices"].get(0)).collect();
            assert!(deltas.iter().all(|d| d["delta"]["content"].as_str().is_none_or(str::is_empty)), "no text: {events:?}");
            let last = deltas.last().unwrap();
            assert_eq!(last["finish_reason"], "tool_calls");
            let streamed = &last["delta"]["tool_calls"];
            assert_eq!(check(streamed), n);
            for (a, b) in streamed.as_array().unwrap().iter().zip(message["tool_calls"].as_array().unwrap()) {
                assert_eq!((&a["function"], a["index"].is_u64()), (&b["function"], true));
            }
        }
    }
    // Auto: text or calls, never a call that does not validate.
    for seed in 0..6 {
        let (s, v) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(ask("agent", json!("auto"), seed, false))).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let message = &v["choices"][0]["message"];
        match message.get("tool_calls") {
            Some(calls) => {
                check(calls);
            }
            None => assert!(!message["content"].as_str().unwrap().starts_with("<tool_call>"), "{v}"),
        }
    }
    // The conversation goes on: the call and its result come back as messages.
    let follow_up = json!({"model": "agent", "max_tokens": 8, "tools": tools, "tool_choice": "none", "messages": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees"},
    ]});
    let (s, v) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(follow_up)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string() && v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
}
