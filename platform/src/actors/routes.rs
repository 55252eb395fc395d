//! Where a request goes: each worker's load, health and resident adapters, kept current by the
//! worker itself and read by whoever submits, so that a request travels from its caller's
//! thread straight to its worker's mailbox without a stop at the supervisor's thread, and a
//! worker's step tells no other thread anything.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use actix::Addr;
use loraplex_kernels::Backend;

use super::Worker;

/// One worker's state as routing sees it. The worker writes it; routing reads it and counts
/// the requests it sends there.
#[derive(Debug)]
pub(crate) struct WorkerLoad {
    /// Requests in flight there: the worker's own count as of its last step, plus those
    /// routed to it since.
    in_flight: AtomicUsize,
    /// It has an engine and takes requests.
    healthy: AtomicBool,
    /// The adapters resident in its pool, as of its last change.
    resident: RwLock<HashSet<Arc<str>>>,
}

impl Default for WorkerLoad {
    fn default() -> Self {
        Self { in_flight: AtomicUsize::new(0), healthy: AtomicBool::new(true), resident: RwLock::new(HashSet::new()) }
    }
}

impl WorkerLoad {
    /// The worker's own count of requests in flight, and whether it has an engine.
    pub(crate) fn set(&self, in_flight: usize, healthy: bool) {
        self.in_flight.store(in_flight, Ordering::Relaxed);
        self.healthy.store(healthy, Ordering::Relaxed);
    }

    /// The adapters now resident in the worker's pool.
    pub(crate) fn set_resident(&self, resident: Vec<Arc<str>>) {
        let resident: HashSet<Arc<str>> = resident.into_iter().collect();
        // A poisoned lock only means a writer panicked mid-assignment; the set is replaced whole.
        *self.resident.write().unwrap_or_else(|e| e.into_inner()) = resident;
    }

    /// Counts one more request sent here, until the worker's next count.
    fn routed(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    fn holds(&self, key: &str) -> bool {
        self.resident.read().unwrap_or_else(|e| e.into_inner()).contains(key)
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// A worker's mailbox and its load.
pub(crate) struct Route<B: Backend> {
    pub addr: Addr<Worker<B>>,
    pub load: Arc<WorkerLoad>,
}

/// Every worker's route, in worker order.
pub(crate) struct Routes<B: Backend>(pub Vec<Route<B>>);

impl<B: Backend> Routes<B> {
    /// The worker a request for `adapter` goes to (see [`choose`]); `None` when none is
    /// healthy. The pick counts as one more request in flight there until the worker's next
    /// count.
    pub(crate) fn pick(&self, adapter: Option<&str>) -> Option<&Route<B>> {
        let route = &self.0[choose(self.0.iter().map(|r| &*r.load), adapter)?];
        route.load.routed();
        Some(route)
    }
}

/// A healthy worker where `adapter` is resident, the least loaded of those; else the least
/// loaded healthy worker; the lowest index among equals.
fn choose<'a>(loads: impl Iterator<Item = &'a WorkerLoad> + Clone, adapter: Option<&str>) -> Option<usize> {
    let least = |pick: &dyn Fn(&WorkerLoad) -> bool| {
        loads.clone().enumerate().filter(|(_, w)| w.healthy() && pick(w)).min_by_key(|(i, w)| (w.in_flight(), *i)).map(|(i, _)| i)
    };
    adapter.and_then(|k| least(&|w| w.holds(k))).or_else(|| least(&|_| true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(n: usize) -> Vec<WorkerLoad> {
        (0..n).map(|_| WorkerLoad::default()).collect()
    }

    /// [`choose`], counted as [`Routes::pick`] counts it.
    fn pick(loads: &[WorkerLoad], adapter: Option<&str>) -> Option<usize> {
        let i = choose(loads.iter(), adapter)?;
        loads[i].routed();
        Some(i)
    }

    #[test]
    fn requests_spread_over_the_least_loaded_and_follow_resident_adapters() {
        let w = loads(3);
        assert_eq!([pick(&w, None), pick(&w, None), pick(&w, None), pick(&w, None)], [Some(0), Some(1), Some(2), Some(0)]);
        // A worker's own count replaces what routing added.
        w[0].set(0, true);
        assert_eq!(pick(&w, None), Some(0));
        w[2].set_resident(vec!["a@1".into()]);
        assert_eq!(pick(&w, Some("a@1")), Some(2), "where the adapter is resident, though busier");
        assert_eq!(pick(&w, Some("b@1")), Some(0));
        w[2].set(0, false);
        assert_eq!(pick(&w, Some("a@1")), Some(1), "an unhealthy worker gets nothing; the least loaded does");
        for l in &w {
            l.set(0, false);
        }
        assert_eq!(pick(&w, None), None);
    }
}
