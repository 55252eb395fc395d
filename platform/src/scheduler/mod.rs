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
mod timer;

use std::collections::{HashMap, HashSet};

use crate::request::SeqError;
use crate::request::SeqId;
use fair::{FairQueues, Job};
pub use fair::{Priority, TenantId};
use timer::StepTimer;

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
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Most tokens one step computes (prefill chunks plus decodes), and its budget of cost: a
    /// token costs 1 plus `attention_cost` for every token it attends to, so a chunk of a long
    /// prompt deep into its context takes as much of a step as it takes time.
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// How many queued requests, next in line, have their adapters prefetched.
    pub prefetch_ahead: usize,
    /// The cost of attending to one cached token, relative to a token's other work (0: count
    /// tokens only).
    pub attention_cost: f64,
    /// How much longer the prompt work of a tenant may make a step that also serves a tenant
    /// ahead of it in the fair order (fewer counter, or as many and fewer sequences running),
    /// as a fraction of a step's fixed time (`None`: no such limit). A light tenant's decodes
    /// are then not padded with a heavy tenant's long prompts; the heavy tenant's prompts take
    /// more, shorter steps while the light tenant has work, and whole steps when it has none.
    pub shared_slowdown: Option<f64>,
    /// A step's fixed time (what a step takes whatever it carries) in units of cost; `None`:
    /// measured from the steps run (a quarter of `max_batch_tokens` until then).
    pub step_overhead: Option<f64>,
    /// For how long (seconds of steps run) a tenant counts as present for
    /// [`shared_slowdown`](Self::shared_slowdown) after its last work in a step: a light tenant
    /// between two requests still keeps the steps short, so its next request does not wait for
    /// a long one.
    pub presence: f64,
    /// When the decodes of the tenants behind another one in the fair order would lengthen a
    /// step that runs that tenant's prompt by at least this fraction of the step's fixed time,
    /// they wait for the next step (`None`: never). Prompt work is cut to fit
    /// [`shared_slowdown`](Self::shared_slowdown); a decode cannot be, so it waits whole. Where
    /// every row of a step costs time (a CPU), a newcomer's first token then waits for its own
    /// prompt only, not for the heavy tenant's batch as well; where rows cost little beside the
    /// fixed time (a GPU at small batches), decodes ride along. A sequence is never deferred
    /// two steps in a row.
    pub defer_decodes: Option<f64>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 2048,
            max_running: 256,
            prefetch_ahead: 16,
            attention_cost: 0.0,
            shared_slowdown: None,
            step_overhead: None,
            presence: 1.0,
            defer_decodes: None,
        }
    }
}

impl SchedulerConfig {
    /// The cost of computing tokens `start .. start + n` of a sequence: each is 1, plus
    /// `attention_cost` for each token it attends to (the ones before it and itself).
    pub fn cost(&self, start: usize, n: usize) -> f64 {
        let (s, n) = (start as f64, n as f64);
        n + self.attention_cost.max(0.0) * (n * s + n * (n + 1.0) / 2.0)
    }

    /// The most tokens (at most `pending`) of a sequence with `start` tokens computed whose
    /// [`cost`](Self::cost) fits `budget`.
    pub fn fit(&self, start: usize, pending: usize, budget: f64) -> usize {
        if pending == 0 || budget < self.cost(start, 1) {
            return 0;
        }
        if budget >= self.cost(start, pending) {
            return pending;
        }
        // cost(n) = w/2 n² + (1 + w (start + 1/2)) n: the positive root, then exact steps.
        let w = self.attention_cost.max(0.0);
        let b = 1.0 + w * (start as f64 + 0.5);
        let guess = if w == 0.0 { budget / b } else { (-b + (b * b + 2.0 * w * budget).sqrt()) / w };
        let mut n = (guess.floor().max(1.0) as usize).min(pending);
        while n > 1 && self.cost(start, n) > budget {
            n -= 1;
        }
        while n < pending && self.cost(start, n + 1) <= budget {
            n += 1;
        }
        n
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
    /// What the chunks cost (see [`SchedulerConfig::cost`]).
    pub cost: f64,
}

impl<S> Default for StepPlan<S> {
    fn default() -> Self {
        Self { chunks: Vec::new(), preempted: Vec::new(), failed: Vec::new(), cost: 0.0 }
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
    timer: StepTimer,
    /// Seconds of steps run so far.
    clock: f64,
    /// When each tenant last had work in a step (on `clock`), for those seen within
    /// `presence`.
    seen: HashMap<TenantId, f64>,
    /// The decodes left out of the last step (see [`SchedulerConfig::defer_decodes`]).
    deferred: HashSet<SeqId>,
}

impl<S: Schedulable> Scheduler<S> {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            config,
            queues: FairQueues::default(),
            running: Vec::new(),
            next_arrival: 0,
            timer: StepTimer::default(),
            clock: 0.0,
            seen: HashMap::new(),
            deferred: HashSet::new(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Tells the scheduler how long a step of `cost` took to run.
    pub fn observe_step(&mut self, cost: f64, seconds: f64) {
        self.timer.observe(cost, seconds);
        if seconds.is_finite() && seconds > 0.0 {
            self.clock += seconds;
        }
    }

    /// A step's fixed time in units of cost: configured, or measured (see
    /// [`SchedulerConfig::step_overhead`]).
    pub fn step_overhead(&self) -> f64 {
        let max = self.config.max_batch_tokens.max(1) as f64;
        self.config.step_overhead.or_else(|| self.timer.overhead()).unwrap_or(max / 4.0).clamp(1.0, max)
    }

    /// Queues a new sequence behind its tenant's earlier ones.
    pub fn enqueue(&mut self, seq: S, placement: Placement) {
        let weight = if placement.weight.is_finite() && placement.weight > 0.0 { placement.weight } else { 1.0 };
        self.queues.set_weight(&placement.tenant, weight);
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let job = Job { seq, tenant: placement.tenant, priority: placement.priority, arrival, charged: 0 };
        // A tenant back from idle gets at most one step of credit.
        self.queues.push_back(job, self.running.iter().map(|j| &j.tenant), self.config.max_batch_tokens as f64);
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
    /// floods the server. The prompt work of a tenant behind another one in the step takes at
    /// most [`SchedulerConfig::shared_slowdown`] of the step's fixed time.
    pub fn schedule(&mut self, mem: &mut impl StepMemory<S>) -> StepPlan<S> {
        let mut plan = StepPlan::default();
        let max = self.config.max_batch_tokens;
        let mut tokens = max;
        let mut decode_cost = 0.0;
        self.running.sort_by_key(|j| (j.priority, j.arrival));
        let slot = self.rebalance(mem, &mut plan);
        let mut done: HashSet<SeqId> = HashSet::new();
        // Each tenant in the step, with its place in the fair order when it first came in.
        let mut step = InStep::new(self.config.shared_slowdown.map_or(f64::INFINITY, |f| f.max(0.0) * self.step_overhead()));
        let in_service = self.in_service();
        // Tenants seen lately count as in the step, where they stood in the fair order.
        let (clock, presence) = (self.clock, self.config.presence);
        self.seen.retain(|_, at| clock - *at <= presence);
        if step.shared.is_finite() {
            for t in self.seen.keys() {
                step.join(t.clone(), (self.queues.counter(t).unwrap_or(0.0), in_service.get(t).copied().unwrap_or(0)));
            }
        }
        let mut decoding: Vec<SeqId> = self.running.iter().filter(|j| pending(j) == 1).map(|j| j.seq.id()).collect();
        // The decodes that wait for a prompt ahead of them in the fair order.
        let deferred: HashSet<SeqId> = self.defer(slot.as_ref(), mem, &in_service).into_iter().flatten().collect();
        decoding.retain(|id| !deferred.contains(id));
        for id in decoding {
            if tokens == 0 {
                break;
            }
            let at = self.get(id).map_or(0, |s| s.computed());
            let rank = self.tenant_of(id).map(|t| (t.clone(), self.rank(t, &in_service)));
            if self.give(id, 1, mem, &mut plan, &mut done) {
                tokens -= 1;
                decode_cost += self.config.cost(at, 1);
                if let Some((t, r)) = rank {
                    step.join(t, r);
                }
            }
        }
        // Prompt work gets what the decodes left of the step's cost, and never less than a
        // quarter of it: long-context decodes slow new prompts down but do not stop them.
        let mut budget = (max as f64 - decode_cost).max(max as f64 / 4.0).min(tokens as f64);
        plan.cost = decode_cost;
        let mut admitting = true;
        let mut prompt_given = false;
        if let Some(job) = slot {
            // The slot made free for it is not given to anyone else this step.
            let rank = (job.tenant.clone(), self.rank(&job.tenant, &in_service));
            match self.start(job, (budget, f64::INFINITY), mem, &mut plan, &mut done) {
                Some(cost) => {
                    budget -= cost;
                    plan.cost += cost;
                    prompt_given = true;
                    step.join(rank.0, rank.1);
                }
                None => admitting = false,
            }
        }
        while budget >= 1.0 {
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
                if deferred.contains(&id) {
                    // A deferred decode does not come back as prompt work.
                    done.insert(id);
                    continue;
                }
                let Some(tenant) = self.tenant_of(id).cloned() else { break };
                let rank = self.rank(&tenant, &in_service);
                let Some((at, pending)) = self.get(id).map(|s| (s.computed(), s.num_tokens() - s.computed())) else { break };
                let (allowed, floor) = step.allowance(&tenant, rank, budget, self.config.cost(at, 1));
                let mut n = self.config.fit(at, pending, allowed);
                // The step's first prompt work always moves a token, however deep its context.
                if n == 0 && (self.config.cost(at, 1) <= floor || (!prompt_given && floor > 0.0)) {
                    n = 1;
                }
                if n == 0 {
                    // Its next token costs more than it may take now: it goes on next step.
                    done.insert(id);
                    continue;
                }
                if self.give(id, n, mem, &mut plan, &mut done) {
                    let cost = self.config.cost(at, n);
                    budget -= cost;
                    plan.cost += cost;
                    prompt_given = true;
                    step.spend(tenant, rank, cost);
                }
            } else if let Some(job) = queued {
                let tenant = job.tenant.clone();
                let rank = self.rank(&tenant, &in_service);
                let (allowed, floor) = step.allowance(&tenant, rank, budget, self.config.cost(job.seq.computed(), 1));
                let floor = if !prompt_given && floor > 0.0 { f64::INFINITY } else { floor };
                match self.start(job, (allowed, floor), mem, &mut plan, &mut done) {
                    Some(cost) => {
                        budget -= cost;
                        plan.cost += cost;
                        prompt_given = true;
                        step.spend(tenant, rank, cost);
                    }
                    None => admitting = false,
                }
            }
        }
        if !deferred.is_empty() && !prompt_given {
            // The prompt could not start after all (the pool is short): the decodes run.
            for &id in &deferred {
                if tokens == 0 {
                    break;
                }
                let at = self.get(id).map_or(0, |s| s.computed());
                if self.give(id, 1, mem, &mut plan, &mut done) {
                    tokens -= 1;
                    plan.cost += self.config.cost(at, 1);
                }
            }
            self.deferred.clear();
        } else {
            self.deferred = deferred;
        }
        for &(id, _) in &plan.chunks {
            if let Some(t) = self.tenant_of(id) {
                self.seen.insert(t.clone(), clock);
            }
        }
        if plan.chunks.is_empty() {
            // No step runs, so the clock stands still: nobody absent may hold up the next one.
            self.seen.clear();
        }
        self.prefetch(mem);
        plan
    }

    /// The decodes this step leaves out (see [`SchedulerConfig::defer_decodes`]): those of the
    /// tenants behind the prompt work that goes first (the sequence given a slot, a running
    /// prefill, or a queued request that can start now), unless they waited last step. `None`
    /// when there is no such prompt, nobody decoding behind it, or when their decodes would
    /// cost too little of the step to matter.
    fn defer(&self, slot: Option<&Job<S>>, mem: &mut impl StepMemory<S>, in_service: &HashMap<TenantId, usize>) -> Option<Vec<SeqId>> {
        let threshold = self.config.defer_decodes? * self.step_overhead();
        let short = |k: (Priority, f64, usize, u64)| (k.0, k.1, k.2);
        let mut lead: Option<(TenantId, Key)> = None;
        let mut consider = |tenant: &TenantId, key: Key| {
            if lead.as_ref().is_none_or(|(_, l)| ahead(key, *l)) {
                lead = Some((tenant.clone(), key));
            }
        };
        if let Some(job) = slot {
            consider(&job.tenant, short(self.key(job, in_service)));
        }
        for job in self.running.iter().filter(|j| pending(j) > 1) {
            consider(&job.tenant, short(self.key(job, in_service)));
        }
        if slot.is_none() && self.running.len() < self.config.max_running {
            let first_ready =
                self.queues.in_pick_order().into_iter().take(self.config.prefetch_ahead.max(1)).find(|j| mem.readiness(&j.seq) == Readiness::Ready);
            if let Some(job) = first_ready {
                consider(&job.tenant, short(self.key(job, in_service)));
            }
        }
        let (tenant, key) = lead?;
        let mut cost = 0.0;
        let mut ids = Vec::new();
        for j in self.running.iter().filter(|j| pending(j) == 1) {
            // Another tenant's decodes behind the prompt, and the prompt's own tenant's
            // decodes of a lower class (its batch work behind its interactive prompt).
            let behind = (j.tenant != tenant || j.priority > key.0) && ahead(key, short(self.key(j, in_service)));
            if behind && !self.deferred.contains(&j.seq.id()) {
                cost += self.config.cost(j.seq.computed(), 1);
                ids.push(j.seq.id());
            }
        }
        (!ids.is_empty() && cost >= threshold).then_some(ids)
    }

    /// A tenant's place in the fair order: its counter, then its sequences running.
    fn rank(&self, tenant: &TenantId, in_service: &HashMap<TenantId, usize>) -> (f64, usize) {
        (self.queues.counter(tenant).unwrap_or(0.0), in_service.get(tenant).copied().unwrap_or(0))
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

    /// Starts a queued sequence with as much of its prompt as the budget (of cost) allows; the
    /// cost taken, or `None` (the job back at the front of its queue) when the pool is short or
    /// the budget cannot pay for its next token.
    fn start(
        &mut self,
        mut job: Job<S>,
        (budget, floor): (f64, f64),
        mem: &mut impl StepMemory<S>,
        plan: &mut StepPlan<S>,
        done: &mut HashSet<SeqId>,
    ) -> Option<f64> {
        match mem.start(&mut job.seq, self.running.is_empty()) {
            Ok(true) => {}
            Ok(false) => {
                self.queues.push_front(job);
                return None;
            }
            Err(why) => {
                plan.failed.push((job.seq, why));
                return Some(0.0);
            }
        }
        // Tokens found cached are not charged.
        job.charged = job.charged.max(job.seq.computed());
        let at = job.seq.computed();
        let mut n = self.config.fit(at, pending(&job), budget);
        if n == 0 && pending(&job) > 0 && self.config.cost(at, 1) <= floor {
            n = 1;
        }
        let target = at + n;
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
        Some(self.config.cost(at, n))
    }

    fn preempt(&mut self, i: usize, mem: &mut impl StepMemory<S>, plan: &mut StepPlan<S>) {
        let mut job = self.running.remove(i);
        mem.release(&mut job.seq);
        plan.preempted.push(job.seq.id());
        self.queues.push_front(job);
    }

    /// Charges running sequence `i`'s tenant for the cost of `n` more tokens, except those it
    /// computed before a preemption.
    fn charge(&mut self, i: usize, n: usize) {
        let job = &mut self.running[i];
        let end = job.seq.computed() + n;
        let from = job.charged.max(job.seq.computed()).min(end);
        let fresh = self.config.cost(from, end - from);
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

/// A place in the fair order: class, tenant counter, the tenant's sequences running.
type Key = (Priority, f64, usize);

/// Whether `a` comes strictly before `b` in the fair order.
fn ahead(a: Key, b: Key) -> bool {
    a.0 < b.0 || (a.0 == b.0 && (a.1 < b.1 || (a.1 == b.1 && a.2 < b.2)))
}

/// The tenants a step serves so far, and what it gave to the prompt work of tenants behind
/// another one in it.
struct InStep {
    /// Each tenant in the step, with its rank (counter, sequences running) when it came in.
    tenants: HashMap<TenantId, (f64, usize)>,
    /// The most cost the prompt work of tenants behind another one may take.
    shared: f64,
    /// What they took so far.
    spent: f64,
}

impl InStep {
    fn new(shared: f64) -> Self {
        Self { tenants: HashMap::new(), shared, spent: 0.0 }
    }

    fn join(&mut self, tenant: TenantId, rank: (f64, usize)) {
        self.tenants.entry(tenant).or_insert(rank);
    }

    /// Whether another tenant in the step is ahead of `tenant` in the fair order.
    fn behind(&self, tenant: &TenantId, rank: (f64, usize)) -> bool {
        let rank = self.tenants.get(tenant).copied().unwrap_or(rank);
        self.tenants.iter().any(|(t, r)| t != tenant && (r.0 < rank.0 || (r.0 == rank.0 && r.1 < rank.1)))
    }

    /// The cost `tenant`'s prompt work may take out of `budget`: all of it, or, behind another
    /// tenant, what is left of the shared allowance (the first such chunk of a step may always
    /// take one token, costing `one`, so that no prompt stops for good).
    ///
    /// Returns the allowance and the budget one token may take whatever the allowance (the
    /// whole budget for the first such chunk, else 0): a new sequence's context, and so its
    /// next token's cost, is only known once it starts (cached prompt blocks).
    fn allowance(&self, tenant: &TenantId, rank: (f64, usize), budget: f64, one: f64) -> (f64, f64) {
        if !self.shared.is_finite() || !self.behind(tenant, rank) {
            return (budget, budget);
        }
        if self.spent == 0.0 {
            return (self.shared.max(one).min(budget).max(0.0), budget);
        }
        ((self.shared - self.spent).min(budget).max(0.0), 0.0)
    }

    fn spend(&mut self, tenant: TenantId, rank: (f64, usize), cost: f64) {
        if self.shared.is_finite() && self.behind(&tenant, rank) {
            self.spent += cost;
        }
        self.join(tenant, rank);
    }
}
