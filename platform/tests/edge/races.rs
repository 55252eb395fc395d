//! Concurrency and disconnects: uploads and deletes of one name at once, patches at once,
//! clients that hang up (streaming or not, running or queued), and reports that agree.

use std::io::{Read, Write};
use std::time::Duration;

use loraplex::bench::http::{Request, multipart};
use serde_json::json;

use super::common::*;

#[test]
fn concurrent_uploads_and_deletes_of_one_name_only_succeed_or_refuse_and_versions_stay_contiguous() {
    for db in databases() {
        let env = Env::start(&db, &["--max-uploads-per-key", "32"]);
        let mut cases = Cases::default();
        let (id, key) = env.tenant("acme", json!({}));
        let files = adapter_files(1, 51);
        let (ctype, body) = multipart(&[("name", b"hot"), ("config", &files[0].0), ("weights", &files[0].1)]);
        let results: Vec<(bool, u16, String)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..32)
                .map(|i| {
                    let (env, key, ctype, body) = (&env, &key, &ctype, &body);
                    s.spawn(move || {
                        if i % 2 == 0 {
                            let res = env.http.send(&Request::new("POST", "/v1/adapters").key(key).body(ctype, body)).unwrap();
                            (true, res.status, res.text())
                        } else {
                            let res = env.call(Some(key), "DELETE", "/v1/adapters/hot", None);
                            (false, res.status, res.text())
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (upload, status, text) in &results {
            let what = if *upload { "upload" } else { "delete" };
            cases.ok(&format!("{what}: a 2xx or a 4xx"), (200..300).contains(status) || (400..500).contains(status), format!("{status} {text}"));
            if !upload && *status == 404 {
                cases.ok("a delete that found nothing says so", text.contains("not found"), text);
            }
        }
        let uploaded = results.iter().filter(|(u, s, _)| *u && *s == 201).count();
        cases.ok("every upload succeeded", uploaded == 16, uploaded);
        let versions: Vec<i64> = env
            .query(&format!("SELECT version FROM adapters WHERE owner = '{id}' AND name = 'hot' ORDER BY version"))
            .into_iter()
            .map(|r| r[0].parse().unwrap())
            .collect();
        cases.ok("versions are contiguous", versions == (1..=versions.len() as i64).collect::<Vec<_>>(), format!("{versions:?}"));
        cases.ok("one row per upload", versions.len() == 16, versions.len());
        // Every version a delete answered for is deleted, with its files gone.
        for (upload, status, text) in &results {
            if *upload || *status != 200 {
                continue;
            }
            let body: serde_json::Value = serde_json::from_str(text).unwrap();
            for v in body["deleted_versions"].as_array().unwrap() {
                let row = env.query(&format!("SELECT deleted_at, blob FROM adapters WHERE owner = '{id}' AND name = 'hot' AND version = {v}"));
                cases.ok(&format!("version {v} deleted"), row[0][0] != "NULL", format!("{row:?}"));
                let blob = env.data().join(&row[0][1]);
                env.wait_for("deleted files to go", 10, || !blob.exists());
            }
        }
        let live: Vec<String> =
            env.query(&format!("SELECT blob FROM adapters WHERE owner = '{id}' AND deleted_at IS NULL")).into_iter().map(|r| r[0].clone()).collect();
        cases.ok("live versions keep their files", live.iter().all(|b| env.data().join(b).is_dir()), format!("{live:?}"));

        // Patches of different fields at once: none undoes another (a merge patch in one write
        // transaction each).
        let fields = ["requests_per_min", "tokens_per_min", "max_concurrent", "max_adapters", "max_adapter_bytes", "max_pinned_pages"];
        std::thread::scope(|s| {
            for (i, f) in fields.iter().enumerate() {
                let env = &env;
                let id = &id;
                s.spawn(move || {
                    let res = env.admin("PATCH", &format!("/admin/tenants/{id}"), Some(json!({"limits": {*f: 1000 + i}})));
                    assert_eq!(res.status, 200, "{}", res.text());
                });
            }
        });
        let t = env.admin("GET", &format!("/admin/tenants/{id}"), None).json();
        for (i, f) in fields.iter().enumerate() {
            cases.ok(&format!("patched {f}"), t[*f] == 1000 + i, &t);
        }
        cases.check(
            "null clears a limit",
            &env.admin("PATCH", &format!("/admin/tenants/{id}"), Some(json!({"limits": {"max_concurrent": null}}))),
            200,
            "\"max_concurrent\":null",
        );
        cases.check("weight cannot be null", &env.admin("PATCH", &format!("/admin/tenants/{id}"), Some(json!({"weight": null}))), 400, "cannot be cleared");
        cases.check("limits cannot be null", &env.admin("PATCH", &format!("/admin/tenants/{id}"), Some(json!({"limits": null}))), 400, "cannot be null");
        cases.check("a patch is an object", &env.admin("PATCH", &format!("/admin/tenants/{id}"), Some(json!([1]))), 400, "JSON object");
        let after = env.admin("GET", &format!("/admin/tenants/{id}"), None).json();
        cases.ok("an absent field is unchanged", after["requests_per_min"] == 1000 && after["max_concurrent"].is_null(), &after);
        cases.finish(&format!("races on {}", env.kind()));
    }
}

/// The ledger row of the only request of tenant `id` once it is no longer running.
fn final_row(env: &Env, id: &str) -> (String, i64) {
    let mut row = Vec::new();
    env.wait_for("the request's row", 30, || {
        row = env.query(&format!("SELECT outcome, completion_tokens FROM usage WHERE tenant_id = '{id}' AND outcome <> 'running'"));
        !row.is_empty()
    });
    (row[0][0].clone(), row[0][1].parse().unwrap())
}

#[test]
fn a_client_that_hangs_up_cancels_its_request_streaming_or_not() {
    for db in databases() {
        let env = Env::start(&db, &[]);
        let mut cases = Cases::default();
        let running = || {
            let text = env.admin("GET", "/metrics", None).text();
            text.lines().find(|l| l.starts_with("vllm:num_requests_running ")).and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).unwrap()
        };
        for (name, stream) in [("non-streaming", false), ("streaming", true)] {
            let (id, key) = env.tenant(name, json!({}));
            let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 480, "ignore_eos": true, "stream": stream}).to_string();
            let mut s = env.http.open(&Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes())).unwrap();
            s.write_all(body.as_bytes()).unwrap();
            if stream {
                // Read until the first token arrives, then hang up.
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while !String::from_utf8_lossy(&got).contains("\"text\"") {
                    let n = s.read(&mut buf).unwrap();
                    got.extend_from_slice(&buf[..n]);
                }
            } else {
                env.wait_for("generation to start", 30, || running() > 0.0);
            }
            drop(s);
            let (outcome, completion) = final_row(&env, &id);
            cases.ok(&format!("{name}: recorded as cancelled"), outcome == "cancelled", &outcome);
            cases.ok(&format!("{name}: with what was generated until then"), (1..480).contains(&completion), completion);
            env.wait_for("generation to stop", 10, || running() == 0.0);
            cases.ok(&format!("{name}: generation stopped"), running() == 0.0, "");
        }
        // A request still queued (its adapter still loading, or behind others) is cancelled too.
        let (id, key) = env.tenant("quick-hangup", json!({}));
        let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 480, "ignore_eos": true}).to_string();
        let mut s = env.http.open(&Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes())).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
        drop(s);
        // Either the request never got in (no row), or it was cancelled: never run to its end.
        std::thread::sleep(Duration::from_secs(2));
        env.wait_for("no request running", 10, || running() == 0.0);
        let rows = env.query(&format!("SELECT outcome, completion_tokens FROM usage WHERE tenant_id = '{id}'"));
        cases.ok(
            "hung up at once: cancelled or never admitted",
            rows.iter().all(|r| r[0] == "cancelled" && r[1].parse::<i64>().unwrap() < 480),
            format!("{rows:?}"),
        );
        // The bill never charges a request for more than it generated; the CSV and JSON reports
        // agree line by line, dates as YYYY-MM-DD in both.
        let json_report = env.admin("GET", "/admin/billing/report", None).json();
        let csv = env.admin("GET", "/admin/billing/report?format=csv", None).text();
        let rows: Vec<Vec<String>> = csv.lines().skip(1).map(|l| l.split(',').map(str::to_string).collect()).collect();
        for l in json_report["lines"].as_array().unwrap() {
            let want = [&l["tenant_id"], &l["tenant"], &l["plan"], &l["adapter"], &l["date"]].map(|v| v.as_str().unwrap().to_string());
            let found = rows.iter().find(|r| r[..5] == want);
            cases.ok(
                "a JSON line is a CSV row",
                found.is_some_and(|r| r[5] == l["requests"].as_i64().unwrap_or(-1).to_string() && r[10] == l["cost"].as_str().unwrap()),
                format!("{l} in\n{csv}"),
            );
            cases.ok("dates are YYYY-MM-DD", l["date"].as_str().is_some_and(|d| d.len() == 10 && d.as_bytes()[4] == b'-'), l);
        }
        for t in json_report["tenants"].as_array().unwrap() {
            let found = rows.iter().any(|r| r[0] == t["tenant_id"].as_str().unwrap() && r[1] == t["tenant"].as_str().unwrap() && r[4] == "*");
            cases.ok("a tenant total carries its name in both", found && t["tenant"].as_str().is_some_and(|n| !n.is_empty()), t);
        }
        cases.ok("money is a decimal string", json_report["totals"]["cost"].as_str().is_some_and(|c| c.contains('.')), &json_report["totals"]);
        cases.finish(&format!("disconnects on {}", env.kind()));
    }
}
