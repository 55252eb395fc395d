//! The HTTP API in process: a synthesized tiny model on the CPU runtime, a SQLite database (and
//! PostgreSQL where the tests say so), requests through the real routes.

mod adapters;
mod batch;
mod billing;
mod inference;
mod structured;

use std::path::PathBuf;
use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::test::{TestRequest, call_service, init_service, read_body, read_body_json};
use actix_web::{App, web};
use loraplex_kernels::cpu::CpuBackend;
use serde_json::{Value, json};

use super::*;
use crate::engine::EngineConfig;
use crate::runtime::Runtime;
use crate::synth::{AdapterSynthOptions, AdapterTargets, FileDType, Preset, SynthOptions};

pub const MODEL: &str = "loraplex-tiny";

/// A server's state over a fresh tiny model, runtime and database.
pub struct Harness {
    pub state: AppState,
    /// The runtime behind `state.serving`, for failure drills.
    pub runtime: Arc<Runtime<CpuBackend>>,
    pub admin: String,
    pub dir: tempfile::TempDir,
}

/// The settings tests run with: the server's defaults, small uploads.
pub fn settings() -> ApiSettings {
    ApiSettings { max_upload_bytes: 1 << 20, max_running: 64, ..ApiSettings::new("test-instance") }
}

impl Harness {
    /// One harness per database the tests run on: SQLite, and PostgreSQL when
    /// `LORAPLEX_TEST_POSTGRES` names a server.
    pub async fn each() -> Vec<Self> {
        let scratch = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        for url in crate::store::test_urls(scratch.path()).await {
            // The SQLite file of `test_urls` lives in `scratch`; each harness gets its own.
            let dir = tempfile::tempdir().unwrap();
            let url = if url.starts_with("sqlite:") { format!("sqlite://{}", dir.path().join("db.sqlite").display()) } else { url };
            out.push(Self::on(dir, &url, settings()).await);
        }
        out
    }

    /// A harness on a SQLite file of its own.
    pub async fn sqlite(settings: ApiSettings) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("db.sqlite").display());
        Self::on(dir, &url, settings).await
    }

    pub async fn on(dir: tempfile::TempDir, url: &str, settings: ApiSettings) -> Self {
        let model_dir = dir.path().join("model");
        crate::synth::synthesize_model(&SynthOptions {
            out: model_dir.clone(),
            preset: Preset::Tiny,
            seed: 0,
            dtype: crate::synth::FileDType::F32,
            kv_heads: None,
        })
        .unwrap();
        let model = Arc::new(crate::model::load(Arc::new(CpuBackend::new()), &model_dir).unwrap());
        let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir).unwrap());
        let config =
            EngineConfig { pool_bytes: 32 << 20, max_running: settings.max_running, max_batch_tokens: 512, pinned_percent: 25, ..EngineConfig::default() };
        let runtime = Arc::new(Runtime::start(vec![model], tokenizer.clone(), config).unwrap());
        let store = Store::connect(url).await.unwrap();
        let (_, admin) = store.create_key(None, &[Scope::Admin]).await.unwrap();
        let state = AppState::new(store, runtime.clone(), tokenizer, MODEL, dir.path(), settings);
        Self { state, runtime, admin, dir }
    }

    /// Adapters for the tiny model, written under the test's directory.
    pub fn adapters(&self, count: usize, seed: u64) -> Vec<PathBuf> {
        crate::synth::synthesize_adapters(&AdapterSynthOptions {
            out: self.dir.path().join(format!("synth-adapters-{seed}")),
            dims: Preset::Tiny.dims(),
            count,
            ranks: vec![8],
            targets: AdapterTargets::Qv,
            seed,
            dtype: FileDType::F32,
        })
        .unwrap()
    }
}

macro_rules! app {
    ($state:expr) => {
        init_service(App::new().app_data(web::Data::new($state.clone())).configure(routes)).await
    };
}
pub(crate) use app;

pub fn bearer(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

/// Creates a tenant and a key for it; returns (tenant id, key).
pub async fn tenant<S>(app: &S, admin: &str, body: Value) -> (String, String)
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let res = call_service(app, TestRequest::post().uri("/admin/tenants").insert_header(bearer(admin)).set_json(body).to_request()).await;
    assert_eq!(res.status(), StatusCode::CREATED);
    let t: Value = read_body_json(res).await;
    let id = t["id"].as_str().unwrap().to_string();
    let res = call_service(app, TestRequest::post().uri(&format!("/admin/tenants/{id}/keys")).insert_header(bearer(admin)).to_request()).await;
    let k: Value = read_body_json(res).await;
    (id, k["key"].as_str().unwrap().to_string())
}

/// A JSON request; the status and the body (JSON, or a string if it is not).
pub async fn call<S>(app: &S, method: &str, uri: &str, key: Option<&str>, body: Option<Value>) -> (StatusCode, Value)
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let mut req = match method {
        "GET" => TestRequest::get(),
        "POST" => TestRequest::post(),
        "DELETE" => TestRequest::delete(),
        "PATCH" => TestRequest::patch(),
        "PUT" => TestRequest::put(),
        other => panic!("no test request for method {other}"),
    }
    .uri(uri);
    if let Some(k) = key {
        req = req.insert_header(bearer(k));
    }
    if let Some(b) = body {
        req = req.set_json(b);
    }
    let res = call_service(app, req.to_request()).await;
    let status = res.status();
    let bytes = read_body(res).await;
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, body)
}

/// Starts a streamed completion long enough (400 tokens, EOS ignored) to still be running when
/// the test acts on it; the response has been checked for 200.
pub async fn long_stream<S>(app: &S, key: &str) -> actix_web::dev::ServiceResponse
where
    S: actix_web::dev::Service<actix_http::Request, Response = actix_web::dev::ServiceResponse, Error = actix_web::Error>,
{
    let long = json!({"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": true, "stream": true});
    let res = call_service(app, TestRequest::post().uri("/v1/completions").insert_header(bearer(key)).set_json(&long).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    res
}

/// The `data:` payloads of a server-sent event stream; `[DONE]` is kept as a string.
pub fn sse_events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_string())))
        .collect()
}

#[actix_web::test]
async fn the_operator_manages_tenants_and_keys() {
    for h in Harness::each().await {
        let (state, admin) = (&h.state, &h.admin);
        let app = app!(state);
        let res = call_service(
            &app,
            TestRequest::post()
                .uri("/admin/tenants")
                .insert_header(bearer(admin))
                .set_json(json!({"name": "acme", "weight": 2.0, "plan": "standard"}))
                .to_request(),
        )
        .await;
        assert_eq!(res.status(), StatusCode::CREATED);
        let tenant: Value = read_body_json(res).await;
        let id = tenant["id"].as_str().unwrap().to_string();
        assert_eq!(tenant["weight"], 2.0);

        let res =
            call_service(&app, TestRequest::post().uri("/admin/tenants").insert_header(bearer(admin)).set_json(json!({"name": "acme"})).to_request()).await;
        assert_eq!(res.status(), StatusCode::CONFLICT);

        let res = call_service(
            &app,
            TestRequest::patch()
                .uri(&format!("/admin/tenants/{id}"))
                .insert_header(bearer(admin))
                .set_json(json!({"limits": {"requests_per_min": 60}}))
                .to_request(),
        )
        .await;
        assert_eq!(res.status(), StatusCode::OK);
        let patched: Value = read_body_json(res).await;
        assert_eq!(patched["requests_per_min"], 60);

        let res = call_service(&app, TestRequest::post().uri(&format!("/admin/tenants/{id}/keys")).insert_header(bearer(admin)).to_request()).await;
        assert_eq!(res.status(), StatusCode::CREATED);
        let key: Value = read_body_json(res).await;
        let secret = key["key"].as_str().unwrap().to_string();
        assert_eq!(key["scopes"], "adapters,inference");
        // A tenant's key is not an admin key.
        let res = call_service(&app, TestRequest::get().uri("/admin/tenants").insert_header(bearer(&secret)).to_request()).await;
        assert_eq!(res.status(), StatusCode::FORBIDDEN);
        let body: Value = read_body_json(res).await;
        assert_eq!(body["error"]["code"], "insufficient_scope");

        let res =
            call_service(&app, TestRequest::delete().uri(&format!("/admin/keys/{}", key["id"].as_str().unwrap())).insert_header(bearer(admin)).to_request())
                .await;
        assert_eq!(res.status(), StatusCode::NO_CONTENT);
        let res = call_service(&app, TestRequest::get().uri("/admin/tenants").insert_header(bearer(&secret)).to_request()).await;
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "a revoked key");

        // The key lists: the tenant's keys, newest first, the revoked one marked, no secrets;
        // the operator's keys apart; an unknown tenant is a 404.
        let res = call_service(
            &app,
            TestRequest::post().uri(&format!("/admin/tenants/{id}/keys")).insert_header(bearer(admin)).set_json(json!({"scopes": ["inference"]})).to_request(),
        )
        .await;
        let live: Value = read_body_json(res).await;
        let list = |uri: String| TestRequest::get().uri(&uri).insert_header(bearer(admin)).to_request();
        let res = call_service(&app, list(format!("/admin/tenants/{id}/keys"))).await;
        assert_eq!(res.status(), StatusCode::OK);
        let keys: Value = read_body_json(res).await;
        let keys = keys["data"].as_array().unwrap();
        assert_eq!(keys.len(), 2, "{keys:?}");
        assert!(keys[0]["created_at"].as_i64() >= keys[1]["created_at"].as_i64(), "newest first");
        let (new, old) = if keys[0]["id"] == live["id"] { (&keys[0], &keys[1]) } else { (&keys[1], &keys[0]) };
        assert_eq!(new["id"], live["id"]);
        assert_eq!(new["scopes"], "inference");
        assert!(new["revoked_at"].is_null());
        assert_eq!(old["id"], key["id"]);
        assert!(old["revoked_at"].as_i64().unwrap() > 0);
        assert_eq!(old["prefix"], key["prefix"]);
        let text = serde_json::to_string(&keys).unwrap();
        assert!(!text.contains(&secret) && !text.contains(live["key"].as_str().unwrap()), "a secret in the list: {text}");
        let res = call_service(&app, list("/admin/keys".into())).await;
        let operator: Value = read_body_json(res).await;
        let operator = operator["data"].as_array().unwrap();
        assert!(!operator.is_empty() && operator.iter().all(|k| k["tenant_id"].is_null() && k["scopes"].as_str().unwrap().contains("admin")), "{operator:?}");
        assert_eq!(call_service(&app, list("/admin/tenants/nobody/keys".into())).await.status(), StatusCode::NOT_FOUND);
        let res =
            call_service(&app, TestRequest::get().uri(&format!("/admin/tenants/{id}/keys")).insert_header(bearer(live["key"].as_str().unwrap())).to_request())
                .await;
        assert_eq!(res.status(), StatusCode::FORBIDDEN, "a tenant cannot list keys");

        let res = call_service(&app, TestRequest::delete().uri(&format!("/admin/tenants/{id}")).insert_header(bearer(admin)).to_request()).await;
        assert_eq!(res.status(), StatusCode::NO_CONTENT);
        let res = call_service(&app, TestRequest::get().uri(&format!("/admin/tenants/{id}")).insert_header(bearer(admin)).to_request()).await;
        assert_eq!(res.status(), StatusCode::NOT_FOUND);
    }
}

#[actix_web::test]
async fn bad_requests_get_a_clear_4xx() {
    for h in Harness::each().await {
        let (state, admin) = (&h.state, &h.admin);
        let app = app!(state);
        let post = |body: &'static str| {
            TestRequest::post()
                .uri("/admin/tenants")
                .insert_header(bearer(admin))
                .insert_header(("content-type", "application/json"))
                .set_payload(body)
                .to_request()
        };
        for (body, needle) in [
            ("{not json", "invalid JSON"),
            (r#"{"name": 5}"#, "invalid JSON"),
            (r#"{"name": "x", "colour": "red"}"#, "unknown field"),
            (r#"{"name": "../etc"}"#, "invalid name"),
            (r#"{"name": "x", "weight": -1}"#, "invalid weight"),
            (r#"{"name": "x", "weight": 1e300}"#, "invalid weight"),
            (r#"{"name": "x", "plan": "gold"}"#, "invalid plan"),
            (r#"{"name": "x", "limits": {"max_concurrent": -3}}"#, "negative"),
        ] {
            let res = call_service(&app, post(body)).await;
            assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{body}");
            let e: Value = read_body_json(res).await;
            assert!(e["error"]["message"].as_str().unwrap().contains(needle), "{body}: {e}");
            assert_eq!(e["error"]["type"], "invalid_request_error");
        }
        for auth in [None, Some("Bearer "), Some("Basic abc"), Some("Bearer lpx_nope")] {
            let mut req = TestRequest::get().uri("/admin/tenants");
            if let Some(a) = auth {
                req = req.insert_header(("authorization", a));
            }
            let res = call_service(&app, req.to_request()).await;
            assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{auth:?}");
        }
        let res = call_service(&app, TestRequest::post().uri("/admin/tenants/ten_missing/keys").insert_header(bearer(admin)).to_request()).await;
        assert_eq!(res.status(), StatusCode::NOT_FOUND);
        let res = call_service(&app, TestRequest::get().uri("/ready").to_request()).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
}
