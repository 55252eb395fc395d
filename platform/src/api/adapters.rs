//! The adapters API: upload (multipart), list, show, delete, load and unload; and the
//! operator's publishing. Files live under `DATA_DIR/adapters/<id>/`, the metadata in the
//! database.
//!
//! An upload is written to a scratch directory under the data directory, validated against the
//! base model there, moved into place with one rename, and only then recorded: a failed upload
//! leaves nothing behind, and no row ever points at missing or unchecked files. A deleted
//! version's files stay until the last request using it has finished.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_multipart::Multipart;
use actix_web::{HttpRequest, HttpResponse, web};
use futures::StreamExt;
use loraplex_adapters::LoraAdapter;
use serde::Deserialize;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::{ApiError, AppState, authorize, json_body};
use crate::memory::{AdapterRef, Residency};
use crate::store::{AdapterRecord, NewAdapter, Scope};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/adapters", web::post().to(upload))
        .route("/v1/adapters", web::get().to(list))
        .route("/v1/adapters/{name}", web::get().to(show))
        .route("/v1/adapters/{name}", web::delete().to(delete))
        .route("/v1/adapters/{name}/load", web::post().to(load))
        .route("/v1/adapters/{name}/unload", web::post().to(unload))
        .route("/admin/adapters/publish", web::post().to(publish));
}

/// Largest `adapter_config.json` accepted.
const MAX_CONFIG_BYTES: usize = 1 << 20;

/// Who owns what a request uploads or changes: a tenant (with the adapters scope), or the
/// operator (`""`, with the admin key).
struct Owner {
    id: String,
    limits: crate::store::TenantLimits,
}

async fn owner(req: &HttpRequest, state: &AppState) -> Result<Owner, ApiError> {
    let header_key = authorize(req, state, Scope::Adapters).await;
    let key = match header_key {
        Ok(k) => k,
        // The operator's key has only the admin scope.
        Err(ApiError::Forbidden(_)) => authorize(req, state, Scope::Admin).await.map_err(|_| ApiError::Forbidden("adapters"))?,
        Err(e) => return Err(e),
    };
    match key.tenant_id {
        Some(t) => {
            let tenant = state.store.tenant(&t).await?.ok_or(ApiError::BadKey)?;
            Ok(Owner { limits: tenant.limits(), id: tenant.id })
        }
        None => Ok(Owner { id: String::new(), limits: Default::default() }),
    }
}

// ---------------------------------------------------------------------------------------------
// Files of adapters in use

/// Which adapter versions requests are using, so that a deleted version's files stay until
/// they finish.
#[derive(Debug, Default)]
pub struct Blobs {
    inner: Mutex<BlobsInner>,
}

#[derive(Debug, Default)]
struct BlobsInner {
    users: HashMap<String, usize>,
    /// Deleted versions; those whose files are still there map to them.
    retired: HashSet<String>,
    pending: HashMap<String, PathBuf>,
}

/// A request's hold on an adapter version's files.
#[derive(Debug)]
pub struct BlobGuard {
    blobs: Arc<Blobs>,
    id: String,
}

impl Blobs {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BlobsInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds the files of version `id`; `None` if it was deleted.
    pub fn enter(self: &Arc<Self>, id: &str) -> Option<BlobGuard> {
        let mut b = self.lock();
        if b.retired.contains(id) {
            return None;
        }
        *b.users.entry(id.to_string()).or_default() += 1;
        Some(BlobGuard { blobs: self.clone(), id: id.to_string() })
    }

    /// Version `id` was deleted: its files go now, or when its last user finishes.
    pub fn retire(&self, id: &str, dir: PathBuf) {
        let mut b = self.lock();
        b.retired.insert(id.to_string());
        if b.users.get(id).copied().unwrap_or(0) == 0 {
            drop(b);
            remove_dir(&dir);
        } else {
            b.pending.insert(id.to_string(), dir);
        }
    }

    /// Versions whose files wait for requests to finish.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }
}

impl Drop for BlobGuard {
    fn drop(&mut self) {
        let mut b = self.blobs.lock();
        let left = match b.users.get_mut(&self.id) {
            Some(n) => {
                *n -= 1;
                *n
            }
            None => 0,
        };
        if left == 0 {
            b.users.remove(&self.id);
            if let Some(dir) = b.pending.remove(&self.id) {
                drop(b);
                remove_dir(&dir);
            }
        }
    }
}

fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("warning: could not remove {}: {e}", dir.display());
    }
}

/// Removes what a crash may have left: scratch uploads, and files of adapters that are not
/// live in the database.
pub async fn sweep(data_dir: &Path, store: &crate::store::Store) -> anyhow::Result<()> {
    let _ = std::fs::remove_dir_all(data_dir.join("uploads"));
    let live: HashSet<String> = store.live_adapter_blobs().await?.into_iter().collect();
    let root = data_dir.join("adapters");
    let Ok(entries) = std::fs::read_dir(&root) else { return Ok(()) };
    for entry in entries.flatten() {
        let blob = format!("adapters/{}", entry.file_name().to_string_lossy());
        if !live.contains(&blob) {
            remove_dir(&entry.path());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Upload

/// A scratch directory removed on drop unless kept.
struct Scratch(Option<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            remove_dir(&dir);
        }
    }
}

/// Reads one multipart field into memory, refusing more than `limit` bytes.
async fn read_small(field: &mut actix_multipart::Field, what: &str, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut out = Vec::new();
    while let Some(chunk) = field.next().await {
        let chunk = chunk.map_err(|e| ApiError::Invalid(format!("reading `{what}`: {e}")))?;
        if out.len() + chunk.len() > limit {
            return Err(ApiError::TooLarge(format!("`{what}` is larger than {limit} bytes")));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

async fn upload(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let mut form = Multipart::new(req.headers(), payload);
    let scratch_root = state.data_dir.join("uploads");
    std::fs::create_dir_all(&scratch_root).map_err(|e| ApiError::Internal(format!("creating {}: {e}", scratch_root.display())))?;
    let dir = scratch_root.join(crate::store::random_id("up"));
    std::fs::create_dir(&dir).map_err(|e| ApiError::Internal(format!("creating {}: {e}", dir.display())))?;
    let mut scratch = Scratch(Some(dir.clone()));

    let max_weights = state.settings.max_upload_bytes;
    let (mut name, mut config, mut weights) = (None, None, 0u64);
    while let Some(field) = form.next().await {
        let mut field = field.map_err(|e| ApiError::Invalid(format!("malformed multipart body: {e}")))?;
        let field_name = field.name().unwrap_or_default().to_string();
        match field_name.as_str() {
            "name" => {
                let bytes = read_small(&mut field, "name", 256).await?;
                name = Some(String::from_utf8(bytes).map_err(|_| ApiError::Invalid("`name` is not UTF-8".into()))?.trim().to_string());
            }
            "config" => config = Some(read_small(&mut field, "config", MAX_CONFIG_BYTES).await?),
            "weights" => {
                let path = dir.join("adapter_model.safetensors");
                let mut file = tokio::fs::File::create(&path).await.map_err(|e| ApiError::Internal(format!("creating {}: {e}", path.display())))?;
                weights = 0;
                while let Some(chunk) = field.next().await {
                    let chunk = chunk.map_err(|e| ApiError::Invalid(format!("reading `weights`: {e}")))?;
                    weights += chunk.len() as u64;
                    if weights > max_weights {
                        return Err(ApiError::TooLarge(format!("`weights` is larger than the limit of {max_weights} bytes")));
                    }
                    file.write_all(&chunk).await.map_err(|e| ApiError::Internal(format!("writing the upload: {e}")))?;
                }
                file.flush().await.map_err(|e| ApiError::Internal(format!("writing the upload: {e}")))?;
                file.sync_all().await.map_err(|e| ApiError::Internal(format!("writing the upload: {e}")))?;
            }
            other => {
                return Err(ApiError::Invalid(format!(
                    "unknown form field `{other}`: send `name`, `config` (adapter_config.json) and `weights` (adapter_model.safetensors)"
                )));
            }
        }
    }
    let name = name.ok_or_else(|| ApiError::Invalid("the form has no `name` field".into()))?;
    crate::store::validate_adapter_name(&name).map_err(ApiError::from)?;
    if *name == *state.model_name {
        return Err(ApiError::Conflict(format!("`{name}` is the base model's name")));
    }
    let (count, used) = state.store.adapter_footprint(&owner.id).await?;
    if let Some(max) = owner.limits.max_adapters
        && count >= max
        && state.store.adapter(&owner.id, &name).await?.is_none()
    {
        return Err(ApiError::RateLimited { message: format!("adapter limit reached: {count} of {max}; delete one first"), retry_after: 3600 });
    }
    let config = config.ok_or_else(|| ApiError::Invalid("the form has no `config` field (adapter_config.json)".into()))?;
    if !dir.join("adapter_model.safetensors").is_file() {
        return Err(ApiError::Invalid("the form has no `weights` field (adapter_model.safetensors)".into()));
    }
    std::fs::write(dir.join("adapter_config.json"), &config).map_err(|e| ApiError::Internal(format!("writing the upload: {e}")))?;
    let bytes = (config.len() as u64 + weights) as i64;
    if let Some(max) = owner.limits.max_adapter_bytes
        && used + bytes > max
    {
        return Err(ApiError::RateLimited {
            message: format!("adapter storage limit: {used} bytes used, this upload is {bytes}, the limit is {max}; delete an adapter first"),
            retry_after: 3600,
        });
    }

    // Validate against the base model, off the async threads.
    let (shape, limits) = (*state.serving.base_shape(), *state.serving.adapter_limits());
    let check_dir = dir.clone();
    let adapter = web::block(move || LoraAdapter::load(&check_dir, &shape, &limits))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::Invalid(format!("the adapter does not fit the base model: {}", e.to_string().replace(&dir.display().to_string(), "upload"))))?;
    let rank = adapter.modules().map(|m| m.rank).max().unwrap_or(0) as i64;
    let targets: Vec<&str> = adapter.target_modules().into_iter().map(|t| t.hf_name()).collect();
    let content_hash = adapter.content_hash_hex();
    drop(adapter);

    let blob_id = crate::store::random_id("blob");
    let blob = format!("adapters/{blob_id}");
    let target = state.data_dir.join(&blob);
    std::fs::create_dir_all(state.data_dir.join("adapters")).map_err(|e| ApiError::Internal(e.to_string()))?;
    std::fs::rename(&dir, &target).map_err(|e| ApiError::Internal(format!("moving the upload into place: {e}")))?;
    scratch.0 = Some(target.clone());
    let record = state.store.insert_adapter(&NewAdapter { owner: owner.id, name, rank, targets: targets.join(","), bytes, content_hash, blob }).await?;
    // Recorded: the files are the adapter's now.
    scratch.0 = None;
    Ok(HttpResponse::Created().json(record_json(&record)))
}

fn record_json(r: &AdapterRecord) -> serde_json::Value {
    json!({
        "id": r.id,
        "name": r.name,
        "version": r.version,
        "owner": if r.owner.is_empty() { None } else { Some(&r.owner) },
        "public": r.public != 0,
        "rank": r.rank,
        "targets": r.targets.split(',').collect::<Vec<_>>(),
        "bytes": r.bytes,
        "content_hash": r.content_hash,
        "created_at": r.created_at,
    })
}

async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let data: Vec<_> = state.store.visible_adapters(&owner.id).await?.iter().map(record_json).collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound(format!("adapter `{name}`"))
}

async fn show(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let latest = state.store.visible_adapter(&owner.id, &name).await?.ok_or_else(|| not_found(&name))?;
    let versions: Vec<_> = state.store.adapter_versions(&latest.owner, &latest.name).await?.iter().map(record_json).collect();
    let mut body = record_json(&latest);
    body["versions"] = versions.into();
    Ok(HttpResponse::Ok().json(body))
}

async fn delete(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    // Only the owner deletes; someone else's published adapter reads as unknown here.
    let deleted = state.store.delete_adapter(&owner.id, &name).await?;
    if deleted.is_empty() {
        return Err(not_found(&name));
    }
    for r in &deleted {
        state.serving.unload_adapter(r.id.as_str().into(), true).await;
        state.blobs.retire(&r.id, state.data_dir.join(&r.blob));
    }
    Ok(HttpResponse::Ok().json(json!({"name": &*name, "deleted_versions": deleted.iter().map(|r| r.version).collect::<Vec<_>>()})))
}

fn residency_name(r: &Residency) -> String {
    match r {
        Residency::Absent => "absent".into(),
        Residency::Loading => "loading".into(),
        Residency::Staged => "staged".into(),
        Residency::Resident => "resident".into(),
        Residency::Failed(e) => format!("failed: {e}"),
    }
}

/// Pins the latest version in every worker's pool (waiting up to a few seconds for it to
/// arrive): requests for it never wait for a load.
async fn load(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let record = state.store.visible_adapter(&owner.id, &name).await?.ok_or_else(|| not_found(&name))?;
    let _guard = state.blobs.enter(&record.id).ok_or_else(|| not_found(&name))?;
    let adapter = AdapterRef::new(record.id.as_str(), state.data_dir.join(&record.blob));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let states = state.serving.load_adapter(adapter.clone(), true).await;
        if let Some(Residency::Failed(e)) = states.iter().find(|s| matches!(s, Residency::Failed(_))) {
            return Err(ApiError::Internal(format!("adapter `{name}` could not be loaded: {e}")));
        }
        let names: Vec<String> = states.iter().map(residency_name).collect();
        if !states.is_empty() && states.iter().all(|s| *s == Residency::Resident) {
            return Ok(HttpResponse::Ok().json(json!({"name": record.name, "version": record.version, "workers": names, "held": true})));
        }
        if std::time::Instant::now() > deadline {
            // Still on its way (the pool may be full of running requests): it is held once placed.
            return Ok(HttpResponse::Accepted().json(json!({"name": record.name, "version": record.version, "workers": names, "held": false})));
        }
        actix_web::rt::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn unload(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let record = state.store.visible_adapter(&owner.id, &name).await?.ok_or_else(|| not_found(&name))?;
    let mut released = false;
    for v in state.store.adapter_versions(&record.owner, &record.name).await? {
        released |= state.serving.unload_adapter(v.id.as_str().into(), false).await;
    }
    Ok(HttpResponse::Ok().json(json!({"name": record.name, "released": released})))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Publish {
    /// The owning tenant's id; absent for the operator's own adapters.
    tenant_id: Option<String>,
    name: String,
    #[serde(default = "yes")]
    public: bool,
}

fn yes() -> bool {
    true
}

async fn publish(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let b: Publish = json_body(payload).await?;
    let owner = b.tenant_id.unwrap_or_default();
    if !state.store.publish_adapter(&owner, &b.name, b.public).await? {
        return Err(not_found(&b.name));
    }
    Ok(HttpResponse::Ok().json(json!({"name": b.name, "tenant_id": owner, "public": b.public})))
}
