//! The adapters API: upload, versions, privacy, delete under load, load/unload, bad uploads.

use super::*;

pub async fn upload<S>(app: &S, key: &str, fields: &[(&str, &[u8])]) -> (StatusCode, Value)
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let (content_type, body) = crate::bench::http::multipart(fields);
    let req = TestRequest::post().uri("/v1/adapters").insert_header(bearer(key)).insert_header(("content-type", content_type)).set_payload(body).to_request();
    let res = call_service(app, req).await;
    let status = res.status();
    let body = read_body(res).await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

pub fn files(dir: &std::path::Path) -> (Vec<u8>, Vec<u8>) {
    (std::fs::read(dir.join("adapter_config.json")).unwrap(), std::fs::read(dir.join("adapter_model.safetensors")).unwrap())
}

fn entries(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| d.count())
}

#[actix_web::test]
async fn upload_version_use_and_privacy() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, acme) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let (_, other) = tenant(&app, &h.admin, json!({"name": "other"})).await;
        let dirs = h.adapters(2, 1);
        let (config, weights) = files(&dirs[0]);
        let (status, v1) = upload(&app, &acme, &[("name", b"support"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(status, StatusCode::CREATED, "{v1}");
        assert_eq!((v1["version"].as_i64(), v1["rank"].as_i64()), (Some(1), Some(8)));
        assert_eq!(v1["targets"], json!(["q_proj", "v_proj"]));
        assert_eq!(v1["bytes"].as_u64().unwrap() as usize, config.len() + weights.len());

        // The adapter changes the output; the base model and the adapter are both listed.
        let ask = |model: &str| json!({"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": true});
        let (s, base) = call(&app, "POST", "/v1/completions", Some(&acme), Some(ask(MODEL))).await;
        assert_eq!(s, StatusCode::OK);
        let (s, tuned) = call(&app, "POST", "/v1/completions", Some(&acme), Some(ask("support"))).await;
        assert_eq!(s, StatusCode::OK, "{tuned}");
        assert_ne!(base["choices"][0]["text"], tuned["choices"][0]["text"], "the adapter must change the greedy output");
        let (_, models) = call(&app, "GET", "/v1/models", Some(&acme), None).await;
        let ids: Vec<&str> = models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
        assert_eq!(ids, [MODEL, "support"]);

        // A second upload under the name is version 2; version 1 stays addressable.
        let (config2, weights2) = files(&dirs[1]);
        let (status, v2) = upload(&app, &acme, &[("name", b"support"), ("config", &config2), ("weights", &weights2)]).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(v2["version"], 2);
        let (_, at1) = call(&app, "POST", "/v1/completions", Some(&acme), Some(ask("support@1"))).await;
        assert_eq!(at1["choices"][0]["text"], tuned["choices"][0]["text"]);
        let (_, latest) = call(&app, "POST", "/v1/completions", Some(&acme), Some(ask("support"))).await;
        assert_ne!(latest["choices"][0]["text"], tuned["choices"][0]["text"]);
        let (_, shown) = call(&app, "GET", "/v1/adapters/support", Some(&acme), None).await;
        assert_eq!(shown["versions"].as_array().unwrap().len(), 2);

        // Another tenant can neither see nor use nor delete it: it reads as unknown.
        let (s, unknown) = call(&app, "POST", "/v1/completions", Some(&other), Some(ask("nope"))).await;
        let (s2, foreign) = call(&app, "POST", "/v1/completions", Some(&other), Some(ask("support"))).await;
        assert_eq!((s, s2), (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND));
        assert_eq!(unknown["error"]["message"].as_str().unwrap().replace("nope", "X"), foreign["error"]["message"].as_str().unwrap().replace("support", "X"));
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&other), Some(ask("support@1"))).await.0, StatusCode::NOT_FOUND);
        assert_eq!(
            call(&app, "POST", "/generate", Some(&other), Some(json!({"inputs": "x", "parameters": {"adapter_id": "support"}}))).await.0,
            StatusCode::NOT_FOUND
        );
        assert_eq!(call(&app, "GET", "/v1/adapters/support", Some(&other), None).await.0, StatusCode::NOT_FOUND);
        assert_eq!(call(&app, "DELETE", "/v1/adapters/support", Some(&other), None).await.0, StatusCode::NOT_FOUND);
        assert_eq!(call(&app, "POST", "/v1/adapters/support/load", Some(&other), None).await.0, StatusCode::NOT_FOUND);
        let (_, theirs) = call(&app, "GET", "/v1/models", Some(&other), None).await;
        assert_eq!(theirs["data"].as_array().unwrap().len(), 1);

        // The operator uploads one of its own and publishes it to everyone.
        let (status, shared) = upload(&app, &h.admin, &[("name", b"summarize"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(status, StatusCode::CREATED, "{shared}");
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&other), Some(ask("summarize"))).await.0, StatusCode::NOT_FOUND);
        let (s, _) = call(&app, "POST", "/admin/adapters/publish", Some(&h.admin), Some(json!({"name": "summarize"}))).await;
        assert_eq!(s, StatusCode::OK);
        let (s, used) = call(&app, "POST", "/v1/completions", Some(&other), Some(ask("summarize"))).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(used["choices"][0]["text"], tuned["choices"][0]["text"], "same weights, same output");
        // A tenant may not delete the operator's published adapter.
        assert_eq!(call(&app, "DELETE", "/v1/adapters/summarize", Some(&other), None).await.0, StatusCode::NOT_FOUND);

        // The operator's list: one row per adapter (its latest version), every owner, named.
        assert_eq!(call(&app, "GET", "/admin/adapters", Some(&acme), None).await.0, StatusCode::FORBIDDEN);
        let (status, all) = call(&app, "GET", "/admin/adapters", Some(&h.admin), None).await;
        assert_eq!(status, StatusCode::OK, "{all}");
        let rows = all["data"].as_array().unwrap();
        assert_eq!(rows.len(), 2, "{all}");
        let support = rows.iter().find(|r| r["name"] == "support").unwrap();
        assert_eq!((support["owner_name"].as_str(), support["version"].as_i64(), support["versions"].as_i64()), (Some("acme"), Some(2), Some(2)));
        assert_eq!(support["bytes_all_versions"].as_i64().unwrap(), v1["bytes"].as_i64().unwrap() + v2["bytes"].as_i64().unwrap());
        let summarize = rows.iter().find(|r| r["name"] == "summarize").unwrap();
        assert!(summarize["owner_name"].is_null() && summarize["owner"].is_null(), "the operator's: {summarize}");
        assert_eq!((summarize["public"].as_bool(), summarize["versions"].as_i64()), (Some(true), Some(1)));

        // Load pins it in the pool; the operator sees where it is and who pins it.
        let acme_id = h.state.store.tenants().await.unwrap().into_iter().find(|t| t.name == "acme").unwrap().id;
        let (s, loaded) = call(&app, "POST", "/v1/adapters/support/load", Some(&acme), None).await;
        assert_eq!(s, StatusCode::OK, "{loaded}");
        assert_eq!(loaded["workers"], json!(["resident"]));
        let support_row = |all: &Value| all["data"].as_array().unwrap().iter().find(|r| r["name"] == "support").unwrap().clone();
        let (_, all) = call(&app, "GET", "/admin/adapters", Some(&h.admin), None).await;
        let row = support_row(&all);
        assert_eq!(row["residency"], json!([{"worker": 0, "tier": "pool"}]), "{row}");
        assert_eq!(row["pinned_by"], json!([{"tenant_id": acme_id, "tenant": "acme", "version": 2}]));
        // The operator pins it too, and may let the tenant's pin go; its own stays.
        assert_eq!(
            call(&app, "POST", "/admin/adapters/pin", Some(&acme), Some(json!({"tenant_id": acme_id, "name": "support"}))).await.0,
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            call(&app, "POST", "/admin/adapters/pin", Some(&h.admin), Some(json!({"name": "support"}))).await.0,
            StatusCode::NOT_FOUND,
            "not the operator's"
        );
        let (s, pinned) = call(&app, "POST", "/admin/adapters/pin", Some(&h.admin), Some(json!({"tenant_id": acme_id, "name": "support"}))).await;
        assert_eq!((s, &pinned["held"], pinned["version"].as_i64()), (StatusCode::OK, &json!(true), Some(2)), "{pinned}");
        let (_, all) = call(&app, "GET", "/admin/adapters", Some(&h.admin), None).await;
        assert_eq!(
            support_row(&all)["pinned_by"],
            json!([{"tenant_id": null, "tenant": null, "version": 2}, {"tenant_id": acme_id, "tenant": "acme", "version": 2}])
        );
        let unpin = |holder: Option<&str>| json!({"tenant_id": acme_id, "name": "support", "holder": holder});
        let (s, released) = call(&app, "POST", "/admin/adapters/unpin", Some(&h.admin), Some(unpin(Some(&acme_id)))).await;
        assert_eq!((s, &released["released"]), (StatusCode::OK, &json!(true)), "{released}");
        let (s, unloaded) = call(&app, "POST", "/v1/adapters/support/unload", Some(&acme), None).await;
        assert_eq!((s, &unloaded["released"]), (StatusCode::OK, &json!(false)), "the operator already let acme's pin go");
        let (_, all) = call(&app, "GET", "/admin/adapters", Some(&h.admin), None).await;
        assert_eq!(support_row(&all)["pinned_by"], json!([{"tenant_id": null, "tenant": null, "version": 2}]));
        assert_eq!(call(&app, "POST", "/admin/adapters/unpin", Some(&h.admin), Some(unpin(None))).await.1["released"], true);
        assert_eq!(call(&app, "POST", "/admin/adapters/unpin", Some(&h.admin), Some(unpin(None))).await.1["released"], false);
        let (_, all) = call(&app, "GET", "/admin/adapters", Some(&h.admin), None).await;
        assert_eq!(support_row(&all)["pinned_by"], json!([]));
        assert_eq!(
            call(&app, "POST", "/admin/adapters/unpin", Some(&h.admin), Some(json!({"tenant_id": acme_id, "name": "nope"}))).await.0,
            StatusCode::NOT_FOUND
        );
        // Pinned again by the tenant, let go by the tenant.
        assert_eq!(call(&app, "POST", "/v1/adapters/support/load", Some(&acme), None).await.0, StatusCode::OK);
        let (s, unloaded) = call(&app, "POST", "/v1/adapters/support/unload", Some(&acme), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(unloaded["released"], true);

        // Delete removes every version and its files.
        let (s, deleted) = call(&app, "DELETE", "/v1/adapters/support", Some(&acme), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(deleted["deleted_versions"], json!([1, 2]));
        assert_eq!(call(&app, "POST", "/v1/completions", Some(&acme), Some(ask("support"))).await.0, StatusCode::NOT_FOUND);
        assert_eq!(entries(&h.dir.path().join("adapters")), 1, "only the operator's adapter is left on disk");

        // Deleting a tenant deletes its adapters too.
        let other_id = h.state.store.tenants().await.unwrap().into_iter().find(|t| t.name == "other").unwrap().id;
        let (status, _) = upload(&app, &other, &[("name", b"theirs"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(entries(&h.dir.path().join("adapters")), 2);
        assert_eq!(call(&app, "DELETE", &format!("/admin/tenants/{other_id}"), Some(&h.admin), None).await.0, StatusCode::NO_CONTENT);
        assert_eq!(entries(&h.dir.path().join("adapters")), 1);
        assert_eq!(call(&app, "GET", "/v1/models", Some(&other), None).await.0, StatusCode::UNAUTHORIZED, "its keys are revoked");
    }
}

#[actix_web::test]
async fn a_deleted_adapter_finishes_the_requests_already_running() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (_, key) = tenant(&app, &h.admin, json!({"name": "acme"})).await;
        let (config, weights) = files(&h.adapters(1, 3)[0]);
        let (s, _) = upload(&app, &key, &[("name", b"doomed"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(s, StatusCode::CREATED);
        let long = json!({"model": "doomed", "prompt": "x", "max_tokens": 300, "ignore_eos": true, "temperature": 0, "stream": true,
            "stream_options": {"include_usage": true}});
        let open = call_service(&app, TestRequest::post().uri("/v1/completions").insert_header(bearer(&key)).set_json(&long).to_request()).await;
        assert_eq!(open.status(), StatusCode::OK);
        let (s, _) = call(&app, "DELETE", "/v1/adapters/doomed", Some(&key), None).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h.state.blobs.pending(), 1, "the files wait for the running request");
        assert_eq!(entries(&h.dir.path().join("adapters")), 1);
        let events = sse_events(&read_body(open).await);
        let usage = &events[events.len() - 2]["usage"];
        assert_eq!(usage["completion_tokens"], 300, "the running request finished on its version: {usage}");
        assert_eq!(events.last().unwrap(), "[DONE]");
        for _ in 0..400 {
            if h.state.blobs.pending() == 0 && entries(&h.dir.path().join("adapters")) == 0 {
                break;
            }
            actix_web::rt::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(h.state.blobs.pending(), 0);
        assert_eq!(entries(&h.dir.path().join("adapters")), 0, "then its files are gone");
    }
}

#[actix_web::test]
async fn bad_uploads_are_refused_and_leave_nothing_behind() {
    for h in Harness::each().await {
        let app = app!(h.state);
        let (tenant_id, key) = tenant(&app, &h.admin, json!({"name": "acme", "limits": {"max_adapters": 1}})).await;
        let (config, weights) = files(&h.adapters(1, 5)[0]);
        let truncated = &weights[..weights.len() / 2];
        // A config that selects projections the weights do not have (k instead of q).
        let wrong_targets = String::from_utf8(config.clone()).unwrap().replace("\"q_proj\"", "\"k_proj\"");
        assert_ne!(wrong_targets.as_bytes(), &config[..]);
        let big = vec![0u8; (h.state.settings.max_upload_bytes + 1) as usize];
        type Fields<'a> = Vec<(&'a str, &'a [u8])>;
        let cases: Vec<(Fields<'_>, StatusCode, &str)> = vec![
            (vec![("config", &config), ("weights", &weights)], StatusCode::BAD_REQUEST, "no `name`"),
            (vec![("name", b"ok"), ("weights", &weights)], StatusCode::BAD_REQUEST, "no `config`"),
            (vec![("name", b"ok"), ("config", &config)], StatusCode::BAD_REQUEST, "no `weights`"),
            (vec![("name", b"../etc"), ("config", &config), ("weights", &weights)], StatusCode::BAD_REQUEST, "adapter name"),
            (vec![("name", b"a/b"), ("config", &config), ("weights", &weights)], StatusCode::BAD_REQUEST, "adapter name"),
            (vec![("name", MODEL.as_bytes()), ("config", &config), ("weights", &weights)], StatusCode::CONFLICT, "base model"),
            (vec![("name", b"ok"), ("config", &config), ("weights", b"this is not safetensors")], StatusCode::BAD_REQUEST, "does not fit"),
            (vec![("name", b"ok"), ("config", &config), ("weights", truncated)], StatusCode::BAD_REQUEST, "does not fit"),
            (vec![("name", b"ok"), ("config", b"{not json"), ("weights", &weights)], StatusCode::BAD_REQUEST, "does not fit"),
            (vec![("name", b"ok"), ("config", wrong_targets.as_bytes()), ("weights", &weights)], StatusCode::BAD_REQUEST, "does not fit"),
            (vec![("name", b"ok"), ("config", &config), ("weights", &big)], StatusCode::PAYLOAD_TOO_LARGE, "larger than"),
            (vec![("name", b"ok"), ("config", &config), ("weights", &weights), ("extra", b"x")], StatusCode::BAD_REQUEST, "unknown form field"),
        ];
        for (fields, status, needle) in cases {
            let names: Vec<&str> = fields.iter().map(|f| f.0).collect();
            let (got, e) = upload(&app, &key, &fields).await;
            assert_eq!(got, status, "{names:?}: {e}");
            let message = e["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains(needle), "{names:?}: {message:?} lacks {needle:?}");
            assert!(!message.contains(&h.dir.path().display().to_string()), "server paths stay private: {message}");
        }
        // Not multipart at all.
        let (got, _) = call(&app, "POST", "/v1/adapters", Some(&key), Some(json!({"name": "x"}))).await;
        assert_eq!(got, StatusCode::BAD_REQUEST);
        // Nothing was recorded or kept.
        assert!(h.state.store.visible_adapters(&tenant_id).await.unwrap().is_empty());
        assert_eq!(entries(&h.dir.path().join("adapters")), 0);
        assert_eq!(entries(&h.dir.path().join("uploads")), 0);
        // The limit on adapters: one is fine, a second (new name) is refused with 429.
        assert_eq!(upload(&app, &key, &[("name", b"ok"), ("config", &config), ("weights", &weights)]).await.0, StatusCode::CREATED);
        let (got, e) = upload(&app, &key, &[("name", b"ok2"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(got, StatusCode::TOO_MANY_REQUESTS, "{e}");
        // A new version of the same adapter is not a new adapter.
        assert_eq!(upload(&app, &key, &[("name", b"ok"), ("config", &config), ("weights", &weights)]).await.0, StatusCode::CREATED);
        assert_eq!(entries(&h.dir.path().join("adapters")), 2);
        // The storage limit counts every version's bytes.
        let room = (config.len() + weights.len()) as i64 * 3 / 2;
        let (_, small) = tenant(&app, &h.admin, json!({"name": "small", "limits": {"max_adapter_bytes": room}})).await;
        assert_eq!(upload(&app, &small, &[("name", b"a"), ("config", &config), ("weights", &weights)]).await.0, StatusCode::CREATED);
        let (got, e) = upload(&app, &small, &[("name", b"a"), ("config", &config), ("weights", &weights)]).await;
        assert_eq!(got, StatusCode::TOO_MANY_REQUESTS, "{e}");
        assert!(e["error"]["message"].as_str().unwrap().contains("storage limit"), "{e}");
        assert_eq!(entries(&h.dir.path().join("adapters")), 3);
        assert_eq!(entries(&h.dir.path().join("uploads")), 0);
    }
}
