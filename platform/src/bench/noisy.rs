//! `loraplex bench noisy-neighbor`: the HTTP server, started as a child process, under an
//! abusive tenant.
//!
//! The run first measures the server's capacity for tenant B's requests (streamed completions
//! of a short text prompt, `max_tokens` tokens each) with the server kept full. B then sends
//! requests open-loop, one every `1 / (fraction * capacity)` seconds: alone, then once per
//! pattern while tenant A, whose request and token limits allow a share of that same capacity,
//! sends the pattern as fast as its limits allow ([`patterns`]; the first, `plain`, is a
//! control with nothing abusive), then alone again. Each phase has a new tenant B unless asked
//! otherwise, so that no phase inherits another's place in the fair order. Each phase gives
//! B's time to first token (sending the request to its first token event) and end-to-end time
//! (to the final event); the target is B's p99 with A abusing at most twice B's p99 alone, for
//! every pattern. Every load is relative to the capacity the same run measures, so the figures
//! mean the same on a slow machine and a fast one.

mod patterns;
mod tenant_b;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde::Serialize;
use serde_json::{Value, json};

use self::patterns::{Kit, KitOptions, Pattern, Spec, Tallies, Tally, Tenant};
use self::tenant_b::{B, B_PROMPT, Capacity, Latency, capacity};
use super::Machine;
use super::http::{Client, Request, multipart};
use super::server::Server;
use crate::config::BenchNoisyArgs;
use crate::model::ModelConfig;
use crate::synth::{self, AdapterSynthOptions, AdapterTargets, FileDType};
use crate::tokenizer::Tokenizer;

/// B's p99 with A abusing over B's p99 alone, for time to first token and end to end.
pub const TARGET: f64 = 2.0;

/// B's p99 time to first token while A's batch runs over B's alone: batch work takes only
/// the capacity interactive requests leave. (Its end-to-end time is reported, not held to a
/// target: B's decode steps carry the batch's rows.)
pub const BATCH_TARGET: f64 = 1.5;

/// Whether a phase met its target.
fn passes(row: &Row) -> bool {
    let held = if row.phase.starts_with(Pattern::Batch.name()) { row.ttft_ratio <= BATCH_TARGET } else { row.ttft_ratio <= TARGET && row.e2e_ratio <= TARGET };
    row.b.failed == 0 && held
}

/// Tenant A's limits, a share of the measured capacity.
#[derive(Debug, Clone, Serialize)]
struct ALimits {
    requests_per_min: i64,
    tokens_per_min: i64,
    max_concurrent: i64,
    max_adapters: i64,
    max_adapter_bytes: i64,
}

#[derive(Debug, Default, Serialize)]
struct Row {
    phase: String,
    /// A's requests by kind, and in all.
    a_kinds: BTreeMap<&'static str, Tally>,
    a_total: Tally,
    /// Rows A's requests left in the usage ledger (requests admitted to inference).
    a_ledger_rows: u64,
    /// A's requests accepted: ledger rows for inference, 2xx answers for the rest.
    a_accepted: u64,
    b: Latency,
    /// Each of B's requests: when it was sent (ms from the first), its time to first token and
    /// end-to-end time (ms; -1 for a request that failed).
    b_samples: Vec<[f64; 3]>,
    ttft_ratio: f64,
    e2e_ratio: f64,
    pass: bool,
    seconds: f64,
    /// CPU seconds per second of B's requests: the server's (and by name, its threads alive at
    /// the end), and this process's.
    server_cores: f64,
    server_threads: BTreeMap<String, f64>,
    bench_cores: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    date: String,
    machine: Machine,
    model: String,
    server_flags: Vec<String>,
    capacity: Capacity,
    b_fraction: f64,
    b_requests_per_s: f64,
    b_requests: usize,
    /// How B sent its prompt: text or token ids.
    b_prompt: String,
    a_share: f64,
    a_limits: ALimits,
    /// The server's prompt byte cap, as it computes it.
    prompt_byte_cap: usize,
    target: f64,
    rows: Vec<Row>,
    failed: Vec<String>,
}

pub fn run(args: &BenchNoisyArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding this executable")?;
    run_with(args, &exe)
}

/// The bench with `exe` as the server's binary (tests pass the built `loraplex`).
pub fn run_with(args: &BenchNoisyArgs, exe: &Path) -> anyhow::Result<()> {
    let mut chosen = Vec::new();
    for p in &args.patterns {
        match (p.as_str(), Spec::parse(p)) {
            ("all", _) => chosen.extend(Pattern::ALL.map(|pattern| Spec { pattern, kind: None })),
            (_, Some(s)) => chosen.push(s),
            _ => bail!(
                "unknown pattern {p:?}: choose from {}, or all (PATTERN:KIND runs one kind: huge-prompts:fits|under|over, adapter-configs:allowed|refused, disconnects:stream|blocking|first-token)",
                Pattern::ALL.map(Pattern::name).join(", ")
            ),
        }
    }
    ensure!(args.b_fraction > 0.0 && args.b_fraction <= 1.0, "--b-fraction must be in (0, 1]");
    ensure!(args.a_share > 0.0 && args.b_requests > 0 && args.a_concurrent > 0 && args.capacity_seconds > 0.0, "the loads must be positive");
    let tmp = tempfile::tempdir().context("creating a scratch directory")?;
    let (dir, source) = super::model_dir(args.model.as_ref(), &args.hub, args.preset, args.model_dtype, None, tmp.path())?;
    let config = ModelConfig::open(&dir)?;
    let tokenizer = Tokenizer::open(&dir)?;
    let machine = Machine::here();
    println!("machine: {machine}");

    eprintln!("synthesizing adapters ...");
    let dims = super::dims_of(&config);
    let synth = |name: &str, count: usize, rank: usize, targets: AdapterTargets| {
        synth::synthesize_adapters(&AdapterSynthOptions {
            out: tmp.path().join(name),
            dims,
            count,
            ranks: vec![rank],
            targets,
            seed: 5,
            dtype: FileDType::Bf16,
        })
    };
    let upload_dir = synth("upload", 1, 8, AdapterTargets::Qv)?.remove(0);
    let pin_adapters =
        if chosen.iter().any(|s| s.pattern == Pattern::PinStorms) { synth("pins", args.pin_adapters, 16, AdapterTargets::All)? } else { Vec::new() };

    let flags = server_flags(args, &dir, machine.cores);
    println!("server: loraplex serve {}", flags.join(" "));
    let data = tmp.path().join("data");
    let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
    let server = Server::start(exe, &data, &flag_refs).context("starting the server")?;
    let admin = server.admin.clone().context("the server printed no admin key")?;
    let client = Client::new(server.addr.clone());
    let pid = server.child.id();

    let capacity_key = tenant(&client, &admin, "capacity", &json!({}))?;
    let models = client.json("GET", "/v1/models", Some(&capacity_key), None)?;
    let model = models.json()["data"][0]["id"].as_str().context("GET /v1/models named no model")?.to_string();
    let ids = match args.b_prompt.as_str() {
        "text" => None,
        "ids" => Some(&tokenizer),
        other => bail!("--b-prompt is text or ids; given {other:?}"),
    };
    let b = B { client: &client, ids, key: capacity_key, model: model.clone(), max_tokens: args.max_tokens };

    eprintln!("capacity: B's requests, {} at a time, for {} s ...", args.max_running, args.capacity_seconds);
    let cap = capacity(&b, args.max_running, args.capacity_seconds);
    ensure!(cap.completed > 0, "no request completed while the capacity was measured ({} failed)", cap.failed);
    let b_rate = cap.requests_per_s * args.b_fraction;
    let every = Duration::from_secs_f64(1.0 / b_rate);
    println!(
        "capacity: {:.2} requests/s ({} in flight; {} prompt + {} new tokens each; p50 {:.0} ms end to end); B offers {:.0}% of it: {:.2} requests/s, one every {:.0} ms",
        cap.requests_per_s,
        cap.concurrency,
        cap.prompt_tokens,
        cap.max_tokens,
        cap.latency.e2e_p50_ms,
        args.b_fraction * 100.0,
        b_rate,
        every.as_secs_f64() * 1e3
    );

    let tokens_per_request = (cap.prompt_tokens + u64::from(args.max_tokens)) as f64;
    let per_min = 60.0 * cap.requests_per_s * args.a_share;
    let limits = ALimits {
        requests_per_min: per_min.ceil().max(1.0) as i64,
        tokens_per_min: (per_min * tokens_per_request).ceil().max(1.0) as i64,
        max_concurrent: i64::from(args.a_concurrent),
        max_adapters: args.pin_adapters as i64 + 8,
        max_adapter_bytes: 8 << 30,
    };
    println!(
        "tenant A: {} requests/min, {} tokens/min ({:.0}% of the capacity), {} concurrent; it retries {} ms after a refusal",
        limits.requests_per_min,
        limits.tokens_per_min,
        args.a_share * 100.0,
        limits.max_concurrent,
        args.a_retry_ms
    );
    let byte_cap = config.max_position_embeddings.saturating_mul(tokenizer.longest_token_bytes()).saturating_mul(2);
    let uploads_per_key = flag_value(&flags, "--max-uploads-per-key").and_then(|v| v.parse().ok()).unwrap_or(2);
    let kit = Kit::build(KitOptions {
        client: &client,
        model: &model,
        tokenizer: &tokenizer,
        context: config.max_position_embeddings,
        byte_cap,
        requests_per_min: limits.requests_per_min,
        tokens_per_min: limits.tokens_per_min,
        concurrency: args.a_concurrent as usize,
        uploads_per_key,
        stalled: args.stalled,
        retry: Duration::from_millis(args.a_retry_ms),
        short_prompt: B_PROMPT,
        upload_dir: &upload_dir,
        pin_adapters,
        batch_lines: args.batch_lines,
    })?;

    let shared_b = if args.shared_b { Some(tenant(&client, &admin, "tenant-b", &json!({}))?) } else { None };
    let mut rows = Vec::new();
    let mut phases: Vec<Option<Spec>> = vec![None];
    phases.extend(chosen.iter().copied().map(Some));
    if args.repeat_alone {
        phases.push(None);
    }
    for (n, phase) in phases.into_iter().enumerate() {
        let name = match phase {
            Some(s) => s.name(),
            None if n == 0 => "alone".to_string(),
            None => "alone (again)".to_string(),
        };
        eprintln!("phase {name}: {} requests of B ...", args.b_requests);
        // A tenant's share of the steps follows the service it has had: unless asked, each
        // phase has a new tenant B, so that no phase inherits another's history.
        let b = match &shared_b {
            Some(key) => B { key: key.clone(), ..b.clone() },
            None => B { key: tenant(&client, &admin, &format!("tenant-b-{n}"), &json!({}))?, ..b.clone() },
        };
        let row = match phase {
            None => measure(&b, pid, args, every, n, &name),
            Some(spec) => {
                let p = spec.pattern;
                // A batch is limited by the server's batch concurrency, not by a tenant's rates.
                let a_limits = if p == Pattern::Batch { json!({}) } else { json!(limits) };
                let key = tenant(&client, &admin, &format!("tenant-a-{n}"), &a_limits)?;
                let pins = if p == Pattern::PinStorms { upload_pins(&client, &key, &kit.pin_adapters)? } else { Vec::new() };
                let a = Tenant { key: &key, pins: &pins };
                let tallies = Tallies::default();
                let stop = AtomicBool::new(false);
                let mut row = std::thread::scope(|s| {
                    s.spawn(|| patterns::run(spec, &kit, &a, &stop, &tallies));
                    std::thread::sleep(Duration::from_millis(args.a_warmup_ms));
                    let row = measure(&b, pid, args, every, n, &name);
                    stop.store(true, Ordering::Relaxed);
                    row
                });
                wait_idle(&client, &admin);
                row.a_kinds = tallies.take();
                for t in row.a_kinds.values() {
                    row.a_total.add(t);
                }
                row.a_ledger_rows = client.json("GET", "/v1/usage", Some(&key), None)?.json()["totals"]["requests"].as_u64().unwrap_or(0);
                row.a_accepted = match p {
                    Pattern::Plain | Pattern::HugePrompts | Pattern::StopLists | Pattern::Disconnects => row.a_ledger_rows,
                    Pattern::Batch => row.a_kinds.get("batch lines").map_or(0, |t| t.ok),
                    _ => row.a_total.ok,
                };
                row
            }
        };
        rows.push(row);
        let (alone_ttft, alone_e2e) = (rows[0].b.ttft_p99_ms, rows[0].b.e2e_p99_ms);
        let row = rows.last_mut().context("no row")?;
        row.ttft_ratio = row.b.ttft_p99_ms / alone_ttft;
        row.e2e_ratio = row.b.e2e_p99_ms / alone_e2e;
        row.pass = passes(row);
        print_progress(row);
    }
    drop(server);
    rescore(&mut rows);

    // The alone rows are the reference and a check of the machine's drift, not patterns.
    let failed: Vec<String> = rows.iter().filter(|r| !r.pass && !r.phase.starts_with("alone")).map(|r| r.phase.clone()).collect();
    let report = Report {
        date: crate::store::date(crate::store::now_ms().div_euclid(86_400_000)),
        machine,
        model: format!("{source} ({} layers, hidden {}, context {})", config.num_layers, config.hidden_size, config.max_position_embeddings),
        server_flags: flags,
        capacity: cap,
        b_fraction: args.b_fraction,
        b_requests_per_s: b_rate,
        b_requests: args.b_requests,
        b_prompt: args.b_prompt.clone(),
        a_share: args.a_share,
        a_limits: limits,
        prompt_byte_cap: byte_cap,
        target: TARGET,
        rows,
        failed,
    };
    print_table(&report);
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?).with_context(|| format!("writing {}", args.out.display()))?;
    println!("report written to {}", args.out.display());
    Ok(())
}

/// The `serve` flags: the limits the run relies on, explicit, then `--serve-arg`s (which
/// replace the bench's value of the same flag).
fn server_flags(args: &BenchNoisyArgs, model: &Path, cores: usize) -> Vec<String> {
    let ours = [
        ("--model", model.display().to_string()),
        ("--max-running", args.max_running.to_string()),
        ("--max-batch-tokens", args.max_batch_tokens.to_string()),
        ("--pool-mb", "1024".into()),
        ("--host-cache-mb", "1024".into()),
        ("--http-workers", cores.to_string()),
        ("--blocking-threads", cores.to_string()),
        ("--blocking-queue", "64".into()),
        ("--max-pending", "256".into()),
        ("--max-pending-per-tenant", "64".into()),
        ("--body-timeout", "30".into()),
        ("--max-uploads-per-key", "2".into()),
        ("--max-pinned-percent", "25".into()),
        ("--tenant-pinned-percent", "10".into()),
    ];
    let given = |flag: &str| args.serve_args.iter().any(|a| a.split('=').next() == Some(flag));
    let mut out: Vec<String> = ours.iter().filter(|(f, _)| !given(f)).map(|(f, v)| format!("{f}={v}")).collect();
    out.extend(args.serve_args.iter().cloned());
    out
}

fn flag_value(flags: &[String], flag: &str) -> Option<String> {
    flags.iter().rev().find_map(|f| f.strip_prefix(flag).and_then(|v| v.strip_prefix('=')).map(str::to_string))
}

/// Creates a tenant with `limits` and returns a key of it.
fn tenant(client: &Client, admin: &str, name: &str, limits: &Value) -> anyhow::Result<String> {
    let r = client.json("POST", "/admin/tenants", Some(admin), Some(&json!({"name": name, "limits": limits})))?;
    ensure!(r.status == 201, "creating tenant {name}: {} {}", r.status, r.text());
    let id = r.json()["id"].as_str().context("a tenant without an id")?.to_string();
    let r = client.json("POST", &format!("/admin/tenants/{id}/keys"), Some(admin), None)?;
    ensure!(r.status == 201, "creating a key of {name}: {} {}", r.status, r.text());
    Ok(r.json()["key"].as_str().context("a key without its secret")?.to_string())
}

/// Uploads the pin storm's adapters to A; their names.
fn upload_pins(client: &Client, key: &str, dirs: &[std::path::PathBuf]) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        let name = format!("pin-{i}");
        let (config, weights) = (std::fs::read(d.join("adapter_config.json"))?, std::fs::read(d.join("adapter_model.safetensors"))?);
        let (ctype, body) = multipart(&[("name", name.as_bytes()), ("config", &config), ("weights", &weights)]);
        let r = client.send(&Request::new("POST", "/v1/adapters").key(key).body(&ctype, &body))?;
        ensure!(r.status == 201, "uploading {name}: {} {}", r.status, r.text());
        names.push(name);
    }
    Ok(names)
}

/// Waits until the server runs and queues nothing (A's requests cancelled or done), then a
/// little more for its blocking jobs.
fn wait_idle(client: &Client, admin: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut quiet = 0;
    while quiet < 3 && Instant::now() < deadline {
        let busy: f64 = client.json("GET", "/metrics", Some(admin), None).map_or(1.0, |r| {
            r.text()
                .lines()
                .filter(|l| l.starts_with("vllm:num_requests_running") || l.starts_with("vllm:num_requests_waiting"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        });
        quiet = if busy == 0.0 { quiet + 1 } else { 0 };
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
}

/// CPU seconds process `pid` has used, its threads that ended included.
fn process_cpu(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().map_or(0.0, |stat| cpu_seconds(&stat))
}

/// utime + stime of a `/proc/.../stat` line (fields 14 and 15, in ticks of 1/100 s).
fn cpu_seconds(stat: &str) -> f64 {
    let Some(close) = stat.rfind(')') else { return 0.0 };
    let fields: Vec<&str> = stat.get(close + 2..).unwrap_or("").split(' ').collect();
    fields.get(11..13).map_or(0.0, |f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum()) / 100.0
}

/// CPU seconds of process `pid`'s live threads, summed by thread name (digits dropped).
fn thread_cpu(pid: u32) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let name = stat[open + 1..close].trim_end_matches(|c: char| c.is_ascii_digit() || c == ':' || c == '-' || c == '|').to_string();
        *out.entry(name).or_insert(0.0) += cpu_seconds(&stat);
    }
    out
}

/// B's requests of one phase, and what the server and this process spent meanwhile.
fn measure(b: &B<'_>, pid: u32, args: &BenchNoisyArgs, every: Duration, n: usize, name: &str) -> Row {
    let (threads0, server0, bench0, start) = (thread_cpu(pid), process_cpu(pid), process_cpu(std::process::id()), Instant::now());
    let samples = b.open_loop(args.b_requests, every, n * 10_000);
    let seconds = start.elapsed().as_secs_f64();
    let (threads1, server1, bench1) = (thread_cpu(pid), process_cpu(pid), process_cpu(std::process::id()));
    let server_threads: BTreeMap<String, f64> =
        threads1.iter().map(|(k, v)| (k.clone(), (v - threads0.get(k).copied().unwrap_or(0.0)).max(0.0) / seconds)).filter(|(_, v)| *v >= 0.005).collect();
    Row {
        phase: name.to_string(),
        a_kinds: BTreeMap::new(),
        a_total: Tally::default(),
        a_ledger_rows: 0,
        a_accepted: 0,
        b: Latency::of(&samples),
        b_samples: samples
            .iter()
            .map(|s| if s.ok { [s.sent_ms.round(), s.ttft_ms.round(), s.e2e_ms.round()] } else { [s.sent_ms.round(), -1.0, -1.0] })
            .collect(),
        ttft_ratio: 1.0,
        e2e_ratio: 1.0,
        pass: true,
        seconds,
        server_cores: (server1 - server0) / seconds,
        server_threads,
        bench_cores: (bench1 - bench0) / seconds,
    }
}

/// With B measured alone twice, the reference of each measure is the lower of the two p99s: a
/// stray slow request in one alone phase must not loosen the target for every pattern.
fn rescore(rows: &mut [Row]) {
    let alone: Vec<&Row> = rows.iter().filter(|r| r.phase.starts_with("alone")).collect();
    if alone.len() < 2 {
        return;
    }
    let ttft = alone.iter().map(|r| r.b.ttft_p99_ms).fold(f64::INFINITY, f64::min);
    let e2e = alone.iter().map(|r| r.b.e2e_p99_ms).fold(f64::INFINITY, f64::min);
    println!("reference: the lower p99 of the two phases of B alone: TTFT {ttft:.0} ms, end to end {e2e:.0} ms");
    for row in rows.iter_mut() {
        row.ttft_ratio = row.b.ttft_p99_ms / ttft;
        row.e2e_ratio = row.b.e2e_p99_ms / e2e;
        row.pass = passes(row);
    }
}

fn print_progress(r: &Row) {
    let mut threads: Vec<(&String, &f64)> = r.server_threads.iter().collect();
    threads.sort_by(|a, b| b.1.total_cmp(a.1));
    let top: Vec<String> = threads.iter().take(4).map(|(n, c)| format!("{n} {c:.2}")).collect();
    println!(
        "{}: B p99 TTFT {:.0} ms, e2e {:.0} ms ({:.2}x, {:.2}x); A sent {}, accepted {}, refused {}; server {:.2} cores ({}), bench {:.2}",
        r.phase,
        r.b.ttft_p99_ms,
        r.b.e2e_p99_ms,
        r.ttft_ratio,
        r.e2e_ratio,
        r.a_total.sent,
        r.a_accepted,
        r.a_total.refusals(),
        r.server_cores,
        top.join(", "),
        r.bench_cores
    );
}

fn print_table(r: &Report) {
    println!();
    println!(
        "B: {:.2} requests/s ({:.0}% of {:.2}), {} per phase; target: B's p99 with A <= {TARGET}x alone (TTFT <= {BATCH_TARGET}x while A's batch runs)",
        r.b_requests_per_s,
        r.b_fraction * 100.0,
        r.capacity.requests_per_s,
        r.b_requests
    );
    println!(
        "| phase | A sent | A accepted | A refused (429) | B TTFT p50 ms | B TTFT p99 ms | B e2e p99 ms | TTFT p99 ratio | e2e p99 ratio | result |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    );
    for row in &r.rows {
        let a = if row.phase.starts_with("alone") {
            "| - | - | - |".to_string()
        } else {
            format!("| {} | {} | {} ({}) |", row.a_total.sent, row.a_accepted, row.a_total.refusals(), row.a_total.limited)
        };
        let failed = if row.b.failed > 0 { format!(", {} of B failed", row.b.failed) } else { String::new() };
        let result = match (row.phase.as_str(), row.pass) {
            (p, _) if p.starts_with("alone") && row.ttft_ratio <= 1.0 && row.e2e_ratio <= 1.0 => "reference",
            (p, _) if p.starts_with("alone") && row.ttft_ratio <= 1.0 => "reference (TTFT)",
            (p, _) if p.starts_with("alone") && row.e2e_ratio <= 1.0 => "reference (end to end)",
            (p, true) if p.starts_with("alone") => "drift within the target",
            (p, false) if p.starts_with("alone") => "DRIFT beyond the target",
            (_, true) => "pass",
            (_, false) => "FAIL",
        };
        println!(
            "| {} {a} {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {}{failed} |",
            row.phase, row.b.ttft_p50_ms, row.b.ttft_p99_ms, row.b.e2e_p99_ms, row.ttft_ratio, row.e2e_ratio, result
        );
    }
    for row in r.rows.iter().filter(|r| !r.a_kinds.is_empty()) {
        let kinds: Vec<String> = row
            .a_kinds
            .iter()
            .map(|(k, t)| format!("{k}: {} sent, {} ok, {} refused ({} 429), {} hung up", t.sent, t.ok, t.refusals(), t.limited, t.hung_up))
            .collect();
        println!("{}: {}", row.phase, kinds.join("; "));
    }
    if r.failed.is_empty() {
        println!("every pattern met the target");
    } else {
        println!("FAILED the target: {}", r.failed.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(phase: &str, ttft: f64, e2e: f64) -> Row {
        Row { phase: phase.into(), b: Latency { ttft_p99_ms: ttft, e2e_p99_ms: e2e, ..Latency::default() }, ..Row::default() }
    }

    #[test]
    fn patterns_are_measured_against_the_lower_of_the_two_alone_phases() {
        let mut rows = vec![row("alone", 80.0, 300.0), row("plain", 100.0, 500.0), row("alone (again)", 40.0, 320.0)];
        rescore(&mut rows);
        let got: Vec<(f64, f64, bool)> = rows.iter().map(|r| (r.ttft_ratio, r.e2e_ratio, r.pass)).collect();
        assert_eq!(got, vec![(2.0, 1.0, true), (2.5, 500.0 / 300.0, false), (1.0, 320.0 / 300.0, true)]);
        // One alone phase: nothing to choose between.
        let mut one = vec![row("alone", 80.0, 300.0), row("plain", 100.0, 500.0)];
        rescore(&mut one);
        assert_eq!(one[1].ttft_ratio, 0.0);
    }
}
