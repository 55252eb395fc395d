//! Tenant A's abusive patterns. Each runs on A's connections until told to stop, sending what
//! it sends as fast as A's limits allow: back to back on `concurrency` connections (uploads:
//! as many as the server lets one key run), waiting `retry` after a refusal (A ignores
//! Retry-After); requests A hangs up on, whose answers it never reads, are paced to its
//! requests per minute. Every request is counted by kind and outcome.
//!
//! The bodies are built once, before any phase, so that A's side costs the machine little
//! while it runs.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use crate::bench::http::{Client, Request, multipart};
use crate::tokenizer::Tokenizer;

/// The largest JSON body the server reads (`api::MAX_JSON_BYTES`).
const MAX_JSON_BYTES: usize = 4 << 20;

/// Words the long prompts are made of.
const WORDS: &str = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches in the old town square ";

/// What tenant A does in one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// A control, nothing abusive: long streamed generations of a short prompt, as many as
    /// A's limits allow.
    Plain,
    /// Text prompts that fit the context (prefilled), just under the byte cap (tokenized, then
    /// refused for the context) and far over it (a body of almost 4 MiB, refused unread).
    HugePrompts,
    /// 16 stop strings of 256 bytes each, and long generations.
    StopLists,
    /// Uploads whose config carries the most pattern entries with the costliest regexes the
    /// caps allow, with a valid weights file; and uploads that pass the caps by one regex.
    AdapterConfigs,
    /// Load and unload of many adapters in a loop.
    PinStorms,
    /// Streams and non-streaming requests dropped right after sending, and streams dropped
    /// after their first token.
    Disconnects,
    /// Connections that send their head and part of a body, then nothing.
    StalledBodies,
    /// A large batch (the Batch API) of long generations, from a tenant without rate limits:
    /// it fills the capacity interactive requests leave, up to the server's
    /// `--batch-concurrency`.
    Batch,
}

impl Pattern {
    pub const ALL: [Pattern; 8] = [
        Pattern::Plain,
        Pattern::HugePrompts,
        Pattern::StopLists,
        Pattern::AdapterConfigs,
        Pattern::PinStorms,
        Pattern::Disconnects,
        Pattern::StalledBodies,
        Pattern::Batch,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Pattern::Plain => "plain",
            Pattern::HugePrompts => "huge-prompts",
            Pattern::StopLists => "stop-lists",
            Pattern::AdapterConfigs => "adapter-configs",
            Pattern::PinStorms => "pin-storms",
            Pattern::Disconnects => "disconnects",
            Pattern::StalledBodies => "stalled-bodies",
            Pattern::Batch => "batch",
        }
    }

    /// The kinds of request the pattern alternates between, which `pattern:kind` runs alone.
    pub fn kinds(self) -> &'static [&'static str] {
        match self {
            Pattern::HugePrompts => &["fits", "under", "over"],
            Pattern::AdapterConfigs => &["allowed", "refused"],
            Pattern::Disconnects => &["stream", "blocking", "first-token"],
            _ => &[],
        }
    }
}

/// A pattern, or one kind of its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    pub pattern: Pattern,
    pub kind: Option<usize>,
}

impl Spec {
    /// `pattern` or `pattern:kind`.
    pub fn parse(s: &str) -> Option<Spec> {
        let (name, kind) = s.split_once(':').map_or((s, None), |(n, k)| (n, Some(k)));
        let pattern = Pattern::ALL.into_iter().find(|p| p.name() == name)?;
        let kind = match kind {
            None => None,
            Some(k) => Some(pattern.kinds().iter().position(|x| *x == k)?),
        };
        Some(Spec { pattern, kind })
    }

    pub fn name(self) -> String {
        match self.kind {
            None => self.pattern.name().to_string(),
            Some(k) => format!("{}:{}", self.pattern.name(), self.pattern.kinds()[k]),
        }
    }

    /// The kind of request number `i`.
    fn kind(self, i: usize) -> usize {
        self.kind.unwrap_or(i % self.pattern.kinds().len().max(1))
    }
}

/// Requests of one kind, by outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Tally {
    pub sent: u64,
    /// Answered 2xx.
    pub ok: u64,
    /// Answered 429.
    pub limited: u64,
    /// Answered 503.
    pub overloaded: u64,
    /// Answered another 4xx (400 invalid, 408 stalled, 413 too large ...).
    pub refused: u64,
    /// Answered another 5xx, or the connection failed.
    pub failed: u64,
    /// A hung up before reading an answer.
    pub hung_up: u64,
}

impl Tally {
    pub fn add(&mut self, o: &Tally) {
        self.sent += o.sent;
        self.ok += o.ok;
        self.limited += o.limited;
        self.overloaded += o.overloaded;
        self.refused += o.refused;
        self.failed += o.failed;
        self.hung_up += o.hung_up;
    }

    /// Refused one way or another: 429, 503 and the other 4xx.
    pub fn refusals(&self) -> u64 {
        self.limited + self.overloaded + self.refused
    }
}

/// How one request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Status(u16),
    HungUp,
    Failed,
}

impl Outcome {
    fn of(r: std::io::Result<u16>) -> Outcome {
        r.map_or(Outcome::Failed, Outcome::Status)
    }

    fn refused(self) -> bool {
        !matches!(self, Outcome::Status(200..=299) | Outcome::HungUp)
    }
}

/// Every kind's tally.
#[derive(Debug, Default)]
pub struct Tallies(Mutex<BTreeMap<&'static str, Tally>>);

impl Tallies {
    fn record(&self, kind: &'static str, o: Outcome) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let t = all.entry(kind).or_default();
        t.sent += 1;
        match o {
            Outcome::Status(200..=299) => t.ok += 1,
            Outcome::Status(429) => t.limited += 1,
            Outcome::Status(503) => t.overloaded += 1,
            Outcome::Status(400..=499) => t.refused += 1,
            Outcome::Status(_) | Outcome::Failed => t.failed += 1,
            Outcome::HungUp => t.hung_up += 1,
        }
    }

    pub fn take(&self) -> BTreeMap<&'static str, Tally> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Everything A sends, built once.
pub struct Kit {
    pub client: Client,
    /// The base model's name.
    pub model: String,
    pub concurrency: usize,
    /// Uploads one key may run at once (the server's flag).
    pub uploads_per_key: usize,
    pub stalled: usize,
    pub retry: Duration,
    /// A's requests per minute: hang-ups are paced to it.
    pub requests_per_min: f64,
    /// Huge prompts: completion bodies.
    pub fits_context: Vec<u8>,
    pub under_cap: Vec<u8>,
    pub over_cap: Vec<u8>,
    pub stop_lists: Vec<u8>,
    /// The control: the same generations without stop strings.
    pub plain: Vec<u8>,
    /// Uploads: (content type, multipart body).
    pub heavy_upload: (String, Vec<u8>),
    pub refused_upload: (String, Vec<u8>),
    /// Disconnects: a streamed and a non-streaming completion.
    pub hangup_stream: Vec<u8>,
    pub hangup_blocking: Vec<u8>,
    /// Adapters for the pin storm, uploaded to each phase's tenant A.
    pub pin_adapters: Vec<PathBuf>,
    /// The batch: a file of long generations (content type, multipart body).
    pub batch_file: (String, Vec<u8>),
}

/// What A's kit is built from.
pub struct KitOptions<'a> {
    pub client: &'a Client,
    pub model: &'a str,
    pub tokenizer: &'a Tokenizer,
    /// The model's context, in tokens.
    pub context: usize,
    /// The server's prompt byte cap.
    pub byte_cap: usize,
    pub requests_per_min: i64,
    pub tokens_per_min: i64,
    pub concurrency: usize,
    pub uploads_per_key: usize,
    pub stalled: usize,
    pub retry: Duration,
    /// A short prompt (B's).
    pub short_prompt: &'a str,
    /// A rank-8 adapter for the model, which the heavy uploads carry.
    pub upload_dir: &'a Path,
    pub pin_adapters: Vec<PathBuf>,
    /// Lines of the batch.
    pub batch_lines: usize,
}

impl Kit {
    /// Builds every body A sends.
    pub fn build(o: KitOptions<'_>) -> anyhow::Result<Kit> {
        let tpm = usize::try_from(o.tokens_per_min).unwrap_or(usize::MAX);
        let words = |bytes: usize| WORDS.repeat(bytes / WORDS.len() + 1)[..bytes].to_string();
        let completion = |prompt: &str, max_tokens: usize, stream: bool, extra: Value| {
            let mut v = json!({"model": o.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": stream});
            if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
                v.extend(extra);
            }
            v.to_string().into_bytes()
        };
        // The longest prompt that fits the context and A's tokens per minute, with 16 new tokens.
        let target = o.context.saturating_sub(32).min(tpm / 2).saturating_sub(16).max(16);
        let (mut lo, mut hi) = (16usize, target * 16);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            if o.tokenizer.encode(&words(mid), true)?.len() <= target { lo = mid } else { hi = mid }
        }
        let fits = words(lo);
        // Just under the byte cap (tokenized, then refused for the context), and far over it, in
        // a body just under the largest the server reads.
        let under = words(o.byte_cap.saturating_sub(64).max(1));
        let over = words(MAX_JSON_BYTES - 1024);
        if over.len() <= o.byte_cap {
            eprintln!("note: the byte cap ({}) is above what a body may carry; the `over` prompts are under it", o.byte_cap);
        }
        // 16 stop strings of 256 bytes, each starting with a common letter.
        let mut seed = 0x2545_f491_u64;
        let stops: Vec<String> = "etaoinshrdlucmfw"
            .chars()
            .map(|c| {
                let mut s = c.to_string();
                while s.len() < 256 {
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    s.push(b"abcdefghijklmnopqrstuvwxyz "[(seed >> 33) as usize % 27] as char);
                }
                s
            })
            .collect();
        let long = 512.min(o.context.saturating_sub(64)).min(tpm / 2).max(16);
        // Heavy configs: 1,024 rank_pattern and 1,024 alpha_pattern entries, each a regex that
        // compiles to 16 KiB (32 MiB together: the per-config budget) and is tried against every
        // module; the refused one adds one more regex, which no longer fits.
        let mut cfg: Value = serde_json::from_slice(&std::fs::read(o.upload_dir.join("adapter_config.json"))?)?;
        cfg["rank_pattern"] = (0..1024).map(|i| (format!(".{{0,12}}zz{i}"), json!(8))).collect::<serde_json::Map<_, _>>().into();
        cfg["alpha_pattern"] = (0..1024).map(|i| (format!(".{{0,12}}zy{i}"), json!(16.0))).collect::<serde_json::Map<_, _>>().into();
        let heavy = serde_json::to_vec(&cfg)?;
        cfg["exclude_modules"] = json!("zzzz");
        let refused = serde_json::to_vec(&cfg)?;
        let weights = std::fs::read(o.upload_dir.join("adapter_model.safetensors"))?;
        let mut lines = String::new();
        for i in 0..o.batch_lines {
            let body = json!({"model": o.model, "prompt": format!("{} {i}", o.short_prompt), "max_tokens": long, "ignore_eos": true});
            lines.push_str(&json!({"custom_id": format!("line-{i}"), "method": "POST", "url": "/v1/completions", "body": body}).to_string());
            lines.push('\n');
        }
        Ok(Kit {
            client: Client { timeout: Duration::from_secs(60), ..o.client.clone() },
            model: o.model.to_string(),
            concurrency: o.concurrency,
            uploads_per_key: o.uploads_per_key,
            stalled: o.stalled,
            retry: o.retry,
            requests_per_min: o.requests_per_min as f64,
            fits_context: completion(&fits, 16, true, json!({})),
            under_cap: completion(&under, 16, false, json!({})),
            over_cap: completion(&over, 16, false, json!({})),
            stop_lists: completion(o.short_prompt, long, true, json!({"stop": stops})),
            plain: completion(o.short_prompt, long, true, json!({})),
            heavy_upload: multipart(&[("name", b"heavy"), ("config", &heavy), ("weights", &weights)]),
            refused_upload: multipart(&[("name", b"heavy"), ("config", &refused), ("weights", &weights)]),
            hangup_stream: completion(o.short_prompt, 256.min(long), true, json!({})),
            hangup_blocking: completion(o.short_prompt, 256.min(long), false, json!({})),
            pin_adapters: o.pin_adapters,
            batch_file: multipart(&[("purpose", b"batch"), ("file", lines.as_bytes())]),
        })
    }
}

/// A's tenant in one phase.
pub struct Tenant<'a> {
    pub key: &'a str,
    /// Names of its adapters for the pin storm.
    pub pins: &'a [String],
}

/// Runs `spec` until `stop` is set; returns when every connection is done.
pub fn run(spec: Spec, kit: &Kit, a: &Tenant<'_>, stop: &AtomicBool, tallies: &Tallies) {
    let pattern = spec.pattern;
    let pacer = Pacer::new(kit.requests_per_min / 60.0);
    std::thread::scope(|s| {
        let threads = match pattern {
            Pattern::AdapterConfigs => kit.uploads_per_key,
            Pattern::StalledBodies | Pattern::Batch => 1,
            _ => kit.concurrency,
        };
        for t in 0..threads {
            let pacer = &pacer;
            s.spawn(move || {
                match pattern {
                    Pattern::StalledBodies => return stalled_bodies(kit, a, stop, tallies),
                    Pattern::Batch => return batch(kit, a, stop, tallies),
                    _ => {}
                }
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    let refused = match pattern {
                        Pattern::Plain => generation(kit, a, &kit.plain, "long generation", stop, tallies),
                        Pattern::HugePrompts => huge_prompt(kit, a, spec.kind(i), stop, tallies),
                        Pattern::StopLists => generation(kit, a, &kit.stop_lists, "16 stops of 256 bytes", stop, tallies),
                        Pattern::AdapterConfigs => upload(kit, a, spec.kind(i), tallies),
                        Pattern::PinStorms => pin(kit, a, i, tallies),
                        Pattern::Disconnects => disconnect(kit, a, spec.kind(i), pacer, tallies),
                        Pattern::StalledBodies | Pattern::Batch => false,
                    };
                    if refused {
                        std::thread::sleep(kit.retry);
                    }
                    i += threads;
                }
            });
        }
    });
}

/// Sends a completion body; streamed ones are hung up on when `stop` is set.
fn completion(kit: &Kit, a: &Tenant<'_>, body: &[u8], streamed: bool, stop: &AtomicBool) -> Outcome {
    let req = Request::new("POST", "/v1/completions").key(a.key).body("application/json", body);
    if !streamed {
        return Outcome::of(kit.client.send(&req).map(|r| r.status));
    }
    let mut hung_up = false;
    let r = kit.client.stream(&req, |_, _| {
        hung_up = stop.load(Ordering::Relaxed);
        !hung_up
    });
    match r {
        Ok((status, _)) if hung_up && status == 200 => Outcome::HungUp,
        r => Outcome::of(r.map(|(s, _)| s)),
    }
}

fn huge_prompt(kit: &Kit, a: &Tenant<'_>, kind: usize, stop: &AtomicBool, tallies: &Tallies) -> bool {
    let (kind, body, streamed) = match kind {
        0 => ("prompt fits the context", &kit.fits_context, true),
        1 => ("prompt under the byte cap", &kit.under_cap, false),
        _ => ("prompt over the byte cap", &kit.over_cap, false),
    };
    let o = completion(kit, a, body, streamed, stop);
    tallies.record(kind, o);
    o.refused()
}

fn generation(kit: &Kit, a: &Tenant<'_>, body: &[u8], kind: &'static str, stop: &AtomicBool, tallies: &Tallies) -> bool {
    let o = completion(kit, a, body, true, stop);
    tallies.record(kind, o);
    o.refused()
}

fn upload(kit: &Kit, a: &Tenant<'_>, kind: usize, tallies: &Tallies) -> bool {
    let (kind, (ctype, body)) = if kind == 0 { ("heavy config (allowed)", &kit.heavy_upload) } else { ("heavy config (over a cap)", &kit.refused_upload) };
    let req = Request::new("POST", "/v1/adapters").key(a.key).body(ctype, body);
    let o = Outcome::of(kit.client.send(&req).map(|r| r.status));
    tallies.record(kind, o);
    // A refusal is the expected answer to the second kind: no pause for it.
    matches!(o, Outcome::Status(429 | 503) | Outcome::Failed)
}

fn pin(kit: &Kit, a: &Tenant<'_>, i: usize, tallies: &Tallies) -> bool {
    if a.pins.is_empty() {
        return true;
    }
    // Connection t of T takes adapters t, t + T, ...
    let name = &a.pins[i % a.pins.len()];
    let load = Outcome::of(kit.client.send(&Request::new("POST", &format!("/v1/adapters/{name}/load")).key(a.key)).map(|r| r.status));
    tallies.record("load", load);
    let unload = Outcome::of(kit.client.send(&Request::new("POST", &format!("/v1/adapters/{name}/unload")).key(a.key)).map(|r| r.status));
    tallies.record("unload", unload);
    load.refused() || unload.refused()
}

fn disconnect(kit: &Kit, a: &Tenant<'_>, kind: usize, pacer: &Pacer, tallies: &Tallies) -> bool {
    match kind {
        0 | 1 => {
            // A never learns whether these were admitted: paced to its rate limit.
            pacer.wait();
            let (kind, body) =
                if kind == 0 { ("stream, hang up at once", &kit.hangup_stream) } else { ("non-streaming, hang up at once", &kit.hangup_blocking) };
            let req = Request::new("POST", "/v1/completions").key(a.key).body("application/json", body);
            let o = match kit.client.open(&req).and_then(|mut s| s.write_all(body)) {
                Ok(()) => Outcome::HungUp,
                Err(_) => Outcome::Failed,
            };
            tallies.record(kind, o);
            false
        }
        _ => {
            let req = Request::new("POST", "/v1/completions").key(a.key).body("application/json", &kit.hangup_stream);
            let r = kit.client.stream(&req, |_, _| false);
            let o = match r {
                Ok((200, _)) => Outcome::HungUp,
                r => Outcome::of(r.map(|(s, _)| s)),
            };
            tallies.record("stream, hang up after the first token", o);
            o.refused()
        }
    }
}

/// Spaces requests `1 / rate` apart across every connection.
struct Pacer {
    start: Instant,
    every: Duration,
    next: AtomicU64,
}

impl Pacer {
    fn new(rate: f64) -> Self {
        Self { start: Instant::now(), every: Duration::from_secs_f64(1.0 / rate.max(1e-3)), next: AtomicU64::new(0) }
    }

    fn wait(&self) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let at = self.every.saturating_mul(u32::try_from(n).unwrap_or(u32::MAX));
        if let Some(d) = at.checked_sub(self.start.elapsed()) {
            std::thread::sleep(d);
        }
    }
}

/// Uploads the batch file, runs it until `stop`, then cancels it. Its lines answered count as
/// requests that succeeded, those that failed as failures.
fn batch(kit: &Kit, a: &Tenant<'_>, stop: &AtomicBool, tallies: &Tallies) {
    let (ctype, body) = &kit.batch_file;
    let file = kit.client.send(&Request::new("POST", "/v1/files").key(a.key).body(ctype, body));
    let id = match &file {
        Ok(r) if r.status == 200 => r.json()["id"].as_str().map(str::to_string),
        _ => None,
    };
    tallies.record("batch file", Outcome::of(file.map(|r| r.status)));
    let Some(id) = id else { return };
    let create = json!({"input_file_id": id, "endpoint": "/v1/completions", "completion_window": "24h"});
    let created = kit.client.json("POST", "/v1/batches", Some(a.key), Some(&create));
    let batch = match &created {
        Ok(r) if r.status == 200 => r.json()["id"].as_str().map(str::to_string),
        _ => None,
    };
    tallies.record("batch", Outcome::of(created.map(|r| r.status)));
    let Some(batch) = batch else { return };
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let cancelled = kit.client.json("POST", &format!("/v1/batches/{batch}/cancel"), Some(a.key), None);
    tallies.record("cancel", Outcome::of(cancelled.map(|r| r.status)));
    // The lines that finished before the cancel took effect.
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Ok(r) = kit.client.json("GET", &format!("/v1/batches/{batch}"), Some(a.key), None) else { break };
        let b = r.json();
        if b["status"] == "cancelled" {
            let counts = &b["request_counts"];
            for _ in 0..counts["completed"].as_u64().unwrap_or(0) {
                tallies.record("batch lines", Outcome::Status(200));
            }
            for _ in 0..counts["failed"].as_u64().unwrap_or(0) {
                tallies.record("batch lines", Outcome::Failed);
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A stalled request: its connection, and its kind.
struct Stalled {
    conn: TcpStream,
    kind: &'static str,
}

/// Opens a connection that sends the head of a request and the first half of its body, then
/// nothing.
fn stall(kit: &Kit, a: &Tenant<'_>, kind: &'static str) -> std::io::Result<Stalled> {
    let (path, ctype, body): (&str, String, Vec<u8>) = match kind {
        "upload body" => {
            // Cut in the middle of the weights.
            let (ctype, mut body) = multipart(&[("name", b"stalled"), ("weights", &[0u8; 4096])]);
            body.truncate(body.len() / 2);
            ("/v1/adapters", ctype, body)
        }
        _ => ("/v1/completions", "application/json".into(), format!(r#"{{"model": {}, "prompt": "{}"#, json!(kit.model), "x".repeat(2000)).into_bytes()),
    };
    // The head announces twice what is sent.
    let announced = vec![b' '; body.len() * 2];
    let mut conn = kit.client.open(&Request::new("POST", path).key(a.key).body(&ctype, &announced))?;
    conn.write_all(&body)?;
    conn.set_nonblocking(true)?;
    Ok(Stalled { conn, kind })
}

/// Holds up to `kit.stalled` stalled connections (the per-key upload cap's worth of uploads,
/// the rest completions). Every 50 ms it looks at them: one the server answered (a refusal, or
/// 408 once the body timeout passed) or closed is counted and dropped; then, if no answer came
/// in that look, it opens up to 64 more, else one (so that refusals come back at about 20 a
/// second, not as fast as connections open).
fn stalled_bodies(kit: &Kit, a: &Tenant<'_>, stop: &AtomicBool, tallies: &Tallies) {
    let mut open: Vec<Stalled> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let mut answered = 0;
        open.retain_mut(|s| {
            let mut head = [0u8; 12];
            let outcome = match s.conn.read(&mut head) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Ok(n) if n >= 12 => Outcome::Status(std::str::from_utf8(&head[9..12]).ok().and_then(|c| c.parse().ok()).unwrap_or(0)),
                _ => Outcome::Failed,
            };
            tallies.record(s.kind, outcome);
            answered += 1;
            false
        });
        let room = kit.stalled.saturating_sub(open.len());
        for _ in 0..room.min(if answered == 0 { 64 } else { 1 }) {
            let uploads = open.iter().filter(|s| s.kind == "upload body").count();
            let kind = if uploads < kit.uploads_per_key { "upload body" } else { "completion body" };
            match stall(kit, a, kind) {
                Ok(s) => open.push(s),
                Err(_) => {
                    tallies.record(kind, Outcome::Failed);
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Those still open were neither answered nor refused: A hangs up on them.
    for s in open {
        tallies.record(s.kind, Outcome::HungUp);
    }
}
