//! A bounded pool for the CPU-heavy or blocking work of requests (tokenizing, chat templates,
//! parsing large bodies, validating adapters, file I/O), so that none of it runs on the HTTP
//! workers' async threads. At most `threads` jobs run at once and at most `queue` wait; past
//! that a request is refused with 503 at once instead of piling up.
//!
//! A job whose request goes away still runs to its end (blocking work cannot be interrupted),
//! holding its slot meanwhile, so the bound holds whatever clients do.
//!
//! Three pools: the one every request's preparation goes through (tokenizing, templates); a
//! background one of its own threads at the lowest CPU priority (on Linux the idle scheduling
//! class) for work no request is waiting on to start generating: validating uploaded adapters
//! and writing their files (on a busy machine it only gets the CPU the device workers leave, so
//! one tenant's uploads never slow another tenant's generation); and one of threads with deep
//! stacks for compiling grammars, whose compiler recurses on what the client sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Semaphore;

use super::ApiError;

/// A job for a background thread.
type Task = Box<dyn FnOnce() + Send>;

#[derive(Debug)]
pub struct BlockingPool {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue: usize,
    /// Threads of the pool's own (the background and deep pools); `None`: tokio's blocking
    /// threads.
    threads: Option<Mutex<std::sync::mpsc::Sender<Task>>>,
    /// Why the pool's own threads could not start: every job is refused with it.
    broken: Option<String>,
}

/// Puts the calling thread at the lowest CPU priority the system gives an unprivileged thread.
fn lower_priority() {
    // Lowering one's own priority needs no privilege; where it is refused the work still runs,
    // at normal priority.
    let _ = thread_priority::set_current_thread_priority(thread_priority::ThreadPriority::Min);
    // On Linux, the idle scheduling class instead (its weight is below niceness 19's, which it
    // makes moot): a thread of the lowest niceness may still keep a core for a while after a
    // device worker wakes up wanting it; an idle-class one gives it up at once, so a parallel
    // step is not held up by an upload.
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy, thread_native_id};
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        let _ = set_thread_priority_and_policy(thread_native_id(), thread_priority::ThreadPriority::Min, idle);
    }
}

/// Takes back a place in the queue when the waiter stops waiting (got a slot, or went away).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl BlockingPool {
    pub fn new(threads: usize, queue: usize) -> Self {
        Self { slots: Arc::new(Semaphore::new(threads.max(1))), waiting: AtomicUsize::new(0), queue, threads: None, broken: None }
    }

    /// A pool that refuses every job with 503, saying `why` (its threads could not start).
    pub fn broken(why: impl Into<String>) -> Self {
        Self { broken: Some(why.into()), ..Self::new(1, 0) }
    }

    /// A pool of `threads` threads of its own at the lowest CPU priority the system gives an
    /// unprivileged thread.
    pub fn background(threads: usize, queue: usize) -> std::io::Result<Self> {
        Self::own_threads("background", threads, queue, None, true)
    }

    /// A pool of `threads` threads of its own, each with a stack of `stack` bytes, for work
    /// that recurses on what clients send (compiling grammars): a stack sized for the deepest
    /// input the checks before the work let through. A thread's stack is address space, taken
    /// in pages as it is used.
    pub fn deep(name: &str, threads: usize, queue: usize, stack: usize) -> std::io::Result<Self> {
        Self::own_threads(name, threads, queue, Some(stack), false)
    }

    fn own_threads(name: &str, threads: usize, queue: usize, stack: Option<usize>, lowest_priority: bool) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let mut builder = std::thread::Builder::new().name(format!("{name}-{i}"));
            if let Some(bytes) = stack {
                builder = builder.stack_size(bytes);
            }
            builder.spawn(move || {
                if lowest_priority {
                    lower_priority();
                }
                loop {
                    let task = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    match task {
                        Ok(task) => task(),
                        Err(_) => return,
                    }
                }
            })?;
        }
        let mut pool = Self::new(threads, queue);
        pool.threads = Some(Mutex::new(tx));
        Ok(pool)
    }

    /// Runs `job` on a blocking thread once a slot is free; 503 if too many jobs wait already.
    pub async fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        if let Some(why) = &self.broken {
            return Err(ApiError::Unavailable(why.clone()));
        }
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::Overloaded { message: "the server is busy preparing other requests; retry shortly".into(), retry_after: 1 });
        }
        let waiting = Waiting(&self.waiting);
        let slot = self.slots.clone().acquire_owned().await.map_err(|_| ApiError::Unavailable("the server is shutting down".into()))?;
        drop(waiting);
        let Some(threads) = &self.threads else {
            return tokio::task::spawn_blocking(move || {
                let _slot = slot;
                job()
            })
            .await
            .map_err(|e| ApiError::Internal(format!("a blocking job failed: {e}")));
        };
        let (done, result) = tokio::sync::oneshot::channel();
        let task: Task = Box::new(move || {
            let _slot = slot;
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            let _ = done.send(out);
        });
        threads.lock().unwrap_or_else(|e| e.into_inner()).send(task).map_err(|_| ApiError::Unavailable("the background threads have stopped".into()))?;
        match result.await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(_)) => Err(ApiError::Internal("a job of the server's own threads panicked".into())),
            Err(_) => Err(ApiError::Unavailable("the background threads have stopped".into())),
        }
    }

    /// Jobs waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn at_most_threads_run_and_a_full_queue_refuses_at_once() {
        let pool = Arc::new(BlockingPool::new(2, 3));
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(std::sync::Mutex::new(gate));
        let mut jobs = Vec::new();
        for _ in 0..5 {
            let (pool, running, peak, gate) = (pool.clone(), running.clone(), peak.clone(), gate.clone());
            jobs.push(tokio::spawn(async move {
                pool.run(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    let _ = gate.lock().unwrap().recv();
                    running.fetch_sub(1, Ordering::SeqCst);
                })
                .await
            }));
        }
        // Two run, three wait: the queue is full.
        for _ in 0..200 {
            if pool.waiting() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pool.waiting(), 3);
        assert!(matches!(pool.run(|| ()).await, Err(ApiError::Overloaded { .. })), "a sixth job is refused without waiting");
        for _ in 0..5 {
            release.send(()).unwrap();
        }
        for j in jobs {
            j.await.unwrap().unwrap();
        }
        assert_eq!(peak.load(Ordering::SeqCst), 2);
        assert_eq!(pool.waiting(), 0);
        assert_eq!(pool.run(|| 7).await.unwrap(), 7);
    }

    #[tokio::test]
    async fn the_background_pool_runs_on_its_own_low_priority_threads() {
        let pool = BlockingPool::background(2, 8).unwrap();
        let name = pool.run(|| std::thread::current().name().map(str::to_string)).await.unwrap();
        assert!(name.is_some_and(|n| n.starts_with("background-")));
        #[cfg(target_os = "linux")]
        {
            // Its threads are in the idle scheduling class (policy 5, SCHED_IDLE): the lowest
            // priority there is.
            let stat = std::fs::read_to_string(format!("/proc/self/task/{}/stat", pool_tid(&pool).await)).unwrap();
            let after_name: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
            let policy: u32 = after_name[38].parse().unwrap();
            assert_eq!(policy, 5, "{stat}");
        }
        assert!(matches!(pool.run(|| panic!("boom")).await, Err(ApiError::Internal(_))), "a panicking job is an error, not a lost thread");
        assert_eq!(pool.run(|| 5).await.unwrap(), 5);
    }

    /// The Linux thread id of one of the pool's threads.
    #[cfg(target_os = "linux")]
    async fn pool_tid(pool: &BlockingPool) -> i64 {
        pool.run(|| std::fs::read_link("/proc/thread-self").unwrap().file_name().unwrap().to_string_lossy().parse().unwrap()).await.unwrap()
    }
}
