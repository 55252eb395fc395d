//! The host-memory tier of adapters and the loader threads that fill it from disk.
//!
//! A load reads the PEFT files, validates every tensor against the base model, hashes the
//! weights and packs them into page images ([`PackedAdapter`]); the result is kept in a
//! byte-weighted cache (moka), so an adapter evicted from the device pool comes back with one
//! copy instead of a disk read. All of it runs on the loader threads: whoever submits a load
//! never waits for it and learns the outcome from [`AdapterLoader::completed`].
//!
//! Each tenant's adapters may hold a share of the tier ([`LoaderConfig::tenant_percent`]): a
//! load that takes a tenant beyond it drops that tenant's own oldest loads, so a tenant cycling
//! through many adapters does not push every other tenant's out to disk.

use std::path::Path;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use loraplex_adapters::{AdapterLimits, BaseShape, LoraAdapter, PackedAdapter, TargetModule};
use loraplex_kernels::LORA_ROW_ALIGN;

use super::AdapterRef;
use moka::sync::Cache;

/// Sizes of the host tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Bytes of packed adapters kept in host memory.
    pub host_cache_bytes: u64,
    /// Threads reading and packing adapters.
    pub threads: usize,
    pub limits: AdapterLimits,
    /// Percent of `host_cache_bytes` one tenant's adapters may hold (100: no share).
    pub tenant_percent: u32,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self { host_cache_bytes: 4 << 30, threads: 2, limits: AdapterLimits::default(), tenant_percent: 50 }
    }
}

/// A validated adapter in host memory, packed for the device pool.
#[derive(Debug)]
pub struct HostAdapter {
    pub key: Arc<str>,
    pub packed: PackedAdapter,
    /// SHA-256 of the weights, lowercase hex.
    pub content_hash: String,
    pub max_rank: usize,
    pub targets: Vec<TargetModule>,
    /// Whose it is (see [`AdapterRef::tenant`]).
    pub tenant: Option<Arc<str>>,
    /// When it was loaded: a tenant beyond its share loses its oldest first.
    pub loaded: std::time::Instant,
}

/// The outcome of one load.
#[derive(Debug)]
pub struct LoadDone {
    pub key: Arc<str>,
    /// The adapter, or why it was refused (naming the file and tensor or key).
    pub result: Result<Arc<HostAdapter>, Arc<str>>,
}

/// One load, ready to run on whichever thread executes loads.
pub type LoadTask = Box<dyn FnOnce() + Send>;

struct LoadContext {
    shape: BaseShape,
    limits: AdapterLimits,
    page_elems: usize,
    cache: Cache<Arc<str>, Arc<HostAdapter>>,
    /// Bytes of one tenant's adapters beyond which its oldest are dropped (`None`: no share).
    tenant_share: Option<u64>,
}

impl LoadContext {
    fn load(&self, key: &Arc<str>, dir: &Path, validated: bool, tenant: Option<Arc<str>>) -> Result<Arc<HostAdapter>, String> {
        // An uploaded adapter was parsed and validated once, at upload: its manifest says what
        // is in the weights file, and no PEFT config or pattern is read again.
        let adapter = if validated { LoraAdapter::load_validated(dir, &self.shape, &self.limits) } else { LoraAdapter::load(dir, &self.shape, &self.limits) };
        let adapter = adapter.map_err(|e| e.to_string())?;
        let packed = PackedAdapter::pack(&adapter, self.page_elems, LORA_ROW_ALIGN).map_err(|e| format!("{}: {e}", dir.display()))?;
        let host = Arc::new(HostAdapter {
            key: key.clone(),
            content_hash: adapter.content_hash_hex(),
            max_rank: adapter.modules().map(|m| m.rank).max().unwrap_or(0),
            targets: adapter.target_modules(),
            packed,
            tenant,
            loaded: std::time::Instant::now(),
        });
        self.cache.insert(key.clone(), host.clone());
        self.keep_share(&host);
        Ok(host)
    }

    /// Drops the oldest other adapters of `host`'s tenant while the tenant holds more than its
    /// share. A walk over the tier per load: loads read and pack whole adapters from disk, and
    /// the tier holds at most thousands of them.
    fn keep_share(&self, host: &HostAdapter) {
        let (Some(share), Some(tenant)) = (self.tenant_share, &host.tenant) else { return };
        let mut mine: Vec<(std::time::Instant, Arc<str>, u64)> = self
            .cache
            .iter()
            .filter(|(k, v)| v.tenant.as_ref() == Some(tenant) && **k != host.key)
            .map(|(k, v)| (v.loaded, (*k).clone(), v.packed.bytes() as u64))
            .collect();
        let mut held = host.packed.bytes() as u64 + mine.iter().map(|m| m.2).sum::<u64>();
        mine.sort_by_key(|m| m.0);
        for (_, key, bytes) in mine {
            if held <= share {
                break;
            }
            self.cache.invalidate(&key);
            held -= bytes;
        }
    }
}

/// The host tier of one machine: a byte-weighted cache of packed adapters and the threads that
/// load them. Shared (through [`AdapterLoader`]s) by every device's adapter residency, so an
/// adapter is read from disk once per machine, and the tier outlives a device worker that is
/// rebuilt.
pub struct LoaderPool {
    ctx: Arc<LoadContext>,
    runner: Runner,
}

/// Where loads run.
enum Runner {
    /// Threads of the pool's own.
    Threads { tasks: Mutex<Option<Sender<LoadTask>>>, threads: Mutex<Vec<JoinHandle<()>>> },
    /// An executor the owner provides (the runtime's loader actor); false when it is gone.
    External(Box<dyn Fn(LoadTask) -> bool + Send + Sync>),
}

/// moka weighs entries with a u32; weights are in KiB so that entries up to 4 TiB fit.
fn weight_kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl LoaderPool {
    fn context(config: &LoaderConfig, shape: BaseShape, page_elems: usize) -> Arc<LoadContext> {
        let cache: Cache<Arc<str>, Arc<HostAdapter>> =
            Cache::builder().max_capacity(config.host_cache_bytes / 1024).weigher(|_k, v: &Arc<HostAdapter>| weight_kib(v.packed.bytes())).build();
        let tenant_share = (config.tenant_percent < 100).then(|| config.host_cache_bytes / 100 * config.tenant_percent as u64);
        Arc::new(LoadContext { shape, limits: config.limits, page_elems, cache, tenant_share })
    }

    /// Starts `config.threads` loader threads. `shape` is what adapters are validated against
    /// and `page_elems` the page size they are packed for.
    pub fn new(config: &LoaderConfig, shape: BaseShape, page_elems: usize) -> std::io::Result<Arc<Self>> {
        let (tasks, task_rx) = mpsc::channel::<LoadTask>();
        let task_rx = Arc::new(Mutex::new(task_rx));
        let mut threads = Vec::new();
        for i in 0..config.threads.max(1) {
            let task_rx = task_rx.clone();
            let thread = std::thread::Builder::new().name(format!("adapter-loader-{i}")).spawn(move || {
                loop {
                    let task = lock(&task_rx).recv();
                    let Ok(task) = task else { break };
                    task();
                }
            })?;
            threads.push(thread);
        }
        let runner = Runner::Threads { tasks: Mutex::new(Some(tasks)), threads: Mutex::new(threads) };
        Ok(Arc::new(Self { ctx: Self::context(config, shape, page_elems), runner }))
    }

    /// A host tier whose loads run on `execute` (which returns false when it can no longer
    /// run anything).
    pub fn with_executor(config: &LoaderConfig, shape: BaseShape, page_elems: usize, execute: impl Fn(LoadTask) -> bool + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self { ctx: Self::context(config, shape, page_elems), runner: Runner::External(Box::new(execute)) })
    }

    /// Runs a load off the caller's thread; its outcome goes to `reply`.
    fn submit(&self, adapter: AdapterRef, reply: Sender<LoadDone>) {
        let ctx = self.ctx.clone();
        let failed = reply.clone();
        let failed_key = adapter.key.clone();
        let task: LoadTask = Box::new(move || {
            let AdapterRef { key, dir, validated, tenant } = adapter;
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.load(&key, &dir, validated, tenant)))
                .unwrap_or_else(|_| Err(format!("{}: the loader failed unexpectedly", dir.display())))
                .map_err(Arc::from);
            // The asker may be gone (a rebuilt worker); the adapter stays cached.
            let _ = reply.send(LoadDone { key, result });
        });
        let queued = match &self.runner {
            Runner::Threads { tasks, .. } => lock(tasks).as_ref().is_some_and(|t| t.send(task).is_ok()),
            Runner::External(execute) => execute(task),
        };
        if !queued {
            let _ = failed.send(LoadDone { key: failed_key, result: Err("the adapter loader has stopped".into()) });
        }
    }
}

impl Drop for LoaderPool {
    fn drop(&mut self) {
        if let Runner::Threads { tasks, threads } = &self.runner {
            lock(tasks).take();
            for t in lock(threads).drain(..) {
                let _ = t.join();
            }
        }
    }
}

/// One device's access to the host tier: it submits loads and receives their outcomes on its
/// own channel.
pub struct AdapterLoader {
    pool: Arc<LoaderPool>,
    reply: Sender<LoadDone>,
    done: Receiver<LoadDone>,
}

impl AdapterLoader {
    /// A host tier of its own (see [`LoaderPool::new`]).
    pub fn new(config: &LoaderConfig, shape: BaseShape, page_elems: usize) -> std::io::Result<Self> {
        Ok(Self::on(LoaderPool::new(config, shape, page_elems)?))
    }

    /// Access to a shared host tier.
    pub fn on(pool: Arc<LoaderPool>) -> Self {
        let (reply, done) = mpsc::channel();
        Self { pool, reply, done }
    }

    /// The adapter if it is in host memory.
    pub fn cached(&self, key: &str) -> Option<Arc<HostAdapter>> {
        self.pool.ctx.cache.get(key)
    }

    /// Queues a load of `adapter`; its outcome comes out of [`Self::completed`].
    pub fn submit(&self, adapter: AdapterRef) {
        self.pool.submit(adapter, self.reply.clone());
    }

    /// Loads finished since the last call, without waiting.
    pub fn completed(&self) -> Vec<LoadDone> {
        self.done.try_iter().collect()
    }

    /// Waits up to `timeout` for the next finished load.
    pub fn wait(&self, timeout: std::time::Duration) -> Option<LoadDone> {
        self.done.recv_timeout(timeout).ok()
    }

    /// Drops an adapter from host memory (a deleted adapter).
    pub fn invalidate(&self, key: &str) {
        self.pool.ctx.cache.invalidate(key);
    }

    /// Bytes of packed adapters held in host memory (approximate until the cache's pending
    /// maintenance runs).
    pub fn host_bytes(&self) -> u64 {
        self.pool.ctx.cache.run_pending_tasks();
        self.pool.ctx.cache.weighted_size() * 1024
    }
}
