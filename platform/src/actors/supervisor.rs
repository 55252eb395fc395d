//! Starts the workers, routes requests to them, and has actix restart the ones that fail.

use std::collections::HashSet;
use std::sync::Arc;

use actix::{Actor, Addr, Arbiter, AsyncContext, Context, Handler, ResponseFuture, SyncArbiter};
use loraplex_kernels::Backend;

use super::{
    Cancel, GetStats, HoldError, InjectFault, LoadAdapter, Loader, LocateAdapters, RunLoad, RuntimeError, Submit, UnloadAdapter, Worker, WorkerLocations,
    WorkerReport, WorkerStats,
};
use crate::engine::EngineConfig;
use crate::memory::{LoaderPool, Residency};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

struct Slot<B: Backend> {
    addr: Addr<Worker<B>>,
    /// The worker's own thread; kept so that it lives as long as the supervisor.
    _arbiter: Arbiter,
    /// Requests routed there and not finished, as of its last report plus routes since.
    in_flight: usize,
    /// Adapters resident in its pool, as of its last report.
    resident: HashSet<Arc<str>>,
    /// It has an engine (as of its last report); an unhealthy worker gets no requests.
    healthy: bool,
}

/// The actor that owns the workers (see the [module docs](super)).
pub struct Supervisor<B: Backend> {
    devices: Vec<Arc<Model<B>>>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    workers: Vec<Slot<B>>,
}

impl<B: Backend> Supervisor<B> {
    /// One worker per entry of `devices`: the base model as loaded on that device.
    pub fn new(devices: Vec<Arc<Model<B>>>, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Self {
        Self { devices, tokenizer, config, workers: Vec::new() }
    }

    /// A healthy worker where the request's adapter is resident, the least loaded of those;
    /// else the least loaded healthy worker.
    fn route(&self, submit: &Submit) -> Option<usize> {
        let key = submit.request.get().adapter.as_ref().map(|a| a.key.clone());
        let least = |pick: &dyn Fn(&Slot<B>) -> bool| {
            self.workers.iter().enumerate().filter(|(_, w)| w.healthy && pick(w)).min_by_key(|(i, w)| (w.in_flight, *i)).map(|(i, _)| i)
        };
        key.and_then(|k| least(&|w| w.resident.contains(&k))).or_else(|| least(&|_| true))
    }
}

impl<B: Backend> Actor for Supervisor<B> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let me = ctx.address().recipient();
        // One host tier for the machine, filled by the loader actor's threads.
        let threads = self.config.adapters.threads.max(1);
        let loader = SyncArbiter::start(threads, || Loader);
        let host = self.devices.first().map(|m| {
            let page_elems = self.config.kv_layout(m).page_elems();
            LoaderPool::with_executor(&self.config.adapters, m.base_shape(), page_elems, move |task| {
                // `do_send` queues past the mailbox's capacity: a burst of prefetches must
                // not be refused.
                let alive = loader.connected();
                if alive {
                    loader.do_send(RunLoad(task));
                }
                alive
            })
        });
        for (index, model) in self.devices.iter().enumerate() {
            let arbiter = Arbiter::new();
            let (model, tokenizer, config, host, me) = (model.clone(), self.tokenizer.clone(), self.config.clone(), host.clone(), me.clone());
            let addr = actix::Supervisor::start_in_arbiter(&arbiter.handle(), move |_| Worker::new(index, model, tokenizer, config, host, Some(me)));
            self.workers.push(Slot { addr, _arbiter: arbiter, in_flight: 0, resident: HashSet::new(), healthy: true });
        }
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        for w in &self.workers {
            w._arbiter.stop();
        }
    }
}

impl<B: Backend> Handler<Submit> for Supervisor<B> {
    type Result = ResponseFuture<Result<(), RuntimeError>>;

    fn handle(&mut self, msg: Submit, _ctx: &mut Self::Context) -> Self::Result {
        let Some(i) = self.route(&msg) else {
            return Box::pin(async { Err(RuntimeError::Unavailable("no device worker is healthy; they are being rebuilt".into())) });
        };
        self.workers[i].in_flight += 1;
        let addr = self.workers[i].addr.clone();
        Box::pin(async move { addr.send(msg).await.map_err(|e| RuntimeError::Unavailable(format!("worker {i}: {e}").into()))? })
    }
}

impl<B: Backend> Handler<Cancel> for Supervisor<B> {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, msg: Cancel, _ctx: &mut Self::Context) -> Self::Result {
        let sends: Vec<_> = self.workers.iter().map(|w| w.addr.send(msg)).collect();
        Box::pin(async move { futures::future::join_all(sends).await.into_iter().any(|r| r.unwrap_or(false)) })
    }
}

impl<B: Backend> Handler<GetStats> for Supervisor<B> {
    type Result = ResponseFuture<Vec<WorkerStats>>;

    fn handle(&mut self, _: GetStats, _ctx: &mut Self::Context) -> Self::Result {
        let sends: Vec<_> = self.workers.iter().map(|w| w.addr.send(GetStats)).collect();
        Box::pin(async move { futures::future::join_all(sends).await.into_iter().flat_map(|r| r.unwrap_or_default()).collect() })
    }
}

impl<B: Backend> Handler<LoadAdapter> for Supervisor<B> {
    type Result = ResponseFuture<Vec<Result<Residency, HoldError>>>;

    fn handle(&mut self, msg: LoadAdapter, _ctx: &mut Self::Context) -> Self::Result {
        let sends: Vec<_> = self.workers.iter().map(|w| w.addr.send(msg.clone())).collect();
        Box::pin(async move {
            futures::future::join_all(sends)
                .await
                .into_iter()
                .map(|r| r.ok().and_then(|v| v.into_iter().next()).unwrap_or_else(|| Ok(Residency::Failed("a worker is unreachable".into()))))
                .collect()
        })
    }
}

impl<B: Backend> Handler<UnloadAdapter> for Supervisor<B> {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, msg: UnloadAdapter, _ctx: &mut Self::Context) -> Self::Result {
        let sends: Vec<_> = self.workers.iter().map(|w| w.addr.send(msg.clone())).collect();
        Box::pin(async move { futures::future::join_all(sends).await.into_iter().any(|r| r.unwrap_or(false)) })
    }
}

impl<B: Backend> Handler<LocateAdapters> for Supervisor<B> {
    type Result = ResponseFuture<Vec<WorkerLocations>>;

    fn handle(&mut self, msg: LocateAdapters, _ctx: &mut Self::Context) -> Self::Result {
        let sends: Vec<_> = self.workers.iter().map(|w| w.addr.send(msg.clone())).collect();
        Box::pin(async move {
            futures::future::join_all(sends)
                .await
                .into_iter()
                .enumerate()
                .map(|(worker, r)| r.ok().and_then(|v| v.into_iter().next()).unwrap_or(WorkerLocations { worker, locations: None }))
                .collect()
        })
    }
}

impl<B: Backend> Handler<InjectFault> for Supervisor<B> {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, msg: InjectFault, _ctx: &mut Self::Context) -> Self::Result {
        let Some(w) = self.workers.get(msg.worker) else { return Box::pin(async { false }) };
        let send = w.addr.send(msg);
        Box::pin(async move { send.await.unwrap_or(false) })
    }
}

impl<B: Backend> Handler<WorkerReport> for Supervisor<B> {
    type Result = ();

    fn handle(&mut self, msg: WorkerReport, _ctx: &mut Self::Context) {
        let Some(w) = self.workers.get_mut(msg.worker) else { return };
        w.in_flight = msg.in_flight;
        w.healthy = msg.healthy;
        if let Some(resident) = msg.resident {
            w.resident = resident.into_iter().collect();
        }
    }
}
