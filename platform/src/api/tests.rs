//! The admin API over HTTP: tenants and keys, authentication, and the error table.

use actix_web::http::StatusCode;
use actix_web::test::{TestRequest, call_service, init_service, read_body_json};
use actix_web::{App, web};
use serde_json::{Value, json};

use super::*;

async fn state() -> (AppState, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect(&format!("sqlite://{}", dir.path().join("db").display())).await.unwrap();
    let (_, admin) = store.create_key(None, &[Scope::Admin]).await.unwrap();
    (AppState { store }, admin, dir)
}

macro_rules! app {
    ($state:expr) => {
        init_service(App::new().app_data(web::Data::new($state.clone())).configure(routes)).await
    };
}

fn bearer(key: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {key}"))
}

#[actix_web::test]
async fn the_operator_manages_tenants_and_keys() {
    let (state, admin, _dir) = state().await;
    let app = app!(state);
    let res = call_service(&app, TestRequest::post().uri("/admin/tenants").insert_header(bearer(&admin)).set_json(json!({"name": "acme", "weight": 2.0, "plan": "standard"})).to_request()).await;
    assert_eq!(res.status(), StatusCode::CREATED);
    let tenant: Value = read_body_json(res).await;
    let id = tenant["id"].as_str().unwrap().to_string();
    assert_eq!(tenant["weight"], 2.0);

    let res = call_service(&app, TestRequest::post().uri("/admin/tenants").insert_header(bearer(&admin)).set_json(json!({"name": "acme"})).to_request()).await;
    assert_eq!(res.status(), StatusCode::CONFLICT);

    let res = call_service(&app, TestRequest::patch().uri(&format!("/admin/tenants/{id}")).insert_header(bearer(&admin)).set_json(json!({"limits": {"requests_per_min": 60}})).to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let patched: Value = read_body_json(res).await;
    assert_eq!(patched["requests_per_min"], 60);

    let res = call_service(&app, TestRequest::post().uri(&format!("/admin/tenants/{id}/keys")).insert_header(bearer(&admin)).to_request()).await;
    assert_eq!(res.status(), StatusCode::CREATED);
    let key: Value = read_body_json(res).await;
    let secret = key["key"].as_str().unwrap().to_string();
    assert_eq!(key["scopes"], "adapters,inference");
    // A tenant's key is not an admin key.
    let res = call_service(&app, TestRequest::get().uri("/admin/tenants").insert_header(bearer(&secret)).to_request()).await;
    assert_eq!(res.status(), StatusCode::FORBIDDEN);
    let body: Value = read_body_json(res).await;
    assert_eq!(body["error"]["code"], "insufficient_scope");

    let res = call_service(&app, TestRequest::delete().uri(&format!("/admin/keys/{}", key["id"].as_str().unwrap())).insert_header(bearer(&admin)).to_request()).await;
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    let res = call_service(&app, TestRequest::get().uri("/admin/tenants").insert_header(bearer(&secret)).to_request()).await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "a revoked key");

    let res = call_service(&app, TestRequest::delete().uri(&format!("/admin/tenants/{id}")).insert_header(bearer(&admin)).to_request()).await;
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    let res = call_service(&app, TestRequest::get().uri(&format!("/admin/tenants/{id}")).insert_header(bearer(&admin)).to_request()).await;
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
}

#[actix_web::test]
async fn bad_requests_get_a_clear_4xx() {
    let (state, admin, _dir) = state().await;
    let app = app!(state);
    let post = |body: &'static str| TestRequest::post().uri("/admin/tenants").insert_header(bearer(&admin)).insert_header(("content-type", "application/json")).set_payload(body).to_request();
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
    let res = call_service(&app, TestRequest::post().uri("/admin/tenants/ten_missing/keys").insert_header(bearer(&admin)).to_request()).await;
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    let res = call_service(&app, TestRequest::get().uri("/ready").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
}
