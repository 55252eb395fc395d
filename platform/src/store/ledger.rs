//! The usage ledger: one row per request, written before the request's final event is sent,
//! with group commit (rows that arrive while a transaction is being written go into the next
//! one); and billing reports priced by each tenant's plan.

use std::collections::BTreeMap;

use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use super::{Store, StoreError};

/// One finished request.
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
    /// `ok`, `cancelled`, `error`, ...
    pub outcome: String,
    pub started_at: i64,
    pub finished_at: i64,
}

/// Most rows in one transaction.
const GROUP: usize = 256;

/// A row to commit, or a barrier: answered once every row sent before it is committed.
enum Pending {
    Row(UsageRecord, oneshot::Sender<Result<(), String>>),
    Flush(oneshot::Sender<()>),
}

/// The writer of the ledger: a task that commits rows in groups. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Ledger {
    tx: mpsc::UnboundedSender<Pending>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pending::Row(r, _) => write!(f, "Row({})", r.id),
            Pending::Flush(_) => write!(f, "Flush"),
        }
    }
}

impl Ledger {
    /// Starts the writer on the current tokio runtime.
    pub fn start(store: Store) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Pending>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(GROUP);
            while rx.recv_many(&mut batch, GROUP).await > 0 {
                let rows: Vec<&UsageRecord> = batch
                    .iter()
                    .filter_map(|p| match p {
                        Pending::Row(r, _) => Some(r),
                        Pending::Flush(_) => None,
                    })
                    .collect();
                let outcome = if rows.is_empty() { Ok(()) } else { store.insert_usage(&rows).await.map_err(|e| e.to_string()) };
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
        Self { tx }
    }

    /// Commits one row; returns once it is durable (or why it could not be written).
    pub async fn commit(&self, record: UsageRecord) -> Result<(), StoreError> {
        let (done, wait) = oneshot::channel();
        self.tx.send(Pending::Row(record, done)).map_err(|_| StoreError::Invalid { field: "ledger", why: "the ledger writer has stopped".into() })?;
        match wait.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(StoreError::Invalid { field: "ledger", why }),
            Err(_) => Err(StoreError::Invalid { field: "ledger", why: "the ledger writer has stopped".into() }),
        }
    }

    /// Returns once every row sent before this call has been written (or failed).
    pub async fn flush(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Pending::Flush(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

/// Token sums and their price.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Totals {
    pub requests: i64,
    pub prompt_tokens: i64,
    pub cached_prompt_tokens: i64,
    pub completion_tokens: i64,
    /// Dollars.
    pub cost: f64,
}

impl Totals {
    fn add(&mut self, o: &Totals) {
        self.requests += o.requests;
        self.prompt_tokens += o.prompt_tokens;
        self.cached_prompt_tokens += o.cached_prompt_tokens;
        self.completion_tokens += o.completion_tokens;
        self.cost += o.cost;
    }
}

/// One (tenant, adapter, day) group of a billing report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BillingLine {
    pub tenant_id: String,
    pub tenant: String,
    pub plan: String,
    pub adapter: String,
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    #[serde(flatten)]
    pub totals: Totals,
}

/// Usage in `[from, to)`, priced: per (tenant, adapter, day), per tenant, and overall.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BillingReport {
    pub from: i64,
    pub to: i64,
    pub lines: Vec<BillingLine>,
    pub tenants: BTreeMap<String, Totals>,
    pub totals: Totals,
}

#[derive(sqlx::FromRow)]
struct Group {
    tenant_id: String,
    adapter: String,
    day: i64,
    requests: i64,
    prompt_tokens: i64,
    cached_prompt_tokens: i64,
    completion_tokens: i64,
}

const DAY_MS: i64 = 86_400_000;

impl Store {
    /// Writes rows in one transaction.
    pub async fn insert_usage(&self, rows: &[&UsageRecord]) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        for r in rows {
            sqlx::query(
                "INSERT INTO usage (id, tenant_id, key_id, adapter, prompt_tokens, cached_prompt_tokens, completion_tokens, queue_ms, ttft_ms, \
                 total_ms, outcome, started_at, finished_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            )
            .bind(&r.id)
            .bind(&r.tenant_id)
            .bind(&r.key_id)
            .bind(&r.adapter)
            .bind(r.prompt_tokens)
            .bind(r.cached_prompt_tokens)
            .bind(r.completion_tokens)
            .bind(r.queue_ms)
            .bind(r.ttft_ms)
            .bind(r.total_ms)
            .bind(&r.outcome)
            .bind(r.started_at)
            .bind(r.finished_at)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Usage in `[from, to)` (milliseconds), of one tenant or of all, priced by each tenant's
    /// plan: uncached prompt, cached prompt and completion tokens each at their price.
    pub async fn billing_report(&self, from: i64, to: i64, tenant: Option<&str>) -> Result<BillingReport, StoreError> {
        if from > to {
            return Err(StoreError::Invalid { field: "from", why: format!("{from} is after to ({to})") });
        }
        let groups: Vec<Group> = sqlx::query_as(
            "SELECT tenant_id, adapter, finished_at / $3 AS day, COUNT(*) AS requests, CAST(SUM(prompt_tokens) AS BIGINT) AS prompt_tokens, \
             CAST(SUM(cached_prompt_tokens) AS BIGINT) AS cached_prompt_tokens, CAST(SUM(completion_tokens) AS BIGINT) AS completion_tokens \
             FROM usage WHERE finished_at >= $1 AND finished_at < $2 AND ($4 = '' OR tenant_id = $4) \
             GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
        )
        .bind(from)
        .bind(to)
        .bind(DAY_MS)
        .bind(tenant.unwrap_or(""))
        .fetch_all(&self.pool)
        .await?;
        let plans: BTreeMap<String, super::Plan> = self.plans().await?.into_iter().map(|p| (p.name.clone(), p)).collect();
        #[derive(sqlx::FromRow)]
        struct Who {
            id: String,
            name: String,
            plan: String,
        }
        // Deleted tenants are still billed for what they used.
        let who: BTreeMap<String, Who> =
            sqlx::query_as::<_, Who>("SELECT id, name, plan FROM tenants").fetch_all(&self.pool).await?.into_iter().map(|w| (w.id.clone(), w)).collect();
        let mut report = BillingReport { from, to, lines: Vec::new(), tenants: BTreeMap::new(), totals: Totals::default() };
        for g in groups {
            let (name, plan) = who.get(&g.tenant_id).map_or((String::new(), String::new()), |w| (w.name.clone(), w.plan.clone()));
            let price = plans.get(&plan);
            let uncached = g.prompt_tokens - g.cached_prompt_tokens;
            let cost = price.map_or(0.0, |p| {
                (uncached as f64 * p.prompt_price as f64
                    + g.cached_prompt_tokens as f64 * p.cached_prompt_price as f64
                    + g.completion_tokens as f64 * p.completion_price as f64)
                    / 1e12
            });
            let totals = Totals {
                requests: g.requests,
                prompt_tokens: g.prompt_tokens,
                cached_prompt_tokens: g.cached_prompt_tokens,
                completion_tokens: g.completion_tokens,
                cost,
            };
            report.tenants.entry(g.tenant_id.clone()).or_default().add(&totals);
            report.totals.add(&totals);
            report.lines.push(BillingLine { tenant_id: g.tenant_id, tenant: name, plan, adapter: g.adapter, day: g.day, totals });
        }
        Ok(report)
    }
}

impl BillingReport {
    /// The report as CSV: one line per group, then one per tenant and the overall total.
    pub fn to_csv(&self) -> String {
        let mut out = String::from("tenant_id,tenant,plan,adapter,day,requests,prompt_tokens,cached_prompt_tokens,completion_tokens,cost\n");
        let field = |s: &str| if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
        let row = |out: &mut String, id: &str, name: &str, plan: &str, adapter: &str, day: &str, t: &Totals| {
            out.push_str(&format!(
                "{},{},{},{},{},{},{},{},{},{:.6}\n",
                field(id),
                field(name),
                field(plan),
                field(adapter),
                day,
                t.requests,
                t.prompt_tokens,
                t.cached_prompt_tokens,
                t.completion_tokens,
                t.cost
            ));
        };
        for l in &self.lines {
            row(&mut out, &l.tenant_id, &l.tenant, &l.plan, &l.adapter, &l.day.to_string(), &l.totals);
        }
        for (id, t) in &self.tenants {
            row(&mut out, id, "", "", "*", "*", t);
        }
        row(&mut out, "*", "", "", "*", "*", &self.totals);
        out
    }
}
