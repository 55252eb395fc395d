//! Durable state: tenants, API keys, adapters' metadata and the usage ledger.
//!
//! sqlx over SQLite by default (a file, WAL) or PostgreSQL by URL, through sqlx's `Any` driver so
//! that one set of queries serves both: `$N` placeholders, BIGINT integers, times as Unix
//! milliseconds. The migrations under `migrations/` are embedded in the binary and run at
//! connect.

mod auth;
mod batches;
mod business;
mod keys;
mod ledger;
pub mod limits;
mod money;
#[cfg(test)]
mod tests;

/// Databases for a test: a SQLite file under `dir`, and, when `LORAPLEX_TEST_POSTGRES` names
/// a server (`.ci/run` starts one), a new PostgreSQL database on it.
#[cfg(test)]
pub(crate) async fn test_urls(dir: &std::path::Path) -> Vec<String> {
    let mut out = vec![format!("sqlite://{}", dir.join("db.sqlite").display())];
    match std::env::var("LORAPLEX_TEST_POSTGRES") {
        Ok(url) => {
            install_drivers();
            let admin = AnyPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
            let name = random_id("test");
            sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&admin).await.unwrap();
            admin.close().await;
            let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
            out.push(format!("{base}/{name}"));
        }
        Err(_) => {
            assert!(std::env::var_os("LORAPLEX_REQUIRE_POSTGRES").is_none(), "LORAPLEX_REQUIRE_POSTGRES is set but LORAPLEX_TEST_POSTGRES is not");
            eprintln!("LORAPLEX_TEST_POSTGRES is not set: PostgreSQL skipped (.ci/run starts one)");
        }
    }
    out
}

use std::sync::Once;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::Rng;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

pub use auth::Principal;
pub use batches::{BatchRecord, BatchResult, BatchUsage, FileRecord, Page, batch_status, file_purpose};
pub use business::{AuditEntry, MAX_PRICE, PriceOverride, validate_plan};
pub use keys::KeyInfo;
pub use ledger::{BillingLine, BillingReport, DAY_MS, Ledger, TenantTotals, Totals, UsageRecord, date, outcome};
pub use money::Money;

/// The columns of [`Tenant`], in order.
macro_rules! tenant_columns {
    () => {
        "id, name, weight, plan, requests_per_min, tokens_per_min, max_concurrent, max_adapters, max_adapter_bytes, max_pinned_pages, created_at"
    };
}

/// The columns of [`AdapterRecord`], in order.
macro_rules! adapter_columns {
    () => {
        "id, owner, name, version, public, rank, targets, bytes, content_hash, blob, created_at, base_model, base_shape"
    };
}

// After the column macros, which its queries use.
mod adapters;

/// Errors of the store. Messages are for the caller where the caller got something wrong.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("migrating the database: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("unsupported database URL {0:?}: use sqlite://PATH or postgres://...")]
    Url(String),
    #[error("{what} {name:?} already exists")]
    Conflict { what: &'static str, name: String },
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The record is in use by another that needs it as it is.
    #[error("{0}")]
    InUse(String),
    #[error("invalid {field}: {why}")]
    Invalid { field: &'static str, why: String },
    /// A tenant's quota (adapters, adapter bytes) would be exceeded.
    #[error("{0}")]
    Quota(String),
    /// The database cannot take the work now (every connection busy, a conflict that persisted
    /// through retries, the ledger writer gone); retrying later may succeed.
    #[error("the database is busy: {0}")]
    Unavailable(String),
    /// Rows that the schema's constraints should have kept consistent are not.
    #[error("inconsistent database: {0}")]
    Inconsistent(String),
}

impl StoreError {
    /// Whether the error is a transient conflict between concurrent writers that a retry of
    /// the whole transaction resolves: PostgreSQL's serialization failure or deadlock, SQLite's
    /// busy or locked database.
    fn is_transient(&self) -> bool {
        let StoreError::Database(sqlx::Error::Database(d)) = self else { return false };
        let code = d.code();
        let code = code.as_deref().unwrap_or("");
        matches!(code, "40001" | "40P01" | "5" | "6" | "261" | "262" | "517" | "SQLITE_BUSY" | "SQLITE_LOCKED")
            || d.message().contains("database is locked")
            || d.message().contains("database table is locked")
    }
}

/// A connection idle at least this long is checked before use ([`pool_options`]).
const CHECK_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

/// A pool of at most `max` connections that checks a connection before handing it out only when
/// it sat idle for [`CHECK_IDLE`] or longer (where a server restart or a dropped connection would
/// show). Checking every one, sqlx's default, costs a round trip before each statement: on
/// PostgreSQL twice the round trips and wake-ups of a busy server's every query.
fn pool_options(max: u32) -> AnyPoolOptions {
    AnyPoolOptions::new().max_connections(max).test_before_acquire(false).before_acquire(|conn, meta| {
        Box::pin(async move {
            if meta.idle_for >= CHECK_IDLE {
                sqlx::Connection::ping(conn).await?;
            }
            Ok(true)
        })
    })
}

/// Which database a store talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbKind {
    Sqlite,
    Postgres,
}

/// The connection pool and the queries.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    kind: DbKind,
    auth: std::sync::Arc<auth::AuthCache>,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// A random id with a readable prefix: `ten_...`, `key_...`.
pub fn random_id(prefix: &str) -> String {
    let bytes: [u8; 12] = rand::rng().random();
    format!("{prefix}_{}", hex(&bytes))
}

/// Bytes as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn install_drivers() {
    static DRIVERS: Once = Once::new();
    DRIVERS.call_once(sqlx::any::install_default_drivers);
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// Attempts of a write transaction that keeps meeting transient conflicts.
const WRITE_ATTEMPTS: u32 = 8;

impl Store {
    /// Connects (creating a SQLite file if needed) and brings the schema up to date.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        install_drivers();
        let (kind, url) = if let Some(rest) = url.strip_prefix("sqlite:") {
            let url = if rest.contains("mode=") { url.to_string() } else { format!("{url}{}mode=rwc", if rest.contains('?') { '&' } else { '?' }) };
            (DbKind::Sqlite, url)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (DbKind::Postgres, url.to_string())
        } else {
            return Err(StoreError::Url(url.to_string()));
        };
        let mut options = pool_options(if kind == DbKind::Sqlite { 4 } else { 8 });
        if kind == DbKind::Sqlite {
            options = options.after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("PRAGMA foreign_keys = ON").execute(&mut *conn).await?;
                    sqlx::query("PRAGMA busy_timeout = 10000").execute(&mut *conn).await?;
                    Ok(())
                })
            });
        }
        let pool = options.connect(&url).await?;
        if kind == DbKind::Sqlite {
            sqlx::query("PRAGMA journal_mode = WAL").execute(&pool).await?;
        }
        sqlx::migrate!("../migrations").run(&pool).await?;
        let store = Self { pool, kind, auth: std::sync::Arc::new(auth::AuthCache::new()) };
        if kind == DbKind::Postgres {
            store.prepare_shared_limits().await?;
        }
        Ok(store)
    }

    pub fn kind(&self) -> DbKind {
        self.kind
    }

    /// A write transaction. On SQLite it takes the write lock up front (`BEGIN IMMEDIATE`):
    /// a transaction that reads and then writes can otherwise fail at once with "database is
    /// locked" when another writer got in between (the busy timeout does not apply to a lock
    /// upgrade).
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>, sqlx::Error> {
        match self.kind {
            DbKind::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await,
            DbKind::Postgres => self.pool.begin().await,
        }
    }

    /// Serializes the writes that concern one owner's adapters (versions, quotas) on
    /// PostgreSQL, inside `tx`; SQLite's `BEGIN IMMEDIATE` already serializes every writer.
    async fn lock_owner(&self, tx: &mut sqlx::Transaction<'static, sqlx::Any>, owner: &str) -> Result<(), sqlx::Error> {
        if self.kind == DbKind::Postgres {
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))").bind(format!("adapters:{owner}")).execute(&mut **tx).await?;
        }
        Ok(())
    }

    /// Runs a whole write transaction again when it fails on a transient conflict, with a
    /// short randomized backoff; a conflict that outlasts the attempts is
    /// [`StoreError::Unavailable`].
    async fn retrying<T, F, Fut>(&self, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut attempt = 0;
        loop {
            match op().await {
                Err(e) if e.is_transient() => {
                    attempt += 1;
                    if attempt >= WRITE_ATTEMPTS {
                        return Err(StoreError::Unavailable(e.to_string()));
                    }
                    let ms = rand::rng().random_range(1..=(5u64 << attempt.min(6)));
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                }
                other => return other,
            }
        }
    }

    /// On PostgreSQL, this store over a pool of `connections` of its own (connected on first
    /// use): for a writer on a request's path that must not wait for a connection behind other
    /// work, such as limit decisions waiting on a tenant's lock with every connection of the
    /// shared pool. `None` on SQLite, whose limits are kept in memory and hold no connection,
    /// and whose writers queue on the database's one write lock whatever their pool.
    pub fn own_pool(&self, connections: u32) -> Option<Self> {
        (self.kind == DbKind::Postgres)
            .then(|| Self { pool: pool_options(connections.max(1)).connect_lazy_with((*self.pool.connect_options()).clone()), ..self.clone() })
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Waits for connections to finish and closes them.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    // -----------------------------------------------------------------------------------------
    // Plans and tenants

    pub async fn plan(&self, name: &str) -> Result<Option<Plan>, StoreError> {
        Ok(sqlx::query_as("SELECT name, prompt_price, cached_prompt_price, completion_price, batch_percent FROM plans WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?)
    }

    pub async fn plans(&self) -> Result<Vec<Plan>, StoreError> {
        Ok(sqlx::query_as("SELECT name, prompt_price, cached_prompt_price, completion_price, batch_percent FROM plans ORDER BY name")
            .fetch_all(&self.pool)
            .await?)
    }

    pub async fn create_tenant(&self, new: &NewTenant) -> Result<Tenant, StoreError> {
        new.validate()?;
        if self.plan(&new.plan).await?.is_none() {
            return Err(StoreError::Invalid { field: "plan", why: format!("no plan named {:?}", new.plan) });
        }
        let t = Tenant {
            id: random_id("ten"),
            name: new.name.clone(),
            weight: new.weight,
            plan: new.plan.clone(),
            requests_per_min: new.limits.requests_per_min,
            tokens_per_min: new.limits.tokens_per_min,
            max_concurrent: new.limits.max_concurrent,
            max_adapters: new.limits.max_adapters,
            max_adapter_bytes: new.limits.max_adapter_bytes,
            max_pinned_pages: new.limits.max_pinned_pages,
            created_at: now_ms(),
        };
        let done = sqlx::query(
            "INSERT INTO tenants (id, name, weight, plan, requests_per_min, tokens_per_min, max_concurrent, max_adapters, max_adapter_bytes, \
             max_pinned_pages, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(&t.id)
        .bind(&t.name)
        .bind(t.weight)
        .bind(&t.plan)
        .bind(t.requests_per_min)
        .bind(t.tokens_per_min)
        .bind(t.max_concurrent)
        .bind(t.max_adapters)
        .bind(t.max_adapter_bytes)
        .bind(t.max_pinned_pages)
        .bind(t.created_at)
        .execute(&self.pool)
        .await;
        match done {
            Ok(_) => Ok(t),
            Err(e) if is_unique_violation(&e) => Err(StoreError::Conflict { what: "tenant", name: new.name.clone() }),
            Err(e) => Err(e.into()),
        }
    }

    /// A tenant that has not been deleted.
    pub async fn tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        let sql = concat!("SELECT ", tenant_columns!(), " FROM tenants WHERE id = $1 AND deleted_at IS NULL");
        Ok(sqlx::query_as(sql).bind(id).fetch_optional(&self.pool).await?)
    }

    pub async fn tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let sql = concat!("SELECT ", tenant_columns!(), " FROM tenants WHERE deleted_at IS NULL ORDER BY name");
        Ok(sqlx::query_as(sql).fetch_all(&self.pool).await?)
    }

    /// Changes what `patch` sets (a JSON merge patch: absent fields stay, cleared limits become
    /// unlimited); the tenant as it is now. Read and write happen in one write transaction, so
    /// concurrent patches of different fields never undo each other.
    pub async fn update_tenant(&self, id: &str, patch: &TenantPatch) -> Result<Tenant, StoreError> {
        if let Some(plan) = &patch.plan
            && self.plan(plan).await?.is_none()
        {
            return Err(StoreError::Invalid { field: "plan", why: format!("no plan named {plan:?}") });
        }
        let patched = self
            .retrying(|| async {
                let mut tx = self.write_tx().await?;
                // The row is locked from the read to the write (on SQLite the transaction holds the
                // write lock already), so concurrent patches of other fields are never lost.
                let sql = match self.kind {
                    DbKind::Sqlite => concat!("SELECT ", tenant_columns!(), " FROM tenants WHERE id = $1 AND deleted_at IS NULL"),
                    DbKind::Postgres => concat!("SELECT ", tenant_columns!(), " FROM tenants WHERE id = $1 AND deleted_at IS NULL FOR UPDATE"),
                };
                let mut t: Tenant = sqlx::query_as(sql).bind(id).fetch_optional(&mut *tx).await?.ok_or(StoreError::NotFound("tenant"))?;
                patch.apply(&mut t);
                validate_weight(t.weight)?;
                t.limits().validate()?;
                sqlx::query(
                    "UPDATE tenants SET weight = $1, plan = $2, requests_per_min = $3, tokens_per_min = $4, max_concurrent = $5, \
                 max_adapters = $6, max_adapter_bytes = $7, max_pinned_pages = $8 WHERE id = $9 AND deleted_at IS NULL",
                )
                .bind(t.weight)
                .bind(&t.plan)
                .bind(t.requests_per_min)
                .bind(t.tokens_per_min)
                .bind(t.max_concurrent)
                .bind(t.max_adapters)
                .bind(t.max_adapter_bytes)
                .bind(t.max_pinned_pages)
                .bind(id)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(t)
            })
            .await;
        self.auth.changed();
        patched
    }

    /// Deletes a tenant, in one transaction: its keys are revoked, its adapters and files
    /// deleted, and its batches with work left moved to `cancelling` (whoever runs them stops
    /// their lines). Its usage stays in the ledger. `None` if there was no such tenant.
    pub async fn delete_tenant(&self, id: &str) -> Result<Option<DeletedTenant>, StoreError> {
        let deleted = self
            .retrying(|| async {
                let now = now_ms();
                let mut tx = self.write_tx().await?;
                self.lock_owner(&mut tx, id).await?;
                // Its name is free again: the deleted row keeps it with its id, as its bills
                // name it from now on.
                let n = sqlx::query("UPDATE tenants SET deleted_at = $1, name = name || ' (deleted ' || id || ')' WHERE id = $2 AND deleted_at IS NULL")
                    .bind(now)
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                if n.rows_affected() == 0 {
                    return Ok(None);
                }
                sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE tenant_id = $2 AND revoked_at IS NULL").bind(now).bind(id).execute(&mut *tx).await?;
                let sql = concat!("SELECT ", adapter_columns!(), " FROM adapters WHERE owner = $1 AND deleted_at IS NULL");
                let adapters: Vec<AdapterRecord> = sqlx::query_as(sql).bind(id).fetch_all(&mut *tx).await?;
                sqlx::query("UPDATE adapters SET deleted_at = $1 WHERE owner = $2 AND deleted_at IS NULL").bind(now).bind(id).execute(&mut *tx).await?;
                let files: Vec<(String,)> =
                    sqlx::query_as("SELECT path FROM files WHERE tenant_id = $1 AND deleted_at IS NULL").bind(id).fetch_all(&mut *tx).await?;
                sqlx::query("UPDATE files SET deleted_at = $1 WHERE tenant_id = $2 AND deleted_at IS NULL").bind(now).bind(id).execute(&mut *tx).await?;
                let running = format!("tenant_id = $1 AND status IN ('{}', '{}')", batches::batch_status::VALIDATING, batches::batch_status::IN_PROGRESS);
                let batches: Vec<(String,)> =
                    sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT id FROM batches WHERE {running}"))).bind(id).fetch_all(&mut *tx).await?;
                let cancel = format!("UPDATE batches SET status = $2, cancelling_at = $3, errors = $4 WHERE {running}");
                let why = serde_json::json!([{"code": "tenant_deleted", "message": "the tenant was deleted", "param": null, "line": null}]).to_string();
                sqlx::query(sqlx::AssertSqlSafe(cancel)).bind(id).bind(batches::batch_status::CANCELLING).bind(now).bind(why).execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(Some(DeletedTenant { adapters, files: files.into_iter().map(|(p,)| p).collect(), batches: batches.into_iter().map(|(b,)| b).collect() }))
            })
            .await;
        self.auth.changed();
        deleted
    }
}

/// What deleting a tenant left to do outside the database.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DeletedTenant {
    /// Its adapters, to unload and whose files to remove.
    pub adapters: Vec<AdapterRecord>,
    /// The paths of its files (relative to the data directory), to remove.
    pub files: Vec<String>,
    /// Its batches that were running, now `cancelling`: to stop.
    pub batches: Vec<String>,
}

/// SHA-256 of a key's secret, hex.
fn hash_secret(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// A price list, in micro-dollars per million tokens.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct Plan {
    pub name: String,
    pub prompt_price: i64,
    pub cached_prompt_price: i64,
    pub completion_price: i64,
    /// Percent of these prices that a token of batch work costs.
    pub batch_percent: i64,
}

impl Plan {
    /// The prices of batch work: each price times [`Plan::batch_percent`], rounded down to a
    /// whole micro-dollar per million tokens.
    pub fn batch_prices(&self) -> (i64, i64, i64) {
        let share = |price: i64| i64::try_from(i128::from(price) * i128::from(self.batch_percent.clamp(0, 100)) / 100).unwrap_or(price);
        (share(self.prompt_price), share(self.cached_prompt_price), share(self.completion_price))
    }
}

/// Per-tenant limits; `None` is unlimited (for `max_pinned_pages`: the server's default).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantLimits {
    pub requests_per_min: Option<i64>,
    pub tokens_per_min: Option<i64>,
    pub max_concurrent: Option<i64>,
    pub max_adapters: Option<i64>,
    pub max_adapter_bytes: Option<i64>,
    /// Pages of each device's pool the tenant may keep pinned by loading adapters.
    pub max_pinned_pages: Option<i64>,
}

impl TenantLimits {
    fn validate(&self) -> Result<(), StoreError> {
        let all = [
            ("requests_per_min", self.requests_per_min),
            ("tokens_per_min", self.tokens_per_min),
            ("max_concurrent", self.max_concurrent),
            ("max_adapters", self.max_adapters),
            ("max_adapter_bytes", self.max_adapter_bytes),
            ("max_pinned_pages", self.max_pinned_pages),
        ];
        for (field, v) in all {
            if let Some(v) = v
                && v < 0
            {
                return Err(StoreError::Invalid { field, why: format!("{v} is negative") });
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, sqlx::FromRow, Serialize)]
pub struct Tenant {
    pub id: String,
    pub name: String,
    pub weight: f64,
    pub plan: String,
    pub requests_per_min: Option<i64>,
    pub tokens_per_min: Option<i64>,
    pub max_concurrent: Option<i64>,
    pub max_adapters: Option<i64>,
    pub max_adapter_bytes: Option<i64>,
    pub max_pinned_pages: Option<i64>,
    pub created_at: i64,
}

impl Tenant {
    pub fn limits(&self) -> TenantLimits {
        TenantLimits {
            requests_per_min: self.requests_per_min,
            tokens_per_min: self.tokens_per_min,
            max_concurrent: self.max_concurrent,
            max_adapters: self.max_adapters,
            max_adapter_bytes: self.max_adapter_bytes,
            max_pinned_pages: self.max_pinned_pages,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewTenant {
    pub name: String,
    pub weight: f64,
    pub plan: String,
    pub limits: TenantLimits,
}

impl NewTenant {
    fn validate(&self) -> Result<(), StoreError> {
        validate_name("name", &self.name)?;
        validate_weight(self.weight)?;
        self.limits.validate()
    }
}

/// A change to a tenant, with JSON merge patch semantics (RFC 7396): `None` leaves a field as
/// it is; for a limit, `Some(None)` clears it (unlimited) and `Some(Some(v))` sets it.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPatch {
    pub weight: Option<f64>,
    pub plan: Option<String>,
    #[serde(default)]
    pub limits: LimitsPatch,
}

/// A merge patch of [`TenantLimits`].
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsPatch {
    #[serde(default, deserialize_with = "present")]
    pub requests_per_min: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    pub tokens_per_min: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    pub max_concurrent: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    pub max_adapters: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    pub max_adapter_bytes: Option<Option<i64>>,
    #[serde(default, deserialize_with = "present")]
    pub max_pinned_pages: Option<Option<i64>>,
}

/// A field that is present: `null` is `Some(None)`, a value `Some(Some(v))`; an absent field
/// takes the `None` of `#[serde(default)]`.
fn present<'de, D: serde::Deserializer<'de>, T: serde::Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    <Option<T> as serde::Deserialize>::deserialize(d).map(Some)
}

impl TenantPatch {
    fn apply(&self, t: &mut Tenant) {
        if let Some(w) = self.weight {
            t.weight = w;
        }
        if let Some(plan) = &self.plan {
            t.plan = plan.clone();
        }
        let l = &self.limits;
        for (field, change) in [
            (&mut t.requests_per_min, l.requests_per_min),
            (&mut t.tokens_per_min, l.tokens_per_min),
            (&mut t.max_concurrent, l.max_concurrent),
            (&mut t.max_adapters, l.max_adapters),
            (&mut t.max_adapter_bytes, l.max_adapter_bytes),
            (&mut t.max_pinned_pages, l.max_pinned_pages),
        ] {
            if let Some(v) = change {
                *field = v;
            }
        }
    }
}

/// The largest weight a tenant may have against another's.
pub const MAX_WEIGHT: f64 = 1000.0;

fn validate_weight(w: f64) -> Result<(), StoreError> {
    if !(w.is_finite() && w > 0.0 && w <= MAX_WEIGHT) {
        return Err(StoreError::Invalid { field: "weight", why: format!("{w} is not in (0, {MAX_WEIGHT}]") });
    }
    Ok(())
}

/// Names of tenants and adapters: 1 to 64 of `a-z A-Z 0-9 - _ .`, not starting with a dot,
/// so that they are safe in paths and URLs.
fn validate_name(field: &'static str, name: &str) -> Result<(), StoreError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 64 || name.starts_with('.') || !name.chars().all(ok_char) {
        return Err(StoreError::Invalid { field, why: format!("{name:?}: use 1 to 64 letters, digits, '-', '_' or '.', not starting with '.'") });
    }
    Ok(())
}

/// Checks an adapter name: letters, digits, `-`, `_`, `.`, not starting with `.`.
pub fn validate_adapter_name(name: &str) -> Result<(), StoreError> {
    validate_name("adapter name", name)
}

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Inference,
    Adapters,
    Admin,
    /// Reading `/metrics` (operator keys only: the metrics name every tenant).
    Metrics,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Inference => "inference",
            Scope::Adapters => "adapters",
            Scope::Admin => "admin",
            Scope::Metrics => "metrics",
        }
    }

    fn join(scopes: &[Scope]) -> String {
        let mut names: Vec<&str> = scopes.iter().map(|s| s.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names.join(",")
    }
}

/// A key as stored (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct ApiKey {
    pub id: String,
    pub tenant_id: Option<String>,
    pub prefix: String,
    pub scopes: String,
    pub created_at: i64,
}

impl ApiKey {
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.split(',').any(|s| s == scope.as_str())
    }
}

/// One version of an adapter.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct AdapterRecord {
    pub id: String,
    /// The owning tenant's id; empty for the operator's adapters.
    pub owner: String,
    pub name: String,
    pub version: i64,
    /// 1 when published to every tenant.
    pub public: i64,
    pub rank: i64,
    pub targets: String,
    pub bytes: i64,
    pub content_hash: String,
    pub blob: String,
    pub created_at: i64,
    /// The served name of the base model it was uploaded for, and that model's shape (see
    /// [`crate::api::BaseModel`]); `None` only until a server adopts versions recorded before
    /// these were.
    pub base_model: Option<String>,
    pub base_shape: Option<String>,
}

impl AdapterRecord {
    /// `name@version`, as the ledger names it.
    pub fn label(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAdapter {
    pub owner: String,
    pub name: String,
    pub rank: i64,
    pub targets: String,
    pub bytes: i64,
    pub content_hash: String,
    pub blob: String,
    /// The base model it is uploaded for: its served name and shape.
    pub base_model: String,
    pub base_shape: String,
}
