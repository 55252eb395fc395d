//! The HTTP API (actix-web). This part: authentication, the admin API for tenants and keys,
//! health and readiness. Every error goes through [`ApiError`].

mod admin;
mod error;

use actix_web::{HttpRequest, HttpResponse, web};

pub use error::ApiError;

use crate::store::{ApiKey, Scope, Store};

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
}

/// Mounts every route.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.app_data(json_config())
        .app_data(web::PathConfig::default().error_handler(|e, _| ApiError::Invalid(e.to_string()).into()))
        .route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .configure(admin::routes);
}

/// JSON bodies: a clear 400 for malformed JSON, wrong types or unknown fields, and a size cap.
fn json_config() -> web::JsonConfig {
    web::JsonConfig::default().limit(4 << 20).error_handler(|e, _| ApiError::Invalid(format!("invalid JSON body: {e}")).into())
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

/// Ready once the database answers.
async fn ready(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    state.store.plans().await?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"status": "ready"})))
}

/// The live key behind the request's bearer token, which must carry `scope`.
pub async fn authorize(req: &HttpRequest, state: &AppState, scope: Scope) -> Result<ApiKey, ApiError> {
    let header = req.headers().get("authorization").and_then(|h| h.to_str().ok()).ok_or(ApiError::MissingKey)?;
    let secret = header.strip_prefix("Bearer ").map(str::trim).filter(|s| !s.is_empty()).ok_or(ApiError::MissingKey)?;
    let key = state.store.authenticate(secret).await?.ok_or(ApiError::BadKey)?;
    if !key.has(scope) {
        return Err(ApiError::Forbidden(scope.as_str()));
    }
    Ok(key)
}

#[cfg(test)]
mod tests;
