//! Batches a tenant (or the server) cannot lose control of: a line that keeps killing its server
//! is failed after a bounded number of starts, counted across restarts; a deleted tenant's batch
//! stops at once and its files go; an adapter unpublished stops reaching other tenants' batches;
//! output counts against the tenant's file storage as it is written.

use std::time::Duration;

use loraplex::bench::http::{Request, multipart};
use serde_json::{Value, json};

use super::common::*;

/// A batch input file of `lines` chat requests to `model`, `max_tokens` each, ids `l0`, `l1`...
fn input(model: &str, lines: usize, max_tokens: u32, extra: Value) -> String {
    (0..lines)
        .map(|i| {
            let mut body =
                json!({"model": model, "messages": [{"role": "user", "content": format!("line {i}")}], "max_tokens": max_tokens, "ignore_eos": true});
            if let (Value::Object(b), Value::Object(e)) = (&mut body, &extra) {
                b.extend(e.clone());
            }
            json!({"custom_id": format!("l{i}"), "method": "POST", "url": "/v1/chat/completions", "body": body}).to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl Env {
    /// Uploads `text` as a batch input file and starts a batch of it: the batch's id.
    fn batch(&self, key: &str, text: &str) -> String {
        let (ctype, form) = multipart(&[("purpose", b"batch"), ("file", text.as_bytes())]);
        let file = self.http.send(&Request::new("POST", "/v1/files").key(key).body(&ctype, &form)).unwrap();
        assert_eq!(file.status, 200, "{}", file.text());
        let body = json!({"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"});
        let b = self.call(Some(key), "POST", "/v1/batches", Some(body));
        assert_eq!(b.status, 200, "{}", b.text());
        b.json()["id"].as_str().unwrap().to_string()
    }

    fn batch_status(&self, key: &str, id: &str) -> Value {
        self.call(Some(key), "GET", &format!("/v1/batches/{id}"), None).json()
    }

    /// Waits until batch `id` has ended; its object.
    fn batch_end(&self, key: &str, id: &str, secs: u64) -> Value {
        let mut last = Value::Null;
        self.wait_for(&format!("batch {id} to end"), secs, || {
            last = self.batch_status(key, id);
            matches!(last["status"].as_str(), Some("completed" | "failed" | "cancelled" | "expired"))
        });
        last
    }

    fn file_text(&self, key: &str, id: &str) -> String {
        self.call(Some(key), "GET", &format!("/v1/files/{id}/content"), None).text()
    }

    fn count(&self, sql: &str) -> i64 {
        self.query(sql)[0][0].parse().unwrap()
    }
}

#[test]
fn a_line_whose_server_dies_each_time_it_runs_is_failed_after_three_starts_and_the_batch_goes_on() {
    for db in databases() {
        let mut env = Env::start(&db, &["--batch-concurrency", "1"]);
        let mut cases = Cases::default();
        let (_, key) = env.tenant("acme", json!({}));
        // The first line is long enough to be killed while it runs; the others are short.
        let mut text = input(MODEL, 1, 400, json!({}));
        text.push('\n');
        text.push_str(&input(MODEL, 3, 2, json!({})).replace("\"l0\"", "\"s0\"").replace("\"l1\"", "\"s1\"").replace("\"l2\"", "\"s2\""));
        let id = env.batch(&key, &text);
        for start in 1..=3 {
            env.wait_for(&format!("start {start} of the long line"), 60, || {
                env.count(&format!("SELECT COALESCE(MAX(tries), 0) FROM batch_tries WHERE batch_id = '{id}' AND line = 0")) == start
            });
            env.crash_and_restart();
        }
        let end = env.batch_end(&key, &id, 120);
        cases.ok("the batch completed", end["status"] == "completed", &end);
        cases.ok("three lines succeeded, one failed", end["request_counts"] == json!({"total": 4, "completed": 3, "failed": 1}), &end["request_counts"]);
        let errors = env.file_text(&key, end["error_file_id"].as_str().unwrap_or_default());
        let line: Value = serde_json::from_str(errors.lines().next().unwrap_or("null")).unwrap_or(Value::Null);
        cases.ok("the long line is in the error file, abandoned", line["custom_id"] == "l0" && line["error"]["code"] == "line_abandoned", &errors);
        cases.ok("its message says why", line["error"]["message"].as_str().is_some_and(|m| m.contains("started 3 times")), &errors);
        let running = env.count(&format!("SELECT COUNT(*) FROM usage WHERE batch_id = '{id}' AND outcome = 'running'"));
        cases.ok("no ledger row is left running", running == 0, running);
        cases.check("the server serves", &env.complete(&key, MODEL, 2), 200, "choices");
        cases.finish(&format!("abandoned lines on {}", env.kind()));
    }
}

#[test]
fn deleting_a_tenant_stops_its_batch_before_the_answer_and_removes_its_files() {
    for db in databases() {
        let env = Env::start(&db, &["--batch-concurrency", "2"]);
        let mut cases = Cases::default();
        let (tenant, key) = env.tenant("leaving", json!({}));
        let id = env.batch(&key, &input(MODEL, 300, 12, json!({})));
        env.wait_for("a few lines to finish", 60, || env.count(&format!("SELECT COUNT(*) FROM batch_results WHERE batch_id = '{id}'")) >= 4);
        let before: Vec<String> = std::fs::read_dir(env.data().join("files")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        cases.ok("its input file is on disk", !before.is_empty(), format!("{before:?}"));
        let res = env.admin("DELETE", &format!("/admin/tenants/{tenant}"), None);
        let answered = loraplex::store::now_ms();
        cases.check("the tenant is deleted", &res, 204, "");
        // Whatever was in flight ends; nothing starts after the answer.
        env.wait_for("the batch to end", 60, || env.query(&format!("SELECT status FROM batches WHERE id = '{id}'"))[0][0] == "cancelled");
        std::thread::sleep(Duration::from_millis(300));
        let late = env.count(&format!("SELECT COUNT(*) FROM usage WHERE batch_id = '{id}' AND started_at > {answered}"));
        cases.ok("no line started after the delete was answered", late == 0, late);
        let total = env.count(&format!("SELECT COUNT(*) FROM usage WHERE batch_id = '{id}'"));
        cases.ok("the batch was stopped, not run to its end", total < 300, total);
        let billed_after = env
            .count(&format!("SELECT COUNT(*) FROM usage WHERE batch_id = '{id}' AND finished_at > {answered} AND (prompt_price > 0 OR completion_price > 0)"));
        cases.ok("lines stopped by the delete are not billed", billed_after == 0, billed_after);
        let live = env.count(&format!("SELECT COUNT(*) FROM files WHERE tenant_id = '{tenant}' AND deleted_at IS NULL"));
        cases.ok("no live file is left (no output was written)", live == 0, live);
        let after: Vec<String> =
            std::fs::read_dir(env.data().join("files")).map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default();
        cases.ok("its files are gone from disk", after.is_empty(), format!("{after:?}"));
        let (_, other) = env.tenant("staying", json!({}));
        cases.check("the server serves", &env.complete(&other, MODEL, 2), 200, "choices");
        cases.finish(&format!("deleted tenant's batch on {}", env.kind()));
    }
}

#[test]
fn an_unpublished_adapter_stops_reaching_other_tenants_batches() {
    for db in databases() {
        let env = Env::start(&db, &["--batch-concurrency", "2"]);
        let mut cases = Cases::default();
        let (_, key) = env.tenant("user", json!({}));
        let files = adapter_files(1, 9);
        assert_eq!(env.upload(ADMIN, "shared", &files[0].0, &files[0].1).status, 201);
        assert_eq!(env.admin("POST", "/admin/adapters/publish", Some(json!({"name": "shared"}))).status, 200);
        let id = env.batch(&key, &input("shared", 200, 12, json!({})));
        env.wait_for("a few lines to finish", 60, || env.count(&format!("SELECT COUNT(*) FROM batch_results WHERE batch_id = '{id}'")) >= 4);
        let res = env.admin("POST", "/admin/adapters/publish", Some(json!({"name": "shared", "public": false})));
        cases.check("unpublished", &res, 200, "");
        let answered = loraplex::store::now_ms();
        let end = env.batch_end(&key, &id, 120);
        let late = env.count(&format!("SELECT COUNT(*) FROM usage WHERE batch_id = '{id}' AND started_at > {answered}"));
        cases.ok("no line ran on the adapter after it was unpublished", late == 0, late);
        let failed = end["request_counts"]["failed"].as_i64().unwrap_or(0);
        cases.ok("the lines after it failed", failed > 100, &end["request_counts"]);
        let errors = env.file_text(&key, end["error_file_id"].as_str().unwrap_or_default());
        cases.ok(
            "each says the adapter is no longer usable",
            errors.lines().next().is_some_and(|l| l.contains("no longer one you may use")),
            errors.lines().next().unwrap_or(""),
        );
        cases.finish(&format!("unpublished adapter on {}", env.kind()));
    }
}

#[test]
fn a_batch_whose_output_reaches_the_storage_limit_stops_with_a_clear_error() {
    for db in databases() {
        let env = Env::start(&db, &["--batch-concurrency", "2", "--max-tenant-files-mb", "1"]);
        let mut cases = Cases::default();
        let (tenant, key) = env.tenant("verbose", json!({}));
        // About 100 kB of output a line: 60 tokens with 20 alternatives each.
        let id = env.batch(&key, &input(MODEL, 60, 80, json!({"logprobs": true, "top_logprobs": 20})));
        let end = env.batch_end(&key, &id, 120);
        cases.ok("the batch failed", end["status"] == "failed", &end["status"]);
        let message = end["errors"]["data"][0]["message"].as_str().unwrap_or_default().to_string();
        cases.ok("its error names the storage limit", message.contains("file storage limit of 1048576 bytes"), &message);
        let done = end["request_counts"]["completed"].as_i64().unwrap_or(0);
        cases.ok("it stopped early", (1..60).contains(&done), &end["request_counts"]);
        let held = env.count(&format!("SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM files WHERE tenant_id = '{tenant}' AND deleted_at IS NULL"));
        // The limit, and at most the lines that were in flight when it was reached.
        cases.ok("the tenant holds about its limit, not more", held <= (1 << 20) + 3 * 150_000, held);
        let output = env.file_text(&key, end["output_file_id"].as_str().unwrap_or_default());
        cases.ok("what finished is in the output file", output.lines().count() as i64 == done, output.lines().count());
        // A new upload is refused while the output holds the space.
        let (ctype, form) = multipart(&[("purpose", b"batch"), ("file", input(MODEL, 1, 2, json!({})).as_bytes())]);
        let res = env.http.send(&Request::new("POST", "/v1/files").key(&key).body(&ctype, &form)).unwrap();
        cases.check("an upload past the limit", &res, 429, "file storage limit");
        cases.finish(&format!("output quota on {}", env.kind()));
    }
}
