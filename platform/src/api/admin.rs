//! The operator's API: tenants and their keys. Every route needs a key with the admin scope.

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;

use super::business::audit;
use super::{ApiError, AppState, authorize, json_body};
use crate::store::{NewTenant, Scope, TenantLimits, TenantPatch};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/tenants", web::post().to(create_tenant))
        .route("/admin/tenants", web::get().to(list_tenants))
        .route("/admin/tenants/{id}", web::get().to(get_tenant))
        .route("/admin/tenants/{id}", web::patch().to(patch_tenant))
        .route("/admin/tenants/{id}", web::delete().to(delete_tenant))
        .route("/admin/tenants/{id}/keys", web::post().to(create_key))
        .route("/admin/tenants/{id}/keys", web::get().to(list_tenant_keys))
        .route("/admin/keys", web::post().to(create_operator_key))
        .route("/admin/keys", web::get().to(list_operator_keys))
        .route("/admin/keys/{id}", web::delete().to(revoke_key));
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateTenant {
    name: String,
    #[serde(default = "one")]
    weight: f64,
    #[serde(default = "standard")]
    plan: String,
    #[serde(default)]
    limits: TenantLimits,
}

fn one() -> f64 {
    1.0
}

fn standard() -> String {
    "standard".into()
}

async fn create_tenant(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let b: CreateTenant = json_body(&state, payload).await?;
    let t = state.store.create_tenant(&NewTenant { name: b.name, weight: b.weight, plan: b.plan, limits: b.limits }).await?;
    audit(&state, &key, &t.id, "tenant.create", &t.name, serde_json::to_value(&t).unwrap_or_default()).await;
    Ok(HttpResponse::Created().json(t))
}

async fn list_tenants(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"data": state.store.tenants().await?})))
}

async fn get_tenant(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let t = state.store.tenant(&id).await?.ok_or_else(|| ApiError::NotFound(format!("tenant {id}")))?;
    Ok(HttpResponse::Ok().json(t))
}

/// A JSON merge patch (RFC 7396) of a tenant: fields left out stay as they are; a limit set to
/// `null` is cleared (unlimited). `weight` and `plan` always have a value, so `null` is refused
/// for them.
async fn patch_tenant(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let body: serde_json::Value = json_body(&state, payload).await?;
    let Some(fields) = body.as_object() else {
        return Err(ApiError::Invalid("a tenant patch is a JSON object (a merge patch: absent fields stay, null clears a limit)".into()));
    };
    for field in ["weight", "plan"] {
        if fields.get(field).is_some_and(serde_json::Value::is_null) {
            return Err(ApiError::Invalid(format!("`{field}` cannot be cleared; give a value")));
        }
    }
    if fields.get("limits").is_some_and(serde_json::Value::is_null) {
        return Err(ApiError::Invalid("`limits` cannot be null; clear one limit with `{\"limits\": {\"NAME\": null}}`".into()));
    }
    let patch: TenantPatch = serde_json::from_value(body.clone()).map_err(|e| ApiError::Invalid(format!("invalid tenant patch: {e}")))?;
    let t = state.store.update_tenant(&id, &patch).await?;
    audit(&state, &key, &t.id, "tenant.update", &t.name, body).await;
    Ok(HttpResponse::Ok().json(t))
}

async fn delete_tenant(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let name = state.store.tenant(&id).await?.map(|t| t.name).unwrap_or_default();
    // Its keys are revoked and its adapters deleted with it (their files go once requests
    // still running on them finish), its files with their bytes; its usage stays billable.
    let deleted = state.store.delete_tenant(&id).await?.ok_or_else(|| ApiError::NotFound(format!("tenant {id}")))?;
    let detail = serde_json::json!({"adapters": deleted.adapters.len(), "files": deleted.files.len(), "batches": deleted.batches});
    audit(&state, &key, &id, "tenant.delete", &name, detail).await;
    // Its batches run here stop before the answer, so that no line of them starts after it (a
    // replica that runs one stops it at its next look for cancelled batches); they end with
    // what finished, and their output is not written.
    for b in &deleted.batches {
        state.batches.signal(b, super::batch::Stop::Cancel);
    }
    let files: Vec<std::path::PathBuf> = deleted.files.iter().map(|p| state.data_dir.join(p)).collect();
    state
        .background
        .run(move || {
            for f in files {
                if let Err(e) = std::fs::remove_file(&f)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    // Left for the sweep at the next start, which removes files no live record names.
                    eprintln!("warning: removing {}: {e}", f.display());
                }
            }
        })
        .await?;
    for f in &deleted.files {
        state.adapter_files.remove_file(f).await;
    }
    let mut gone = Vec::new();
    for a in deleted.adapters {
        state.serving.unload_adapter(a.id.as_str().into(), id.as_str().into(), true).await;
        gone.extend(super::adapters::retire(&state, &a));
        state.adapter_files.remove(&a.blob).await;
    }
    if !gone.is_empty() {
        state.background.run(move || gone.iter().for_each(|d| super::adapters::remove_dir(d))).await?;
    }
    Ok(HttpResponse::NoContent().finish())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateKey {
    #[serde(default = "tenant_scopes")]
    scopes: Vec<Scope>,
}

fn tenant_scopes() -> Vec<Scope> {
    vec![Scope::Inference, Scope::Adapters]
}

async fn create_key(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let by = authorize(&req, &state, Scope::Admin).await?;
    // The body is optional: without one, the key gets the inference and adapters scopes.
    let body = super::read_body(&state, payload).await?;
    let scopes = if body.iter().all(u8::is_ascii_whitespace) { tenant_scopes() } else { super::parse_json::<CreateKey>(&body)?.scopes };
    if let Some(s) = scopes.iter().find(|s| matches!(s, Scope::Admin | Scope::Metrics)) {
        return Err(ApiError::Invalid(format!("a tenant's key cannot have the {} scope (it would see every tenant)", s.as_str())));
    }
    let (key, secret) = state.store.create_key(Some(&id), &scopes).await.map_err(|e| match e {
        crate::store::StoreError::NotFound(_) => ApiError::NotFound(format!("tenant {id}")),
        e => e.into(),
    })?;
    audit(&state, &by, &id, "key.create", &key.id, serde_json::json!({"scopes": key.scopes, "prefix": key.prefix})).await;
    Ok(HttpResponse::Created().json(serde_json::json!({"id": key.id, "key": secret, "prefix": key.prefix, "scopes": key.scopes, "tenant_id": key.tenant_id})))
}

/// A new operator key: `admin` (everything) and/or `metrics` (scraping `/metrics` only, for a
/// Prometheus server).
async fn create_operator_key(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let by = authorize(&req, &state, Scope::Admin).await?;
    let b: CreateKey = json_body(&state, payload).await?;
    if let Some(s) = b.scopes.iter().find(|s| !matches!(s, Scope::Admin | Scope::Metrics)) {
        return Err(ApiError::Invalid(format!("an operator key has the admin and/or metrics scopes; {} belongs to a tenant's key", s.as_str())));
    }
    let (key, secret) = state.store.create_key(None, &b.scopes).await?;
    audit(&state, &by, "", "key.create", &key.id, serde_json::json!({"scopes": key.scopes, "prefix": key.prefix})).await;
    Ok(HttpResponse::Created().json(serde_json::json!({"id": key.id, "key": secret, "prefix": key.prefix, "scopes": key.scopes, "tenant_id": null})))
}

/// A tenant's keys, revoked ones included (never their secrets).
async fn list_tenant_keys(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    if state.store.tenant(&id).await?.is_none() {
        return Err(ApiError::NotFound(format!("tenant {id}")));
    }
    Ok(HttpResponse::Ok().json(serde_json::json!({"data": state.store.keys(Some(&id)).await?})))
}

/// The operator's keys, revoked ones included (never their secrets).
async fn list_operator_keys(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"data": state.store.keys(None).await?})))
}

async fn revoke_key(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let by = authorize(&req, &state, Scope::Admin).await?;
    let owner = state.store.key_tenant(&id).await?;
    if !state.store.revoke_key(&id).await? {
        return Err(ApiError::NotFound(format!("key {id}")));
    }
    audit(&state, &by, owner.as_deref().unwrap_or(""), "key.revoke", &id, serde_json::json!({})).await;
    Ok(HttpResponse::NoContent().finish())
}
