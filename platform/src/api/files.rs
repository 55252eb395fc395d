//! OpenAI's Files API, for the Batch API: a tenant uploads a file of requests (`purpose:
//! batch`, one JSON request a line), and lists, reads and deletes its files, among them the output
//! and error files its batches wrote (`batch_output`). An upload is streamed to disk within
//! `--max-file-mb`, then every line is checked as its endpoint would check the request, on the
//! background pool; a file with invalid lines is refused with each line's problem. Files are
//! private to their tenant: another tenant's read as unknown (404). Their bytes live under the
//! data directory (`files/`), their records in the database.

use std::path::PathBuf;

use actix_multipart::Multipart;
use actix_web::{HttpRequest, HttpResponse, web};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::batch::lines::{self, Checked};
use super::infer::{self, Caller};
use super::{ApiError, AppState};
use crate::store::{FileRecord, Page, Scope, file_purpose, now_ms, random_id};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/files", web::post().to(upload))
        .route("/v1/files", web::get().to(list))
        .route("/v1/files/{id}", web::get().to(show))
        .route("/v1/files/{id}", web::delete().to(delete))
        .route("/v1/files/{id}/content", web::get().to(content));
}

/// Where a file's bytes live, relative to the data directory.
pub fn relative_path(id: &str) -> String {
    format!("files/{id}.jsonl")
}

/// OpenAI's file object.
pub fn file_json(f: &FileRecord) -> Value {
    json!({
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at / 1000,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "expires_at": null,
        "status_details": null,
    })
}

/// A scratch file removed on drop unless kept.
pub(super) struct Scratch(pub(super) Option<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(path) = self.0.take()
            && let Err(e) = std::fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("warning: could not remove {}: {e}", path.display());
        }
    }
}

/// A file name as a client may see it again: its last component, without control characters,
/// at most 255 characters.
fn clean_filename(name: &str) -> String {
    let last = name.rsplit(['/', '\\']).next().unwrap_or_default();
    let clean: String = last.chars().filter(|c| !c.is_control()).take(255).collect();
    if clean.trim().is_empty() { "upload.jsonl".into() } else { clean }
}

fn io_error(what: &'static str) -> impl Fn(std::io::Error) -> ApiError {
    move |e| ApiError::Internal(format!("{what}: {e}"))
}

async fn upload(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    // An upload counts against the tenant's requests like any other, and each key may run only
    // a few at once.
    let mut permit = state.limiter.admit(&caller.tenant.id, &caller.tenant.limits()).await.inspect_err(|_| state.metrics.limited(&caller.tenant.name))?;
    permit.reserve(0).await?;
    let _slot = state.uploads.enter(&caller.key_id, state.settings.max_uploads_per_key)?;
    let limits = state.settings.batch;
    let scratch_root = state.data_dir.join("uploads");
    let path = scratch_root.join(format!("{}.jsonl", random_id("file")));
    state.background.run(move || std::fs::create_dir_all(&scratch_root)).await?.map_err(io_error("creating the upload directory"))?;
    let mut scratch = Scratch(Some(path.clone()));

    let (payload, clock) = super::body::paced(payload, &state.settings);
    let mut form = Multipart::new(req.headers(), payload);
    let (mut purpose, mut file) = (None, None);
    while let Some(field) = form.next().await {
        let mut field = field.map_err(|e| clock.error(|| ApiError::Invalid(format!("malformed multipart body: {e}"))))?;
        let field_name = field.name().unwrap_or_default().to_string();
        match field_name.as_str() {
            "purpose" => {
                let bytes = super::adapters::read_small(&clock, &mut field, "purpose", 64).await?;
                purpose = Some(String::from_utf8_lossy(&bytes).trim().to_string());
            }
            "file" if file.is_some() => return Err(ApiError::Invalid("the form has two `file` fields".into())),
            "file" => {
                let name = clean_filename(field.content_disposition().and_then(|cd| cd.get_filename()).unwrap_or_default());
                let size = super::adapters::write_field(&state, &clock, &mut field, "file", path.clone(), limits.max_file_bytes).await?;
                file = Some((name, size));
            }
            other => {
                let other: String = other.chars().take(64).collect();
                return Err(ApiError::Invalid(format!("unknown form field `{other}`: send `purpose` (batch) and `file`")));
            }
        }
    }
    match purpose.as_deref() {
        Some(file_purpose::BATCH) => {}
        Some(other) => {
            let other: String = other.chars().take(64).collect();
            return Err(ApiError::Invalid(format!("`purpose` {other:?} is not supported: files here are the input of batches (`batch`)")));
        }
        None => return Err(ApiError::Invalid("the form has no `purpose` field (batch)".into())),
    }
    let (filename, bytes) = file.ok_or_else(|| ApiError::Invalid("the form has no `file` field".into()))?;
    let bytes = i64::try_from(bytes).map_err(|_| ApiError::TooLarge("the file is too large".into()))?;
    let checked_path = path.clone();
    let grammar = state.settings.grammar.clone();
    let checked = state
        .background
        .run(move || std::fs::File::open(&checked_path).and_then(|f| lines::check(f, &grammar)))
        .await?
        .map_err(io_error("reading the upload"))?;
    let requests = match checked {
        Checked::Valid { requests } => requests,
        Checked::Invalid { count, first } => {
            let shown: Vec<String> = first.iter().take(3).map(|l| format!("line {}: {}", l.line, l.message)).collect();
            let message = format!("{count} lines of the file are not valid requests ({}{})", shown.join("; "), if count > 3 { "; ..." } else { "" });
            return Err(ApiError::InvalidLines { message, lines: first });
        }
    };
    let id = random_id("file").replacen('_', "-", 1);
    let relative = relative_path(&id);
    let (from, to) = (path, state.data_dir.join(&relative));
    state
        .background
        .run(move || to.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| std::fs::rename(&from, &to)))
        .await?
        .map_err(io_error("moving the upload into place"))?;
    scratch.0 = Some(state.data_dir.join(&relative));
    // Into the shared store (in a cluster), before the row names it.
    state.adapter_files.put_file(&relative).await?;
    let record = FileRecord {
        id,
        tenant_id: caller.tenant.id.clone(),
        purpose: file_purpose::BATCH.into(),
        filename,
        bytes,
        lines: requests as i64,
        path: relative,
        created_at: now_ms(),
    };
    if let Err(e) = state.store.insert_file(&record, Some(i64::try_from(limits.max_tenant_file_bytes).unwrap_or(i64::MAX))).await {
        state.adapter_files.remove_file(&record.path).await;
        return Err(e.into());
    }
    scratch.0 = None;
    let detail = json!({"filename": record.filename, "bytes": record.bytes, "lines": record.lines});
    super::business::audit_as(&state, &caller.tenant.id, &caller.key_id, &caller.tenant.id, "file.upload", &record.id, detail).await;
    Ok(HttpResponse::Ok().json(file_json(&record)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    purpose: Option<String>,
    limit: Option<u32>,
    after: Option<String>,
    order: Option<String>,
}

/// Most rows one page of a listing holds.
pub const MAX_PAGE: u32 = 1000;

/// `limit` and `order` of a listing, checked.
pub fn page<'a>(limit: Option<u32>, default: u32, after: Option<&'a str>, order: Option<&str>) -> Result<Page<'a>, ApiError> {
    let limit = limit.unwrap_or(default);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::Invalid(format!("`limit` must be 1 to {MAX_PAGE}; given: {limit}")));
    }
    let ascending = match order {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(_) => return Err(ApiError::Invalid("`order` must be asc or desc".into())),
    };
    Ok(Page { after, limit: i64::from(limit) + 1, ascending })
}

/// OpenAI's list object over a page fetched one row long (to know whether more follow).
pub fn list_json<T>(mut rows: Vec<T>, limit: i64, id: impl Fn(&T) -> &str, json: impl Fn(&T) -> Value) -> Value {
    let has_more = rows.len() as i64 >= limit;
    rows.truncate((limit - 1).max(0) as usize);
    json!({
        "object": "list",
        "data": rows.iter().map(&json).collect::<Vec<_>>(),
        "first_id": rows.first().map(&id),
        "last_id": rows.last().map(&id),
        "has_more": has_more,
    })
}

async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let q: ListQuery = super::parse_query(&req)?;
    let page = page(q.limit, 100, q.after.as_deref(), q.order.as_deref())?;
    let rows = state.store.files(&caller.tenant.id, q.purpose.as_deref(), &page).await?;
    Ok(HttpResponse::Ok().json(list_json(rows, page.limit, |f| f.id.as_str(), file_json)))
}

async fn owned(state: &AppState, caller: &Caller, id: &str) -> Result<FileRecord, ApiError> {
    let shown: String = id.chars().take(80).collect();
    if id.len() > 128 {
        return Err(ApiError::NotFound(format!("file `{shown}`")));
    }
    state.store.file(&caller.tenant.id, id).await?.ok_or_else(|| ApiError::NotFound(format!("file `{shown}`")))
}

async fn show(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    Ok(HttpResponse::Ok().json(file_json(&owned(&state, &caller, &id).await?)))
}

/// Bytes read from disk per chunk of a download.
const READ_CHUNK: usize = 256 << 10;

async fn content(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    let record = owned(&state, &caller, &id).await?;
    let path = state.adapter_files.local_file(&state.background, &record.path, u64::try_from(record.bytes).unwrap_or(0)).await?;
    let file = state.background.run(move || std::fs::File::open(path)).await?.map_err(io_error("opening the file"))?;
    let pool = state.background.clone();
    let body = futures::stream::unfold(Some(file), move |file| {
        let pool = pool.clone();
        async move {
            let mut file = file?;
            let read = pool
                .run(move || {
                    use std::io::Read;
                    let mut buf = vec![0u8; READ_CHUNK];
                    let n = file.read(&mut buf)?;
                    buf.truncate(n);
                    Ok::<_, std::io::Error>((buf, file))
                })
                .await;
            match read {
                Ok(Ok((buf, _))) if buf.is_empty() => None,
                Ok(Ok((buf, file))) => Some((Ok(web::Bytes::from(buf)), Some(file))),
                // The status is sent already: cut the body short, which the client sees.
                Ok(Err(e)) => Some((Err(actix_web::error::ErrorInternalServerError(e)), None)),
                Err(e) => Some((Err(actix_web::error::ErrorServiceUnavailable(e.to_string())), None)),
            }
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("application/jsonl")
        .no_chunking(u64::try_from(record.bytes).unwrap_or(0))
        .insert_header(("content-disposition", format!("attachment; filename=\"{}\"", record.filename.replace(['"', '\\'], "_"))))
        .streaming(body))
}

async fn delete(req: HttpRequest, state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let caller = infer::caller(&req, &state, Scope::Inference).await?;
    owned(&state, &caller, &id).await?;
    let record = state.store.delete_file(&caller.tenant.id, &id).await?.ok_or_else(|| ApiError::NotFound(format!("file `{id}`")))?;
    let path = state.data_dir.join(&record.path);
    state
        .background
        .run(move || std::fs::remove_file(path))
        .await?
        .or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
        .map_err(io_error("removing the file"))?;
    state.adapter_files.remove_file(&record.path).await;
    super::business::audit_as(&state, &caller.tenant.id, &caller.key_id, &caller.tenant.id, "file.delete", &record.id, json!({"filename": record.filename}))
        .await;
    Ok(HttpResponse::Ok().json(json!({"id": record.id, "object": "file", "deleted": true})))
}
