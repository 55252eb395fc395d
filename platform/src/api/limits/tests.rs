//! A tenant's limits kept on one server, and shared by replicas through PostgreSQL (the
//! shared tests run where `LORAPLEX_TEST_POSTGRES` names a server, as the store's do).

use super::*;

fn limits(rpm: Option<i64>, tpm: Option<i64>, conc: Option<i64>) -> TenantLimits {
    TenantLimits { requests_per_min: rpm, tokens_per_min: tpm, max_concurrent: conc, ..TenantLimits::default() }
}

fn admit(l: &Arc<Limiter>, tenant: &str, limits: &TenantLimits, tokens: u64) -> Result<Permit, ApiError> {
    let mut p = l.admit_at(tenant, limits, Instant::now())?;
    p.reserve_at(tokens)?;
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
    a.reserve_at(50).unwrap();
    let mut b = l.admit_batch_at("k", &tpm, t0).unwrap();
    assert!(matches!(b.reserve_at(1), Err(ApiError::RateLimited { .. })));
    assert!(matches!(b.reserve_at(51), Err(ApiError::Invalid(_))));
    let mut i = l.admit_at("k", &tpm, t0).unwrap();
    i.reserve_at(50).unwrap();
    assert!(matches!(l.admit_at("k", &tpm, t0).unwrap().reserve_at(1), Err(ApiError::RateLimited { .. })));
    a.settle(10);
    b.reserve_at(40).unwrap();
}

/// Waits (up to five seconds) for `f` to admit: releases and settlements of the shared
/// limits are written behind the request.
async fn eventually<F, Fut>(mut f: F) -> Permit
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Permit, ApiError>>,
{
    for _ in 0..500 {
        if let Ok(p) = f().await {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never admitted");
}

#[actix_web::test]
async fn shared_limits_hold_across_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = crate::store::test_urls(dir.path()).await.into_iter().find(|u| u.starts_with("postgres")) else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let store = Store::connect(&url).await.unwrap();
    let a = Limiter::shared(store.clone(), "rep_a").await.unwrap();
    let b = Limiter::shared(store.clone(), "rep_b").await.unwrap();
    assert!(a.is_shared());

    // A tenant without limits costs no row.
    let none = limits(None, None, None);
    let p = a.admit("free", &none).await.unwrap();
    assert!(p.slot.is_none());

    // Requests per minute: six, alternating replicas, twelve asked at once from both.
    let rpm = limits(Some(6), None, None);
    let tries = (0..12).map(|i| {
        let l = if i % 2 == 0 { a.clone() } else { b.clone() };
        let rpm = rpm.clone();
        async move { l.admit("t", &rpm).await }
    });
    let results = futures::future::join_all(tries).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 6);
    match results.iter().find_map(|r| r.as_ref().err()) {
        Some(ApiError::RateLimited { retry_after, .. }) => assert!((1..=60).contains(retry_after), "{retry_after}"),
        other => panic!("{other:?}"),
    }

    // Concurrency: two slots in all; one released on A frees one for B.
    let conc = limits(None, None, Some(2));
    let p1 = a.admit("c", &conc).await.unwrap();
    let _p2 = b.admit("c", &conc).await.unwrap();
    assert!(matches!(a.admit("c", &conc).await, Err(ApiError::RateLimited { .. })));
    assert!(matches!(b.admit("c", &conc).await, Err(ApiError::RateLimited { .. })));
    drop(p1);
    let _p3 = eventually(|| b.admit("c", &conc)).await;

    // Tokens: a reservation on A counts on B; what was not used comes back.
    let tpm = limits(None, Some(100), None);
    let mut x = a.admit("k", &tpm).await.unwrap();
    x.reserve(80).await.unwrap();
    let mut y = b.admit("k", &tpm).await.unwrap();
    assert!(matches!(y.reserve(30).await, Err(ApiError::RateLimited { .. })));
    assert!(matches!(y.reserve(101).await, Err(ApiError::Invalid(_))));
    x.settle(10);
    let mut ok = false;
    for _ in 0..500 {
        if y.reserve(30).await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ok, "the settled tokens never came back");

    // Batch work takes half of the concurrency across replicas.
    let conc4 = limits(None, None, Some(4));
    let b1 = a.admit_batch("m", &conc4).await.unwrap();
    let _b2 = b.admit_batch("m", &conc4).await.unwrap();
    assert!(matches!(a.admit_batch("m", &conc4).await, Err(ApiError::RateLimited { .. })));
    let _i1 = b.admit("m", &conc4).await.unwrap();
    // A batch slot let go on A is free again in batch work's half, on B too.
    drop(b1);
    let _b3 = eventually(|| b.admit_batch("m", &conc4)).await;

    // A replica that dies holding slots: once it has not been seen for the timeout, its
    // slots no longer count.
    let conc1 = limits(None, None, Some(1));
    store.limit_heartbeat("rep_dead").await.unwrap();
    sqlx::query("INSERT INTO limit_running (tenant_id, batch, replica, running) VALUES ('d', 0, 'rep_dead', 1)").execute(store.pool()).await.unwrap();
    assert!(matches!(a.admit("d", &conc1).await, Err(ApiError::RateLimited { .. })));
    sqlx::query("UPDATE replicas SET seen_ms = 0 WHERE id = 'rep_dead'").execute(store.pool()).await.unwrap();
    let _d = a.admit("d", &conc1).await.unwrap();
    // ... and a replica that restarts under the same name lets its previous run's slots go.
    let again = Limiter::shared(store.clone(), "rep_a").await.unwrap();
    let _e = again.admit("d", &conc1).await.unwrap();
}

/// A PostgreSQL store for the shared limits' tests, or `None` (skipped) without one.
async fn shared_store(dir: &std::path::Path) -> Option<Store> {
    let url = crate::store::test_urls(dir).await.into_iter().find(|u| u.starts_with("postgres"))?;
    Some(Store::connect(&url).await.unwrap())
}

/// One interactive admission of `tenant` on replica `rep_a`, under no limit, for no lease.
fn plain_ask(tenant: &str) -> AdmitAsk<'_> {
    AdmitAsk {
        tenant,
        batch: false,
        replica: "rep_a",
        max_concurrent: None,
        requests_per_min: None,
        share_concurrent: None,
        share_requests_per_min: None,
        bucket: None,
        want: 1,
        tokens_per_min: None,
        share_tokens_per_min: None,
        want_tokens: 0,
        ahead: false,
    }
}

/// (requests, tokens) counted for `tenant`'s interactive class, and its concurrency slots.
async fn counted(store: &Store, tenant: &str) -> (i64, i64, i64) {
    let (requests, tokens): (i64, i64) = sqlx::query_as(
        "SELECT CAST(COALESCE(SUM(requests), 0) AS BIGINT), CAST(COALESCE(SUM(tokens), 0) AS BIGINT) FROM limit_seconds WHERE tenant_id = $1 AND batch = 0",
    )
    .bind(tenant)
    .fetch_one(store.pool())
    .await
    .unwrap();
    let (running,): (i64,) = sqlx::query_as("SELECT CAST(COALESCE(SUM(running), 0) AS BIGINT) FROM limit_running WHERE tenant_id = $1 AND batch = 0")
        .bind(tenant)
        .fetch_one(store.pool())
        .await
        .unwrap();
    (requests, tokens, running)
}

/// Waits (up to five seconds) until `tenant`'s counts are `want`.
async fn counts_become(store: &Store, tenant: &str, want: (i64, i64, i64)) {
    let mut last = (0, 0, 0);
    for _ in 0..500 {
        last = counted(store, tenant).await;
        if last == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{tenant}: counted {last:?}, not {want:?}");
}

#[actix_web::test]
async fn far_from_its_limits_a_replica_leases_admissions_and_tokens_and_gives_back_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = shared_store(dir.path()).await else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let a = Limiter::shared(store.clone(), "rep_a").await.unwrap();
    let high = limits(Some(1_000_000), Some(1_000_000_000), Some(100_000));
    let mut permits = Vec::new();
    for _ in 0..40 {
        let mut p = a.admit("t", &high).await.unwrap();
        p.reserve(100).await.unwrap();
        permits.push(p);
    }
    // One decision each would be 80 calls; leases that double while they run out take a
    // handful (a few more when the requests straddle a second).
    let calls = a.database_calls();
    assert!(calls <= 30, "{calls} calls for 40 admissions and reservations");
    // Once the leases' seconds are over, what they did not hand out is given back: the
    // database counts exactly the 40 requests, their tokens and their slots.
    counts_become(&store, "t", (40, 4000, 40)).await;
    for p in &permits[..10] {
        p.settle(30);
    }
    drop(permits);
    counts_become(&store, "t", (40, 4000 - 10 * 70, 0)).await;
}

/// A background renewal that lands while the tokens of the one before are still held (their
/// admissions were taken, the tokens not needed yet) gives those tokens back as it replaces
/// them, instead of leaving them counted for the rest of the minute.
#[test]
fn a_renewal_gives_back_the_following_tokens_it_replaces() {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let now = Instant::now();
    let lease = |second: i64, granted: i64| Lease { second, from: now, until: now + Duration::from_secs(1), granted, left: granted };
    let mut leases = Leases { next_tokens: Some(lease(7, 200)), ..Leases::default() };
    leases.land_renewal(lease(8, 4), Some(lease(8, 400)), "t", false, &tx);
    assert_eq!(leases.next_admissions.map(|a| (a.second, a.left)), Some((8, 4)));
    assert_eq!(leases.next_tokens.map(|t| (t.second, t.left)), Some((8, 400)));
    match rx.try_recv() {
        Ok(Change::Settle { tenant, batch: false, second: 7, delta: -200 }) if tenant == "t" => {}
        other => panic!("the replaced tokens are given back, got {other:?}"),
    }
    assert!(rx.try_recv().is_err(), "nothing else");
    // A renewal that brought no tokens leaves the held ones in place; the admissions it replaces
    // are given back.
    leases.land_renewal(lease(9, 2), None, "t", false, &tx);
    assert_eq!(leases.next_tokens.map(|t| t.second), Some(8));
    match rx.try_recv() {
        Ok(Change::Unlease { tenant, batch: false, second: 8, n: 4 }) if tenant == "t" => {}
        other => panic!("the replaced admissions are given back, got {other:?}"),
    }
}

/// Tokens are leased in the admissions' call, a request's worth (its last reservation) per
/// admission: after the first request, reservations find tokens leased and ask nothing.
#[actix_web::test]
async fn tokens_are_leased_with_the_admissions_in_one_call() {
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = shared_store(dir.path()).await else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let a = Limiter::shared(store.clone(), "rep_a").await.unwrap();
    let high = limits(Some(1_000_000), Some(1_000_000_000), None);
    let mut permits = Vec::new();
    let mut reserve_calls = 0;
    for i in 0..40 {
        let mut p = a.admit("t", &high).await.unwrap();
        let before = a.waits();
        p.reserve(100).await.unwrap();
        if i > 0 {
            reserve_calls += a.waits() - before;
        }
        permits.push(p);
    }
    // Separate leases would take one call whenever the tokens' lease ran out (five or six
    // times while it doubles); a second ending between an admission and its reservation
    // may cost one.
    assert!(reserve_calls <= 2, "{reserve_calls} of 39 reservations asked the database");
    drop(permits);
    // What the leases did not hand out comes back: exactly the 40 requests and their tokens.
    counts_become(&store, "t", (40, 4000, 0)).await;
}

/// A class whose requests keep coming has its next second's leases asked for before the
/// current second ends: at the turn of a second its requests do not wait for a decision.
/// What those leases do not hand out is given back like any lease's.
#[actix_web::test]
async fn steady_traffic_has_the_next_seconds_leases_before_it_needs_them() {
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = shared_store(dir.path()).await else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let a = Limiter::shared(store.clone(), "rep_a").await.unwrap();
    let high = limits(Some(1_000_000), Some(1_000_000_000), None);
    let mut n = 0;
    let step = async |n: &mut i64| {
        let mut p = a.admit("t", &high).await.unwrap();
        p.reserve(10).await.unwrap();
        *n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A second and a half for the leases to grow to the traffic, then three seconds timed.
    let began = Instant::now();
    while began.elapsed() < Duration::from_millis(1500) {
        step(&mut n).await;
    }
    let (waited, calls) = (a.waits(), a.database_calls());
    let timed = Instant::now();
    while timed.elapsed() < Duration::from_secs(3) {
        step(&mut n).await;
    }
    let (waited, calls) = (a.waits() - waited, a.database_calls() - calls);
    // Without leases asked ahead, each of the three turns of a second waits for one call: three
    // waits or more. Asked ahead, a turn waits only when its renewal came back after the turn
    // (a database call slower than the lead, as on a loaded CI machine); most turns do not.
    assert!(waited < 3, "{waited} requests waited for the database over three seconds of steady traffic");
    assert!((2..=8).contains(&calls), "{calls} calls over three seconds");
    counts_become(&store, "t", (n, 10 * n, 0)).await;
}

/// Leases asked for the next second count there, and near a limit none is granted: a
/// request there is decided as it comes.
#[actix_web::test]
async fn leases_asked_ahead_count_in_the_next_second_and_never_near_a_limit() {
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = shared_store(dir.path()).await else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let ask = |tenant: &'static str, rpm: i64| AdmitAsk {
        requests_per_min: Some(rpm),
        want: 4,
        tokens_per_min: Some(1_000_000),
        want_tokens: 400,
        ahead: true,
        ..plain_ask(tenant)
    };
    let v = store.limit_admit(&ask("far", 1_000_000)).await.unwrap();
    assert_eq!((v.verdict.as_str(), v.granted, v.tokens_granted), ("ok", 4, 400));
    let (second,): (i64,) = sqlx::query_as("SELECT second FROM limit_seconds WHERE tenant_id = 'far'").fetch_one(store.pool()).await.unwrap();
    assert_eq!(second, v.now_ms.div_euclid(1000) + 1, "counted in the next second");
    assert_eq!(counted(&store, "far").await, (4, 400, 4));
    // Room for seven more: not leased ahead, nothing counted.
    let v = store.limit_admit(&ask("near", 7)).await.unwrap();
    assert_eq!((v.verdict.as_str(), v.granted), ("near", 0));
    assert_eq!(counted(&store, "near").await, (0, 0, 0));
}

/// Each tenant's seconds begin at an offset of their own: asked for at one instant, the
/// leases of twenty tenants end at instants spread over the second, not all at its end
/// (where they would all come back to the database together).
#[actix_web::test]
async fn tenants_leases_end_at_instants_spread_over_the_second() {
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = shared_store(dir.path()).await else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let mut tenths = std::collections::BTreeSet::new();
    for i in 0..20 {
        let tenant = format!("tenant-{i}");
        let ask = AdmitAsk { requests_per_min: Some(1_000_000), ..plain_ask(&tenant) };
        let v = store.limit_admit(&ask).await.unwrap();
        assert_eq!(v.verdict, "ok");
        tenths.insert(v.now_ms.rem_euclid(1000) / 100);
    }
    // On one clock, twenty calls a few milliseconds apart fall in one tenth of a second or two.
    assert!(tenths.len() >= 5, "the tenants' seconds end together: {tenths:?}");
}

#[actix_web::test]
async fn near_a_limit_leases_never_let_the_replicas_pass_it_together() {
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = shared_store(dir.path()).await else {
        eprintln!("shared limits need PostgreSQL: skipped");
        return;
    };
    let a = Limiter::shared(store.clone(), "rep_a").await.unwrap();
    let b = Limiter::shared(store.clone(), "rep_b").await.unwrap();
    // 40 slots: a lease may take a few of them at once, which the other replica cannot use
    // until they are handed out or given back; together they never hold more than 40, and
    // they reach 40.
    let conc = limits(None, None, Some(40));
    let mut held = Vec::new();
    let began = Instant::now();
    while held.len() < 40 && began.elapsed() < Duration::from_secs(10) {
        for l in [&a, &b] {
            if let Ok(p) = l.admit("c", &conc).await {
                held.push(p);
            }
        }
        let (_, _, running) = counted(&store, "c").await;
        assert!(running <= 40, "{running} slots held");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(held.len(), 40, "the replicas never reached the limit together");
    assert!(matches!(a.admit("c", &conc).await, Err(ApiError::RateLimited { .. })));
    assert!(matches!(b.admit("c", &conc).await, Err(ApiError::RateLimited { .. })));
    counts_become(&store, "c", (40, 0, 40)).await;
}
