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
        let patched =
            s.update_tenant(&acme.id, &TenantPatch { weight: Some(2.0), plan: Some("enterprise".into()), limits: Some(limits.clone()) }).await.unwrap();
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
        assert_eq!(s.delete_tenant(&acme.id).await.unwrap(), Some(Vec::new()));
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
        let new = |owner: &str, name: &str| NewAdapter {
            owner: owner.into(),
            name: name.into(),
            rank: 8,
            targets: "q_proj,v_proj".into(),
            bytes: 1000,
            content_hash: "ab".repeat(32),
            blob: format!("adapters/{owner}/{name}"),
        };
        assert_eq!(s.insert_adapter(&new(&a.id, "support")).await.unwrap().version, 1);
        let v2 = s.insert_adapter(&new(&a.id, "support")).await.unwrap();
        assert_eq!((v2.version, v2.label()), (2, "support@2".into()));
        assert_eq!(s.visible_adapter(&a.id, "support").await.unwrap(), Some(v2.clone()));
        assert_eq!(s.visible_adapter(&b.id, "support").await.unwrap(), None, "another tenant's private adapter is unknown");
        assert!(s.visible_adapters(&b.id).await.unwrap().is_empty());
        assert_eq!(s.visible_adapters(&a.id).await.unwrap(), std::slice::from_ref(&v2), "only the latest version is listed");
        assert_eq!(s.adapter_footprint(&a.id).await.unwrap(), (1, 2000), "one adapter, two versions");
        for bad in ["../etc", "a/b", "", ".hidden", &"x".repeat(65)] {
            assert!(matches!(s.insert_adapter(&new(&a.id, bad)).await, Err(StoreError::Invalid { .. })), "{bad:?}");
        }
        // The operator publishes one of its own to everyone.
        let shared = s.insert_adapter(&new("", "summarize")).await.unwrap();
        assert_eq!(s.visible_adapter(&b.id, "summarize").await.unwrap(), None);
        assert!(s.publish_adapter("", "summarize", true).await.unwrap());
        assert_eq!(s.visible_adapter(&b.id, "summarize").await.unwrap().map(|r| r.id), Some(shared.id.clone()));
        let shared2 = s.insert_adapter(&new("", "summarize")).await.unwrap();
        assert_eq!(shared2.public, 1, "a new version of a published adapter stays published");
        assert_eq!(s.visible_adapter_version(&b.id, "summarize", 1).await.unwrap().map(|r| r.id), Some(shared.id));
        assert_eq!(s.visible_adapter_version(&a.id, "support", 1).await.unwrap().map(|r| r.version), Some(1));
        assert_eq!(s.visible_adapter_version(&b.id, "support", 1).await.unwrap(), None, "nor any version of it");
        // A tenant's own adapter of the same name comes first.
        let own = s.insert_adapter(&new(&b.id, "summarize")).await.unwrap();
        assert_eq!(s.visible_adapter(&b.id, "summarize").await.unwrap().map(|r| r.id), Some(own.id));
        assert_eq!(s.delete_adapter(&a.id, "support").await.unwrap().len(), 2);
        assert!(s.delete_adapter(&a.id, "support").await.unwrap().is_empty());
        assert_eq!(s.visible_adapter(&a.id, "support").await.unwrap(), None);
        assert_eq!(s.insert_adapter(&new(&a.id, "support")).await.unwrap().version, 3, "versions are never reused");
    }
}

#[tokio::test]
async fn the_ledger_commits_in_groups_and_the_report_adds_up() {
    for (s, _dir) in stores().await {
        let kind = s.kind();
        let a = s.create_tenant(&tenant("acme")).await.unwrap();
        let b = s.create_tenant(&NewTenant { plan: "free".into(), ..tenant("globex") }).await.unwrap();
        let ledger = Ledger::start(s.clone());
        let day0 = 20_000 * DAY;
        let mut tasks = Vec::new();
        for i in 0..300i64 {
            let ledger = ledger.clone();
            let tenant = if i % 3 == 0 { b.id.clone() } else { a.id.clone() };
            let record = UsageRecord {
                id: format!("req-{i}"),
                tenant_id: tenant,
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
        assert_eq!(r.tenants[&b.id].cost, 0.0, "the free plan");
        let of_a = |f: fn(&UsageRecord) -> i64| sent.iter().filter(|u| u.tenant_id == a.id).map(f).sum::<i64>();
        let want = ((of_a(|u| u.prompt_tokens) - of_a(|u| u.cached_prompt_tokens)) as f64 * 0.5
            + of_a(|u| u.cached_prompt_tokens) as f64 * 0.125
            + of_a(|u| u.completion_tokens) as f64 * 1.5)
            / 1e6;
        assert!((r.tenants[&a.id].cost - want).abs() < 1e-9, "{} vs {want}", r.tenants[&a.id].cost);
        let one_day = s.billing_report(day0, day0 + DAY, Some(&a.id)).await.unwrap();
        assert_eq!(one_day.totals.requests, sent.iter().filter(|u| u.tenant_id == a.id && u.finished_at < day0 + DAY).count() as i64);
        let csv = r.to_csv();
        assert_eq!(csv.lines().count(), 1 + 8 + 2 + 1);
        assert!(csv.lines().last().unwrap().starts_with(&format!("*,,,*,*,300,{}", r.totals.prompt_tokens)));
        assert!(matches!(s.billing_report(10, 5, None).await, Err(StoreError::Invalid { .. })));
    }
}

const DAY: i64 = 86_400_000;
