//! A bounded pool for the CPU-heavy or blocking work of requests (tokenizing, chat templates,
//! parsing large bodies, validating adapters, file I/O), so that none of it runs on the HTTP
//! workers' async threads. At most `threads` jobs run at once and at most `queue` wait; past
//! that a request is refused with 503 at once instead of piling up.
//!
//! A job whose request goes away still runs to its end (blocking work cannot be interrupted),
//! holding its slot meanwhile, so the bound holds whatever clients do.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use super::ApiError;

#[derive(Debug)]
pub struct BlockingPool {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue: usize,
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
        Self { slots: Arc::new(Semaphore::new(threads.max(1))), waiting: AtomicUsize::new(0), queue }
    }

    /// Runs `job` on a blocking thread once a slot is free; 503 if too many jobs wait already.
    pub async fn run<T: Send + 'static>(&self, job: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(ApiError::Overloaded { message: "the server is busy preparing other requests; retry shortly".into(), retry_after: 1 });
        }
        let waiting = Waiting(&self.waiting);
        let slot = self.slots.clone().acquire_owned().await.map_err(|_| ApiError::Unavailable("the server is shutting down".into()))?;
        drop(waiting);
        tokio::task::spawn_blocking(move || {
            let _slot = slot;
            job()
        })
        .await
        .map_err(|e| ApiError::Internal(format!("a blocking job failed: {e}")))
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
}
