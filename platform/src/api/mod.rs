//! The HTTP API (actix-web): OpenAI- and LoRAX-compatible inference, adapters, tenants and
//! keys, usage and billing, metrics. Every error goes through [`ApiError`].

mod adapters;
mod admin;
mod admission;
pub mod batch;
mod blocking;
mod body;
pub(crate) mod business;
pub mod cluster;
mod error;
pub mod files;
mod infer;
mod limits;
pub mod listen;
mod lorax;
mod metrics;
mod objects;
mod openai;
pub mod openapi;
mod peer;
mod serving;
pub mod structured;
pub mod tools;
mod ui;
mod usage;
pub mod validate;

use std::path::Path;
use std::sync::Arc;

use actix_web::{HttpRequest, HttpResponse, web};

pub use adapters::{Blobs, restore_pins, sweep};
pub use admission::{Admission, AdmissionConfig};
pub use blocking::BlockingPool;
pub use error::{ApiError, LORAX_ERROR_TYPES};
pub use limits::Limiter;
pub use metrics::{Metrics, StateTime};
pub use objects::{AdapterFiles, ObjectError};
pub use peer::{on_connect, request_id, shed_refused_bodies};
pub use serving::Serving;

use crate::store::{ApiKey, Ledger, Principal, Scope, Store};
use crate::tokenizer::Tokenizer;

/// How long an interactive request runs before its ledger row's opening is written (see
/// [`ApiSettings::open_row_after`]).
pub const OPEN_ROW_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// `loraplex serve`'s default [`ApiSettings::ledger_gather`].
pub const LEDGER_GATHER: std::time::Duration = std::time::Duration::from_millis(2);

/// Limits of the HTTP layer.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// Largest adapter weights file accepted by an upload.
    pub max_upload_bytes: u64,
    /// Most sequences one worker runs at once (reported as `max_lora`).
    pub max_running: usize,
    /// Admission: sequences queued or running on the server, and per tenant.
    pub admission: AdmissionConfig,
    /// Threads of the blocking pool, and the most jobs that may wait for one.
    pub blocking_threads: usize,
    pub blocking_queue: usize,
    /// A request body that sends nothing for this long is cut with 408.
    pub body_timeout: std::time::Duration,
    /// Bytes a second a body must keep up past its first `body_timeout` (see [`body`]).
    pub body_min_rate: u64,
    /// Uploads one key may run at once.
    pub max_uploads_per_key: u32,
    /// Live keys a tenant may hold when it mints its own.
    pub max_keys_per_tenant: u32,
    /// Percent of each pool a tenant without its own `max_pinned_pages` may pin.
    pub tenant_pinned_percent: u32,
    /// This server's name on the ledger rows it opens (see [`crate::store::Ledger`]).
    pub instance: String,
    /// An interactive request still running after this long gets its ledger row's opening
    /// (outcome `running`) written, so that a crash of this process leaves a trace of it;
    /// one that ends sooner is written once, when it ends. Zero: every row is opened, durably,
    /// before its request is queued.
    pub open_row_after: std::time::Duration,
    /// How long the ledger's writer gathers rows that arrive back to back before a commit
    /// (see [`Ledger::start`]).
    pub ledger_gather: std::time::Duration,
    /// What one structured-output grammar may cost to compile and to run.
    pub grammar: crate::grammar::GrammarLimits,
    /// The Batch API's bounds.
    pub batch: BatchSettings,
}

/// The Batch API's bounds.
#[derive(Debug, Clone, Copy)]
pub struct BatchSettings {
    /// Largest input file.
    pub max_file_bytes: u64,
    /// Most bytes of one tenant's live files.
    pub max_tenant_file_bytes: u64,
    /// Batches with work left, per tenant.
    pub max_active: u32,
    /// Batch lines in flight on the server.
    pub concurrency: u32,
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self { max_file_bytes: 200 << 20, max_tenant_file_bytes: 2 << 30, max_active: 16, concurrency: 32 }
    }
}

impl ApiSettings {
    /// The defaults of `loraplex serve`, for an instance named `instance`.
    pub fn new(instance: impl Into<String>) -> Self {
        Self {
            max_upload_bytes: 1 << 30,
            max_running: 256,
            admission: AdmissionConfig { max_pending: 4096, max_pending_per_tenant: 1024 },
            blocking_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            blocking_queue: 1024,
            body_timeout: std::time::Duration::from_secs(30),
            body_min_rate: 1024,
            max_uploads_per_key: 2,
            max_keys_per_tenant: 10,
            tenant_pinned_percent: 10,
            instance: instance.into(),
            open_row_after: OPEN_ROW_AFTER,
            ledger_gather: LEDGER_GATHER,
            grammar: crate::grammar::GrammarLimits::default(),
            batch: BatchSettings::default(),
        }
    }
}

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub ledger: Ledger,
    pub serving: Arc<dyn Serving>,
    pub tokenizer: Arc<Tokenizer>,
    /// The name clients use for the base model.
    pub model_name: Arc<str>,
    /// The base model as adapters record it (its name and shape).
    pub base: Arc<BaseModel>,
    pub data_dir: Arc<Path>,
    pub limiter: Arc<Limiter>,
    pub metrics: Arc<Metrics>,
    pub blobs: Arc<Blobs>,
    /// Where adapter files live (the data directory, or an object store every replica shares).
    pub adapter_files: Arc<AdapterFiles>,
    pub jobs: Arc<Jobs>,
    pub settings: Arc<ApiSettings>,
    pub admission: Arc<Admission>,
    /// Preparing requests: tokenizing, chat templates, large bodies.
    pub blocking: Arc<BlockingPool>,
    /// Work no generation waits on, at low CPU priority: adapter validation and files.
    pub background: Arc<BlockingPool>,
    /// Compiling grammars, on threads with stacks for the deepest specification the checks let
    /// through (see [`crate::grammar::COMPILE_STACK`]).
    pub grammars: Arc<BlockingPool>,
    pub uploads: Arc<adapters::Uploads>,
    /// The batches this server runs.
    pub batches: Arc<batch::Batches>,
    /// What prompts may be, from the model's context and vocabulary.
    pub prompt_limits: validate::PromptLimits,
    /// The model's end-of-sequence tokens (they end a constrained text).
    pub end_tokens: Arc<[u32]>,
    /// Structured output's compiler for the served tokenizer, built on first use.
    pub grammar: Arc<std::sync::OnceLock<Result<Arc<crate::grammar::GrammarCompiler>, crate::grammar::GrammarError>>>,
    /// Unix milliseconds.
    pub started_at: i64,
}

impl AppState {
    /// State over a started runtime; starts the ledger writer (call inside the server's
    /// async runtime).
    pub fn new(store: Store, serving: Arc<dyn Serving>, tokenizer: Arc<Tokenizer>, model_name: &str, data_dir: &Path, settings: ApiSettings) -> Self {
        let context = serving.model_config().max_position_embeddings;
        // Normalization may shrink text a little (composed characters): twice the bound.
        let max_bytes = context.saturating_mul(tokenizer.longest_token_bytes()).saturating_mul(2);
        Self {
            ledger: Ledger::start(store.clone(), settings.ledger_gather),
            admission: Admission::new(settings.admission),
            blocking: Arc::new(BlockingPool::new(settings.blocking_threads, settings.blocking_queue)),
            background: Arc::new(BlockingPool::background(settings.blocking_threads, settings.blocking_queue).unwrap_or_else(|e| {
                eprintln!("warning: the background threads could not start ({e}); adapter validation runs at normal priority");
                BlockingPool::new(settings.blocking_threads, settings.blocking_queue)
            })),
            grammars: Arc::new(
                BlockingPool::deep("grammar", settings.blocking_threads, settings.blocking_queue, crate::grammar::COMPILE_STACK).unwrap_or_else(|e| {
                    eprintln!("warning: the grammar compiler's threads could not start ({e}); structured output is refused");
                    BlockingPool::broken(format!("structured output is unavailable: the grammar compiler's threads could not start ({e})"))
                }),
            ),
            uploads: Arc::new(adapters::Uploads::default()),
            batches: Arc::new(batch::Batches::new(settings.batch.concurrency)),
            prompt_limits: validate::PromptLimits { context, max_bytes },
            end_tokens: crate::engine::end_tokens(&tokenizer, serving.model_config()).into(),
            grammar: Arc::default(),
            store,
            tokenizer,
            base: Arc::new(BaseModel::new(model_name, serving.base_shape())),
            model_name: model_name.into(),
            serving,
            data_dir: data_dir.into(),
            limiter: Limiter::new(),
            metrics: Arc::new(Metrics::default()),
            blobs: Blobs::new(),
            adapter_files: Arc::new(AdapterFiles::local(data_dir)),
            jobs: Arc::new(Jobs::default()),
            settings: Arc::new(settings),
            started_at: crate::store::now_ms(),
        }
    }
}

/// The base model this server serves, as an adapter records the model it was uploaded for: its
/// served name, and its shape (the layers and the sizes of each projection an adapter's matrices
/// must fit). An adapter recorded for another shape cannot be used here; one recorded under
/// another name but the same shape can (a model served under a new name), and its listing says
/// which it was uploaded for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseModel {
    pub name: String,
    pub shape: String,
}

impl BaseModel {
    pub fn new(name: &str, shape: &loraplex_adapters::BaseShape) -> Self {
        let modules: Vec<String> = loraplex_adapters::TargetModule::ALL
            .iter()
            .map(|&m| {
                let (i, o) = shape.dims(m);
                format!("{} {i}x{o}", m.hf_name())
            })
            .collect();
        BaseModel { name: name.to_string(), shape: format!("{} layers; {}", shape.num_layers, modules.join(", ")) }
    }

    /// Why `adapter` cannot be used with this model, when it cannot.
    pub fn unusable(&self, adapter: &crate::store::AdapterRecord) -> Option<String> {
        let shape = adapter.base_shape.as_deref()?;
        (shape != self.shape).then(|| {
            format!(
                "adapter `{}` was uploaded for the base model `{}` ({shape}), not for `{}`, which this server serves ({}): upload it again for this model",
                adapter.label(),
                adapter.base_model.as_deref().unwrap_or("unknown"),
                self.name,
                self.shape
            )
        })
    }
}

/// The inference jobs in flight. Their tasks run on the server's main thread, which outlives
/// the HTTP workers, so a shutdown can wait for them to record their usage.
#[derive(Debug, Default)]
pub struct Jobs {
    running: std::sync::atomic::AtomicUsize,
    idle: tokio::sync::Notify,
}

struct JobToken(Arc<Jobs>);

impl Drop for JobToken {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Jobs {
    /// Runs `job` on the system's arbiter (the main thread).
    pub fn spawn(self: &Arc<Self>, job: impl std::future::Future<Output = ()> + Send + 'static) {
        self.running.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let token = JobToken(self.clone());
        actix_web::rt::System::current().arbiter().spawn(async move {
            let _token = token;
            job.await;
        });
    }

    /// Runs the future `make` returns on the system's arbiter, as [`Jobs::spawn`], for futures
    /// that must stay on one thread (those that submit to the runtime).
    pub fn spawn_local<F, Fut>(self: &Arc<Self>, make: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + 'static,
    {
        self.running.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let token = JobToken(self.clone());
        on_main_thread(move || async move {
            let _token = token;
            make().await;
        });
    }

    pub fn running(&self) -> usize {
        self.running.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits until no job runs, or `timeout` passes; true if none runs.
    pub async fn drain(&self, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.running() > 0 {
            let idle = self.idle.notified();
            if self.running() == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return self.running() == 0;
            }
        }
        true
    }
}

/// Runs the future `make` returns on the system's arbiter (the main thread, which outlives the
/// HTTP workers), where it may stay on one thread.
pub fn on_main_thread<F, Fut>(make: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    actix_web::rt::System::current().arbiter().spawn_fn(move || {
        actix_web::rt::spawn(make());
    });
}

/// Mounts every route.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.app_data(web::PathConfig::default().error_handler(|e, _| ApiError::Invalid(e.to_string()).into()))
        .app_data(web::QueryConfig::default().error_handler(|e, _| ApiError::Invalid(format!("invalid query string: {e}")).into()))
        .route("/health", web::get().to(health))
        .route("/ready", web::get().to(ready))
        .route("/metrics", web::get().to(metrics))
        .route("/admin/stats", web::get().to(stats))
        .route("/openapi.json", web::get().to(openapi_json))
        .configure(admin::routes)
        .configure(business::routes)
        .configure(openai::routes)
        .configure(lorax::routes)
        .configure(adapters::routes)
        .configure(usage::routes)
        .configure(files::routes)
        .configure(batch::routes)
        .configure(ui::routes)
        .default_service(web::to(unknown_route));
}

/// Largest JSON body accepted.
const MAX_JSON_BYTES: usize = 4 << 20;

/// Bodies up to this size are parsed in place; larger ones on the blocking pool.
const INLINE_JSON_BYTES: usize = 16 << 10;

/// Parses a JSON body (after the caller is authorized, so that an unauthenticated request
/// learns nothing but that it needs a key): a clear 400 for malformed JSON, wrong types or
/// unknown fields.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::Invalid("the request needs a JSON body".into()));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::Invalid(format!("invalid JSON body: {e}")))
}

/// Reads a request body of at most [`MAX_JSON_BYTES`]; a body that stalls, or falls behind the
/// minimum rate, is cut with 408 (see [`body`]).
pub async fn read_body(state: &AppState, payload: web::Payload) -> Result<web::Bytes, ApiError> {
    use futures::StreamExt;
    let (mut payload, clock) = body::paced(payload, &state.settings);
    let mut out = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| clock.error(|| ApiError::Invalid(format!("reading the body: {e}"))))?;
        if out.len().saturating_add(chunk.len()) > MAX_JSON_BYTES {
            return Err(ApiError::TooLarge(format!("the body is larger than {MAX_JSON_BYTES} bytes")));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.freeze())
}

/// [`read_body`], then [`parse_json`] (on the blocking pool when the body is large).
pub async fn json_body<T: serde::de::DeserializeOwned + Send + 'static>(state: &AppState, payload: web::Payload) -> Result<T, ApiError> {
    let body = read_body(state, payload).await?;
    if body.len() <= INLINE_JSON_BYTES {
        return parse_json(&body);
    }
    state.blocking.run(move || parse_json(&body)).await?
}

/// Parses a query string (after authorization, as [`parse_json`]).
pub fn parse_query<T: serde::de::DeserializeOwned>(req: &HttpRequest) -> Result<T, ApiError> {
    web::Query::<T>::from_query(req.query_string()).map(web::Query::into_inner).map_err(|e| ApiError::Invalid(format!("invalid query string: {e}")))
}

async fn unknown_route(req: HttpRequest) -> HttpResponse {
    use actix_web::ResponseError;
    ApiError::NotFound(format!("route {} {}", req.method(), req.path())).error_response()
}

async fn health() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

/// Ready once the database answers and at least one worker has an engine; every worker's
/// health is listed (a worker without an engine is rebuilding it and gets no requests).
async fn ready(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    state.store.plans().await?;
    let workers = state.serving.stats().await;
    let list: Vec<serde_json::Value> =
        workers.iter().map(|w| serde_json::json!({"worker": w.worker, "healthy": w.unhealthy.is_none(), "reason": w.unhealthy})).collect();
    let healthy = workers.iter().filter(|w| w.unhealthy.is_none()).count();
    if healthy == 0 {
        return Err(ApiError::Unavailable(if workers.is_empty() {
            "no worker is running".into()
        } else {
            "no worker is healthy; they are being rebuilt".into()
        }));
    }
    let status = if healthy == workers.len() { "ready" } else { "degraded" };
    Ok(HttpResponse::Ok().json(serde_json::json!({"status": status, "workers": list})))
}

/// Prometheus metrics, for an operator key with the `metrics` (or `admin`) scope: they name
/// every tenant and adapter in use.
async fn metrics(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let key = match authorize(&req, &state, Scope::Metrics).await {
        Err(ApiError::Forbidden(_)) => authorize(&req, &state, Scope::Admin).await.map_err(|_| ApiError::Forbidden(Scope::Metrics.as_str()))?,
        other => other?,
    };
    if key.tenant_id.is_some() {
        return Err(ApiError::Forbidden(Scope::Metrics.as_str()));
    }
    render_metrics(&state).await
}

/// The routes of `serve --metrics-port`: the metrics without a key, for scrapers inside the
/// cluster (the port is not exposed beyond it), and liveness.
pub fn metrics_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/metrics", web::get().to(|state: web::Data<AppState>| async move { render_metrics(&state).await })).route("/health", web::get().to(health));
}

async fn render_metrics(state: &AppState) -> Result<HttpResponse, ApiError> {
    let workers = state.serving.stats().await;
    let body = state.metrics.render(&metrics::Snapshot { workers: &workers, max_lora: state.settings.max_running });
    Ok(HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(body))
}

/// The live state the console's dashboard shows (an operator key with the admin scope): each
/// worker's counters and pool, and the HTTP layer's latency histograms and request counts.
async fn stats(req: HttpRequest, state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let key = authorize(&req, &state, Scope::Admin).await?;
    if key.tenant_id.is_some() {
        return Err(ApiError::Forbidden(Scope::Admin.as_str()));
    }
    let workers = state.serving.stats().await;
    let mut body = state.metrics.json();
    body["workers"] = serde_json::to_value(&workers).map_err(|e| ApiError::Internal(format!("worker stats: {e}")))?;
    body["at_ms"] = crate::store::now_ms().into();
    Ok(HttpResponse::Ok().json(body))
}

async fn openapi_json() -> HttpResponse {
    HttpResponse::Ok().json(openapi::document(env!("CARGO_PKG_VERSION")))
}

/// The live key behind the request's bearer token, which must carry `scope`.
pub async fn authorize(req: &HttpRequest, state: &AppState, scope: Scope) -> Result<ApiKey, ApiError> {
    Ok(principal(req, state, scope).await?.key.clone())
}

/// [`authorize`], with the key's tenant and plan (a lookup the store keeps for a moment).
pub async fn principal(req: &HttpRequest, state: &AppState, scope: Scope) -> Result<std::sync::Arc<Principal>, ApiError> {
    let found = principal_of(req.headers(), state).await?;
    if !found.key.has(scope) {
        return Err(ApiError::Forbidden(scope.as_str()));
    }
    Ok(found)
}

/// The key of a request with these headers, whatever its scope.
async fn principal_of(headers: &actix_web::http::header::HeaderMap, state: &AppState) -> Result<std::sync::Arc<Principal>, ApiError> {
    let header = headers.get("authorization").and_then(|h| h.to_str().ok()).ok_or(ApiError::MissingKey)?;
    let secret = header.strip_prefix("Bearer ").map(str::trim).filter(|s| !s.is_empty()).ok_or(ApiError::MissingKey)?;
    state.store.principal(secret).await?.ok_or(ApiError::BadKey)
}

#[cfg(test)]
mod tests;
