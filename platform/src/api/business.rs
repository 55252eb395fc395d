//! The operator's business over HTTP: plans and their prices, a tenant's own prices, the audit
//! log; and a tenant's view of itself (its plan, prices, limits and what is left of its quotas)
//! with the keys it mints and revokes itself.

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ApiError, AppState, authorize, json_body, parse_query, principal_of};
use crate::store::{ApiKey, Plan, PriceOverride, Scope};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/admin/plans", web::get().to(list_plans))
        .route("/admin/plans", web::post().to(create_plan))
        .route("/admin/plans/{name}", web::patch().to(patch_plan))
        .route("/admin/tenants/{id}/prices", web::get().to(get_prices))
        .route("/admin/tenants/{id}/prices", web::put().to(put_prices))
        .route("/admin/audit", web::get().to(audit_log))
        .route("/v1/me", web::get().to(me))
        .route("/v1/keys", web::post().to(mint_key))
        .route("/v1/keys", web::get().to(my_keys))
        .route("/v1/keys/{id}", web::delete().to(revoke_my_key));
}

/// Records a change in the audit log: by `key` (the operator's or a tenant's), about tenant
/// `tenant` (`""`: none). The change is made already; a failure to record it is reported in
/// the server's log, and the answer stands.
pub async fn audit(state: &AppState, key: &ApiKey, tenant: &str, action: &str, target: &str, detail: Value) {
    audit_as(state, key.tenant_id.as_deref().unwrap_or(""), &key.id, tenant, action, target, detail).await;
}

/// [`audit`] by `actor` (a tenant's id, `""` the operator) with key `key_id`.
pub async fn audit_as(state: &AppState, actor: &str, key_id: &str, tenant: &str, action: &str, target: &str, detail: Value) {
    if let Err(e) = state.store.audit(actor, key_id, tenant, action, target, &detail).await {
        eprintln!("warning: the audit log missed {action} of {target} by key {key_id}: {e}");
    }
}

fn plan_json(p: &Plan) -> Value {
    let (bp, bc, bo) = p.batch_prices();
    json!({
        "name": p.name,
        "prompt_price": p.prompt_price,
        "cached_prompt_price": p.cached_prompt_price,
        "completion_price": p.completion_price,
        "batch_percent": p.batch_percent,
        "batch_prices": {"prompt_price": bp, "cached_prompt_price": bc, "completion_price": bo},
    })
}

async fn list_plans(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let plans: Vec<Value> = state.store.plans().await?.iter().map(plan_json).collect();
    Ok(HttpResponse::Ok().json(json!({"data": plans})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewPlan {
    name: String,
    prompt_price: i64,
    cached_prompt_price: i64,
    completion_price: i64,
    #[serde(default = "half")]
    batch_percent: i64,
}

fn half() -> i64 {
    50
}

async fn create_plan(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let b: NewPlan = json_body(&state, payload).await?;
    let plan = Plan {
        name: b.name,
        prompt_price: b.prompt_price,
        cached_prompt_price: b.cached_prompt_price,
        completion_price: b.completion_price,
        batch_percent: b.batch_percent,
    };
    let plan = state.store.create_plan(&plan).await?;
    audit(&state, &key, "", "plan.create", &plan.name, plan_json(&plan)).await;
    Ok(HttpResponse::Created().json(plan_json(&plan)))
}

/// Changes the prices a patch names (the fields of a tenant's own prices, laid over the plan's
/// as those are); requests admitted from now on pay them (the ledger's rows keep the prices
/// they were admitted at).
async fn patch_plan(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let patch: PriceOverride = json_body(&state, payload).await?;
    let plan = state.store.plan(&name).await?.ok_or_else(|| ApiError::NotFound(format!("plan {name:?}")))?;
    let before = plan_json(&plan);
    let plan = state.store.update_plan(&patch.apply(&plan)).await?;
    audit(&state, &key, "", "plan.update", &plan.name, json!({"before": before, "after": plan_json(&plan)})).await;
    Ok(HttpResponse::Ok().json(plan_json(&plan)))
}

/// A tenant's plan, its own prices over it, and the prices it pays.
async fn prices_json(state: &AppState, tenant: &crate::store::Tenant) -> Result<Value, ApiError> {
    let plan = state.store.plan(&tenant.plan).await?.ok_or_else(|| ApiError::Internal(format!("tenant {} has no plan {:?}", tenant.id, tenant.plan)))?;
    let own = state.store.price_override(&tenant.id).await?;
    Ok(json!({"plan": plan_json(&plan), "override": own, "effective": plan_json(&own.apply(&plan))}))
}

async fn tenant_or_404(state: &AppState, id: &str) -> Result<crate::store::Tenant, ApiError> {
    state.store.tenant(id).await?.ok_or_else(|| ApiError::NotFound(format!("tenant {id}")))
}

async fn get_prices(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let t = tenant_or_404(&state, &id).await?;
    Ok(HttpResponse::Ok().json(prices_json(&state, &t).await?))
}

/// Sets a tenant's own prices (each field left out or null is its plan's; `{}` clears them).
async fn put_prices(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let b: PriceOverride = json_body(&state, payload).await?;
    let t = tenant_or_404(&state, &id).await?;
    state.store.set_price_override(&t.id, &b).await?;
    audit(&state, &key, &t.id, "tenant.prices", &t.name, serde_json::to_value(&b).unwrap_or_default()).await;
    Ok(HttpResponse::Ok().json(prices_json(&state, &t).await?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    tenant_id: Option<String>,
    /// Unix milliseconds: entries before it (the `at` of the last entry of the page before).
    before: Option<i64>,
    limit: Option<u32>,
}

/// The audit log, newest first: `?tenant_id=` (changes by or about one tenant), `&before=`,
/// `&limit=` (default 100, at most 1000).
async fn audit_log(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let q: AuditQuery = parse_query(&req)?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::InvalidParam { param: "limit".into(), message: format!("`limit` is 1 to 1000, not {limit}") });
    }
    let entries = state.store.audit_log(q.tenant_id.as_deref(), q.before, i64::from(limit)).await?;
    let names: std::collections::HashMap<String, String> = state.store.tenants().await?.into_iter().map(|t| (t.id, t.name)).collect();
    let data: Vec<Value> = entries
        .into_iter()
        .map(|e| {
            let detail: Value = serde_json::from_str(&e.detail).unwrap_or(Value::String(e.detail.clone()));
            let actor_name = if e.actor.is_empty() { Some("operator".to_string()) } else { names.get(&e.actor).cloned() };
            json!({
                "id": e.id, "at": e.at, "actor": if e.actor.is_empty() { None } else { Some(&e.actor) }, "actor_name": actor_name,
                "key_id": e.key_id, "tenant_id": if e.tenant_id.is_empty() { None } else { Some(&e.tenant_id) },
                "tenant": names.get(&e.tenant_id), "action": e.action, "target": e.target, "detail": detail,
            })
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({"data": data})))
}

/// The caller's tenant: a key of a tenant, whatever its scopes.
async fn tenant_key(req: &HttpRequest, state: &AppState) -> Result<std::sync::Arc<crate::store::Principal>, ApiError> {
    let p = principal_of(req.headers(), state).await?;
    if p.tenant.is_none() {
        return Err(ApiError::Forbidden("inference"));
    }
    Ok(p)
}

/// A tenant's view of itself: its plan and the prices it pays (batch prices too), its limits,
/// and what it uses and has left of each quota.
async fn me(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let p = tenant_key(&req, &state).await?;
    let Some((tenant, plan)) = &p.tenant else { return Err(ApiError::Forbidden("inference")) };
    let limits = tenant.limits();
    let (adapters, adapter_bytes) = state.store.adapter_footprint(&tenant.id).await?;
    let files = state.store.file_storage_used(&tenant.id).await?;
    let keys = state.store.live_keys(&tenant.id).await?;
    let max_keys = i64::from(state.settings.max_keys_per_tenant);
    let max_files = i64::try_from(state.settings.batch.max_tenant_file_bytes).unwrap_or(i64::MAX);
    let left = |max: Option<i64>, used: i64| max.map(|m| m.saturating_sub(used).max(0));
    Ok(HttpResponse::Ok().json(json!({
        "tenant": {"id": tenant.id, "name": tenant.name, "weight": tenant.weight, "plan": tenant.plan, "created_at": tenant.created_at},
        "prices": plan_json(plan),
        "limits": limits,
        "key": {"id": p.key.id, "prefix": p.key.prefix, "scopes": p.key.scopes.split(',').collect::<Vec<_>>()},
        "quotas": {
            "adapters": {"used": adapters, "limit": limits.max_adapters, "left": left(limits.max_adapters, adapters)},
            "adapter_bytes": {"used": adapter_bytes, "limit": limits.max_adapter_bytes, "left": left(limits.max_adapter_bytes, adapter_bytes)},
            "file_bytes": {"used": files, "limit": max_files, "left": left(Some(max_files), files)},
            "keys": {"used": keys, "limit": max_keys, "left": left(Some(max_keys), keys)},
        },
    })))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MintKey {
    scopes: Option<Vec<Scope>>,
}

/// A new key of the caller's tenant, with the caller's scopes or fewer; the secret is shown
/// once. At most `--max-keys-per-tenant` live keys.
async fn mint_key(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let p = tenant_key(&req, &state).await?;
    let tenant = p.key.tenant_id.clone().unwrap_or_default();
    let body = super::read_body(&state, payload).await?;
    let asked = if body.iter().all(u8::is_ascii_whitespace) { None } else { super::parse_json::<MintKey>(&body)?.scopes };
    let own: Vec<Scope> = [Scope::Inference, Scope::Adapters].into_iter().filter(|s| p.key.has(*s)).collect();
    let scopes = asked.unwrap_or_else(|| own.clone());
    if let Some(s) = scopes.iter().find(|s| !own.contains(s)) {
        return Err(ApiError::InvalidParam {
            param: "scopes".into(),
            message: format!("this key cannot give the {} scope: a new key has this key's scopes or fewer", s.as_str()),
        });
    }
    let (key, secret) = state.store.mint_tenant_key(&tenant, &scopes, i64::from(state.settings.max_keys_per_tenant)).await?;
    audit(&state, &p.key, &tenant, "key.create", &key.id, json!({"scopes": key.scopes, "prefix": key.prefix})).await;
    Ok(HttpResponse::Created().json(json!({"id": key.id, "key": secret, "prefix": key.prefix, "scopes": key.scopes, "tenant_id": key.tenant_id})))
}

async fn my_keys(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let p = tenant_key(&req, &state).await?;
    Ok(HttpResponse::Ok().json(json!({"data": state.store.keys(p.key.tenant_id.as_deref()).await?})))
}

/// Revokes one of the caller's tenant's keys (the caller's own too); another tenant's is a 404.
async fn revoke_my_key(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let p = tenant_key(&req, &state).await?;
    let tenant = p.key.tenant_id.clone().unwrap_or_default();
    if !state.store.revoke_tenant_key(&tenant, &id).await? {
        return Err(ApiError::NotFound(format!("key {id}")));
    }
    audit(&state, &p.key, &tenant, "key.revoke", &id, json!({})).await;
    Ok(HttpResponse::NoContent().finish())
}
