//! The serving runtime's actors.
//!
//! - A [`Worker`] owns one device: its engine (page pool, adapter residency, scheduler) over
//!   the shared base model. It runs one engine step per [`Step`] message and re-notifies itself
//!   while work remains, so submits, cancels and stats requests are handled between steps.
//! - The [`Loader`] reads, validates and packs adapters from disk into the machine's one host
//!   tier, on threads of its own (a `SyncArbiter`); every worker's adapters come through it.
//! - The [`Supervisor`] starts one worker per device, each on its own arbiter (thread), and has
//!   actix restart a worker whose step failed. A request goes from its caller straight to a
//!   worker where its adapter is resident (else the least loaded one), chosen by what each
//!   worker publishes of itself ([`routes`]), not through the supervisor's thread.
//!
//! Supervision is explicit: a failed step (an error, or a panic caught around the step) sends
//! an error event to every request in flight on that worker, which then stops; actix restarts
//! it and [`Worker::restarting`](actix::Supervised::restarting) rebuilds its engine from the
//! model. The shared state is plain and synchronous (engine, scheduler); the handlers only
//! route messages to it.
//!
//! [`crate::runtime::Runtime`] is the handle the rest of the program uses.

mod loader;
pub(crate) mod routes;
mod supervisor;
mod text;
mod worker;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use actix::Message;
use tokio::sync::mpsc::UnboundedSender;

use crate::memory::{AdapterLocation, AdapterRef, PoolStats, PrefixStats, Residency};
use crate::request::{FinishReason, RequestError, SeqError, ValidRequest};
use crate::scheduler::Placement;

pub use crate::memory::{HoldError, Holder};
pub use loader::{Loader, RunLoad};
pub use supervisor::{Supervisor, WorkerThreads, join_workers};
pub use worker::Worker;

/// Names one submitted request for as long as the runtime runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct RequestId(pub u64);

/// What a request's stream carries: tokens as they are generated, then one final event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenOut),
    /// Every sample finished; nothing follows.
    Done(Usage),
    /// The request failed; nothing follows.
    Error(RuntimeError),
}

/// One generated token of one sample.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    /// Which of the request's `n` samples (0-based).
    pub index: usize,
    pub token: u32,
    /// Text this token completed (may be empty while a character or stop string is pending).
    pub text: String,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
    /// Set on the sample's last token.
    pub finish: Option<FinishReason>,
}

/// What a finished request used, for its response and the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (billed at a discount).
    pub cached_prompt_tokens: usize,
    /// Over all samples.
    pub completion_tokens: usize,
    /// From submission until the request first ran.
    #[serde(serialize_with = "millis")]
    pub queue_time: Duration,
    /// From submission until its first token.
    #[serde(serialize_with = "millis")]
    pub time_to_first_token: Duration,
    /// From submission until its last token.
    #[serde(serialize_with = "millis")]
    pub total_time: Duration,
}

fn millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

/// Why the runtime refused or failed a request. Messages are for the caller.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    /// The request can never be served as asked.
    #[error(transparent)]
    Rejected(#[from] RequestError),
    /// One of its sequences could not run, or failed; other requests are not affected.
    #[error(transparent)]
    Sequence(#[from] SeqError),
    /// It was cancelled (its client went away, or asked).
    #[error("the request was cancelled")]
    Cancelled,
    /// The worker running the request failed; the request was dropped and the worker rebuilt.
    #[error("the device worker failed: {0}; the request was dropped and the worker restarted")]
    WorkerFailed(Arc<str>),
    /// The runtime is shutting down, or no worker can take requests now.
    #[error("the runtime is unavailable: {0}")]
    Unavailable(Arc<str>),
}

/// Queues a request on a worker (the one [`routes::Routes::pick`] chose).
#[derive(Message)]
#[rtype(result = "Result<(), RuntimeError>")]
pub struct Submit {
    pub id: RequestId,
    pub request: ValidRequest,
    pub placement: Placement,
    pub events: UnboundedSender<Event>,
    pub submitted: std::time::Instant,
}

/// Drops a request wherever it is; its pages are freed at once. Answers whether it was found.
#[derive(Message, Clone, Copy)]
#[rtype(result = "bool")]
pub struct Cancel(pub RequestId);

/// Asks for statistics.
#[derive(Message, Clone, Copy)]
#[rtype(result = "Vec<WorkerStats>")]
pub struct GetStats;

/// Brings an adapter into every worker's pool ahead of its requests (or, with a `holder`, keeps
/// it there, pinned, until that holder's [`UnloadAdapter`]). Answers each worker's residency
/// now; ask again to follow a load.
#[derive(Message, Clone)]
#[rtype(result = "Vec<Result<Residency, HoldError>>")]
pub struct LoadAdapter {
    pub adapter: AdapterRef,
    pub holder: Option<Holder>,
}

/// Lets `holder`'s pin of an adapter go (the adapter stays pinned while another holder keeps
/// it); `forget` drops every pin and the adapter from host memory (a deleted adapter). Answers
/// whether any worker released a pin of `holder`.
#[derive(Message, Clone)]
#[rtype(result = "bool")]
pub struct UnloadAdapter {
    pub key: Arc<str>,
    pub holder: Arc<str>,
    pub forget: bool,
}

/// Asks every worker where these adapters are (pool, host memory, disk) and who pins them.
#[derive(Message, Clone)]
#[rtype(result = "Vec<WorkerLocations>")]
pub struct LocateAdapters {
    pub keys: Arc<[Arc<str>]>,
}

/// One worker's answer to [`LocateAdapters`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WorkerLocations {
    pub worker: usize,
    /// In the order of the keys asked; `None` while the worker has no engine (or did not answer).
    pub locations: Option<Vec<AdapterLocation>>,
}

/// Makes the next step of a worker fail with this reason, as a real failure would, and the
/// next `failed_rebuilds` attempts to rebuild its engine fail too: for tests and failure drills
/// of the supervision path.
#[derive(Message, Clone)]
#[rtype(result = "bool")]
pub struct InjectFault {
    pub worker: usize,
    pub reason: String,
    pub failed_rebuilds: u32,
}

/// Runs one engine iteration (a worker sends it to itself).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Step;

/// Asks the supervisor for the workers' routes (none before it started them).
#[derive(Message)]
#[rtype(result = "Option<Arc<routes::Routes<B>>>")]
pub(crate) struct GetRoutes<B: loraplex_kernels::Backend>(pub std::marker::PhantomData<B>);

/// One worker's counters.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WorkerStats {
    pub worker: usize,
    pub device: String,
    /// Why the worker has no engine (a failed rebuild it keeps retrying); `None` when healthy.
    pub unhealthy: Option<String>,
    /// Requests accepted and not yet finished.
    pub in_flight: usize,
    pub running: usize,
    pub waiting: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    /// A step's fixed time in units of a token's cost (measured from its steps, or configured);
    /// 0 without an engine.
    pub step_fixed_cost: f64,
    /// Times the worker was rebuilt after a failed step.
    pub restarts: u64,
    pub pool: PoolStats,
    pub prefix: PrefixStats,
    /// Bytes of adapters in the host tier (one tier shared by every worker).
    pub host_adapter_bytes: u64,
    pub adapters: AdapterCounters,
    /// The keys of the adapter versions resident in its pool.
    pub resident_adapters: Vec<String>,
    /// Where the current engine's steps spent their time (reset when the worker is rebuilt).
    #[serde(skip)]
    pub step_time: crate::engine::StepTime,
}

/// Where requests found their adapters, and the loads that followed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AdapterCounters {
    /// Requests whose adapter was already in the device pool when they arrived.
    pub device_hits: u64,
    /// ... in host memory (only a copy into the pool was needed).
    pub host_hits: u64,
    /// ... on disk only.
    pub disk_misses: u64,
    /// Adapters placed into the pool from host memory, and from disk.
    pub loads_from_host: u64,
    pub loads_from_disk: u64,
    /// Loads that failed.
    pub failures: u64,
}

impl AdapterCounters {
    /// Counts residency events; true if there were any.
    pub(crate) fn count(&mut self, events: Vec<crate::memory::ResidencyEvent>) -> bool {
        use crate::memory::{ResidencyEvent, Tier};
        let any = !events.is_empty();
        for e in events {
            match e {
                ResidencyEvent::Resident { from: Tier::Host, .. } => self.loads_from_host += 1,
                ResidencyEvent::Resident { from: Tier::Disk, .. } => self.loads_from_disk += 1,
                ResidencyEvent::Failed { .. } => self.failures += 1,
            }
        }
        any
    }
}
