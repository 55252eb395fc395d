//! Starts the workers (and the routes callers send requests by), and has actix restart the ones
//! that fail.

use std::sync::{Arc, Mutex};

use actix::{Actor, Addr, Arbiter, ArbiterHandle, Context, Handler, MessageResult, ResponseFuture, SyncArbiter};
use loraplex_kernels::Backend;

use super::routes::{Route, Routes, WorkerLoad};
use super::{
    Cancel, GetRoutes, GetStats, HoldError, InjectFault, LoadAdapter, Loader, LocateAdapters, RunLoad, UnloadAdapter, Worker, WorkerLocations, WorkerStats,
};
use crate::engine::EngineConfig;
use crate::memory::{LoaderPool, Residency};
use crate::model::Model;
use crate::tokenizer::Tokenizer;

struct Slot<B: Backend> {
    addr: Addr<Worker<B>>,
    /// The worker's own thread.
    arbiter: ArbiterHandle,
}

/// The workers' threads, which whoever stops the actor system joins: a worker drops its engine
/// (and with it the device's buffers) on its own thread, which must be over before the process
/// exits or the device's driver is torn down under it.
pub type WorkerThreads = Arc<Mutex<Vec<Arbiter>>>;

/// Stops every thread of `threads` and waits for each to end.
pub fn join_workers(threads: &WorkerThreads) {
    let arbiters = std::mem::take(&mut *threads.lock().unwrap_or_else(|p| p.into_inner()));
    for a in arbiters {
        a.stop();
        let _ = a.join();
    }
}

/// The actor that owns the workers (see the [module docs](super)).
pub struct Supervisor<B: Backend> {
    devices: Vec<Arc<Model<B>>>,
    tokenizer: Arc<Tokenizer>,
    config: EngineConfig,
    workers: Vec<Slot<B>>,
    threads: WorkerThreads,
    /// What callers route requests by; the workers keep it current.
    routes: Option<Arc<Routes<B>>>,
}

impl<B: Backend> Supervisor<B> {
    /// One worker per entry of `devices`: the base model as loaded on that device. The
    /// workers' threads go into `threads`, for [`join_workers`] once the actor system stopped.
    pub fn new(devices: Vec<Arc<Model<B>>>, tokenizer: Arc<Tokenizer>, config: EngineConfig, threads: WorkerThreads) -> Self {
        Self { devices, tokenizer, config, workers: Vec::new(), threads, routes: None }
    }
}

impl<B: Backend> Actor for Supervisor<B> {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Self::Context) {
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
        let mut routes = Vec::with_capacity(self.devices.len());
        for (index, model) in self.devices.iter().enumerate() {
            let arbiter = Arbiter::new();
            let load = Arc::new(WorkerLoad::default());
            let (model, tokenizer, config, host, worker_load) = (model.clone(), self.tokenizer.clone(), self.config.clone(), host.clone(), load.clone());
            let addr = actix::Supervisor::start_in_arbiter(&arbiter.handle(), move |_| Worker::new(index, model, tokenizer, config, host, worker_load.clone()));
            routes.push(Route { addr: addr.clone(), load });
            self.workers.push(Slot { addr, arbiter: arbiter.handle() });
            self.threads.lock().unwrap_or_else(|p| p.into_inner()).push(arbiter);
        }
        self.routes = Some(Arc::new(Routes(routes)));
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        for w in &self.workers {
            w.arbiter.stop();
        }
    }
}

impl<B: Backend> Handler<GetRoutes<B>> for Supervisor<B> {
    type Result = MessageResult<GetRoutes<B>>;

    fn handle(&mut self, _: GetRoutes<B>, _ctx: &mut Self::Context) -> Self::Result {
        MessageResult(self.routes.clone())
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
