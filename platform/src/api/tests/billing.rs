//! The ledger and the bill: what clients were told they used is what they are billed, on
//! SQLite and PostgreSQL, for a few hundred concurrent requests of every kind.

use super::*;
use crate::store::Money;

/// Sums of the usage objects clients received.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Seen {
    requests: i64,
    prompt: i64,
    cached: i64,
    completion: i64,
}

impl Seen {
    fn add(&mut self, u: &Value) {
        self.requests += 1;
        self.prompt += u["prompt_tokens"].as_i64().unwrap();
        self.cached += u["prompt_tokens_details"]["cached_tokens"].as_i64().unwrap();
        self.completion += u["completion_tokens"].as_i64().unwrap();
        assert_eq!(u["total_tokens"].as_i64().unwrap(), u["prompt_tokens"].as_i64().unwrap() + u["completion_tokens"].as_i64().unwrap());
    }
}

/// A cost string (`"12.003400"`) in picodollars.
fn pico(dollars: &str) -> i128 {
    let (whole, frac) = dollars.split_once('.').unwrap();
    assert!(!whole.starts_with('-') && frac.len() <= 12, "{dollars}");
    whole.parse::<i128>().unwrap() * 1_000_000_000_000 + format!("{frac:0<12}").parse::<i128>().unwrap()
}

fn check(totals: &Value, seen: &Seen, what: &str) {
    let got = Seen {
        requests: totals["requests"].as_i64().unwrap(),
        prompt: totals["prompt_tokens"].as_i64().unwrap(),
        cached: totals["cached_prompt_tokens"].as_i64().unwrap(),
        completion: totals["completion_tokens"].as_i64().unwrap(),
    };
    assert_eq!(&got, seen, "{what}");
}

#[actix_web::test]
async fn the_bill_adds_up_to_what_clients_were_told_on_every_database() {
    let scratch = tempfile::tempdir().unwrap();
    for url in crate::store::test_urls(scratch.path()).await {
        let h = Harness::on(tempfile::tempdir().unwrap(), &url, settings()).await;
        let app = app!(h.state);
        let (a_id, a) = tenant(&app, &h.admin, json!({"name": "acme", "plan": "standard"})).await;
        let (b_id, b) = tenant(&app, &h.admin, json!({"name": "bravo", "plan": "enterprise", "weight": 2.0})).await;
        let (config, weights) = super::adapters::files(&h.adapters(1, 9)[0]);
        let (s, _) = super::adapters::upload(&app, &a, &[("name", b"support"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(s, StatusCode::CREATED);

        // A shared system prompt long enough to fill prefix-cache blocks.
        let system = "You are a helpful assistant for a large company. ".repeat(4);
        let n = 240;
        let requests = (0..n).map(|i| {
            let (key, tenant) = if i % 3 == 0 { (&b, 1) } else { (&a, 0) };
            let model = if tenant == 0 && i % 2 == 0 { "support" } else { MODEL };
            let max_tokens = 1 + i % 5;
            let stream = i % 4 == 1;
            let (uri, mut body) = if i % 2 == 0 {
                ("/v1/completions", json!({"model": model, "prompt": format!("{system} question {i}"), "max_tokens": max_tokens, "n": 1 + i % 2, "temperature": 0.7, "seed": i}))
            } else {
                ("/v1/chat/completions", json!({"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("question {i}")}], "max_tokens": max_tokens}))
            };
            if stream {
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
            }
            let app = &app;
            async move {
                let res = call_service(app, TestRequest::post().uri(uri).insert_header(bearer(key)).set_json(&body).to_request()).await;
                assert_eq!(res.status(), StatusCode::OK, "{uri} {body}");
                let bytes = read_body(res).await;
                let usage = if stream {
                    let events = sse_events(&bytes);
                    assert_eq!(events.last().unwrap(), "[DONE]");
                    events[events.len() - 2]["usage"].clone()
                } else {
                    serde_json::from_slice::<Value>(&bytes).unwrap()["usage"].clone()
                };
                (tenant, usage)
            }
        });
        let results = futures::future::join_all(requests).await;
        let mut seen = [Seen::default(); 2];
        for (t, u) in &results {
            seen[*t].add(u);
        }
        let all = Seen {
            requests: seen[0].requests + seen[1].requests,
            prompt: seen[0].prompt + seen[1].prompt,
            cached: seen[0].cached + seen[1].cached,
            completion: seen[0].completion + seen[1].completion,
        };
        assert_eq!(all.requests, n as i64);
        assert!(all.cached > 0, "the shared system prompt was served from the prefix cache");

        let (s, report) = call(&app, "GET", "/admin/billing/report?format=json", Some(&h.admin), None).await;
        assert_eq!(s, StatusCode::OK, "{report}");
        check(&report["totals"], &all, &url);
        for (id, t) in [(&a_id, 0), (&b_id, 1)] {
            let line = report["tenants"].as_array().unwrap().iter().find(|l| l["tenant_id"] == id.as_str()).unwrap();
            check(line, &seen[t], id);
        }
        // Costs, exact: each plan's prices per million tokens (micro-dollars), cached prompt
        // discounted.
        let price = |s: &Seen, p: [i64; 3]| {
            [(s.prompt - s.cached, p[0]), (s.cached, p[1]), (s.completion, p[2])]
                .into_iter()
                .fold(Money::ZERO, |m, (t, p)| m.checked_add(Money::of(t, p)).unwrap())
        };
        let (a_cost, b_cost) = (price(&seen[0], [500_000, 125_000, 1_500_000]), price(&seen[1], [400_000, 100_000, 1_200_000]));
        assert_eq!(report["totals"]["cost"], a_cost.checked_add(b_cost).unwrap().dollars(), "{url}");
        for (id, cost) in [(&a_id, a_cost), (&b_id, b_cost)] {
            let line = report["tenants"].as_array().unwrap().iter().find(|l| l["tenant_id"] == id.as_str()).unwrap();
            assert_eq!(line["cost"], cost.dollars());
        }
        assert!(report["lines"].as_array().unwrap().iter().any(|l| l["adapter"] == "support@1"));
        // Per adapter and per day: the same totals, every line counted once.
        for (part, width) in [("adapters", 3), ("days", 1)] {
            let rows = report[part].as_array().unwrap();
            assert!(rows.len() >= width, "{report}");
            let field = |f: &str| rows.iter().map(|r| r[f].as_i64().unwrap()).sum::<i64>();
            let summed = Seen {
                requests: field("requests"),
                prompt: field("prompt_tokens"),
                cached: field("cached_prompt_tokens"),
                completion: field("completion_tokens"),
            };
            check(&report["totals"], &summed, part);
            let cost: i128 = rows.iter().map(|r| pico(r["cost"].as_str().unwrap())).sum();
            assert_eq!(cost, pico(report["totals"]["cost"].as_str().unwrap()), "{part}");
        }
        let adapters = report["adapters"].as_array().unwrap();
        assert_eq!(adapters.len(), 3, "acme's base model and support@1, bravo's base model: {report}");
        assert!(adapters.iter().any(|r| r["tenant_id"] == a_id.as_str() && r["adapter"] == "support@1"));

        // The CSV ends with the same totals.
        let res = call_service(&app, TestRequest::get().uri("/admin/billing/report?format=csv").insert_header(bearer(&h.admin)).to_request()).await;
        assert_eq!(res.headers().get("content-type").unwrap(), "text/csv; charset=utf-8");
        let csv = String::from_utf8(read_body(res).await.to_vec()).unwrap();
        let last: Vec<&str> = csv.lines().last().unwrap().split(',').collect();
        assert_eq!(
            last[5..9],
            [all.requests.to_string(), all.prompt.to_string(), all.cached.to_string(), all.completion.to_string()]
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()[..]
        );

        // Each tenant's own view agrees, by day and by adapter; it never shows another tenant.
        for (key, t) in [(&a, 0), (&b, 1)] {
            for group in ["day", "adapter"] {
                let (s, usage) = call(&app, "GET", &format!("/v1/usage?group_by={group}"), Some(key), None).await;
                assert_eq!(s, StatusCode::OK, "{usage}");
                check(&usage["totals"], &seen[t], group);
                let rows = usage["data"].as_array().unwrap();
                let sum: i64 = rows.iter().map(|r| r["completion_tokens"].as_i64().unwrap()).sum();
                assert_eq!(sum, seen[t].completion);
            }
        }
        let (_, by_adapter) = call(&app, "GET", "/v1/usage?group_by=adapter", Some(&b), None).await;
        assert_eq!(by_adapter["data"].as_array().unwrap().len(), 1, "bravo used only the base model");
        for bad in ["/v1/usage?group_by=week", "/v1/usage?from=yesterday", "/v1/usage?colour=red"] {
            assert_eq!(call(&app, "GET", bad, Some(&a), None).await.0, StatusCode::BAD_REQUEST, "{bad}");
        }
        assert_eq!(call(&app, "GET", "/admin/billing/report?format=xml", Some(&h.admin), None).await.0, StatusCode::BAD_REQUEST);
        assert_eq!(call(&app, "GET", "/admin/billing/report", Some(&a), None).await.0, StatusCode::FORBIDDEN);
        // Nothing in the future yet.
        let (_, later) = call(&app, "GET", "/admin/billing/report?from=2100-01-01&to=2100-01-02", Some(&h.admin), None).await;
        assert_eq!(later["totals"]["requests"], 0);
    }
}

#[actix_web::test]
async fn a_client_that_leaves_is_billed_for_what_was_generated() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let res = long_stream(&app, &key).await;
        // Read a little, then hang up.
        let mut body = res.into_body();
        let first = next_chunk(&mut body).await;
        assert!(first.is_some());
        drop(body);
        assert!(h.state.jobs.drain(std::time::Duration::from_secs(10)).await, "the job ends once its client is gone");
        h.state.ledger.flush().await;
        let report = h.state.store.billing_report(0, i64::MAX, Some(&tenant_id)).await.unwrap();
        assert_eq!(report.totals.requests, 1);
        assert!(report.totals.completion_tokens >= 1 && report.totals.completion_tokens < 400, "{:?}", report.totals);
        let (outcome,): (String,) = sqlx::query_as("SELECT outcome FROM usage").fetch_one(h.state.store.pool()).await.unwrap();
        assert_eq!(outcome, "cancelled");
    }
}

/// The next chunk of a streamed body, as text; `None` at its end.
async fn next_chunk(body: &mut actix_web::body::BoxBody) -> Option<String> {
    futures::future::poll_fn(|cx| actix_web::body::MessageBody::poll_next(std::pin::Pin::new(&mut *body), cx))
        .await
        .map(|chunk| String::from_utf8(chunk.unwrap().to_vec()).unwrap())
}

/// No token waits for the database, but the end of a request does: with the database's write
/// lock held by someone else, a stream's tokens go out and its final usage does not; once the
/// lock is released it ends, and its one row is there.
#[actix_web::test]
async fn tokens_do_not_wait_for_the_ledger_and_the_end_waits_for_its_row() {
    let h = Harness::sqlite(settings()).await;
    let app = app!(h.state);
    let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;

    let mut lock = h.state.store.pool().acquire().await.unwrap();
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *lock).await.unwrap();
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let res = tokio::time::timeout(
        std::time::Duration::from_secs(8),
        call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&body).to_request()),
    )
    .await
    .expect("the stream starts while the database is locked");
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let mut text = String::new();
    // Up to the last token's chunk (the one with a finish reason): a token that ends inside a
    // character has no chunk of its own.
    while !sse_events(text.as_bytes()).iter().any(|e| e["choices"][0]["finish_reason"].is_string()) {
        let chunk =
            tokio::time::timeout(std::time::Duration::from_secs(8), next_chunk(&mut body)).await.expect("the tokens go out while the database is locked");
        text.push_str(&chunk.expect("the stream goes on"));
    }
    let so_far = sse_events(text.as_bytes());
    assert!(so_far.iter().all(|e| e.is_object() && e["usage"].is_null()), "{text}");
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(300), next_chunk(&mut body)).await.is_err(),
        "the stream ended while its ledger row could not be written"
    );
    sqlx::query("ROLLBACK").execute(&mut *lock).await.unwrap();
    drop(lock);
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(&chunk);
    }
    let events = sse_events(text.as_bytes());
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(events[events.len() - 2]["usage"]["completion_tokens"], 4, "{events:?}");
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT outcome, completion_tokens FROM usage WHERE tenant_id = $1").bind(&tenant_id).fetch_all(h.state.store.pool()).await.unwrap();
    assert_eq!(rows, vec![("ok".to_string(), 4)]);
}

/// A request still running after `open_row_after` has its `running` row written while it runs
/// (a crash of the process then leaves an `interrupted` row for it); its end completes it.
#[actix_web::test]
async fn a_long_request_has_its_row_opened_while_it_runs() {
    let h = Harness::sqlite(ApiSettings { open_row_after: std::time::Duration::from_millis(50), ..settings() }).await;
    let app = app!(h.state);
    let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
    // Eight samples of 480 tokens: seconds of work for the tiny model.
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 480, "n": 8, "ignore_eos": true, "stream": true});
    let res = call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&body).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let mut text = next_chunk(&mut body).await.unwrap();
    let rows = || async {
        sqlx::query_as::<_, (String, i64)>("SELECT outcome, completion_tokens FROM usage WHERE tenant_id = $1")
            .bind(&tenant_id)
            .fetch_all(h.state.store.pool())
            .await
            .unwrap()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match rows().await.as_slice() {
            [] => assert!(std::time::Instant::now() < deadline, "no row while the request runs"),
            [(outcome, _)] if outcome == "running" => break,
            other => panic!("{other:?} while the request runs"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    while let Some(chunk) = next_chunk(&mut body).await {
        text.push_str(&chunk);
    }
    assert_eq!(sse_events(text.as_bytes()).last().unwrap(), "[DONE]");
    assert_eq!(rows().await, vec![("ok".to_string(), 8 * 480)]);
}
