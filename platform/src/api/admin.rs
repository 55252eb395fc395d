//! The operator's API: tenants and their keys. Every route needs a key with the admin scope.

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;

use super::{ApiError, AppState, authorize, json_body};
use crate::store::{NewTenant, Scope, TenantLimits, TenantPatch};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/tenants", web::post().to(create_tenant))
        .route("/admin/tenants", web::get().to(list_tenants))
        .route("/admin/tenants/{id}", web::get().to(get_tenant))
        .route("/admin/tenants/{id}", web::patch().to(patch_tenant))
        .route("/admin/tenants/{id}", web::delete().to(delete_tenant))
        .route("/admin/tenants/{id}/keys", web::post().to(create_key))
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
    authorize(&req, &state, Scope::Admin).await?;
    let b: CreateTenant = json_body(payload).await?;
    let t = state.store.create_tenant(&NewTenant { name: b.name, weight: b.weight, plan: b.plan, limits: b.limits }).await?;
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchTenant {
    weight: Option<f64>,
    plan: Option<String>,
    limits: Option<TenantLimits>,
}

async fn patch_tenant(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let b: PatchTenant = json_body(payload).await?;
    let t = state.store.update_tenant(&id, &TenantPatch { weight: b.weight, plan: b.plan, limits: b.limits }).await?;
    Ok(HttpResponse::Ok().json(t))
}

async fn delete_tenant(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    // Its keys are revoked and its adapters deleted with it (their files go once requests
    // still running on them finish); its usage stays billable.
    let adapters = state.store.delete_tenant(&id).await?.ok_or_else(|| ApiError::NotFound(format!("tenant {id}")))?;
    for a in adapters {
        state.serving.unload_adapter(a.id.as_str().into(), true).await;
        state.blobs.retire(&a.id, state.data_dir.join(&a.blob));
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
    authorize(&req, &state, Scope::Admin).await?;
    // The body is optional: without one, the key gets the inference and adapters scopes.
    let body = super::read_body(payload).await?;
    let scopes = if body.iter().all(u8::is_ascii_whitespace) { tenant_scopes() } else { super::parse_json::<CreateKey>(&body)?.scopes };
    if scopes.contains(&Scope::Admin) {
        return Err(ApiError::Invalid("a tenant's key cannot have the admin scope".into()));
    }
    let (key, secret) = state.store.create_key(Some(&id), &scopes).await.map_err(|e| match e {
        crate::store::StoreError::NotFound(_) => ApiError::NotFound(format!("tenant {id}")),
        e => e.into(),
    })?;
    Ok(HttpResponse::Created().json(serde_json::json!({"id": key.id, "key": secret, "prefix": key.prefix, "scopes": key.scopes, "tenant_id": key.tenant_id})))
}

async fn revoke_key(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    if !state.store.revoke_key(&id).await? {
        return Err(ApiError::NotFound(format!("key {id}")));
    }
    Ok(HttpResponse::NoContent().finish())
}
