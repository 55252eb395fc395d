//! Tenant B, the steady tenant: its requests (streamed completions of a short text prompt),
//! their timing, and the capacity measured with them.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use crate::bench::http::{Client, Request};
use crate::bench::quantile;
use crate::tokenizer::Tokenizer;

/// B's prompt (a request number is appended, so that no two share a cached block).
pub const B_PROMPT: &str = "Describe the weather in the mountains on a quiet autumn morning, request";

/// One of B's requests.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    pub sent_ms: f64,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub prompt_tokens: u64,
    /// It streamed all its tokens and a final event.
    pub ok: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    pub requests: usize,
    pub failed: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
}

impl Latency {
    pub fn of(samples: &[Sample]) -> Latency {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
        let ttft: Vec<f64> = ok.iter().map(|s| s.ttft_ms).collect();
        let e2e: Vec<f64> = ok.iter().map(|s| s.e2e_ms).collect();
        Latency {
            requests: samples.len(),
            failed: samples.len() - ok.len(),
            ttft_p50_ms: quantile(&ttft, 0.5),
            ttft_p99_ms: quantile(&ttft, 0.99),
            e2e_p50_ms: quantile(&e2e, 0.5),
            e2e_p99_ms: quantile(&e2e, 0.99),
        }
    }
}

/// Tenant B: its key and what it sends.
#[derive(Clone)]
pub struct B<'a> {
    pub client: &'a Client,
    /// With a tokenizer, the prompt goes as token ids (so the server never tokenizes it).
    pub ids: Option<&'a Tokenizer>,
    pub key: String,
    pub model: String,
    pub max_tokens: u32,
}

impl B<'_> {
    /// One streamed request: times from sending it to its first token and to its last event.
    pub fn request(&self, n: usize) -> Sample {
        let text = format!("{B_PROMPT} {n}.");
        let prompt = match self.ids.map(|t| t.encode(&text, true)) {
            Some(Ok(ids)) => json!(ids),
            _ => json!(text),
        };
        let body = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let req = Request::new("POST", "/v1/completions").key(&self.key).body("application/json", body.as_bytes());
        let sent = Instant::now();
        let (mut first, mut last, mut done, mut tokens, mut failed, mut prompt_tokens) = (None, sent, false, 0u32, false, 0);
        let r = self.client.stream(&req, |data, at| {
            last = at;
            if data == "[DONE]" {
                done = true;
                return true;
            }
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            failed |= v.get("error").is_some() || v.is_null();
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                first.get_or_insert(at);
            }
            // Counted by the usage: a token that ends inside a character has no chunk of its own.
            if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                prompt_tokens = p;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = u32::try_from(n).unwrap_or(u32::MAX);
            }
            true
        });
        let ok = matches!(r, Ok((200, _))) && done && !failed && tokens == self.max_tokens;
        let ms = |t: Instant| t.duration_since(sent).as_secs_f64() * 1e3;
        Sample { sent_ms: 0.0, ttft_ms: first.map_or(f64::NAN, ms), e2e_ms: ms(last), prompt_tokens, ok }
    }

    /// `n` requests open-loop, one every `every`, each on its own connection.
    pub fn open_loop(&self, n: usize, every: Duration, salt: usize) -> Vec<Sample> {
        let start = Instant::now();
        std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(n);
            for i in 0..n {
                if let Some(wait) = every.saturating_mul(i as u32).checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
                let sent_ms = start.elapsed().as_secs_f64() * 1e3;
                handles.push(s.spawn(move || Sample { sent_ms, ..self.request(salt + i) }));
            }
            handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
        })
    }
}

#[derive(Debug, Serialize)]
pub struct Capacity {
    pub requests_per_s: f64,
    /// Requests kept in flight (the server's `--max-running`).
    pub concurrency: usize,
    pub seconds: f64,
    pub completed: usize,
    pub failed: usize,
    /// B's prompt tokens and new tokens per request.
    pub prompt_tokens: u64,
    pub max_tokens: u32,
    pub latency: Latency,
}

/// B's requests closed-loop, `concurrency` at a time: a warm-up until as many have completed
/// (and at least a fifth of `seconds`), then completions counted over `seconds`.
pub fn capacity(b: &B<'_>, concurrency: usize, seconds: f64) -> Capacity {
    let window = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let next = AtomicUsize::new(1_000_000);
    let stop = AtomicBool::new(false);
    let done: Mutex<Vec<(Duration, Sample)>> = Mutex::default();
    let lock = || done.lock().unwrap_or_else(|e| e.into_inner());
    let mut warm = Duration::ZERO;
    std::thread::scope(|s| {
        for _ in 0..concurrency {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let sample = b.request(next.fetch_add(1, Ordering::Relaxed));
                    lock().push((start.elapsed(), sample));
                }
            });
        }
        while (lock().len() < concurrency || start.elapsed() < window / 5) && start.elapsed() < Duration::from_secs(300) {
            std::thread::sleep(Duration::from_millis(10));
        }
        warm = start.elapsed();
        std::thread::sleep(window);
        stop.store(true, Ordering::Relaxed);
    });
    let done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    let timed: Vec<Sample> = done.iter().filter(|(t, _)| *t >= warm && *t < warm + window).map(|(_, s)| *s).collect();
    let completed = timed.iter().filter(|s| s.ok).count();
    Capacity {
        requests_per_s: completed as f64 / seconds,
        concurrency,
        seconds,
        completed,
        failed: timed.len() - completed,
        prompt_tokens: done.iter().find(|(_, s)| s.ok).map_or(0, |(_, s)| s.prompt_tokens),
        max_tokens: b.max_tokens,
        latency: Latency::of(&timed),
    }
}
