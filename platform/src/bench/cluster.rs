//! `loraplex bench cluster`: what sharing state between replicas costs. The same load of tiny
//! requests (a completion of `--max-tokens` tokens from the tiny model, so that the engine costs
//! next to nothing) runs against one server on SQLite, then against `--replicas` servers sharing
//! one PostgreSQL database, each with its tenant limits shared through it. `--clients` clients
//! send requests back to back, spread over `--tenants` tenants (each with limits high enough never
//! to refuse, so that every request goes through the limits' rows) and over the replicas.
//!
//! The replicas also serve tenants without limits, apart: what the key and the ledger cost
//! alone, without the limits' rows.
//!
//! The one server runs with the machine's cores; each replica with its share of them
//! (`--replica-threads`, by default the cores divided among the replicas, at least one), as a
//! replica in a pod with a CPU limit would: the thread counts a server picks by default follow
//! the limit.
//!
//! Reported for each: requests per second, how busy the machine's cores were, the clients' latency, and the time each request spent
//! on database-backed state (its key, its tenant's limits, its ledger row), from the servers'
//! `loraplex_state_seconds` histograms over the timed window (quantiles are bucket upper bounds).
//! Target: the state path's p99 on PostgreSQL at most 5 ms more than on SQLite. Each offered
//! load runs `--rounds` times, the three phases in turn, and the median round's overhead is the
//! figure: a one-off stall (here, of the machine's disk under the two stores' fsyncs) moves one
//! phase's p99 by hundreds of milliseconds, on SQLite as on PostgreSQL.
//! On one machine the replicas share its cores, so aggregate throughput says little; the state
//! path's time is the figure.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use serde_json::json;

use super::Machine;
use super::http::{Client, KeepAlive};
use super::server::Server;
use crate::config::BenchClusterArgs;

/// The largest extra p99 time on shared state, PostgreSQL against SQLite.
pub const TARGET_MS: f64 = 5.0;

const ADMIN: &str = "bench-operator-key-0123456789";

#[derive(Debug, Serialize)]
struct Phase {
    name: String,
    /// The round of a paced phase (from 1); `None` for a capacity phase.
    round: Option<u32>,
    replicas: usize,
    /// Requests per second offered (paced clients), or `None`: as fast as answered.
    offered_per_s: Option<f64>,
    requests: usize,
    refused: usize,
    seconds: f64,
    requests_per_s: f64,
    client_p50_ms: f64,
    client_p99_ms: f64,
    /// The state path, from the servers' histograms (bucket upper bounds): all of it, then
    /// each part.
    state: Vec<PartTime>,
    /// How busy this machine's cores were over the phase (0 to 1, all of them together: the
    /// servers, the database and the clients share them); `None` off Linux.
    cpu_busy: Option<f64>,
}

/// (busy, all) clock ticks of every core since boot, from `/proc/stat`.
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let all: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((all - idle, all))
}

/// The parts of `loraplex_state_seconds`, as the servers label them.
const PARTS: [&str; 4] = ["all", "key", "limits", "ledger"];

/// One part's `loraplex_state_seconds` histogram summed over `servers`: (upper bound,
/// cumulative), sum, count.
type Summed = (Vec<(f64, u64)>, f64, u64);

/// Every part's histogram, summed over `servers`, in the order of [`PARTS`].
fn state_histograms(servers: &[Server]) -> anyhow::Result<Vec<Summed>> {
    let mut out: Vec<Summed> = PARTS.iter().map(|_| (Vec::new(), 0.0, 0)).collect();
    for s in servers {
        let page = s.client().json("GET", "/metrics", Some(ADMIN), None)?.text();
        let mut at = vec![0usize; PARTS.len()];
        for line in page.lines() {
            let Some(rest) = line.strip_prefix("loraplex_state_seconds") else { continue };
            let Some(p) = PARTS.iter().position(|p| rest.contains(&format!("part=\"{p}\""))) else { continue };
            let value = rest.rsplit_once(' ').context("a metric line")?.1;
            let h = &mut out[p];
            if rest.starts_with("_bucket") {
                let le = rest.split("le=\"").nth(1).and_then(|r| r.split('"').next()).context("a bucket bound")?;
                if le == "+Inf" {
                    continue;
                }
                let (le, n): (f64, u64) = (le.parse()?, value.parse()?);
                if h.0.len() <= at[p] {
                    h.0.push((le, 0));
                }
                h.0[at[p]].1 += n;
                at[p] += 1;
            } else if rest.starts_with("_sum") {
                h.1 += value.parse::<f64>()?;
            } else if rest.starts_with("_count") {
                h.2 += value.parse::<u64>()?;
            }
        }
    }
    Ok(out)
}

/// A part's time over a window: p50 and p99 (bucket upper bounds) and mean, in ms.
#[derive(Debug, Serialize)]
struct PartTime {
    part: &'static str,
    p50_ms: f64,
    p99_ms: f64,
    mean_ms: f64,
}

fn part_times(before: &[Summed], after: &[Summed]) -> Vec<PartTime> {
    PARTS
        .iter()
        .zip(before.iter().zip(after))
        .map(|(part, (b, a))| {
            let n = a.2 - b.2;
            PartTime {
                part,
                p50_ms: bucket_quantile(&b.0, &a.0, n, 0.5),
                p99_ms: bucket_quantile(&b.0, &a.0, n, 0.99),
                mean_ms: if n == 0 { f64::NAN } else { (a.1 - b.1) / n as f64 * 1e3 },
            }
        })
        .collect()
}

/// The `q`-quantile's bucket upper bound, in ms, of the difference of two histograms.
fn bucket_quantile(before: &[(f64, u64)], after: &[(f64, u64)], total: u64, q: f64) -> f64 {
    let want = (q * total as f64).ceil() as u64;
    for (i, (le, n)) in after.iter().enumerate() {
        let was = before.get(i).map_or(0, |b| b.1);
        if n - was >= want {
            return le * 1e3;
        }
    }
    f64::INFINITY
}

/// The median of the rounds' overheads; of an even number, the larger middle one.
fn median_round(rounds: &[f64]) -> f64 {
    let mut sorted = rounds.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `n` tenants, each with limits high enough never to refuse (so every request goes through the
/// limits' rows), or with none (`limited` false: no limits' rows at all), and a key for each.
fn tenants(client: &Client, n: usize, limited: bool) -> anyhow::Result<Vec<String>> {
    let mut keys = Vec::new();
    for i in 0..n {
        let limits = if limited {
            json!({"requests_per_min": 1_000_000_000i64, "tokens_per_min": 1_000_000_000_000i64, "max_concurrent": 1_000_000})
        } else {
            json!({})
        };
        let prefix = if limited { "bench" } else { "bench-unlimited" };
        let body = json!({"name": format!("{prefix}-{i}"), "limits": limits});
        let t = client.json("POST", "/admin/tenants", Some(ADMIN), Some(&body))?;
        if t.status != 201 {
            bail!("creating a tenant: {} {}", t.status, t.text());
        }
        let id = t.json()["id"].as_str().context("tenant id")?.to_string();
        let k = client.json("POST", &format!("/admin/tenants/{id}/keys"), Some(ADMIN), None)?;
        keys.push(k.json()["key"].as_str().context("key")?.to_string());
    }
    Ok(keys)
}

/// The load on `servers` for `seconds`, after a warm-up of a fifth of it: every client sends
/// back to back (`rate` None: the capacity), or paced so that all together offer `rate` requests
/// per second (a client late for its next send sends at once).
fn drive(name: &str, servers: &[Server], keys: &Arc<Vec<String>>, args: &BenchClusterArgs, rate: Option<f64>, round: Option<u32>) -> anyhow::Result<Phase> {
    let clients: Vec<Client> = servers.iter().map(|s| s.client()).collect();
    let body = Arc::new(json!({"model": "tiny", "prompt": "x", "max_tokens": args.max_tokens, "ignore_eos": true}));
    let n = args.clients.max(1);
    let run = |seconds: f64| -> anyhow::Result<(Vec<f64>, usize, f64)> {
        let stop = Arc::new(AtomicBool::new(false));
        let began = Instant::now();
        let threads: Vec<_> = (0..n)
            .map(|i| {
                let (client, keys, body, stop) = (clients[i % clients.len()].clone(), keys.clone(), body.clone(), stop.clone());
                // Each client's share of the rate, its first send spread over one interval.
                let interval = rate.map(|r| Duration::from_secs_f64(n as f64 / r.max(1e-3)));
                std::thread::spawn(move || {
                    let key = &keys[i % keys.len()];
                    // One connection kept alive a client, as an HTTP client library keeps one:
                    // the clients share the machine with the servers they measure.
                    let mut conn = KeepAlive::new(client);
                    let (mut lat, mut refused) = (Vec::new(), 0usize);
                    let mut next = interval.map(|iv| began + iv.mul_f64(i as f64 / n as f64));
                    while !stop.load(Ordering::Relaxed) {
                        if let (Some(at), Some(iv)) = (next.as_mut(), interval) {
                            let now = Instant::now();
                            if *at > now {
                                std::thread::sleep(*at - now);
                            }
                            *at += iv;
                        }
                        let t = Instant::now();
                        match conn.json("POST", "/v1/completions", Some(key), Some(&body)) {
                            Ok(r) if r.status == 200 => lat.push(t.elapsed().as_secs_f64() * 1e3),
                            _ => refused += 1,
                        }
                    }
                    (lat, refused)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        let (mut lat, mut refused) = (Vec::new(), 0);
        for t in threads {
            let (l, r) = t.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?;
            lat.extend(l);
            refused += r;
        }
        Ok((lat, refused, began.elapsed().as_secs_f64()))
    };
    run(args.seconds / 5.0)?;
    let before = state_histograms(servers)?;
    let of = round.map_or_else(String::new, |r| format!(", round {r} of {}", args.rounds));
    eprintln!("{name}: {n} clients for {} s{of} ...", args.seconds);
    let ticks = cpu_ticks();
    let (lat, refused, seconds) = run(args.seconds)?;
    let cpu_busy = match (ticks, cpu_ticks()) {
        (Some((b0, a0)), Some((b1, a1))) if a1 > a0 => Some((b1 - b0) as f64 / (a1 - a0) as f64),
        _ => None,
    };
    let after = state_histograms(servers)?;
    Ok(Phase {
        name: name.to_string(),
        round,
        replicas: servers.len(),
        offered_per_s: rate,
        requests: lat.len(),
        refused,
        seconds,
        requests_per_s: lat.len() as f64 / seconds,
        client_p50_ms: super::quantile(&lat, 0.5),
        client_p99_ms: super::quantile(&lat, 0.99),
        state: part_times(&before, &after),
        cpu_busy,
    })
}

fn start(exe: &Path, data: &Path, model: &Path, extra: &[&str]) -> anyhow::Result<Server> {
    let mut args = vec!["--admin-key", ADMIN, "--served-model-name", "tiny", "--model"];
    let model = model.to_str().context("a UTF-8 path")?;
    args.push(model);
    args.extend_from_slice(extra);
    Ok(Server::start(exe, data, &args)?)
}

/// A new database on the PostgreSQL server `url` names.
fn fresh_database(url: &str) -> anyhow::Result<String> {
    let name = format!("bench_cluster_{}", std::process::id());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        sqlx::any::install_default_drivers();
        let admin = sqlx::AnyPool::connect(url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}"))).execute(&admin).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await?;
        admin.close().await;
        anyhow::Ok(())
    })?;
    Ok(format!("{}/{name}", url.rsplit_once('/').map_or(url, |(b, _)| b)))
}

pub fn run(args: &BenchClusterArgs) -> anyhow::Result<()> {
    let Some(pg) = args.postgres.clone() else {
        bail!("bench cluster needs a PostgreSQL server: --postgres postgres://user@host:port/db (a database is created on it)")
    };
    let machine = Machine::here();
    let exe = std::env::current_exe()?;
    let scratch = tempfile::tempdir()?;
    let model = scratch.path().join("model");
    crate::synth::synthesize_model(&crate::synth::SynthOptions {
        out: model.clone(),
        preset: crate::synth::Preset::Tiny,
        seed: 0,
        dtype: crate::synth::FileDType::F32,
        kv_heads: None,
    })?;

    // Both configurations run side by side: first each one's capacity (clients back to back),
    // then each at the same offered load, a fraction of the smaller capacity, where the time on
    // shared state is compared.
    // The one server has the machine; each replica its share of it, as a pod with a CPU
    // limit sees it (the thread counts a server picks by default follow the limit).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let replica_count = args.replicas.max(1);
    let replica_threads = args.replica_threads.unwrap_or(cores / replica_count).max(1);
    let threads = replica_threads.to_string();
    let one = vec![start(&exe, &scratch.path().join("sqlite"), &model, &[])?];
    let db = fresh_database(&pg)?;
    let mut replicas = Vec::new();
    for i in 0..replica_count {
        let host = format!("127.0.0.{}", i + 1);
        let extra = ["--database-url", &db, "--host", &host, "--threads", &threads, "--http-workers", &threads];
        replicas.push(start(&exe, &scratch.path().join(format!("pg{i}")), &model, &extra)?);
    }
    let (sqlite_name, pg_name) = ("SQLite, 1 server".to_string(), format!("PostgreSQL, {} replicas", replicas.len()));
    let sqlite_keys = Arc::new(tenants(&one[0].client(), args.tenants.max(1), true)?);
    let pg_keys = Arc::new(tenants(&replicas[0].client(), args.tenants.max(1), true)?);
    // The same replicas for tenants without limits: what the key and the ledger cost alone.
    let unlimited_name = format!("{pg_name}, no limits");
    let unlimited_keys = Arc::new(tenants(&replicas[0].client(), args.tenants.max(1), false)?);
    let mut phases = vec![
        drive(&sqlite_name, &one, &sqlite_keys, args, None, None)?,
        drive(&pg_name, &replicas, &pg_keys, args, None, None)?,
        drive(&unlimited_name, &replicas, &unlimited_keys, args, None, None)?,
    ];
    let capacity = phases[0].requests_per_s.min(phases[1].requests_per_s);
    let mut overheads = Vec::new();
    for &load in &args.loads {
        let rate = load * capacity;
        let mut rounds = Vec::new();
        for round in 1..=args.rounds {
            phases.push(drive(&sqlite_name, &one, &sqlite_keys, args, Some(rate), Some(round))?);
            phases.push(drive(&pg_name, &replicas, &pg_keys, args, Some(rate), Some(round))?);
            phases.push(drive(&unlimited_name, &replicas, &unlimited_keys, args, Some(rate), Some(round))?);
            let (a, b) = (&phases[phases.len() - 3], &phases[phases.len() - 2]);
            rounds.push(b.state[0].p99_ms - a.state[0].p99_ms);
        }
        let overhead = median_round(&rounds);
        let rounds_met = rounds.iter().filter(|&&o| o <= TARGET_MS).count();
        overheads.push(json!({
            "load": load,
            "offered_per_s": rate,
            "overhead_p99_ms": overhead,
            "met": overhead <= TARGET_MS,
            "rounds_ms": rounds,
            "rounds_met": rounds_met,
        }));
    }
    drop((one, replicas));

    println!("machine: {machine}");
    println!("each replica: {replica_threads} compute and {replica_threads} HTTP threads (the one server: {cores} of each)");
    println!(
        "{} clients over {} tenants, {} new tokens each request; paced phases offer a fraction of the smaller capacity ({capacity:.0}/s)",
        args.clients, args.tenants, args.max_tokens
    );
    println!("state time p50 / p99 / mean in ms (p50, p99: bucket upper bounds)");
    println!(
        "{:<35} {:>9} {:>8} {:>5} {:>8} {:>8} {:>8} {:>18} {:>18} {:>18} {:>18}",
        "", "offered/s", "req/s", "cpu", "p50 ms", "p99 ms", "refused", "state", "key", "limits", "ledger"
    );
    for p in &phases {
        let offered = p.offered_per_s.map_or_else(|| "capacity".to_string(), |r| format!("{r:.0}"));
        let name = p.round.map_or_else(|| p.name.clone(), |r| format!("{}, round {r}", p.name));
        let parts: Vec<String> = p.state.iter().map(|t| format!("{:.1}/{:.1}/{:.2}", t.p50_ms, t.p99_ms, t.mean_ms)).collect();
        let cpu = p.cpu_busy.map_or_else(|| "-".to_string(), |c| format!("{:.0}%", c * 1e2));
        println!(
            "{:<35} {:>9} {:>8.1} {:>5} {:>8.1} {:>8.1} {:>8} {:>18} {:>18} {:>18} {:>18}",
            name, offered, p.requests_per_s, cpu, p.client_p50_ms, p.client_p99_ms, p.refused, parts[0], parts[1], parts[2], parts[3]
        );
    }
    for o in &overheads {
        let rounds: Vec<String> = o["rounds_ms"].as_array().into_iter().flatten().map(|r| format!("{:+.1}", r.as_f64().unwrap_or(f64::NAN))).collect();
        println!(
            "shared-state overhead at p99, {:.0}% load ({:.0}/s): {:.2} ms, the median of {} rounds ({} ms; {} within the target) (target <= {TARGET_MS} ms): {}",
            o["load"].as_f64().unwrap_or(0.0) * 1e2,
            o["offered_per_s"].as_f64().unwrap_or(0.0),
            o["overhead_p99_ms"].as_f64().unwrap_or(f64::NAN),
            rounds.len(),
            rounds.join(", "),
            o["rounds_met"],
            if o["met"] == true { "met" } else { "NOT met" }
        );
    }
    let report = json!({
        "machine": machine,
        "clients": args.clients,
        "tenants": args.tenants,
        "max_tokens": args.max_tokens,
        "replica_threads": replica_threads,
        "server_threads": cores,
        "capacity_per_s": capacity,
        "rounds": args.rounds,
        "phases": phases,
        "overheads": overheads,
        "target_ms": TARGET_MS,
    });
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_round_ignores_one_stalled_round() {
        assert_eq!(median_round(&[-2.5, 490.0, 0.0]), 0.0);
        assert_eq!(median_round(&[-250.0, 5.0, 2.5]), 2.5);
        assert_eq!(median_round(&[7.5]), 7.5);
        assert_eq!(median_round(&[1.0, 10.0]), 10.0, "of two, the larger");
        assert!(median_round(&[]).is_nan());
    }
}
