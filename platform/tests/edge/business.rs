//! The operator's business: plans and prices set through the API, a tenant's own prices, ledger
//! rows that keep the prices they were admitted at, a tenant's view of itself and the keys it
//! mints and revokes, the audit log, and a deleted tenant's name free again.

use serde_json::{Value, json};

use super::common::*;

/// The prices of the ledger's rows of `tenant`, oldest first: (prompt, completion) price.
fn row_prices(env: &Env, tenant: &str) -> Vec<(String, String)> {
    env.query(&format!("SELECT prompt_price, completion_price FROM usage WHERE tenant_id = '{tenant}' ORDER BY started_at, id"))
        .into_iter()
        .map(|r| (r[0].clone(), r[1].clone()))
        .collect()
}

#[test]
fn plans_prices_keys_and_the_audit_log() {
    for db in databases() {
        let env = Env::start(&db, &["--max-keys-per-tenant", "3"]);
        let mut cases = Cases::default();
        let plan = json!({"name": "startup", "prompt_price": 300000, "cached_prompt_price": 75000, "completion_price": 900000, "batch_percent": 40});
        cases.check("a plan is created", &env.admin("POST", "/admin/plans", Some(plan.clone())), 201, "\"batch_percent\":40");
        cases.check("the same name again", &env.admin("POST", "/admin/plans", Some(plan)), 409, "startup");
        let bad = json!({"name": "x", "prompt_price": -1, "cached_prompt_price": 0, "completion_price": 0});
        cases.check("a negative price", &env.admin("POST", "/admin/plans", Some(bad)), 400, "prompt_price");
        let dear = json!({"name": "y", "prompt_price": 2_000_000_000_000i64, "cached_prompt_price": 0, "completion_price": 0});
        cases.check("a price past the bound", &env.admin("POST", "/admin/plans", Some(dear)), 400, "micro-dollars");
        cases.check("a batch percent past 100", &env.admin("PATCH", "/admin/plans/startup", Some(json!({"batch_percent": 101}))), 400, "0 to 100");
        cases.check("patching an unknown plan", &env.admin("PATCH", "/admin/plans/nope", Some(json!({"prompt_price": 1}))), 404, "plan");
        let plans = env.admin("GET", "/admin/plans", None);
        cases.check("the plans are listed with their batch prices", &plans, 200, "\"cached_prompt_price\":30000");

        let t = env.admin("POST", "/admin/tenants", Some(json!({"name": "acme", "plan": "startup"})));
        cases.check("a tenant on the new plan", &t, 201, "\"plan\":\"startup\"");
        let acme = t.json()["id"].as_str().unwrap_or_default().to_string();
        let key = env.admin("POST", &format!("/admin/tenants/{acme}/keys"), None).json()["key"].as_str().unwrap_or_default().to_string();
        cases.check("served at the plan's prices", &env.complete(&key, MODEL, 1), 200, "choices");
        cases.check("the plan's price changes", &env.admin("PATCH", "/admin/plans/startup", Some(json!({"completion_price": 1_000_000}))), 200, "1000000");
        cases.check("served at the new price", &env.complete(&key, MODEL, 1), 200, "choices");
        let own = json!({"completion_price": 800_000, "batch_percent": 25});
        let set = env.admin("PUT", &format!("/admin/tenants/{acme}/prices"), Some(own));
        cases.check("the tenant's own prices", &set, 200, "\"effective\"");
        cases.ok("its effective completion price is its own", set.json()["effective"]["completion_price"] == 800_000, set.text());
        cases.ok("its prompt price is the plan's", set.json()["effective"]["prompt_price"] == 300_000, set.text());
        cases.check("served at its own price", &env.complete(&key, MODEL, 1), 200, "choices");
        let me = env.call(Some(&key), "GET", "/v1/me", None);
        cases.check("the tenant sees its plan", &me, 200, "\"plan\":\"startup\"");
        cases.ok(
            "and the prices it pays",
            me.json()["prices"]["completion_price"] == 800_000 && me.json()["prices"]["batch_prices"]["completion_price"] == 200_000,
            me.text(),
        );
        cases.ok("and its keys' quota", me.json()["quotas"]["keys"] == json!({"used": 1, "limit": 3, "left": 2}), me.text());
        cases.check(
            "cleared: the plan's prices again",
            &env.admin("PUT", &format!("/admin/tenants/{acme}/prices"), Some(json!({}))),
            200,
            "\"override\":{\"prompt_price\":null",
        );
        cases.check("served at the plan's price", &env.complete(&key, MODEL, 1), 200, "choices");
        let rows = row_prices(&env, &acme);
        let want: Vec<(String, String)> = [("300000", "900000"), ("300000", "1000000"), ("300000", "800000"), ("300000", "1000000")]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        cases.ok("each ledger row kept the prices it was admitted at", rows == want, format!("{rows:?}"));

        // Keys the tenant mints itself, within the cap of 3.
        let mint = |k: &str, body: Option<Value>| env.call(Some(k), "POST", "/v1/keys", body);
        let second = mint(&key, Some(json!({"scopes": ["inference"]})));
        cases.check("the tenant mints a key", &second, 201, "\"scopes\":\"inference\"");
        let narrow = second.json()["key"].as_str().unwrap_or_default().to_string();
        let second_id = second.json()["id"].as_str().unwrap_or_default().to_string();
        cases.check("a narrower key cannot give more", &mint(&narrow, Some(json!({"scopes": ["adapters"]}))), 400, "cannot give the adapters scope");
        cases.check("nor an operator's scope", &mint(&key, Some(json!({"scopes": ["admin"]}))), 400, "");
        cases.check("a third key", &mint(&narrow, None), 201, "lpx_");
        cases.check("a fourth is past the cap", &mint(&key, None), 429, "key limit reached");
        let list = env.call(Some(&key), "GET", "/v1/keys", None);
        cases.ok(
            "the tenant lists its three keys, no secret",
            list.json()["data"].as_array().map(Vec::len) == Some(3) && !list.text().contains(&narrow),
            list.text(),
        );
        let (_, other) = env.tenant("other", json!({}));
        cases.check("another tenant cannot revoke it", &env.call(Some(&other), "DELETE", &format!("/v1/keys/{second_id}"), None), 404, "key");
        cases.check("the tenant revokes it", &env.call(Some(&key), "DELETE", &format!("/v1/keys/{second_id}"), None), 204, "");
        cases.check("the revoked key is refused", &env.call(Some(&narrow), "GET", "/v1/me", None), 401, "invalid or revoked");
        cases.check("room for a key again", &mint(&key, None), 201, "lpx_");
        cases.check("the operator's key has no tenant to view", &env.admin("GET", "/v1/me", None), 403, "");
        cases.check("a tenant cannot read the audit log", &env.call(Some(&key), "GET", "/admin/audit", None), 403, "insufficient_scope");

        // A deleted tenant's name is free again; its bills name it with its id.
        let (gone, gone_key) = env.tenant("gone", json!({}));
        cases.check("the doomed tenant is served", &env.complete(&gone_key, MODEL, 1), 200, "choices");
        cases.check("the tenant is deleted", &env.admin("DELETE", &format!("/admin/tenants/{gone}"), None), 204, "");
        cases.check("its name is taken again", &env.admin("POST", "/admin/tenants", Some(json!({"name": "gone"}))), 201, "\"name\":\"gone\"");
        let report = env.admin("GET", "/admin/billing/report", None).text();
        cases.ok("its bill names the deleted tenant with its id", report.contains(&format!("gone (deleted {gone})")), &report);

        // The audit log: who, what, when.
        let log = env.admin("GET", "/admin/audit?limit=1000", None);
        cases.check("the audit log", &log, 200, "\"data\"");
        let entries = log.json()["data"].as_array().cloned().unwrap_or_default();
        let has = |action: &str, actor: Option<&str>| entries.iter().any(|e| e["action"] == action && e["actor_name"].as_str() == actor);
        for action in ["plan.create", "plan.update", "tenant.create", "tenant.prices", "tenant.delete"] {
            cases.ok(&format!("the operator's {action} is logged"), has(action, Some("operator")), log.text().chars().take(600).collect::<String>());
        }
        cases.ok("acme's own key.create is logged as acme's", has("key.create", Some("acme")), "");
        cases.ok("acme's own key.revoke is logged as acme's", has("key.revoke", Some("acme")), "");
        cases.ok("every entry has a time and a key", entries.iter().all(|e| e["at"].as_i64().is_some_and(|t| t > 0) && e["key_id"].is_string()), "");
        cases.ok("newest first", entries.windows(2).all(|w| w[0]["at"].as_i64() >= w[1]["at"].as_i64()), "");
        let mine = env.admin("GET", &format!("/admin/audit?tenant_id={acme}"), None).json();
        let about_acme = mine["data"].as_array().cloned().unwrap_or_default();
        cases.ok(
            "filtered to one tenant",
            !about_acme.is_empty() && about_acme.iter().all(|e| e["tenant_id"] == acme.as_str() || e["actor"] == acme.as_str()),
            format!("{mine}"),
        );
        cases.check("a limit past 1000", &env.admin("GET", "/admin/audit?limit=5000", None), 400, "limit");
        cases.finish(&format!("business on {}", env.kind()));
    }
}
