//! Limits: a tenant's rate and concurrency limits, the server's admission bounds (429 for a
//! tenant over its share, 503 for a full server, both with Retry-After), and pins of adapters
//! (each holder's own, capped per tenant and for the pool).

use std::time::Duration;

use loraplex::bench::http::Request;
use serde_json::{Value, json};

use super::common::*;

/// Starts a long stream for `key` and returns once its first token arrived; the stream goes on
/// in a thread until it ends, which yields the tokens its usage counted.
fn hold_stream(env: &Env, key: &str, tokens: u32) -> std::thread::JoinHandle<u64> {
    let (client, key) = (env.http.clone(), key.to_string());
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let body = json!({"model": MODEL, "prompt": "x", "max_tokens": tokens, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}})
        .to_string();
        let mut n = 0;
        let _ = client.stream(&Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes()), |data, _| {
            if let Ok(v) = serde_json::from_str::<Value>(data)
                && let Some(tokens) = v["usage"]["completion_tokens"].as_u64()
            {
                n = tokens;
            }
            let _ = tx.send(());
            true
        });
        n
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("the stream started");
    handle
}

#[test]
fn rate_limits_admission_and_pins_refuse_with_the_right_status() {
    for db in databases() {
        let env = Env::start(&db, &["--max-pending", "4", "--max-pending-per-tenant", "3", "--max-pinned-percent", "10", "--tenant-pinned-percent", "5"]);
        let mut cases = Cases::default();
        let retry = |res: &loraplex::bench::http::Response| res.header("retry-after").and_then(|v| v.parse::<u64>().ok());

        // Requests per minute.
        let (_, rpm) = env.tenant("rpm", json!({"requests_per_min": 3}));
        for i in 0..3 {
            cases.check(&format!("request {i} within the minute"), &env.complete(&rpm, MODEL, 1), 200, "");
        }
        let res = env.complete(&rpm, MODEL, 1);
        cases.check("the fourth in a minute", &res, 429, "per minute");
        cases.ok("with a Retry-After under a minute", retry(&res).is_some_and(|s| (1..=60).contains(&s)), format!("{:?}", res.header("retry-after")));
        // Tokens per minute: one request that could never fit is a 400; one that fits later a 429.
        let (_, tpm) = env.tenant("tpm", json!({"tokens_per_min": 100}));
        cases.check("more tokens than a minute allows", &env.complete(&tpm, MODEL, 200), 400, "tokens per minute");
        cases.check("60 of 100 tokens", &env.complete(&tpm, MODEL, 58), 200, "");
        cases.check("another 60 of 100", &env.complete(&tpm, MODEL, 58), 429, "too many tokens");
        // Concurrency.
        let (_, conc) = env.tenant("conc", json!({"max_concurrent": 1}));
        let running = hold_stream(&env, &conc, 300);
        let res = env.complete(&conc, MODEL, 1);
        cases.check("a second concurrent request", &res, 429, "concurrent");
        cases.ok("retry in a second", retry(&res) == Some(1), format!("{:?}", res.header("retry-after")));
        cases.ok("the first stream ran to its end", running.join().unwrap() == 300, "");

        // A tenant cannot hold more bodies in flight than it may run requests: stalled bodies
        // take its concurrency, and a body cut off gives the place back.
        let (_, staller) = env.tenant("staller", json!({"max_concurrent": 2, "requests_per_min": 100}));
        let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 1}).to_string();
        let req = Request::new("POST", "/v1/completions").key(&staller).body("application/json", body.as_bytes());
        let stalls: Vec<_> = (0..2).map(|_| env.http.open(&req).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(300));
        cases.check("a third request while two bodies stall", &env.complete(&staller, MODEL, 1), 429, "concurrent");
        drop(stalls);
        env.wait_for("the stalled bodies to give their places back", 10, || env.complete(&staller, MODEL, 1).status == 200);
        cases.ok("places given back", true, "");
        // Uploads count against the requests per minute too.
        let (_, uploader) = env.tenant("uploader", json!({"requests_per_min": 2}));
        let one = adapter_files(1, 61).remove(0);
        cases.check("upload 1 of 2 in a minute", &env.upload(&uploader, "u1", &one.0, &one.1), 201, "");
        cases.check("upload 2 of 2 in a minute", &env.upload(&uploader, "u2", &one.0, &one.1), 201, "");
        cases.check("upload 3 in a minute", &env.upload(&uploader, "u3", &one.0, &one.1), 429, "per minute");

        // Admission: at most 3 sequences of one tenant, 4 on the server.
        let (_, a) = env.tenant("hog", json!({}));
        let (_, b) = env.tenant("small", json!({}));
        let streams: Vec<_> = (0..3).map(|_| hold_stream(&env, &a, 400)).collect();
        let res = env.complete(&a, MODEL, 1);
        cases.check("the hog's fourth sequence", &res, 429, "in flight");
        cases.ok("429 with Retry-After", retry(&res).is_some(), "");
        let n = env.call(Some(&b), "POST", "/v1/completions", Some(json!({"model": MODEL, "prompt": "x", "n": 5})));
        cases.check("more sequences than one tenant may ever have", &n, 400, "sequences");
        let small = hold_stream(&env, &b, 400);
        let res = env.complete(&b, MODEL, 1);
        cases.check("the server is full and the small tenant within its share", &res, 503, "server is full");
        cases.ok("503 with Retry-After", retry(&res).is_some(), "");
        let res = env.complete(&a, MODEL, 1);
        cases.ok("the hog over its share of a full server gets 429", res.status == 429, res.text());
        for s in streams {
            s.join().unwrap();
        }
        small.join().unwrap();
        cases.check("room again", &env.complete(&b, MODEL, 1), 200, "");

        // Pins: each holder's own, capped.
        let files = adapter_files(3, 31);
        assert_eq!(env.upload(ADMIN, "shared", &files[0].0, &files[0].1).status, 201);
        assert_eq!(env.admin("POST", "/admin/adapters/publish", Some(json!({"name": "shared"}))).status, 200);
        let (_, pinner) = env.tenant("pinner", json!({}));
        let (_, none) = env.tenant("nopins", json!({"max_pinned_pages": 0}));
        assert_eq!(env.upload(&pinner, "mine", &files[1].0, &files[1].1).status, 201);
        assert_eq!(env.upload(&none, "theirs", &files[2].0, &files[2].1).status, 201);
        let reclaimable = || {
            let text = env.admin("GET", "/metrics", None).text();
            text.lines()
                .find(|l| l.starts_with("loraplex_pool_pages{worker=\"0\",kind=\"reclaimable\"}"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .unwrap()
        };
        cases.check("a tenant without pin pages", &env.call(Some(&none), "POST", "/v1/adapters/theirs/load", None), 429, "your limit of 0");
        cases.check("the operator pins the published adapter", &env.admin("POST", "/v1/adapters/shared/load", None), 200, "\"held\":true");
        let pinned = reclaimable();
        cases.check("a tenant pins it too", &env.call(Some(&pinner), "POST", "/v1/adapters/shared/load", None), 200, "\"held\":true");
        cases.check("and lets its own pin go", &env.call(Some(&pinner), "POST", "/v1/adapters/shared/unload", None), 200, "\"released\":true");
        cases.check("it has no other pin to let go", &env.call(Some(&pinner), "POST", "/v1/adapters/shared/unload", None), 200, "\"released\":false");
        cases.ok("the operator's pin stays", reclaimable() == pinned, format!("{} vs {pinned}", reclaimable()));
        cases.check("the operator lets go", &env.admin("POST", "/v1/adapters/shared/unload", None), 200, "\"released\":true");
        cases.ok("then its pages are reclaimable", reclaimable() > pinned, format!("{} vs {pinned}", reclaimable()));
        cases.check("the tenant pins its own", &env.call(Some(&pinner), "POST", "/v1/adapters/mine/load", None), 200, "\"held\":true");
        cases.finish(&format!("limits on {}", env.kind()));
    }
}

#[test]
fn pins_never_take_the_share_of_the_pool_requests_need() {
    let db = databases().remove(0);
    let env = Env::start(&db, &["--max-pinned-percent", "0"]);
    let mut cases = Cases::default();
    let (_, key) = env.tenant("acme", json!({"max_pinned_pages": 100000}));
    let files = adapter_files(1, 41);
    assert_eq!(env.upload(&key, "a", &files[0].0, &files[0].1).status, 201);
    let res = env.call(Some(&key), "POST", "/v1/adapters/a/load", None);
    cases.check("no share of the pool for pins", &res, 503, "the server allows");
    cases.ok("with Retry-After", res.header("retry-after").is_some(), "");
    cases.check("the adapter still serves", &env.complete(&key, "a", 2), 200, "choices");
    // A pin storm counts against the tenant's requests per minute (the upload is the first).
    let (_, storm) = env.tenant("storm", json!({"requests_per_min": 4}));
    assert_eq!(env.upload(&storm, "b", &files[0].0, &files[0].1).status, 201);
    for i in 0..3 {
        let res = env.call(Some(&storm), "POST", "/v1/adapters/b/unload", None);
        cases.check(&format!("unload {i}"), &res, 200, "released");
    }
    cases.check("the fifth pin request in a minute", &env.call(Some(&storm), "POST", "/v1/adapters/b/load", None), 429, "per minute");
    cases.finish("pool share for pins");
}
