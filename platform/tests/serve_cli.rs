//! `loraplex serve` on the embedded defaults: first start prints the admin key once, the
//! server answers health and the admin API, and a restart keeps the database.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

use loraplex::bench::server::Server;

fn start(data: &std::path::Path, extra: &[&str]) -> Server {
    Server::start(std::path::Path::new(env!("CARGO_BIN_EXE_loraplex")), data, extra).unwrap()
}

/// One HTTP/1.1 request; the status and the body.
fn http(addr: &str, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[test]
fn serve_prints_the_admin_key_once_and_keeps_its_database() {
    let data = tempfile::tempdir().unwrap();
    let first = start(data.path(), &[]);
    let admin = first.admin.clone().expect("the first start prints an admin key");
    assert_eq!(http(&first.addr, "GET", "/health", None, "").0, 200);
    assert_eq!(http(&first.addr, "GET", "/admin/tenants", None, "").0, 401);
    let (status, body) = http(&first.addr, "POST", "/admin/tenants", Some(&admin), r#"{"name": "acme"}"#);
    assert_eq!(status, 201, "{body}");
    drop(first);
    assert!(data.path().join("loraplex.db").exists(), "SQLite under the data directory by default");

    let second = start(data.path(), &[]);
    assert!(second.admin.is_none(), "the key is printed only once");
    let (status, body) = http(&second.addr, "GET", "/admin/tenants", Some(&admin), "");
    assert_eq!(status, 200);
    assert!(body.contains("\"acme\""), "{body}");
    drop(second);

    let third = start(data.path(), &["--admin-key", "operator-key-0123456789"]);
    assert_eq!(http(&third.addr, "GET", "/admin/tenants", Some("operator-key-0123456789"), "").0, 200);
    assert_eq!(http(&third.addr, "GET", "/ready", None, "").0, 200);
}

#[test]
fn a_first_start_that_cannot_listen_makes_no_key_and_the_next_start_prints_one() {
    let data = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out =
        Command::new(env!("CARGO_BIN_EXE_loraplex")).args(["serve", "--host", "127.0.0.1", "--port", &port, "--data-dir"]).arg(data.path()).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "the port is taken: {stdout}");
    assert!(stderr.contains("listening on 127.0.0.1"), "the error names the address: {stderr}");
    assert!(!stdout.contains("admin key"), "no key is printed by a start that cannot serve: {stdout}");
    drop(taken);
    let next = start(data.path(), &[]);
    let admin = next.admin.clone().expect("the next start prints the first key");
    assert_eq!(http(&next.addr, "GET", "/admin/tenants", Some(&admin), "").0, 200);
}

fn tenant_key(addr: &str, admin: &str, name: &str) -> String {
    let (status, body) = http(addr, "POST", "/admin/tenants", Some(admin), &format!(r#"{{"name": "{name}"}}"#));
    assert_eq!(status, 201, "{body}");
    let id = body.split("\"id\":\"").nth(1).unwrap().split('"').next().unwrap().to_string();
    let (status, body) = http(addr, "POST", &format!("/admin/tenants/{id}/keys"), Some(admin), "");
    assert_eq!(status, 201, "{body}");
    body.split("\"key\":\"").nth(1).unwrap().split('"').next().unwrap().to_string()
}

#[test]
fn shutdown_lets_running_requests_finish_and_records_them() {
    // SIGTERM (an orchestrator) and SIGINT (Ctrl-C) alike.
    for signal in ["-TERM", "-INT"] {
        drains_on(signal);
    }
}

fn drains_on(signal: &str) {
    let data = tempfile::tempdir().unwrap();
    let admin = "operator-key-0123456789";
    let server = start(data.path(), &["--admin-key", admin]);
    let key = tenant_key(&server.addr, admin, "acme");
    let body = r#"{"model": "loraplex-tiny", "prompt": "x", "max_tokens": 300, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true}}"#;
    // The signal comes once the stream has its first token, and before its last: the request
    // is running when the server is told to stop.
    let (first, signalled) = (std::sync::mpsc::channel::<()>(), std::sync::mpsc::channel::<()>());
    let client = server.client();
    let stream = std::thread::spawn(move || {
        // Chunks with text, those after the signal, the tokens the usage counted, and the end.
        let (mut chunks, mut after_signal, mut tokens, mut done) = (0, 0, 0, false);
        let req = loraplex::bench::http::Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes());
        let (status, _) = client
            .stream(&req, |data, _| {
                if data == "[DONE]" {
                    done = true;
                } else if let Some(n) = serde_json::from_str::<serde_json::Value>(data).ok().and_then(|v| v["usage"]["completion_tokens"].as_u64()) {
                    tokens = n;
                } else if data.contains("\"text\":") {
                    chunks += 1;
                    if chunks == 1 {
                        first.0.send(()).unwrap();
                        signalled.1.recv().unwrap();
                    } else {
                        after_signal += 1;
                    }
                }
                true
            })
            .unwrap();
        (status, chunks, after_signal, tokens, done)
    });
    first.1.recv().unwrap();
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args([signal, &pid]).status().unwrap().success());
    signalled.0.send(()).unwrap();
    let (status, chunks, after_signal, tokens, done) = stream.join().unwrap();
    assert_eq!(status, 200);
    assert!(done, "{signal}: the stream ran to its end");
    assert_eq!(tokens, 300);
    assert!(after_signal * 3 > chunks * 2, "most of the text came after the signal: {after_signal} of {chunks} chunks");
    let mut server = server;
    assert!(server.child.wait().unwrap().success(), "a clean exit");
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(server.output.lock().unwrap().last().map(String::as_str), Some("stopped"));

    let again = start(data.path(), &["--admin-key", admin]);
    let (status, report) = http(&again.addr, "GET", "/admin/billing/report", Some(admin), "");
    assert_eq!(status, 200);
    assert!(report.contains("\"completion_tokens\":300"), "the usage row was committed: {report}");
}

#[test]
fn a_second_ctrl_c_stops_the_server_at_once() {
    let data = tempfile::tempdir().unwrap();
    let admin = "operator-key-0123456789";
    // A drain that would wait long for the slow client below.
    let mut server = start(data.path(), &["--admin-key", admin, "--shutdown-timeout", "120"]);
    let key = tenant_key(&server.addr, admin, "acme");
    // About 1.5 kB an event with 20 alternatives a token: more than the sockets' buffers hold, so
    // the server is still writing the stream when it is stopped.
    let body = r#"{"model": "loraplex-tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": true, "stream": true, "logprobs": 20}"#;
    let (first, got_first) = std::sync::mpsc::channel::<()>();
    let client = server.client();
    let stream = std::thread::spawn(move || {
        let (mut tokens, mut done) = (0, false);
        let req = loraplex::bench::http::Request::new("POST", "/v1/completions").key(&key).body("application/json", body.as_bytes());
        let _ = client.stream(&req, |data, _| {
            if data == "[DONE]" {
                done = true;
            } else if data.contains("\"text\":") {
                tokens += 1;
                if tokens == 1 {
                    first.send(()).unwrap();
                }
                // Slowly, so that the stream is still being written at the second signal.
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            true
        });
        (tokens, done)
    });
    got_first.recv().unwrap();
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(server.child.try_wait().unwrap().is_none(), "one Ctrl-C drains: the server still runs");
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let started = std::time::Instant::now();
    let status = server.child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "a second Ctrl-C exits at once with 130");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    // The client may still be reading what the kernel had buffered; it is left to end on its own.
    drop(stream);
}

/// Runs a client script of `tests/clients` against a fresh server on the embedded defaults:
/// `python SCRIPT URL ADMIN_KEY ADAPTERS`, where ADAPTERS is the first of `adapters` synthesized
/// adapters (rank 8 on `targets`), or with `every` the directory of all of them; what it printed.
/// `None` where no Python with the client is configured (`.ci/run` configures one).
fn client_script(script: &str, adapters: usize, targets: &str, every: bool) -> Option<String> {
    let Some(python) = std::env::var_os("LORAPLEX_TEST_PYTHON") else {
        assert!(std::env::var_os("LORAPLEX_REQUIRE_OPENAI").is_none(), "LORAPLEX_REQUIRE_OPENAI is set but LORAPLEX_TEST_PYTHON is not");
        eprintln!("LORAPLEX_TEST_PYTHON is not set: {script} is skipped (.ci/run sets it)");
        return None;
    };
    let data = tempfile::tempdir().unwrap();
    let synth = data.path().join("synth");
    let out = Command::new(env!("CARGO_BIN_EXE_loraplex"))
        .args(["synth", "--preset", "tiny", "--adapters", &adapters.to_string(), "--ranks", "8", "--targets", targets, "--out"])
        .arg(&synth)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let admin = "operator-key-0123456789";
    let server = start(&data.path().join("server"), &["--admin-key", admin]);
    let dir = synth.join("adapters");
    let adapter = if every { dir } else { std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path() };
    let script = format!("{}/../tests/clients/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(python).arg(script).arg(format!("http://{}", server.addr)).arg(admin).arg(&adapter).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("{stdout}");
    Some(stdout)
}

#[test]
fn the_official_openai_python_client_works_unchanged() {
    if let Some(said) = client_script("openai_client.py", 1, "qv", false) {
        assert!(said.contains(": ok ("), "{said}");
    }
}

/// The script a GPU run checks `serve --device cuda` with (`.ci/gpu-run`), kept honest here on
/// the CPU: it passes where the tokens are transformers + PEFT's, and fails on a model whose
/// tokens are not (the bf16 checkpoint, asked as if it were the f32 one).
#[test]
fn the_device_parity_script_passes_on_the_cpu_and_catches_other_tokens() {
    let Some(python) = std::env::var_os("LORAPLEX_TEST_PYTHON") else {
        eprintln!("LORAPLEX_TEST_PYTHON is not set: the parity script test is skipped (.ci/run sets it)");
        return;
    };
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/reference/llama");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/clients/device_parity.py");
    let admin = "operator-key-0123456789";
    let run = |model: &str, variants: &[&str]| {
        let data = tempfile::tempdir().unwrap();
        let server = start(data.path(), &["--admin-key", admin, "--model", &format!("{fixtures}/{model}")]);
        let out = Command::new(&python).arg(script).arg(format!("http://{}", server.addr)).arg(admin).arg(fixtures).args(variants).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let (ok, said) = run("model-f32", &[]);
    assert!(ok && said.contains("compute type cpu; 0 mismatch(es)"), "{said}");
    assert_eq!(said.matches(" ok\n").count(), 24, "base and three adapters, six prompts each: {said}");
    let (ok, said) = run("model-bf16", &["base"]);
    assert!(!ok && said.contains("differs at token"), "{said}");
}

#[test]
fn without_cuda_auto_serves_on_the_cpu_and_cuda_is_a_clear_error() {
    let data = tempfile::tempdir().unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_loraplex")).args(["serve", "--port", "0", "--device", "nvidia"]).arg("--data-dir").arg(data.path()).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("use auto, cpu, cuda or cuda:N"));
    if let Ok(n) = loraplex_kernels::cuda::probe() {
        eprintln!("skipped: this machine has {n} CUDA device(s)");
        return;
    }
    let out =
        Command::new(env!("CARGO_BIN_EXE_loraplex")).args(["serve", "--port", "0", "--device", "cuda:0"]).arg("--data-dir").arg(data.path()).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device cuda:0: CUDA is not usable on this machine"), "{err}");
    let server = start(data.path(), &["--device", "auto"]);
    assert_eq!(http(&server.addr, "GET", "/health", None, "").0, 200);
}

/// Structured output and tool calls through the official client (`openai_structured.py`):
/// response_format, the client's pydantic `parse`, vLLM's fields, and tools, every answer
/// validated with the `jsonschema` package.
#[test]
fn the_official_openai_client_gets_structured_output_and_tool_calls() {
    if let Some(said) = client_script("openai_structured.py", 1, "all", false) {
        assert!(said.contains("structured ok ("), "{said}");
    }
}

/// The Batch API through the official client (`openai_batch.py`): files, batches over three
/// adapters and the base model answered as the interactive API answers, cancel, listings.
#[test]
fn the_official_openai_client_runs_batches() {
    if let Some(said) = client_script("openai_batch.py", 3, "all", true) {
        assert!(said.contains("batch ok ("), "{said}");
    }
}

/// A batch whose server is killed (SIGKILL, no shutdown) goes on when it starts again: every line
/// is answered once, and billed once.
#[test]
fn a_batch_survives_its_server_being_killed() {
    use loraplex::bench::http::{Request, multipart};
    use serde_json::{Value, json};
    let data = tempfile::tempdir().unwrap();
    let admin = "operator-key-0123456789";
    let args = ["--admin-key", admin, "--batch-concurrency", "2"];
    let mut server = start(data.path(), &args);
    let key = tenant_key(&server.addr, admin, "acme");
    let lines: Vec<String> = (0..30)
        .map(|i| {
            let body = json!({"model": "loraplex-tiny", "prompt": format!("line {i}"), "max_tokens": 64, "ignore_eos": true, "temperature": 0});
            json!({"custom_id": format!("l{i}"), "method": "POST", "url": "/v1/completions", "body": body}).to_string() + "\n"
        })
        .collect();
    let (content_type, form) = multipart(&[("purpose", b"batch"), ("file", lines.concat().as_bytes())]);
    let file = server.client().send(&Request::new("POST", "/v1/files").key(&key).body(&content_type, &form)).unwrap();
    assert_eq!(file.status, 200, "{}", file.text());
    let create = json!({"input_file_id": file.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"});
    let batch = server.client().json("POST", "/v1/batches", Some(&key), Some(&create)).unwrap().json();
    let id = batch["id"].as_str().unwrap().to_string();
    let get = |server: &loraplex::bench::server::Server| server.client().json("GET", &format!("/v1/batches/{id}"), Some(&key), None).unwrap().json();
    let wait = |server: &loraplex::bench::server::Server, done: &dyn Fn(&Value) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let b = get(server);
            if done(&b) {
                return b;
            }
            assert!(std::time::Instant::now() < deadline, "{b}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let before = wait(&server, &|b| b["request_counts"]["completed"].as_i64() >= Some(4));
    server.kill();
    let _ = server.child.wait();
    let before = before["request_counts"]["completed"].as_i64().unwrap();
    assert!(before < 30, "the kill came before the end: {before}");

    let again = start(data.path(), &args);
    assert!(again.output.lock().unwrap().iter().any(|l| l.contains("batches: 1 of the last run go on")), "{:?}", again.output.lock().unwrap());
    let batch = wait(&again, &|b| b["status"] == "completed");
    assert_eq!((batch["request_counts"]["completed"].as_i64(), batch["request_counts"]["failed"].as_i64()), (Some(30), Some(0)), "{batch}");
    let output =
        again.client().send(&Request::new("GET", &format!("/v1/files/{}/content", batch["output_file_id"].as_str().unwrap())).key(&key)).unwrap().text();
    let mut ids: Vec<String> = output.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["custom_id"].as_str().unwrap().to_string()).collect();
    ids.sort_by_key(|i| i[1..].parse::<u32>().unwrap());
    assert_eq!(ids, (0..30).map(|i| format!("l{i}")).collect::<Vec<_>>(), "every line answered once");
    // Billed once per line: the batch's tokens are the answers' tokens, and the bill is theirs
    // at half the standard plan's prices.
    let answers: Vec<Value> = output.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["response"]["body"].clone()).collect();
    let prompt: i64 = answers.iter().map(|a| a["usage"]["prompt_tokens"].as_i64().unwrap()).sum();
    assert!(answers.iter().all(|a| a["usage"]["completion_tokens"] == 64));
    assert_eq!((batch["usage"]["input_tokens"].as_i64(), batch["usage"]["output_tokens"].as_i64()), (Some(prompt), Some(30 * 64)));
    let report = again.client().json("GET", "/admin/billing/report", Some(admin), None).unwrap().json();
    let expected = loraplex::store::Money::of(prompt, 250_000).checked_add(loraplex::store::Money::of(30 * 64, 750_000)).unwrap();
    assert_eq!(report["totals"]["cost"].as_str(), Some(expected.to_string().as_str()), "{report}");
    // The answers are the ones an uninterrupted run gives: the interactive API's.
    for (a, l) in answers.iter().zip(output.lines()).take(5) {
        let line: usize = serde_json::from_str::<Value>(l).unwrap()["custom_id"].as_str().unwrap()[1..].parse().unwrap();
        let body: Value = serde_json::from_str::<Value>(&lines[line]).unwrap()["body"].clone();
        let direct = again.client().json("POST", "/v1/completions", Some(&key), Some(&body)).unwrap().json();
        assert_eq!(a["choices"], direct["choices"], "line {line}");
    }
}
