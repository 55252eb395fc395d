//! Forms each step's batch: which sequences run, how many tokens each computes, who waits and
//! who is preempted. Pure and synchronous: it never touches a device; the memory it needs is
//! asked of a [`StepMemory`], so the same logic runs against the real page pool and against
//! the fakes of its tests.
//!
//! - **Continuous batching at iteration level.** Every step gives each running sequence its
//!   next tokens: one for a decoding sequence, a chunk of its prompt for a prefilling one, up to
//!   a per-step token budget and a maximum number of running sequences. Long prompts are
//!   prefilled in chunks over several steps, mixed with the decodes of others.
//! - **Fair share.** Waiting requests sit in per-tenant queues served by virtual token counters
//!   (see [`fair`]); interactive requests go before batch ones.
//! - **Adapters.** Only a request whose adapter is resident is started; the adapters of the
//!   requests next in line are prefetched ahead of their turn.
//! - **Preemption.** When the pool cannot give a running sequence room for its next tokens, the
//!   running sequence of lowest priority that arrived last gives up its pages and goes back to
//!   the front of its tenant's queue; it recomputes its tokens when it resumes, and its output
//!   does not change (its sampler's state stays with it).

mod fair;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};

use crate::engine::SeqId;
use crate::request::SeqError;
use fair::{FairQueues, Job};
pub use fair::{Priority, TenantId};

/// Tokens of a job not computed yet.
fn pending<S: Schedulable>(job: &Job<S>) -> usize {
    job.seq.num_tokens().saturating_sub(job.seq.computed())
}

/// What the scheduler reads of a sequence it holds.
pub trait Schedulable {
    fn id(&self) -> SeqId;
    /// Tokens the sequence holds: its prompt, then what it generated so far.
    fn num_tokens(&self) -> usize;
    /// Of those, the tokens whose K/V are in the cache.
    fn computed(&self) -> usize;
}

/// Whether a queued sequence can start now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Its adapter (if any) is resident.
    Ready,
    /// Its adapter is still on its way.
    Waiting,
    /// It can never run (its adapter failed to load; it can never fit): drop it with this reason.
    Failed(SeqError),
}

/// The memory side of scheduling, implemented over the page pool by the engine.
pub trait StepMemory<S> {
    /// Whether `seq` could start now (see [`Readiness`]).
    fn readiness(&mut self, seq: &S) -> Readiness;
    /// Makes `seq` ready to run: pins its adapter, reuses cached blocks of its prompt (which
    /// raises its `computed`). `Ok(false)`, with nothing held, when the pool is short now;
    /// `Err` when it can never start. `alone` says nothing else runs, so no pages will be
    /// freed by others: a shortfall then is final.
    fn start(&mut self, seq: &mut S, alone: bool) -> Result<bool, SeqError>;
    /// Gives `seq` room in the cache for `tokens` tokens in all; false, with nothing changed,
    /// when the pool is short.
    fn grow(&mut self, seq: &mut S, tokens: usize) -> bool;
    /// Lets go of everything `seq` holds in the pool; it will recompute its tokens when it runs
    /// again (its `computed` drops to zero).
    fn release(&mut self, seq: &mut S);
    /// Starts bringing in what a queued sequence will need (its adapter) ahead of its turn.
    fn prefetch(&mut self, seq: &S);
}

/// Limits of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most tokens one step computes (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// How many queued requests, next in line, have their adapters prefetched.
    pub prefetch_ahead: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { max_batch_tokens: 2048, max_running: 256, prefetch_ahead: 16 }
    }
}

/// Where a request goes: its tenant (and that tenant's weight) and its class.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub tenant: TenantId,
    /// The tenant's share relative to other tenants' (its plan's weight); positive.
    pub weight: f64,
    pub priority: Priority,
    /// Whose cached prompt blocks the request may reuse, and share its own with: the tenant's
    /// when `None`.
    pub cache_namespace: Option<std::sync::Arc<str>>,
}

impl Placement {
    pub fn tenant(tenant: TenantId, weight: f64) -> Self {
        Self { tenant, weight, ..Self::default() }
    }

    /// The prefix cache namespace in effect. A chosen namespace never equals a tenant's own.
    pub fn namespace(&self) -> std::sync::Arc<str> {
        match &self.cache_namespace {
            Some(ns) => format!("shared:{ns}").into(),
            None => format!("tenant:{}", self.tenant).into(),
        }
    }
}

impl Default for Placement {
    fn default() -> Self {
        Self { tenant: TenantId::new("default"), weight: 1.0, priority: Priority::Interactive, cache_namespace: None }
    }
}

/// One step's decisions.
#[derive(Debug)]
pub struct StepPlan<S> {
    /// The sequences that compute this step and how many tokens each, in batch order.
    pub chunks: Vec<(SeqId, usize)>,
    /// Running sequences sent back to their queues to free pages.
    pub preempted: Vec<SeqId>,
    /// Queued sequences that can never run, with the reason.
    pub failed: Vec<(S, SeqError)>,
}

impl<S> Default for StepPlan<S> {
    fn default() -> Self {
        Self { chunks: Vec::new(), preempted: Vec::new(), failed: Vec::new() }
    }
}

/// The waiting and running sequences of one device, and the policy that moves them.
#[derive(Debug)]
pub struct Scheduler<S> {
    config: SchedulerConfig,
    queues: FairQueues<S>,
    /// Running sequences, kept in service order: priority, then arrival.
    running: Vec<Job<S>>,
    next_arrival: u64,
}

impl<S: Schedulable> Scheduler<S> {
    pub fn new(config: SchedulerConfig) -> Self {
        Self { config, queues: FairQueues::default(), running: Vec::new(), next_arrival: 0 }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a new sequence behind its tenant's earlier ones.
    pub fn enqueue(&mut self, seq: S, placement: Placement) {
        let weight = if placement.weight.is_finite() && placement.weight > 0.0 { placement.weight } else { 1.0 };
        self.queues.set_weight(&placement.tenant, weight);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.queues.push_back(Job { seq, tenant: placement.tenant, priority: placement.priority, arrival, charged: 0 });
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || self.queues.len() > 0
    }

    pub fn waiting_len(&self) -> usize {
        self.queues.len()
    }

    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// A tenant's virtual token counter (service received divided by its weight).
    pub fn counter(&self, tenant: &TenantId) -> Option<f64> {
        self.queues.counter(tenant)
    }

    pub fn running(&self) -> impl Iterator<Item = &S> {
        self.running.iter().map(|j| &j.seq)
    }

    pub fn get(&self, id: SeqId) -> Option<&S> {
        self.running.iter().find(|j| j.seq.id() == id).map(|j| &j.seq)
    }

    /// Every sequence held, running ones first.
    pub fn all(&self) -> impl Iterator<Item = &S> {
        self.running.iter().chain(self.queues.in_pick_order()).map(|j| &j.seq)
    }

    /// Takes the queued sequences `pred` picks out of their queues.
    pub fn remove_waiting_where(&mut self, mut pred: impl FnMut(&S) -> bool) -> Vec<S> {
        self.queues.remove_where(|j| pred(&j.seq)).into_iter().map(|j| j.seq).collect()
    }

    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut S> {
        self.running.iter_mut().find(|j| j.seq.id() == id).map(|j| &mut j.seq)
    }

    /// The tenant of a running sequence.
    pub fn tenant_of(&self, id: SeqId) -> Option<&TenantId> {
        self.running.iter().find(|j| j.seq.id() == id).map(|j| &j.tenant)
    }

    /// Runs `child`, split off running sequence `parent` (another sample of its prompt), right
    /// after it, in the same tenant, class and arrival; the tokens it already holds are not
    /// charged again. Gives `child` back if `parent` is not running.
    pub fn fork(&mut self, parent: SeqId, child: S) -> Result<(), S> {
        let Some(i) = self.running.iter().position(|j| j.seq.id() == parent) else { return Err(child) };
        let p = &self.running[i];
        let job = Job { charged: child.computed(), tenant: p.tenant.clone(), priority: p.priority, arrival: p.arrival, seq: child };
        self.running.insert(i + 1, job);
        Ok(())
    }

    /// Takes a running sequence out (it finished).
    pub fn finish(&mut self, id: SeqId) -> Option<S> {
        let i = self.running.iter().position(|j| j.seq.id() == id)?;
        Some(self.running.remove(i).seq)
    }

    /// Takes a sequence out wherever it is (its client went away).
    pub fn cancel(&mut self, id: SeqId) -> Option<S> {
        self.finish(id).or_else(|| self.queues.remove_where(|j| j.seq.id() == id).pop().map(|j| j.seq))
    }

    /// Decides this step. First a running slot for a tenant below its share, if the running
    /// set is full with another tenant's sequences. Then one token for every decoding sequence
    /// (preempting when the pool is short). The rest of the budget goes to prompt work (chunks of
    /// running prefills, and new sequences) in fair order: class, then tenant counter, then
    /// arrival. So a tenant that just arrived is not stuck behind the long prompts of one that
    /// floods the server.
    pub fn schedule(&mut self, mem: &mut impl StepMemory<S>) -> StepPlan<S> {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_batch_tokens;
        self.running.sort_by_key(|j| (j.priority, j.arrival));
        let slot = self.rebalance(mem, &mut plan);
        let mut done: HashSet<SeqId> = HashSet::new();
        let decoding: Vec<SeqId> = self.running.iter().filter(|j| pending(j) == 1).map(|j| j.seq.id()).collect();
        for id in decoding {
            if budget == 0 {
                break;
            }
            if self.give(id, 1, mem, &mut plan, &mut done) {
                budget -= 1;
            }
        }
        let mut admitting = true;
        if let Some(job) = slot {
            // The slot made free for it is not given to anyone else this step.
            match self.start(job, budget, mem, &mut plan, &mut done) {
                Some(n) => budget -= n,
                None => admitting = false,
            }
        }
        while budget > 0 {
            let in_service = self.in_service();
            let best_running = self
                .running
                .iter()
                .filter(|j| pending(j) > 0 && !done.contains(&j.seq.id()))
                .map(|j| (self.key(j, &in_service), j.seq.id()))
                .min_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
            let queued = if admitting && self.running.len() < self.config.max_running { self.next_ready(mem, &mut plan, &in_service) } else { None };
            let run_first = match (&best_running, &queued) {
                (None, None) => break,
                (Some((key, _)), Some(q)) => *key <= self.key(q, &in_service),
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            if run_first {
                if let Some(q) = queued {
                    self.queues.push_front(q);
                }
                let Some((_, id)) = best_running else { break };
                let n = self.get(id).map_or(0, |s| s.num_tokens() - s.computed()).min(budget);
                if self.give(id, n, mem, &mut plan, &mut done) {
                    budget -= n;
                }
            } else if let Some(job) = queued {
                match self.start(job, budget, mem, &mut plan, &mut done) {
                    Some(n) => budget -= n,
                    None => admitting = false,
                }
            }
        }
        self.prefetch(mem);
        plan
    }

    /// The fair order of prompt work: class, tenant counter, then (on equal counters, as when
    /// a tenant returns from idle) the tenant with fewer sequences running, then arrival.
    fn key(&self, job: &Job<S>, in_service: &HashMap<TenantId, usize>) -> (Priority, f64, usize, u64) {
        let running = in_service.get(&job.tenant).copied().unwrap_or(0);
        (job.priority, self.queues.counter(&job.tenant).unwrap_or(0.0), running, job.arrival)
    }

    /// Running sequences per tenant.
    fn in_service(&self) -> HashMap<TenantId, usize> {
        let mut n = HashMap::new();
        for j in &self.running {
            *n.entry(j.tenant.clone()).or_default() += 1;
        }
        n
    }

    /// The queued sequence to start next, if one is ready; those that can never run go to
    /// `plan.failed`.
    fn next_ready(&mut self, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>, in_service: &HashMap<TenantId, usize>) -> Option<Job<S>> {
        let mut failed = Vec::new();
        let ready = |job: &Job<S>| match mem.readiness(&job.seq) {
            Readiness::Ready => true,
            Readiness::Waiting => false,
            Readiness::Failed(why) => {
                failed.push((job.seq.id(), why));
                false
            }
        };
        let next = self.queues.pop_next(ready, |t| in_service.get(t).copied().unwrap_or(0));
        for (id, why) in failed {
            for job in self.queues.remove_where(|j| j.seq.id() == id) {
                plan.failed.push((job.seq, why.clone()));
            }
        }
        next
    }

    /// Gives running sequence `id` room for `n` more tokens and puts them in the plan. False if
    /// it was preempted instead (the pool could not make room).
    fn give(&mut self, id: SeqId, n: usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>, done: &mut HashSet<SeqId>) -> bool {
        if n == 0 || !self.make_room(id, n, mem, plan, done) {
            return false;
        }
        let Some(i) = self.index_of(id) else { return false };
        self.charge(i, n);
        plan.chunks.push((id, n));
        done.insert(id);
        true
    }

    /// Starts a queued sequence with as much of its prompt as the budget allows; the tokens
    /// taken, or `None` (the job back at the front of its queue) when the pool is short.
    fn start(&mut self, mut job: Job<S>, budget: usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>, done: &mut HashSet<SeqId>) -> Option<usize> {
        match mem.start(&mut job.seq, self.running.is_empty()) {
            Ok(true) => {}
            Ok(false) => {
                self.queues.push_front(job);
                return None;
            }
            Err(why) => {
                plan.failed.push((job.seq, why));
                return Some(0);
            }
        }
        // Tokens found cached are not charged.
        job.charged = job.charged.max(job.seq.computed());
        let n = pending(&job).min(budget);
        let target = job.seq.computed() + n;
        if n == 0 || !mem.grow(&mut job.seq, target) {
            mem.release(&mut job.seq);
            self.queues.push_front(job);
            return None;
        }
        let id = job.seq.id();
        self.running.push(job);
        self.charge(self.running.len() - 1, n);
        plan.chunks.push((id, n));
        done.insert(id);
        Some(n)
    }

    fn preempt(&mut self, i: usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>) {
        let mut job = self.running.remove(i);
        mem.release(&mut job.seq);
        plan.preempted.push(job.seq.id());
        self.queues.push_front(job);
    }

    /// Charges running sequence `i`'s tenant for `n` more tokens, except those it computed
    /// before a preemption.
    fn charge(&mut self, i: usize, n: usize) {
        let job = &mut self.running[i];
        let end = job.seq.computed() + n;
        let fresh = end.saturating_sub(job.charged);
        job.charged = job.charged.max(end);
        let tenant = job.tenant.clone();
        self.queues.charge(&tenant, fresh);
    }

    fn index_of(&self, id: SeqId) -> Option<usize> {
        self.running.iter().position(|j| j.seq.id() == id)
    }

    /// Grows running sequence `id` by `n` tokens, preempting the last running sequences not yet
    /// given work this step (lowest priority, latest arrival; `id` itself last of all) until it
    /// fits. False when `id` was preempted.
    fn make_room(&mut self, id: SeqId, n: usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>, done: &HashSet<SeqId>) -> bool {
        loop {
            let Some(i) = self.index_of(id) else { return false };
            let target = self.running[i].seq.computed() + n;
            if mem.grow(&mut self.running[i].seq, target) {
                return true;
            }
            let Some(victim) = self.running.iter().rposition(|j| !done.contains(&j.seq.id())) else { return false };
            let victim_id = self.running[victim].seq.id();
            self.preempt(victim, mem, plan);
            if victim_id == id {
                return false;
            }
        }
    }

    /// When the running set is full, a ready queued sequence of a tenant running fewer
    /// sequences than its share of the running slots (by weight, among tenants with work)
    /// takes the slot of the latest sequence of the tenant most over its share, which resumes
    /// later from the front of its tenant's queue (its full blocks usually still cached).
    /// Returns the sequence to start this step.
    fn rebalance(&mut self, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>) -> Option<Job<S>> {
        if self.running.len() < self.config.max_running {
            return None;
        }
        let running = self.in_service();
        let active = self.queues.active_weights(running.keys()).max(f64::MIN_POSITIVE);
        let slots = self.config.max_running as f64;
        let share = |queues: &FairQueues<S>, t: &TenantId| slots * queues.weight(t) / active;
        let count = |t: &TenantId| running.get(t).copied().unwrap_or(0) as f64;
        let over = running
            .keys()
            .filter(|t| count(t) > share(&self.queues, t))
            .max_by(|a, b| (count(a) / share(&self.queues, a)).total_cmp(&(count(b) / share(&self.queues, b))))
            .cloned()?;
        let shares: HashMap<TenantId, f64> = self.queues.tenants().map(|t| (t.clone(), share(&self.queues, t))).collect();
        let under = |t: &TenantId| count(t) + 1.0 <= shares.get(t).copied().unwrap_or(0.0);
        let mut failed = Vec::new();
        let job = self.queues.pop_next(
            |j| {
                under(&j.tenant)
                    && match mem.readiness(&j.seq) {
                        Readiness::Ready => true,
                        Readiness::Waiting => false,
                        Readiness::Failed(why) => {
                            failed.push((j.seq.id(), why));
                            false
                        }
                    }
            },
            |t| running.get(t).copied().unwrap_or(0),
        );
        for (id, why) in failed {
            for job in self.queues.remove_where(|j| j.seq.id() == id) {
                plan.failed.push((job.seq, why.clone()));
            }
        }
        let job = job?;
        if let Some(v) = self.running.iter().rposition(|j| j.tenant == over) {
            self.preempt(v, mem, plan);
        }
        Some(job)
    }

    /// Asks for the adapters of the next queued requests, in the order they would be picked.
    fn prefetch(&mut self, mem: &mut impl StepMemory<S>) {
        for job in self.queues.in_pick_order().into_iter().take(self.config.prefetch_ahead) {
            mem.prefetch(&job.seq);
        }
    }
}
