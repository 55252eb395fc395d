//! The adapters API: upload (multipart), list, show, delete, load and unload; and the
//! operator's list of every adapter (where each is, who pins it), publishing, pinning and
//! unpinning. Files live under `DATA_DIR/adapters/<id>/`, the metadata in the
//! database.
//!
//! An upload is written to a scratch directory under the data directory, parsed and validated
//! against the base model there (once: a manifest of what was validated is written next to the
//! files, and later loads read that instead of the PEFT config), moved into place with one
//! rename, and only then recorded, in the same transaction that checks and consumes the owner's
//! quota: a failed upload leaves nothing behind, and no row ever points at missing or unchecked
//! files. A body that stalls is cut with 408 and its scratch files removed; each key may run a
//! few uploads at once. Validation and file I/O run on the background pool (low CPU priority). A deleted version's
//! files stay until the last request using it has finished.

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

use super::body::BodyClock;
use super::business::{audit, audit_as};
use super::{ApiError, AppState, authorize, json_body, principal};
use crate::memory::{AdapterLocation, AdapterRef, Residency};
use crate::runtime::{HoldError, Holder};
use crate::store::{AdapterRecord, NewAdapter, Scope};

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/adapters", web::post().to(upload))
        .route("/v1/adapters", web::get().to(list))
        .route("/v1/adapters/{name}", web::get().to(show))
        .route("/v1/adapters/{name}", web::delete().to(delete))
        .route("/v1/adapters/{name}/load", web::post().to(load))
        .route("/v1/adapters/{name}/unload", web::post().to(unload))
        .route("/admin/adapters/publish", web::post().to(publish))
        .route("/admin/adapters/pin", web::post().to(pin))
        .route("/admin/adapters/unpin", web::post().to(unpin))
        .route("/admin/adapters", web::get().to(list_all));
}

/// Largest `adapter_config.json` accepted.
const MAX_CONFIG_BYTES: usize = 1 << 20;

/// Who owns what a request uploads or changes: a tenant (with the adapters scope), or the
/// operator (`""`, with the admin key).
struct Owner {
    id: String,
    /// The key used, for the per-key upload cap.
    key_id: String,
    /// The tenant (its limits, its weight), or `None` for the operator.
    tenant: Option<crate::store::Tenant>,
}

impl Owner {
    /// Who this is, in words.
    fn describe(&self) -> String {
        match &self.tenant {
            Some(t) => format!("tenant `{}`", t.name),
            None => "the operator".into(),
        }
    }

    fn limits(&self) -> crate::store::TenantLimits {
        self.tenant.as_ref().map(|t| t.limits()).unwrap_or_default()
    }

    /// Who pins what this owner loads, and how many pages of each pool its pins may take: the
    /// tenant's `max_pinned_pages`, else the server's default share; the operator's pins are
    /// bounded by the pool's share for pins only.
    fn holder(&self, state: &AppState) -> Holder {
        let max_pages = match &self.tenant {
            None => usize::MAX,
            Some(t) => match t.max_pinned_pages {
                Some(max) => usize::try_from(max).unwrap_or(0),
                None => state.serving.pool_shape().total_pages.saturating_mul(state.settings.tenant_pinned_percent.min(100) as usize) / 100,
            },
        };
        Holder { id: self.id.as_str().into(), max_pages }
    }
}

async fn owner(req: &HttpRequest, state: &AppState) -> Result<Owner, ApiError> {
    let found = match principal(req, state, Scope::Adapters).await {
        Ok(p) => p,
        // The operator's key has only the admin scope.
        Err(ApiError::Forbidden(_)) => principal(req, state, Scope::Admin).await.map_err(|_| ApiError::Forbidden("adapters"))?,
        Err(e) => return Err(e),
    };
    let key_id = found.key.id.clone();
    match &found.tenant {
        Some((tenant, _)) => Ok(Owner { id: tenant.id.clone(), key_id, tenant: Some(tenant.clone()) }),
        None => Ok(Owner { id: String::new(), key_id, tenant: None }),
    }
}

// ---------------------------------------------------------------------------------------------
// Uploads in flight

/// Uploads running per key.
#[derive(Debug, Default)]
pub struct Uploads {
    running: Mutex<HashMap<String, u32>>,
}

/// One running upload of a key; the count drops with it.
pub(super) struct UploadSlot<'a> {
    uploads: &'a Uploads,
    key: String,
}

impl Uploads {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u32>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn enter(&self, key: &str, max: u32) -> Result<UploadSlot<'_>, ApiError> {
        let mut running = self.lock();
        let n = running.entry(key.to_string()).or_default();
        if *n >= max {
            return Err(ApiError::RateLimited { message: format!("this key already runs {n} uploads, the most it may at once"), retry_after: 1 });
        }
        *n += 1;
        Ok(UploadSlot { uploads: self, key: key.to_string() })
    }
}

impl Drop for UploadSlot<'_> {
    fn drop(&mut self) {
        let mut running = self.uploads.lock();
        if let Some(n) = running.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                running.remove(&self.key);
            }
        }
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

    /// Version `id` was deleted: its files go now (the directory is returned for the caller to
    /// remove, off the async threads), or when its last user finishes.
    #[must_use]
    pub fn retire(&self, id: &str, dir: PathBuf) -> Option<PathBuf> {
        let mut b = self.lock();
        b.retired.insert(id.to_string());
        if b.users.get(id).copied().unwrap_or(0) == 0 {
            Some(dir)
        } else {
            b.pending.insert(id.to_string(), dir);
            None
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
                // The last request on a deleted version ended, maybe on an async thread.
                let _ = std::thread::Builder::new().name("remove-adapter".into()).spawn(move || remove_dir(&dir));
            }
        }
    }
}

pub(super) fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        eprintln!("warning: could not remove {}: {e}", dir.display());
    }
}

/// Removes the directories of deleted versions, on the background pool.
async fn remove_dirs(state: &AppState, dirs: Vec<PathBuf>) {
    if dirs.is_empty() {
        return;
    }
    // Refused only when the pool is saturated; then a thread of its own does it.
    if let Err(ApiError::Overloaded { .. }) = state
        .background
        .run({
            let dirs = dirs.clone();
            move || dirs.iter().for_each(|d| remove_dir(d))
        })
        .await
    {
        let _ = std::thread::Builder::new().name("remove-adapter".into()).spawn(move || dirs.iter().for_each(|d| remove_dir(d)));
    }
}

/// What [`sweep`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Adapter directories kept (live in the database).
    pub kept: usize,
    /// Directories removed: no live version names them.
    pub orphans: usize,
    /// Live versions written before manifests existed, validated now and given one.
    pub validated: usize,
}

/// At start: removes what a crash may have left (scratch uploads, files of adapters that are
/// not live in the database) and gives live adapters uploaded before manifests existed their
/// manifest, validating them once. Runs before the server takes requests.
pub async fn sweep(
    data_dir: &Path,
    store: &crate::store::Store,
    shape: loraplex_adapters::BaseShape,
    limits: loraplex_adapters::AdapterLimits,
) -> anyhow::Result<Swept> {
    let live: HashSet<String> = store.live_adapter_blobs().await?.into_iter().collect();
    let data_dir = data_dir.to_path_buf();
    let swept = tokio::task::spawn_blocking(move || {
        let _ = std::fs::remove_dir_all(data_dir.join("uploads"));
        let mut swept = Swept::default();
        let Ok(entries) = std::fs::read_dir(data_dir.join("adapters")) else { return swept };
        for entry in entries.flatten() {
            let blob = format!("adapters/{}", entry.file_name().to_string_lossy());
            if !live.contains(&blob) {
                remove_dir(&entry.path());
                swept.orphans += 1;
                continue;
            }
            swept.kept += 1;
            let dir = entry.path();
            if !dir.join(loraplex_adapters::MANIFEST_FILE).is_file() {
                match LoraAdapter::load_with_manifest(&dir, &shape, &limits).and_then(|(_, m)| m.write(&dir)) {
                    Ok(()) => swept.validated += 1,
                    Err(e) => eprintln!("warning: adapter files {} do not validate: {e}", dir.display()),
                }
            }
        }
        swept
    })
    .await?;
    Ok(swept)
}

// ---------------------------------------------------------------------------------------------
// Upload

/// A scratch directory removed on drop unless kept.
pub(super) struct Scratch(pub(super) Option<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            remove_dir(&dir);
        }
    }
}

/// Reads one multipart field into memory, refusing more than `limit` bytes.
pub(super) async fn read_small(clock: &BodyClock, field: &mut actix_multipart::Field, what: &str, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut out = Vec::new();
    while let Some(chunk) = field.next().await {
        let chunk = chunk.map_err(|e| clock.error(|| ApiError::Invalid(format!("reading `{what}`: {e}"))))?;
        if out.len().saturating_add(chunk.len()) > limit {
            return Err(ApiError::TooLarge(format!("`{what}` is larger than {limit} bytes")));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Bytes of `weights` gathered before each write to disk.
const WRITE_CHUNK: usize = 1 << 20;

/// Streams the form field `what` into `path` (written on the background pool, a megabyte at a
/// time), refusing more than `limit` bytes; returns its size.
pub(super) async fn write_field(
    state: &AppState,
    clock: &BodyClock,
    field: &mut actix_multipart::Field,
    what: &str,
    path: PathBuf,
    limit: u64,
) -> Result<u64, ApiError> {
    let io = |e: std::io::Error| ApiError::Internal(format!("writing the upload: {e}"));
    let mut file = Some(state.background.run(move || std::fs::File::create(path)).await?.map_err(io)?);
    let mut size = 0u64;
    let mut buffer = Vec::with_capacity(WRITE_CHUNK);
    loop {
        let chunk = field.next().await;
        let done = chunk.is_none();
        if let Some(chunk) = chunk {
            let chunk = chunk.map_err(|e| clock.error(|| ApiError::Invalid(format!("reading `{what}`: {e}"))))?;
            size = size.saturating_add(chunk.len() as u64);
            if size > limit {
                return Err(ApiError::TooLarge(format!("`{what}` is larger than the limit of {limit} bytes")));
            }
            buffer.extend_from_slice(&chunk);
        }
        if buffer.len() >= WRITE_CHUNK || (done && !buffer.is_empty()) {
            let (mut f, data) = (file.take().ok_or_else(|| ApiError::Internal("the upload file is gone".into()))?, std::mem::take(&mut buffer));
            file = Some(
                state
                    .background
                    .run(move || {
                        use std::io::Write;
                        f.write_all(&data).map(|()| f)
                    })
                    .await?
                    .map_err(io)?,
            );
        }
        if done {
            break;
        }
    }
    if let Some(f) = file {
        state.background.run(move || f.sync_all()).await?.map_err(io)?;
    }
    Ok(size)
}

/// What validating an upload found.
struct Checked {
    rank: i64,
    targets: String,
    content_hash: String,
}

async fn upload(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let _permit = admit_tenant_request(&state, &owner).await?;
    let _slot = state.uploads.enter(&owner.key_id, state.settings.max_uploads_per_key)?;
    let (payload, clock) = super::body::paced(payload, &state.settings);
    let mut form = Multipart::new(req.headers(), payload);
    let scratch_root = state.data_dir.join("uploads");
    let dir = scratch_root.join(crate::store::random_id("up"));
    let created = dir.clone();
    state
        .background
        .run(move || std::fs::create_dir_all(&scratch_root).and_then(|()| std::fs::create_dir(&created)))
        .await?
        .map_err(|e| ApiError::Internal(format!("creating the upload directory: {e}")))?;
    // From here on, every way out removes the scratch files.
    let mut scratch = Scratch(Some(dir.clone()));

    let max_weights = state.settings.max_upload_bytes;
    let (mut name, mut config, mut weights) = (None, None, None);
    while let Some(field) = form.next().await {
        let mut field = field.map_err(|e| clock.error(|| ApiError::Invalid(format!("malformed multipart body: {e}"))))?;
        let field_name = field.name().unwrap_or_default().to_string();
        match field_name.as_str() {
            "name" => {
                let bytes = read_small(&clock, &mut field, "name", 256).await?;
                name = Some(String::from_utf8(bytes).map_err(|_| ApiError::Invalid("`name` is not UTF-8".into()))?.trim().to_string());
            }
            "config" => config = Some(read_small(&clock, &mut field, "config", MAX_CONFIG_BYTES).await?),
            "weights" if weights.is_some() => return Err(ApiError::Invalid("the form has two `weights` fields".into())),
            "weights" => weights = Some(write_field(&state, &clock, &mut field, "weights", dir.join("adapter_model.safetensors"), max_weights).await?),
            other => {
                let other: String = other.chars().take(64).collect();
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
    let config = config.ok_or_else(|| ApiError::Invalid("the form has no `config` field (adapter_config.json)".into()))?;
    let weights = weights.ok_or_else(|| ApiError::Invalid("the form has no `weights` field (adapter_model.safetensors)".into()))?;
    let bytes = i64::try_from((config.len() as u64).saturating_add(weights)).unwrap_or(i64::MAX);
    // A cheap early look at the quota, before the work of validating; the insert checks again.
    let limits = owner.limits();
    let (count, used) = state.store.adapter_footprint(&owner.id).await?;
    if limits.max_adapters.is_some_and(|max| count >= max) && state.store.adapter(&owner.id, &name).await?.is_none()
        || limits.max_adapter_bytes.is_some_and(|max| used.saturating_add(bytes) > max)
    {
        let quota = crate::store::TenantLimits { max_adapters: limits.max_adapters, max_adapter_bytes: limits.max_adapter_bytes, ..Default::default() };
        return Err(quota_error(count, used, bytes, &quota));
    }

    // Parse and validate against the base model, once, and keep what was validated.
    let (shape, mut adapter_limits) = (*state.serving.base_shape(), *state.serving.adapter_limits());
    adapter_limits.max_file_bytes = adapter_limits.max_file_bytes.min(max_weights);
    let check_dir = dir.clone();
    let checked = state
        .background
        .run(move || -> Result<Checked, String> {
            std::fs::write(check_dir.join("adapter_config.json"), &config).map_err(|e| format!("writing the upload: {e}"))?;
            let (adapter, manifest) = LoraAdapter::load_with_manifest(&check_dir, &shape, &adapter_limits).map_err(|e| e.to_string())?;
            manifest.write(&check_dir).map_err(|e| e.to_string())?;
            let targets: Vec<&str> = adapter.target_modules().into_iter().map(|t| t.hf_name()).collect();
            Ok(Checked {
                rank: adapter.modules().map(|m| m.rank).max().unwrap_or(0) as i64,
                targets: targets.join(","),
                content_hash: adapter.content_hash_hex(),
            })
        })
        .await?
        .map_err(|e| ApiError::Invalid(format!("the adapter does not fit the base model: {}", e.replace(&dir.display().to_string(), "upload"))))?;

    let blob_id = crate::store::random_id("blob");
    let blob = format!("adapters/{blob_id}");
    // Into the adapter store (and this replica's directory) before the row names it.
    state.adapter_files.publish(&state.background, &dir, &blob).await?;
    scratch.0 = Some(state.adapter_files.dir(&blob));
    let new = NewAdapter {
        owner: owner.id.clone(),
        name,
        rank: checked.rank,
        targets: checked.targets,
        bytes,
        content_hash: checked.content_hash,
        blob: blob.clone(),
        base_model: state.base.name.clone(),
        base_shape: state.base.shape.clone(),
    };
    let record = match state.store.insert_adapter(&new, &limits).await {
        Ok(record) => record,
        Err(e) => {
            state.adapter_files.forget(&blob);
            state.adapter_files.remove(&blob).await;
            return Err(e.into());
        }
    };
    // Recorded: the files are the adapter's now.
    scratch.0 = None;
    let detail = json!({"version": record.version, "bytes": record.bytes, "rank": record.rank, "content_hash": record.content_hash});
    audit_as(&state, &owner.id, &owner.key_id, &owner.id, "adapter.upload", &record.name, detail).await;
    Ok(HttpResponse::Created().json(record_json(&state.base, &record)))
}

fn quota_error(count: i64, used: i64, bytes: i64, limits: &crate::store::TenantLimits) -> ApiError {
    match (limits.max_adapters, limits.max_adapter_bytes) {
        (Some(max), _) if count >= max => ApiError::Quota(format!("adapter limit reached: {count} of {max}; delete one first")),
        (_, Some(max)) => {
            ApiError::Quota(format!("adapter storage limit: {used} bytes used, this upload is {bytes}, the limit is {max}; delete an adapter first"))
        }
        _ => ApiError::Quota("adapter quota reached".into()),
    }
}

/// An adapter version as the API shows it, with whether this server's base model can use it.
fn record_json(base: &super::BaseModel, r: &AdapterRecord) -> serde_json::Value {
    let unusable = base.unusable(r);
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
        "base_model": r.base_model,
        "usable": unusable.is_none(),
        "unusable_reason": unusable,
    })
}

async fn list(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let data: Vec<_> = state.store.visible_adapters(&owner.id).await?.iter().map(|r| record_json(&state.base, r)).collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

fn not_found(name: &str) -> ApiError {
    ApiError::NotFound(format!("adapter `{name}`"))
}

async fn show(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let latest = state.store.visible_adapter(&owner.id, &name).await?.ok_or_else(|| not_found(&name))?;
    let versions: Vec<_> = state.store.adapter_versions(&latest.owner, &latest.name).await?.iter().map(|r| record_json(&state.base, r)).collect();
    let mut body = record_json(&state.base, &latest);
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
    let mut gone = Vec::new();
    for r in &deleted {
        state.serving.unload_adapter(r.id.as_str().into(), owner.id.as_str().into(), true).await;
        gone.extend(retire(&state, r));
        state.adapter_files.remove(&r.blob).await;
    }
    remove_dirs(&state, gone).await;
    let versions: Vec<i64> = deleted.iter().map(|r| r.version).collect();
    audit_as(&state, &owner.id, &owner.key_id, &owner.id, "adapter.delete", &name, json!({"versions": versions})).await;
    Ok(HttpResponse::Ok().json(json!({"name": &*name, "deleted_versions": versions})))
}

/// A deleted version leaves this replica: new requests refuse it, and its files go now (the
/// directory returned) or once the requests running on it finish.
#[must_use]
pub(super) fn retire(state: &AppState, r: &AdapterRecord) -> Option<PathBuf> {
    state.adapter_files.forget(&r.blob);
    state.metrics.forget_adapter(&r.id);
    state.blobs.retire(&r.id, state.adapter_files.dir(&r.blob))
}

/// The local directory of `record`'s files, fetched from the adapter store and verified first
/// when this replica has no copy.
pub(super) async fn adapter_dir(state: &AppState, record: &AdapterRecord) -> Result<PathBuf, ApiError> {
    let (shape, limits) = (*state.serving.base_shape(), *state.serving.adapter_limits());
    let verify = move || -> super::objects::Verify {
        Arc::new(move |dir: &Path| LoraAdapter::load_validated(dir, &shape, &limits).map(|a| a.content_hash_hex()).map_err(|e| e.to_string()))
    };
    let max_bytes = u64::try_from(record.bytes).unwrap_or(0);
    state.metrics.name_adapter(&record.id, &record.name);
    state.adapter_files.local_dir(&state.background, &record.blob, &record.content_hash, max_bytes, verify).await
}

fn residency_name(r: &Residency) -> String {
    match r {
        Residency::Absent => "absent".into(),
        Residency::Loading => "loading".into(),
        Residency::Staged => "staged".into(),
        Residency::Copying => "copying".into(),
        Residency::Resident => "resident".into(),
        Residency::Failed(e) => format!("failed: {e}"),
    }
}

/// A tenant's uploads, loads and unloads count against its request limits (requests per minute,
/// concurrency), so that a storm of them is bounded like any other traffic.
async fn admit_tenant_request(state: &AppState, owner: &Owner) -> Result<Option<super::limits::Permit>, ApiError> {
    let Some(tenant) = &owner.tenant else { return Ok(None) };
    let mut permit = state.limiter.admit(&tenant.id, &tenant.limits()).await.inspect_err(|_| state.metrics.limited(&tenant.name))?;
    permit.reserve(0).await?;
    Ok(Some(permit))
}

fn hold_error(e: HoldError) -> ApiError {
    match e {
        HoldError::HolderCap { .. } => ApiError::RateLimited { message: e.to_string(), retry_after: 60 },
        HoldError::PoolShare { .. } => ApiError::Overloaded { message: e.to_string(), retry_after: 10 },
    }
}

/// Pins the latest version in every worker's pool on behalf of the caller (waiting up to a
/// few seconds for it to arrive): requests for it never wait for a load. The pin is the
/// caller's: only the caller's unload lets it go, and its pages count against the caller's
/// cap.
async fn load(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let _permit = admit_tenant_request(&state, &owner).await?;
    let record = state.store.visible_adapter(&owner.id, &name).await?.ok_or_else(|| not_found(&name))?;
    let _guard = state.blobs.enter(&record.id).ok_or_else(|| not_found(&name))?;
    let res = pin_latest(&state, &record, owner.holder(&state)).await?;
    audit_as(&state, &owner.id, &owner.key_id, &record.owner, "adapter.load", &record.name, json!({"version": record.version})).await;
    Ok(res)
}

/// Pins `record` in every worker's pool for `holder`, waiting a few seconds for it to arrive:
/// 200 with `held: true` once it is resident and held everywhere, else 202 with `held: false`:
/// still on its way into some pool, pinned only where it already was; asking again pins the
/// rest once placed.
async fn pin_latest(state: &AppState, record: &AdapterRecord, holder: Holder) -> Result<HttpResponse, ApiError> {
    let name = &record.name;
    if let Some(why) = state.base.unusable(record) {
        return Err(ApiError::Conflict(why));
    }
    let adapter = AdapterRef::validated(record.id.as_str(), adapter_dir(state, record).await?).for_owner(&record.owner);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut recorded = false;
    loop {
        let mut states = Vec::new();
        for s in state.serving.load_adapter(adapter.clone(), Some(holder.clone())).await {
            states.push(s.map_err(hold_error)?);
        }
        if let Some(Residency::Failed(e)) = states.iter().find(|s| matches!(s, Residency::Failed(_))) {
            return Err(ApiError::Internal(format!("adapter `{name}` could not be loaded: {e}")));
        }
        if !recorded {
            // Within the holder's caps: recorded, so that the next start restores it, even if it
            // is still on its way into some pool now.
            state.store.record_pin(&record.id, &holder.id).await?;
            recorded = true;
        }
        let names: Vec<String> = states.iter().map(residency_name).collect();
        if !states.is_empty() && states.iter().all(|s| *s == Residency::Resident) {
            return Ok(HttpResponse::Ok().json(json!({"name": record.name, "version": record.version, "workers": names, "held": true})));
        }
        if std::time::Instant::now() > deadline {
            // Still on its way (the pool may be full of running requests): not held there yet.
            return Ok(HttpResponse::Accepted().json(json!({"name": record.name, "version": record.version, "workers": names, "held": false})));
        }
        actix_web::rt::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Restores the pins recorded before the last stop (see [`pin_latest`]): each in every worker's
/// pool, for its holder and within the holder's caps as they are now; a pin of an adapter this
/// base model cannot use is skipped. Runs in the background; returns how many pins it restores.
pub async fn restore_pins(state: &AppState) -> Result<usize, ApiError> {
    let pins = state.store.pins().await?;
    let mut restored = 0;
    for (record, holder) in pins {
        if let Some(why) = state.base.unusable(&record) {
            eprintln!("warning: a pin is not restored: {why}");
            continue;
        }
        let tenant = if holder.is_empty() { None } else { state.store.tenant(&holder).await? };
        if !holder.is_empty() && tenant.is_none() {
            continue;
        }
        let owner = Owner { id: holder, key_id: String::new(), tenant };
        let holder = owner.holder(state);
        let state = state.clone();
        restored += 1;
        actix_web::rt::spawn(async move {
            // Not while the adapter is being deleted.
            let Some(_guard) = state.blobs.enter(&record.id) else { return };
            // A few minutes for the pools to make room; the pin is kept for the next start.
            let deadline = std::time::Instant::now() + Duration::from_secs(300);
            while std::time::Instant::now() < deadline {
                match pin_latest(&state, &record, holder.clone()).await {
                    Ok(res) if res.status() == actix_web::http::StatusCode::OK => return,
                    Ok(_) => {}
                    Err(e) => {
                        eprintln!("warning: the pin of adapter `{}` for {} is not restored: {e}", record.label(), owner.describe());
                        return;
                    }
                }
                actix_web::rt::time::sleep(Duration::from_secs(1)).await;
            }
            eprintln!("warning: the pin of adapter `{}` for {} found no room in some pool", record.label(), owner.describe());
        });
    }
    Ok(restored)
}

/// Lets the caller's pin of an adapter go; pins of others (the operator's pin of a published
/// adapter) stay.
async fn unload(req: HttpRequest, state: web::Data<AppState>, name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    let owner = owner(&req, &state).await?;
    let _permit = admit_tenant_request(&state, &owner).await?;
    let record = state.store.visible_adapter(&owner.id, &name).await?.ok_or_else(|| not_found(&name))?;
    let mut released = state.store.forget_pins(&record.owner, &record.name, &owner.id).await?;
    for v in state.store.adapter_versions(&record.owner, &record.name).await? {
        released |= state.serving.unload_adapter(v.id.as_str().into(), owner.id.as_str().into(), false).await;
    }
    audit_as(&state, &owner.id, &owner.key_id, &record.owner, "adapter.unload", &record.name, json!({"released": released})).await;
    Ok(HttpResponse::Ok().json(json!({"name": record.name, "released": released})))
}

/// An adapter as the operator names it: its owner and name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminAdapter {
    /// The owning tenant's id; absent for the operator's own adapters.
    tenant_id: Option<String>,
    name: String,
}

/// Pins the latest version of any tenant's adapter (or the operator's) in every worker's pool
/// as the operator: it stays resident until the operator unpins it, whatever the tenant does.
/// The operator's pins are bounded only by the pool's share for pins.
async fn pin(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let b: AdminAdapter = json_body(&state, payload).await?;
    let owner = b.tenant_id.unwrap_or_default();
    let record = state.store.adapter(&owner, &b.name).await?.ok_or_else(|| not_found(&b.name))?;
    let _guard = state.blobs.enter(&record.id).ok_or_else(|| not_found(&b.name))?;
    let res = pin_latest(&state, &record, Holder { id: "".into(), max_pages: usize::MAX }).await?;
    audit(&state, &key, &record.owner, "adapter.pin", &record.name, json!({"version": record.version})).await;
    Ok(res)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Unpin {
    tenant_id: Option<String>,
    name: String,
    /// Whose pin to let go: a tenant's id; absent for the operator's own.
    holder: Option<String>,
}

/// Lets one holder's pins of every version of an adapter go: the operator's own, or (with
/// `holder`) a tenant's, as an operator freeing pool pages would.
async fn unpin(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let b: Unpin = json_body(&state, payload).await?;
    let owner = b.tenant_id.unwrap_or_default();
    let versions = state.store.adapter_versions(&owner, &b.name).await?;
    if versions.is_empty() {
        return Err(not_found(&b.name));
    }
    let holder: Arc<str> = b.holder.as_deref().unwrap_or_default().into();
    let mut released = state.store.forget_pins(&owner, &b.name, &holder).await?;
    for v in &versions {
        released |= state.serving.unload_adapter(v.id.as_str().into(), holder.clone(), false).await;
    }
    audit(&state, &key, &owner, "adapter.unpin", &b.name, json!({"holder": &*holder, "released": released})).await;
    Ok(HttpResponse::Ok().json(json!({"name": b.name, "tenant_id": owner, "holder": &*holder, "released": released})))
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

/// Every tenant's adapters and the operator's: the latest version of each, with how many live
/// versions it has, their bytes together, the owner's name, where the latest version is on each
/// worker, and who pins any of its versions.
async fn list_all(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    authorize(&req, &state, Scope::Admin).await?;
    let names: HashMap<String, String> = state.store.tenants().await?.into_iter().map(|t| (t.id, t.name)).collect();
    // Versions come ordered by owner, name and version: one run per adapter, its latest last.
    let versions = state.store.all_adapter_versions().await?;
    let keys: Arc<[Arc<str>]> = versions.iter().map(|v| Arc::from(v.id.as_str())).collect();
    let workers = state.serving.locate_adapters(keys).await;
    let mut data: Vec<serde_json::Value> = Vec::new();
    let mut first = 0;
    for run in versions.chunk_by(|a, b| a.owner == b.owner && a.name == b.name) {
        let (start, end) = (first, first + run.len());
        first = end;
        let Some(latest) = run.last() else { continue };
        let mut row = record_json(&state.base, latest);
        row["versions"] = run.len().into();
        row["bytes_all_versions"] = run.iter().fold(0i64, |a, v| a.saturating_add(v.bytes)).into();
        row["owner_name"] = names.get(&latest.owner).cloned().map_or(serde_json::Value::Null, Into::into);
        row["residency"] = workers.iter().map(|w| residency_json(w.worker, w.locations.as_ref().map(|l| &l[end - 1]))).collect::<Vec<_>>().into();
        row["pinned_by"] = pinned_by_json(run, &workers, start, &names).into();
        data.push(row);
    }
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// One worker's tier for an adapter version (`unknown` while the worker has no engine).
fn residency_json(worker: usize, location: Option<&AdapterLocation>) -> serde_json::Value {
    let mut v = match location {
        Some(l) => serde_json::to_value(&l.location).unwrap_or_default(),
        None => json!({"tier": "unknown"}),
    };
    v["worker"] = worker.into();
    v
}

/// Who pins any version of one adapter on any worker: one entry per holder and version, the
/// operator as `tenant_id: null`.
fn pinned_by_json(run: &[AdapterRecord], workers: &[crate::runtime::WorkerLocations], start: usize, names: &HashMap<String, String>) -> Vec<serde_json::Value> {
    let mut seen: std::collections::BTreeSet<(i64, Arc<str>)> = std::collections::BTreeSet::new();
    for w in workers {
        let Some(locations) = &w.locations else { continue };
        for (v, l) in run.iter().zip(&locations[start..start + run.len()]) {
            seen.extend(l.pinned_by.iter().map(|h| (v.version, h.clone())));
        }
    }
    seen.into_iter()
        .map(|(version, holder)| {
            let tenant = (!holder.is_empty()).then(|| holder.to_string());
            let name = tenant.as_ref().and_then(|t| names.get(t).cloned());
            json!({"tenant_id": tenant, "tenant": name, "version": version})
        })
        .collect()
}

async fn publish(req: HttpRequest, state: web::Data<AppState>, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    let b: Publish = json_body(&state, payload).await?;
    let owner = b.tenant_id.unwrap_or_default();
    if !state.store.publish_adapter(&owner, &b.name, b.public).await? {
        return Err(not_found(&b.name));
    }
    audit(&state, &key, &owner, if b.public { "adapter.publish" } else { "adapter.unpublish" }, &b.name, json!({})).await;
    Ok(HttpResponse::Ok().json(json!({"name": b.name, "tenant_id": owner, "public": b.public})))
}
