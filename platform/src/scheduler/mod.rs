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

use std::sync::Arc;

use crate::engine::SeqId;
pub use fair::{Priority, TenantId};
use fair::{FairQueues, Job};

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
    Failed(Arc<str>),
}

/// The memory side of scheduling, implemented over the page pool by the engine.
pub trait StepMemory<S> {
    /// Whether `seq` could start now (see [`Readiness`]).
    fn readiness(&mut self, seq: &S) -> Readiness;
    /// Makes `seq` ready to run: pins its adapter, reuses cached blocks of its prompt (which
    /// raises its `computed`). `Ok(false)`, with nothing held, when the pool is short now;
    /// `Err` when it can never start. `alone` says nothing else runs, so no pages will be
    /// freed by others: a shortfall then is final.
    fn start(&mut self, seq: &mut S, alone: bool) -> Result<bool, Arc<str>>;
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
    pub failed: Vec<(S, Arc<str>)>,
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

    /// Decides this step: room for the running sequences' next tokens (preempting when the pool
    /// is short), then new sequences while the budget and the running limit allow.
    pub fn schedule(&mut self, mem: &mut impl StepMemory<S>) -> StepPlan<S> {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_batch_tokens;
        self.running.sort_by_key(|j| (j.priority, j.arrival));
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let job = &self.running[i];
            let pending = job.seq.num_tokens().saturating_sub(job.seq.computed());
            if pending == 0 {
                i += 1;
                continue;
            }
            let n = pending.min(budget);
            let target = job.seq.computed() + n;
            if !self.make_room(i, target, mem, &mut plan) {
                // Sequence i itself was preempted; the next one moved into its place.
                continue;
            }
            self.charge(i, n);
            plan.chunks.push((self.running[i].seq.id(), n));
            budget -= n;
            i += 1;
        }
        self.admit(&mut budget, mem, &mut plan);
        self.prefetch(mem);
        plan
    }

    /// Grows running sequence `i` to `target` tokens, preempting the last running sequences
    /// (lowest priority, latest arrival; `i` itself last of all) until it fits. False when `i`
    /// was preempted.
    fn make_room(&mut self, i: usize, target: usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>) -> bool {
        loop {
            if mem.grow(&mut self.running[i].seq, target) {
                return true;
            }
            let victim = self.running.len() - 1;
            self.preempt(victim, mem, plan);
            if victim == i {
                return false;
            }
        }
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

    /// Starts queued sequences in fair order while there is budget, room in the running set and
    /// memory. Stops at the first ready sequence that does not fit rather than letting later
    /// ones jump ahead of it.
    fn admit(&mut self, budget: &mut usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>) {
        while *budget > 0 && self.running.len() < self.config.max_running {
            let mut failed = Vec::new();
            let next = self.queues.pop_next(|job| match mem.readiness(&job.seq) {
                Readiness::Ready => true,
                Readiness::Waiting => false,
                Readiness::Failed(why) => {
                    failed.push((job.seq.id(), why));
                    false
                }
            });
            for (id, why) in failed {
                for job in self.queues.remove_where(|j| j.seq.id() == id) {
                    plan.failed.push((job.seq, why.clone()));
                }
            }
            let Some(mut job) = next else { break };
            match mem.start(&mut job.seq, self.running.is_empty()) {
                Ok(true) => {}
                Ok(false) => {
                    self.queues.push_front(job);
                    break;
                }
                Err(why) => {
                    plan.failed.push((job.seq, why));
                    continue;
                }
            }
            // Tokens found cached are not charged.
            job.charged = job.charged.max(job.seq.computed());
            let pending = job.seq.num_tokens().saturating_sub(job.seq.computed());
            let n = pending.min(*budget);
            let target = job.seq.computed() + n;
            if n == 0 || !mem.grow(&mut job.seq, target) {
                mem.release(&mut job.seq);
                self.queues.push_front(job);
                break;
            }
            self.running.push(job);
            let i = self.running.len() - 1;
            self.charge(i, n);
            plan.chunks.push((self.running[i].seq.id(), n));
            *budget -= n;
        }
    }

    /// Asks for the adapters of the next queued requests, in the order they would be picked.
    fn prefetch(&mut self, mem: &mut impl StepMemory<S>) {
        for job in self.queues.in_pick_order().into_iter().take(self.config.prefetch_ahead) {
            mem.prefetch(&job.seq);
        }
    }
}
