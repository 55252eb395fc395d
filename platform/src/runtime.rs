//! The serving runtime as a library: submit a validated request, read its events, cancel it,
//! read statistics. The HTTP layer and the command line both go through this.
//!
//! [`Runtime::start`] runs the actors (see [`crate::actors`]) on a thread of their own, so the
//! handle works from any thread, async or not: every call either sends a message or awaits a
//! reply. Dropping a [`RequestHandle`] before its final event cancels the request (the client
//! went away) and frees its pages at the worker's next step.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use actix::{Actor, Addr, System};
use loraplex_adapters::{AdapterLimits, BaseShape};
use loraplex_kernels::Backend;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::actors::routes::Routes;
pub use crate::actors::{AdapterCounters, Event, HoldError, Holder, RequestId, RuntimeError, TokenOut, Usage, WorkerLocations, WorkerStats};
use crate::actors::{Cancel, GetRoutes, GetStats, InjectFault, LoadAdapter, LocateAdapters, Submit, Supervisor, UnloadAdapter, WorkerThreads, join_workers};
use crate::engine::EngineConfig;
use crate::memory::{AdapterRef, Residency};
use crate::model::{Model, ModelConfig};
use crate::request::{FinishReason, GenerationRequest, RequestError, ValidRequest};
use crate::scheduler::Placement;
use crate::tokenizer::Tokenizer;

/// The running actors and the way to reach them.
pub struct Runtime<B: Backend> {
    supervisor: Addr<Supervisor<B>>,
    /// Each worker's mailbox and load: requests go straight there.
    routes: Arc<Routes<B>>,
    system: System,
    thread: Option<JoinHandle<()>>,
    next_id: AtomicU64,
    model: ModelConfig,
    shape: BaseShape,
    adapter_limits: AdapterLimits,
    device: String,
    pool: PoolShape,
}

/// The shape of each worker's page pool, for checks made before a request is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Tokens per KV page.
    pub block_size: usize,
    pub total_pages: usize,
    /// Pages that adapter pins may take together; the rest is always there for requests.
    pub max_pinned_pages: usize,
}

impl PoolShape {
    /// Pages requests can always have.
    pub fn usable_pages(&self) -> usize {
        self.total_pages - self.max_pinned_pages
    }
}

/// Why a request was refused before it was queued.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error(transparent)]
    Invalid(#[from] RequestError),
    #[error("unknown adapter {key}: {why}")]
    UnknownAdapter { key: Arc<str>, why: String },
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl<B: Backend> Runtime<B> {
    /// Starts one worker per entry of `devices` (the base model as loaded on each device; on
    /// the CPU, the same model any number of times).
    pub fn start(devices: Vec<Arc<Model<B>>>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> std::io::Result<Self> {
        let Some(first) = devices.first() else {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "the runtime needs at least one device"));
        };
        let model = first.config().clone();
        let shape = first.base_shape();
        let device = first.backend().device_name();
        if !first.backend().supports_kv_dtype(config.kv_dtype) {
            let why = format!("{device} cannot keep KV pages in {} (--kv-dtype)", config.kv_dtype.dtype());
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
        }
        let adapter_limits = config.adapters.limits;
        let layout = config.kv_layout(first);
        let total_pages = (config.pool_bytes / layout.page_bytes()).max(1);
        let pool = PoolShape { block_size: config.block_size, total_pages, max_pinned_pages: config.max_pinned_pages(total_pages) };
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("loraplex-runtime".into()).spawn(move || {
            let system = System::new();
            let threads = WorkerThreads::default();
            let workers = threads.clone();
            system.block_on(async move {
                let supervisor = Supervisor::new(devices, tokenizer, config, workers).start();
                // Answered once the supervisor has started its workers.
                let routes = supervisor.send(GetRoutes(std::marker::PhantomData)).await.ok().flatten();
                let _ = tx.send(routes.map(|routes| (supervisor, routes, System::current())));
            });
            let _ = system.run();
            // Stopping the system stops the workers' threads without waiting for them.
            join_workers(&threads);
        })?;
        let not_started = || std::io::Error::other("the runtime thread did not start");
        let (supervisor, routes, system) = rx.recv().map_err(|_| not_started())?.ok_or_else(not_started)?;
        Ok(Self { supervisor, routes, system, thread: Some(thread), next_id: AtomicU64::new(0), model, shape, adapter_limits, device, pool })
    }

    /// The base model's configuration (what requests are validated against).
    pub fn model_config(&self) -> &ModelConfig {
        &self.model
    }

    /// The projection shapes adapters must match.
    pub fn base_shape(&self) -> &BaseShape {
        &self.shape
    }

    /// What an adapter may be (rank, file size) to be accepted.
    pub fn adapter_limits(&self) -> &AdapterLimits {
        &self.adapter_limits
    }

    /// The first device, in words.
    pub fn device_name(&self) -> &str {
        &self.device
    }

    /// The shape of every worker's page pool.
    pub fn pool_shape(&self) -> PoolShape {
        self.pool
    }

    /// Checks a request (prompt, limits, sampling, adapter, the pages it may need) without
    /// queueing it: what passes can run once there is room.
    pub fn validate(&self, request: GenerationRequest) -> Result<ValidRequest, SubmitError> {
        if let Some(a) = request.adapter.as_ref().filter(|a| !a.validated) {
            check_adapter_dir(&a.key, &a.dir)?;
        }
        let valid = request.validate(&self.model)?;
        let request = valid.get();
        let (needed, usable) = (request.max_pages(self.pool.block_size), self.pool.usable_pages());
        if needed > usable {
            let (samples, max_new_tokens) = (request.n, request.stop.max_new_tokens);
            return Err(RequestError::TooLargeForPool { needed, usable, samples, max_new_tokens }.into());
        }
        Ok(valid)
    }

    /// Validates and queues a request; its events come through the returned handle.
    pub async fn submit(&self, request: GenerationRequest, placement: Placement) -> Result<RequestHandle, SubmitError> {
        let request = self.validate(request)?;
        self.submit_valid(request, placement).await
    }

    /// Queues an already validated request.
    pub async fn submit_valid(&self, request: ValidRequest, placement: Placement) -> Result<RequestHandle, SubmitError> {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = unbounded_channel();
        let n = request.get().n;
        let route = self.routes.pick(request.get().adapter.as_ref().map(|a| &*a.key)).ok_or_else(no_worker)?;
        let msg = Submit { id, request, placement, events, submitted: Instant::now() };
        route.addr.send(msg).await.map_err(|e| RuntimeError::Unavailable(e.to_string().into()))??;
        Ok(RequestHandle { id, n, events: rx, finished: false })
    }

    /// Queues an already validated request without waiting for the worker to take it (the
    /// worker may be in the middle of a step): a refusal then arrives as the stream's
    /// [`Event::Error`]. For callers that must not block, such as load generators.
    pub fn submit_detached(&self, request: ValidRequest, placement: Placement) -> RequestHandle {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (events, rx) = unbounded_channel();
        let n = request.get().n;
        match self.routes.pick(request.get().adapter.as_ref().map(|a| &*a.key)) {
            Some(route) => route.addr.do_send(Submit { id, request, placement, events, submitted: Instant::now() }),
            None => {
                let _ = events.send(Event::Error(no_worker()));
            }
        }
        RequestHandle { id, n, events: rx, finished: false }
    }

    /// Asks every worker to bring `adapter` into its pool (and, with a `holder`, to keep it
    /// there until that holder's [`Runtime::unload_adapter`]); returns each worker's residency
    /// now, or why it refused the pin.
    pub async fn load_adapter(&self, adapter: AdapterRef, holder: Option<Holder>) -> Vec<Result<Residency, HoldError>> {
        self.supervisor.send(LoadAdapter { adapter, holder }).await.unwrap_or_default()
    }

    /// [`Runtime::load_adapter`], repeated until every worker has the adapter resident (and
    /// held, with `hold`), one reports it failed, or `timeout` passes (the pool may be full of
    /// held adapters and pinned pages).
    pub fn load_adapter_blocking(&self, adapter: &AdapterRef, hold: bool, timeout: std::time::Duration) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + timeout;
        let holder = hold.then(|| Holder { id: "".into(), max_pages: usize::MAX });
        loop {
            if Instant::now() > deadline {
                return Err(RuntimeError::Unavailable(
                    format!("adapter {} did not become resident within {timeout:?}; the pool may be full", adapter.key).into(),
                ));
            }
            let states: Vec<Residency> = futures::executor::block_on(self.load_adapter(adapter.clone(), holder.clone()))
                .into_iter()
                .map(|s| s.unwrap_or_else(|e| Residency::Failed(e.to_string().into())))
                .collect();
            if let Some(Residency::Failed(e)) = states.iter().find(|s| matches!(s, Residency::Failed(_))) {
                return Err(RuntimeError::Sequence(crate::request::SeqError::AdapterFailed(e.clone())));
            }
            if !states.is_empty() && states.iter().all(|s| *s == Residency::Resident) {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// Lets `holder`'s pin of an adapter go (it stays cached until evicted); with `forget`,
    /// drops every pin and the adapter from every tier so the next request reloads it from disk.
    pub async fn unload_adapter(&self, key: Arc<str>, holder: Arc<str>, forget: bool) -> bool {
        self.supervisor.send(UnloadAdapter { key, holder, forget }).await.unwrap_or(false)
    }

    /// Where each of `keys` is on every worker (pool, host memory, disk) and who pins it.
    pub async fn locate_adapters(&self, keys: Arc<[Arc<str>]>) -> Vec<WorkerLocations> {
        self.supervisor.send(LocateAdapters { keys }).await.unwrap_or_default()
    }

    /// [`Runtime::submit_valid`] for callers outside an async context.
    pub fn submit_blocking_valid(&self, request: ValidRequest, placement: Placement) -> Result<RequestHandle, SubmitError> {
        futures::executor::block_on(self.submit_valid(request, placement))
    }

    /// [`Runtime::submit`] for callers outside an async context.
    pub fn submit_blocking(&self, request: GenerationRequest, placement: Placement) -> Result<RequestHandle, SubmitError> {
        futures::executor::block_on(self.submit(request, placement))
    }

    /// Drops a request wherever it is (its pages are freed at once); false if it is unknown or
    /// already finished.
    pub async fn cancel(&self, id: RequestId) -> bool {
        self.supervisor.send(Cancel(id)).await.unwrap_or(false)
    }

    /// Every worker's counters.
    pub async fn stats(&self) -> Vec<WorkerStats> {
        self.supervisor.send(GetStats).await.unwrap_or_default()
    }

    pub fn stats_blocking(&self) -> Vec<WorkerStats> {
        futures::executor::block_on(self.stats())
    }

    /// Makes the next step of `worker` fail as a real device failure would: its requests get
    /// an error event and it is rebuilt, after `failed_rebuilds` failed attempts (during which it
    /// is unhealthy and gets no requests). For tests and failure drills.
    pub async fn inject_fault(&self, worker: usize, reason: &str, failed_rebuilds: u32) -> bool {
        self.supervisor.send(InjectFault { worker, reason: reason.to_string(), failed_rebuilds }).await.unwrap_or(false)
    }

    /// Stops the actors; requests still in flight get no more events.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl<B: Backend> Drop for Runtime<B> {
    fn drop(&mut self) {
        self.stop();
    }
}

fn no_worker() -> RuntimeError {
    RuntimeError::Unavailable("no device worker is healthy; they are being rebuilt".into())
}

fn check_adapter_dir(key: &Arc<str>, dir: &Path) -> Result<(), SubmitError> {
    let config = dir.join("adapter_config.json");
    if !config.is_file() {
        let why = format!("{} has no adapter_config.json", dir.display());
        return Err(SubmitError::UnknownAdapter { key: key.clone(), why });
    }
    Ok(())
}

/// The events of one request, in order: tokens, then [`Event::Done`] or [`Event::Error`].
/// Dropping it early cancels the request.
pub struct RequestHandle {
    pub id: RequestId,
    n: u32,
    events: UnboundedReceiver<Event>,
    finished: bool,
}

/// A finished request's output, collected by [`RequestHandle::collect`].
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub samples: Vec<SampleOutput>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct SampleOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
}

impl RequestHandle {
    /// The next event; `None` after the final one.
    pub async fn next(&mut self) -> Option<Event> {
        if self.finished {
            return None;
        }
        let event = self.events.recv().await;
        self.finished = !matches!(event, Some(Event::Token(_)));
        event
    }

    /// The next event if it has already arrived.
    pub fn try_next(&mut self) -> Option<Event> {
        if self.finished {
            return None;
        }
        let event = self.events.try_recv().ok()?;
        self.finished = !matches!(event, Event::Token(_));
        Some(event)
    }

    /// [`RequestHandle::next`] for callers outside an async context.
    pub fn next_blocking(&mut self) -> Option<Event> {
        futures::executor::block_on(self.next())
    }

    /// Reads every event; the request's samples and usage, or its error.
    pub async fn collect(mut self) -> Result<Output, RuntimeError> {
        let mut samples = vec![SampleOutput::default(); self.n as usize];
        loop {
            match self.next().await {
                Some(Event::Token(t)) => {
                    let Some(s) = samples.get_mut(t.index) else { continue };
                    s.tokens.push(t.token);
                    s.text.push_str(&t.text);
                    s.finish_reason = t.finish.or(s.finish_reason);
                }
                Some(Event::Done(usage)) => return Ok(Output { samples, usage }),
                Some(Event::Error(e)) => return Err(e),
                None => return Err(RuntimeError::Unavailable("the runtime stopped before the request finished".into())),
            }
        }
    }

    pub fn collect_blocking(self) -> Result<Output, RuntimeError> {
        futures::executor::block_on(self.collect())
    }
}
