//! Three replicas of `loraplex serve` on one machine, as a cluster runs them: on 127.0.0.1,
//! 127.0.0.2 and 127.0.0.3, sharing one PostgreSQL database (a new one on the server
//! `LORAPLEX_TEST_POSTGRES` names; `.ci/run` starts it) and one S3-compatible object store (moto's
//! server, run by the Python of `LORAPLEX_TEST_PYTHON`; `.ci/run` installs it). Without both the
//! test says it skipped, unless `LORAPLEX_REQUIRE_POSTGRES` asks for them.
//!
//! The metrics are checked against the model-server protocol of the Gateway API Inference
//! Extension (`deploy/schemas/gie/SOURCE.md` says where it comes from; the protocol is
//! `docs/proposals/003-model-server-protocol/README.md` of kubernetes-sigs/
//! gateway-api-inference-extension): `vllm:num_requests_waiting`, `vllm:num_requests_running` and
//! `vllm:kv_cache_usage_perc` gauges, and the `vllm:lora_requests_info` gauge whose value is a
//! timestamp and whose labels are `running_lora_adapters` (adapters loaded and ready to serve,
//! comma-separated), `waiting_lora_adapters` and `max_lora`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use loraplex::bench::http::{Client, Request, multipart};
use loraplex::bench::server::Server;
use serde_json::{Value, json};

const ADMIN: &str = "operator-key-0123456789";
const BUCKET: &str = "loraplex-test";

/// moto's S3 server, stopped when dropped.
struct Moto {
    child: Child,
    endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One plain HTTP/1.1 request to the S3 server (moto takes unsigned requests); status, body.
fn s3(endpoint: &str, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(endpoint.trim_start_matches("http://")).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", endpoint.trim_start_matches("http://")).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

fn start_moto(python: &Path) -> Moto {
    let port = free_port();
    let child = Command::new(python)
        .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting moto's server (pip install 'moto[server]')");
    let moto = Moto { child, endpoint: format!("http://127.0.0.1:{port}") };
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "moto's server did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = s3(&moto.endpoint, "PUT", &format!("/{BUCKET}"));
    assert_eq!(status, 200, "creating the bucket: {body}");
    moto
}

/// A new database on the test PostgreSQL server.
fn fresh_database(url: &str) -> String {
    let name = format!("cluster_{}", std::process::id());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        sqlx::any::install_default_drivers();
        let admin = sqlx::AnyPool::connect(url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}"))).execute(&admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.unwrap();
        admin.close().await;
    });
    format!("{}/{name}", url.rsplit_once('/').map_or(url, |(b, _)| b))
}

fn json(c: &Client, method: &str, path: &str, key: &str, body: Option<Value>) -> (u16, Value) {
    let r = c.json(method, path, Some(key), body.as_ref()).unwrap();
    (r.status, r.json())
}

fn metrics(addr: &str) -> String {
    Client::new(addr).send(&Request::new("GET", "/metrics")).unwrap().text()
}

/// The names in `running_lora_adapters` of a metrics page, checked against the protocol's
/// shape on the way.
fn running_adapters(page: &str) -> Vec<String> {
    assert!(page.contains("# TYPE vllm:lora_requests_info gauge"), "{page}");
    for gauge in ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"] {
        assert!(page.contains(&format!("# TYPE {gauge} gauge")), "{gauge}");
        let value: f64 = page.lines().find_map(|l| l.strip_prefix(&format!("{gauge} "))).unwrap().parse().unwrap();
        assert!(value >= 0.0 && (gauge != "vllm:kv_cache_usage_perc" || value <= 1.0), "{gauge} {value}");
    }
    let line = page.lines().find(|l| l.starts_with("vllm:lora_requests_info{")).expect("a vllm:lora_requests_info series");
    let (labels, value) = line.strip_prefix("vllm:lora_requests_info{").unwrap().split_once("} ").unwrap();
    // The value is the time it was last updated, in seconds since the epoch.
    let at: f64 = value.parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((now - at).abs() < 60.0, "{line}");
    let label =
        |name: &str| labels.split(&format!("{name}=\"")).nth(1).and_then(|r| r.split('"').next()).unwrap_or_else(|| panic!("no {name}: {line}")).to_string();
    assert!(label("max_lora").parse::<u32>().unwrap() > 0, "{line}");
    let _ = label("waiting_lora_adapters");
    label("running_lora_adapters").split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()
}

/// Greedy text of `model` for a fixed prompt on one replica.
fn greedy(c: &Client, key: &str, model: &str) -> (u16, String, Value) {
    let body = json!({"model": model, "prompt": "the cluster says", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, v) = json(c, "POST", "/v1/completions", key, Some(body));
    (status, v["choices"][0]["text"].as_str().unwrap_or_default().to_string(), v["usage"].clone())
}

fn requirements() -> Option<(String, PathBuf)> {
    let pg = std::env::var("LORAPLEX_TEST_POSTGRES").ok();
    let python = std::env::var_os("LORAPLEX_TEST_PYTHON").map(PathBuf::from);
    match (pg, python) {
        (Some(pg), Some(py)) => Some((pg, py)),
        _ => {
            assert!(std::env::var_os("LORAPLEX_REQUIRE_POSTGRES").is_none(), "the cluster test needs LORAPLEX_TEST_POSTGRES and LORAPLEX_TEST_PYTHON");
            eprintln!("the cluster test needs LORAPLEX_TEST_POSTGRES and LORAPLEX_TEST_PYTHON (with moto): skipped (.ci/run sets both)");
            None
        }
    }
}

#[test]
fn three_replicas_share_adapters_limits_and_the_ledger() {
    let Some((pg, python)) = requirements() else { return };
    let moto = start_moto(&python);
    let db = fresh_database(&pg);
    let work = tempfile::tempdir().unwrap();
    let synth = work.path().join("synth");
    let out = Command::new(env!("CARGO_BIN_EXE_loraplex"))
        .args(["synth", "--preset", "tiny", "--adapters", "2", "--ranks", "8", "--targets", "all", "--out"])
        .arg(&synth)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let env = [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT", moto.endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
    ];
    let store = format!("s3://{BUCKET}/adapters-prefix");
    let model = synth.to_str().unwrap().to_string();
    let start = |i: usize| {
        let host = format!("127.0.0.{i}");
        let args = [
            "--host",
            &host,
            "--database-url",
            &db,
            "--admin-key",
            ADMIN,
            "--adapter-store",
            &store,
            "--metrics-port",
            "0",
            "--cluster-sync-ms",
            "200",
            "--model",
            &model,
            "--served-model-name",
            "tiny",
        ];
        Server::start_with_env(Path::new(env!("CARGO_BIN_EXE_loraplex")), &work.path().join(format!("replica{i}")), &args, &env).unwrap()
    };
    // One at a time: the first brings the new database's schema up.
    let mut replicas: Vec<Server> = (1..=3).map(start).collect();
    let clients: Vec<Client> = replicas.iter().map(|r| r.client()).collect();
    let metrics_at: Vec<String> = replicas.iter().map(|r| r.metrics_addr().expect("a metrics port")).collect();
    for (i, r) in replicas.iter().enumerate() {
        assert!(r.addr.starts_with(&format!("127.0.0.{}:", i + 1)), "{}", r.addr);
    }

    // A tenant, made through replica 1, is known to all.
    let (status, t) = json(&clients[0], "POST", "/admin/tenants", ADMIN, Some(json!({"name": "acme"})));
    assert_eq!(status, 201, "{t}");
    let (status, k) = json(&clients[1], "POST", &format!("/admin/tenants/{}/keys", t["id"].as_str().unwrap()), ADMIN, None);
    assert_eq!(status, 201, "{k}");
    let key = k["key"].as_str().unwrap().to_string();

    // An adapter uploaded through replica 1 lands in the bucket and serves from all three,
    // with the same greedy tokens; replica 3 lists it among its loaded adapters only once it has
    // used it.
    let adapter = synth.join("adapters").join(std::fs::read_dir(synth.join("adapters")).unwrap().next().unwrap().unwrap().file_name());
    let (config, weights) = (std::fs::read(adapter.join("adapter_config.json")).unwrap(), std::fs::read(adapter.join("adapter_model.safetensors")).unwrap());
    let (ctype, form) = multipart(&[("name", b"support"), ("config", &config), ("weights", &weights)]);
    let r = clients[0].send(&Request::new("POST", "/v1/adapters").key(&key).body(&ctype, &form)).unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    let (_, listing) = s3(&moto.endpoint, "GET", &format!("/{BUCKET}?list-type=2&prefix=adapters-prefix/adapters/"));
    assert!(listing.contains("adapter_model.safetensors") && listing.contains("loraplex_adapter.json"), "{listing}");
    assert!(!running_adapters(&metrics(&metrics_at[2])).contains(&"support".to_string()));
    let (base_status, base_text, _) = greedy(&clients[0], &key, "tiny");
    assert_eq!(base_status, 200);
    let mut texts = Vec::new();
    for c in &clients {
        let (status, text, _) = greedy(c, &key, "support");
        assert_eq!(status, 200, "{text}");
        texts.push(text);
    }
    assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
    assert_ne!(texts[0], base_text, "the adapter changes the output");
    for m in &metrics_at {
        assert!(running_adapters(&metrics(m)).contains(&"support".to_string()), "resident after use: {m}");
    }

    // Usage through every replica, read back from each: the same report, equal to what the
    // clients were told.
    let (mut prompt, mut completion, mut requests) = (0i64, 0i64, 1 + 3);
    for (i, c) in clients.iter().enumerate() {
        for _ in 0..2 {
            let (status, _, usage) = greedy(c, &key, if i % 2 == 0 { "support" } else { "tiny" });
            assert_eq!(status, 200);
            prompt += usage["prompt_tokens"].as_i64().unwrap();
            completion += usage["completion_tokens"].as_i64().unwrap();
            requests += 1;
        }
    }
    let reports: Vec<Value> = clients.iter().map(|c| json(c, "GET", "/admin/billing/report", ADMIN, None).1).collect();
    assert!(reports.iter().all(|r| r["tenants"] == reports[0]["tenants"]), "{reports:?}");
    let totals = &reports[0]["totals"];
    // The four greedy requests above (base, and one per replica) were 12 tokens each too.
    assert_eq!(totals["requests"], requests, "{totals}");
    assert_eq!(totals["completion_tokens"].as_i64().unwrap(), completion + 4 * 12, "{totals}");
    assert!(totals["prompt_tokens"].as_i64().unwrap() >= prompt, "{totals}");

    // A tenant's requests per minute hold across replicas: 12 a minute allows a burst of 10, in
    // all, whichever replica a request reaches.
    let (_, limited) = json(&clients[0], "POST", "/admin/tenants", ADMIN, Some(json!({"name": "limited", "limits": {"requests_per_min": 12}})));
    let (_, lk) = json(&clients[2], "POST", &format!("/admin/tenants/{}/keys", limited["id"].as_str().unwrap()), ADMIN, None);
    let lkey = lk["key"].as_str().unwrap().to_string();
    let tries: Vec<_> = (0..30)
        .map(|i| {
            let (c, lkey) = (clients[i % 3].clone(), lkey.clone());
            std::thread::spawn(move || json(&c, "POST", "/v1/completions", &lkey, Some(json!({"model": "tiny", "prompt": "x", "max_tokens": 1}))).0)
        })
        .collect();
    let statuses: Vec<u16> = tries.into_iter().map(|t| t.join().unwrap()).collect();
    let ok = statuses.iter().filter(|&&s| s == 200).count();
    assert!((10..=12).contains(&ok), "{ok} admitted of 30: {statuses:?}");
    assert!(statuses.iter().all(|&s| s == 200 || s == 429), "{statuses:?}");

    // The Batch API across replicas: a file uploaded through replica 1 feeds a batch created
    // through replica 3 (which runs it); replica 2 reads its output. A batch run by replica 3
    // and cancelled through replica 1 stops.
    let batch_file = |n: usize, tokens: u32| {
        let lines: String = (0..n)
            .map(|i| json!({"custom_id": format!("line-{i}"), "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x", "max_tokens": tokens, "ignore_eos": true}}).to_string() + "\n")
            .collect();
        let (ctype, form) = multipart(&[("purpose", b"batch"), ("file", lines.as_bytes())]);
        let r = clients[0].send(&Request::new("POST", "/v1/files").key(&key).body(&ctype, &form)).unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["id"].as_str().unwrap().to_string()
    };
    let create = |c: &Client, file: &str| {
        let (status, b) = json(c, "POST", "/v1/batches", &key, Some(json!({"input_file_id": file, "endpoint": "/v1/completions", "completion_window": "24h"})));
        assert_eq!(status, 200, "{b}");
        b["id"].as_str().unwrap().to_string()
    };
    let wait_for = |c: &Client, id: &str, status: &str, secs: u64| {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let (_, b) = json(c, "GET", &format!("/v1/batches/{id}"), &key, None);
            if b["status"] == status {
                return b;
            }
            assert!(Instant::now() < deadline, "batch {id} is not {status}: {b}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let small = batch_file(20, 4);
    let id = create(&clients[2], &small);
    let done = wait_for(&clients[0], &id, "completed", 60);
    let out = clients[1].send(&Request::new("GET", &format!("/v1/files/{}/content", done["output_file_id"].as_str().unwrap())).key(&key)).unwrap();
    assert_eq!(out.status, 200);
    assert_eq!(out.text().lines().count(), 20, "{}", out.text());
    let large = batch_file(2000, 64);
    let id = create(&clients[2], &large);
    wait_for(&clients[2], &id, "in_progress", 30);
    let (status, b) = json(&clients[0], "POST", &format!("/v1/batches/{id}/cancel"), &key, None);
    assert_eq!(status, 200, "{b}");
    let cancelled = wait_for(&clients[1], &id, "cancelled", 30);
    assert!(cancelled["request_counts"]["completed"].as_i64().unwrap() < 2000, "{cancelled}");
    // A batch whose replica dies is taken over by another once that one has not been seen for
    // half a minute (below), and completes.
    let orphan = create(&clients[1], &batch_file(600, 32));
    wait_for(&clients[1], &orphan, "in_progress", 30);

    // Killing replica 2 while it streams loses no ledger row of a request it completed.
    let (status, _, usage) = greedy(&clients[1], &key, "support");
    assert_eq!(status, 200);
    let done_on_2 = usage["completion_tokens"].as_i64().unwrap();
    let (first, first_rx) = std::sync::mpsc::channel::<()>();
    let streaming = {
        let c = clients[1].clone();
        let key = key.clone();
        std::thread::spawn(move || {
            // Eight samples of 480 tokens: seconds of work for the tiny model.
            let body = json!({"model": "support", "prompt": "x", "max_tokens": 480, "n": 8, "ignore_eos": true, "stream": true}).to_string();
            let req = Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes());
            let mut done = false;
            let _ = c.stream(&req, |data, _| {
                let _ = first.send(());
                done |= data == "[DONE]";
                true
            });
            done
        })
    };
    first_rx.recv_timeout(Duration::from_secs(30)).expect("the stream started");
    replicas[1].kill();
    assert!(!streaming.join().unwrap(), "the stream was cut before its end");
    let (_, left) = json(&clients[0], "GET", &format!("/v1/batches/{orphan}"), &key, None);
    assert_eq!(left["status"], "in_progress", "the batch was still running when its replica died: {left}");
    let adopted = wait_for(&clients[0], &orphan, "completed", 150);
    assert_eq!(adopted["request_counts"]["completed"], 600, "{adopted}");
    let (_, after) = json(&clients[0], "GET", "/admin/billing/report", ADMIN, None);
    let acme = after["tenants"].as_array().unwrap().iter().find(|t| t["tenant"] == "acme").cloned().unwrap();
    assert!(acme["requests"].as_i64().unwrap() > requests, "{acme}");
    assert!(acme["completion_tokens"].as_i64().unwrap() >= completion + 4 * 12 + done_on_2, "{acme}");

    // A delete through replica 3 is a 404 on every live replica at once (each request reads the
    // adapter from the database), its objects leave the bucket, and within two seconds (the
    // 200 ms sync) replica 1 has dropped its copy: no longer listed as loaded, files gone.
    let (status, d) = json(&clients[2], "DELETE", "/v1/adapters/support", &key, None);
    assert_eq!(status, 200, "{d}");
    for c in [&clients[0], &clients[2]] {
        assert_eq!(greedy(c, &key, "support").0, 404);
    }
    let (_, listing) = s3(&moto.endpoint, "GET", &format!("/{BUCKET}?list-type=2&prefix=adapters-prefix/adapters/"));
    assert!(!listing.contains("adapter_model.safetensors"), "{listing}");
    let deadline = Instant::now() + Duration::from_secs(2);
    let copies = work.path().join("replica1").join("adapters");
    loop {
        let listed = running_adapters(&metrics(&metrics_at[0])).contains(&"support".to_string());
        let files = std::fs::read_dir(&copies).map(|d| d.count()).unwrap_or(0);
        if !listed && files == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "replica 1 still holds the deleted adapter (listed {listed}, {files} copies)");
        std::thread::sleep(Duration::from_millis(50));
    }
}
