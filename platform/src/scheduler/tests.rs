use std::collections::{HashMap, HashSet};

use super::*;

/// A sequence as the scheduler sees it: `len` tokens, `computed` of them cached, `blocks` held.
#[derive(Debug)]
struct Seq {
    id: SeqId,
    len: usize,
    computed: usize,
    max_len: usize,
    blocks: usize,
    adapter: Option<&'static str>,
}

impl Schedulable for Seq {
    fn id(&self) -> SeqId {
        self.id
    }
    fn num_tokens(&self) -> usize {
        self.len
    }
    fn computed(&self) -> usize {
        self.computed
    }
}

/// A pool of `free` blocks of `block` tokens; adapters listed in `ready` are resident.
struct Mem {
    block: usize,
    total: usize,
    free: usize,
    ready: HashSet<&'static str>,
    failed: HashSet<&'static str>,
    prefetched: Vec<&'static str>,
}

impl Mem {
    fn new(total: usize, block: usize) -> Self {
        Mem { block, total, free: total, ready: HashSet::new(), failed: HashSet::new(), prefetched: Vec::new() }
    }
}

impl StepMemory<Seq> for Mem {
    fn readiness(&mut self, seq: &Seq) -> Readiness {
        match seq.adapter {
            Some(a) if self.failed.contains(a) => Readiness::Failed(SeqError::AdapterFailed(format!("adapter {a} failed").into())),
            Some(a) if !self.ready.contains(a) => Readiness::Waiting,
            _ => Readiness::Ready,
        }
    }
    fn start(&mut self, seq: &mut Seq, alone: bool) -> Result<bool, SeqError> {
        let need = seq.max_len.div_ceil(self.block);
        if alone && need > self.free {
            return Err(SeqError::PoolExhausted { needed: need, available: self.free });
        }
        Ok(self.free > 0)
    }
    fn grow(&mut self, seq: &mut Seq, tokens: usize) -> bool {
        let need = tokens.div_ceil(self.block).saturating_sub(seq.blocks);
        if need > self.free {
            return false;
        }
        self.free -= need;
        seq.blocks += need;
        true
    }
    fn release(&mut self, seq: &mut Seq) {
        self.free += seq.blocks;
        seq.blocks = 0;
        seq.computed = 0;
    }
    fn prefetch(&mut self, seq: &Seq) {
        if let Some(a) = seq.adapter {
            self.prefetched.push(a);
        }
    }
}

struct Sim {
    sched: Scheduler<Seq>,
    mem: Mem,
    next: u64,
    /// Tokens computed per tenant.
    served: HashMap<TenantId, usize>,
    finished: Vec<SeqId>,
    /// Tokens generated per sequence, in order of generation steps (for resume checks).
    generated: HashMap<SeqId, usize>,
}

impl Sim {
    fn new(config: SchedulerConfig, mem: Mem) -> Self {
        Sim { sched: Scheduler::new(config), mem, next: 0, served: HashMap::new(), finished: Vec::new(), generated: HashMap::new() }
    }

    fn add(&mut self, tenant: &str, weight: f64, priority: Priority, prompt: usize, new_tokens: usize, adapter: Option<&'static str>) -> SeqId {
        let id = SeqId(self.next);
        self.next += 1;
        let seq = Seq { id, len: prompt, computed: 0, max_len: prompt + new_tokens, blocks: 0, adapter };
        self.sched.enqueue(seq, Placement { tenant: TenantId::new(tenant), weight, priority, cache_namespace: None });
        id
    }

    /// One step: schedule, then apply the plan as an engine would.
    fn step(&mut self) -> StepPlan<Seq> {
        let plan = self.sched.schedule(&mut self.mem);
        // Every step takes 10 ms.
        self.sched.observe_step(plan.cost.max(1.0), 0.01);
        let total: usize = plan.chunks.iter().map(|&(_, n)| n).sum();
        assert!(total <= self.sched.config().max_batch_tokens, "budget exceeded: {total}");
        assert!(self.sched.running_len() <= self.sched.config().max_running);
        for &(id, n) in &plan.chunks {
            let tenant = self.sched.tenant_of(id).expect("planned sequences run").clone();
            *self.served.entry(tenant).or_default() += n;
            let seq = self.sched.get_mut(id).unwrap();
            assert!(seq.computed + n <= seq.blocks * self.mem.block, "tokens beyond the sequence's blocks");
            seq.computed += n;
            if seq.computed == seq.len {
                seq.len += 1;
                *self.generated.entry(id).or_default() += 1;
                if seq.len == seq.max_len {
                    let done = self.sched.finish(id).unwrap();
                    self.mem.free += done.blocks;
                    self.finished.push(id);
                }
            }
        }
        plan
    }

    fn served(&self, tenant: &str) -> usize {
        self.served.get(&TenantId::new(tenant)).copied().unwrap_or(0)
    }
}

fn config(max_batch_tokens: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig { max_batch_tokens, max_running, prefetch_ahead: 4, attention_cost: 0.0, ..SchedulerConfig::default() }
}

#[test]
fn backlogged_tenants_are_served_in_proportion_to_their_weights() {
    let mut sim = Sim::new(config(64, 4), Mem::new(10_000, 16));
    for _ in 0..300 {
        sim.add("a", 1.0, Priority::Interactive, 32, 8, None);
        sim.add("b", 2.0, Priority::Interactive, 32, 8, None);
    }
    // VTC's bound: the weighted service of two backlogged tenants never drifts apart by more
    // than about two requests' worth of tokens plus one step's budget.
    let bound = 2.0 * (32.0 + 8.0) + 64.0;
    for step in 0..400 {
        sim.step();
        let (a, b) = (sim.served("a") as f64, sim.served("b") as f64 / 2.0);
        assert!((a - b).abs() <= bound, "step {step}: a {a} vs b/2 {b}");
    }
    let ratio = sim.served("b") as f64 / sim.served("a") as f64;
    assert!((ratio - 2.0).abs() < 0.15, "b received {ratio:.2}x a's service, not 2x");
}

#[test]
fn a_light_tenant_is_not_starved_by_a_flood() {
    let mut sim = Sim::new(config(64, 4), Mem::new(10_000, 16));
    for _ in 0..500 {
        sim.add("flood", 1.0, Priority::Interactive, 48, 16, None);
    }
    for _ in 0..20 {
        sim.step();
    }
    let light = sim.add("light", 1.0, Priority::Interactive, 48, 4, None);
    let mut waited = 0;
    while !sim.sched.running().any(|s| s.id == light) && !sim.finished.contains(&light) {
        sim.step();
        waited += 1;
        assert!(waited < 20, "the light tenant waited {waited} steps");
    }
    // Lifted to the flood's counter on arrival: no credit for the time it was idle, so it
    // does not shut the flood out either.
    let (flood, light_c) = (sim.sched.counter(&TenantId::new("flood")).unwrap(), sim.sched.counter(&TenantId::new("light")).unwrap());
    assert!(light_c >= flood - 64.0, "light {light_c} vs flood {flood}");
    for _ in 0..20 {
        sim.step();
    }
    assert!(sim.finished.contains(&light));
}

#[test]
fn a_returning_tenant_is_lifted_to_one_step_below_the_smallest_backlogged_counter() {
    let mut sim = Sim::new(config(64, 2), Mem::new(10_000, 16));
    sim.add("b", 1.0, Priority::Interactive, 8, 1, None);
    sim.step();
    for _ in 0..50 {
        sim.add("a", 1.0, Priority::Interactive, 32, 4, None);
    }
    for _ in 0..30 {
        sim.step();
    }
    let a = sim.sched.counter(&TenantId::new("a")).unwrap();
    assert!(a > 100.0);
    sim.add("b", 1.0, Priority::Interactive, 8, 1, None);
    assert_eq!(sim.sched.counter(&TenantId::new("b")), Some(a - 64.0), "b's idle time is not banked beyond one step");
}

#[test]
fn interactive_requests_start_before_batch_ones() {
    let mut sim = Sim::new(config(1000, 2), Mem::new(10_000, 16));
    let batch: Vec<SeqId> = (0..3).map(|_| sim.add("a", 1.0, Priority::Batch, 8, 4, None)).collect();
    let inter: Vec<SeqId> = (0..2).map(|_| sim.add("b", 1.0, Priority::Interactive, 8, 4, None)).collect();
    let plan = sim.step();
    let started: Vec<SeqId> = plan.chunks.iter().map(|&(id, _)| id).collect();
    assert_eq!(started, inter);
    while sim.sched.has_work() {
        sim.step();
    }
    assert!(batch.iter().all(|id| sim.finished.contains(id)));
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_alongside_decodes() {
    let mut sim = Sim::new(config(16, 4), Mem::new(10_000, 16));
    let short = sim.add("a", 1.0, Priority::Interactive, 4, 20, None);
    sim.step();
    let long = sim.add("a", 1.0, Priority::Interactive, 50, 2, None);
    let mut chunks = Vec::new();
    while !sim.generated.contains_key(&long) {
        let plan = sim.step();
        assert!(plan.chunks.contains(&(short, 1)), "the decode runs every step");
        chunks.extend(plan.chunks.iter().filter(|c| c.0 == long).map(|c| c.1));
    }
    assert_eq!(chunks, vec![15, 15, 15, 5]);
}

#[test]
fn only_requests_with_resident_adapters_start_and_queued_adapters_are_prefetched() {
    let mut sim = Sim::new(config(1000, 8), Mem::new(10_000, 16));
    let cold = sim.add("a", 1.0, Priority::Interactive, 8, 2, Some("x"));
    let plain = sim.add("a", 1.0, Priority::Interactive, 8, 2, None);
    let plan = sim.step();
    assert_eq!(plan.chunks, vec![(plain, 8)], "the plain request does not wait behind the cold adapter");
    assert!(sim.mem.prefetched.contains(&"x"));
    sim.mem.ready.insert("x");
    let plan = sim.step();
    assert!(plan.chunks.contains(&(cold, 8)));
}

#[test]
fn a_request_whose_adapter_failed_is_dropped_with_the_reason() {
    let mut sim = Sim::new(config(1000, 8), Mem::new(10_000, 16));
    let bad = sim.add("a", 1.0, Priority::Interactive, 8, 2, Some("broken"));
    sim.mem.failed.insert("broken");
    let plan = sim.step();
    assert_eq!(plan.failed.len(), 1);
    assert_eq!(plan.failed[0].0.id, bad);
    assert!(matches!(&plan.failed[0].1, SeqError::AdapterFailed(why) if why.contains("broken")), "{}", plan.failed[0].1);
    assert!(!sim.sched.has_work());
}

#[test]
fn a_request_that_can_never_fit_fails_instead_of_waiting_forever() {
    let mut sim = Sim::new(config(1000, 8), Mem::new(4, 16));
    sim.add("a", 1.0, Priority::Interactive, 60, 40, None);
    let plan = sim.step();
    assert_eq!(plan.failed.len(), 1);
    assert!(matches!(plan.failed[0].1, SeqError::PoolExhausted { needed: 7, available: 4 }), "{}", plan.failed[0].1);
}

#[test]
fn preemption_takes_the_lowest_priority_latest_arrival_and_it_resumes() {
    // 6 blocks of 4 tokens; three sequences that each grow to 12 tokens (3 blocks).
    let mut sim = Sim::new(config(100, 8), Mem::new(6, 4));
    let first = sim.add("a", 1.0, Priority::Interactive, 4, 8, None);
    let batch = sim.add("b", 1.0, Priority::Batch, 4, 8, None);
    let second = sim.add("c", 1.0, Priority::Interactive, 4, 8, None);
    let mut preempted = Vec::new();
    for _ in 0..200 {
        if !sim.sched.has_work() {
            break;
        }
        preempted.extend(sim.step().preempted);
    }
    assert!(!sim.sched.has_work(), "every sequence finished");
    assert_eq!(preempted.first(), Some(&batch), "the batch request goes first");
    assert!(!preempted.contains(&first), "the earliest interactive request is never preempted");
    for id in [first, batch, second] {
        assert_eq!(sim.generated[&id], 8, "{id:?} generated all its tokens");
    }
    assert_eq!(sim.mem.free, sim.mem.total, "every block came back");
}

#[test]
fn recomputed_tokens_are_not_charged_twice() {
    let mut sim = Sim::new(config(100, 8), Mem::new(3, 4));
    sim.add("a", 1.0, Priority::Interactive, 4, 8, None);
    sim.add("b", 1.0, Priority::Interactive, 4, 8, None);
    let mut preemptions = 0;
    while sim.sched.has_work() {
        preemptions += sim.step().preempted.len();
    }
    assert!(preemptions > 0, "the pool was meant to be too small for both at once");
    // Each sequence computes its 4 prompt tokens and 7 of its 8 generated ones (the last is
    // never fed back): 11 charged tokens, however often it was recomputed.
    assert_eq!(sim.sched.counter(&TenantId::new("a")), Some(11.0));
    assert_eq!(sim.sched.counter(&TenantId::new("b")), Some(11.0));
    assert!(sim.served("a") + sim.served("b") > 22, "recomputation did happen");
}

#[test]
fn cancel_removes_a_sequence_wherever_it_is() {
    let mut sim = Sim::new(config(100, 1), Mem::new(100, 4));
    let running = sim.add("a", 1.0, Priority::Interactive, 4, 8, None);
    let queued = sim.add("a", 1.0, Priority::Interactive, 4, 8, None);
    sim.step();
    assert_eq!(sim.sched.cancel(queued).map(|s| s.id), Some(queued));
    let s = sim.sched.cancel(running).unwrap();
    sim.mem.release(&mut { s });
    assert!(!sim.sched.has_work());
    assert!(sim.sched.cancel(running).is_none());
}

/// A tenant that arrives while another's long prompts are mid-prefill gets its prompt
/// computed first: prompt work goes in counter order, after the decodes.
#[test]
fn a_new_tenants_prompt_goes_before_a_flooding_tenants_prefill() {
    let config = SchedulerConfig { max_batch_tokens: 64, max_running: 16, prefetch_ahead: 0, attention_cost: 0.0, ..SchedulerConfig::default() };
    let mut sim = Sim::new(config, Mem::new(1000, 16));
    let a: Vec<SeqId> = (0..4).map(|_| sim.add("a", 1.0, Priority::Interactive, 200, 4, None)).collect();
    sim.step();
    sim.step();
    let b = sim.add("b", 1.0, Priority::Interactive, 40, 4, None);
    let plan = sim.step();
    assert_eq!(plan.chunks[0], (b, 40), "b's whole prompt first: {:?}", plan.chunks);
    assert_eq!(plan.chunks[1..].iter().map(|c| c.1).sum::<usize>(), 24, "a's prefill gets the rest");
    assert!(plan.chunks[1..].iter().all(|c| a.contains(&c.0)));
    // b decodes from now on, ahead of a's prompt chunks.
    let plan = sim.step();
    assert_eq!(plan.chunks[0], (b, 1));
}

/// A full running set held by one tenant gives a slot to a tenant below its share: the
/// flooding tenant's latest sequence is preempted, the newcomer starts at once, and nothing
/// is preempted while every tenant stays within its share.
#[test]
fn a_tenant_below_its_share_gets_a_running_slot() {
    let config = SchedulerConfig { max_batch_tokens: 256, max_running: 4, prefetch_ahead: 0, attention_cost: 0.0, ..SchedulerConfig::default() };
    let mut sim = Sim::new(config, Mem::new(1000, 16));
    let a: Vec<SeqId> = (0..6).map(|_| sim.add("a", 1.0, Priority::Interactive, 8, 50, None)).collect();
    for _ in 0..3 {
        sim.step();
    }
    assert_eq!(sim.sched.running_len(), 4);
    let b = sim.add("b", 1.0, Priority::Interactive, 8, 50, None);
    let plan = sim.step();
    assert_eq!(plan.preempted, [a[3]], "a's latest running sequence gives way");
    assert!(plan.chunks.contains(&(b, 8)), "b starts at once: {:?}", plan.chunks);
    let b2 = sim.add("b", 1.0, Priority::Interactive, 8, 50, None);
    let plan = sim.step();
    assert_eq!(plan.preempted, [a[2]], "b is still below its half of the slots");
    assert!(plan.chunks.contains(&(b2, 8)));
    sim.add("b", 1.0, Priority::Interactive, 8, 50, None);
    for _ in 0..5 {
        assert!(sim.step().preempted.is_empty(), "two each: nobody is over its share");
    }
    // Everything still finishes, with every token generated once.
    while sim.sched.has_work() {
        sim.step();
    }
    assert_eq!(sim.finished.len(), 9);
    assert!(sim.generated.values().all(|&g| g == 50));
}

#[test]
fn the_cost_of_a_chunk_grows_with_its_context_and_fit_finds_the_largest_that_fits() {
    let flat = config(64, 8);
    assert_eq!(flat.cost(1000, 10), 10.0);
    assert_eq!(flat.fit(1000, 100, 64.0), 64);
    let c = SchedulerConfig { attention_cost: 0.01, ..config(64, 8) };
    // 10 tokens at positions 1000..1010 attend to 1001..=1010 tokens each.
    assert!((c.cost(1000, 10) - (10.0 + 0.01 * 10055.0)).abs() < 1e-9);
    for (start, pending, budget) in [(0, 500, 64.0), (1000, 500, 64.0), (4000, 500, 64.0), (4000, 3, 64.0), (100_000, 50, 64.0), (0, 1, 0.5)] {
        let n = c.fit(start, pending, budget);
        assert!(n <= pending);
        if n > 0 {
            assert!(c.cost(start, n) <= budget, "{start} {n}");
        }
        if n < pending {
            assert!(c.cost(start, n + 1) > budget, "{start} {n}: one more would have fit");
        }
    }
    assert_eq!(c.fit(100_000, 50, 64.0), 0, "its first token alone costs more than the budget");
}

#[test]
fn a_long_prompt_deep_in_its_context_gets_small_chunks_and_others_keep_their_steps() {
    // Attending to 100 tokens costs as much as a token's other work.
    let mut sim = Sim::new(SchedulerConfig { attention_cost: 0.01, ..config(64, 8) }, Mem::new(100_000, 16));
    let long = sim.add("a", 1.0, Priority::Interactive, 4000, 4, None);
    let mut steps = 0;
    while sim.sched.get(long).is_none_or(|s| s.computed < 3000) {
        let plan = sim.step();
        steps += 1;
        let cost: f64 = plan.chunks.iter().map(|&(_, n)| n as f64).sum();
        assert!(cost <= 64.0);
        assert!(steps < 2000);
    }
    // Deep in the context each chunk is a few tokens: its cost, not its tokens, fills a step.
    let before = sim.sched.get(long).unwrap().computed;
    let b = sim.add("b", 1.0, Priority::Interactive, 20, 2, None);
    let plan = sim.step();
    let chunk = |id| plan.chunks.iter().find(|&&(s, _)| s == id).map(|&(_, n)| n);
    assert_eq!(chunk(b), Some(20), "the newcomer's whole prompt goes in the next step");
    let a = chunk(long).unwrap_or(0);
    let cfg = sim.sched.config().clone();
    assert!(cfg.cost(0, 20) + cfg.cost(before, a) <= 64.0 + 1e-9, "{a} tokens of the long prompt");
    assert!(a < 20, "the long prompt's chunk shrank to what its context costs: {a}");
}

#[test]
fn a_newcomer_is_lifted_to_the_counters_of_tenants_whose_work_is_all_running() {
    let mut sim = Sim::new(config(64, 8), Mem::new(10_000, 16));
    // Tenant a runs alone for a while: its counter grows, and nothing of it is queued.
    for _ in 0..4 {
        sim.add("a", 1.0, Priority::Interactive, 16, 200, None);
    }
    for _ in 0..50 {
        sim.step();
    }
    assert_eq!(sim.sched.waiting_len(), 0);
    let a = sim.sched.counter(&TenantId::new("a")).unwrap();
    assert!(a > 100.0);
    sim.add("b", 1.0, Priority::Interactive, 16, 4, None);
    let b = sim.sched.counter(&TenantId::new("b")).unwrap();
    assert_eq!(b, a - 64.0, "the newcomer starts one step of service behind the tenant running, not at 0");
}

/// While a light tenant has work in a step, a heavy tenant's prompt chunks in it take only the
/// shared allowance (half the step's fixed time here: 8 of 64) whenever the heavy tenant is
/// ahead in service; when the light tenant is done, they take whole steps again.
#[test]
fn a_heavy_tenants_prompt_chunks_shrink_while_a_lighter_tenant_is_in_the_step() {
    let shared = SchedulerConfig { shared_slowdown: Some(0.5), step_overhead: Some(16.0), ..config(64, 16) };
    let mut sim = Sim::new(shared, Mem::new(100_000, 16));
    let long = sim.add("a", 1.0, Priority::Interactive, 3000, 4, None);
    for _ in 0..5 {
        assert_eq!(sim.step().chunks, [(long, 64)], "alone, a's prompt takes whole steps");
    }
    let b = sim.add("b", 1.0, Priority::Interactive, 20, 10, None);
    let plan = sim.step();
    assert_eq!(plan.chunks, [(b, 20), (long, 8)], "b's prompt first, then a's allowance");
    assert_eq!(plan.cost, 28.0);
    for _ in 0..9 {
        let plan = sim.step();
        assert_eq!(plan.chunks, [(b, 1), (long, 8)], "b decodes; a's chunks stay small");
    }
    assert!(sim.finished.contains(&b));
    // b counts as present for a second of steps (100 here) after its last token, so that its
    // next request would not wait for a whole step of a's; then a has whole steps again.
    let small = (0..200).take_while(|_| sim.step().chunks == [(long, 8)]).count();
    assert!((95..=100).contains(&small), "{small} steps");
    assert_eq!(sim.step().chunks, [(long, 64)]);
}

/// The allowance never stops a prompt for good: the first chunk behind another tenant may take
/// one token even when that one token costs more than the allowance.
#[test]
fn a_prompt_behind_another_tenant_still_moves_a_token_a_step() {
    let c = SchedulerConfig { attention_cost: 0.01, shared_slowdown: Some(0.0), step_overhead: Some(16.0), ..config(64, 16) };
    let mut sim = Sim::new(c, Mem::new(100_000, 16));
    let long = sim.add("a", 1.0, Priority::Interactive, 3000, 4, None);
    for _ in 0..3 {
        sim.step();
    }
    let b = sim.add("b", 1.0, Priority::Interactive, 4, 50, None);
    assert!(sim.step().chunks.contains(&(long, 1)));
    sim.step();
    for _ in 0..20 {
        let plan = sim.step();
        assert!(plan.chunks.contains(&(b, 1)));
        assert!(plan.chunks.contains(&(long, 1)), "{:?}", plan.chunks);
    }
    // Without a limit, a's chunks fill what b's decodes leave.
    let c = SchedulerConfig { attention_cost: 0.0, shared_slowdown: None, ..config(64, 16) };
    let mut sim = Sim::new(c, Mem::new(100_000, 16));
    let long = sim.add("a", 1.0, Priority::Interactive, 3000, 4, None);
    sim.step();
    let b = sim.add("b", 1.0, Priority::Interactive, 4, 50, None);
    sim.step();
    assert_eq!(sim.step().chunks, [(b, 1), (long, 63)]);
}

/// A prompt so deep in its context that one more token costs more than a whole step still
/// moves a token a step, alone or behind another tenant's decodes: it never stalls.
#[test]
fn a_token_dearer_than_a_step_still_moves() {
    let c = SchedulerConfig { attention_cost: 0.05, shared_slowdown: Some(0.5), step_overhead: Some(16.0), ..config(64, 16) };
    let mut sim = Sim::new(c, Mem::new(100_000, 16));
    let long = sim.add("a", 1.0, Priority::Interactive, 2000, 2, None);
    let b = sim.add("b", 1.0, Priority::Interactive, 4, 4000, None);
    let mut steps = 0;
    while !sim.finished.contains(&long) {
        sim.step();
        steps += 1;
        assert!(steps < 5000, "stalled at {:?}", sim.sched.get(long).map(|s| s.computed));
    }
    assert!(sim.sched.get(b).is_some(), "b was still decoding: a moved behind its decodes");
}

/// Eight sequences of `a` decoding (with `config`), then `b` arrives with a 20-token prompt:
/// the ids of a's sequences and b's.
fn a_decoding_then_b_arrives(config: SchedulerConfig) -> (Sim, Vec<SeqId>, SeqId) {
    let mut sim = Sim::new(config, Mem::new(100_000, 16));
    let a: Vec<SeqId> = (0..8).map(|_| sim.add("a", 1.0, Priority::Interactive, 4, 1000, None)).collect();
    for _ in 0..40 {
        sim.step();
    }
    assert!(a.iter().all(|&id| sim.sched.get(id).is_some_and(|s| s.len - s.computed == 1)), "a decodes");
    let b = sim.add("b", 1.0, Priority::Interactive, 20, 10, None);
    (sim, a, b)
}

/// Where a step's rows cost time, a newcomer ahead in the fair order gets its prompt's step to
/// itself: the decodes of the tenant behind it wait one step, and never two in a row.
#[test]
fn a_newcomers_prompt_runs_without_the_decodes_behind_it_for_one_step() {
    let defer = SchedulerConfig { defer_decodes: Some(0.25), step_overhead: Some(16.0), ..config(64, 16) };
    let (mut sim, a, b) = a_decoding_then_b_arrives(defer.clone());
    assert_eq!(sim.step().chunks, [(b, 20)], "b's prompt alone");
    let plan = sim.step();
    assert!(a.iter().all(|id| plan.chunks.contains(&(*id, 1))), "a's decodes are back the step after: {:?}", plan.chunks);
    assert!(plan.chunks.contains(&(b, 1)));
    // Off: b's prompt shares its step with a's decodes.
    let (mut sim, a, b) = a_decoding_then_b_arrives(SchedulerConfig { defer_decodes: None, ..defer.clone() });
    let plan = sim.step();
    assert!(plan.chunks.contains(&(b, 20)) && a.iter().all(|id| plan.chunks.contains(&(*id, 1))), "{:?}", plan.chunks);

    // Where a step's fixed time dwarfs its rows (a GPU: 400 tokens' worth), eight decodes are
    // not worth a step: they ride along.
    let (mut sim, a, b) = a_decoding_then_b_arrives(SchedulerConfig { step_overhead: Some(400.0), ..defer });
    let plan = sim.step();
    assert!(plan.chunks.contains(&(b, 20)) && a.iter().all(|id| plan.chunks.contains(&(*id, 1))), "{:?}", plan.chunks);
}

/// A tenant's interactive prompt runs without the decodes of batch work behind it, its own
/// batch work included; decodes of its own class ride along.
#[test]
fn an_interactive_prompt_runs_without_the_batch_decodes_behind_it() {
    let defer = SchedulerConfig { defer_decodes: Some(0.25), step_overhead: Some(16.0), ..config(64, 16) };
    let mut sim = Sim::new(defer.clone(), Mem::new(100_000, 16));
    let batch: Vec<SeqId> = (0..8).map(|_| sim.add("a", 1.0, Priority::Batch, 4, 1000, None)).collect();
    for _ in 0..40 {
        sim.step();
    }
    let prompt = sim.add("a", 1.0, Priority::Interactive, 20, 10, None);
    assert_eq!(sim.step().chunks, [(prompt, 20)], "the tenant's own prompt alone");
    let plan = sim.step();
    assert!(batch.iter().all(|id| plan.chunks.contains(&(*id, 1))), "the batch decodes are back the step after: {:?}", plan.chunks);
    // Interactive decodes of the same tenant are not deferred for its prompt.
    let mut sim = Sim::new(defer, Mem::new(100_000, 16));
    let own: Vec<SeqId> = (0..8).map(|_| sim.add("a", 1.0, Priority::Interactive, 4, 1000, None)).collect();
    for _ in 0..40 {
        sim.step();
    }
    let prompt = sim.add("a", 1.0, Priority::Interactive, 20, 10, None);
    let plan = sim.step();
    assert!(plan.chunks.contains(&(prompt, 20)) && own.iter().all(|id| plan.chunks.contains(&(*id, 1))), "{:?}", plan.chunks);
}

/// A flood of prompts from a newcomer defers the decodes of the tenant running only while the
/// newcomer is ahead in the fair order (its one step of credit), never two steps in a row;
/// once it has had its share, the decodes run in every step.
#[test]
fn a_flood_of_prompts_defers_others_decodes_only_while_it_is_ahead() {
    let defer = SchedulerConfig { defer_decodes: Some(0.0), step_overhead: Some(16.0), ..config(64, 16) };
    let mut sim = Sim::new(defer, Mem::new(100_000, 16));
    let b: Vec<SeqId> = (0..4).map(|_| sim.add("b", 1.0, Priority::Interactive, 4, 1000, None)).collect();
    for _ in 0..3 {
        sim.step();
    }
    for _ in 0..200 {
        sim.add("a", 1.0, Priority::Interactive, 30, 4, None);
    }
    let mut waited = Vec::new();
    for step in 0..100 {
        let plan = sim.step();
        let b_in = b.iter().filter(|id| plan.chunks.contains(&(**id, 1))).count();
        assert!(b_in == 0 || b_in == b.len(), "step {step}: {:?}", plan.chunks);
        if b_in == 0 {
            assert!(step == 0 || waited.last() != Some(&(step - 1)), "b waited two steps in a row at {step}");
            waited.push(step);
        }
    }
    assert!(!waited.is_empty() && waited.len() <= 2, "b's decodes waited in steps {waited:?}");
}
