//! OpenAI's Batch API: a tenant names a file of requests it uploaded (see [`super::files`]) and
//! an endpoint, and gets every answer in an output file (and every failure in an error file)
//! within the completion window, at the plan's batch prices (`batch_percent` of its prices, half
//! by default). Lines run in the capacity interactive traffic leaves (see [`runner`]); a batch
//! survives restarts of its server (its state is in the database, its files under the data
//! directory) and can be cancelled. A batch's lines may name any models the tenant may use: the
//! base model and its adapters, mixed.
//!
//! Creating a batch checks what can be checked before it runs: its input file, that every line
//! calls the batch's endpoint, and that every model a line names exists for the tenant (a 400
//! lists the lines that do not). What needs the request itself (the prompt's length, a schema)
//! is checked when the line runs, and a line that fails goes to the error file with the status
//! and body the endpoint would have answered.

pub mod lines;
mod runner;

use std::collections::BTreeMap;

use actix_web::{HttpRequest, HttpResponse, web};
use serde::Deserialize;
use serde_json::{Value, json};

pub use runner::{Batches, Stop, resume};

use super::error::LineError;
use super::infer::{self, Caller};
use super::openai::BatchEndpoint;
use super::{ApiError, AppState, json_body};
use crate::store::{BatchRecord, Scope, batch_status, file_purpose, now_ms, random_id};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/batches", web::post().to(create))
        .route("/v1/batches", web::get().to(list))
        .route("/v1/batches/{id}", web::get().to(show))
        .route("/v1/batches/{id}/cancel", web::post().to(cancel));
}

/// The one completion window there is (OpenAI's).
pub const COMPLETION_WINDOW: &str = "24h";
const WINDOW_MS: i64 = 24 * 3_600_000;

/// Bounds of a batch's metadata (OpenAI's).
pub const MAX_METADATA: usize = 16;
pub const MAX_METADATA_KEY: usize = 64;
pub const MAX_METADATA_VALUE: usize = 512;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBatch {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    metadata: Option<BTreeMap<String, String>>,
}

fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if metadata.len() > MAX_METADATA {
        return Err(ApiError::Invalid(format!("`metadata` may hold at most {MAX_METADATA} pairs; given: {}", metadata.len())));
    }
    for (k, v) in metadata {
        if k.chars().count() > MAX_METADATA_KEY || v.chars().count() > MAX_METADATA_VALUE {
            return Err(ApiError::Invalid(format!("`metadata` keys may have at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}")));
        }
    }
    Ok(())
}

async fn create(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let body: CreateBatch = json_body(&state, payload).await?;
    if body.completion_window != COMPLETION_WINDOW {
        return Err(ApiError::Invalid(format!("`completion_window` must be {COMPLETION_WINDOW:?}")));
    }
    let endpoint = BatchEndpoint::from_url(&body.endpoint).ok_or_else(|| {
        let known: Vec<&str> = BatchEndpoint::ALL.iter().map(|e| e.url()).collect();
        ApiError::Invalid(format!("`endpoint` must be {}", known.join(" or ")))
    })?;
    let metadata = body.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    let shown: String = body.input_file_id.chars().take(80).collect();
    let file = match body.input_file_id.len() {
        0..=128 => state.store.file(&caller.tenant.id, &body.input_file_id).await?,
        _ => None,
    }
    .ok_or_else(|| ApiError::NotFound(format!("file `{shown}`")))?;
    if file.purpose != file_purpose::BATCH {
        return Err(ApiError::Invalid(format!("file `{shown}` is a batch's output (purpose {}), not an input (purpose batch)", file.purpose)));
    }
    // Every line calls the batch's endpoint and names a model the tenant may use.
    let path = state.adapter_files.local_file(&state.background, &file.path, u64::try_from(file.bytes).unwrap_or(0)).await?;
    let scan = state
        .background
        .run(move || std::fs::File::open(path).and_then(|f| lines::scan(f, endpoint)))
        .await?
        .map_err(|e| ApiError::Internal(format!("reading the input file: {e}")))?;
    let (mut count, mut problems) = (scan.problem_count, scan.problems);
    for (model, line) in &scan.models {
        match infer::resolve(&state, &caller.tenant.id, model).await {
            Ok(_) => {}
            Err(ApiError::NotFound(what)) => {
                count += 1;
                if problems.len() < lines::MAX_REPORTED {
                    problems.push(LineError { line: line + 1, custom_id: None, message: format!("{what} not found") });
                }
            }
            Err(e) => return Err(e),
        }
    }
    if count > 0 {
        problems.sort_by_key(|p| p.line);
        let first = problems.first().map(|p| format!("line {}: {}", p.line, p.message)).unwrap_or_default();
        return Err(ApiError::InvalidLines { message: format!("{count} lines of the file cannot run in this batch (the first: {first})"), lines: problems });
    }
    let now = now_ms();
    let record = BatchRecord {
        id: random_id("batch"),
        tenant_id: caller.tenant.id.clone(),
        key_id: caller.key_id.clone(),
        endpoint: endpoint.url().into(),
        input_file_id: file.id.clone(),
        completion_window: COMPLETION_WINDOW.into(),
        status: batch_status::IN_PROGRESS.into(),
        instance: state.settings.instance.clone(),
        metadata: serde_json::to_string(&metadata).map_err(|e| ApiError::Internal(e.to_string()))?,
        total: file.lines,
        completed: 0,
        failed: 0,
        output_file_id: None,
        error_file_id: None,
        errors: None,
        created_at: now,
        expires_at: now + WINDOW_MS,
        in_progress_at: Some(now),
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
    };
    state.store.insert_batch(&record, Some(i64::from(state.settings.batch.max_active))).await?;
    Batches::start(&state, &record.id);
    let detail = serde_json::json!({"input_file_id": record.input_file_id, "endpoint": record.endpoint});
    super::business::audit_as(&state, &caller.tenant.id, &caller.key_id, &caller.tenant.id, "batch.create", &record.id, detail).await;
    Ok(HttpResponse::Ok().json(batch_json(&state, &record).await?))
}

/// OpenAI's batch object: counts live while it runs, and the tokens it was billed for.
pub async fn batch_json(state: &AppState, b: &BatchRecord) -> Result<Value, ApiError> {
    let (completed, failed) = if b.is_active() { state.store.batch_counts(&b.id).await? } else { (b.completed, b.failed) };
    let usage = state.store.batch_usage(&b.id).await?;
    let seconds = |ms: Option<i64>| ms.map(|ms| ms / 1000);
    let errors = b.errors.as_deref().and_then(|e| serde_json::from_str::<Value>(e).ok()).map(|data| json!({"object": "list", "data": data}));
    let metadata = serde_json::from_str::<Value>(&b.metadata).ok().filter(|m| m.as_object().is_some_and(|o| !o.is_empty()));
    Ok(json!({
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": b.created_at / 1000,
        "in_progress_at": seconds(b.in_progress_at),
        "expires_at": b.expires_at / 1000,
        "finalizing_at": seconds(b.finalizing_at),
        "completed_at": seconds(b.completed_at),
        "failed_at": seconds(b.failed_at),
        "expired_at": seconds(b.expired_at),
        "cancelling_at": seconds(b.cancelling_at),
        "cancelled_at": seconds(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": completed, "failed": failed},
        "metadata": metadata,
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens.saturating_add(usage.completion_tokens),
        },
    }))
}

async fn owned(state: &AppState, caller: &Caller, id: &str) -> Result<BatchRecord, ApiError> {
    let shown: String = id.chars().take(80).collect();
    let found = if id.len() <= 128 { state.store.batch(&caller.tenant.id, id).await? } else { None };
    found.ok_or_else(|| ApiError::NotFound(format!("batch `{shown}`")))
}

async fn show(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let batch = owned(&state, &caller, &id).await?;
    Ok(HttpResponse::Ok().json(batch_json(&state, &batch).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    limit: Option<u32>,
    after: Option<String>,
}

async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let q: ListQuery = super::parse_query(&req)?;
    let page = super::files::page(q.limit, 20, q.after.as_deref(), None)?;
    let mut rows = state.store.batches(&caller.tenant.id, &page).await?;
    let has_more = rows.len() as i64 >= page.limit;
    rows.truncate((page.limit - 1).max(0) as usize);
    let mut data = Vec::with_capacity(rows.len());
    for b in &rows {
        data.push(batch_json(&state, b).await?);
    }
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": data,
        "first_id": rows.first().map(|b| &b.id),
        "last_id": rows.last().map(|b| &b.id),
        "has_more": has_more,
    })))
}

async fn cancel(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let batch = owned(&state, &caller, &id).await?;
    match batch.status.as_str() {
        batch_status::VALIDATING | batch_status::IN_PROGRESS => {
            state.store.set_batch_status(&batch.id, &[batch_status::VALIDATING, batch_status::IN_PROGRESS], batch_status::CANCELLING).await?;
            // Its task stops its lines and writes what finished; without one here (it ended
            // between the read and the write), a task is started to do that.
            if !state.batches.signal(&batch.id, Stop::Cancel) && batch.instance == state.settings.instance {
                Batches::start(&state, &batch.id);
            }
        }
        batch_status::CANCELLING | batch_status::CANCELLED => {}
        other => return Err(ApiError::Conflict(format!("the batch is {other}: only a batch that is validating or in progress can be cancelled"))),
    }
    let batch = owned(&state, &caller, &id).await?;
    super::business::audit_as(&state, &caller.tenant.id, &caller.key_id, &caller.tenant.id, "batch.cancel", &batch.id, serde_json::json!({})).await;
    Ok(HttpResponse::Ok().json(batch_json(&state, &batch).await?))
}

/// At start, before batches resume: removes the files under `files/` that no live record names
/// (an upload or an output file that a crash left unrecorded, a deleted file whose bytes stayed);
/// a batch that was writing its output writes it again. Returns how many were removed.
pub async fn sweep(data_dir: &std::path::Path, store: &crate::store::Store) -> Result<usize, crate::store::StoreError> {
    let live: std::collections::HashSet<String> = store.file_paths().await?.into_iter().filter(|(_, live)| *live).map(|(p, _)| p).collect();
    let data_dir = data_dir.to_path_buf();
    let removed = tokio::task::spawn_blocking(move || {
        let Ok(entries) = std::fs::read_dir(data_dir.join("files")) else { return 0 };
        let mut removed = 0;
        for entry in entries.flatten() {
            let relative = format!("files/{}", entry.file_name().to_string_lossy());
            if !live.contains(&relative) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => removed += 1,
                    Err(e) => eprintln!("warning: could not remove {}: {e}", entry.path().display()),
                }
            }
        }
        removed
    })
    .await
    .unwrap_or(0);
    Ok(removed)
}
