//! The host-memory tier of adapters and the loader threads that fill it from disk.
//!
//! A load reads the PEFT files, validates every tensor against the base model, hashes the
//! weights and packs them into page images ([`PackedAdapter`]); the result is kept in a
//! byte-weighted cache (moka), so an adapter evicted from the device pool comes back with one
//! copy instead of a disk read. All of it runs on the loader threads: whoever submits a load
//! never waits for it and learns the outcome from [`AdapterLoader::completed`].

use std::path::Path;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use loraplex_adapters::{AdapterLimits, BaseShape, LoraAdapter, PackedAdapter, TargetModule};
use loraplex_kernels::LORA_ROW_ALIGN;
use moka::sync::Cache;

/// Sizes of the host tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Bytes of packed adapters kept in host memory.
    pub host_cache_bytes: u64,
    /// Threads reading and packing adapters.
    pub threads: usize,
    pub limits: AdapterLimits,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        Self { host_cache_bytes: 4 << 30, threads: 2, limits: AdapterLimits::default() }
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
}

/// The outcome of one load.
#[derive(Debug)]
pub struct LoadDone {
    pub key: Arc<str>,
    /// The adapter, or why it was refused (naming the file and tensor or key).
    pub result: Result<Arc<HostAdapter>, Arc<str>>,
}

struct Job {
    key: Arc<str>,
    dir: Arc<Path>,
    /// Where the outcome goes: the channel of the [`AdapterLoader`] that asked.
    reply: Sender<LoadDone>,
}

struct LoadContext {
    shape: BaseShape,
    limits: AdapterLimits,
    page_elems: usize,
    cache: Cache<Arc<str>, Arc<HostAdapter>>,
}

impl LoadContext {
    fn load(&self, key: &Arc<str>, dir: &Path) -> Result<Arc<HostAdapter>, String> {
        let adapter = LoraAdapter::load(dir, &self.shape, &self.limits).map_err(|e| e.to_string())?;
        let packed = PackedAdapter::pack(&adapter, self.page_elems, LORA_ROW_ALIGN).map_err(|e| format!("{}: {e}", dir.display()))?;
        let host = Arc::new(HostAdapter {
            key: key.clone(),
            content_hash: adapter.content_hash_hex(),
            max_rank: adapter.modules().map(|m| m.rank).max().unwrap_or(0),
            targets: adapter.target_modules(),
            packed,
        });
        self.cache.insert(key.clone(), host.clone());
        Ok(host)
    }
}

/// The host tier of one machine: a byte-weighted cache of packed adapters and the threads that
/// load them. Shared (through [`AdapterLoader`]s) by every device's adapter residency, so an
/// adapter is read from disk once per machine, and the tier outlives a device worker that is
/// rebuilt.
pub struct LoaderPool {
    cache: Cache<Arc<str>, Arc<HostAdapter>>,
    jobs: Mutex<Option<Sender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// moka weighs entries with a u32; weights are in KiB so that entries up to 4 TiB fit.
fn weight_kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl LoaderPool {
    /// Starts the loader threads. `shape` is what adapters are validated against and
    /// `page_elems` the page size they are packed for.
    pub fn new(config: &LoaderConfig, shape: BaseShape, page_elems: usize) -> std::io::Result<Arc<Self>> {
        let cache: Cache<Arc<str>, Arc<HostAdapter>> = Cache::builder()
            .max_capacity(config.host_cache_bytes / 1024)
            .weigher(|_k, v: &Arc<HostAdapter>| weight_kib(v.packed.bytes()))
            .build();
        let ctx = Arc::new(LoadContext { shape, limits: config.limits, page_elems, cache: cache.clone() });
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::new();
        for i in 0..config.threads.max(1) {
            let (ctx, job_rx) = (ctx.clone(), job_rx.clone());
            let worker = std::thread::Builder::new().name(format!("adapter-loader-{i}")).spawn(move || {
                loop {
                    let job = match job_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(poisoned) => poisoned.into_inner().recv(),
                    };
                    let Ok(job) = job else { break };
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.load(&job.key, &job.dir)))
                        .unwrap_or_else(|_| Err(format!("{}: the loader failed unexpectedly", job.dir.display())))
                        .map_err(Arc::from);
                    // The asker may be gone (a rebuilt worker); the adapter stays cached.
                    let _ = job.reply.send(LoadDone { key: job.key, result });
                }
            })?;
            workers.push(worker);
        }
        Ok(Arc::new(Self { cache, jobs: Mutex::new(Some(jobs)), workers: Mutex::new(workers) }))
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for LoaderPool {
    fn drop(&mut self) {
        Self::lock(&self.jobs).take();
        for w in Self::lock(&self.workers).drain(..) {
            let _ = w.join();
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
        self.pool.cache.get(key)
    }

    /// Queues a load from `dir`; its outcome comes out of [`Self::completed`].
    pub fn submit(&self, key: Arc<str>, dir: Arc<Path>) {
        if let Some(jobs) = LoaderPool::lock(&self.pool.jobs).as_ref() {
            let _ = jobs.send(Job { key, dir, reply: self.reply.clone() });
        }
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
        self.pool.cache.invalidate(key);
    }

    /// Bytes of packed adapters held in host memory (approximate until the cache's pending
    /// maintenance runs).
    pub fn host_bytes(&self) -> u64 {
        self.pool.cache.run_pending_tasks();
        self.pool.cache.weighted_size() * 1024
    }
}
