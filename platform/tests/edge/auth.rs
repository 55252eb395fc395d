//! Keys and scopes on every route, and one tenant's adapters invisible to another by every name
//! form. Nothing answered without a key names a tenant or a private adapter.

use loraplex::api::openapi::ROUTES;
use serde_json::json;

use super::common::*;

#[test]
fn every_route_checks_its_key_and_scope_and_tenants_never_see_each_other() {
    let mut total = 0;
    for db in databases() {
        let env = Env::start(&db, &[]);
        let mut cases = Cases::default();
        let (a_id, a) = env.tenant("acme", json!({}));
        let (b_id, b) = env.tenant("bravo", json!({}));
        let files = adapter_files(2, 5);
        assert_eq!(env.upload(&a, "secret", &files[0].0, &files[0].1).status, 201);
        assert_eq!(env.upload(ADMIN, "shared", &files[1].0, &files[1].1).status, 201);
        assert_eq!(env.admin("POST", "/admin/adapters/publish", Some(json!({"name": "shared"}))).status, 200);
        let narrow =
            env.admin("POST", &format!("/admin/tenants/{a_id}/keys"), Some(json!({"scopes": ["inference"]}))).json()["key"].as_str().unwrap().to_string();
        let revoked = env.admin("POST", &format!("/admin/tenants/{a_id}/keys"), None).json();
        assert_eq!(env.admin("DELETE", &format!("/admin/keys/{}", revoked["id"].as_str().unwrap()), None).status, 204);
        let revoked = revoked["key"].as_str().unwrap().to_string();
        let (gone_id, gone) = env.tenant("gone", json!({}));
        assert_eq!(env.admin("DELETE", &format!("/admin/tenants/{gone_id}"), None).status, 204);
        let metrics = env.admin("POST", "/admin/keys", Some(json!({"scopes": ["metrics"]}))).json()["key"].as_str().unwrap().to_string();

        // Every documented route, with every kind of wrong key.
        for &(method, path, _, scope) in ROUTES {
            let uri = path.replace("{name}", "secret").replace("{id}", &a_id).replace("{path}", "index.html");
            let m = method.to_uppercase();
            let name = |who: &str| format!("{}: {m} {path} with {who}", env.kind());
            if scope == "none" {
                // The console's page and its redirects are public: it signs in with a key itself.
                let expected = if matches!(path, "/" | "/ui") { 302 } else { 200 };
                cases.check(&name("no key"), &env.call(None, &m, &uri, None), expected, "");
                continue;
            }
            // LoRAX's routes answer in LoRAX's shape: `error_type` instead of OpenAI's codes.
            let lorax = path.starts_with("/generate");
            let (unauthorized, forbidden) = if lorax {
                ("\"error_type\":\"authentication\"", "scope\",\"error_type\":\"authentication\"")
            } else {
                ("\"authentication_error\"", "insufficient_scope")
            };
            for (who, key) in [
                ("no key", None),
                ("an unknown key", Some("lpx_0000")),
                ("a revoked key", Some(revoked.as_str())),
                ("a deleted tenant's key", Some(gone.as_str())),
            ] {
                let res = env.call(key, &m, &uri, None);
                cases.check(&name(who), &res, 401, unauthorized);
                let text = res.text();
                cases.ok(&name(&format!("{who}: names nobody")), !["acme", "bravo", "secret", &a_id, &b_id].iter().any(|n| text.contains(n)), &text);
            }
            match scope {
                "admin" => cases.check(&name("a tenant's key"), &env.call(Some(&a), &m, &uri, None), 403, forbidden),
                "metrics" => {
                    cases.check(&name("a tenant's key"), &env.call(Some(&a), &m, &uri, None), 403, forbidden);
                    cases.check(&name("a metrics key"), &env.call(Some(&metrics), &m, &uri, None), 200, "vllm:num_requests_waiting");
                }
                "adapters" => cases.check(&name("an inference-only key"), &env.call(Some(&narrow), &m, &uri, None), 403, forbidden),
                "inference" => {
                    let res = env.call(Some(ADMIN), &m, &uri, Some(json!({"model": MODEL, "prompt": "x", "inputs": "x"})));
                    cases.check(&name("the operator's key"), &res, 403, forbidden);
                }
                other => panic!("unknown scope {other}"),
            }
            if scope != "metrics" && scope != "admin" {
                cases.check(&name("a metrics key"), &env.call(Some(&metrics), &m, &uri, None), 403, forbidden);
            }
        }
        for header in ["Bearer", "Bearer ", "Basic YWRtaW46YWRtaW4=", "bearer lpx_x", "Token abc", "Bearer  \t", "Bearer \u{00e9}\u{00e9}"] {
            let req = format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: {header}\r\n\r\n");
            cases.check(&format!("authorization {header:?}"), &env.http.raw(req.as_bytes()).unwrap(), 401, "authentication_error");
        }
        let twice = format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer lpx_nope\r\nAuthorization: Bearer {a}\r\n\r\n");
        cases.check("two authorization headers: the first counts", &env.http.raw(twice.as_bytes()).unwrap(), 401, "authentication_error");
        // A tenant's key can never be given the operator's scopes.
        for scope in ["admin", "metrics"] {
            let res = env.admin("POST", &format!("/admin/tenants/{a_id}/keys"), Some(json!({"scopes": [scope]})));
            cases.check(&format!("tenant key with {scope}"), &res, 400, "cannot have");
        }
        cases.check("operator key with a tenant scope", &env.admin("POST", "/admin/keys", Some(json!({"scopes": ["inference"]}))), 400, "belongs to a tenant");

        // Another tenant's private adapter reads as unknown, by every name form and route.
        let unknown = env.complete(&b, "nosuch", 2).json()["error"]["message"].as_str().unwrap().replace("nosuch", "NAME");
        for model in
            ["secret", "secret@1", "secret@01", "SECRET", "secret ", "./secret", "../acme/secret", "acme/secret", "secret@0", "secret@99999999999999999999"]
        {
            let res = env.complete(&b, model, 2);
            cases.check(&format!("bravo: completion with {model:?}"), &res, 404, "not_found");
            let msg = res.json()["error"]["message"].as_str().unwrap_or_default().replace(model, "NAME");
            cases.ok(&format!("bravo: {model:?} reads like an unknown name"), msg == unknown, &msg);
        }
        let chat = json!({"model": "secret", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        cases.check("bravo: chat with secret", &env.call(Some(&b), "POST", "/v1/chat/completions", Some(chat)), 404, "not_found");
        let lorax = json!({"inputs": "hi", "parameters": {"adapter_id": "secret", "max_new_tokens": 2}});
        cases.check("bravo: lorax generate with secret", &env.call(Some(&b), "POST", "/generate", Some(lorax.clone())), 404, "not_found");
        cases.check("bravo: lorax stream with secret", &env.call(Some(&b), "POST", "/generate_stream", Some(lorax)), 404, "not_found");
        for (m, path) in
            [("GET", "/v1/adapters/secret"), ("DELETE", "/v1/adapters/secret"), ("POST", "/v1/adapters/secret/load"), ("POST", "/v1/adapters/secret/unload")]
        {
            cases.check(&format!("bravo: {m} {path}"), &env.call(Some(&b), m, path, None), 404, "adapter `secret` not found");
        }
        let list = env.call(Some(&b), "GET", "/v1/adapters", None).text();
        cases.ok("bravo's list has the published adapter and not acme's", list.contains("\"shared\"") && !list.contains("secret"), &list);
        let models = env.call(Some(&b), "GET", "/v1/models", None).text();
        cases.ok("bravo's models have no secret", !models.contains("secret") && models.contains("shared"), &models);
        // bravo's attempts changed nothing: acme still has and uses its adapter.
        cases.check("acme still uses secret", &env.complete(&a, "secret", 2), 200, "choices");
        cases.check("bravo uses the published adapter", &env.complete(&b, "shared", 2), 200, "choices");
        // Usage is one's own.
        let usage = env.call(Some(&b), "GET", "/v1/usage", None).json();
        let rows = usage["data"].as_array().cloned().unwrap_or_default();
        cases.ok("bravo's usage is bravo's", usage["tenant_id"] == b_id.as_str() && rows.iter().all(|r| r["tenant_id"] == b_id.as_str()), &usage);
        cases.ok("bravo's usage does not show acme's adapter", !usage.to_string().contains("secret"), &usage);
        total += cases.finish(&format!("auth and isolation on {}", env.kind()));
    }
    assert!(total >= 100, "{total}");
}
