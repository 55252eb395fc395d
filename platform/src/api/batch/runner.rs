//! Runs batches. Each batch with work left has a task on the server's main thread that reads
//! its input file a few lines at a time and runs each line as the endpoint would run the same
//! request, in the scheduler's batch class (interactive requests go first) and at the plan's batch
//! prices. At most `--batch-concurrency` lines of all batches are in flight at once, so queued
//! batch work never fills the server's queues; a tenant's batch lines take at most half of each
//! of its limits (requests and tokens per minute, concurrency), and wait for room rather than
//! fail, so the tenant's own interactive traffic always has the other half.
//!
//! A line is done once its result is in the database ([`crate::store::BatchResult`]): a batch
//! that was stopped (a restart, a crash) runs only its other lines when its server starts again.
//! Only recorded lines are billed: the usage rows of lines cancelled while they ran, of tries
//! refused for capacity and tried again, and of lines whose server stopped between the two
//! writes are voided when the batch resumes or ends. When every line is done the batch writes its
//! output and error files and records its end in one transaction.
//!
//! Cancelling stops the lines in flight (they are not billed) and keeps what finished. A batch
//! still running when its completion window closes expires: the same, and each line that never
//! ran gets a `batch_expired` error in the error file. At shutdown no batch starts another line;
//! the lines in flight finish within the shutdown timeout, and the rest run after the restart.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};

use super::lines::{Line, LineReader, RequestLine};
use crate::api::infer::{self, Admitted, BatchLine, Caller, Target};
use crate::api::openai::{self, BatchEndpoint};
use crate::api::peer::Peer;
use crate::api::{ApiError, AppState};
use crate::store::{BatchRecord, BatchResult, FileRecord, StoreError, batch_status, file_purpose, now_ms, random_id};

/// Lines read from the input file at a time.
const READ_LINES: usize = 64;

/// Results written into the output files at a time.
const WRITE_RESULTS: i64 = 512;

/// How long a batch whose run failed (its database unreachable, say) waits before it tries again
/// (a moment in tests).
const RETRY_RUN: Duration = if cfg!(test) { Duration::from_millis(50) } else { Duration::from_secs(5) };

/// What a running batch is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    Go,
    /// Cancelled by its tenant: stop the lines in flight, write what finished.
    Cancel,
    /// Its completion window closed: the same, and its other lines expire.
    Expire,
    /// Its output reached its tenant's file storage limit: stop the lines in flight, write what
    /// finished, and fail.
    Full,
    /// The server is stopping: start no line; those in flight finish.
    Shutdown,
}

/// The running batches of this server.
#[derive(Debug)]
pub struct Batches {
    /// Lines of every batch in flight.
    lines: Arc<Semaphore>,
    /// Each running batch's signal.
    running: Mutex<HashMap<String, watch::Sender<Stop>>>,
    /// Set at shutdown: no batch starts.
    closing: std::sync::atomic::AtomicBool,
}

impl Batches {
    pub fn new(concurrency: u32) -> Self {
        Self { lines: Arc::new(Semaphore::new(concurrency.max(1) as usize)), running: Mutex::default(), closing: Default::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<Stop>>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the task of batch `id` (on the server's main thread), unless it runs already.
    pub fn start(state: &AppState, id: &str) {
        let batches = &state.batches;
        if batches.closing.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let rx = {
            let mut running = batches.lock();
            if running.contains_key(id) {
                return;
            }
            let (tx, rx) = watch::channel(Stop::Go);
            running.insert(id.to_string(), tx);
            rx
        };
        let (state, id) = (state.clone(), id.to_string());
        crate::api::on_main_thread(move || async move {
            drive(&state, &id, rx).await;
            state.batches.lock().remove(&id);
        });
    }

    /// Tells a running batch to stop; false if it has no task here.
    pub fn signal(&self, id: &str, stop: Stop) -> bool {
        self.lock().get(id).is_some_and(|tx| {
            tx.send_if_modified(|s| {
                // Cancelling, expiring and filling up are final; a shutdown does not undo them.
                let changed = *s == Stop::Go || (stop != Stop::Shutdown && *s == Stop::Shutdown);
                if changed {
                    *s = stop;
                }
                changed
            });
            true
        })
    }

    /// Stops every batch from starting lines (the server is stopping).
    pub fn shutdown(&self) {
        self.closing.store(true, std::sync::atomic::Ordering::Release);
        let ids: Vec<String> = self.lock().keys().cloned().collect();
        for id in ids {
            self.signal(&id, Stop::Shutdown);
        }
    }

    /// The batches with a task here.
    pub fn running_ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Whether batch `id` has a task here.
    pub fn is_running(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    /// Batch lines in flight on the server.
    pub fn lines_in_flight(&self, concurrency: u32) -> usize {
        (concurrency as usize).saturating_sub(self.lines.available_permits())
    }
}

/// Starts the batches this server left unfinished when it last stopped. Call once, at start.
pub async fn resume(state: &AppState) -> Result<usize, StoreError> {
    let active = state.store.active_batches(&state.settings.instance).await?;
    for b in &active {
        Batches::start(state, &b.id);
    }
    Ok(active.len())
}

/// How a run of a batch's lines ended.
enum End {
    Done,
    Cancelled,
    Expired,
    Shutdown,
    /// The batch cannot run at all (its tenant or input file is gone): why.
    Failed(String),
}

/// How a line's task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recorded {
    /// Its result is in the database (or it was stopped, and needs none).
    Yes,
    /// Its result could not be written: it runs again later.
    Lost,
    /// Its result is in, and with it the tenant's files and running batches' output hold more
    /// than the file storage limit.
    Full,
}

/// Starts of one line (counted across restarts) whose results never came, their server gone
/// each time, before the line is failed instead of started again: a line that kills its server
/// cannot keep a batch, and the server, in a loop.
pub const MAX_LINE_STARTS: i64 = 3;

/// Runs of a batch that fail for a reason that does not pass (a file that cannot be read, an
/// inconsistent record) before the batch fails; capacity and an unreachable database are waited
/// out.
const GIVE_UP: u32 = 3;

/// A batch's task: runs it to its end, or until the server stops; a failed run is tried again
/// after a pause, and a batch whose runs keep failing for the same lasting reason fails.
async fn drive(state: &AppState, id: &str, mut stop: watch::Receiver<Stop>) {
    let mut failures = 0;
    loop {
        match run(state, id, &mut stop).await {
            Ok(()) => return,
            Err(e) => {
                let passes = matches!(e, ApiError::Unavailable(_) | ApiError::Overloaded { .. } | ApiError::RateLimited { .. });
                failures = if passes { 0 } else { failures + 1 };
                if failures >= GIVE_UP {
                    eprintln!("warning: batch {id} failed: {e}");
                    if let Err(e) = fail(state, id, &e.to_string()).await {
                        eprintln!("warning: batch {id}: recording its failure: {e}");
                    }
                    return;
                }
                eprintln!("warning: batch {id} stopped: {e}; it goes on in {:.1} s", RETRY_RUN.as_secs_f64());
                tokio::select! {
                    () = tokio::time::sleep(RETRY_RUN) => {}
                    _ = stop.wait_for(|s| *s == Stop::Shutdown) => return,
                }
            }
        }
    }
}

/// Ends a batch that cannot go on as `failed`, with `why` as its error: what finished is still
/// written to its output and error files (and billed), as at any other end.
async fn fail(state: &AppState, id: &str, why: &str) -> Result<(), ApiError> {
    let errors = json!([{"code": "batch_failed", "message": why, "param": null, "line": null}]).to_string();
    state.store.set_batch_errors(id, &errors).await?;
    let Some(batch) = state.store.batch_by_id(id).await? else { return Ok(()) };
    if let Err(e) = finalize(state, &batch, batch_status::FAILED).await {
        // Its files could not be written: it fails without them.
        state.store.fail_batch(id).await?;
        return Err(e);
    }
    Ok(())
}

async fn run(state: &AppState, id: &str, stop: &mut watch::Receiver<Stop>) -> Result<(), ApiError> {
    loop {
        let Some(batch) = state.store.batch_by_id(id).await? else { return Ok(()) };
        match batch.status.as_str() {
            batch_status::VALIDATING | batch_status::IN_PROGRESS => match run_lines(state, &batch, stop).await? {
                End::Done => {
                    state.store.set_batch_status(id, &[batch_status::VALIDATING, batch_status::IN_PROGRESS], batch_status::FINALIZING).await?;
                }
                // The API moved it to cancelling already; a cancel that came from elsewhere
                // (another replica) is moved here.
                End::Cancelled => {
                    state.store.set_batch_status(id, &[batch_status::IN_PROGRESS], batch_status::CANCELLING).await?;
                }
                End::Expired => return finalize(state, &batch, batch_status::EXPIRED).await,
                End::Shutdown => return Ok(()),
                End::Failed(why) => return fail(state, id, &why).await,
            },
            batch_status::FINALIZING => return finalize(state, &batch, batch_status::COMPLETED).await,
            batch_status::CANCELLING => return finalize(state, &batch, batch_status::CANCELLED).await,
            _ => return Ok(()),
        }
    }
}

/// What every line of a batch shares.
struct Context {
    batch_id: Arc<str>,
    endpoint: BatchEndpoint,
    caller: Mutex<Caller>,
    /// The models the lines named, resolved once per run: every line of a run uses the same
    /// adapter version.
    targets: tokio::sync::Mutex<HashMap<String, Target>>,
}

impl Context {
    fn caller(&self) -> Caller {
        self.caller.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The model a line names, as it was resolved for the run's first line that named it, if
    /// the tenant may still use that version (its owner may have deleted it, or unpublished it
    /// since): each line checks, as a new request would.
    async fn target(&self, state: &AppState, tenant: &str, model: &str) -> Result<Target, ApiError> {
        let mut targets = self.targets.lock().await;
        if let Some(t) = targets.get(model) {
            return match t {
                Target::Base => Ok(Target::Base),
                Target::Adapter(a) => {
                    let base = model.rsplit_once('@').filter(|(_, v)| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())).map_or(model, |(b, _)| b);
                    match infer::resolve(state, tenant, &format!("{base}@{}", a.version)).await {
                        Ok(Target::Adapter(now)) if now.id == a.id => Ok(t.clone()),
                        Ok(_) | Err(ApiError::NotFound(_)) => {
                            let shown: String = model.chars().take(80).collect();
                            Err(ApiError::NotFound(format!("model `{shown}` (its version {} is no longer one you may use)", a.version)))
                        }
                        Err(e) => Err(e),
                    }
                }
            };
        }
        let t = infer::resolve(state, tenant, model).await?;
        targets.insert(model.to_string(), t.clone());
        Ok(t)
    }
}

/// The batch's tenant, with its plan, and its key, or why it can no longer run.
async fn caller(state: &AppState, batch: &BatchRecord) -> Result<Result<Caller, String>, ApiError> {
    let Some(tenant) = state.store.tenant(&batch.tenant_id).await? else { return Ok(Err("the tenant was deleted".into())) };
    let plan = state.store.plan(&tenant.plan).await?.ok_or_else(|| StoreError::Inconsistent(format!("tenant {} has no plan {:?}", tenant.id, tenant.plan)))?;
    Ok(Ok(Caller { key_id: batch.key_id.clone(), tenant, plan }))
}

/// Runs the lines of `batch` that are not done, until all are or it is told to stop.
async fn run_lines(state: &AppState, batch: &BatchRecord, stop: &mut watch::Receiver<Stop>) -> Result<End, ApiError> {
    if now_ms() >= batch.expires_at {
        return Ok(End::Expired);
    }
    let caller = match caller(state, batch).await? {
        Ok(c) => c,
        Err(why) => return Ok(End::Failed(why)),
    };
    let Some(input) = state.store.file(&batch.tenant_id, &batch.input_file_id).await? else {
        return Ok(End::Failed("the input file was deleted".into()));
    };
    let Some(endpoint) = BatchEndpoint::from_url(&batch.endpoint) else {
        return Ok(End::Failed(format!("the endpoint {} cannot be called by a batch", batch.endpoint)));
    };
    if batch.status == batch_status::VALIDATING {
        state.store.set_batch_status(&batch.id, &[batch_status::VALIDATING], batch_status::IN_PROGRESS).await?;
    }
    // What an earlier run left unrecorded runs again, and only this run's try is billed.
    state.store.void_unrecorded_batch_usage(&batch.id).await?;
    let done: HashSet<i64> = state.store.batch_done_lines(&batch.id).await?.into_iter().collect();
    let started: HashMap<i64, i64> = state.store.batch_tries(&batch.id).await?.into_iter().collect();
    let context = Arc::new(Context { batch_id: batch.id.as_str().into(), endpoint, caller: Mutex::new(caller), targets: tokio::sync::Mutex::default() });
    let path = state.adapter_files.local_file(&state.background, &input.path, u64::try_from(input.bytes).unwrap_or(0)).await?;
    let mut reader =
        Some(state.background.run(move || LineReader::open(&path)).await?.map_err(|e| ApiError::Internal(format!("opening the input file: {e}")))?);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(u64::try_from(batch.expires_at - now_ms()).unwrap_or(0));
    let mut in_flight: FuturesUnordered<oneshot::Receiver<Recorded>> = FuturesUnordered::new();
    let mut lost = false;
    let full = |state: &AppState| {
        format!(
            "the batch's output reached the file storage limit of {} bytes (the tenant's files and the output of its running batches); what finished is in its output and error files",
            state.settings.batch.max_tenant_file_bytes
        )
    };
    let end = 'lines: loop {
        let Some(mut r) = reader.take() else { break 'lines End::Done };
        let (r, chunk) = state
            .background
            .run(move || {
                let mut chunk = Vec::with_capacity(READ_LINES);
                while chunk.len() < READ_LINES {
                    match r.next_line()? {
                        Some(line) => chunk.push(line),
                        None => return Ok::<_, std::io::Error>((None, chunk)),
                    }
                }
                Ok((Some(r), chunk))
            })
            .await?
            .map_err(|e| ApiError::Internal(format!("reading the input file: {e}")))?;
        reader = r;
        if !chunk.is_empty() {
            // The tenant's plan and limits as they are now.
            match self::caller(state, batch).await? {
                Ok(c) => *context.caller.lock().unwrap_or_else(|e| e.into_inner()) = c,
                Err(why) => break 'lines End::Failed(why),
            }
        }
        for (number, line) in chunk {
            if done.contains(&(number as i64)) {
                continue;
            }
            let permit = loop {
                tokio::select! {
                    biased;
                    _ = stop.changed() => {}
                    () = tokio::time::sleep_until(deadline) => { state.batches.signal(&batch.id, Stop::Expire); }
                    Some(recorded) = in_flight.next(), if !in_flight.is_empty() => {
                        match recorded.unwrap_or(Recorded::Lost) {
                            Recorded::Yes => {}
                            Recorded::Lost => lost = true,
                            Recorded::Full => { state.batches.signal(&batch.id, Stop::Full); }
                        }
                        if *stop.borrow() == Stop::Go { continue; }
                    }
                    p = state.batches.lines.clone().acquire_owned() => {
                        let p = p.map_err(|_| ApiError::Unavailable("the batch runner stopped".into()))?;
                        // A stop told while the permit was awaited (a cancel, the tenant's
                        // deletion) is seen before the line starts.
                        if *stop.borrow() == Stop::Go { break p; }
                    }
                }
                match *stop.borrow() {
                    Stop::Go => {}
                    Stop::Cancel => break 'lines End::Cancelled,
                    Stop::Expire => break 'lines End::Expired,
                    Stop::Full => break 'lines End::Failed(full(state)),
                    Stop::Shutdown => break 'lines End::Shutdown,
                }
            };
            // A line whose earlier starts never ended, their server gone each time, is failed
            // rather than started again; every start is counted before the line runs.
            if started.get(&(number as i64)).copied().unwrap_or(0) >= MAX_LINE_STARTS {
                let result = given_up(&context, number, &line);
                if state.store.insert_batch_result(&result, &batch.tenant_id, None).await.is_err() {
                    lost = true;
                }
                continue;
            }
            state.store.start_batch_line(&batch.id, number as i64).await?;
            let (tx, rx) = oneshot::channel();
            in_flight.push(rx);
            let (state2, context, stop) = (state.clone(), context.clone(), stop.clone());
            state.jobs.spawn_local(move || async move {
                let recorded = line_task(&state2, &context, number, line, stop, permit).await;
                let _ = tx.send(recorded);
            });
        }
        if reader.is_none() {
            break 'lines End::Done;
        }
    };
    if matches!(end, End::Shutdown) {
        // The lines in flight finish (and are recorded) on their own, within the shutdown's
        // time; the rest run after the restart.
        return Ok(End::Shutdown);
    }
    // The lines in flight end: they finish, or stop when the batch is cancelled, expires or
    // fills its tenant's storage.
    let mut end = end;
    while !in_flight.is_empty() {
        tokio::select! {
            Some(recorded) = in_flight.next() => match recorded.unwrap_or(Recorded::Lost) {
                Recorded::Yes => {}
                Recorded::Lost => lost = true,
                Recorded::Full => { state.batches.signal(&batch.id, Stop::Full); }
            },
            _ = stop.changed() => {}
            () = tokio::time::sleep_until(deadline), if matches!(end, End::Done) => { state.batches.signal(&batch.id, Stop::Expire); }
        }
        match *stop.borrow() {
            Stop::Cancel if matches!(end, End::Done) => end = End::Cancelled,
            Stop::Expire if matches!(end, End::Done) => end = End::Expired,
            Stop::Full if matches!(end, End::Done) => end = End::Failed(full(state)),
            Stop::Shutdown if matches!(end, End::Done) => return Ok(End::Shutdown),
            _ => {}
        }
    }
    if lost && matches!(end, End::Done) {
        return Err(ApiError::Unavailable("the results of some lines could not be recorded".into()));
    }
    Ok(end)
}

/// Runs one line and records its result. A line stopped by a cancel, an expiry or a full
/// storage records nothing (and is not billed).
async fn line_task(state: &AppState, context: &Context, number: u64, line: Line, mut stop: watch::Receiver<Stop>, _permit: OwnedSemaphorePermit) -> Recorded {
    let stopping = |s: &Stop| matches!(s, Stop::Cancel | Stop::Expire | Stop::Full);
    if stopping(&stop.borrow()) {
        return Recorded::Yes;
    }
    let work = run_line(state, context, number, line, stop.clone());
    let result = tokio::select! {
        biased;
        () = told(&mut stop, stopping, false) => return Recorded::Yes,
        result = work => result,
    };
    let Some(result) = result else { return Recorded::Lost };
    let tenant = context.caller().tenant.id;
    let quota = i64::try_from(state.settings.batch.max_tenant_file_bytes).ok();
    // A result that cannot be written now is tried a few times; a line whose result is lost
    // runs again later.
    for attempt in 0..5u32 {
        match state.store.insert_batch_result(&result, &tenant, quota).await {
            Ok(false) => return Recorded::Yes,
            Ok(true) => return Recorded::Full,
            Err(e) => {
                eprintln!("warning: batch {}: recording line {number}: {e}", context.batch_id);
                tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
            }
        }
    }
    Recorded::Lost
}

/// The failed result of a line not started again (see [`MAX_LINE_STARTS`]).
fn given_up(context: &Context, number: u64, line: &Line) -> BatchResult {
    let custom_id = line.as_ref().ok().and_then(|t| RequestLine::parse(t).ok()).map(|(l, _)| l.custom_id);
    let message = format!("the line was started {MAX_LINE_STARTS} times and its server stopped each time before it finished; it is not started again");
    let body = json!({
        "id": random_id("batch_req"),
        "custom_id": custom_id,
        "response": null,
        "error": {"code": "line_abandoned", "message": message},
    });
    BatchResult { batch_id: context.batch_id.to_string(), line: number as i64, ok: 0, body: body.to_string(), usage_id: String::new() }
}

/// Completes once the batch is told what `what` accepts. A batch whose task has ended while
/// its lines are in flight did so because the server is stopping: that counts as told when
/// `closed` says so, and as never told otherwise.
async fn told(stop: &mut watch::Receiver<Stop>, what: impl FnMut(&Stop) -> bool, closed: bool) {
    if stop.wait_for(what).await.is_err() && !closed {
        std::future::pending::<()>().await;
    }
}

/// Whether an error is the server's capacity, which passes: the line waits and tries again.
fn retry_after(e: &ApiError) -> Option<Duration> {
    match e {
        ApiError::RateLimited { retry_after, .. } | ApiError::Overloaded { retry_after, .. } => Some(Duration::from_secs((*retry_after).clamp(1, 60))),
        ApiError::Unavailable(_) => Some(Duration::from_secs(1)),
        _ => None,
    }
}

/// One line's result, or `None` when the server stopped before it ran.
async fn run_line(state: &AppState, context: &Context, number: u64, line: Line, mut stop: watch::Receiver<Stop>) -> Option<BatchResult> {
    let request_id = random_id("batch_req");
    let result = |custom_id: Option<&str>, ok: bool, body: Value, usage_id: String| BatchResult {
        batch_id: context.batch_id.to_string(),
        line: number as i64,
        ok: i64::from(ok),
        body: json!({"id": request_id, "custom_id": custom_id, "response": body, "error": null}).to_string(),
        usage_id,
    };
    let failed = |custom_id: Option<&str>, e: &ApiError, usage_id: String| {
        use actix_web::ResponseError;
        let response = json!({"status_code": e.status_code().as_u16(), "request_id": request_id, "body": e.body()});
        result(custom_id, false, response, usage_id)
    };
    let text = match line {
        Ok(text) => text,
        Err(why) => return Some(failed(None, &ApiError::Invalid(why), String::new())),
    };
    let (line, endpoint) = match RequestLine::parse(&text) {
        Ok(parsed) => parsed,
        Err((id, why)) => return Some(failed(id.as_deref(), &ApiError::Invalid(why), String::new())),
    };
    let custom_id = Some(line.custom_id.as_str());
    if endpoint != context.endpoint {
        let e = ApiError::Invalid(format!("the line calls {}, the batch {}", endpoint.url(), context.endpoint.url()));
        return Some(failed(custom_id, &e, String::new()));
    }
    loop {
        let tried = async {
            let parsed = endpoint.parse(&line.body).map_err(|e| (e, String::new()))?;
            let caller = context.caller();
            let target = context.target(state, &caller.tenant.id, &parsed.model).await.map_err(|e| (e, String::new()))?;
            let admitting = std::time::Instant::now();
            let permit = state.limiter.admit_batch(&caller.tenant.id, &caller.tenant.limits()).await.map_err(|e| (e, String::new()))?;
            let state_time = crate::api::StateTime { limits: admitting.elapsed(), ..Default::default() };
            let usage_id = random_id("use");
            let tag = BatchLine { batch_id: context.batch_id.clone(), usage_id: usage_id.clone() };
            let admitted = Admitted { caller, permit, state_time };
            openai::answer(state, admitted, parsed, target, endpoint.batch_name(), Some(tag), &Peer::default())
                .await
                .map(|body| (body, usage_id.clone()))
                .map_err(|e| (e, usage_id))
        };
        match tried.await {
            Ok((body, usage_id)) => {
                let response = json!({"status_code": 200, "request_id": body["id"], "body": body});
                return Some(result(custom_id, true, response, usage_id));
            }
            Err((e, usage_id)) => match retry_after(&e) {
                None => return Some(failed(custom_id, &e, usage_id)),
                Some(wait) => {
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = told(&mut stop, |s| *s == Stop::Shutdown, true) => return None,
                    }
                }
            },
        }
    }
}

/// Writes the output and error files of a batch whose lines are done (or will never run), and
/// records its end as `status`.
async fn finalize(state: &AppState, batch: &BatchRecord, status: &str) -> Result<(), ApiError> {
    if state.store.tenant(&batch.tenant_id).await?.is_none() {
        // Its tenant was deleted, with its files: it ends without any.
        let counts = state.store.batch_counts(&batch.id).await?;
        state.ledger.flush().await;
        state.store.finish_batch(&batch.id, status, None, None, counts).await?;
        return Ok(());
    }
    let suffix = batch.id.strip_prefix("batch_").unwrap_or(&batch.id).to_string();
    let files = [format!("file-{suffix}-output"), format!("file-{suffix}-errors")];
    let paths = files.clone().map(|id| state.data_dir.join(super::super::files::relative_path(&id)));
    let partial = paths.clone().map(|p| p.with_extension("partial"));
    let open = partial.clone();
    let mut out = Some(
        state
            .background
            .run(move || -> std::io::Result<_> {
                if let Some(dir) = open[0].parent() {
                    std::fs::create_dir_all(dir)?;
                }
                Ok([std::fs::File::create(&open[0])?, std::fs::File::create(&open[1])?].map(std::io::BufWriter::new))
            })
            .await?
            .map_err(|e| ApiError::Internal(format!("creating the output files: {e}")))?,
    );
    // [lines, bytes] of the output and of the error file.
    let mut sizes = [[0i64; 2]; 2];
    let mut done = HashSet::new();
    let mut after = -1;
    loop {
        let page = state.store.batch_results(&batch.id, after, WRITE_RESULTS).await?;
        let Some(last) = page.last() else { break };
        after = last.line;
        done.extend(page.iter().map(|r| r.line));
        let mut writers = out.take().ok_or_else(|| ApiError::Internal("the output files are gone".into()))?;
        let (w, added) = state
            .background
            .run(move || -> std::io::Result<_> {
                use std::io::Write;
                let mut added = [[0i64; 2]; 2];
                for r in &page {
                    let which = usize::from(r.ok == 0);
                    writers[which].write_all(r.body.as_bytes())?;
                    writers[which].write_all(b"\n")?;
                    added[which][0] += 1;
                    added[which][1] += r.body.len() as i64 + 1;
                }
                Ok((writers, added))
            })
            .await?
            .map_err(|e| ApiError::Internal(format!("writing the output files: {e}")))?;
        out = Some(w);
        for (s, a) in sizes.iter_mut().zip(added) {
            s[0] += a[0];
            s[1] += a[1];
        }
    }
    let mut writers = out.take().ok_or_else(|| ApiError::Internal("the output files are gone".into()))?;
    if status == batch_status::EXPIRED {
        // Every line that never ran is an error of its own.
        let path = match state.store.file(&batch.tenant_id, &batch.input_file_id).await? {
            Some(f) => Some(state.adapter_files.local_file(&state.background, &f.path, u64::try_from(f.bytes).unwrap_or(0)).await?),
            None => None,
        };
        let (w, added) = state
            .background
            .run(move || -> std::io::Result<_> {
                use std::io::Write;
                let mut added = [0i64; 2];
                let Some(path) = path else { return Ok((writers, added)) };
                let mut reader = LineReader::open(&path)?;
                while let Some((number, line)) = reader.next_line()? {
                    if done.contains(&(number as i64)) {
                        continue;
                    }
                    let custom_id = line.ok().and_then(|t| RequestLine::parse(&t).ok()).map(|(l, _)| l.custom_id);
                    let body = json!({
                        "id": random_id("batch_req"),
                        "custom_id": custom_id,
                        "response": null,
                        "error": {"code": "batch_expired", "message": "This line could not be run before the batch's completion window closed."},
                    })
                    .to_string();
                    writers[1].write_all(body.as_bytes())?;
                    writers[1].write_all(b"\n")?;
                    added[0] += 1;
                    added[1] += body.len() as i64 + 1;
                }
                Ok((writers, added))
            })
            .await?
            .map_err(|e| ApiError::Internal(format!("writing the error file: {e}")))?;
        writers = w;
        sizes[1][0] += added[0];
        sizes[1][1] += added[1];
    }
    let keep = [sizes[0][0] > 0, sizes[1][0] > 0];
    let (from, to) = (partial.clone(), paths.clone());
    state
        .background
        .run(move || -> std::io::Result<()> {
            for (i, w) in writers.into_iter().enumerate() {
                let file = w.into_inner().map_err(|e| e.into_error())?;
                if keep[i] {
                    file.sync_all()?;
                    std::fs::rename(&from[i], &to[i])?;
                } else {
                    drop(file);
                    std::fs::remove_file(&from[i])?;
                }
            }
            Ok(())
        })
        .await?
        .map_err(|e| ApiError::Internal(format!("writing the output files: {e}")))?;
    let record = |i: usize, what: &str| {
        keep[i].then(|| FileRecord {
            id: files[i].clone(),
            tenant_id: batch.tenant_id.clone(),
            purpose: file_purpose::BATCH_OUTPUT.into(),
            filename: format!("{}_{what}.jsonl", batch.id),
            bytes: sizes[i][1],
            lines: sizes[i][0],
            path: super::super::files::relative_path(&files[i]),
            created_at: now_ms(),
        })
    };
    let (output, errors) = (record(0, "output"), record(1, "errors"));
    // Into the shared store (in a cluster) before the rows name them.
    for f in output.iter().chain(&errors) {
        state.adapter_files.put_file(&f.path).await?;
    }
    // A line stopped while its opening was on its way to the ledger (the writer gathers rows)
    // must have its row written before the rows no result records are voided, or it would stay
    // `running`.
    state.ledger.flush().await;
    state.store.finish_batch(&batch.id, status, output.as_ref(), errors.as_ref(), (sizes[0][0], sizes[1][0])).await?;
    Ok(())
}
