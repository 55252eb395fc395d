//! The pace of a request's body: `Expect: 100-continue` is answered only once the key is known,
//! and a body is cut when it falls behind the minimum rate, not only when it goes silent.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;

use super::common::*;

/// Writes a request head asking `Expect: 100-continue` for a body of `length` bytes, and
/// returns what the server answers before any of the body is sent (up to a blank line).
fn ask(env: &Env, path: &str, key: Option<&str>, length: usize) -> (TcpStream, String) {
    let mut s = TcpStream::connect(&env.http.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => got.push(byte[0]),
            _ => break,
        }
    }
    (s, String::from_utf8_lossy(&got).into_owned())
}

/// Everything the server sends on `s` until it closes the connection or goes quiet.
fn rest(mut s: TcpStream) -> String {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `body` in pieces of `piece` bytes, one each `every`; stops when a write fails or an
/// answer has arrived. Returns the answer and how long it took.
fn trickle(env: &Env, key: &str, body: &[u8], piece: usize, every: Duration) -> (String, Duration) {
    let req = loraplex::bench::http::Request::new("POST", "/v1/completions").key(key).body("application/json", body);
    let mut s = env.http.open(&req).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let started = Instant::now();
    for chunk in body.chunks(piece) {
        if s.write_all(chunk).is_err() || answered(&s) {
            break;
        }
        std::thread::sleep(every);
    }
    let answer = rest_of_one(s);
    (answer, started.elapsed())
}

/// Whether the server has written something on `s` (without taking it).
fn answered(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let seen = matches!(s.peek(&mut [0u8; 1]), Ok(n) if n > 0);
    s.set_nonblocking(false).unwrap();
    seen
}

#[test]
fn expect_continue_waits_for_the_key_and_a_body_below_the_minimum_rate_is_cut() {
    let env = Env::start(&Db::Sqlite, &["--body-timeout", "2", "--body-min-rate", "200"]);
    let (_, key) = env.tenant("acme", json!({}));
    let mut cases = Cases::default();
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 1}).to_string();

    for (name, k) in [("no key", None), ("an unknown key", Some("sk-unknown-0123456789"))] {
        let (s, head) = ask(&env, "/v1/completions", k, body.len());
        cases.ok(&format!("{name}: 401 before the body, no 100 Continue"), head.starts_with("HTTP/1.1 401"), &head);
        cases.ok(&format!("{name}: the connection closes"), head.to_ascii_lowercase().contains("connection: close"), &head);
        cases.ok(&format!("{name}: an x-request-id"), head.to_ascii_lowercase().contains("x-request-id: req"), &head);
        let after = rest(s);
        cases.ok(&format!("{name}: the error names the key"), after.contains("\"error\""), &after);
    }
    let (mut s, head) = ask(&env, "/v1/completions", Some(&key), body.len());
    cases.ok("a valid key: 100 Continue", head.starts_with("HTTP/1.1 100 Continue"), &head);
    s.write_all(body.as_bytes()).unwrap();
    let answer = rest_of_one(s);
    cases.ok("a valid key: then the answer", answer.starts_with("HTTP/1.1 200") && answer.contains("choices"), &answer);
    // The scope is the route's to check: a tenant's key on an operator route is told to go on,
    // then refused.
    let (mut s, head) = ask(&env, "/admin/tenants", Some(&key), 2);
    cases.ok("a tenant key on an operator route: 100 Continue", head.starts_with("HTTP/1.1 100 Continue"), &head);
    s.write_all(b"{}").unwrap();
    let answer = rest_of_one(s);
    cases.ok("then 403", answer.starts_with("HTTP/1.1 403"), &answer);

    // A byte every 50 ms: never silent for the 2 s body timeout, but 20 bytes a second against a
    // minimum of 200: cut once the grace (2 s) and what the bytes earned are spent.
    let padded = format!("{body}{}", " ".repeat(4000));
    let (answer, took) = trickle(&env, &key, padded.as_bytes(), 1, Duration::from_millis(50));
    cases.ok("a trickled body: 408", answer.starts_with("HTTP/1.1 408"), &answer);
    cases.ok("a trickled body: the answer names the rate", answer.contains("too slow") && answer.contains("200 bytes a second"), &answer);
    cases.ok("a trickled body: cut soon after the grace", took >= Duration::from_millis(1900) && took < Duration::from_secs(6), format!("{took:?}"));
    // 100 bytes every 50 ms (2,000 a second) for longer than the grace: served.
    let padded = format!("{body}{}", " ".repeat(6000));
    let (answer, took) = trickle(&env, &key, padded.as_bytes(), 100, Duration::from_millis(50));
    cases.ok("a slow body above the rate: served", answer.starts_with("HTTP/1.1 200"), &answer);
    cases.ok("a slow body above the rate: it took longer than the grace", took > Duration::from_millis(2500), format!("{took:?}"));
    // Silence is still cut, with its own message.
    let req = loraplex::bench::http::Request::new("POST", "/v1/completions").key(&key).body("application/json", padded.as_bytes());
    let mut s = env.http.open(&req).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&padded.as_bytes()[..10]).unwrap();
    let answer = rest_of_one(s);
    cases.ok("a silent body: 408", answer.starts_with("HTTP/1.1 408") && answer.contains("nothing arrived"), &answer);
    cases.check("still serving", &env.complete(&key, MODEL, 1), 200, "choices");
    cases.finish("the pace of bodies");
}

/// The one response on `s` (the connection may stay open): its head and a body of the length
/// it declares.
fn rest_of_one(s: TcpStream) -> String {
    match loraplex::bench::http::read_response(s) {
        Ok(r) => format!("HTTP/1.1 {} {}", r.status, r.text()),
        Err(e) => format!("no answer: {e}"),
    }
}
