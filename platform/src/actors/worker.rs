//! One device's actor: its engine, the requests in flight on it, and the step loop.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, ActorContext, AsyncContext, Context, Handler, Supervised};
use loraplex_kernels::Backend;
use tokio::sync::mpsc::UnboundedSender;

use super::routes::WorkerLoad;
use super::text::{TextEnded, TextJob, TextStage};
use super::{
    AdapterCounters, Cancel, Event, GetStats, HoldError, InjectFault, LoadAdapter, LocateAdapters, RequestId, RuntimeError, Step, Submit, UnloadAdapter,
    WorkerLocations, WorkerStats,
};
use crate::engine::{Engine, EngineConfig, EngineError, SeqId, TokenEvent};
use crate::memory::{LoaderPool, Residency};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// A request in flight on this worker: until its engine has ended all of its samples. Its
/// events are the text stage's to send.
struct Flight {
    seqs: Vec<SeqId>,
    /// To see that its client went away.
    events: UnboundedSender<Event>,
    /// Samples the engine has not ended.
    open: usize,
}

/// The actor that owns one device (see the [module docs](super)).
pub struct Worker<B: Backend> {
    index: usize,
    model: Arc<Model<B>>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    /// The machine's host tier of adapters, shared by every worker and kept across rebuilds.
    host: Option<Arc<LoaderPool>>,
    /// The reason, while an engine cannot be built. Boxed: actors must be `Unpin`, and device
    /// buffers need not be.
    engine: Result<Box<Engine<B>>, Arc<str>>,
    flights: HashMap<RequestId, Flight>,
    /// Which request each sequence the engine still runs belongs to.
    seqs: HashMap<SeqId, RequestId>,
    /// Makes the text of every step's tokens and sends every request's events; started with
    /// the actor (see [`super::text`]).
    text: Option<TextStage>,
    /// A `Step` is queued.
    stepping: bool,
    fault: Option<String>,
    /// Rebuilds still to fail, for failure drills.
    failing_rebuilds: u32,
    /// Failed rebuilds in a row, for the backoff.
    rebuild_attempts: u32,
    /// What routing reads of this worker (see [`super::routes`]).
    load: Arc<WorkerLoad>,
    steps: u64,
    generated: u64,
    restarts: u64,
    /// Preemptions of engines before the current one.
    past_preemptions: u64,
    adapters: AdapterCounters,
}

impl<B: Backend> Worker<B> {
    pub(crate) fn new(
        index: usize,
        model: Arc<Model<B>>,
        tokenizer: Arc<Tokenizer>,
        config: EngineConfig,
        host: Option<Arc<LoaderPool>>,
        load: Arc<WorkerLoad>,
    ) -> Self {
        let engine = Self::build(&model, &tokenizer, &config, &host);
        Self {
            index,
            model,
            tokenizer,
            config,
            host,
            engine,
            flights: HashMap::new(),
            seqs: HashMap::new(),
            text: None,
            stepping: false,
            fault: None,
            failing_rebuilds: 0,
            rebuild_attempts: 0,
            load,
            steps: 0,
            generated: 0,
            restarts: 0,
            past_preemptions: 0,
            adapters: AdapterCounters::default(),
        }
    }

    fn build(model: &Arc<Model<B>>, tokenizer: &Arc<Tokenizer>, config: &EngineConfig, host: &Option<Arc<LoaderPool>>) -> Result<Box<Engine<B>>, Arc<str>> {
        match Engine::with_host_tier(model.clone(), tokenizer.clone(), config.clone(), host.clone()) {
            Ok(engine) => Ok(Box::new(engine)),
            Err(e) => Err(format!("building the engine: {e}").into()),
        }
    }

    fn kick(&mut self, ctx: &mut Context<Self>) {
        if !self.stepping {
            self.stepping = true;
            ctx.notify(Step);
        }
    }

    /// Starts the text stage if it is not running; the reason when it cannot be.
    fn start_text(&mut self, ctx: &mut Context<Self>) -> Result<(), Arc<str>> {
        if self.text.is_none() {
            let stage = TextStage::start(self.index, self.tokenizer.clone(), ctx.address().recipient());
            self.text = Some(stage.map_err(|e| Arc::<str>::from(format!("starting the text thread: {e}")))?);
        }
        Ok(())
    }

    /// Hands a job to the text stage. Without one (it could not start, or its thread died) the
    /// worker cannot send its requests anything: the step fails, and the restart starts a new
    /// stage.
    fn hand_to_text(&mut self, job: TextJob) -> Result<(), Arc<str>> {
        match &self.text {
            Some(stage) if stage.send(job) => Ok(()),
            _ => {
                self.text = None;
                Err("the text thread stopped".into())
            }
        }
    }

    /// Ends a request with `event` (sent after its tokens already handed to the text stage) and
    /// drops whatever of it the engine still holds.
    fn end(&mut self, id: RequestId, event: Event) {
        let Some(flight) = self.flights.remove(&id) else { return };
        for seq in &flight.seqs {
            if self.seqs.remove(seq).is_some()
                && let Ok(engine) = &mut self.engine
            {
                engine.cancel(*seq);
            }
        }
        if self.hand_to_text(TextJob::Close { id, event: event.clone() }).is_err() {
            let _ = flight.events.send(event);
        }
    }

    /// The engine, or the text stage, ended this sample: forgets it, and its request once the
    /// engine holds none of its samples.
    fn seq_ended(&mut self, seq: SeqId) {
        let Some(id) = self.seqs.remove(&seq) else { return };
        let Some(flight) = self.flights.get_mut(&id) else { return };
        flight.open -= 1;
        if flight.open == 0 {
            self.flights.remove(&id);
        }
    }

    /// Hands one step's tokens to the text stage, which streams them to their requests; forgets
    /// the samples the engine ended.
    fn deliver(&mut self, events: Vec<TokenEvent>) -> Result<(), Arc<str>> {
        // Every token the engine made, those a stop string or a failure dropped included.
        self.generated += events.len() as u64;
        for e in &events {
            if e.finish.is_some() {
                self.seq_ended(e.seq);
            }
        }
        if events.is_empty() { Ok(()) } else { self.hand_to_text(TextJob::Tokens(events)) }
    }

    /// Cancels requests whose client has gone away without waiting for their next token.
    fn drop_abandoned(&mut self) {
        let gone: Vec<RequestId> = self.flights.iter().filter(|(_, f)| f.events.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.end(id, Event::Error(RuntimeError::Cancelled));
        }
    }

    /// Publishes this worker's load and health for routing, and its resident adapters when
    /// they changed.
    fn report(&mut self, resident_changed: bool) {
        self.load.set(self.flights.len(), self.engine.is_ok());
        match (&self.engine, resident_changed) {
            (Ok(engine), true) => self.load.set_resident(engine.resident_adapters()),
            (Err(_), _) => self.load.set_resident(Vec::new()),
            _ => {}
        }
    }

    /// One engine iteration; `Err` means the engine can no longer be trusted.
    fn step_once(&mut self) -> Result<bool, Arc<str>> {
        if let Some(reason) = self.fault.take() {
            return Err(format!("injected fault: {reason}").into());
        }
        // Those whose client left during the last step (or while its messages were handled)
        // take no part in this one.
        self.drop_abandoned();
        let Ok(engine) = &mut self.engine else { return Ok(false) };
        if !engine.has_work() {
            // No requests, but adapter loads may be under way: place them as they arrive.
            engine.poll_adapters_now().map_err(|e| Arc::<str>::from(e.to_string()))?;
            let placed = self.adapters.count(engine.take_residency_events());
            // Staged adapters are retried only while others are still being placed: with
            // nothing running, no pages free up by themselves. Copies in flight are watched
            // until they land.
            let loading = engine.adapters().is_loading() || engine.adapters().is_copying() || (placed && engine.adapters().has_staged());
            if placed {
                self.report(true);
            }
            if loading {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            return Ok(loading);
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| engine.step()));
        let events = match outcome {
            Ok(Ok(events)) => events,
            Ok(Err(e)) => return Err(e.to_string().into()),
            Err(panic) => {
                let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
                return Err(format!("panic in a step: {}", what.unwrap_or_default()).into());
            }
        };
        self.steps += 1;
        let failures = engine.take_failures();
        let residency = self.adapters.count(engine.take_residency_events());
        self.deliver(events)?;
        for f in failures {
            if let Some(&id) = self.seqs.get(&f.seq) {
                self.end(id, Event::Error(RuntimeError::Sequence(f.error)));
            }
        }
        self.drop_abandoned();
        self.report(residency);
        Ok(matches!(&self.engine, Ok(e) if e.has_work()))
    }
}

impl<B: Backend> Actor for Worker<B> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.stepping = false;
        if let Err(why) = self.start_text(ctx) {
            self.engine = Err(why);
        }
        if self.engine.is_err() {
            self.rebuild(ctx);
        }
        if matches!(&self.engine, Ok(e) if e.has_work()) {
            self.kick(ctx);
        }
    }
}

/// The first wait before retrying a failed rebuild; it doubles up to [`REBUILD_BACKOFF_MAX`].
const REBUILD_BACKOFF: std::time::Duration = std::time::Duration::from_millis(50);
const REBUILD_BACKOFF_MAX: std::time::Duration = std::time::Duration::from_secs(10);

impl<B: Backend> Worker<B> {
    /// Builds a new engine; while that fails, the worker stays without one (unhealthy: the
    /// supervisor routes nothing to it) and tries again with a growing delay.
    fn rebuild(&mut self, ctx: &mut Context<Self>) {
        let built = if self.failing_rebuilds > 0 {
            self.failing_rebuilds -= 1;
            Err("injected rebuild failure".into())
        } else if let Err(why) = self.start_text(ctx) {
            Err(why)
        } else {
            Self::build(&self.model, &self.tokenizer, &self.config, &self.host)
        };
        self.engine = built;
        match &self.engine {
            Ok(_) => self.rebuild_attempts = 0,
            Err(why) => {
                let delay = REBUILD_BACKOFF.saturating_mul(1 << self.rebuild_attempts.min(16)).min(REBUILD_BACKOFF_MAX);
                self.rebuild_attempts += 1;
                eprintln!("worker {}: {why}; retrying in {delay:?}", self.index);
                ctx.run_later(delay, |worker, ctx| worker.rebuild(ctx));
            }
        }
        self.report(true);
    }
}

impl<B: Backend> Worker<B> {
    /// Every request in flight gets the error; actix then restarts this worker, which rebuilds
    /// its engine (and its text stage, if that is what failed).
    fn fail(&mut self, reason: Arc<str>, ctx: &mut Context<Self>) {
        let ids: Vec<RequestId> = self.flights.keys().copied().collect();
        for id in ids {
            self.end(id, Event::Error(RuntimeError::WorkerFailed(reason.clone())));
        }
        self.report(false);
        ctx.stop();
    }
}

impl<B: Backend> Supervised for Worker<B> {
    /// Drops the failed engine, then builds a fresh one (pool, scheduler and adapter tiers)
    /// over the same model. The old one goes first: a device pool sized near the device's
    /// capacity must never need to exist twice.
    fn restarting(&mut self, _ctx: &mut Self::Context) {
        self.restarts += 1;
        if let Ok(old) = &self.engine {
            self.past_preemptions += old.preemptions();
        }
        // A failed step ended its requests already; any left (the actor stopped another way)
        // end here, through the text stage, which would otherwise keep their streams open.
        let left: Vec<RequestId> = self.flights.keys().copied().collect();
        for id in left {
            self.end(id, Event::Error(RuntimeError::WorkerFailed("the worker restarted".into())));
        }
        self.engine = Err("rebuilding after a failed step".into());
        self.flights.clear();
        self.seqs.clear();
        self.stepping = false;
        self.fault = None;
        // `started` runs again next, and builds the new engine.
    }
}

impl<B: Backend> Handler<Step> for Worker<B> {
    type Result = ();

    fn handle(&mut self, _: Step, ctx: &mut Self::Context) {
        self.stepping = false;
        match self.step_once() {
            Ok(true) => self.kick(ctx),
            Ok(false) => {}
            Err(reason) => self.fail(reason, ctx),
        }
    }
}

impl<B: Backend> Handler<Submit> for Worker<B> {
    type Result = Result<(), RuntimeError>;

    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) -> Self::Result {
        let refuse = |e: RuntimeError| {
            // Callers that did not wait for the answer learn it from the stream.
            let _ = msg.events.send(Event::Error(e.clone()));
            e
        };
        // Its caller left while the request came here: nothing to queue.
        if msg.events.is_closed() {
            return Err(RuntimeError::Cancelled);
        }
        let engine = match self.engine.as_mut() {
            Ok(engine) => engine,
            Err(e) => return Err(refuse(RuntimeError::Unavailable(e.clone()))),
        };
        let n = msg.request.get().n.max(1) as usize;
        let stop_strings = msg.request.get().stop.stop_strings.clone();
        if let Some(a) = &msg.request.get().adapter {
            match engine.adapters().status(&a.key) {
                Residency::Resident => self.adapters.device_hits += 1,
                _ if engine.adapters().loader().cached(&a.key).is_some() => self.adapters.host_hits += 1,
                _ => self.adapters.disk_misses += 1,
            }
        }
        let first = match engine.add_placed(msg.request, msg.placement) {
            Ok(id) => id,
            Err(EngineError::Request(e)) => return Err(refuse(RuntimeError::Rejected(e))),
            Err(EngineError::Adapter(e)) => return Err(refuse(RuntimeError::Sequence(crate::request::SeqError::AdapterFailed(e)))),
            Err(e) => return Err(refuse(RuntimeError::Unavailable(e.to_string().into()))),
        };
        let seqs: Vec<SeqId> = (0..n as u64).map(|i| SeqId(first.0 + i)).collect();
        let open = TextJob::Open { id: msg.id, seqs: seqs.clone(), stop_strings, events: msg.events.clone(), submitted: msg.submitted, added: Instant::now() };
        if let Err(why) = self.hand_to_text(open) {
            if let Ok(engine) = &mut self.engine {
                for seq in &seqs {
                    engine.cancel(*seq);
                }
            }
            self.fail(why.clone(), ctx);
            return Err(refuse(RuntimeError::Unavailable(why)));
        }
        for seq in &seqs {
            self.seqs.insert(*seq, msg.id);
        }
        self.flights.insert(msg.id, Flight { seqs, events: msg.events, open: n });
        self.kick(ctx);
        Ok(())
    }
}

impl<B: Backend> Handler<Cancel> for Worker<B> {
    type Result = bool;

    fn handle(&mut self, Cancel(id): Cancel, _ctx: &mut Self::Context) -> bool {
        if !self.flights.contains_key(&id) {
            return false;
        }
        self.end(id, Event::Error(RuntimeError::Cancelled));
        true
    }
}

impl<B: Backend> Handler<GetStats> for Worker<B> {
    type Result = Vec<WorkerStats>;

    fn handle(&mut self, _: GetStats, _ctx: &mut Self::Context) -> Self::Result {
        let (running, waiting, pool, prefix, preemptions, host_adapter_bytes, step_fixed_cost, step_time) = match &mut self.engine {
            Ok(e) => {
                let (running, waiting) = e.load();
                let host = e.adapters().loader().host_bytes();
                (running, waiting, e.pool_stats(), e.prefix_stats(), e.preemptions(), host, e.step_overhead(), e.step_time())
            }
            Err(_) => Default::default(),
        };
        vec![WorkerStats {
            worker: self.index,
            device: self.model.backend().device_name(),
            unhealthy: self.engine.as_ref().err().map(|e| e.to_string()),
            in_flight: self.flights.len(),
            running,
            waiting,
            steps: self.steps,
            generated_tokens: self.generated,
            preemptions: self.past_preemptions + preemptions,
            step_fixed_cost,
            restarts: self.restarts,
            pool,
            prefix,
            host_adapter_bytes,
            adapters: self.adapters,
            resident_adapters: self.engine.as_ref().map(|e| e.resident_adapters().iter().map(|k| k.to_string()).collect()).unwrap_or_default(),
            step_time,
        }]
    }
}

impl<B: Backend> Handler<InjectFault> for Worker<B> {
    type Result = bool;

    fn handle(&mut self, msg: InjectFault, ctx: &mut Self::Context) -> bool {
        self.fault = Some(msg.reason);
        self.failing_rebuilds = msg.failed_rebuilds;
        self.kick(ctx);
        true
    }
}

impl<B: Backend> Handler<LoadAdapter> for Worker<B> {
    type Result = Vec<Result<Residency, HoldError>>;

    fn handle(&mut self, msg: LoadAdapter, ctx: &mut Self::Context) -> Self::Result {
        let Ok(engine) = &mut self.engine else { return vec![Ok(Residency::Failed("the worker has no engine".into()))] };
        let mut now = engine.prefetch(&msg.adapter);
        if let Some(holder) = &msg.holder
            && now == Residency::Resident
            && let Err(e) = engine.adapters().hold(&msg.adapter.key, holder)
        {
            return vec![Err(e)];
        }
        if now != Residency::Resident && !matches!(now, Residency::Failed(_)) {
            // Loads complete inside steps; make sure one runs.
            engine.poll_adapters_now().unwrap_or_else(|e| now = Residency::Failed(e.to_string().into()));
            self.kick(ctx);
        }
        vec![Ok(now)]
    }
}

impl<B: Backend> Handler<LocateAdapters> for Worker<B> {
    type Result = Vec<WorkerLocations>;

    fn handle(&mut self, msg: LocateAdapters, _ctx: &mut Self::Context) -> Self::Result {
        let locations = self.engine.as_mut().ok().map(|engine| msg.keys.iter().map(|k| engine.adapters().locate(k)).collect());
        vec![WorkerLocations { worker: self.index, locations }]
    }
}

impl<B: Backend> Handler<UnloadAdapter> for Worker<B> {
    type Result = bool;

    fn handle(&mut self, msg: UnloadAdapter, _ctx: &mut Self::Context) -> bool {
        let Ok(engine) = &mut self.engine else { return false };
        let held = engine.adapters().release(&msg.key, &msg.holder);
        if msg.forget {
            engine.adapters().forget(&msg.key);
        }
        held
    }
}

impl<B: Backend> Handler<TextEnded> for Worker<B> {
    type Result = ();

    /// The text stage ended these samples (their request's events are sent): the engine stops
    /// them now.
    fn handle(&mut self, msg: TextEnded, _ctx: &mut Self::Context) {
        for seq in msg.seqs {
            if self.seqs.get(&seq) == Some(&msg.id) {
                if let Ok(engine) = &mut self.engine {
                    engine.cancel(seq);
                }
                self.seq_ended(seq);
            }
        }
    }
}
