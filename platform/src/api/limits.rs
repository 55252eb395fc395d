//! Per-tenant admission limits: requests per minute, tokens per minute and concurrent
//! requests, over a sliding one-minute window kept in memory.
//!
//! A minute's requests are also spread over the minute: a bucket of [`burst`] requests, refilled
//! at the per-minute rate, must hold one for each request. Without it a tenant whose requests
//! end quickly (refused after their bodies were read, say) would spend a minute's allowance in its
//! first seconds, and the reading, parsing and tokenizing of all of them would land together.
//!
//! Tokens are reserved when a request is admitted (its prompt plus the most it may generate)
//! and corrected to what it really used when it ends, so a burst of long requests cannot slip
//! past the limit while they run.
//!
//! On PostgreSQL the limits hold across every replica sharing the database ([`Limiter::shared`]):
//! the same rules are decided on rows (`store::limits`), one transaction under the tenant's
//! lock per decision, on the database's clock. A decision far from every limit grants a lease:
//! several admissions (or tokens) counted at once, which this replica hands out until the
//! tenant's second ends (each tenant's seconds begin at an offset of their own, so that leases do
//! not all end together; see `store::limits`), then gives back what it did not use. Its size follows the tenant's
//! traffic here (doubled when a lease runs out before its second ends, halved when most of one
//! is left) and is at most an eighth of the room left under the limits, so near a limit every
//! request is decided in the database alone, and the sum over replicas never passes a limit.
//! The call that leases admissions leases that many requests' worth of tokens too (the size of
//! the class's last reservation), so that steady traffic costs one call per tenant and second;
//! and a class whose requests keep coming has its next leases asked for in the background
//! shortly before its second ends ([`AHEAD`]) or its lease runs out, so that its requests do not
//! wait for the database (near a limit nothing is leased for the next second).
//! Releases, settlements and returned leases are written behind the requests by a task of the
//! limiter (in batches), which also marks the replica alive: the slots of a replica that died
//! stop counting within [`crate::store::limits::REPLICA_TIMEOUT_MS`]. A tenant without any of
//! these limits costs no query.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ApiError;
use crate::store::limits::{AdmitAsk, AdmitVerdict, LimitChanges};
use crate::store::{Store, StoreError, TenantLimits};

const WINDOW: Duration = Duration::from_secs(60);

/// Seconds of the per-minute rate a burst may take at once.
const BURST_SECONDS: f64 = 5.0;

/// A burst may always take this many requests (or the whole minute's, when fewer).
const MIN_BURST: f64 = 10.0;

/// Requests a tenant allowed `per_min` requests per minute may send at once: five seconds' worth
/// of them, at least ten (or the whole minute's when fewer).
pub fn burst(per_min: i64) -> f64 {
    let per_min = per_min.max(0) as f64;
    (per_min * BURST_SECONDS / 60.0).max(per_min.min(MIN_BURST))
}

#[derive(Debug, Default)]
struct Window {
    /// (admission time, permit id) of the requests of the last minute.
    requests: VecDeque<(Instant, u64)>,
    /// (admission time, permit id, tokens) of the last minute.
    tokens: VecDeque<(Instant, u64, u64)>,
    concurrent: usize,
    /// Requests the burst bucket holds, as of the instant; `None` until the first request (a
    /// full bucket).
    bucket: Option<(f64, Instant)>,
}

impl Window {
    fn expire(&mut self, now: Instant) {
        while self.requests.front().is_some_and(|&(t, _)| now.duration_since(t) >= WINDOW) {
            self.requests.pop_front();
        }
        while self.tokens.front().is_some_and(|&(t, _, _)| now.duration_since(t) >= WINDOW) {
            self.tokens.pop_front();
        }
    }

    fn token_sum(&self) -> u64 {
        self.tokens.iter().fold(0u64, |sum, &(_, _, n)| sum.saturating_add(n))
    }
}

/// Refuses a request over `limits`' concurrency (`concurrent` held now) or requests per minute
/// (`requests` in the last minute; `retry_after` seconds until the oldest leaves it).
fn check_counts(limits: &TenantLimits, concurrent: i64, requests: i64, retry_after: impl FnOnce() -> u64, what: &str) -> Result<(), ApiError> {
    if let Some(max) = limits.max_concurrent
        && concurrent >= max
    {
        return Err(ApiError::RateLimited { message: format!("too many concurrent {what}: the limit is {max}"), retry_after: 1 });
    }
    if let Some(max) = limits.requests_per_min
        && requests >= max
    {
        return Err(ApiError::RateLimited { message: format!("too many {what}: the limit is {max} per minute"), retry_after: retry_after().max(1) });
    }
    Ok(())
}

/// The burst bucket after taking one request from it, or why it holds none: `held` requests
/// as of `elapsed` seconds ago (`None`: a full bucket). `Ok(None)` without a per-minute limit.
fn take_bucket(limits: &TenantLimits, held: Option<(f64, f64)>) -> Result<Option<f64>, ApiError> {
    let Some(max) = limits.requests_per_min else { return Ok(None) };
    let (cap, rate) = (burst(max), max.max(0) as f64 / 60.0);
    let (held, elapsed) = held.unwrap_or((cap, 0.0));
    let held = (held + elapsed.max(0.0) * rate).min(cap);
    if held < 1.0 {
        // The minute's limit refuses a tenant allowed none at all.
        let retry_after = ((1.0 - held) / rate.max(1e-9)).ceil().clamp(1.0, 60.0) as u64;
        return Err(ApiError::RateLimited {
            message: format!("too many requests at once: the limit of {max} per minute allows {} at once, then one every {:.1} s", cap as u64, 1.0 / rate),
            retry_after,
        });
    }
    Ok(Some(held - 1.0))
}

/// Whether `tokens` more fit a tokens-per-minute limit of `max` over `sum` held now; `entries`
/// are the window's (seconds until it leaves the window, tokens), oldest first, read only when
/// they do not fit, to say when to retry.
fn check_tokens<I: IntoIterator<Item = (u64, u64)>>(max: i64, tokens: u64, sum: u64, entries: impl FnOnce() -> I, what: &str) -> Result<(), ApiError> {
    let max = max.max(0) as u64;
    if tokens > max {
        return Err(ApiError::Invalid(format!(
            "this request may use {tokens} tokens (prompt plus max_tokens times n), more than the limit of {max} tokens per minute{what}; lower max_tokens"
        )));
    }
    if sum.saturating_add(tokens) <= max {
        return Ok(());
    }
    // Retry once enough of the window has expired.
    let (mut sum, mut retry_after) = (sum, 1);
    for (left, n) in entries() {
        sum = sum.saturating_sub(n);
        retry_after = left.max(1);
        if sum.saturating_add(tokens) <= max {
            break;
        }
    }
    Err(ApiError::RateLimited { message: format!("too many tokens{what}: the limit is {max} per minute and this request may use {tokens}"), retry_after })
}

/// The error of a shared admission's refusal: what the in-memory limiter says for the same
/// counts.
fn refusal(v: &AdmitVerdict, limits: &TenantLimits, share: Option<&TenantLimits>) -> ApiError {
    let retry = || v.oldest_ms.map_or(1, |t| ((t + WINDOW.as_millis() as i64 - v.now_ms).max(0) as u64).div_ceil(1000));
    let only = |l: &TenantLimits, concurrent: bool| TenantLimits {
        max_concurrent: if concurrent { l.max_concurrent } else { None },
        requests_per_min: if concurrent { None } else { l.requests_per_min },
        ..l.clone()
    };
    let share = share.cloned().unwrap_or_default();
    const SHARE: &str = "batch requests (half the limit)";
    let refused = match v.verdict.as_str() {
        "concurrent" => check_counts(&only(limits, true), i64::MAX, 0, retry, "requests"),
        "rpm" => check_counts(&only(limits, false), 0, i64::MAX, retry, "requests"),
        "share_concurrent" => check_counts(&only(&share, true), i64::MAX, 0, retry, SHARE),
        "share_rpm" => check_counts(&only(&share, false), 0, i64::MAX, retry, SHARE),
        "bucket" => take_bucket(if share.requests_per_min.is_some() { &share } else { limits }, Some((v.held.unwrap_or(0.0), 0.0))).map(|_| ()),
        _ => Ok(()),
    };
    refused.err().unwrap_or_else(|| ApiError::Internal(format!("shared limits: the verdict {:?} names no refusal", v.verdict)))
}

impl Window {
    /// Refuses a request over `limits`' concurrency or requests per minute.
    fn check(&self, limits: &TenantLimits, now: Instant, what: &str) -> Result<(), ApiError> {
        let retry = || self.requests.front().map_or(1, |&(t, _)| seconds_until(t, now));
        check_counts(limits, self.concurrent as i64, self.requests.len() as i64, retry, what)
    }

    /// The burst bucket after taking one request from it, or why it holds none.
    fn take(&self, limits: &TenantLimits, now: Instant) -> Result<Option<(f64, Instant)>, ApiError> {
        let held = self.bucket.map(|(held, at)| (held, now.saturating_duration_since(at).as_secs_f64()));
        Ok(take_bucket(limits, held)?.map(|held| (held, now)))
    }

    fn enter(&mut self, now: Instant, id: u64) {
        self.requests.push_back((now, id));
        self.concurrent += 1;
    }

    /// Whether `tokens` more fit `limits`' tokens per minute, or when to retry.
    fn room(&self, limits: &TenantLimits, now: Instant, tokens: u64, what: &str) -> Result<(), ApiError> {
        match limits.tokens_per_min {
            Some(max) => check_tokens(max, tokens, self.token_sum(), || self.tokens.iter().map(|&(t, _, n)| (seconds_until(t, now), n)), what),
            None => Ok(()),
        }
    }

    fn settle(&mut self, id: u64, tokens: u64) {
        if let Some(entry) = self.tokens.iter_mut().find(|(_, i, _)| *i == id) {
            entry.2 = tokens;
        }
    }
}

/// The share of a tenant's limits its batch work may take: half of its requests and tokens per
/// minute and of its concurrency (rounded up), so that its interactive requests always have the
/// other half.
pub fn batch_share(limits: &TenantLimits) -> TenantLimits {
    let half = |v: Option<i64>| v.map(|x| if x > 0 { x / 2 + x % 2 } else { x });
    TenantLimits {
        requests_per_min: half(limits.requests_per_min),
        tokens_per_min: half(limits.tokens_per_min),
        max_concurrent: half(limits.max_concurrent),
        ..limits.clone()
    }
}

#[derive(Debug, Default)]
struct Windows {
    /// Every request of each tenant, interactive and batch.
    tenants: HashMap<String, Window>,
    /// The batch requests of each tenant.
    batch: HashMap<String, Window>,
}

/// The windows of every tenant: in memory, or shared by every replica of a PostgreSQL database
/// ([`Limiter::shared`]).
#[derive(Debug, Default)]
pub struct Limiter {
    windows: Mutex<Windows>,
    next_id: std::sync::atomic::AtomicU64,
    shared: Option<Shared>,
}

#[derive(Debug)]
struct Shared {
    store: Store,
    /// This server's name on its rows.
    replica: String,
    /// Releases and settlements, written behind the requests by [`maintain`].
    changes: tokio::sync::mpsc::UnboundedSender<Change>,
    leases: Arc<LeaseMap>,
    /// Decisions this replica asked the database for.
    calls: std::sync::atomic::AtomicU64,
    /// Admissions and reservations that waited for one.
    waited: std::sync::atomic::AtomicU64,
}

/// This replica's leases, per (tenant, batch work). A class's lock is held while its lease is
/// renewed, so the requests that find it empty wait for one call instead of each making one.
type LeaseMap = Mutex<HashMap<(String, bool), Arc<tokio::sync::Mutex<Leases>>>>;

/// The most admissions one lease may ask for.
const MAX_LEASE: i64 = 64;

/// How long before its lease's second ends a class whose requests keep coming has the next
/// second's leases asked for, in the background, so that its requests do not wait for them
/// ([`Leases::renewal_due`]).
const AHEAD: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct Leases {
    admissions: Option<Lease>,
    tokens: Option<Lease>,
    /// The leases that follow the current ones, asked for before those end or run out
    /// ([`Leases::renewal_due`]): the next second's, or more of this one's.
    next_admissions: Option<Lease>,
    next_tokens: Option<Lease>,
    /// Whether a call for them is under way.
    renewing: bool,
    /// Admissions the next lease asks for (tokens: that many requests' worth).
    want: i64,
    /// The tokens the class's last request reserved (0 before its first): what a request's
    /// worth of tokens is when they are leased with the admissions.
    tokens_each: i64,
}

impl Default for Leases {
    fn default() -> Self {
        Self { admissions: None, tokens: None, next_admissions: None, next_tokens: None, renewing: false, want: 1, tokens_each: 0 }
    }
}

/// Admissions or tokens counted in the database in `second`, `left` of them not handed out yet;
/// usable from `from` until `until`, this replica's instants for the start and end of that
/// second.
#[derive(Debug, Clone, Copy)]
struct Lease {
    second: i64,
    from: Instant,
    until: Instant,
    granted: i64,
    left: i64,
}

impl Lease {
    /// A lease granted at the database's `now_ms`, asked for at `sent` and answered at `got`, for
    /// the second of `now_ms` or (`ahead`) the one after it. Its instants are taken so that it is
    /// usable only inside its second: `from` never earlier than the second's start, `until` never
    /// later than its end.
    fn new(now_ms: i64, sent: Instant, got: Instant, ahead: bool, granted: i64, used: i64) -> Self {
        let rest = Duration::from_millis((1000 - now_ms.rem_euclid(1000)) as u64);
        let second = now_ms.div_euclid(1000);
        let (second, from, until) = if ahead { (second + 1, got + rest, sent + rest + Duration::from_secs(1)) } else { (second, sent, sent + rest) };
        Self { second, from, until, granted, left: granted - used }
    }

    fn live(&self, now: Instant) -> bool {
        self.from <= now && now < self.until
    }
}

/// Gives back what an admissions' lease did not hand out.
fn unlease(a: &Lease, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
    if a.left > 0 {
        let _ = changes.send(Change::Unlease { tenant: tenant.to_string(), batch, second: a.second, n: a.left });
    }
}

/// Gives back what a tokens' lease did not hand out.
fn untoken(t: &Lease, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
    if t.left > 0 {
        let _ = changes.send(Change::Settle { tenant: tenant.to_string(), batch, second: t.second, delta: -t.left });
    }
}

impl Leases {
    /// Ends the admissions' lease (used up or over): its unused admissions are given back, and
    /// the next lease is sized on how this one went.
    fn end_admissions(&mut self, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
        if let Some(a) = self.admissions.take() {
            unlease(&a, tenant, batch, changes);
            self.want = if a.left == 0 {
                (self.want * 2).min(MAX_LEASE)
            } else if a.left * 2 > a.granted {
                (self.want / 2).max(1)
            } else {
                self.want
            };
        }
    }

    /// Ends the tokens' lease: its unused tokens are given back.
    fn end_tokens(&mut self, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
        if let Some(t) = self.tokens.take() {
            untoken(&t, tenant, batch, changes);
        }
    }

    /// Puts the following admissions in place of the current ones once those are of no more
    /// use (over or used up) and these are live.
    fn promote_admissions(&mut self, now: Instant, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
        if self.next_admissions.is_some_and(|n| n.live(now)) && !self.admissions.is_some_and(|a| a.live(now) && a.left > 0) {
            self.end_admissions(tenant, batch, changes);
            self.admissions = self.next_admissions.take();
        }
    }

    /// The same for the tokens, for a request of `need` of them.
    fn promote_tokens(&mut self, now: Instant, need: i64, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
        if self.next_tokens.is_some_and(|n| n.live(now) && n.left >= need) && !self.tokens.is_some_and(|t| t.live(now) && t.left >= need) {
            self.end_tokens(tenant, batch, changes);
            self.tokens = self.next_tokens.take();
        }
    }

    /// Puts the leases a background call brought in as the following ones. A following lease
    /// still held (its tokens: the admissions that came with them were taken, and the tokens
    /// were not needed yet) is given back first, as it ends here: what it did not hand out
    /// would otherwise stay counted in the database for the rest of the minute.
    fn land_renewal(&mut self, admissions: Lease, tokens: Option<Lease>, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
        if let Some(old) = self.next_admissions.replace(admissions) {
            unlease(&old, tenant, batch, changes);
        }
        if let Some(tokens) = tokens
            && let Some(old) = self.next_tokens.replace(tokens)
        {
            untoken(&old, tenant, batch, changes);
        }
    }

    /// Ends the following leases whose second is over unused.
    fn drop_stale_next(&mut self, now: Instant, tenant: &str, batch: bool, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
        if let Some(a) = self.next_admissions.take_if(|a| now >= a.until) {
            unlease(&a, tenant, batch, changes);
        }
        if let Some(t) = self.next_tokens.take_if(|t| now >= t.until) {
            untoken(&t, tenant, batch, changes);
        }
    }

    /// Whether leases should be asked for in the background now, and for which second: the
    /// next one (`Some(true)`) when the current admissions end within [`AHEAD`], the current
    /// one when a quarter or less of them is left. Only for a class whose lease has handed out
    /// two admissions or more (a class with a request now and then asks as they come), and
    /// while none are asked for or held already.
    fn renewal_due(&self, now: Instant) -> Option<bool> {
        let a = self.admissions.filter(|a| a.granted - a.left >= 2 && !self.renewing && self.next_admissions.is_none())?;
        if a.until.saturating_duration_since(now) <= AHEAD {
            Some(true)
        } else if a.left * 4 <= a.granted {
            Some(false)
        } else {
            None
        }
    }

    /// The tokens to lease with the admissions (0: none): a request's worth per admission, for a
    /// class under a token limit whose requests' size is known, unless `held` has enough.
    fn tokens_wanted(&self, token_limits: bool, held: bool) -> i64 {
        if token_limits && self.tokens_each > 0 && !held { self.tokens_each.saturating_mul(self.want) } else { 0 }
    }
}

impl Shared {
    fn leases(&self, tenant: &str, batch: bool) -> Arc<tokio::sync::Mutex<Leases>> {
        let mut all = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        all.entry((tenant.to_string(), batch)).or_default().clone()
    }
}

#[derive(Debug)]
enum Change {
    /// A request of (tenant, batch work) let its concurrency slot go.
    Release(String, bool),
    /// A request of (tenant, batch work) admitted in a second used this many tokens more (or
    /// fewer) than it reserved.
    Settle { tenant: String, batch: bool, second: i64, delta: i64 },
    /// Admissions of (tenant, batch work) leased in a second and not handed out.
    Unlease { tenant: String, batch: bool, second: i64, n: i64 },
}

/// Ends the leases whose second is over (giving back what they did not hand out), and forgets
/// the classes nothing holds.
fn sweep(leases: &LeaseMap, changes: &tokio::sync::mpsc::UnboundedSender<Change>) {
    let now = Instant::now();
    let mut all = leases.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(tenant, batch), cell| {
        // A class being renewed is left to its next sweep.
        let Ok(mut l) = cell.try_lock() else { return true };
        if l.admissions.is_some_and(|a| now >= a.until) {
            l.end_admissions(tenant, *batch, changes);
        }
        if l.tokens.is_some_and(|t| now >= t.until) {
            l.end_tokens(tenant, *batch, changes);
        }
        l.drop_stale_next(now, tenant, *batch, changes);
        let idle = l.admissions.is_none() && l.tokens.is_none() && l.next_admissions.is_none() && l.next_tokens.is_none() && !l.renewing && l.want == 1;
        drop(l);
        !(idle && Arc::strong_count(cell) == 1)
    });
}

/// How often a replica marks itself alive (well within the timeout after which its slots stop
/// counting).
const HEARTBEAT: Duration = Duration::from_secs(3);

/// The shared limiter's writer: marks the replica alive every [`HEARTBEAT`] (and deletes rows
/// nothing counts any more), and writes releases (summed per tenant) and settlements, keeping
/// those that failed (the database away) for the next try.
async fn maintain(
    store: Store,
    replica: String,
    leases: Arc<LeaseMap>,
    sender: tokio::sync::mpsc::WeakUnboundedSender<Change>,
    mut changes: tokio::sync::mpsc::UnboundedReceiver<Change>,
) {
    let mut beat = tokio::time::interval(HEARTBEAT);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut releases: HashMap<(String, bool), i64> = HashMap::new();
    let mut settles: HashMap<(String, bool, i64), i64> = HashMap::new();
    let mut unleases: HashMap<(String, bool, i64), i64> = HashMap::new();
    let mut warned = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // Ended leases send their returns here, written below with the next changes.
                if let Some(sender) = sender.upgrade() {
                    sweep(&leases, &sender);
                }
                continue;
            }
            _ = beat.tick() => {
                if let Err(e) = store.limit_heartbeat(&replica).await
                    && !std::mem::replace(&mut warned, true)
                {
                    eprintln!("warning: shared limits: marking this replica alive: {e} (retrying)");
                }
            }
            change = changes.recv() => {
                let Some(first) = change else { break };
                add(first, &mut releases, &mut settles, &mut unleases);
            }
        }
        // A few milliseconds more to gather what the requests ending now give back: one write of
        // each kind for many of them.
        tokio::time::sleep(GATHER).await;
        while let Ok(change) = changes.try_recv() {
            add(change, &mut releases, &mut settles, &mut unleases);
        }
        let rows = LimitChanges {
            tokens: table_rows(settles.iter().map(|((t, b, s), n)| (t, *b, *s, *n))),
            requests: table_rows(unleases.iter().map(|((t, b, s), n)| (t, *b, *s, *n))),
            running: table_rows(releases.iter().map(|((t, b), n)| (t, *b, 0, *n))),
        };
        // What failed (the database away) is kept for the next try.
        if store.limit_apply(&replica, &rows).await {
            settles.clear();
            unleases.clear();
            releases.clear();
        }
    }
}

/// The rows of the limit tables that (tenant, batch work, second, amount) changes touch: batch
/// work's count in its class and in its tenant's totals (class 0), summed per row.
fn table_rows<'a>(changes: impl Iterator<Item = (&'a String, bool, i64, i64)>) -> Vec<(String, bool, i64, i64)> {
    let mut rows: HashMap<(&String, bool, i64), i64> = HashMap::new();
    for (tenant, batch, second, n) in changes {
        *rows.entry((tenant, false, second)).or_default() += n;
        if batch {
            *rows.entry((tenant, true, second)).or_default() += n;
        }
    }
    rows.into_iter().filter(|&(_, n)| n != 0).map(|((t, b, s), n)| (t.clone(), b, s, n)).collect()
}

/// How long the writer of the shared limits gathers changes before it writes them: the
/// releases, settlements and returned leases of many requests go out in one transaction (a
/// slot or tokens let go count in the database that much longer, on the safe side).
const GATHER: Duration = Duration::from_millis(50);

/// Adds one change to what the writer has to write: slots to let go per (tenant, batch work),
/// tokens to settle and admissions to take back per (tenant, batch work, second).
fn add(
    change: Change,
    releases: &mut HashMap<(String, bool), i64>,
    settles: &mut HashMap<(String, bool, i64), i64>,
    unleases: &mut HashMap<(String, bool, i64), i64>,
) {
    match change {
        Change::Release(tenant, batch) => *releases.entry((tenant, batch)).or_default() += 1,
        Change::Settle { tenant, batch, second, delta } => *settles.entry((tenant, batch, second)).or_default() += delta,
        // Taken back from the minute, and their slots let go.
        Change::Unlease { tenant, batch, second, n } => {
            *releases.entry((tenant.clone(), batch)).or_default() += n;
            *unleases.entry((tenant, batch, second)).or_default() += n;
        }
    }
}

/// An admitted request: holds a concurrency slot until dropped. It counts against the
/// requests per minute whatever happens to it later: a request refused after it was read still
/// cost its reading, parsing and tokenizing.
#[derive(Debug)]
pub struct Permit {
    limiter: Arc<Limiter>,
    tenant: String,
    limits: TenantLimits,
    id: u64,
    /// For batch work: the share of the limits it runs under ([`batch_share`]).
    share: Option<TenantLimits>,
    /// Shared limits: the second it was admitted in and the tokens it reserved (`None` for a
    /// tenant without limits).
    slot: Option<(i64, u64)>,
}

fn seconds_until(t: Instant, now: Instant) -> u64 {
    let left = (t + WINDOW).saturating_duration_since(now);
    left.as_secs() + u64::from(left.subsec_nanos() > 0)
}

/// Whether a class's requests reserve tokens against a limit: the tenant's tokens per minute, or
/// its batch work's share of them.
fn token_limited(limits: &TenantLimits, share: Option<&TenantLimits>) -> bool {
    limits.tokens_per_min.is_some() || share.is_some_and(|s| s.tokens_per_min.is_some())
}

/// What the database is asked to decide an admission of `tenant` (batch work with `share`).
fn admit_ask<'a>(
    shared: &'a Shared,
    tenant: &'a str,
    limits: &TenantLimits,
    share: Option<&TenantLimits>,
    want: i64,
    want_tokens: i64,
    ahead: bool,
) -> AdmitAsk<'a> {
    let bucket_limits = share.unwrap_or(limits);
    AdmitAsk {
        tenant,
        batch: share.is_some(),
        replica: &shared.replica,
        max_concurrent: limits.max_concurrent,
        requests_per_min: limits.requests_per_min,
        share_concurrent: share.and_then(|s| s.max_concurrent),
        share_requests_per_min: share.and_then(|s| s.requests_per_min),
        bucket: bucket_limits.requests_per_min.map(|max| (burst(max), max.max(0) as f64 / 60.0)),
        want,
        tokens_per_min: limits.tokens_per_min,
        share_tokens_per_min: share.and_then(|s| s.tokens_per_min),
        want_tokens,
        ahead,
    }
}

impl Limiter {
    /// Limits kept in this server's memory.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Limits held across every replica of `store`'s PostgreSQL database, `replica` naming this
    /// one. Slots its previous run left held are released, and it is marked alive, before it
    /// admits anything. Call inside the server's runtime (its writer runs on the main thread).
    pub async fn shared(store: Store, replica: &str) -> Result<Arc<Self>, StoreError> {
        store.limit_heartbeat(replica).await?;
        store.limit_restart(replica).await?;
        let (changes, rx) = tokio::sync::mpsc::unbounded_channel();
        let leases = Arc::new(LeaseMap::default());
        let (writer, name, swept, sender) = (store.clone(), replica.to_string(), leases.clone(), changes.downgrade());
        super::on_main_thread(move || maintain(writer, name, swept, sender, rx));
        let (calls, waited) = Default::default();
        Ok(Arc::new(Self { shared: Some(Shared { store, replica: replica.to_string(), changes, leases, calls, waited }), ..Self::default() }))
    }

    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Decisions this replica asked the shared database for (0 in memory).
    pub fn database_calls(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.calls.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Admissions and reservations that waited for a decision of the shared database (0 in
    /// memory): those that found no lease to take from.
    pub fn waits(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.waited.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Admits one request of `tenant` against its concurrency and requests-per-minute limits,
    /// or says when to retry. Its tokens are reserved later ([`Permit::reserve`]), once they
    /// are counted.
    pub async fn admit(self: &Arc<Self>, tenant: &str, limits: &TenantLimits) -> Result<Permit, ApiError> {
        match &self.shared {
            None => self.admit_at(tenant, limits, Instant::now()),
            Some(shared) => self.admit_shared(shared, tenant, limits, None).await,
        }
    }

    /// Admits one line of `tenant`'s batch work: within its [`batch_share`] of the limits, and
    /// within the limits themselves counting every request of the tenant. The tenant's burst
    /// bucket is left to its interactive requests; batch work has one of its own.
    pub async fn admit_batch(self: &Arc<Self>, tenant: &str, limits: &TenantLimits) -> Result<Permit, ApiError> {
        match &self.shared {
            None => self.admit_batch_at(tenant, limits, Instant::now()),
            Some(shared) => self.admit_shared(shared, tenant, limits, Some(batch_share(limits))).await,
        }
    }

    async fn admit_shared(self: &Arc<Self>, shared: &Shared, tenant: &str, limits: &TenantLimits, share: Option<TenantLimits>) -> Result<Permit, ApiError> {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut permit = Permit { limiter: self.clone(), tenant: tenant.to_string(), limits: limits.clone(), id, share, slot: None };
        if limits.requests_per_min.is_none() && limits.tokens_per_min.is_none() && limits.max_concurrent.is_none() {
            return Ok(permit);
        }
        let batch = permit.share.is_some();
        let cell = shared.leases(tenant, batch);
        let mut leases = cell.lock().await;
        let now = Instant::now();
        leases.drop_stale_next(now, tenant, batch, &shared.changes);
        leases.promote_admissions(now, tenant, batch, &shared.changes);
        if let Some(a) = leases.admissions.as_mut()
            && a.left > 0
            && a.live(now)
        {
            a.left -= 1;
            permit.slot = Some((a.second, 0));
            self.renew_ahead_if_due(&mut leases, &cell, now, &permit);
            return Ok(permit);
        }
        leases.end_admissions(tenant, batch, &shared.changes);
        // The tokens this lease's requests will reserve, asked for in the same call unless the
        // tokens' lease (this second's or the next's) still has a request's worth.
        let each = leases.tokens_each;
        let held = [leases.tokens, leases.next_tokens].iter().flatten().any(|t| t.live(now) && t.left >= each);
        let want_tokens = leases.tokens_wanted(token_limited(limits, permit.share.as_ref()), held);
        if want_tokens > 0 {
            leases.end_tokens(tenant, batch, &shared.changes);
        }
        let ask = admit_ask(shared, tenant, limits, permit.share.as_ref(), leases.want, want_tokens, false);
        let sent = Instant::now();
        shared.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        shared.waited.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let v = shared.store.limit_admit(&ask).await?;
        if v.verdict != "ok" {
            return Err(refusal(&v, limits, permit.share.as_ref()));
        }
        let got = Instant::now();
        let lease = Lease::new(v.now_ms, sent, got, false, v.granted.max(1), 1);
        permit.slot = Some((lease.second, 0));
        leases.admissions = Some(lease);
        if v.tokens_granted > 0 {
            leases.tokens = Some(Lease::new(v.now_ms, sent, got, false, v.tokens_granted, 0));
        }
        self.renew_ahead_if_due(&mut leases, &cell, got, &permit);
        Ok(permit)
    }

    /// Has leases of `permit`'s class asked for in the background when its current ones end or
    /// run out soon ([`Leases::renewal_due`]): requests keep taking from the current ones
    /// meanwhile, and take the new ones once those are over. A refusal or an error leaves the
    /// class to decide its next request as it comes.
    fn renew_ahead_if_due(self: &Arc<Self>, leases: &mut Leases, cell: &Arc<tokio::sync::Mutex<Leases>>, now: Instant, permit: &Permit) {
        let Some(ahead) = leases.renewal_due(now) else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        leases.renewing = true;
        let want = leases.want;
        let want_tokens = leases.tokens_wanted(token_limited(&permit.limits, permit.share.as_ref()), false);
        let (limiter, cell, tenant, limits, share) = (self.clone(), cell.clone(), permit.tenant.clone(), permit.limits.clone(), permit.share.clone());
        runtime.spawn(async move {
            let Some(shared) = &limiter.shared else { return };
            let ask = admit_ask(shared, &tenant, &limits, share.as_ref(), want, want_tokens, ahead);
            let sent = Instant::now();
            shared.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let v = shared.store.limit_admit(&ask).await;
            let got = Instant::now();
            let mut leases = cell.lock().await;
            leases.renewing = false;
            if let Ok(v) = v
                && v.verdict == "ok"
            {
                let admissions = Lease::new(v.now_ms, sent, got, ahead, v.granted.max(1), 0);
                let tokens = (v.tokens_granted > 0).then(|| Lease::new(v.now_ms, sent, got, ahead, v.tokens_granted, 0));
                leases.land_renewal(admissions, tokens, &tenant, share.is_some(), &shared.changes);
            }
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Windows> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn admit_at(self: &Arc<Self>, tenant: &str, limits: &TenantLimits, now: Instant) -> Result<Permit, ApiError> {
        let mut all = self.lock();
        let w = all.tenants.entry(tenant.to_string()).or_default();
        w.expire(now);
        w.check(limits, now, "requests")?;
        w.bucket = w.take(limits, now)?;
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        w.enter(now, id);
        Ok(Permit { limiter: self.clone(), tenant: tenant.to_string(), limits: limits.clone(), id, share: None, slot: None })
    }

    fn admit_batch_at(self: &Arc<Self>, tenant: &str, limits: &TenantLimits, now: Instant) -> Result<Permit, ApiError> {
        let share = batch_share(limits);
        let mut all = self.lock();
        let Windows { tenants, batch } = &mut *all;
        let w = tenants.entry(tenant.to_string()).or_default();
        w.expire(now);
        w.check(limits, now, "requests")?;
        let b = batch.entry(tenant.to_string()).or_default();
        b.expire(now);
        b.check(&share, now, "batch requests (half the limit)")?;
        b.bucket = b.take(&share, now)?;
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        w.enter(now, id);
        b.enter(now, id);
        Ok(Permit { limiter: self.clone(), tenant: tenant.to_string(), limits: limits.clone(), id, share: Some(share), slot: None })
    }
}

impl Permit {
    /// Reserves the most tokens the request may use (prompt plus what it may generate) against
    /// the tokens-per-minute limit (and batch work against its share too), or says when to retry.
    pub async fn reserve(&mut self, tokens: u64) -> Result<(), ApiError> {
        let limiter = self.limiter.clone();
        match &limiter.shared {
            None => self.reserve_at(tokens),
            Some(shared) => self.reserve_shared(shared, tokens).await,
        }
    }

    async fn reserve_shared(&mut self, shared: &Shared, tokens: u64) -> Result<(), ApiError> {
        let share_max = self.share.as_ref().and_then(|s| s.tokens_per_min);
        let (Some(_), true) = (self.slot, self.limits.tokens_per_min.is_some() || share_max.is_some()) else { return Ok(()) };
        const SHARE: &str = " for batch work (half the limit)";
        // A request that could never fit is told so first, not to wait.
        if let Some(max) = share_max {
            check_tokens(max, tokens, 0, Vec::new, SHARE)?;
        }
        if let Some(max) = self.limits.tokens_per_min {
            check_tokens(max, tokens, 0, Vec::new, "")?;
        }
        let wanted = i64::try_from(tokens).unwrap_or(i64::MAX);
        let batch = self.share.is_some();
        let cell = shared.leases(&self.tenant, batch);
        let mut leases = cell.lock().await;
        leases.tokens_each = wanted;
        let now = Instant::now();
        leases.promote_tokens(now, wanted, &self.tenant, batch, &shared.changes);
        if let Some(t) = leases.tokens.as_mut()
            && t.left >= wanted
            && t.live(now)
        {
            t.left -= wanted;
            self.slot = Some((t.second, tokens));
            return Ok(());
        }
        leases.end_tokens(&self.tenant, batch, &shared.changes);
        let sent = Instant::now();
        let want = wanted.saturating_mul(leases.want);
        shared.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        shared.waited.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let v = shared.store.limit_reserve(&self.tenant, batch, wanted, self.limits.tokens_per_min, share_max, want).await?;
        let (max, what, batch) = match v.verdict.as_str() {
            "ok" => {
                let lease = Lease::new(v.now_ms, sent, Instant::now(), false, v.granted.max(wanted), wanted);
                self.slot = Some((lease.second, tokens));
                leases.tokens = Some(lease);
                return Ok(());
            }
            "share" => (share_max, SHARE, true),
            "all" => (self.limits.tokens_per_min, "", false),
            other => return Err(ApiError::Internal(format!("shared limits: unknown verdict {other:?}"))),
        };
        let rows = shared.store.limit_token_rows(&self.tenant, batch, v.now_ms - WINDOW.as_millis() as i64).await?;
        let left = |at: i64| ((at + WINDOW.as_millis() as i64 - v.now_ms).max(0) as u64).div_ceil(1000);
        let refused = check_tokens(max.unwrap_or(0), tokens, v.held.max(0) as u64, || rows.iter().map(|&(at, n)| (left(at), n)), what);
        Err(refused.err().unwrap_or_else(|| ApiError::Internal(format!("shared limits: the verdict {:?} refused nothing", v.verdict))))
    }

    fn reserve_at(&mut self, tokens: u64) -> Result<(), ApiError> {
        let now = Instant::now();
        let mut all = self.limiter.lock();
        let Windows { tenants, batch } = &mut *all;
        // The share first: a line that could never fit it is told so, not to wait.
        let mut share = None;
        if let Some(limits) = &self.share {
            let b = batch.entry(self.tenant.clone()).or_default();
            b.expire(now);
            b.room(limits, now, tokens, " for batch work (half the limit)")?;
            share = Some(b);
        }
        let w = tenants.entry(self.tenant.clone()).or_default();
        w.expire(now);
        w.room(&self.limits, now, tokens, "")?;
        w.tokens.push_back((now, self.id, tokens));
        if let Some(b) = share {
            b.tokens.push_back((now, self.id, tokens));
        }
        Ok(())
    }

    /// Replaces the reservation with the tokens the request really used.
    pub fn settle(&self, tokens: u64) {
        if let Some(shared) = &self.limiter.shared {
            let counted = self.limits.tokens_per_min.is_some() || self.share.as_ref().is_some_and(|s| s.tokens_per_min.is_some());
            if let Some((second, reserved)) = self.slot
                && counted
                && tokens != reserved
            {
                let delta = i64::try_from(tokens).unwrap_or(i64::MAX).saturating_sub(i64::try_from(reserved).unwrap_or(i64::MAX));
                let _ = shared.changes.send(Change::Settle { tenant: self.tenant.clone(), batch: self.share.is_some(), second, delta });
            }
            return;
        }
        let mut all = self.limiter.lock();
        if let Some(w) = all.tenants.get_mut(&self.tenant) {
            w.settle(self.id, tokens);
        }
        if self.share.is_some()
            && let Some(b) = all.batch.get_mut(&self.tenant)
        {
            b.settle(self.id, tokens);
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(shared) = &self.limiter.shared {
            if self.slot.take().is_some() {
                let _ = shared.changes.send(Change::Release(self.tenant.clone(), self.share.is_some()));
            }
            return;
        }
        let mut all = self.limiter.lock();
        if let Some(w) = all.tenants.get_mut(&self.tenant) {
            w.concurrent = w.concurrent.saturating_sub(1);
        }
        if self.share.is_some()
            && let Some(b) = all.batch.get_mut(&self.tenant)
        {
            b.concurrent = b.concurrent.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests;
