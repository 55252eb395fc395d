//! Prometheus metrics in the text exposition format: counters and histograms kept by the HTTP
//! layer, and gauges read from the workers when scraped. Also the names Kubernetes inference
//! gateways read (`vllm:*`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

use crate::runtime::{Usage, WorkerStats};

/// Bucket bounds, in seconds.
const LATENCY_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Time on database-backed state per request: fine up to 20 ms, where the cluster's target (a
/// p99 at most 5 ms above a single server's) is compared; 2.5 ms apart from 5 to 20 ms.
const STATE_BUCKETS: [f64; 23] =
    [0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];
const TOKEN_BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// Cumulative counts per upper bound (the last, `+Inf`, is `count`), as JSON.
    fn json(&self) -> serde_json::Value {
        serde_json::json!({"le": self.bounds, "cumulative": self.counts, "count": self.count, "sum": self.sum})
    }

    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", self.count, self.sum, self.count);
    }

    /// One labelled series of a histogram whose HELP and TYPE lines are written already.
    fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
        }
        let _ =
            writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}\n{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}", self.count, self.sum, self.count);
    }
}

#[derive(Debug)]
struct Inner {
    /// (endpoint, outcome) -> requests.
    requests: BTreeMap<(&'static str, String), u64>,
    /// (tenant, kind) -> tokens.
    tokens: BTreeMap<(String, &'static str), u64>,
    /// Requests refused by a tenant limit, by tenant.
    limited: BTreeMap<String, u64>,
    /// Adapter label -> (requests waiting for their first token, requests generating).
    lora: BTreeMap<String, (usize, usize)>,
    /// Adapter version key (its id) -> the name clients send, for the versions this server has
    /// met (requests, loads), so resident ones can be listed by name.
    adapter_names: BTreeMap<String, String>,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    queue: Histogram,
    /// By part: the key, the tenant's limits, the ledger row, and all three.
    state: [Histogram; 4],
}

/// The HTTP layer's metrics. One per server.
#[derive(Debug)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                tokens: BTreeMap::new(),
                limited: BTreeMap::new(),
                lora: BTreeMap::new(),
                adapter_names: BTreeMap::new(),
                ttft: Histogram::new(&LATENCY_BUCKETS),
                tpot: Histogram::new(&TOKEN_BUCKETS),
                e2e: Histogram::new(&LATENCY_BUCKETS),
                queue: Histogram::new(&LATENCY_BUCKETS),
                state: [(); 4].map(|()| Histogram::new(&STATE_BUCKETS)),
            }),
        }
    }
}

/// Where an inference request's time on database-backed state went.
#[derive(Debug, Clone, Copy, Default)]
pub struct StateTime {
    /// Finding its key (and tenant).
    pub key: Duration,
    /// Its tenant's limits: admission and the token reservation.
    pub limits: Duration,
    /// Its ledger row: opened before it runs, committed when it ends.
    pub ledger: Duration,
}

/// What one finished inference request contributes.
pub struct Observation<'a> {
    pub endpoint: &'static str,
    pub outcome: &'a str,
    pub tenant: &'a str,
    pub usage: &'a Usage,
    /// Time to the first token, when one was produced.
    pub ttft: Option<Duration>,
    pub total: Duration,
}

/// What the workers report, gathered at scrape time.
pub struct Snapshot<'a> {
    pub workers: &'a [WorkerStats],
    /// The most adapters one batch may use.
    pub max_lora: usize,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The latency histograms and the request counts by outcome, as JSON: what the console's
    /// dashboard turns into recent percentiles and rates (from the change between two reads).
    pub fn json(&self) -> serde_json::Value {
        let m = self.lock();
        let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
        for ((_, outcome), n) in &m.requests {
            *outcomes.entry(outcome).or_default() += n;
        }
        let waiting: usize = m.lora.values().map(|(w, _)| w).sum();
        let running: usize = m.lora.values().map(|(_, r)| r).sum();
        serde_json::json!({
            "requests": outcomes,
            "in_http": {"waiting_first_token": waiting, "generating": running},
            "ttft_seconds": m.ttft.json(),
            "tpot_seconds": m.tpot.json(),
            "e2e_seconds": m.e2e.json(),
            "queue_seconds": m.queue.json(),
        })
    }

    pub fn observe(&self, o: &Observation<'_>) {
        let mut m = self.lock();
        *m.requests.entry((o.endpoint, o.outcome.to_string())).or_default() += 1;
        for (kind, n) in [("prompt", o.usage.prompt_tokens), ("cached_prompt", o.usage.cached_prompt_tokens), ("completion", o.usage.completion_tokens)] {
            *m.tokens.entry((o.tenant.to_string(), kind)).or_default() += n as u64;
        }
        m.e2e.observe(o.total.as_secs_f64());
        if let Some(ttft) = o.ttft {
            m.ttft.observe(ttft.as_secs_f64());
            m.queue.observe(o.usage.queue_time.as_secs_f64());
            if o.usage.completion_tokens > 1 {
                let decode = o.total.saturating_sub(ttft).as_secs_f64();
                m.tpot.observe(decode / (o.usage.completion_tokens - 1) as f64);
            }
        }
    }

    /// A job for `adapter` (a label; empty for the base model) was queued.
    pub fn job_queued(&self, adapter: &str) {
        if !adapter.is_empty() {
            self.lock().lora.entry(adapter.to_string()).or_default().0 += 1;
        }
    }

    /// ... produced its first token.
    pub fn job_running(&self, adapter: &str) {
        if let Some(e) = self.lock().lora.get_mut(adapter) {
            e.0 = e.0.saturating_sub(1);
            e.1 += 1;
        }
    }

    /// ... ended, after its first token or before.
    pub fn job_ended(&self, adapter: &str, running: bool) {
        let mut m = self.lock();
        if let Some(e) = m.lora.get_mut(adapter) {
            if running {
                e.1 = e.1.saturating_sub(1);
            } else {
                e.0 = e.0.saturating_sub(1);
            }
            if *e == (0, 0) {
                m.lora.remove(adapter);
            }
        }
    }

    /// An inference request spent `took` on database-backed state: its key, its tenant's limits
    /// (admission, the token reservation) and its ledger row (opened, committed).
    pub fn state_time(&self, took: &StateTime) {
        let mut m = self.lock();
        for (h, t) in m.state.iter_mut().zip([took.key, took.limits, took.ledger, took.key + took.limits + took.ledger]) {
            h.observe(t.as_secs_f64());
        }
    }

    /// Adapter version `id` is called `name` by clients.
    pub fn name_adapter(&self, id: &str, name: &str) {
        let mut m = self.lock();
        if m.adapter_names.get(id).is_none_or(|n| n != name) {
            m.adapter_names.insert(id.to_string(), name.to_string());
        }
    }

    /// Adapter version `id` was deleted.
    pub fn forget_adapter(&self, id: &str) {
        self.lock().adapter_names.remove(id);
    }

    /// A request refused by one of `tenant`'s limits.
    pub fn limited(&self, tenant: &str) {
        *self.lock().limited.entry(tenant.to_string()).or_default() += 1;
    }

    pub fn render(&self, s: &Snapshot<'_>) -> String {
        let m = self.lock();
        let mut out = String::with_capacity(8192);
        let o = &mut out;
        let _ = writeln!(o, "# HELP loraplex_requests_total Inference requests by endpoint and outcome.\n# TYPE loraplex_requests_total counter");
        for ((endpoint, outcome), n) in &m.requests {
            let _ = writeln!(o, "loraplex_requests_total{{endpoint=\"{endpoint}\",outcome=\"{}\"}} {n}", escape(outcome));
        }
        let _ = writeln!(o, "# HELP loraplex_rate_limited_total Requests refused by a tenant limit.\n# TYPE loraplex_rate_limited_total counter");
        for (tenant, n) in &m.limited {
            let _ = writeln!(o, "loraplex_rate_limited_total{{tenant=\"{}\"}} {n}", escape(tenant));
        }
        let _ =
            writeln!(o, "# HELP loraplex_tokens_total Tokens by tenant and kind (prompt, cached_prompt, completion).\n# TYPE loraplex_tokens_total counter");
        for ((tenant, kind), n) in &m.tokens {
            let _ = writeln!(o, "loraplex_tokens_total{{tenant=\"{}\",kind=\"{kind}\"}} {n}", escape(tenant));
        }
        m.ttft.render(o, "loraplex_time_to_first_token_seconds", "From arrival to the first token.");
        m.tpot.render(o, "loraplex_time_per_output_token_seconds", "Mean time between output tokens, per request.");
        m.e2e.render(o, "loraplex_e2e_request_latency_seconds", "From arrival to the last token.");
        m.queue.render(o, "loraplex_queue_time_seconds", "From arrival until the request first ran.");
        let _ = writeln!(
            o,
            "# HELP loraplex_state_seconds Time an inference request spent on database-backed state, by part: its key, its tenant's limits (shared by replicas on PostgreSQL), its ledger row, and all.\n# TYPE loraplex_state_seconds histogram"
        );
        for (h, part) in m.state.iter().zip(["key", "limits", "ledger", "all"]) {
            h.render_series(o, "loraplex_state_seconds", &format!("part=\"{part}\""));
        }
        // GIE's model-server protocol: `running_lora_adapters` are the adapters "currently loaded
        // in GPU memory and ready to serve requests" (here: resident in a worker's pool, and
        // those of requests generating), `waiting_lora_adapters` those of requests waiting to
        // be served; both by the name clients send as `model` (a label `name@version` counts as
        // its name), so that a gateway's LoRA affinity matches requests to them.
        let name = |label: &str| label.rsplit_once('@').map_or(label, |(n, _)| n).to_string();
        let mut running_adapters: std::collections::BTreeSet<String> = m.lora.iter().filter(|(_, c)| c.1 > 0).map(|(k, _)| name(k)).collect();
        for w in s.workers {
            running_adapters.extend(w.resident_adapters.iter().filter_map(|id| m.adapter_names.get(id).cloned()));
        }
        let running_adapters: Vec<String> = running_adapters.into_iter().collect();
        let waiting_adapters: Vec<String> =
            m.lora.iter().filter(|(_, c)| c.0 > 0).map(|(k, _)| name(k)).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        drop(m);

        let sum = |f: &dyn Fn(&WorkerStats) -> u64| s.workers.iter().map(f).sum::<u64>();
        let gauge = |o: &mut String, name: &str, help: &str, kind: &str, v: f64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let running = sum(&|w| w.running as u64);
        let waiting = sum(&|w| w.waiting as u64);
        gauge(o, "loraplex_requests_running", "Sequences generating now.", "gauge", running as f64);
        gauge(o, "loraplex_requests_waiting", "Sequences queued.", "gauge", waiting as f64);
        let _ = writeln!(
            o,
            "# HELP loraplex_worker_healthy 1 when the worker has an engine and takes requests; 0 while it is being rebuilt.\n# TYPE loraplex_worker_healthy gauge"
        );
        for w in s.workers {
            let _ = writeln!(o, "loraplex_worker_healthy{{worker=\"{}\"}} {}", w.worker, u8::from(w.unhealthy.is_none()));
        }
        let _ = writeln!(
            o,
            "# HELP loraplex_step_fixed_cost A step's fixed time in units of a token's cost, measured from the worker's steps (or --step-overhead).\n# TYPE loraplex_step_fixed_cost gauge"
        );
        for w in s.workers {
            let _ = writeln!(o, "loraplex_step_fixed_cost{{worker=\"{}\"}} {}", w.worker, w.step_fixed_cost);
        }
        let _ = writeln!(o, "# HELP loraplex_pool_pages Page pool pages by kind, per worker.\n# TYPE loraplex_pool_pages gauge");
        for w in s.workers {
            let p = &w.pool;
            for (kind, n) in [("total", p.total), ("free", p.free), ("kv", p.kv), ("adapter", p.adapter), ("prefix", p.cached), ("reclaimable", p.reclaimable)]
            {
                let _ = writeln!(o, "loraplex_pool_pages{{worker=\"{}\",kind=\"{kind}\"}} {n}", w.worker);
            }
        }
        let _ = writeln!(o, "# HELP loraplex_pool_evictions_total Pool entries evicted, by kind.\n# TYPE loraplex_pool_evictions_total counter");
        let _ = writeln!(o, "loraplex_pool_evictions_total{{kind=\"adapter\"}} {}", sum(&|w| w.pool.adapter_evictions));
        let _ = writeln!(o, "loraplex_pool_evictions_total{{kind=\"prefix\"}} {}", sum(&|w| w.pool.evictions - w.pool.adapter_evictions));
        let _ = writeln!(
            o,
            "# HELP loraplex_adapter_requests_total Requests by where their adapter was when they arrived (device, host, disk).\n# TYPE loraplex_adapter_requests_total counter"
        );
        for (tier, n) in [("device", sum(&|w| w.adapters.device_hits)), ("host", sum(&|w| w.adapters.host_hits)), ("disk", sum(&|w| w.adapters.disk_misses))] {
            let _ = writeln!(o, "loraplex_adapter_requests_total{{tier=\"{tier}\"}} {n}");
        }
        let _ = writeln!(
            o,
            "# HELP loraplex_adapter_loads_total Adapters placed in a device pool, by the tier they came from.\n# TYPE loraplex_adapter_loads_total counter"
        );
        for (tier, n) in [("host", sum(&|w| w.adapters.loads_from_host)), ("disk", sum(&|w| w.adapters.loads_from_disk))] {
            let _ = writeln!(o, "loraplex_adapter_loads_total{{from=\"{tier}\"}} {n}");
        }
        gauge(o, "loraplex_adapter_load_failures_total", "Adapter loads that failed.", "counter", sum(&|w| w.adapters.failures) as f64);
        gauge(o, "loraplex_host_adapter_bytes", "Bytes of adapters in host memory.", "gauge", s.workers.first().map_or(0, |w| w.host_adapter_bytes) as f64);
        let looked = sum(&|w| w.prefix.looked_up);
        let hits = sum(&|w| w.prefix.hits);
        gauge(o, "loraplex_prefix_cache_queries_total", "Prompt blocks looked up in the prefix cache.", "counter", looked as f64);
        gauge(o, "loraplex_prefix_cache_hits_total", "Prompt blocks found in the prefix cache.", "counter", hits as f64);
        let rate = if looked == 0 { 0.0 } else { hits as f64 / looked as f64 };
        gauge(o, "loraplex_prefix_cache_hit_rate", "Prefix-cache hits over lookups since start.", "gauge", rate);
        gauge(o, "loraplex_preemptions_total", "Sequences preempted to free pages.", "counter", sum(&|w| w.preemptions) as f64);
        gauge(o, "loraplex_worker_restarts_total", "Workers rebuilt after a failed step.", "counter", sum(&|w| w.restarts) as f64);
        gauge(o, "loraplex_generated_tokens_total", "Tokens generated by every worker.", "counter", sum(&|w| w.generated_tokens) as f64);

        // The names inference gateways scrape.
        gauge(o, "vllm:num_requests_running", "Requests running on the engine.", "gauge", running as f64);
        gauge(o, "vllm:num_requests_waiting", "Requests waiting to run.", "gauge", waiting as f64);
        let (total, used) = s.workers.iter().fold((0usize, 0usize), |(t, u), w| (t + w.pool.total, u + w.pool.kv));
        let usage = if total == 0 { 0.0 } else { used as f64 / total as f64 };
        gauge(o, "vllm:kv_cache_usage_perc", "Fraction of the page pool held by running sequences' KV blocks.", "gauge", usage);
        gauge(o, "vllm:gpu_cache_usage_perc", "Same as vllm:kv_cache_usage_perc (older name).", "gauge", usage);
        let list = |v: &[String]| escape(&v.join(","));
        let now = crate::store::now_ms() as f64 / 1e3;
        let _ = writeln!(o, "# HELP vllm:lora_requests_info Adapters of running and waiting requests.\n# TYPE vllm:lora_requests_info gauge");
        let _ = writeln!(
            o,
            "vllm:lora_requests_info{{running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\",max_lora=\"{}\"}} {now}",
            list(&running_adapters),
            list(&waiting_adapters),
            s.max_lora
        );
        out
    }
}
