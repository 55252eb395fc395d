//! The Files and Batch APIs: a batch's answers equal the interactive API's, it is billed at the
//! batch price, it can be cancelled, it goes on after a restart, it expires, and what cannot run
//! is refused with the lines named.

use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::api::batch::{Batches, resume};
use crate::store::{UsageRecord, outcome};

/// Uploads `text` as a file of requests.
async fn upload_file<S>(app: &S, key: &str, purpose: &str, text: &[u8]) -> (StatusCode, Value)
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let (content_type, body) = crate::bench::http::multipart(&[("purpose", purpose.as_bytes()), ("file", text)]);
    let req = TestRequest::post().uri("/v1/files").insert_header(bearer(key)).insert_header(("content-type", content_type)).set_payload(body).to_request();
    let res = call_service(app, req).await;
    let status = res.status();
    let body = read_body(res).await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// A file's bytes.
async fn content<S>(app: &S, key: &str, id: &str) -> String
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let res = call_service(app, TestRequest::get().uri(&format!("/v1/files/{id}/content")).insert_header(bearer(key)).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    String::from_utf8(read_body(res).await.to_vec()).unwrap()
}

/// Polls a batch until `done` says so (a minute at most).
async fn wait_for<S>(app: &S, key: &str, id: &str, done: impl Fn(&Value) -> bool) -> Value
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (status, batch) = call(app, "GET", &format!("/v1/batches/{id}"), Some(key), None).await;
        assert_eq!(status, StatusCode::OK, "{batch}");
        if done(&batch) {
            return batch;
        }
        assert!(std::time::Instant::now() < deadline, "the batch never got there: {batch}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ended(b: &Value) -> bool {
    ["completed", "failed", "expired", "cancelled"].contains(&b["status"].as_str().unwrap_or_default())
}

fn line(id: &str, url: &str, body: Value) -> String {
    json!({"custom_id": id, "method": "POST", "url": url, "body": body}).to_string()
}

fn jsonl(lines: &[String]) -> Vec<u8> {
    let mut out = lines.join("\n");
    out.push('\n');
    out.into_bytes()
}

/// The lines of a JSONL file by `custom_id`.
fn by_custom_id(text: &str) -> HashMap<String, Value> {
    let mut out = HashMap::new();
    for l in text.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        let id = v["custom_id"].as_str().unwrap().to_string();
        assert!(out.insert(id.clone(), v).is_none(), "{id} appears twice");
    }
    out
}

/// Uploads `lines` and starts a batch on them; the batch.
async fn start_batch<S>(app: &S, key: &str, url: &str, lines: &[String]) -> Value
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let (status, file) = upload_file(app, key, "batch", &jsonl(lines)).await;
    assert_eq!(status, StatusCode::OK, "{file}");
    assert_eq!((file["object"].as_str(), file["purpose"].as_str()), (Some("file"), Some("batch")));
    let body = json!({"input_file_id": file["id"], "endpoint": url, "completion_window": "24h", "metadata": {"job": "test"}});
    let (status, batch) = call(app, "POST", "/v1/batches", Some(key), Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{batch}");
    assert_eq!(batch["request_counts"]["total"], lines.len());
    assert_eq!(batch["metadata"]["job"], "test");
    batch
}

/// The usage row of a line of batch `batch` that answered `completion_tokens` tokens, billed at
/// the standard plan's batch prices, with no result recorded for it.
async fn unrecorded_line(state: &AppState, id: &str, tenant: &str, batch: &str, completion_tokens: i64) -> UsageRecord {
    let standard = state.store.plan("standard").await.unwrap().unwrap();
    UsageRecord {
        id: id.into(),
        tenant_id: tenant.into(),
        key_id: "key".into(),
        adapter: String::new(),
        prompt_tokens: 5,
        cached_prompt_tokens: 0,
        completion_tokens,
        queue_ms: 0.0,
        ttft_ms: 0.0,
        total_ms: 0.0,
        outcome: outcome::OK.into(),
        started_at: 0,
        finished_at: 0,
        plan: "standard".into(),
        prompt_price: standard.prompt_price / 2,
        cached_prompt_price: 0,
        completion_price: standard.completion_price / 2,
        instance: "test-instance".into(),
        batch_id: batch.into(),
        base_model: "loraplex-tiny".into(),
    }
}

/// The usage rows of a batch.
async fn batch_rows(state: &AppState, id: &str) -> Vec<UsageRecord> {
    state.ledger.flush().await;
    sqlx::query_as(
        "SELECT id, tenant_id, key_id, adapter, prompt_tokens, cached_prompt_tokens, completion_tokens, queue_ms, ttft_ms, total_ms, outcome, \
         started_at, finished_at, plan, prompt_price, cached_prompt_price, completion_price, instance, batch_id, base_model FROM usage WHERE batch_id = $1",
    )
    .bind(id)
    .fetch_all(state.store.pool())
    .await
    .unwrap()
}

/// Sum of the `usage` of every answer in an output file: (prompt, completion) tokens.
fn answered_tokens(output: &HashMap<String, Value>) -> (i64, i64) {
    output.values().fold((0, 0), |(p, c), l| {
        let u = &l["response"]["body"]["usage"];
        (p + u["prompt_tokens"].as_i64().unwrap(), c + u["completion_tokens"].as_i64().unwrap())
    })
}

#[actix_web::test]
async fn two_hundred_lines_over_three_adapters_answer_as_the_interactive_api_at_the_batch_price() {
    for h in Harness::each().await {
        let (state, admin) = (&h.state, &h.admin);
        let app = app!(state);
        let (_, key) = tenant(&app, admin, json!({"name": "acme", "plan": "standard"})).await;
        let adapters = h.adapters(3, 11);
        for (i, dir) in adapters.iter().enumerate() {
            let (config, weights) = super::adapters::files(dir);
            let name = format!("a{i}");
            let (status, _) = super::adapters::upload(&app, &key, &[("name", name.as_bytes()), ("config", &config), ("weights", &weights)]).await;
            assert_eq!(status, StatusCode::CREATED);
        }
        let models = ["a0", "a1", "a2", MODEL];
        let mut lines = Vec::new();
        let mut bodies = Vec::new();
        for i in 0..200 {
            let mut body = json!({
                "model": models[i % 4],
                "messages": [{"role": "user", "content": format!("request {i}: {}", "word ".repeat(i % 7))}],
                "max_tokens": 2 + i % 9,
                "temperature": 0,
            });
            if i % 50 == 7 {
                // Structured output in a batch, with an adapter.
                let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"], "additionalProperties": false});
                body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}});
                body["max_tokens"] = 40.into();
            }
            lines.push(line(&format!("req-{i}"), "/v1/chat/completions", body.clone()));
            bodies.push((format!("req-{i}"), body));
        }
        // A line that only fails when it runs: a prompt longer than the model's context.
        lines.push(line("too-long", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "x ".repeat(3000)}]})));
        let batch = start_batch(&app, &key, "/v1/chat/completions", &lines).await;
        let id = batch["id"].as_str().unwrap().to_string();
        assert_eq!(batch["status"], "in_progress");
        let batch = wait_for(&app, &key, &id, ended).await;
        assert_eq!(batch["status"], "completed", "{batch}");
        assert_eq!((batch["request_counts"]["completed"].as_i64(), batch["request_counts"]["failed"].as_i64()), (Some(200), Some(1)), "{batch}");
        let output = by_custom_id(&content(&app, &key, batch["output_file_id"].as_str().unwrap()).await);
        let errors = by_custom_id(&content(&app, &key, batch["error_file_id"].as_str().unwrap()).await);
        assert_eq!((output.len(), errors.len()), (200, 1));
        let failed = &errors["too-long"]["response"];
        assert_eq!((failed["status_code"].as_u64(), failed["body"]["error"]["code"].as_str()), (Some(400), Some("invalid_request")), "{failed}");

        // Every answer is the interactive API's answer to the same request.
        for (custom_id, body) in &bodies {
            let answer = &output[custom_id]["response"];
            assert_eq!(answer["status_code"], 200);
            assert_eq!(answer["request_id"], answer["body"]["id"]);
            let (status, interactive) = call(&app, "POST", "/v1/chat/completions", Some(&key), Some(body.clone())).await;
            assert_eq!(status, StatusCode::OK, "{interactive}");
            assert_eq!(answer["body"]["choices"], interactive["choices"], "{custom_id}");
            assert_eq!(answer["body"]["model"], interactive["model"]);
            for count in ["prompt_tokens", "completion_tokens"] {
                assert_eq!(answer["body"]["usage"][count], interactive["usage"][count], "{custom_id} {count}");
            }
            if body.get("response_format").is_some() {
                let text = answer["body"]["choices"][0]["message"]["content"].as_str().unwrap();
                assert!(serde_json::from_str::<Value>(text).unwrap()["n"].is_i64(), "{text}");
            }
        }

        // Billed once per finished line, at half the plan's prices, and the batch says so.
        let rows = batch_rows(state, &id).await;
        let standard = state.store.plan("standard").await.unwrap().unwrap();
        let billed: Vec<&UsageRecord> = rows.iter().filter(|r| r.outcome == outcome::OK).collect();
        assert_eq!(billed.len(), 200);
        for r in &billed {
            assert_eq!((r.prompt_price, r.completion_price), (standard.prompt_price / 2, standard.completion_price / 2));
        }
        let (prompt, completion) = answered_tokens(&output);
        assert_eq!((billed.iter().map(|r| r.prompt_tokens).sum::<i64>(), billed.iter().map(|r| r.completion_tokens).sum::<i64>()), (prompt, completion));
        assert_eq!((batch["usage"]["input_tokens"].as_i64(), batch["usage"]["output_tokens"].as_i64()), (Some(prompt), Some(completion)));
        // The interactive requests were billed at the full price.
        let (full,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM usage WHERE batch_id = '' AND prompt_price = $1 AND outcome = 'ok'")
            .bind(standard.prompt_price)
            .fetch_one(state.store.pool())
            .await
            .unwrap();
        assert_eq!(full, 200);

        // The listings show it all.
        let (_, list) = call(&app, "GET", "/v1/batches", Some(&key), None).await;
        assert_eq!((list["data"][0]["id"].as_str(), list["has_more"].as_bool()), (Some(id.as_str()), Some(false)));
        let (_, files) = call(&app, "GET", "/v1/files?purpose=batch_output", Some(&key), None).await;
        assert_eq!(files["data"].as_array().unwrap().len(), 2, "{files}");
        // An ended batch cannot be cancelled.
        let (status, e) = call(&app, "POST", &format!("/v1/batches/{id}/cancel"), Some(&key), None).await;
        assert_eq!(status, StatusCode::CONFLICT, "{e}");
    }
}

/// `n` completion lines of `tokens` tokens each (EOS ignored), numbered.
fn long_lines(n: usize, tokens: u32) -> Vec<String> {
    (0..n)
        .map(|i| {
            line(
                &format!("l{i}"),
                "/v1/completions",
                json!({"model": MODEL, "prompt": format!("line {i}"), "max_tokens": tokens, "ignore_eos": true, "temperature": 0}),
            )
        })
        .collect()
}

/// Settings with `concurrency` batch lines in flight.
fn batch_settings(concurrency: u32) -> ApiSettings {
    let mut s = settings();
    s.batch.concurrency = concurrency;
    s
}

#[actix_web::test]
async fn a_cancelled_batch_stops_its_lines_and_bills_only_what_finished() {
    let h = Harness::sqlite(batch_settings(2)).await;
    let (state, admin) = (&h.state, &h.admin);
    let app = app!(state);
    let (tenant_id, key) = tenant(&app, admin, json!({"name": "acme", "plan": "standard"})).await;
    let batch = start_batch(&app, &key, "/v1/completions", &long_lines(40, 48)).await;
    let id = batch["id"].as_str().unwrap().to_string();
    wait_for(&app, &key, &id, |b| b["request_counts"]["completed"].as_i64() >= Some(3)).await;
    // A line that finished just as the cancel came, before its result was recorded: it was
    // never delivered, so it is cancelled and not charged.
    state.ledger.commit(unrecorded_line(state, "use_late", &tenant_id, &id, 48).await).await.unwrap();
    let (status, cancelling) = call(&app, "POST", &format!("/v1/batches/{id}/cancel"), Some(&key), None).await;
    assert_eq!(status, StatusCode::OK, "{cancelling}");
    assert!(["cancelling", "cancelled"].contains(&cancelling["status"].as_str().unwrap()), "{cancelling}");
    let batch = wait_for(&app, &key, &id, ended).await;
    assert_eq!(batch["status"], "cancelled", "{batch}");
    assert!(batch["cancelled_at"].as_i64() >= batch["cancelling_at"].as_i64());
    let completed = batch["request_counts"]["completed"].as_i64().unwrap();
    assert!((3..40).contains(&completed), "{batch}");
    assert_eq!(batch["request_counts"]["failed"], 0);
    assert!(batch["error_file_id"].is_null(), "lines that never ran are not errors: {batch}");
    let output = by_custom_id(&content(&app, &key, batch["output_file_id"].as_str().unwrap()).await);
    assert_eq!(output.len() as i64, completed);
    assert!(output.values().all(|l| l["response"]["body"]["usage"]["completion_tokens"] == 48));
    // Cancelling again changes nothing.
    let (status, again) = call(&app, "POST", &format!("/v1/batches/{id}/cancel"), Some(&key), None).await;
    assert_eq!((status, again["status"].as_str()), (StatusCode::OK, Some("cancelled")));

    // The lines in flight were stopped: recorded, not charged. The finished ones are billed.
    let mut rows = batch_rows(state, &id).await;
    for _ in 0..50 {
        if rows.iter().all(|r| r.outcome != outcome::RUNNING) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        rows = batch_rows(state, &id).await;
    }
    let charged: Vec<&UsageRecord> = rows.iter().filter(|r| r.prompt_price > 0).collect();
    assert_eq!(charged.len() as i64, completed, "{rows:?}");
    assert!(charged.iter().all(|r| r.outcome == outcome::OK));
    let stopped: Vec<&UsageRecord> = rows.iter().filter(|r| r.prompt_price == 0).collect();
    assert!(!stopped.is_empty() && stopped.iter().all(|r| r.outcome == outcome::CANCELLED && r.completion_price == 0), "{stopped:?}");
    assert!(stopped.iter().any(|r| r.id == "use_late"), "{stopped:?}");
    let (prompt, completion) = answered_tokens(&output);
    assert_eq!((batch["usage"]["input_tokens"].as_i64(), batch["usage"]["output_tokens"].as_i64()), (Some(prompt), Some(completion)));
    let report = state.store.billing_report(0, i64::MAX, None).await.unwrap();
    let standard = state.store.plan("standard").await.unwrap().unwrap();
    let expected =
        crate::store::Money::of(prompt, standard.prompt_price / 2).checked_add(crate::store::Money::of(completion, standard.completion_price / 2)).unwrap();
    assert_eq!(report.totals.cost, expected);
}

#[actix_web::test]
async fn a_batch_goes_on_after_a_restart_without_billing_a_line_twice_and_expires_after_its_window() {
    let h = Harness::sqlite(batch_settings(1)).await;
    let app = app!(&h.state);
    let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard"})).await;
    let lines = long_lines(24, 24);
    let batch = start_batch(&app, &key, "/v1/completions", &lines).await;
    let id = batch["id"].as_str().unwrap().to_string();
    wait_for(&app, &key, &id, |b| b["request_counts"]["completed"].as_i64() >= Some(3)).await;
    // The server stops: no line starts, the one in flight finishes and is recorded.
    h.state.batches.shutdown();
    assert!(h.state.jobs.drain(Duration::from_secs(30)).await);
    let (before, _) = h.state.store.batch_counts(&id).await.unwrap();
    assert!(before < 24, "{before}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.state.store.batch_counts(&id).await.unwrap().0, before, "nothing runs after the shutdown");
    // A usage row whose line's result was never written (its server died in between).
    h.state.ledger.commit(unrecorded_line(&h.state, "use_stray", &tenant_id, &id, 24).await).await.unwrap();

    // The server starts again over the same database and data directory.
    let restarted = AppState::new(h.state.store.clone(), h.runtime.clone(), h.state.tokenizer.clone(), MODEL, h.dir.path(), batch_settings(4));
    assert_eq!(resume(&restarted).await.unwrap(), 1);
    assert!(restarted.batches.is_running(&id));
    let app = app!(&restarted);
    let batch = wait_for(&app, &key, &id, ended).await;
    assert_eq!((batch["status"].as_str(), batch["request_counts"]["completed"].as_i64()), (Some("completed"), Some(24)), "{batch}");
    let output = by_custom_id(&content(&app, &key, batch["output_file_id"].as_str().unwrap()).await);
    assert_eq!(output.len(), 24);
    for (i, l) in lines.iter().enumerate() {
        let body: Value = serde_json::from_str::<Value>(l).unwrap()["body"].clone();
        let (_, interactive) = call(&app, "POST", "/v1/completions", Some(&key), Some(body)).await;
        assert_eq!(output[&format!("l{i}")]["response"]["body"]["choices"], interactive["choices"], "line {i}");
    }
    let rows = batch_rows(&restarted, &id).await;
    let charged: Vec<&UsageRecord> = rows.iter().filter(|r| r.prompt_price > 0).collect();
    assert_eq!(charged.len(), 24, "each line billed once: {rows:?}");
    assert_eq!(rows.len(), 25, "no line ran twice: {:?}", rows.iter().filter(|r| r.prompt_price == 0).collect::<Vec<_>>());
    let stray = rows.iter().find(|r| r.id == "use_stray").unwrap();
    assert_eq!((stray.outcome.as_str(), stray.prompt_price, stray.completion_price), (outcome::INTERRUPTED, 0, 0));

    // A batch whose completion window closes while it waits to go on expires: what finished is
    // kept, every other line is an error of its own.
    let batch = start_batch(&app, &key, "/v1/completions", &long_lines(12, 24)).await;
    let id = batch["id"].as_str().unwrap().to_string();
    wait_for(&app, &key, &id, |b| b["request_counts"]["completed"].as_i64() >= Some(1)).await;
    restarted.batches.shutdown();
    assert!(restarted.jobs.drain(Duration::from_secs(30)).await);
    let (done, _) = restarted.store.batch_counts(&id).await.unwrap();
    sqlx::query("UPDATE batches SET expires_at = $1 WHERE id = $2").bind(crate::store::now_ms() - 1).bind(&id).execute(restarted.store.pool()).await.unwrap();
    let again = AppState::new(h.state.store.clone(), h.runtime.clone(), h.state.tokenizer.clone(), MODEL, h.dir.path(), batch_settings(4));
    Batches::start(&again, &id);
    let app = app!(&again);
    let batch = wait_for(&app, &key, &id, ended).await;
    assert_eq!(batch["status"], "expired", "{batch}");
    assert_eq!((batch["request_counts"]["completed"].as_i64(), batch["request_counts"]["failed"].as_i64()), (Some(done), Some(12 - done)));
    let errors = by_custom_id(&content(&app, &key, batch["error_file_id"].as_str().unwrap()).await);
    assert_eq!(errors.len() as i64, 12 - done);
    assert!(errors.values().all(|e| e["error"]["code"] == "batch_expired" && e["response"].is_null()), "{errors:?}");
    assert_eq!(by_custom_id(&content(&app, &key, batch["output_file_id"].as_str().unwrap()).await).len() as i64, done);
}

#[actix_web::test]
async fn files_and_batches_refuse_what_they_cannot_run_and_stay_private() {
    let mut settings = batch_settings(1);
    settings.batch.max_file_bytes = 8 << 10;
    settings.batch.max_tenant_file_bytes = 20 << 10;
    settings.batch.max_active = 1;
    let h = Harness::sqlite(settings).await;
    let app = app!(&h.state);
    let (_, key) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard"})).await;
    let (_, other) = tenant(&app, &h.admin, json!({"name": "globex", "plan": "standard"})).await;
    let good = |n: usize| long_lines(n, 2);

    // Uploads.
    let (status, e) = upload_file(&app, &key, "fine-tune", &jsonl(&good(1))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{e}");
    let bad = [good(1)[0].clone(), good(1)[0].clone(), "{}".into()];
    let (status, e) = upload_file(&app, &key, "batch", &jsonl(&bad)).await;
    assert_eq!((status, e["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_lines")), "{e}");
    let named: Vec<u64> = e["error"]["lines"].as_array().unwrap().iter().map(|l| l["line"].as_u64().unwrap()).collect();
    assert_eq!(named, [2, 3]);
    let (status, e) = upload_file(&app, &key, "batch", &vec![b'x'; 9 << 10]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{e}");
    let mut ids = Vec::new();
    loop {
        let (status, f) = upload_file(&app, &key, "batch", &jsonl(&good(40))).await;
        if status == StatusCode::TOO_MANY_REQUESTS {
            assert_eq!(f["error"]["code"], "quota_exceeded", "{f}");
            break;
        }
        assert_eq!(status, StatusCode::OK, "{f}");
        ids.push(f["id"].as_str().unwrap().to_string());
        assert!(ids.len() < 10, "the quota never held");
    }
    assert!(ids.len() >= 2);
    // Pages of files, newest first, or oldest first.
    let (_, page) = call(&app, "GET", "/v1/files?limit=1", Some(&key), None).await;
    assert_eq!((page["data"][0]["id"].as_str(), page["has_more"].as_bool()), (ids.last().map(String::as_str), Some(true)));
    let (_, rest) = call(&app, "GET", &format!("/v1/files?after={}", page["last_id"].as_str().unwrap()), Some(&key), None).await;
    assert_eq!(rest["data"].as_array().unwrap().len(), ids.len() - 1);
    let (_, asc) = call(&app, "GET", "/v1/files?order=asc&limit=1000", Some(&key), None).await;
    assert_eq!(asc["data"][0]["id"].as_str(), Some(ids[0].as_str()));
    assert_eq!(call(&app, "GET", "/v1/files?limit=0", Some(&key), None).await.0, StatusCode::BAD_REQUEST);

    // Creating batches.
    let create = |file: &str, endpoint: &str, window: &str| json!({"input_file_id": file, "endpoint": endpoint, "completion_window": window});
    for (body, status) in [
        (create(&ids[0], "/v1/completions", "1h"), StatusCode::BAD_REQUEST),
        (create(&ids[0], "/v1/embeddings", "24h"), StatusCode::BAD_REQUEST),
        (create(&ids[0], "/v1/chat/completions", "24h"), StatusCode::BAD_REQUEST),
        (create("file-nope", "/v1/completions", "24h"), StatusCode::NOT_FOUND),
        (
            json!({"input_file_id": ids[0], "endpoint": "/v1/completions", "completion_window": "24h", "metadata": (0..17).map(|i| (i.to_string(), json!("v"))).collect::<serde_json::Map<_, _>>()}),
            StatusCode::BAD_REQUEST,
        ),
    ] {
        let (got, e) = call(&app, "POST", "/v1/batches", Some(&key), Some(body.clone())).await;
        assert_eq!(got, status, "{body}: {e}");
    }
    // Another tenant's file is unknown; so is a model the tenant cannot use.
    assert_eq!(call(&app, "POST", "/v1/batches", Some(&other), Some(create(&ids[0], "/v1/completions", "24h"))).await.0, StatusCode::NOT_FOUND);
    for id in &ids[1..] {
        assert_eq!(call(&app, "DELETE", &format!("/v1/files/{id}"), Some(&key), None).await.0, StatusCode::OK);
    }
    let unknown = [good(1)[0].clone(), line("x", "/v1/completions", json!({"model": "nobody", "prompt": "p"}))];
    let (_, f) = upload_file(&app, &key, "batch", &jsonl(&unknown)).await;
    let (status, e) = call(&app, "POST", "/v1/batches", Some(&key), Some(create(f["id"].as_str().unwrap(), "/v1/completions", "24h"))).await;
    assert_eq!((status, e["error"]["lines"][0]["line"].as_u64()), (StatusCode::BAD_REQUEST, Some(2)), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("nobody"), "{e}");

    // One batch at a time (max_active 1); its input cannot be deleted while it runs; another
    // tenant sees none of it.
    let (status, slow) = upload_file(&app, &key, "batch", &jsonl(&long_lines(40, 48))).await;
    assert_eq!(status, StatusCode::OK, "{slow}");
    let slow = slow["id"].as_str().unwrap().to_string();
    let (status, running) = call(&app, "POST", "/v1/batches", Some(&key), Some(create(&slow, "/v1/completions", "24h"))).await;
    assert_eq!(status, StatusCode::OK, "{running}");
    let bid = running["id"].as_str().unwrap().to_string();
    let (status, e) = call(&app, "POST", "/v1/batches", Some(&key), Some(create(&ids[0], "/v1/completions", "24h"))).await;
    assert_eq!((status, e["error"]["code"].as_str()), (StatusCode::TOO_MANY_REQUESTS, Some("quota_exceeded")), "{e}");
    let (status, e) = call(&app, "DELETE", &format!("/v1/files/{slow}"), Some(&key), None).await;
    assert_eq!(status, StatusCode::CONFLICT, "{e}");
    for (method, uri) in [("GET", format!("/v1/batches/{bid}")), ("POST", format!("/v1/batches/{bid}/cancel")), ("GET", format!("/v1/files/{slow}"))] {
        assert_eq!(call(&app, method, &uri, Some(&other), None).await.0, StatusCode::NOT_FOUND, "{method} {uri}");
    }
    let res = call_service(&app, TestRequest::get().uri(&format!("/v1/files/{slow}/content")).insert_header(bearer(&other)).to_request()).await;
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    let (_, theirs) = call(&app, "GET", "/v1/batches", Some(&other), None).await;
    assert_eq!(theirs["data"].as_array().map(Vec::len), Some(0));
    // A file is the one uploaded, byte for byte.
    assert_eq!(content(&app, &key, &ids[0]).await.into_bytes(), jsonl(&good(40)));
    wait_for(&app, &key, &bid, |b| b["request_counts"]["completed"].as_i64() >= Some(1)).await;
    let (status, _) = call(&app, "POST", &format!("/v1/batches/{bid}/cancel"), Some(&key), None).await;
    assert_eq!(status, StatusCode::OK);
    let done = wait_for(&app, &key, &bid, ended).await;
    // A batch's output is not an input.
    let out = done["output_file_id"].as_str().unwrap();
    let (status, e) = call(&app, "POST", "/v1/batches", Some(&key), Some(create(out, "/v1/completions", "24h"))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{e}");
    assert_eq!(call(&app, "DELETE", &format!("/v1/files/{slow}"), Some(&key), None).await.0, StatusCode::OK);
    assert_eq!(call(&app, "GET", &format!("/v1/files/{slow}"), Some(&key), None).await.0, StatusCode::NOT_FOUND);
    assert!(!h.dir.path().join(format!("files/{slow}.jsonl")).exists(), "its bytes are gone");
}

#[actix_web::test]
async fn batch_lines_wait_for_the_tenants_limits_and_leave_it_the_other_half() {
    let h = Harness::sqlite(batch_settings(8)).await;
    let app = app!(&h.state);
    // Two at once: batch work may hold one of them.
    let (_, key) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard", "limits": {"max_concurrent": 2, "requests_per_min": 24}})).await;
    let batch = start_batch(&app, &key, "/v1/completions", &long_lines(11, 200)).await;
    let id = batch["id"].as_str().unwrap().to_string();
    // While the batch runs (a line at a time: its half of the concurrency), the tenant's own
    // requests are admitted: a slot and the tenant's burst are theirs.
    wait_for(&app, &key, &id, |b| b["request_counts"]["completed"].as_i64() >= Some(1)).await;
    for _ in 0..3 {
        let (status, e) = call(&app, "POST", "/v1/completions", Some(&key), Some(json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}))).await;
        assert_eq!(status, StatusCode::OK, "{e}");
    }
    // 24 a minute: batch work gets 12 a minute, 10 at once, then one every 5 s. The lines wait
    // for their turn instead of failing.
    let batch = wait_for(&app, &key, &id, ended).await;
    assert_eq!((batch["status"].as_str(), batch["request_counts"]["failed"].as_i64()), (Some("completed"), Some(0)), "{batch}");
    let took = batch["completed_at"].as_i64().unwrap() - batch["created_at"].as_i64().unwrap();
    assert!(took >= 4, "the 11th line waited for the tenant's limit: {took} s");
}

/// Forwards to the runtime and remembers where each request was placed.
struct Recording {
    inner: Arc<dyn Serving>,
    placements: std::sync::Mutex<Vec<crate::scheduler::Placement>>,
}

impl Serving for Recording {
    fn model_config(&self) -> &crate::model::ModelConfig {
        self.inner.model_config()
    }
    fn base_shape(&self) -> &loraplex_adapters::BaseShape {
        self.inner.base_shape()
    }
    fn adapter_limits(&self) -> &loraplex_adapters::AdapterLimits {
        self.inner.adapter_limits()
    }
    fn device_name(&self) -> &str {
        self.inner.device_name()
    }
    fn pool_shape(&self) -> crate::runtime::PoolShape {
        self.inner.pool_shape()
    }
    fn validate(&self, request: crate::request::GenerationRequest) -> Result<crate::request::ValidRequest, crate::runtime::SubmitError> {
        self.inner.validate(request)
    }
    fn submit(
        &self,
        request: crate::request::ValidRequest,
        placement: crate::scheduler::Placement,
    ) -> futures::future::LocalBoxFuture<'_, Result<crate::runtime::RequestHandle, crate::runtime::SubmitError>> {
        self.placements.lock().unwrap().push(placement.clone());
        self.inner.submit(request, placement)
    }
    fn stats(&self) -> futures::future::LocalBoxFuture<'_, Vec<crate::runtime::WorkerStats>> {
        self.inner.stats()
    }
    fn load_adapter(
        &self,
        adapter: crate::memory::AdapterRef,
        holder: Option<crate::runtime::Holder>,
    ) -> futures::future::LocalBoxFuture<'_, Vec<Result<crate::memory::Residency, crate::runtime::HoldError>>> {
        self.inner.load_adapter(adapter, holder)
    }
    fn unload_adapter(&self, key: Arc<str>, holder: Arc<str>, forget: bool) -> futures::future::LocalBoxFuture<'_, bool> {
        self.inner.unload_adapter(key, holder, forget)
    }
    fn locate_adapters(&self, keys: Arc<[Arc<str>]>) -> futures::future::LocalBoxFuture<'_, Vec<crate::runtime::WorkerLocations>> {
        self.inner.locate_adapters(keys)
    }
}

#[actix_web::test]
async fn batch_lines_run_in_the_batch_class_and_interactive_requests_in_theirs() {
    use crate::scheduler::Priority;
    let h = Harness::sqlite(batch_settings(4)).await;
    let recording = Arc::new(Recording { inner: h.runtime.clone(), placements: Default::default() });
    let state = AppState::new(h.state.store.clone(), recording.clone(), h.state.tokenizer.clone(), MODEL, h.dir.path(), batch_settings(4));
    let app = app!(&state);
    let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard"})).await;
    let batch = start_batch(&app, &key, "/v1/completions", &long_lines(6, 4)).await;
    wait_for(&app, &key, batch["id"].as_str().unwrap(), ended).await;
    let (status, _) = call(&app, "POST", "/v1/completions", Some(&key), Some(json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}))).await;
    assert_eq!(status, StatusCode::OK);
    let placements = recording.placements.lock().unwrap().clone();
    let classes: Vec<Priority> = placements.iter().map(|p| p.priority).collect();
    assert_eq!(classes, [[Priority::Batch; 6].as_slice(), &[Priority::Interactive]].concat());
    assert!(placements.iter().all(|p| &*p.tenant.0 == tenant_id.as_str()), "{placements:?}");
}

#[actix_web::test]
async fn a_batch_whose_tenant_is_deleted_is_cancelled_with_what_finished_billed_and_no_files() {
    let h = Harness::sqlite(batch_settings(1)).await;
    let app = app!(&h.state);
    let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard"})).await;
    // More lines than one read of the input file, so the tenant is looked up again mid-run.
    let batch = start_batch(&app, &key, "/v1/completions", &long_lines(200, 16)).await;
    let id = batch["id"].as_str().unwrap().to_string();
    wait_for(&app, &key, &id, |b| b["request_counts"]["completed"].as_i64() >= Some(2)).await;
    let (status, _) = call(&app, "DELETE", &format!("/admin/tenants/{tenant_id}"), Some(&h.admin), None).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let record = loop {
        let b = h.state.store.batch(&tenant_id, &id).await.unwrap().unwrap();
        if !b.is_active() {
            break b;
        }
        assert!(std::time::Instant::now() < deadline, "{b:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(record.status, "cancelled");
    assert!(record.errors.as_deref().unwrap_or_default().contains("the tenant was deleted"), "{record:?}");
    assert!(record.completed >= 2 && record.completed < 200, "{record:?}");
    assert_eq!((record.output_file_id.as_deref(), record.error_file_id.as_deref()), (None, None), "its files went with it");
    let rows = batch_rows(&h.state, &id).await;
    assert_eq!(rows.iter().filter(|r| r.prompt_price > 0).count() as i64, record.completed, "billed what was written: {rows:?}");
}

#[actix_web::test]
async fn a_batch_whose_input_cannot_be_read_fails_after_a_few_tries() {
    let h = Harness::sqlite(batch_settings(1)).await;
    let app = app!(&h.state);
    let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard"})).await;
    let (_, file) = upload_file(&app, &key, "batch", &jsonl(&long_lines(3, 2))).await;
    let file_id = file["id"].as_str().unwrap();
    // The bytes are lost behind the server's back.
    std::fs::remove_file(h.dir.path().join(crate::api::files::relative_path(file_id))).unwrap();
    let (status, batch) =
        call(&app, "POST", "/v1/batches", Some(&key), Some(json!({"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}))).await;
    // Creating it reads the file too: a server fault, said as such.
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{batch}");
    // A batch that was created before its file was lost fails after a few runs.
    let (_, file) = upload_file(&app, &key, "batch", &jsonl(&long_lines(3, 2))).await;
    let file_id = file["id"].as_str().unwrap().to_string();
    let record = crate::store::BatchRecord {
        id: crate::store::random_id("batch"),
        tenant_id: tenant_id.clone(),
        key_id: "key".into(),
        endpoint: "/v1/completions".into(),
        input_file_id: file_id.clone(),
        completion_window: "24h".into(),
        status: "in_progress".into(),
        instance: "test-instance".into(),
        metadata: "{}".into(),
        total: 3,
        completed: 0,
        failed: 0,
        output_file_id: None,
        error_file_id: None,
        errors: None,
        created_at: crate::store::now_ms(),
        expires_at: crate::store::now_ms() + 3_600_000,
        in_progress_at: None,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
    };
    h.state.store.insert_batch(&record, None).await.unwrap();
    std::fs::remove_file(h.dir.path().join(crate::api::files::relative_path(&file_id))).unwrap();
    Batches::start(&h.state, &record.id);
    let batch = wait_for(&app, &key, &record.id, ended).await;
    assert_eq!(batch["status"], "failed", "{batch}");
    let message = batch["errors"]["data"][0]["message"].as_str().unwrap();
    assert!(message.contains("opening the input file"), "{message}");
}

#[actix_web::test]
async fn a_batch_taken_over_by_another_replica_stops_here_without_ending() {
    let scratch = tempfile::tempdir().unwrap();
    let Some(url) = crate::store::test_urls(scratch.path()).await.into_iter().find(|u| u.starts_with("postgres")) else {
        eprintln!("taking batches over needs PostgreSQL (the replicas' heartbeats): skipped");
        return;
    };
    // Two lines in flight at a time: the batch is far from done when it is taken over.
    {
        let h = Harness::on(tempfile::tempdir().unwrap(), &url, batch_settings(2)).await;
        let mut state = h.state.clone();
        state.limiter = crate::api::Limiter::shared(state.store.clone(), &state.settings.instance).await.unwrap();
        let admin = &h.admin;
        let app = app!(state);
        let (_, key) = tenant(&app, admin, json!({"name": "acme"})).await;
        let batch = start_batch(&app, &key, "/v1/completions", &long_lines(40, 48)).await;
        let id = batch["id"].as_str().unwrap().to_string();
        wait_for(&app, &key, &id, |b| b["request_counts"]["completed"].as_i64() >= Some(2)).await;
        // Another replica, alive, now runs it (it took it over while this one was cut off).
        state.store.limit_heartbeat("inst_other").await.unwrap();
        sqlx::query("UPDATE batches SET instance = 'inst_other' WHERE id = $1").bind(&id).execute(state.store.pool()).await.unwrap();
        crate::api::cluster::batches(&state, true).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while state.batches.is_running(&id) {
            assert!(std::time::Instant::now() < deadline, "the batch still runs here");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (_, now) = call(&app, "GET", &format!("/v1/batches/{id}"), Some(&key), None).await;
        assert_eq!(now["status"], "in_progress", "its end is left to its new runner: {now}");
        assert!(now["request_counts"]["completed"].as_i64().unwrap() < 40, "{now}");
    }
}
