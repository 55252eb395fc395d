//! Per-tenant queues served by virtual token counters (VTC).
//!
//! Every tenant has a counter: the service it received (the cost of its tokens, see
//! [`super::SchedulerConfig::cost`]) divided by its weight. The next request comes from the
//! backlogged tenant (one with queued requests) whose counter is smallest, so over any interval
//! two backlogged tenants receive service in proportion to their weights, within a bound of a
//! few requests' worth of tokens. A tenant that returns from idle is lifted to one step's
//! worth of service below the smallest counter among the tenants with work, queued or running:
//! idle time is not banked as credit beyond what lets an occasional short request go first, and
//! a newcomer does not go ahead of tenants whose requests are all running for longer than that.
//!
//! Priority classes come first: a tenant's interactive requests are served before anyone's
//! batch requests; within a class the counters decide.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// A tenant: the owner of requests, the unit of fair share.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub Arc<str>);

impl TenantId {
    pub fn new(name: &str) -> Self {
        TenantId(name.into())
    }
}

impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Service classes, most urgent first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// A person is waiting on the answer.
    #[default]
    Interactive,
    /// Offline work: runs when no interactive request is waiting.
    Batch,
}

impl Priority {
    pub const ALL: [Priority; 2] = [Priority::Interactive, Priority::Batch];

    fn index(self) -> usize {
        self as usize
    }
}

/// One queued request with what the scheduler keeps about it.
#[derive(Debug)]
pub(super) struct Job<S> {
    pub seq: S,
    pub tenant: TenantId,
    pub priority: Priority,
    /// Arrival order, over all tenants (kept across preemptions).
    pub arrival: u64,
    /// Tokens of this sequence already charged to its tenant: recomputing them after a
    /// preemption is not charged again.
    pub charged: usize,
}

#[derive(Debug)]
struct Tenant<S> {
    weight: f64,
    /// Service (cost) received divided by the weight.
    counter: f64,
    /// Queued requests per priority class, in order.
    queues: [VecDeque<Job<S>>; 2],
}

impl<S> Tenant<S> {
    fn backlogged(&self) -> bool {
        self.queues.iter().any(|q| !q.is_empty())
    }
}

/// The waiting requests of every tenant and their counters.
#[derive(Debug)]
pub(super) struct FairQueues<S> {
    tenants: HashMap<TenantId, Tenant<S>>,
}

impl<S> Default for FairQueues<S> {
    fn default() -> Self {
        Self { tenants: HashMap::new() }
    }
}

impl<S> FairQueues<S> {
    /// Sets a tenant's weight (its share relative to the others'); it takes effect for service
    /// charged from now on.
    pub fn set_weight(&mut self, tenant: &TenantId, weight: f64) {
        self.tenant(tenant).weight = weight;
    }

    fn tenant(&mut self, id: &TenantId) -> &mut Tenant<S> {
        self.tenants.entry(id.clone()).or_insert_with(|| Tenant { weight: 1.0, counter: 0.0, queues: Default::default() })
    }

    /// The smallest counter among the tenants other than `except` with queued requests or
    /// in `running`.
    fn min_active(&self, except: &TenantId, running: &std::collections::HashSet<&TenantId>) -> Option<f64> {
        self.tenants.iter().filter(|(id, t)| *id != except && (t.backlogged() || running.contains(id))).map(|(_, t)| t.counter).min_by(f64::total_cmp)
    }

    /// Queues a new request at the back of its tenant's class queue, lifting a tenant that was
    /// idle (nothing queued, nothing in `running`) to `credit` of service below the smallest
    /// counter of the tenants with work.
    pub fn push_back<'a>(&mut self, job: Job<S>, running: impl Iterator<Item = &'a TenantId>, credit: f64) {
        let running: std::collections::HashSet<&TenantId> = running.collect();
        let idle = !running.contains(&job.tenant) && self.tenants.get(&job.tenant).is_none_or(|t| !t.backlogged());
        let lift = if idle { self.min_active(&job.tenant, &running) } else { None };
        let t = self.tenant(&job.tenant);
        if let Some(min) = lift {
            t.counter = t.counter.max(min - credit.max(0.0) / t.weight);
        }
        let class = job.priority.index();
        t.queues[class].push_back(job);
    }

    /// Puts a preempted request back at the front of its tenant's class queue: it resumes before
    /// that tenant's later requests. No lift: it was already being served.
    pub fn push_front(&mut self, job: Job<S>) {
        let class = job.priority.index();
        self.tenant(&job.tenant).queues[class].push_front(job);
    }

    /// Adds `cost` of service to a tenant's counter.
    pub fn charge(&mut self, tenant: &TenantId, cost: f64) {
        let t = self.tenant(tenant);
        t.counter += cost / t.weight;
    }

    /// Every tenant seen.
    pub fn tenants(&self) -> impl Iterator<Item = &TenantId> {
        self.tenants.keys()
    }

    /// A tenant's weight (1 for one never seen).
    pub fn weight(&self, tenant: &TenantId) -> f64 {
        self.tenants.get(tenant).map_or(1.0, |t| t.weight)
    }

    /// The summed weights of the tenants with queued requests or among `running`.
    pub fn active_weights<'a>(&self, running: impl Iterator<Item = &'a TenantId>) -> f64 {
        let mut seen: std::collections::HashSet<&TenantId> = running.collect();
        seen.extend(self.tenants.iter().filter(|(_, t)| t.backlogged()).map(|(id, _)| id));
        seen.iter().map(|t| self.weight(t)).sum()
    }

    pub fn counter(&self, tenant: &TenantId) -> Option<f64> {
        self.tenants.get(tenant).map(|t| t.counter)
    }

    pub fn len(&self) -> usize {
        self.tenants.values().map(|t| t.queues.iter().map(VecDeque::len).sum::<usize>()).sum()
    }

    /// Every queued request in the order they would be picked if all were ready and the
    /// counters did not move: class, then tenant counter, then queue position.
    pub fn in_pick_order(&self) -> Vec<&Job<S>> {
        let mut tenants: Vec<&Tenant<S>> = self.tenants.values().collect();
        tenants.sort_by(|a, b| a.counter.total_cmp(&b.counter));
        Priority::ALL.iter().flat_map(|p| tenants.iter().flat_map(move |t| t.queues[p.index()].iter())).collect()
    }

    /// Takes the next request: in the most urgent class that has a ready one, from the tenant
    /// with the smallest counter among those with a ready one (on equal counters, the one with
    /// the smaller `in_service`, then by name), that tenant's first ready request. `ready` is
    /// asked about queued requests (it may start loads for those it turns down); `None` when
    /// no queued request is ready.
    pub fn pop_next(&mut self, mut ready: impl FnMut(&Job<S>) -> bool, in_service: impl Fn(&TenantId) -> usize) -> Option<Job<S>> {
        for class in Priority::ALL.map(Priority::index) {
            let mut best: Option<(&TenantId, (f64, usize), usize)> = None;
            for (id, t) in &self.tenants {
                let rank = (t.counter, in_service(id));
                if best.is_some_and(|(bid, r, _)| (rank, id) >= (r, bid)) {
                    continue;
                }
                if let Some(pos) = t.queues[class].iter().position(&mut ready) {
                    best = Some((id, rank, pos));
                }
            }
            if let Some((id, _, pos)) = best {
                let id = id.clone();
                return self.tenants.get_mut(&id).and_then(|t| t.queues[class].remove(pos));
            }
        }
        None
    }

    /// Removes the queued requests `pred` picks, in no particular order.
    pub fn remove_where(&mut self, mut pred: impl FnMut(&Job<S>) -> bool) -> Vec<Job<S>> {
        let mut out = Vec::new();
        for t in self.tenants.values_mut() {
            for q in &mut t.queues {
                let mut i = 0;
                while i < q.len() {
                    if pred(&q[i]) {
                        out.extend(q.remove(i));
                    } else {
                        i += 1;
                    }
                }
            }
        }
        out
    }
}
