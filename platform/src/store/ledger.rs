//! The usage ledger: one row per request, with group commit (rows that arrive while a
//! transaction is being written go into the next one); and billing reports.
//!
//! A request's row is written when it ends ([`Ledger::commit`], durable before its final event
//! goes out), and also opened (outcome `running`) while it runs: a batch line's before it is
//! queued ([`Ledger::open`]), an interactive request's once it has run for a moment, behind its
//! tokens ([`Ledger::send`]; see `api::infer`). A process that dies in between leaves `running`
//! rows, which the next start of the same instance turns into `interrupted`
//! ([`Store::interrupt_running`]): recorded with their prompt tokens and no charge. Each row
//! keeps the plan and prices in force when it was admitted, so reports price history as it was,
//! exactly (see [`Money`]).

use std::collections::BTreeMap;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::{DbKind, Money, Store, StoreError};

/// The outcomes a row can have.
pub mod outcome {
    /// Admitted, not finished yet (or its process died: see `INTERRUPTED`).
    pub const RUNNING: &str = "running";
    pub const OK: &str = "ok";
    /// The client went away, or cancelled.
    pub const CANCELLED: &str = "cancelled";
    pub const ERROR: &str = "error";
    /// Admitted and unfinished when its server process died; not charged.
    pub const INTERRUPTED: &str = "interrupted";
}

/// One request.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, Serialize)]
pub struct UsageRecord {
    pub id: String,
    pub tenant_id: String,
    pub key_id: String,
    /// `name@version`, or empty for the base model.
    pub adapter: String,
    pub prompt_tokens: i64,
    pub cached_prompt_tokens: i64,
    pub completion_tokens: i64,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
    /// One of [`outcome`].
    pub outcome: String,
    pub started_at: i64,
    pub finished_at: i64,
    /// The tenant's plan when the request was admitted, and its prices (micro-dollars per
    /// million tokens).
    pub plan: String,
    pub prompt_price: i64,
    pub cached_prompt_price: i64,
    pub completion_price: i64,
    /// The server instance that admitted it.
    pub instance: String,
    /// The batch it is a line of; empty for an interactive request.
    pub batch_id: String,
    /// The base model that served it (its served name).
    pub base_model: String,
}

/// Most rows in one transaction.
const GROUP: usize = 256;

/// A row to write, or a barrier: answered once every row sent before it is committed.
enum Pending {
    Row(Box<UsageRecord>, oneshot::Sender<Result<(), String>>),
    Flush(oneshot::Sender<()>),
}

/// The writer of the ledger: a task that commits rows in groups. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    tx: mpsc::UnboundedSender<Pending>,
    /// The writer's own pool (PostgreSQL), closed by [`Ledger::close`]; `None` when it writes
    /// through the store's.
    own: Option<Store>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pending::Row(r, _) => write!(f, "Row({}, {})", r.id, r.outcome),
            Pending::Flush(_) => write!(f, "Flush"),
        }
    }
}

fn stopped() -> StoreError {
    StoreError::Unavailable("the ledger writer has stopped".into())
}

/// A row on its way to the database: resolves once it is durable, or with why it could not be
/// written. Dropping it does not stop the write.
#[must_use = "a row is only known to be durable once its write resolves"]
pub struct Written(oneshot::Receiver<Result<(), String>>);

impl std::future::Future for Written {
    type Output = Result<(), StoreError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|answer| match answer {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(StoreError::Unavailable(format!("the usage ledger could not be written: {why}"))),
            Err(_) => Err(stopped()),
        })
    }
}

impl Ledger {
    /// Starts the writer on the current tokio runtime: the rows that arrive while a group is
    /// being written go out together in the next one. On PostgreSQL the writer has a connection
    /// of its own: a request's end waits for its row, and must not also wait for a connection
    /// of the shared pool behind other work (limit decisions queued on a tenant's lock).
    ///
    /// While rows arrive back to back (the last commit ended less than `gather` ago), the
    /// writer waits `gather` after the first before committing, so that one commit serves
    /// several requests: at half of a server's capacity, three replicas on PostgreSQL spent a
    /// fifth of two cores in their ledger connections committing one row at a time. A flush
    /// is never held back; zero `gather` never waits.
    pub fn start(store: Store, gather: std::time::Duration) -> Self {
        let own = store.own_pool(1);
        let store = own.clone().unwrap_or(store);
        let (tx, mut rx) = mpsc::unbounded_channel::<Pending>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(GROUP);
            let mut last_commit: Option<std::time::Instant> = None;
            while rx.recv_many(&mut batch, GROUP).await > 0 {
                // Rows flowing (the last commit ended a moment ago): gather (see above).
                let flowing = !gather.is_zero() && last_commit.is_some_and(|t| t.elapsed() < gather);
                if flowing && batch.len() < GROUP && !batch.iter().any(|p| matches!(p, Pending::Flush(_))) {
                    tokio::time::sleep(gather).await;
                    while batch.len() < GROUP
                        && let Ok(p) = rx.try_recv()
                    {
                        batch.push(p);
                    }
                }
                let rows: Vec<&UsageRecord> = batch
                    .iter()
                    .filter_map(|p| match p {
                        Pending::Row(r, _) => Some(&**r),
                        Pending::Flush(_) => None,
                    })
                    .collect();
                let outcome = if rows.is_empty() { Ok(()) } else { store.upsert_usage(&rows).await.map_err(|e| e.to_string()) };
                last_commit = Some(std::time::Instant::now());
                for p in batch.drain(..) {
                    match p {
                        Pending::Row(_, done) => {
                            let _ = done.send(outcome.clone());
                        }
                        Pending::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            }
        });
        Self { tx, own }
    }

    /// Records an admitted request (outcome `running`); returns once the row is durable.
    pub async fn open(&self, record: UsageRecord) -> Result<(), StoreError> {
        debug_assert_eq!(record.outcome, outcome::RUNNING);
        self.send(record)?.await
    }

    /// Records how a request ended (creating its row if it was never opened); returns once it
    /// is durable (or why it could not be written).
    pub async fn commit(&self, record: UsageRecord) -> Result<(), StoreError> {
        self.send(record)?.await
    }

    /// Hands a row to the writer without waiting for it: the caller may work meanwhile and
    /// await the answer when it must know the row is durable. A later write of the same row
    /// must wait for this one's answer.
    pub fn send(&self, record: UsageRecord) -> Result<Written, StoreError> {
        let (done, wait) = oneshot::channel();
        self.tx.send(Pending::Row(Box::new(record), done)).map_err(|_| stopped())?;
        Ok(Written(wait))
    }

    /// Returns once every row sent before this call has been written (or failed).
    pub async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Pending::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }

    /// At shutdown: writes every row sent before this call, then closes the writer's own
    /// connection (the store's pool is its owner's to close). Rows sent later fail.
    pub async fn close(&self) {
        self.flush().await;
        if let Some(own) = &self.own {
            own.close().await;
        }
    }
}

/// Token sums and their exact price.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub requests: i64,
    pub prompt_tokens: i64,
    pub cached_prompt_tokens: i64,
    pub completion_tokens: i64,
    pub cost: Money,
}

fn overflow() -> StoreError {
    StoreError::Invalid { field: "report", why: "the sums overflow".into() }
}

impl Totals {
    pub fn add(&mut self, o: &Totals) -> Result<(), StoreError> {
        self.requests = self.requests.checked_add(o.requests).ok_or_else(overflow)?;
        self.prompt_tokens = self.prompt_tokens.checked_add(o.prompt_tokens).ok_or_else(overflow)?;
        self.cached_prompt_tokens = self.cached_prompt_tokens.checked_add(o.cached_prompt_tokens).ok_or_else(overflow)?;
        self.completion_tokens = self.completion_tokens.checked_add(o.completion_tokens).ok_or_else(overflow)?;
        self.cost = self.cost.checked_add(o.cost).ok_or_else(overflow)?;
        Ok(())
    }

    pub fn total_tokens(&self) -> i64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// One (tenant, adapter, day, plan) group of a billing report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BillingLine {
    pub tenant_id: String,
    pub tenant: String,
    /// The plan its requests were admitted under.
    pub plan: String,
    pub adapter: String,
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    #[serde(flatten)]
    pub totals: Totals,
}

/// One tenant's sums over a report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct TenantTotals {
    /// The tenant's name (also for deleted tenants, which stay billable).
    pub tenant: String,
    #[serde(flatten)]
    pub totals: Totals,
}

/// Finished usage in `[from, to)`, priced: per (tenant, adapter, day, plan), per tenant, and
/// overall.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BillingReport {
    pub from: i64,
    pub to: i64,
    pub lines: Vec<BillingLine>,
    pub tenants: BTreeMap<String, TenantTotals>,
    pub totals: Totals,
}

#[derive(sqlx::FromRow)]
struct Group {
    tenant_id: String,
    adapter: String,
    day: i64,
    plan: String,
    prompt_price: i64,
    cached_prompt_price: i64,
    completion_price: i64,
    requests: i64,
    prompt_tokens: i64,
    cached_prompt_tokens: i64,
    completion_tokens: i64,
}

impl Group {
    fn totals(&self) -> Result<Totals, StoreError> {
        let uncached = self.prompt_tokens - self.cached_prompt_tokens;
        let mut cost = Money::ZERO;
        for (tokens, price) in
            [(uncached, self.prompt_price), (self.cached_prompt_tokens, self.cached_prompt_price), (self.completion_tokens, self.completion_price)]
        {
            cost = cost.checked_add(Money::of(tokens, price)).ok_or_else(overflow)?;
        }
        Ok(Totals {
            requests: self.requests,
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: self.cached_prompt_tokens,
            completion_tokens: self.completion_tokens,
            cost,
        })
    }
}

pub const DAY_MS: i64 = 86_400_000;

/// `YYYY-MM-DD` of a day number since the Unix epoch (proleptic Gregorian, UTC).
pub fn date(day: i64) -> String {
    // Howard Hinnant's days-to-civil.
    let z = day + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The columns of a usage row, in the order both statements below name them.
const USAGE_COLUMNS: &str = "id, tenant_id, key_id, adapter, prompt_tokens, cached_prompt_tokens, completion_tokens, queue_ms, ttft_ms, \
     total_ms, outcome, started_at, finished_at, plan, prompt_price, cached_prompt_price, completion_price, instance, batch_id, base_model";

/// What a known row (opened earlier) takes from a later write: its outcome, tokens and times;
/// its plan and prices stay as opened. A row already `cancelled` or `interrupted` (voided with
/// its batch while its request was still ending) keeps that outcome.
const USAGE_ON_CONFLICT: &str = "ON CONFLICT (id) DO UPDATE SET prompt_tokens = excluded.prompt_tokens, \
     cached_prompt_tokens = excluded.cached_prompt_tokens, completion_tokens = excluded.completion_tokens, queue_ms = excluded.queue_ms, \
     ttft_ms = excluded.ttft_ms, total_ms = excluded.total_ms, \
     outcome = CASE WHEN usage.outcome IN ('cancelled', 'interrupted') THEN usage.outcome ELSE excluded.outcome END, \
     finished_at = excluded.finished_at";

/// A group of rows as one statement with one parameter, a JSON array of the rows: one round
/// trip and one cached statement whatever the group's size (a statement per row cost a round
/// trip per row inside the transaction, which is what limited the ledger on PostgreSQL).
fn upsert_usage_sql(kind: DbKind) -> String {
    match kind {
        DbKind::Postgres => format!(
            "INSERT INTO usage ({USAGE_COLUMNS}) SELECT {USAGE_COLUMNS} FROM json_to_recordset($1::json) AS r(id TEXT, tenant_id TEXT, \
             key_id TEXT, adapter TEXT, prompt_tokens BIGINT, cached_prompt_tokens BIGINT, completion_tokens BIGINT, queue_ms DOUBLE PRECISION, \
             ttft_ms DOUBLE PRECISION, total_ms DOUBLE PRECISION, outcome TEXT, started_at BIGINT, finished_at BIGINT, plan TEXT, \
             prompt_price BIGINT, cached_prompt_price BIGINT, completion_price BIGINT, instance TEXT, batch_id TEXT, base_model TEXT) {USAGE_ON_CONFLICT}"
        ),
        DbKind::Sqlite => {
            let fields = USAGE_COLUMNS.split(',').map(|c| format!("json_extract(value, '$.{}')", c.trim())).collect::<Vec<_>>().join(", ");
            // `WHERE true` settles SQLite's parse of `ON CONFLICT` after a SELECT.
            format!("INSERT INTO usage ({USAGE_COLUMNS}) SELECT {fields} FROM json_each($1) WHERE true {USAGE_ON_CONFLICT}")
        }
    }
}

/// Splits `rows` into runs in which no id is written twice: PostgreSQL refuses one statement
/// that updates a row twice, and rows of the same id must apply in order. A request's end is
/// only sent after its opening was written, so one run is the rule.
fn runs<'a>(rows: &[&'a UsageRecord]) -> Vec<Vec<&'a UsageRecord>> {
    let mut runs: Vec<Vec<&UsageRecord>> = vec![Vec::new()];
    let mut ids = std::collections::HashSet::new();
    for r in rows {
        if !ids.insert(r.id.as_str()) {
            ids.clear();
            ids.insert(r.id.as_str());
            runs.push(Vec::new());
        }
        runs.last_mut().expect("runs starts with one").push(r);
    }
    runs.retain(|r| !r.is_empty());
    runs
}

/// The rows as a JSON array; times that are not finite numbers (which JSON cannot hold) are
/// written as 0 (only then are the rows copied).
fn usage_json(rows: &[&UsageRecord]) -> Result<String, StoreError> {
    let invalid = |e: serde_json::Error| StoreError::Invalid { field: "usage", why: e.to_string() };
    if rows.iter().all(|r| [r.queue_ms, r.ttft_ms, r.total_ms].iter().all(|v| v.is_finite())) {
        return serde_json::to_string(rows).map_err(invalid);
    }
    let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
    let rows: Vec<UsageRecord> =
        rows.iter().map(|r| UsageRecord { queue_ms: finite(r.queue_ms), ttft_ms: finite(r.ttft_ms), total_ms: finite(r.total_ms), ..(*r).clone() }).collect();
    serde_json::to_string(&rows).map_err(invalid)
}

impl Store {
    /// Writes rows atomically: new rows are inserted, known ones (opened earlier) get their
    /// outcome, tokens and times; their plan and prices stay as opened.
    pub async fn upsert_usage(&self, rows: &[&UsageRecord]) -> Result<(), StoreError> {
        static POSTGRES: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| upsert_usage_sql(DbKind::Postgres));
        static SQLITE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| upsert_usage_sql(DbKind::Sqlite));
        let sql: &'static str = match self.kind {
            DbKind::Postgres => &POSTGRES,
            DbKind::Sqlite => &SQLITE,
        };
        let runs = runs(rows).iter().map(|run| usage_json(run)).collect::<Result<Vec<_>, _>>()?;
        self.retrying(|| async {
            if let [one] = runs.as_slice() {
                // One statement is atomic by itself: no transaction's two extra round trips.
                sqlx::query(sqlx::AssertSqlSafe(sql)).bind(one).execute(&self.pool).await?;
                return Ok(());
            }
            let mut tx = self.write_tx().await?;
            for run in &runs {
                sqlx::query(sqlx::AssertSqlSafe(sql)).bind(run).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// Marks the rows `instance` left `running` (its process died) as `interrupted`, without
    /// charge; returns how many there were.
    pub async fn interrupt_running(&self, instance: &str) -> Result<u64, StoreError> {
        let now = super::now_ms();
        let done = sqlx::query(
            "UPDATE usage SET outcome = $1, finished_at = CASE WHEN finished_at < $2 THEN $2 ELSE finished_at END, \
             prompt_price = 0, cached_prompt_price = 0, completion_price = 0 WHERE instance = $3 AND outcome = $4",
        )
        .bind(outcome::INTERRUPTED)
        .bind(now)
        .bind(instance)
        .bind(outcome::RUNNING)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    /// One row (tests and support).
    pub async fn usage_row(&self, id: &str) -> Result<Option<UsageRecord>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, tenant_id, key_id, adapter, prompt_tokens, cached_prompt_tokens, completion_tokens, queue_ms, ttft_ms, total_ms, outcome, \
             started_at, finished_at, plan, prompt_price, cached_prompt_price, completion_price, instance, batch_id, base_model FROM usage WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Rows per outcome of one tenant (or all): what a report counts, and what it leaves out.
    pub async fn outcomes(&self, tenant: Option<&str>) -> Result<BTreeMap<String, i64>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT outcome, COUNT(*) FROM usage WHERE ($1 = '' OR tenant_id = $1) GROUP BY outcome")
            .bind(tenant.unwrap_or(""))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().collect())
    }

    /// Finished usage in `[from, to)` (milliseconds), of one tenant or of all, each row priced
    /// as it was admitted: uncached prompt, cached prompt and completion tokens at their prices.
    /// Requests still running are not in it.
    pub async fn billing_report(&self, from: i64, to: i64, tenant: Option<&str>) -> Result<BillingReport, StoreError> {
        if from > to {
            return Err(StoreError::Invalid { field: "from", why: format!("{from} is after to ({to})") });
        }
        let groups: Vec<Group> = sqlx::query_as(
            "SELECT tenant_id, adapter, finished_at / $3 AS day, plan, prompt_price, cached_prompt_price, completion_price, COUNT(*) AS requests, \
             CAST(SUM(prompt_tokens) AS BIGINT) AS prompt_tokens, CAST(SUM(cached_prompt_tokens) AS BIGINT) AS cached_prompt_tokens, \
             CAST(SUM(completion_tokens) AS BIGINT) AS completion_tokens \
             FROM usage WHERE finished_at >= $1 AND finished_at < $2 AND ($4 = '' OR tenant_id = $4) AND outcome <> $5 \
             GROUP BY 1, 2, 3, 4, 5, 6, 7 ORDER BY 1, 2, 3, 4",
        )
        .bind(from)
        .bind(to)
        .bind(DAY_MS)
        .bind(tenant.unwrap_or(""))
        .bind(outcome::RUNNING)
        .fetch_all(&self.pool)
        .await?;
        // Deleted tenants are still billed for what they used, under their name.
        let names: BTreeMap<String, String> =
            sqlx::query_as::<_, (String, String)>("SELECT id, name FROM tenants").fetch_all(&self.pool).await?.into_iter().collect();
        let mut report = BillingReport { from, to, lines: Vec::new(), tenants: BTreeMap::new(), totals: Totals::default() };
        for g in groups {
            let totals = g.totals()?;
            let name = names.get(&g.tenant_id).cloned().unwrap_or_default();
            let tenant = report.tenants.entry(g.tenant_id.clone()).or_insert_with(|| TenantTotals { tenant: name.clone(), totals: Totals::default() });
            tenant.totals.add(&totals)?;
            report.totals.add(&totals)?;
            // Groups that differ only in prices (a plan whose prices changed) share a line.
            match report.lines.last_mut() {
                Some(l) if (&l.tenant_id, &l.adapter, l.day, &l.plan) == (&g.tenant_id, &g.adapter, g.day, &g.plan) => l.totals.add(&totals)?,
                _ => report.lines.push(BillingLine { tenant_id: g.tenant_id, tenant: name, plan: g.plan, adapter: g.adapter, day: g.day, totals }),
            }
        }
        Ok(report)
    }
}

impl BillingReport {
    /// The report as CSV, with the same fields and values as its JSON form: one line per group,
    /// then one per tenant (adapter and date `*`) and the overall total (tenant `*`).
    pub fn to_csv(&self) -> String {
        let mut out = String::from("tenant_id,tenant,plan,adapter,date,requests,prompt_tokens,cached_prompt_tokens,completion_tokens,total_tokens,cost\n");
        let field = |s: &str| if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
        let row = |out: &mut String, id: &str, name: &str, plan: &str, adapter: &str, day: &str, t: &Totals| {
            out.push_str(&format!(
                "{},{},{},{},{},{},{},{},{},{},{}\n",
                field(id),
                field(name),
                field(plan),
                field(adapter),
                day,
                t.requests,
                t.prompt_tokens,
                t.cached_prompt_tokens,
                t.completion_tokens,
                t.total_tokens(),
                t.cost
            ));
        };
        for l in &self.lines {
            row(&mut out, &l.tenant_id, &l.tenant, &l.plan, &l.adapter, &date(l.day), &l.totals);
        }
        for (id, t) in &self.tenants {
            row(&mut out, id, &t.tenant, "*", "*", "*", &t.totals);
        }
        row(&mut out, "*", "*", "*", "*", "*", &self.totals);
        out
    }
}
