//! Inference through the OpenAI and LoRAX endpoints: shapes, parameters, streams, limits and
//! bad input.

use super::*;

#[actix_web::test]
async fn completions_in_every_prompt_form_agree() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let ask = |prompt: Value| json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
        let (status, one) = call(&app, "POST", "/v1/completions", Some(&key), Some(ask(json!("hello world")))).await;
        assert_eq!(status, StatusCode::OK, "{one}");
        assert_eq!(one["object"], "text_completion");
        assert!(one["id"].as_str().unwrap().starts_with("cmpl-"));
        let text = one["choices"][0]["text"].as_str().unwrap().to_string();
        assert_eq!(one["choices"][0]["finish_reason"], "length");
        let usage = &one["usage"];
        assert_eq!(usage["completion_tokens"], 6);
        let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
        assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt_tokens + 6);
        assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());

        // The same prompt as token ids, and inside lists: the same greedy text.
        let ids = h.state.tokenizer.encode("hello world", true).unwrap();
        assert_eq!(ids.len() as u64, prompt_tokens);
        let (_, by_ids) = call(&app, "POST", "/v1/completions", Some(&key), Some(ask(json!(ids)))).await;
        assert_eq!(by_ids["choices"][0]["text"], text.as_str());
        let (_, many) = call(&app, "POST", "/v1/completions", Some(&key), Some(ask(json!(["hello world", "another prompt"])))).await;
        assert_eq!(many["choices"].as_array().unwrap().len(), 2);
        assert_eq!(many["choices"][0]["text"], text.as_str());
        assert_eq!(many["choices"][1]["index"], 1);
        assert_eq!(many["usage"]["completion_tokens"], 12);
        let (_, lists) = call(&app, "POST", "/v1/completions", Some(&key), Some(ask(json!([ids, ids])))).await;
        assert_eq!(lists["choices"][1]["text"], text.as_str());

        // n samples with a seed: reproducible, and each sample has its own index.
        let sampled = json!({"model": MODEL, "prompt": "hello", "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 7, "top_k": 20, "ignore_eos": true});
        let (_, a) = call(&app, "POST", "/v1/completions", Some(&key), Some(sampled.clone())).await;
        let (_, b) = call(&app, "POST", "/v1/completions", Some(&key), Some(sampled)).await;
        assert_eq!(a["choices"], b["choices"]);
        assert_eq!(a["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(a["usage"]["completion_tokens"], 15);

        // Logprobs: one entry per token, with the asked number of alternatives.
        let (_, lp) = call(
            &app,
            "POST",
            "/v1/completions",
            Some(&key),
            Some(json!({"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": true})),
        )
        .await;
        let l = &lp["choices"][0]["logprobs"];
        assert_eq!(l["tokens"].as_array().unwrap().len(), 3);
        assert!(l["token_logprobs"][0].as_f64().unwrap() <= 0.0);
        assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2);
        assert_eq!(l["text_offset"][0], 0);

        // A stop string cuts the text before it.
        let cut: String = text.chars().skip(2).take(2).collect();
        if !cut.is_empty() && !cut.contains('\u{fffd}') {
            let (_, stopped) = call(
                &app,
                "POST",
                "/v1/completions",
                Some(&key),
                Some(json!({"model": MODEL, "prompt": "hello world", "max_tokens": 6, "temperature": 0, "stop": [cut.clone()], "ignore_eos": true})),
            )
            .await;
            let got = stopped["choices"][0]["text"].as_str().unwrap();
            assert!(!got.contains(&cut) && text.starts_with(got), "{got:?} vs {text:?} stop {cut:?}");
            assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
        }
    }
}

#[actix_web::test]
async fn streams_carry_the_same_tokens_and_end_with_usage_and_done() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let body = json!({"model": MODEL, "prompt": "stream me", "max_tokens": 7, "temperature": 0, "ignore_eos": true});
        let (_, whole) = call(&app, "POST", "/v1/completions", Some(&key), Some(body.clone())).await;
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let res = call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&streamed).to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers().get("content-type").unwrap(), "text/event-stream");
        let events = sse_events(&read_body(res).await);
        assert_eq!(events.last().unwrap(), "[DONE]");
        let usage = &events[events.len() - 2]["usage"];
        assert_eq!(usage["completion_tokens"], 7);
        assert_eq!(usage["prompt_tokens"], whole["usage"]["prompt_tokens"]);
        let text: String = events.iter().filter_map(|e| e["choices"].get(0)).map(|c| c["text"].as_str().unwrap()).collect();
        assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
        assert_eq!(events[events.len() - 3]["choices"][0]["finish_reason"], "length");

        // Chat: the role first, then content deltas, then usage.
        let chat = json!({"model": MODEL, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4, "temperature": 0, "ignore_eos": true});
        let (status, reply) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(chat.clone())).await;
        assert_eq!(status, StatusCode::OK, "{reply}");
        assert_eq!(reply["object"], "chat.completion");
        assert_eq!(reply["choices"][0]["message"]["role"], "assistant");
        assert_eq!(reply["usage"]["completion_tokens"], 4);
        let mut streamed = chat;
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let res = call_service(&app, TestRequest::post().uri("/v1/chat/completions").insert_header(bearer(&key)).set_json(&streamed).to_request()).await;
        let events = sse_events(&read_body(res).await);
        assert_eq!(events[0]["object"], "chat.completion.chunk");
        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = events.iter().filter_map(|e| e["choices"].get(0)).filter_map(|c| c["delta"]["content"].as_str()).collect();
        assert_eq!(text, reply["choices"][0]["message"]["content"].as_str().unwrap());
        assert_eq!(events[events.len() - 2]["usage"]["completion_tokens"], 4);
        assert_eq!(events.last().unwrap(), "[DONE]");

        // Without include_usage, chunks carry no usage at all.
        let mut plain = body;
        plain["stream"] = json!(true);
        let res = call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&plain).to_request()).await;
        let events = sse_events(&read_body(res).await);
        assert!(events.iter().all(|e| e.get("usage").is_none()));
    }
}

#[actix_web::test]
async fn lorax_generate_and_stream() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let body = json!({"inputs": "hello", "parameters": {"max_new_tokens": 5, "details": true, "ignore_eos_token": true, "return_k_alternatives": 2}});
        let res = call_service(&app, TestRequest::post().uri("/generate").insert_header(bearer(&key)).set_json(&body).to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
        let header = |name: &str| res.headers().get(name).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(header("x-adapter-id").as_deref(), Some(MODEL));
        assert_eq!(header("x-generated-tokens").as_deref(), Some("5"));
        let prompt_tokens = header("x-prompt-tokens").unwrap();
        let out: Value = read_body_json(res).await;
        let d = &out["details"];
        assert_eq!(d["finish_reason"], "length");
        assert_eq!(d["generated_tokens"], 5);
        assert_eq!(d["prompt_tokens"].to_string(), prompt_tokens);
        assert_eq!(d["tokens"].as_array().unwrap().len(), 5);
        assert_eq!(d["tokens"][0]["alternative_tokens"].as_array().unwrap().len(), 2);
        let text: String = d["tokens"].as_array().unwrap().iter().map(|t| t["text"].as_str().unwrap()).collect();
        assert_eq!(out["generated_text"].as_str().unwrap(), text);

        // The stream: one event per token, the last with the text and details; greedy by default.
        let res = call_service(&app, TestRequest::post().uri("/generate_stream").insert_header(bearer(&key)).set_json(&body).to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
        let events = sse_events(&read_body(res).await);
        assert_eq!(events.len(), 5);
        assert!(events[..4].iter().all(|e| e["generated_text"].is_null() && e["details"].is_null()));
        assert_eq!(events[4]["generated_text"], out["generated_text"]);
        assert_eq!(events[4]["details"]["generated_tokens"], 5);

        // return_full_text puts the input first.
        let full = json!({"inputs": "hello", "parameters": {"max_new_tokens": 5, "return_full_text": true, "ignore_eos_token": true}});
        let (_, f) = call(&app, "POST", "/generate", Some(&key), Some(full)).await;
        assert_eq!(f["generated_text"].as_str().unwrap(), format!("hello{}", out["generated_text"].as_str().unwrap()));
    }
}

#[actix_web::test]
async fn bad_inference_requests_get_a_clear_4xx_and_the_server_keeps_serving() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let (other_id, other) = tenant(&app, &h.admin, json!({"name": "other"})).await;
        let _ = other_id;
        let cases: Vec<(Value, StatusCode, &str)> = vec![
            (json!({"model": MODEL}), StatusCode::BAD_REQUEST, "missing field `prompt`"),
            (json!({"model": MODEL, "prompt": "x", "max_tokens": "many"}), StatusCode::BAD_REQUEST, "invalid type"),
            (json!({"model": MODEL, "prompt": "x", "temperature": 2.5}), StatusCode::BAD_REQUEST, "between 0 and 2"),
            (json!({"model": MODEL, "prompt": "x", "functions": [{"name": "f"}]}), StatusCode::BAD_REQUEST, "`functions` is not supported"),
            (json!({"model": MODEL, "prompt": "x", "max_tokens": -1}), StatusCode::BAD_REQUEST, "invalid value"),
            (json!({"model": MODEL, "prompt": "x", "max_tokens": 100000000}), StatusCode::BAD_REQUEST, "context length"),
            (json!({"model": MODEL, "prompt": "x", "max_tokens": 0}), StatusCode::BAD_REQUEST, "at least 1"),
            (json!({"model": MODEL, "prompt": ""}), StatusCode::BAD_REQUEST, "empty"),
            (json!({"model": MODEL, "prompt": []}), StatusCode::BAD_REQUEST, "empty"),
            (json!({"model": MODEL, "prompt": [1, 2, 99999999]}), StatusCode::BAD_REQUEST, "vocabulary"),
            (json!({"model": MODEL, "prompt": [1, -2]}), StatusCode::BAD_REQUEST, "not a valid token id"),
            (json!({"model": MODEL, "prompt": {"a": 1}}), StatusCode::BAD_REQUEST, "`prompt` must be"),
            (json!({"model": MODEL, "prompt": "x ".repeat(600)}), StatusCode::BAD_REQUEST, "context length"),
            (json!({"model": MODEL, "prompt": "x", "n": 0}), StatusCode::BAD_REQUEST, "`n`"),
            (json!({"model": MODEL, "prompt": "x", "n": 100000}), StatusCode::BAD_REQUEST, "`n`"),
            (json!({"model": MODEL, "prompt": "x", "temperature": -1}), StatusCode::BAD_REQUEST, "temperature"),
            (json!({"model": MODEL, "prompt": "x", "top_p": 0}), StatusCode::BAD_REQUEST, "top_p"),
            (json!({"model": MODEL, "prompt": "x", "logprobs": 50}), StatusCode::BAD_REQUEST, "logprobs"),
            (json!({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": true}}), StatusCode::BAD_REQUEST, "stream_options"),
            (json!({"model": MODEL, "prompt": "x", "echo": true}), StatusCode::BAD_REQUEST, "echo"),
            (json!({"model": MODEL, "prompt": "x", "stop": [1]}), StatusCode::BAD_REQUEST, "stop"),
            (json!({"model": "nope", "prompt": "x"}), StatusCode::NOT_FOUND, "model `nope`"),
            (json!({"model": "nope@3", "prompt": "x"}), StatusCode::NOT_FOUND, "model `nope@3`"),
        ];
        for (body, status, needle) in cases {
            let (got, e) = call(&app, "POST", "/v1/completions", Some(&key), Some(body.clone())).await;
            assert_eq!(got, status, "{body}: {e}");
            let message = e["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(needle), "{body}: {message:?} lacks {needle:?}");
            assert!(e["error"]["code"].is_string() && e["error"]["type"].is_string());
        }
        let res = call_service(
            &app,
            TestRequest::post()
                .uri("/v1/completions")
                .insert_header(bearer(&key))
                .insert_header(("content-type", "application/json"))
                .set_payload("{\"model\": ")
                .to_request(),
        )
        .await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        for body in [
            json!({"model": MODEL, "messages": []}),
            json!({"model": MODEL, "messages": [{"role": "user"}], "top_logprobs": 2}),
            json!({"model": MODEL, "messages": "hi"}),
        ] {
            let (got, e) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(body.clone())).await;
            assert_eq!(got, StatusCode::BAD_REQUEST, "{body}: {e}");
        }
        for body in [
            json!({"inputs": "", "parameters": {}}),
            json!({"inputs": "x", "parameters": {"watermark": true}}),
            json!({"inputs": "x", "parameters": {"adapter_id": "nope"}}),
            json!({"inputs": 5}),
        ] {
            let (got, e) = call(&app, "POST", "/generate", Some(&key), Some(body.clone())).await;
            assert!(got.is_client_error(), "{body}: {got} {e}");
        }
        // Keys: none, malformed, unknown; the operator's key is not a tenant's.
        let ok = json!({"model": MODEL, "prompt": "x", "max_tokens": 1});
        assert_eq!(call(&app, "POST", "/v1/completions", None, Some(ok.clone())).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(call(&app, "POST", "/v1/completions", Some("lpx_nope"), Some(ok.clone())).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&h.admin), Some(ok.clone())).await.0, StatusCode::FORBIDDEN);
        assert_eq!(call(&app, "GET", "/no/such/route", Some(&key), None).await.0, StatusCode::NOT_FOUND);
        // And after all that, the server still serves.
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&key), Some(ok.clone())).await.0, StatusCode::OK);
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&other), Some(ok)).await.0, StatusCode::OK);
    }
}

#[actix_web::test]
async fn tenant_limits_answer_429_with_retry_after() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme", "limits": {"requests_per_min": 2}})).await;
        let ok = json!({"model": MODEL, "prompt": "x", "max_tokens": 1});
        for _ in 0..2 {
            assert_eq!(call(&app, "POST", "/v1/completions", Some(&key), Some(ok.clone())).await.0, StatusCode::OK);
        }
        let res = call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&ok).to_request()).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let retry: u64 = res.headers().get("retry-after").unwrap().to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
        let e: Value = read_body_json(res).await;
        assert_eq!(e["error"]["code"], "rate_limit_exceeded");

        // Tokens per minute count the prompt and the most a request may generate.
        let (_, key) = tenant(&app, &h.admin, json!({"name": "tokens", "limits": {"tokens_per_min": 40}})).await;
        let ask = |n: usize| json!({"model": MODEL, "prompt": "x", "max_tokens": n, "ignore_eos": true, "temperature": 0});
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&key), Some(ask(30))).await.0, StatusCode::OK);
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&key), Some(ask(30))).await.0, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&key), Some(ask(100))).await.0, StatusCode::BAD_REQUEST, "can never fit");

        // Concurrency: a second request while a stream is open.
        let (_, key) = tenant(&app, &h.admin, json!({"name": "one-at-a-time", "limits": {"max_concurrent": 1}})).await;
        let long = json!({"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": true, "stream": true});
        let open = call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&long).to_request()).await;
        assert_eq!(open.status(), StatusCode::OK);
        let (status, _) = call(&app, "POST", "/v1/completions", Some(&key), Some(ok.clone())).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        let events = sse_events(&read_body(open).await);
        assert_eq!(events.last().unwrap(), "[DONE]");
        // The slot is given back when the job ends (its task may still be finishing).
        let mut status = StatusCode::TOO_MANY_REQUESTS;
        for _ in 0..100 {
            status = call(&app, "POST", "/v1/completions", Some(&key), Some(ok.clone())).await.0;
            if status == StatusCode::OK {
                break;
            }
            actix_web::rt::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(status, StatusCode::OK);
    }
}

#[actix_web::test]
async fn metrics_openapi_and_health() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        for _ in 0..3 {
            let (s, _) =
                call(&app, "POST", "/v1/completions", Some(&key), Some(json!({"model": MODEL, "prompt": "x", "max_tokens": 3, "ignore_eos": true}))).await;
            assert_eq!(s, StatusCode::OK);
        }
        // Metrics name every tenant: they need an operator key with the metrics (or admin) scope.
        let (status, body) = call(&app, "GET", "/metrics", None, None).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(!body.to_string().contains("acme"), "{body}");
        assert_eq!(call(&app, "GET", "/metrics", Some(&key), None).await.0, StatusCode::FORBIDDEN, "a tenant's key");
        let (status, minted) = call(&app, "POST", "/admin/keys", Some(&h.admin), Some(json!({"scopes": ["metrics"]}))).await;
        assert_eq!(status, StatusCode::CREATED, "{minted}");
        let scraper = minted["key"].as_str().unwrap().to_string();
        assert_eq!(call(&app, "GET", "/admin/tenants", Some(&scraper), None).await.0, StatusCode::FORBIDDEN, "a metrics key is only that");
        assert_eq!(call(&app, "GET", "/metrics", Some(&h.admin), None).await.0, StatusCode::OK);
        let (status, text) = call(&app, "GET", "/metrics", Some(&scraper), None).await;
        assert_eq!(status, StatusCode::OK);
        let text = text.as_str().unwrap();
        for needle in [
            "loraplex_requests_total{endpoint=\"completions\",outcome=\"ok\"} 3",
            "loraplex_tokens_total{tenant=\"acme\",kind=\"completion\"} 9",
            "loraplex_time_to_first_token_seconds_count 3",
            "loraplex_time_per_output_token_seconds_count 3",
            "loraplex_e2e_request_latency_seconds_bucket{le=\"+Inf\"} 3",
            "loraplex_queue_time_seconds_count 3",
            "loraplex_pool_pages{worker=\"0\",kind=\"kv\"}",
            "loraplex_worker_healthy{worker=\"0\"} 1",
            "loraplex_prefix_cache_hit_rate",
            "loraplex_adapter_loads_total{from=\"disk\"}",
            "vllm:num_requests_waiting 0",
            "vllm:num_requests_running 0",
            "vllm:kv_cache_usage_perc",
            "vllm:lora_requests_info{running_lora_adapters=\"\",waiting_lora_adapters=\"\",max_lora=\"64\"}",
        ] {
            assert!(text.contains(needle), "{needle} missing from\n{text}");
        }
        // The dashboard's JSON: the same counts, for the admin scope only.
        assert_eq!(call(&app, "GET", "/admin/stats", Some(&scraper), None).await.0, StatusCode::FORBIDDEN, "a metrics key");
        assert_eq!(call(&app, "GET", "/admin/stats", Some(&key), None).await.0, StatusCode::FORBIDDEN, "a tenant's key");
        let (status, stats) = call(&app, "GET", "/admin/stats", Some(&h.admin), None).await;
        assert_eq!(status, StatusCode::OK, "{stats}");
        assert_eq!(stats["requests"]["ok"], 3, "{stats}");
        assert_eq!(stats["ttft_seconds"]["count"], 3);
        assert_eq!(stats["tpot_seconds"]["count"], 3);
        let le = stats["ttft_seconds"]["le"].as_array().unwrap();
        let cumulative = stats["ttft_seconds"]["cumulative"].as_array().unwrap();
        assert_eq!(le.len(), cumulative.len());
        assert_eq!(cumulative.last().unwrap(), 3, "every first token within the last bound");
        let workers = stats["workers"].as_array().unwrap();
        assert_eq!(workers.len(), 1);
        assert_eq!(workers[0]["generated_tokens"], 9, "{stats}");
        assert!(workers[0]["pool"]["total"].as_u64().unwrap() > 0);
        assert!(workers[0]["unhealthy"].is_null());

        // Every documented route exists: without a key it answers 401 (or 200), never "no route".
        let (_, doc) = call(&app, "GET", "/openapi.json", None, None).await;
        assert_eq!(doc["openapi"], "3.0.3");
        for &(method, path, _, scope) in openapi::ROUTES {
            assert!(doc["paths"][path][method].is_object(), "{method} {path}");
            let uri = path.replace("{name}", "x").replace("{id}", "x").replace("{path}", "app.js");
            let (status, body) = call(&app, &method.to_uppercase(), &uri, None, None).await;
            let expected = match (scope, path) {
                (_, "/" | "/ui") => StatusCode::FOUND,
                ("none", _) => StatusCode::OK,
                _ => StatusCode::UNAUTHORIZED,
            };
            assert_eq!(status, expected, "{method} {path}: {body}");
        }
        assert_eq!(call(&app, "GET", "/ready", None, None).await.0, StatusCode::OK);
    }
}

#[actix_web::test]
async fn a_failure_mid_stream_arrives_as_an_error_event_and_is_recorded() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let res = long_stream(&app, &key).await;
        assert!(h.runtime.inject_fault(0, "drill", 0).await);
        let events = sse_events(&read_body(res).await);
        let error = events.iter().find(|e| e.get("error").is_some()).expect("an error event");
        assert_eq!(error["error"]["code"], "unavailable");
        assert!(error["error"]["message"].as_str().unwrap().contains("drill"), "{error}");
        assert_eq!(events.last().unwrap(), "[DONE]");
        assert!(h.state.jobs.drain(std::time::Duration::from_secs(10)).await);
        let (outcome, completion): (String, i64) =
            sqlx::query_as("SELECT outcome, completion_tokens FROM usage WHERE tenant_id = $1").bind(&tenant_id).fetch_one(h.state.store.pool()).await.unwrap();
        assert_eq!(outcome, "error");
        assert!(completion < 400);
        // The worker was rebuilt and serves again.
        let (status, _) = call(&app, "POST", "/v1/completions", Some(&key), Some(json!({"model": MODEL, "prompt": "x", "max_tokens": 2}))).await;
        assert_eq!(status, StatusCode::OK);

        // A worker whose rebuild keeps failing is unhealthy: /ready says so and requests get a
        // 503 with Retry-After (never a 500) until the retried rebuild succeeds.
        assert!(h.runtime.inject_fault(0, "drill", 4).await);
        let (_, _) = call(&app, "POST", "/v1/completions", Some(&key), Some(json!({"model": MODEL, "prompt": "x", "max_tokens": 2}))).await;
        let mut saw = Vec::new();
        for _ in 0..600 {
            let (ready, body) = call(&app, "GET", "/ready", None, None).await;
            if ready == StatusCode::SERVICE_UNAVAILABLE && saw.is_empty() {
                assert!(body.to_string().contains("no worker is healthy"), "{body}");
                let res = call_service(
                    &app,
                    TestRequest::post()
                        .uri("/v1/completions")
                        .insert_header(bearer(&key))
                        .set_json(json!({"model": MODEL, "prompt": "x", "max_tokens": 2}))
                        .to_request(),
                )
                .await;
                assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
                assert!(res.headers().contains_key("retry-after"));
                let (_, metrics) = call(&app, "GET", "/metrics", Some(&h.admin), None).await;
                assert!(metrics.as_str().unwrap().contains("loraplex_worker_healthy{worker=\"0\"} 0"));
                saw.push(ready);
            }
            if ready == StatusCode::OK && !saw.is_empty() {
                saw.push(ready);
                break;
            }
            actix_web::rt::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(saw, [StatusCode::SERVICE_UNAVAILABLE, StatusCode::OK], "unhealthy, then recovered");
        let (status, _) = call(&app, "POST", "/v1/completions", Some(&key), Some(json!({"model": MODEL, "prompt": "x", "max_tokens": 2}))).await;
        assert_eq!(status, StatusCode::OK);
    }
}
