//! kill -9 under load: after a restart on the same data, the bill is exactly what clients were
//! told they used plus the interrupted requests (recorded, not charged), and the database is
//! intact. With `--open-row-after-ms 0` every request that was not answered is an interrupted
//! row; by default only those that had run for more than the setting are, the others leave no
//! row (and cost nothing either way).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use loraplex::bench::http::Request;
use serde_json::{Value, json};

use super::common::*;

#[test]
fn a_crash_under_load_leaves_an_exact_bill_and_an_intact_database() {
    for (db, open_after) in databases().into_iter().flat_map(|db| [(db.clone(), "0"), (db, "1000")]) {
        // Every row opened before its request runs, or only those of requests that ran a while.
        let strict = open_after == "0";
        let mut env = Env::start(&db, &["--open-row-after-ms", open_after]);
        let mut cases = Cases::default();
        let (id, key) = env.tenant("acme", json!({}));
        // Usage objects clients received (their final events), and streams that got a token.
        let received: Arc<Mutex<Vec<Value>>> = Arc::default();
        let started = Arc::new(Mutex::new(0usize));
        let mut clients = Vec::new();
        for i in 0..12 {
            let (client, key, received, started) = (env.http.clone(), key.clone(), received.clone(), started.clone());
            let long = i >= 4;
            clients.push(std::thread::spawn(move || {
                let max_tokens = if long { 480 } else { 3 };
                let body = json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": max_tokens, "ignore_eos": true, "stream": true,
                    "stream_options": {"include_usage": true}})
                .to_string();
                let mut counted = false;
                let _ = client.stream(&Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes()), |data, _| {
                    if !counted {
                        counted = true;
                        *started.lock().unwrap() += 1;
                    }
                    if let Ok(v) = serde_json::from_str::<Value>(data)
                        && v["usage"].is_object()
                    {
                        received.lock().unwrap().push(v["usage"].clone());
                    }
                    true
                });
            }));
            if !long {
                // The short ones finish before the crash.
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        env.wait_for("every stream to be generating", 60, || *started.lock().unwrap() == 12 && received.lock().unwrap().len() >= 4);
        env.crash_and_restart();
        for c in clients {
            c.join().unwrap();
        }
        let received = received.lock().unwrap().clone();
        cases.ok("the four short requests were answered before the crash, not every long one", (4..12).contains(&received.len()), received.len());

        let rows = env.query(&format!("SELECT outcome, prompt_tokens, completion_tokens, prompt_price, completion_price FROM usage WHERE tenant_id = '{id}'"));
        let count = |o: &str| rows.iter().filter(|r| r[0] == o).count();
        cases.ok("no row is left running", count("running") == 0, format!("{rows:?}"));
        cases.ok("every answered request is an ok row", count("ok") == received.len(), format!("{rows:?}"));
        if strict {
            cases.ok("every unanswered request is an interrupted row", count("interrupted") == 12 - received.len(), format!("{rows:?}"));
        } else {
            cases.ok("an unanswered request is an interrupted row or none", count("interrupted") <= 12 - received.len(), format!("{rows:?}"));
        }
        cases.ok("interrupted rows are not charged", rows.iter().filter(|r| r[0] == "interrupted").all(|r| r[3] == "0" && r[4] == "0"), format!("{rows:?}"));
        let report = env.admin("GET", &format!("/admin/billing/report?tenant_id={id}"), None).json();
        let sum = |f: &str| received.iter().map(|u| u[f].as_i64().unwrap()).sum::<i64>();
        let interrupted_prompt: i64 = rows.iter().filter(|r| r[0] == "interrupted").map(|r| r[1].parse::<i64>().unwrap()).sum();
        let totals = &report["totals"];
        cases.ok("requests billed: the answered plus the interrupted", totals["requests"] == (received.len() + count("interrupted")) as i64, totals);
        cases.ok(
            "prompt tokens: what clients were told plus the interrupted prompts",
            totals["prompt_tokens"] == sum("prompt_tokens") + interrupted_prompt,
            totals,
        );
        cases.ok("completion tokens: exactly what clients were told", totals["completion_tokens"] == sum("completion_tokens"), totals);
        // The cost is the answered requests' alone: the standard plan's $0.50, $0.125 and $1.50
        // per million uncached prompt, cached prompt and completion tokens.
        use loraplex::store::Money;
        let cached: i64 = received.iter().map(|u| u["prompt_tokens_details"]["cached_tokens"].as_i64().unwrap()).sum();
        let expect = [(sum("prompt_tokens") - cached, 500_000), (cached, 125_000), (sum("completion_tokens"), 1_500_000)]
            .into_iter()
            .fold(Money::ZERO, |m, (tokens, price)| m.checked_add(Money::of(tokens, price)).unwrap());
        cases.ok("the cost is the answered requests'", totals["cost"] == expect.dollars().as_str(), format!("{} vs {}", totals["cost"], expect.dollars()));
        if env.kind() == "sqlite" {
            let check = env.query("PRAGMA integrity_check");
            cases.ok("PRAGMA integrity_check", check[0][0] == "ok", format!("{check:?}"));
        }
        cases.check("the server serves after the crash", &env.complete(&key, MODEL, 2), 200, "choices");
        cases.finish(&format!("crash on {}, rows opened after {open_after} ms", env.kind()));
    }
}
