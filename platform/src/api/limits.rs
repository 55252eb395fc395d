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

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::ApiError;
use crate::store::TenantLimits;

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

impl Window {
    /// Refuses a request over `limits`' concurrency or requests per minute.
    fn check(&self, limits: &TenantLimits, now: Instant, what: &str) -> Result<(), ApiError> {
        if let Some(max) = limits.max_concurrent
            && self.concurrent as i64 >= max
        {
            return Err(ApiError::RateLimited { message: format!("too many concurrent {what}: the limit is {max}"), retry_after: 1 });
        }
        if let Some(max) = limits.requests_per_min
            && self.requests.len() as i64 >= max
        {
            let retry_after = self.requests.front().map_or(1, |&(t, _)| seconds_until(t, now)).max(1);
            return Err(ApiError::RateLimited { message: format!("too many {what}: the limit is {max} per minute"), retry_after });
        }
        Ok(())
    }

    /// The burst bucket after taking one request from it, or why it holds none.
    fn take(&self, limits: &TenantLimits, now: Instant) -> Result<Option<(f64, Instant)>, ApiError> {
        let Some(max) = limits.requests_per_min else { return Ok(None) };
        let (cap, rate) = (burst(max), max.max(0) as f64 / 60.0);
        let (held, at) = self.bucket.unwrap_or((cap, now));
        let held = (held + now.saturating_duration_since(at).as_secs_f64() * rate).min(cap);
        if held < 1.0 {
            // The minute's limit refuses a tenant allowed none at all.
            let retry_after = ((1.0 - held) / rate.max(1e-9)).ceil().clamp(1.0, 60.0) as u64;
            return Err(ApiError::RateLimited {
                message: format!("too many requests at once: the limit of {max} per minute allows {} at once, then one every {:.1} s", cap as u64, 1.0 / rate),
                retry_after,
            });
        }
        Ok(Some((held - 1.0, now)))
    }

    fn enter(&mut self, now: Instant, id: u64) {
        self.requests.push_back((now, id));
        self.concurrent += 1;
    }

    /// Whether `tokens` more fit `limits`' tokens per minute, or when to retry.
    fn room(&self, limits: &TenantLimits, now: Instant, tokens: u64, what: &str) -> Result<(), ApiError> {
        if let Some(max) = limits.tokens_per_min {
            let max = max.max(0) as u64;
            if tokens > max {
                return Err(ApiError::Invalid(format!(
                    "this request may use {tokens} tokens (prompt plus max_tokens times n), more than the limit of {max} tokens per minute{what}; lower max_tokens"
                )));
            }
            let mut sum = self.token_sum();
            if sum.saturating_add(tokens) > max {
                // Retry once enough of the window has expired.
                let mut retry_after = 1;
                for &(t, _, n) in &self.tokens {
                    sum = sum.saturating_sub(n);
                    retry_after = seconds_until(t, now).max(1);
                    if sum.saturating_add(tokens) <= max {
                        break;
                    }
                }
                return Err(ApiError::RateLimited {
                    message: format!("too many tokens{what}: the limit is {max} per minute and this request may use {tokens}"),
                    retry_after,
                });
            }
        }
        Ok(())
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

/// The windows of every tenant. Cheap to share.
#[derive(Debug, Default)]
pub struct Limiter {
    windows: Mutex<Windows>,
    next_id: std::sync::atomic::AtomicU64,
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
}

fn seconds_until(t: Instant, now: Instant) -> u64 {
    let left = (t + WINDOW).saturating_duration_since(now);
    left.as_secs() + u64::from(left.subsec_nanos() > 0)
}

impl Limiter {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Windows> {
        self.windows.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits one request of `tenant` against its concurrency and requests-per-minute limits,
    /// or says when to retry. Its tokens are reserved later ([`Permit::reserve`]), once they
    /// are counted.
    pub fn admit(self: &Arc<Self>, tenant: &str, limits: &TenantLimits) -> Result<Permit, ApiError> {
        self.admit_at(tenant, limits, Instant::now())
    }

    fn admit_at(self: &Arc<Self>, tenant: &str, limits: &TenantLimits, now: Instant) -> Result<Permit, ApiError> {
        let mut all = self.lock();
        let w = all.tenants.entry(tenant.to_string()).or_default();
        w.expire(now);
        w.check(limits, now, "requests")?;
        w.bucket = w.take(limits, now)?;
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        w.enter(now, id);
        Ok(Permit { limiter: self.clone(), tenant: tenant.to_string(), limits: limits.clone(), id, share: None })
    }

    /// Admits one line of `tenant`'s batch work: within its [`batch_share`] of the limits, and
    /// within the limits themselves counting every request of the tenant. The tenant's burst
    /// bucket is left to its interactive requests; batch work has one of its own.
    pub fn admit_batch(self: &Arc<Self>, tenant: &str, limits: &TenantLimits) -> Result<Permit, ApiError> {
        self.admit_batch_at(tenant, limits, Instant::now())
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
        Ok(Permit { limiter: self.clone(), tenant: tenant.to_string(), limits: limits.clone(), id, share: Some(share) })
    }
}

impl Permit {
    /// Reserves the most tokens the request may use (prompt plus what it may generate) against
    /// the tokens-per-minute limit (and batch work against its share too), or says when to retry.
    pub fn reserve(&mut self, tokens: u64) -> Result<(), ApiError> {
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
mod tests {
    use super::*;

    fn limits(rpm: Option<i64>, tpm: Option<i64>, conc: Option<i64>) -> TenantLimits {
        TenantLimits { requests_per_min: rpm, tokens_per_min: tpm, max_concurrent: conc, ..TenantLimits::default() }
    }

    fn admit(l: &Arc<Limiter>, tenant: &str, limits: &TenantLimits, tokens: u64) -> Result<Permit, ApiError> {
        let mut p = l.admit(tenant, limits)?;
        p.reserve(tokens)?;
        Ok(p)
    }

    #[test]
    fn each_limit_refuses_with_a_retry_time() {
        let l = Limiter::new();
        let rpm = limits(Some(2), None, None);
        let _a = admit(&l, "t", &rpm, 1).unwrap();
        let _b = admit(&l, "t", &rpm, 1).unwrap();
        match admit(&l, "t", &rpm, 1) {
            Err(ApiError::RateLimited { retry_after, .. }) => assert!((59..=60).contains(&retry_after), "{retry_after}"),
            other => panic!("{other:?}"),
        }
        // Another tenant has its own window.
        assert!(admit(&l, "u", &rpm, 1).is_ok());

        let conc = limits(None, None, Some(1));
        let p = admit(&l, "c", &conc, 1).unwrap();
        assert!(matches!(admit(&l, "c", &conc, 1), Err(ApiError::RateLimited { retry_after: 1, .. })));
        drop(p);
        assert!(admit(&l, "c", &conc, 1).is_ok());

        let tpm = limits(None, Some(100), None);
        let p = admit(&l, "k", &tpm, 80).unwrap();
        assert!(matches!(admit(&l, "k", &tpm, 30), Err(ApiError::RateLimited { .. })));
        // What was reserved but not used is given back.
        p.settle(10);
        assert!(admit(&l, "k", &tpm, 30).is_ok());
        // A request that could never fit is a client error, not a retry.
        assert!(matches!(admit(&l, "k", &tpm, 101), Err(ApiError::Invalid(_))));
        // Sums saturate instead of overflowing.
        assert!(matches!(admit(&l, "k", &tpm, u64::MAX), Err(ApiError::Invalid(_))));
    }

    #[test]
    fn a_request_refused_after_admission_still_counts_against_the_minute() {
        let l = Limiter::new();
        let both = limits(Some(1), Some(100), None);
        // Admitted, then refused for its tokens: it was read and counted, so it counts.
        assert!(matches!(admit(&l, "t", &both, 500), Err(ApiError::Invalid(_))));
        assert!(matches!(admit(&l, "t", &both, 10), Err(ApiError::RateLimited { .. })));
    }

    #[test]
    fn a_minute_of_requests_is_spread_over_the_minute() {
        assert_eq!((burst(3), burst(60), burst(600), burst(0)), (3.0, 10.0, 50.0, 0.0));
        let l = Limiter::new();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // 120 a minute: 10 at once, then one every half second.
        let rpm = limits(Some(120), None, None);
        let held: Vec<Permit> = (0..10).map(|_| l.admit_at("t", &rpm, t0).unwrap()).collect();
        match l.admit_at("t", &rpm, t0) {
            Err(ApiError::RateLimited { retry_after, message }) => assert!(retry_after == 1 && message.contains("10 at once"), "{retry_after} {message}"),
            other => panic!("{other:?}"),
        }
        assert!(l.admit_at("t", &rpm, at(500)).is_ok());
        assert!(l.admit_at("t", &rpm, at(500)).is_err());
        drop(held);
        // 600 a minute, asked for every 10 ms: the first five seconds get 100, not all 600, and
        // the minute never more than 600.
        let rpm = limits(Some(600), None, None);
        let mut admitted = Vec::new();
        for ms in (0..120_000).step_by(10) {
            if let Ok(p) = l.admit_at("u", &rpm, at(ms)) {
                admitted.push(ms);
                drop(p);
            }
        }
        let within = |from: u64, len: u64| admitted.iter().filter(|&&ms| ms >= from && ms < from + len).count();
        assert!((99..=101).contains(&within(0, 5_000)), "{}", within(0, 5_000));
        assert!((0..60_000).step_by(1_000).all(|from| within(from, 60_000) <= 600));
        assert!(within(0, 60_000) >= 590, "{}", within(0, 60_000));
    }

    #[test]
    fn batch_work_takes_at_most_half_of_each_limit_and_never_the_interactive_burst() {
        assert_eq!(batch_share(&limits(Some(7), Some(100), Some(1))), limits(Some(4), Some(50), Some(1)));
        assert_eq!(batch_share(&limits(None, Some(0), None)), limits(None, Some(0), None));
        let l = Limiter::new();
        let t0 = Instant::now();
        // Concurrency 4: batch work holds at most 2, and interactive requests get the rest.
        let conc = limits(None, None, Some(4));
        let batch: Vec<Permit> = (0..2).map(|_| l.admit_batch_at("c", &conc, t0).unwrap()).collect();
        assert!(matches!(l.admit_batch_at("c", &conc, t0), Err(ApiError::RateLimited { .. })));
        let interactive: Vec<Permit> = (0..2).map(|_| l.admit_at("c", &conc, t0).unwrap()).collect();
        assert!(l.admit_at("c", &conc, t0).is_err(), "batch and interactive count together");
        drop(interactive);
        // Interactive requests may take the whole limit: then batch work waits too.
        drop(batch);
        let interactive: Vec<Permit> = (0..4).map(|_| l.admit_at("c", &conc, t0).unwrap()).collect();
        assert!(l.admit_batch_at("c", &conc, t0).is_err());
        drop(interactive);

        // 20 a minute: batch work gets 10 of them, from a bucket of its own; the tenant's burst of
        // 10 interactive requests is still there, and the minute holds 20 in all.
        let rpm = limits(Some(20), None, None);
        for i in 0..10 {
            l.admit_batch_at("r", &rpm, t0).unwrap_or_else(|e| panic!("batch {i}: {e}"));
        }
        assert!(l.admit_batch_at("r", &rpm, t0).is_err());
        for i in 0..10 {
            l.admit_at("r", &rpm, t0).unwrap_or_else(|e| panic!("interactive {i}: {e}"));
        }
        assert!(l.admit_at("r", &rpm, t0 + Duration::from_secs(30)).is_err(), "the minute's 20 are used");

        // Tokens: batch work reserves at most half the minute's tokens; one line that could never
        // fit its half is a client error, not a wait.
        let tpm = limits(None, Some(100), None);
        let mut a = l.admit_batch_at("k", &tpm, t0).unwrap();
        a.reserve(50).unwrap();
        let mut b = l.admit_batch_at("k", &tpm, t0).unwrap();
        assert!(matches!(b.reserve(1), Err(ApiError::RateLimited { .. })));
        assert!(matches!(b.reserve(51), Err(ApiError::Invalid(_))));
        let mut i = l.admit_at("k", &tpm, t0).unwrap();
        i.reserve(50).unwrap();
        assert!(matches!(l.admit_at("k", &tpm, t0).unwrap().reserve(1), Err(ApiError::RateLimited { .. })));
        a.settle(10);
        b.reserve(40).unwrap();
    }
}
