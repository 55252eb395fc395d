//! What every inference endpoint shares: who is calling, which model they named, admission,
//! and the job that runs their prompts, records the ledger row and hands the events to the
//! endpoint's formatter.
//!
//! [`start`] does the work in order of cost, so that what is refused costs little: the cheap
//! checks of what was sent ([`validate`]), admission against the server's and the tenant's
//! bounds and the tenant's request limits, then tokenizing on the blocking pool, the checks of
//! the token counts, the token reservation, and only then the queue (and a batch line's ledger row).
//!
//! A job runs in a task of its own, so its ledger row is written whatever the client does. The
//! row is written when the job ends, before its final event (the usage) is sent: when the
//! client goes away (its event channel closes) the task cancels the requests and records what
//! was generated with the outcome `cancelled`. No token waits for the database: an interactive
//! request still running after [`super::ApiSettings::open_row_after`] has its row opened
//! (outcome `running`) behind its tokens, so that a crash of the process leaves an
//! `interrupted` row for it; one that ends sooner costs one write. A line of a batch has its row
//! opened, durably, before it is queued: cancelling the batch voids the rows of the lines still
//! running (see `store::batches`); so has every request when `open_row_after` is zero.

use std::time::{Duration, Instant};

use actix_web::HttpRequest;
use futures::StreamExt;
use tokio::sync::mpsc;

use super::adapters::BlobGuard;
use super::admission::Slot;
use super::limits::Permit;
use super::metrics::Observation;
use super::peer::Peer;
use super::validate::{self, DefaultMax, Knobs, Prompt};
use super::{ApiError, AppState, principal};
use crate::memory::AdapterRef;
use crate::request::FinishReason;
use crate::runtime::{Event, RequestHandle, RuntimeError, TokenOut, Usage};
use crate::scheduler::{Placement, Priority, TenantId};
use crate::store::{AdapterRecord, Plan, Scope, Tenant, UsageRecord, now_ms, outcome};

/// An authenticated tenant's key, with the tenant and its plan.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The key's id (the ledger records it).
    pub key_id: String,
    pub tenant: Tenant,
    pub plan: Plan,
}

/// The caller behind the request's key, which must be a tenant's key with `scope`.
pub async fn caller(req: &HttpRequest, state: &AppState, scope: Scope) -> Result<Caller, ApiError> {
    let found = principal(req, state, scope).await?;
    let Some((tenant, plan)) = found.tenant.clone() else {
        return Err(ApiError::Invalid("the operator's key manages tenants; inference and adapters need a tenant's key".into()));
    };
    Ok(Caller { key_id: found.key.id.clone(), tenant, plan })
}

/// A caller admitted against its tenant's concurrency and requests-per-minute limits, before its
/// body is read: a tenant cannot hold more bodies in flight (stalled, say) than it may run
/// requests. It keeps its place in the minute even if it is refused later.
pub struct Admitted {
    pub caller: Caller,
    pub permit: Permit,
    /// Time spent so far on database-backed state (the key, the admission).
    pub state_time: super::StateTime,
}

/// [`caller`] with the inference scope, then admission against the tenant's limits.
pub async fn admitted(req: &HttpRequest, state: &AppState) -> Result<Admitted, ApiError> {
    let began = Instant::now();
    let caller = caller(req, state, Scope::Inference).await?;
    let key = began.elapsed();
    let permit = state.limiter.admit(&caller.tenant.id, &caller.tenant.limits()).await.inspect_err(|_| state.metrics.limited(&caller.tenant.name))?;
    Ok(Admitted { caller, permit, state_time: super::StateTime { key, limits: began.elapsed() - key, ledger: Duration::ZERO } })
}

/// What a request's `model` (or LoRAX `adapter_id`) names.
#[derive(Debug, Clone)]
pub enum Target {
    Base,
    Adapter(Box<AdapterRecord>),
}

impl Target {
    /// The ledger's name for it: `name@version`, or empty for the base model.
    pub fn label(&self) -> String {
        match self {
            Target::Base => String::new(),
            Target::Adapter(a) => a.label(),
        }
    }
}

/// Resolves `name` for `tenant`: the base model's name, an adapter the tenant may use (the
/// latest version), or `name@version`. Unknown and foreign adapters read the same.
pub async fn resolve(state: &AppState, tenant: &str, name: &str) -> Result<Target, ApiError> {
    if name == &*state.model_name {
        return Ok(Target::Base);
    }
    let shown: String = name.chars().take(80).collect();
    let not_found = || ApiError::NotFound(format!("model `{shown}` (neither the base model `{}` nor an adapter you may use)", state.model_name));
    if name.len() > 256 {
        return Err(not_found());
    }
    let record = match name.rsplit_once('@') {
        Some((base, v)) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => {
            let version: i64 = v.parse().map_err(|_| not_found())?;
            state.store.visible_adapter_version(tenant, base, version).await?
        }
        _ => state.store.visible_adapter(tenant, name).await?,
    };
    let record = record.ok_or_else(not_found)?;
    if let Some(why) = state.base.unusable(&record) {
        return Err(ApiError::InvalidParam { param: "model".into(), message: why });
    }
    Ok(Target::Adapter(Box::new(record)))
}

/// One event of a job.
#[derive(Debug)]
pub enum JobEvent {
    /// A token of sample `token.index` of prompt `prompt`.
    Token { prompt: usize, token: TokenOut },
    /// Every prompt finished and the ledger row is committed: the usage over all of them.
    Done(Usage),
    /// The job failed; nothing follows.
    Failed(ApiError),
}

/// What a job runs: one generation request per prompt, sharing the other fields.
pub struct JobSpec {
    pub endpoint: &'static str,
    pub prompts: Vec<Prompt>,
    pub knobs: Knobs,
    pub default_max: DefaultMax,
    /// Keep only the last this many tokens of each prompt (LoRAX's `truncate`).
    pub truncate: Option<u32>,
    pub target: Target,
    /// What the output must follow (structured output, tool calls).
    pub grammar: Option<super::structured::GrammarSource>,
    /// The batch this is a line of: it runs in the batch class, at the plan's batch prices.
    pub batch: Option<BatchLine>,
    /// The client's connection: a job whose client has left is not started.
    pub peer: Peer,
}

/// A request that is a line of a batch.
#[derive(Debug, Clone)]
pub struct BatchLine {
    pub batch_id: std::sync::Arc<str>,
    /// The id of its usage row, chosen by the batch, which records it with the line's result.
    pub usage_id: String,
}

/// A started job: its events, and the facts the response headers need.
pub struct Job {
    pub events: mpsc::UnboundedReceiver<JobEvent>,
    pub prompt_tokens: usize,
}

/// Checks, admits and queues a job, and starts the task that drives it. Errors here are the
/// response's status.
pub async fn start(state: &AppState, admitted: Admitted, spec: JobSpec) -> Result<Job, ApiError> {
    let Admitted { caller, mut permit, mut state_time } = admitted;
    let started = Instant::now();
    let started_at = now_ms();
    // What was sent, cheaply.
    spec.knobs.check()?;
    validate::check_prompts(&spec.prompts, &state.prompt_limits)?;
    // Admission, before any expensive work.
    let units = (spec.prompts.len() as u32).saturating_mul(spec.knobs.samples());
    let slot = state.admission.admit(&caller.tenant.id, caller.tenant.weight, units).inspect_err(|_| state.metrics.limited(&caller.tenant.name))?;
    let guard = match &spec.target {
        Target::Base => None,
        Target::Adapter(a) => Some(state.blobs.enter(&a.id).ok_or_else(|| ApiError::NotFound(format!("model `{}`", a.name)))?),
    };
    let adapter_ref = match &spec.target {
        Target::Base => None,
        Target::Adapter(a) => Some(AdapterRef::validated(a.id.as_str(), super::adapters::adapter_dir(state, a).await?).for_owner(&a.owner)),
    };
    // A client that left while it waited for a slot costs no tokenizing nor compiling.
    if spec.peer.gone() {
        return Err(ApiError::Cancelled);
    }
    // Tokens.
    let prompts = validate::tokenize(state, spec.prompts).await?;
    let grammar = match spec.grammar {
        Some(source) => super::structured::compile(state, source, &caller.tenant.id).await?,
        None => None,
    };
    let context = state.serving.model_config().max_position_embeddings;
    let mut valid = Vec::with_capacity(prompts.len());
    let mut requests = Vec::with_capacity(prompts.len());
    for mut prompt in prompts {
        if let Some(keep) = spec.truncate {
            prompt.drain(..prompt.len().saturating_sub(keep as usize));
        }
        let mut request = spec.knobs.request(prompt, spec.default_max, context)?;
        request.adapter = adapter_ref.clone();
        request.grammar = grammar.clone();
        requests.push(request);
    }
    let budget = validate::token_budget(&requests);
    for request in requests {
        valid.push(state.serving.validate(request)?);
    }
    let prompt_tokens: usize = valid.iter().map(|r| r.get().prompt.len()).sum();
    let reserving = Instant::now();
    permit.reserve(budget).await.inspect_err(|_| state.metrics.limited(&caller.tenant.name))?;
    state_time.limits += reserving.elapsed();
    // Nor a step: one that left while its prompt was tokenized is never queued.
    if spec.peer.gone() {
        return Err(ApiError::Cancelled);
    }

    // The ledger row: written when the job ends (and opened while it runs; see the module).
    let label = spec.target.label();
    let plan = &caller.plan;
    let (prompt_price, cached_prompt_price, completion_price) = match spec.batch {
        Some(_) => plan.batch_prices(),
        None => (plan.prompt_price, plan.cached_prompt_price, plan.completion_price),
    };
    let record = UsageRecord {
        id: spec.batch.as_ref().map_or_else(|| crate::store::random_id("use"), |b| b.usage_id.clone()),
        tenant_id: caller.tenant.id.clone(),
        key_id: caller.key_id.clone(),
        adapter: label.clone(),
        prompt_tokens: prompt_tokens as i64,
        cached_prompt_tokens: 0,
        completion_tokens: 0,
        queue_ms: 0.0,
        ttft_ms: 0.0,
        total_ms: 0.0,
        outcome: outcome::RUNNING.into(),
        started_at,
        finished_at: started_at,
        plan: plan.name.clone(),
        prompt_price,
        cached_prompt_price,
        completion_price,
        instance: state.settings.instance.clone(),
        batch_id: spec.batch.as_ref().map_or_else(String::new, |b| b.batch_id.to_string()),
        base_model: state.base.name.clone(),
    };
    let open_first = spec.batch.is_some() || state.settings.open_row_after.is_zero();
    if open_first {
        let opening = Instant::now();
        state.ledger.open(record.clone()).await?;
        state_time.ledger += opening.elapsed();
    }
    let mut placement = Placement::tenant(TenantId::new(&caller.tenant.id), caller.tenant.weight);
    if spec.batch.is_some() {
        placement.priority = Priority::Batch;
    }
    let mut handles = Vec::with_capacity(valid.len());
    for request in valid {
        match state.serving.submit(request, placement.clone()).await {
            Ok(h) => handles.push(h),
            Err(e) => {
                // Handles already queued are dropped (and so cancelled); the row says why.
                drop(handles);
                let e = ApiError::from(e);
                let ended = UsageRecord { outcome: outcome::ERROR.into(), finished_at: now_ms(), ..record };
                state.ledger.commit(ended).await?;
                return Err(e);
            }
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    state.metrics.job_queued(&label);
    let run = Run {
        state: state.clone(),
        endpoint: spec.endpoint,
        caller,
        record,
        opened: open_first,
        label,
        prompt_tokens,
        started,
        permit,
        state_time,
        _slot: slot,
        _guard: guard,
    };
    state.jobs.spawn(run.drive(handles, tx));
    Ok(Job { events: rx, prompt_tokens })
}

/// The state of a running job's task.
struct Run {
    state: AppState,
    endpoint: &'static str,
    caller: Caller,
    /// Its ledger row as opened.
    record: UsageRecord,
    /// Whether the row's opening is written already (a batch line's is, and every one's with
    /// a zero `open_row_after`).
    opened: bool,
    label: String,
    prompt_tokens: usize,
    started: Instant,
    permit: Permit,
    /// Time spent on database-backed state before it ran.
    state_time: super::StateTime,
    /// Its place in the admission bounds.
    _slot: Slot,
    /// Keeps the adapter's files while the job runs, even if the adapter is deleted.
    _guard: Option<BlobGuard>,
}

enum Outcome {
    Ok,
    Cancelled,
    Error(ApiError),
}

impl Run {
    async fn drive(self, handles: Vec<RequestHandle>, tx: mpsc::UnboundedSender<JobEvent>) {
        let prompts = handles.len();
        let streams =
            handles.into_iter().enumerate().map(|(i, h)| futures::stream::unfold(h, move |mut h| async move { h.next().await.map(|e| ((i, e), h)) }).boxed());
        let mut merged = futures::stream::select_all(streams);
        let mut usage = Usage::default();
        let mut finished = 0;
        let mut completion = 0;
        let mut first_token: Option<Duration> = None;
        // The row's opening, once the job has run for `open_row_after`.
        let open_at = tokio::time::sleep(self.state.settings.open_row_after);
        tokio::pin!(open_at);
        let mut open_due = !self.opened;
        let mut opening = None;
        let outcome = loop {
            let event = tokio::select! {
                event = merged.next() => event,
                // The client went away while nothing was generated.
                () = tx.closed() => break Outcome::Cancelled,
                () = &mut open_at, if open_due => {
                    // Behind the tokens: nothing waits for it but the row's end. Not sent (the
                    // writer stopped): the end says why it cannot be written either.
                    open_due = false;
                    opening = self.state.ledger.send(self.record.clone()).ok();
                    continue;
                }
            };
            match event {
                Some((prompt, Event::Token(token))) => {
                    completion += 1;
                    if first_token.is_none() {
                        first_token = Some(self.started.elapsed());
                        self.state.metrics.job_running(&self.label);
                    }
                    if tx.send(JobEvent::Token { prompt, token }).is_err() {
                        break Outcome::Cancelled;
                    }
                }
                Some((_, Event::Done(u))) => {
                    usage.prompt_tokens += u.prompt_tokens;
                    usage.cached_prompt_tokens += u.cached_prompt_tokens;
                    usage.completion_tokens += u.completion_tokens;
                    usage.queue_time = usage.queue_time.max(u.queue_time);
                    finished += 1;
                    if finished == prompts {
                        break Outcome::Ok;
                    }
                }
                Some((_, Event::Error(RuntimeError::Cancelled))) => break Outcome::Cancelled,
                Some((_, Event::Error(e))) => break Outcome::Error(e.into()),
                None => break Outcome::Error(RuntimeError::Unavailable("the runtime stopped before the request finished".into()).into()),
            }
        };
        // Whatever is still queued or running is cancelled here.
        drop(merged);
        let total = self.started.elapsed();
        if !matches!(outcome, Outcome::Ok) {
            usage.prompt_tokens = self.prompt_tokens;
            usage.completion_tokens = completion;
        }
        usage.time_to_first_token = first_token.unwrap_or(total);
        usage.total_time = total;
        let outcome_name = match &outcome {
            Outcome::Ok => outcome::OK,
            Outcome::Cancelled => outcome::CANCELLED,
            Outcome::Error(_) => outcome::ERROR,
        };
        let record = UsageRecord {
            prompt_tokens: usage.prompt_tokens as i64,
            cached_prompt_tokens: usage.cached_prompt_tokens as i64,
            completion_tokens: usage.completion_tokens as i64,
            queue_ms: usage.queue_time.as_secs_f64() * 1e3,
            ttft_ms: usage.time_to_first_token.as_secs_f64() * 1e3,
            total_ms: total.as_secs_f64() * 1e3,
            outcome: outcome_name.into(),
            finished_at: now_ms(),
            ..self.record.clone()
        };
        let committing = Instant::now();
        // A row's two writes never overlap: the end goes out once the opening is answered
        // (written or not: the end creates the row if the opening was lost).
        if let Some(opening) = opening {
            let _ = opening.await;
        }
        let committed = self.state.ledger.commit(record).await;
        let mut state_time = self.state_time;
        state_time.ledger += committing.elapsed();
        self.state.metrics.state_time(&state_time);
        self.permit.settle((usage.prompt_tokens + usage.completion_tokens) as u64);
        self.state.metrics.job_ended(&self.label, first_token.is_some());
        self.state.metrics.observe(&Observation {
            endpoint: self.endpoint,
            outcome: outcome_name,
            tenant: &self.caller.tenant.name,
            usage: &usage,
            ttft: first_token,
            total,
        });
        let last = match (outcome, committed) {
            (Outcome::Ok, Ok(())) => JobEvent::Done(usage),
            (Outcome::Ok, Err(e)) => JobEvent::Failed(e.into()),
            (Outcome::Error(e), _) => JobEvent::Failed(e),
            (Outcome::Cancelled, _) => return,
        };
        let _ = tx.send(last);
    }
}

/// Sample outputs gathered from a job's events, for the non-streaming responses.
#[derive(Debug, Clone, Default)]
pub struct Gathered {
    pub tokens: Vec<TokenOut>,
    pub text: String,
    pub finish: Option<FinishReason>,
}

/// Reads a job to its end: per prompt, per sample, the tokens; and the usage. If the client
/// goes away meanwhile, stops reading (which cancels the job) and answers `Cancelled`.
pub async fn gather(mut job: Job, prompts: usize, n: usize, peer: &Peer) -> Result<(Vec<Vec<Gathered>>, Usage), ApiError> {
    let mut out = vec![vec![Gathered::default(); n]; prompts];
    loop {
        let event = tokio::select! {
            event = job.events.recv() => event,
            () = peer.closed() => return Err(ApiError::Cancelled),
        };
        match event {
            Some(JobEvent::Token { prompt, token }) => {
                if let Some(g) = out.get_mut(prompt).and_then(|p| p.get_mut(token.index)) {
                    g.text.push_str(&token.text);
                    g.finish = token.finish.or(g.finish);
                    g.tokens.push(token);
                }
            }
            Some(JobEvent::Done(usage)) => return Ok((out, usage)),
            Some(JobEvent::Failed(e)) => return Err(e),
            None => return Err(ApiError::Unavailable("the request ended without a result".into())),
        }
    }
}

/// The next event of a streamed job; `None` once the client has gone (which cancels the job).
pub async fn next_event(job: &mut Job, peer: &Peer) -> Option<Option<JobEvent>> {
    tokio::select! {
        event = job.events.recv() => Some(event),
        () = peer.closed() => None,
    }
}

/// OpenAI's usage object.
pub fn usage_json(u: &Usage) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// Server-sent events: one `data:` line per event.
pub fn sse(value: &serde_json::Value) -> actix_web::web::Bytes {
    actix_web::web::Bytes::from(format!("data: {value}\n\n"))
}

/// A random id for a response object, OpenAI style: `cmpl-...`.
pub fn response_id(prefix: &str) -> String {
    crate::store::random_id(prefix).replacen('_', "-", 1)
}

/// Shared across the crate for the token text of logprobs.
pub fn token_text(state: &AppState, id: u32) -> String {
    state.tokenizer.decode(&[id], false).unwrap_or_default()
}
