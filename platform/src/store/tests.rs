//! The store against SQLite and, when `LORAPLEX_TEST_POSTGRES` names a server (`.ci/run`
//! starts one), PostgreSQL: every test runs on both.

use super::*;

/// A fresh database of each kind: a SQLite file, and a new PostgreSQL database.
async fn stores() -> Vec<(Store, Option<tempfile::TempDir>)> {
    let dir = tempfile::tempdir().unwrap();
    let mut out = Vec::new();
    for url in test_urls(dir.path()).await {
        out.push((Store::connect(&url).await.unwrap(), None));
    }
    out[0].1 = Some(dir);
    out
}

fn tenant(name: &str) -> NewTenant {
    NewTenant { name: name.into(), weight: 1.0, plan: "standard".into(), limits: TenantLimits::default() }
}

#[tokio::test]
async fn tenants_and_keys() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let acme = s.create_tenant(&tenant("acme")).await.unwrap();
        assert!(matches!(s.create_tenant(&tenant("acme")).await, Err(StoreError::Conflict { .. })), "{kind:?}");
        for bad in
            [NewTenant { name: "../x".into(), ..tenant("x") }, NewTenant { weight: 0.0, ..tenant("x") }, NewTenant { plan: "gold".into(), ..tenant("x") }]
        {
            assert!(matches!(s.create_tenant(&bad).await, Err(StoreError::Invalid { .. })), "{kind:?} {bad:?}");
        }
        let limits = TenantLimits { requests_per_min: Some(60), ..Default::default() };
        let patch =
            TenantPatch { weight: Some(2.0), plan: Some("enterprise".into()), limits: LimitsPatch { requests_per_min: Some(Some(60)), ..Default::default() } };
        let patched = s.update_tenant(&acme.id, &patch).await.unwrap();
        assert_eq!((patched.weight, patched.plan.as_str(), patched.limits()), (2.0, "enterprise", limits));
        assert_eq!(s.tenant(&acme.id).await.unwrap(), Some(patched));

        let (key, secret) = s.create_key(Some(&acme.id), &[Scope::Inference, Scope::Adapters]).await.unwrap();
        assert!(secret.starts_with(&key.prefix) && secret.len() > 40);
        let found = s.authenticate(&secret).await.unwrap().expect("a live key");
        assert!(found.has(Scope::Inference) && !found.has(Scope::Admin));
        assert_eq!(s.authenticate("lpx_wrong").await.unwrap(), None);
        let (admin, admin_secret) = s.create_key(None, &[Scope::Admin]).await.unwrap();
        assert_eq!(s.authenticate(&admin_secret).await.unwrap().map(|k| k.id), Some(admin.id));
        assert!(s.revoke_key(&key.id).await.unwrap());
        assert!(!s.revoke_key(&key.id).await.unwrap());
        assert_eq!(s.authenticate(&secret).await.unwrap(), None, "revoked");

        let (_, other) = s.create_key(Some(&acme.id), &[Scope::Inference]).await.unwrap();
        assert_eq!(s.delete_tenant(&acme.id).await.unwrap(), Some(DeletedTenant::default()));
        assert_eq!(s.tenant(&acme.id).await.unwrap(), None);
        assert_eq!(s.authenticate(&other).await.unwrap(), None, "a deleted tenant's keys stop working");
        assert!(matches!(s.create_key(Some(&acme.id), &[Scope::Inference]).await, Err(StoreError::NotFound(_))));
        assert!(s.create_tenant(&tenant("globex")).await.is_ok());
        assert_eq!(s.tenants().await.unwrap().len(), 1);
    }
}

#[tokio::test]
async fn adapter_versions_and_visibility() {
    for (s, _dir) in stores().await {
        let a = s.create_tenant(&tenant("acme")).await.unwrap();
        let b = s.create_tenant(&tenant("globex")).await.unwrap();
        let none = TenantLimits::default();
        let new = |owner: &str, name: &str| NewAdapter {
            owner: owner.into(),
            name: name.into(),
            rank: 8,
            targets: "q_proj,v_proj".into(),
            bytes: 1000,
            content_hash: "ab".repeat(32),
            blob: format!("adapters/{owner}/{name}"),
            base_model: "m".into(),
            base_shape: "s".into(),
        };
        assert_eq!(s.insert_adapter(&new(&a.id, "support"), &none).await.unwrap().version, 1);
        let v2 = s.insert_adapter(&new(&a.id, "support"), &none).await.unwrap();
        assert_eq!((v2.version, v2.label()), (2, "support@2".into()));
        assert_eq!(s.visible_adapter(&a.id, "support").await.unwrap(), Some(v2.clone()));
        assert_eq!(s.visible_adapter(&b.id, "support").await.unwrap(), None, "another tenant's private adapter is unknown");
        assert!(s.visible_adapters(&b.id).await.unwrap().is_empty());
        assert_eq!(s.visible_adapters(&a.id).await.unwrap(), std::slice::from_ref(&v2), "only the latest version is listed");
        assert_eq!(s.adapter_footprint(&a.id).await.unwrap(), (1, 2000), "one adapter, two versions");
        for bad in ["../etc", "a/b", "", ".hidden", &"x".repeat(65)] {
            assert!(matches!(s.insert_adapter(&new(&a.id, bad), &none).await, Err(StoreError::Invalid { .. })), "{bad:?}");
        }
        // The operator publishes one of its own to everyone.
        let shared = s.insert_adapter(&new("", "summarize"), &none).await.unwrap();
        assert_eq!(s.visible_adapter(&b.id, "summarize").await.unwrap(), None);
        assert!(s.publish_adapter("", "summarize", true).await.unwrap());
        assert_eq!(s.visible_adapter(&b.id, "summarize").await.unwrap().map(|r| r.id), Some(shared.id.clone()));
        let shared2 = s.insert_adapter(&new("", "summarize"), &none).await.unwrap();
        assert_eq!(shared2.public, 1, "a new version of a published adapter stays published");
        assert_eq!(s.visible_adapter_version(&b.id, "summarize", 1).await.unwrap().map(|r| r.id), Some(shared.id));
        assert_eq!(s.visible_adapter_version(&a.id, "support", 1).await.unwrap().map(|r| r.version), Some(1));
        assert_eq!(s.visible_adapter_version(&b.id, "support", 1).await.unwrap(), None, "nor any version of it");
        // A tenant's own adapter of the same name comes first.
        let own = s.insert_adapter(&new(&b.id, "summarize"), &none).await.unwrap();
        assert_eq!(s.visible_adapter(&b.id, "summarize").await.unwrap().map(|r| r.id), Some(own.id));
        assert_eq!(s.delete_adapter(&a.id, "support").await.unwrap().len(), 2);
        assert!(s.delete_adapter(&a.id, "support").await.unwrap().is_empty());
        assert_eq!(s.visible_adapter(&a.id, "support").await.unwrap(), None);
        assert_eq!(s.insert_adapter(&new(&a.id, "support"), &none).await.unwrap().version, 3, "versions are never reused");
    }
}

/// One group written as one statement: a row opened and ended in the same group keeps its
/// opening's plan and prices and takes its end's outcome; every value comes back as written.
#[tokio::test]
async fn a_group_of_usage_rows_is_written_exactly() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let row = |id: &str, outcome: &str, price: i64| UsageRecord {
            id: id.into(),
            tenant_id: "ten".into(),
            key_id: "key".into(),
            adapter: "it's \"quoted\" ü@1".into(),
            prompt_tokens: i64::MAX / 3,
            cached_prompt_tokens: 7,
            completion_tokens: 11,
            queue_ms: 0.1 + 0.2,
            ttft_ms: 1e-9,
            total_ms: 12_345.678_9,
            outcome: outcome.into(),
            started_at: 1_700_000_000_123,
            finished_at: 1_700_000_000_456,
            plan: "standard".into(),
            prompt_price: price,
            cached_prompt_price: price / 4,
            completion_price: price * 3,
            instance: "replica-1".into(),
            batch_id: String::new(),
            base_model: "loraplex-tiny".into(),
        };
        let opened = row("a", "running", 500_000);
        let ended = UsageRecord { completion_tokens: 99, total_ms: f64::NAN, plan: "other".into(), ..row("a", "ok", 1) };
        let other = row("b", "cancelled", 2);
        s.upsert_usage(&[&opened, &other, &ended]).await.unwrap();
        let a = s.usage_row("a").await.unwrap().unwrap();
        let want = UsageRecord {
            total_ms: 0.0,
            plan: opened.plan.clone(),
            prompt_price: 500_000,
            cached_prompt_price: 125_000,
            completion_price: 1_500_000,
            ..ended.clone()
        };
        assert_eq!(a, want, "{kind:?}");
        assert_eq!(s.usage_row("b").await.unwrap().unwrap(), other, "{kind:?}");
        // A cancelled row keeps its outcome when its request's end is written later.
        s.upsert_usage(&[&row("b", "ok", 2)]).await.unwrap();
        assert_eq!(s.usage_row("b").await.unwrap().unwrap().outcome, "cancelled", "{kind:?}");
        s.upsert_usage(&[]).await.unwrap();
    }
}

#[tokio::test]
async fn the_ledger_commits_in_groups_and_the_report_adds_up() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let a = s.create_tenant(&tenant("acme")).await.unwrap();
        let b = s.create_tenant(&NewTenant { plan: "free".into(), ..tenant("globex") }).await.unwrap();
        let ledger = Ledger::start(s.clone(), std::time::Duration::ZERO);
        let (standard, free) = (s.plan("standard").await.unwrap().unwrap(), s.plan("free").await.unwrap().unwrap());
        let day0 = 20_000 * DAY;
        let mut tasks = Vec::new();
        for i in 0..300i64 {
            let ledger = ledger.clone();
            let (tenant, plan) = if i % 3 == 0 { (b.id.clone(), &free) } else { (a.id.clone(), &standard) };
            let record = UsageRecord {
                id: format!("req-{i}"),
                tenant_id: tenant,
                plan: plan.name.clone(),
                prompt_price: plan.prompt_price,
                cached_prompt_price: plan.cached_prompt_price,
                completion_price: plan.completion_price,
                batch_id: String::new(),
                base_model: "loraplex-tiny".into(),
                instance: "test".into(),
                key_id: "key".into(),
                adapter: if i % 2 == 0 { "support@1".into() } else { String::new() },
                prompt_tokens: 100 + i,
                cached_prompt_tokens: i % 50,
                completion_tokens: 10 + i % 7,
                queue_ms: 1.0,
                ttft_ms: 2.0,
                total_ms: 3.0,
                outcome: "ok".into(),
                started_at: day0 + i * 1000,
                finished_at: day0 + (i / 150) * DAY + i * 1000,
            };
            tasks.push(tokio::spawn(async move { ledger.commit(record.clone()).await.map(|()| record) }));
        }
        let mut sent = Vec::new();
        for t in tasks {
            sent.push(t.await.unwrap().unwrap());
        }
        let r = s.billing_report(day0, day0 + 2 * DAY, None).await.unwrap();
        let sum = |f: fn(&UsageRecord) -> i64| sent.iter().map(f).sum::<i64>();
        assert_eq!(r.totals.requests, 300, "{kind:?}");
        assert_eq!(r.totals.prompt_tokens, sum(|u| u.prompt_tokens));
        assert_eq!(r.totals.cached_prompt_tokens, sum(|u| u.cached_prompt_tokens));
        assert_eq!(r.totals.completion_tokens, sum(|u| u.completion_tokens));
        assert_eq!(r.lines.len(), 2 * 2 * 2, "tenant x adapter x day");
        assert_eq!(r.tenants[&b.id].totals.cost, Money::ZERO, "the free plan");
        assert_eq!((r.tenants[&a.id].tenant.as_str(), r.tenants[&b.id].tenant.as_str()), ("acme", "globex"));
        let of_a = |f: fn(&UsageRecord) -> i64| sent.iter().filter(|u| u.tenant_id == a.id).map(f).sum::<i64>();
        // Exact: $0.50, $0.125 and $1.50 per million tokens, in pico-dollars.
        let pico = i128::from(of_a(|u| u.prompt_tokens) - of_a(|u| u.cached_prompt_tokens)) * 500_000
            + i128::from(of_a(|u| u.cached_prompt_tokens)) * 125_000
            + i128::from(of_a(|u| u.completion_tokens)) * 1_500_000;
        assert_eq!(r.tenants[&a.id].totals.cost.pico(), pico);
        assert_eq!(r.totals.cost.pico(), pico);
        let one_day = s.billing_report(day0, day0 + DAY, Some(&a.id)).await.unwrap();
        assert_eq!(one_day.totals.requests, sent.iter().filter(|u| u.tenant_id == a.id && u.finished_at < day0 + DAY).count() as i64);
        let csv = r.to_csv();
        assert_eq!(csv.lines().count(), 1 + 8 + 2 + 1);
        assert!(csv.lines().last().unwrap().starts_with(&format!("*,*,*,*,*,300,{}", r.totals.prompt_tokens)));
        // Every row a line of the JSON report has, with the same values; dates as YYYY-MM-DD.
        let first = csv.lines().nth(1).unwrap();
        let l = &r.lines[0];
        assert!(["acme", "globex"].contains(&l.tenant.as_str()) && ["standard", "free"].contains(&l.plan.as_str()), "{l:?}");
        assert_eq!(
            first,
            format!(
                "{},{},{},{},{},{},{},{},{},{},{}",
                l.tenant_id,
                l.tenant,
                l.plan,
                l.adapter,
                date(l.day),
                l.totals.requests,
                l.totals.prompt_tokens,
                l.totals.cached_prompt_tokens,
                l.totals.completion_tokens,
                l.totals.total_tokens(),
                l.totals.cost
            )
        );
        assert!(csv.lines().any(|row| row.starts_with(&format!("{},globex,*,*,*,", b.id))), "tenant totals carry the name:\n{csv}");
        assert!(matches!(s.billing_report(10, 5, None).await, Err(StoreError::Invalid { .. })));
    }
}

const DAY: i64 = 86_400_000;

fn row(id: &str, tenant: &Tenant, plan: &Plan, outcome: &str, instance: &str, finished_at: i64) -> UsageRecord {
    UsageRecord {
        id: id.into(),
        tenant_id: tenant.id.clone(),
        key_id: "key".into(),
        adapter: String::new(),
        prompt_tokens: 1000,
        cached_prompt_tokens: 0,
        completion_tokens: 100,
        queue_ms: 0.0,
        ttft_ms: 0.0,
        total_ms: 0.0,
        outcome: outcome.into(),
        started_at: finished_at,
        finished_at,
        plan: plan.name.clone(),
        prompt_price: plan.prompt_price,
        cached_prompt_price: plan.cached_prompt_price,
        completion_price: plan.completion_price,
        instance: instance.into(),
        batch_id: String::new(),
        base_model: "loraplex-tiny".into(),
    }
}

/// Rows handed over without waiting go out in several groups; a flush answers only once every
/// one of them is written, and each row's answer says it is.
#[tokio::test]
async fn a_flush_waits_for_every_row_sent_before_it() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let t = s.create_tenant(&tenant("acme")).await.unwrap();
        let plan = s.plan("standard").await.unwrap().unwrap();
        let ledger = Ledger::start(s.clone(), std::time::Duration::ZERO);
        let n: i64 = 3 * 256 + 100;
        let written: Vec<_> = (0..n).map(|i| ledger.send(row(&format!("r{i}"), &t, &plan, outcome::OK, "me", 1000 + i)).unwrap()).collect();
        ledger.flush().await;
        let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM usage").fetch_one(s.pool()).await.unwrap();
        assert_eq!(count, n, "{kind:?}");
        for w in written {
            w.await.unwrap();
        }
    }
}

/// While rows arrive back to back, the writer holds a row for its gather time so that rows
/// sent meanwhile share its commit; a row after a quiet spell, and a flush, wait for nothing.
#[tokio::test]
async fn rows_arriving_back_to_back_are_gathered_into_one_commit() {
    use std::time::{Duration, Instant};
    let gather = Duration::from_millis(400);
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let t = s.create_tenant(&tenant("acme")).await.unwrap();
        let plan = s.plan("standard").await.unwrap().unwrap();
        let ledger = Ledger::start(s.clone(), gather);
        // The first row: nothing was flowing, so it is committed at once.
        let began = Instant::now();
        ledger.commit(row("first", &t, &plan, outcome::OK, "me", 1000)).await.unwrap();
        assert!(began.elapsed() < gather, "{kind:?}: the first row waited {:?}", began.elapsed());
        // Right after that commit: held for the gather time, and a row sent meanwhile joins it.
        let began = Instant::now();
        let held = ledger.send(row("held", &t, &plan, outcome::OK, "me", 1001)).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let joined = ledger.send(row("joined", &t, &plan, outcome::OK, "me", 1002)).unwrap();
        held.await.unwrap();
        assert!(began.elapsed() >= gather, "{kind:?}: a row while rows flow was committed after {:?}", began.elapsed());
        tokio::time::timeout(Duration::from_millis(50), joined).await.expect("the row sent during the gather shares its commit").unwrap();
        // After a quiet spell longer than the gather time: at once again.
        tokio::time::sleep(gather + Duration::from_millis(100)).await;
        let began = Instant::now();
        ledger.commit(row("quiet", &t, &plan, outcome::OK, "me", 1003)).await.unwrap();
        assert!(began.elapsed() < gather, "{kind:?}: a row after a quiet spell waited {:?}", began.elapsed());
        // A flush right after a commit is not held back.
        let began = Instant::now();
        ledger.flush().await;
        assert!(began.elapsed() < gather, "{kind:?}: a flush waited {:?}", began.elapsed());
        let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM usage").fetch_one(s.pool()).await.unwrap();
        assert_eq!(count, 4, "{kind:?}");
    }
}

/// On PostgreSQL the ledger writes over a connection of its own: a request's end is durable
/// even while every connection of the store's pool is taken (by limit decisions waiting on a
/// tenant's lock, say), instead of waiting for one. SQLite has nothing to hold its pool so
/// (its limits are in memory) and writes through it.
#[tokio::test]
async fn the_ledger_writes_while_every_connection_of_the_pool_is_taken() {
    for (s, _dir) in stores().await {
        if s.kind() != DbKind::Postgres {
            continue;
        }
        let t = s.create_tenant(&tenant("acme")).await.unwrap();
        let plan = s.plan("standard").await.unwrap().unwrap();
        let ledger = Ledger::start(s.clone(), std::time::Duration::ZERO);
        let mut held = Vec::new();
        while held.len() < s.pool().options().get_max_connections() as usize {
            held.push(s.pool().acquire().await.unwrap());
        }
        let written = tokio::time::timeout(std::time::Duration::from_secs(10), ledger.commit(row("end", &t, &plan, outcome::OK, "me", 1000))).await;
        assert!(matches!(written, Ok(Ok(()))), "the row waited for the store's pool: {written:?}");
        drop(held);
        assert_eq!(s.usage_row("end").await.unwrap().map(|r| r.outcome), Some(outcome::OK.to_string()));
        // At shutdown its connection closes after the rows sent before; later ones fail.
        let last = ledger.send(row("last", &t, &plan, outcome::OK, "me", 1001)).unwrap();
        ledger.close().await;
        last.await.unwrap();
        assert!(ledger.commit(row("late", &t, &plan, outcome::OK, "me", 1002)).await.is_err());
        assert!(s.usage_row("last").await.unwrap().is_some() && s.usage_row("late").await.unwrap().is_none());
    }
}

#[tokio::test]
async fn a_plan_change_never_rewrites_a_past_bill_and_unfinished_requests_are_not_billed() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let t = s.create_tenant(&tenant("acme")).await.unwrap();
        let (standard, enterprise) = (s.plan("standard").await.unwrap().unwrap(), s.plan("enterprise").await.unwrap().unwrap());
        let ledger = Ledger::start(s.clone(), std::time::Duration::ZERO);
        ledger.commit(row("old", &t, &standard, outcome::OK, "me", 1000)).await.unwrap();
        let before = s.billing_report(0, i64::MAX, None).await.unwrap();
        // $0.50 x 1000 + $1.50 x 100 per million tokens.
        assert_eq!(before.totals.cost.dollars(), "0.000650", "{kind:?}");
        s.update_tenant(&t.id, &TenantPatch { plan: Some("enterprise".into()), ..Default::default() }).await.unwrap();
        assert_eq!(s.billing_report(0, i64::MAX, None).await.unwrap(), before, "the plan change left the past alone");
        ledger.commit(row("new", &t, &enterprise, outcome::OK, "me", 2000)).await.unwrap();
        let after = s.billing_report(0, i64::MAX, None).await.unwrap();
        assert_eq!(after.totals.cost.dollars(), "0.001170", "0.000650 + 0.000400 + 0.000120");
        assert_eq!(after.lines.iter().map(|l| l.plan.as_str()).collect::<Vec<_>>(), ["enterprise", "standard"]);

        // Requests admitted and not finished are rows too, but not in a bill until they end;
        // those of a process that died become `interrupted`, without charge; another
        // instance's rows are left alone.
        ledger.open(row("mine", &t, &standard, outcome::RUNNING, "me", 3000)).await.unwrap();
        ledger.open(row("theirs", &t, &standard, outcome::RUNNING, "other", 3000)).await.unwrap();
        assert_eq!(s.billing_report(0, i64::MAX, None).await.unwrap().totals.requests, 2);
        assert_eq!(s.interrupt_running("me").await.unwrap(), 1);
        let mine = s.usage_row("mine").await.unwrap().unwrap();
        assert_eq!((mine.outcome.as_str(), mine.prompt_tokens, mine.prompt_price, mine.completion_price), (outcome::INTERRUPTED, 1000, 0, 0));
        assert_eq!(s.usage_row("theirs").await.unwrap().unwrap().outcome, outcome::RUNNING);
        let with = s.billing_report(0, i64::MAX, None).await.unwrap();
        assert_eq!((with.totals.requests, with.totals.cost), (3, after.totals.cost), "counted, not charged");
        // Finishing an opened row keeps the prices it was opened with.
        let done = UsageRecord {
            outcome: outcome::OK.into(),
            completion_tokens: 7,
            plan: "ignored".into(),
            prompt_price: 9,
            ..row("theirs", &t, &standard, outcome::OK, "other", 4000)
        };
        ledger.commit(done).await.unwrap();
        let theirs = s.usage_row("theirs").await.unwrap().unwrap();
        assert_eq!((theirs.completion_tokens, theirs.plan.as_str(), theirs.prompt_price), (7, "standard", standard.prompt_price));
        assert_eq!(s.outcomes(Some(&t.id)).await.unwrap().get(outcome::INTERRUPTED), Some(&1));
    }
}

#[tokio::test]
async fn a_merge_patch_changes_only_what_it_names_and_null_clears() {
    for (s, _dir) in stores().await {
        let limits = TenantLimits { requests_per_min: Some(60), tokens_per_min: Some(1000), max_pinned_pages: Some(5), ..Default::default() };
        let t = s.create_tenant(&NewTenant { limits, ..tenant("acme") }).await.unwrap();
        let patch: TenantPatch = serde_json::from_str(r#"{"limits": {"tokens_per_min": null, "max_concurrent": 3}}"#).unwrap();
        let t2 = s.update_tenant(&t.id, &patch).await.unwrap();
        assert_eq!((t2.requests_per_min, t2.tokens_per_min, t2.max_concurrent, t2.max_pinned_pages), (Some(60), None, Some(3), Some(5)));
        assert_eq!((t2.weight, t2.plan.as_str()), (1.0, "standard"));
        let t3 = s.update_tenant(&t.id, &serde_json::from_str(r#"{"weight": 3}"#).unwrap()).await.unwrap();
        assert_eq!((t3.weight, t3.limits()), (3.0, t2.limits()));
        assert!(serde_json::from_str::<TenantPatch>(r#"{"limits": {"colour": 1}}"#).is_err());
    }
}

#[tokio::test]
async fn quotas_hold_under_concurrent_uploads_and_versions_stay_contiguous() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let t = s.create_tenant(&tenant("acme")).await.unwrap();
        let quota = TenantLimits { max_adapters: Some(3), max_adapter_bytes: Some(10_000), ..Default::default() };
        let new = |name: String, bytes: i64| NewAdapter {
            owner: t.id.clone(),
            name,
            rank: 8,
            targets: "q_proj".into(),
            bytes,
            content_hash: "00".repeat(32),
            blob: random_id("adapters/blob"),
            base_model: "m".into(),
            base_shape: "s".into(),
        };
        // 16 distinct names at once: exactly 3 get in; the rest are quota errors, never a
        // database error.
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (s, new, quota) = (s.clone(), new(format!("n{i}"), 100), quota.clone());
                tokio::spawn(async move { s.insert_adapter(&new, &quota).await })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(_) => ok += 1,
                Err(StoreError::Quota(_)) => {}
                Err(e) => panic!("{kind:?}: {e}"),
            }
        }
        assert_eq!(ok, 3, "{kind:?}");
        // 32 uploads and deletes of one name at once: only successes and typed refusals;
        // versions stay contiguous; a delete that answered deleted every version it saw.
        let name = "n0".to_string();
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let (s, new, quota, name, owner) = (s.clone(), new(name.clone(), 10), quota.clone(), name.clone(), t.id.clone());
                tokio::spawn(
                    async move { if i % 2 == 0 { s.insert_adapter(&new, &quota).await.map(|r| vec![r]) } else { s.delete_adapter(&owner, &name).await } },
                )
            })
            .collect();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                assert!(matches!(e, StoreError::Quota(_)), "{kind:?}: {e}");
            }
        }
        let versions: Vec<(i64,)> = sqlx::query_as("SELECT version FROM adapters WHERE owner = $1 AND name = $2 ORDER BY version")
            .bind(&t.id)
            .bind(&name)
            .fetch_all(s.pool())
            .await
            .unwrap();
        let versions: Vec<i64> = versions.into_iter().map(|(v,)| v).collect();
        assert_eq!(versions, (1..=versions.len() as i64).collect::<Vec<_>>(), "{kind:?}: contiguous");
        let live = s.adapter_versions(&t.id, &name).await.unwrap();
        assert!(live.windows(2).all(|w| w[0].version < w[1].version));
        // The byte quota is checked in the same transaction too.
        let (count, used) = s.adapter_footprint(&t.id).await.unwrap();
        assert!(count <= 3 && used <= 10_000, "{kind:?}: {count} {used}");
        let big = new("n1".into(), 10_001 - used + 1);
        assert!(matches!(s.insert_adapter(&big, &quota).await, Err(StoreError::Quota(_))));
    }
}

#[tokio::test]
async fn principals_are_remembered_for_a_moment_and_forgotten_at_every_change_made_here() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        // Another process on the same database (a second replica) has a cache of its own.
        let replica = Store { pool: s.pool.clone(), kind: s.kind, auth: std::sync::Arc::new(auth::AuthCache::new()) };
        let acme = s.create_tenant(&tenant("acme")).await.unwrap();
        let (key, secret) = s.create_key(Some(&acme.id), &[Scope::Inference]).await.unwrap();
        let found = s.principal(&secret).await.unwrap().expect("a live key");
        let (t, plan) = found.tenant.clone().expect("a tenant's key");
        assert_eq!((found.key.id.as_str(), t.id.as_str(), plan.name.as_str()), (key.id.as_str(), acme.id.as_str(), "standard"), "{kind:?}");
        let (admin, admin_secret) = s.create_key(None, &[Scope::Admin]).await.unwrap();
        let op = s.principal(&admin_secret).await.unwrap().expect("an operator key");
        assert_eq!((op.key.id.as_str(), op.tenant.is_none()), (admin.id.as_str(), true));

        // A change made here is seen at once.
        let weight = |w: f64| TenantPatch { weight: Some(w), ..Default::default() };
        s.update_tenant(&acme.id, &TenantPatch { plan: Some("enterprise".into()), ..weight(3.0) }).await.unwrap();
        let (t, plan) = s.principal(&secret).await.unwrap().unwrap().tenant.clone().unwrap();
        assert_eq!((t.weight, plan.name.as_str()), (3.0, "enterprise"), "{kind:?}");
        // One made elsewhere within the time to live.
        replica.update_tenant(&acme.id, &weight(5.0)).await.unwrap();
        assert_eq!(s.principal(&secret).await.unwrap().unwrap().tenant.as_ref().unwrap().0.weight, 3.0, "{kind:?}: remembered");
        tokio::time::sleep(auth::TTL + std::time::Duration::from_millis(200)).await;
        assert_eq!(s.principal(&secret).await.unwrap().unwrap().tenant.as_ref().unwrap().0.weight, 5.0, "{kind:?}: asked again after the time to live");

        // Revoked and deleted keys stop working at once.
        assert!(s.revoke_key(&key.id).await.unwrap());
        assert_eq!(s.principal(&secret).await.unwrap(), None, "{kind:?}: revoked");
        let (_, other) = s.create_key(Some(&acme.id), &[Scope::Inference]).await.unwrap();
        assert!(s.principal(&other).await.unwrap().is_some());
        s.delete_tenant(&acme.id).await.unwrap();
        assert_eq!(s.principal(&other).await.unwrap(), None, "{kind:?}: a deleted tenant's key");

        // Unknown secrets are not remembered.
        s.auth.entries.run_pending_tasks();
        let before = s.auth.entries.entry_count();
        for i in 0..50 {
            assert_eq!(s.principal(&format!("lpx_made_up_{i}")).await.unwrap(), None);
        }
        s.auth.entries.run_pending_tasks();
        assert_eq!(s.auth.entries.entry_count(), before, "{kind:?}");
    }
}

/// A key in use is read again in the background once its answer is half its time to live old:
/// the lookup that notices answers at once from what it remembers, and a change made by another
/// replica is seen before the time to live ends.
#[tokio::test]
async fn a_key_in_use_is_read_again_in_the_background_before_its_answer_expires() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let replica = Store { pool: s.pool.clone(), kind: s.kind, auth: std::sync::Arc::new(auth::AuthCache::new()) };
        let acme = s.create_tenant(&tenant("acme")).await.unwrap();
        let (_, secret) = s.create_key(Some(&acme.id), &[Scope::Inference]).await.unwrap();
        let weight = |p: &Principal| p.tenant.as_ref().unwrap().0.weight;
        let began = std::time::Instant::now();
        assert_eq!(weight(&s.principal(&secret).await.unwrap().unwrap()), 1.0);
        replica.update_tenant(&acme.id, &TenantPatch { weight: Some(4.0), ..Default::default() }).await.unwrap();
        tokio::time::sleep(auth::TTL * 6 / 10).await;
        // Past half the time to live: still the remembered answer, and a read behind it.
        assert_eq!(weight(&s.principal(&secret).await.unwrap().unwrap()), 1.0, "{kind:?}");
        let deadline = began + auth::TTL * 95 / 100;
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            if weight(&s.principal(&secret).await.unwrap().unwrap()) == 4.0 {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{kind:?}: the change is not seen before the first answer expires");
        }
    }
}

/// Connections are not checked before every statement (a round trip each), but one idle for a
/// second or more is: after the server dropped every connection of a pool, a statement a second
/// later runs on a fresh one instead of failing.
#[tokio::test]
async fn connections_the_server_dropped_are_replaced_after_a_quiet_second() {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = test_urls(dir.path()).await.into_iter().find(|u| u.starts_with("postgres")) else {
        eprintln!("needs PostgreSQL: skipped");
        return;
    };
    let s = Store::connect(&url).await.unwrap();
    s.tenants().await.unwrap();
    let admin = Store::connect(&url).await.unwrap();
    let (dropped,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()) AS t",
    )
    .fetch_one(admin.pool())
    .await
    .unwrap();
    assert!(dropped >= 1, "no connection of the pool was dropped");
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    s.tenants().await.expect("a statement after a quiet second runs on a fresh connection");
}
