//! Tenant limits shared by the replicas of one PostgreSQL database: the rows behind
//! `api::limits` when it runs in its shared mode.
//!
//! Every decision is one call of a function (`limits.sql`) that takes the tenant's advisory lock
//! before it reads, so two replicas never both take the last slot, and costs one round trip;
//! time is the database's clock, so replicas whose clocks differ still agree on what the last
//! minute is. A decision may grant a lease of several admissions or tokens, counted at once, that
//! the replica hands out until the second ends, then gives back the rest ([`Store::limit_apply`]).
//! Each tenant's clock runs ahead of the database's by an offset of its own (under a second):
//! the `now_ms` of its verdicts, and its seconds, are on it, so that many tenants' leases do not
//! all end at the same instant. Only differences of its times are used, so the offset cancels.

use super::{DbKind, Store, StoreError};

/// A replica not seen for this long is gone: its requests' concurrency slots no longer count.
pub const REPLICA_TIMEOUT_MS: i64 = 15_000;

/// The requests-per-minute window.
pub const WINDOW_MS: i64 = 60_000;

/// What [`Store::limit_admit`] is asked: one request of a tenant, with the limits it runs under.
#[derive(Debug, Clone)]
pub struct AdmitAsk<'a> {
    pub tenant: &'a str,
    /// Batch work (counted apart as well, against `share_*`).
    pub batch: bool,
    pub replica: &'a str,
    pub max_concurrent: Option<i64>,
    pub requests_per_min: Option<i64>,
    pub share_concurrent: Option<i64>,
    pub share_requests_per_min: Option<i64>,
    /// The class's burst bucket: (capacity, requests per second); `None` without one.
    pub bucket: Option<(f64, f64)>,
    /// Admissions wanted at once (this request's and a lease of the rest); at least one is
    /// granted, at most an eighth of the room every limit has left.
    pub want: i64,
    /// The tokens-per-minute limits (the tenant's, and batch work's share of it), for a lease of
    /// tokens granted with the admissions.
    pub tokens_per_min: Option<i64>,
    pub share_tokens_per_min: Option<i64>,
    /// Tokens wanted as a lease (0: none); never a refusal, at most an eighth of the room the
    /// token limits have left.
    pub want_tokens: i64,
    /// Leases for the tenant's next second (counted in it) rather than the current one.
    pub ahead: bool,
}

/// What [`Store::limit_admit`] decided: `ok` (the request is counted), or which limit
/// refused it: `concurrent`, `rpm`, `share_concurrent`, `share_rpm`, `bucket`; or, asked
/// `ahead`, `near` (a limit is too near for a lease: nothing was counted).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AdmitVerdict {
    pub verdict: String,
    /// The tenant's clock (see the module).
    pub now_ms: i64,
    /// For `rpm` and `share_rpm`: the oldest request of the minute counted.
    pub oldest_ms: Option<i64>,
    /// The bucket's requests, after this one (`ok`) or as found (`bucket`).
    pub held: Option<f64>,
    /// Admissions granted and counted (`ok`: at least one), 0 when refused; counted in the
    /// second of `now_ms`, or in the next one when asked `ahead`.
    pub granted: i64,
    /// Tokens granted as a lease and counted with the admissions (perhaps 0).
    pub tokens_granted: i64,
}

/// What [`Store::limit_reserve`] decided: `ok` (reserved), `share` (batch work's half would be
/// exceeded) or `all`; with the database's time and the tokens held before.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ReserveVerdict {
    pub verdict: String,
    /// The tenant's clock (see the module).
    pub now_ms: i64,
    pub held: i64,
    /// Tokens granted and counted in the second of `now_ms` (`ok`: at least those asked), 0
    /// when refused.
    pub granted: i64,
}

impl Store {
    /// On PostgreSQL: the limit tables made unlogged, and the decision functions
    /// (`limits.sql`) created, under a lock so replicas starting together do not collide.
    ///
    /// Unlogged tables' writes skip the write-ahead log, so a decision waits for no disk flush.
    /// What they hold is worth a minute at most, and a crash of the database server empties them
    /// (every tenant's window starts afresh), which is the trade.
    pub(super) async fn prepare_shared_limits(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('loraplex:limits-schema'))").execute(&mut *tx).await?;
        for table in ["limit_seconds", "limit_running", "limit_buckets", "replicas"] {
            let (persistence,): (String,) = sqlx::query_as("SELECT CAST(relpersistence AS TEXT) FROM pg_class WHERE relname = $1 AND relkind = 'r'")
                .bind(table)
                .fetch_one(&mut *tx)
                .await?;
            if persistence != "u" {
                sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE {table} SET UNLOGGED"))).execute(&mut *tx).await?;
            }
        }
        sqlx::raw_sql(include_str!("limits.sql")).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Decides one admission under the tenant's lock, in one call; see [`AdmitVerdict`].
    pub async fn limit_admit(&self, ask: &AdmitAsk<'_>) -> Result<AdmitVerdict, StoreError> {
        if self.kind != DbKind::Postgres {
            return Err(StoreError::Unavailable("shared limits need PostgreSQL".into()));
        }
        // No NULLs (see limits.sql): -1 is no limit.
        let (cap, rate) = ask.bucket.unwrap_or((-1.0, 0.0));
        let none = |v: Option<i64>| v.map_or(-1, |v| v.max(0));
        Ok(sqlx::query_as(
            "SELECT verdict, now_ms, oldest_ms, held, granted, tokens_granted \
             FROM loraplex_limit_admit_leases($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)",
        )
        .bind(ask.tenant)
        .bind(ask.batch as i32)
        .bind(ask.replica)
        .bind(none(ask.max_concurrent))
        .bind(none(ask.requests_per_min))
        .bind(none(ask.share_concurrent))
        .bind(none(ask.share_requests_per_min))
        .bind(cap)
        .bind(rate)
        .bind(WINDOW_MS)
        .bind(REPLICA_TIMEOUT_MS)
        .bind(ask.want.max(1))
        .bind(none(ask.tokens_per_min))
        .bind(none(ask.share_tokens_per_min))
        .bind(ask.want_tokens.max(0))
        .bind(i32::from(ask.ahead))
        .fetch_one(&self.pool)
        .await?)
    }

    /// Reserves `tokens` for a request of `tenant`'s class `batch` in the current second, under
    /// the tenant's lock, if they fit `max` (all its requests of the minute) and `share_max` (its
    /// batch work's), with a lease of up to `want` in all; see [`ReserveVerdict`].
    pub async fn limit_reserve(
        &self,
        tenant: &str,
        batch: bool,
        tokens: i64,
        max: Option<i64>,
        share_max: Option<i64>,
        want: i64,
    ) -> Result<ReserveVerdict, StoreError> {
        Ok(sqlx::query_as("SELECT verdict, now_ms, held, granted FROM loraplex_limit_reserve_lease($1, $2, $3, $4, $5, $6, $7)")
            .bind(tenant)
            .bind(batch as i32)
            .bind(tokens)
            .bind(max.map_or(-1, |v| v.max(0)))
            .bind(share_max.map_or(-1, |v| v.max(0)))
            .bind(WINDOW_MS)
            .bind(want.max(tokens))
            .fetch_one(&self.pool)
            .await?)
    }

    /// The (start in ms, tokens) of each second since `since_ms` in which `tenant` holds tokens
    /// (its batch work's alone with `batch`), oldest first: when a refused reservation would fit.
    pub async fn limit_token_rows(&self, tenant: &str, batch: bool, since_ms: i64) -> Result<Vec<(i64, u64)>, StoreError> {
        let rows: Vec<(i64, i64)> =
            sqlx::query_as("SELECT second, tokens FROM limit_seconds WHERE tenant_id = $1 AND batch = $2 AND second > $3 AND tokens > 0 ORDER BY second")
                .bind(tenant)
                .bind(batch as i32)
                .bind(since_ms / 1000)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.into_iter().map(|(second, n)| (second * 1000, n.max(0) as u64)).collect())
    }

    /// Marks this replica alive, and deletes rows nothing counts any more: seconds past the
    /// window, and replicas gone for an hour with their counts.
    pub async fn limit_heartbeat(&self, replica: &str) -> Result<(), StoreError> {
        let (now,): (i64,) = sqlx::query_as("SELECT CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)").fetch_one(&self.pool).await?;
        sqlx::query("INSERT INTO replicas (id, seen_ms) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET seen_ms = excluded.seen_ms")
            .bind(replica)
            .bind(now)
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM limit_seconds WHERE second < $1").bind((now - 2 * WINDOW_MS) / 1000).execute(&self.pool).await?;
        sqlx::query("DELETE FROM limit_running WHERE replica IN (SELECT id FROM replicas WHERE seen_ms < $1)")
            .bind(now - 3_600_000)
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM replicas WHERE seen_ms < $1").bind(now - 3_600_000).execute(&self.pool).await?;
        Ok(())
    }

    /// Lets go every slot `replica` holds: its previous run ended without releasing them.
    pub async fn limit_restart(&self, replica: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM limit_running WHERE replica = $1").bind(replica).execute(&self.pool).await?;
        Ok(())
    }

    /// Writes what requests and leases gave back since the last call, all of it in one
    /// statement (so one round trip and one transaction; the rows go as JSON parameters): tokens
    /// settled (used less reserved, per second), admissions of leases not handed out (per
    /// second), and concurrency slots let go on `replica`. Each list names the rows themselves:
    /// batch work's changes are already added to its tenant's totals (class 0). Whether it was
    /// written (all of it, or none).
    pub async fn limit_apply(&self, replica: &str, changes: &LimitChanges) -> bool {
        #[derive(serde::Serialize)]
        struct Second<'a> {
            t: &'a str,
            b: i32,
            s: i64,
            /// Tokens to add.
            dt: i64,
            /// Admissions to take back.
            dr: i64,
        }
        #[derive(serde::Serialize)]
        struct Running<'a> {
            t: &'a str,
            b: i32,
            d: i64,
        }
        // One row per second counted: an UPDATE may change a row once.
        let mut seconds: std::collections::BTreeMap<(&str, bool, i64), (i64, i64)> = Default::default();
        for (t, b, s, d) in &changes.tokens {
            let e = seconds.entry((t.as_str(), *b, *s)).or_default();
            e.0 = e.0.saturating_add(*d);
        }
        for (t, b, s, d) in &changes.requests {
            let e = seconds.entry((t.as_str(), *b, *s)).or_default();
            e.1 = e.1.saturating_add(*d);
        }
        let mut running: std::collections::BTreeMap<(&str, bool), i64> = Default::default();
        for (t, b, _, d) in &changes.running {
            let e = running.entry((t.as_str(), *b)).or_default();
            *e = e.saturating_add(*d);
        }
        if seconds.is_empty() && running.is_empty() {
            return true;
        }
        let seconds: Vec<Second<'_>> = seconds.into_iter().map(|((t, b, s), (dt, dr))| Second { t, b: i32::from(b), s, dt, dr }).collect();
        let running: Vec<Running<'_>> = running.into_iter().map(|((t, b), d)| Running { t, b: i32::from(b), d }).collect();
        let (Ok(seconds), Ok(running)) = (serde_json::to_string(&seconds), serde_json::to_string(&running)) else { return false };
        sqlx::query(
            "WITH sec AS (UPDATE limit_seconds s SET tokens = GREATEST(s.tokens + x.dt, 0), requests = GREATEST(s.requests - x.dr, 0) \
                 FROM json_to_recordset($1::json) AS x(t TEXT, b INTEGER, s BIGINT, dt BIGINT, dr BIGINT) \
                 WHERE s.tenant_id = x.t AND s.batch = x.b AND s.second = x.s RETURNING 1), \
             run AS (UPDATE limit_running r SET running = GREATEST(r.running - x.d, 0) \
                 FROM json_to_recordset($2::json) AS x(t TEXT, b INTEGER, d BIGINT) \
                 WHERE r.tenant_id = x.t AND r.batch = x.b AND r.replica = $3 RETURNING 1) \
             SELECT (SELECT COUNT(*) FROM sec) + (SELECT COUNT(*) FROM run)",
        )
        .bind(seconds)
        .bind(running)
        .bind(replica)
        .execute(&self.pool)
        .await
        .is_ok()
    }
}

/// What [`Store::limit_apply`] writes: rows of (tenant, batch class, second, amount), one per
/// row of the tables (`running` ignores the second).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LimitChanges {
    /// Tokens to add (negative: used less than reserved, or a lease's unused tokens).
    pub tokens: Vec<(String, bool, i64, i64)>,
    /// Admissions to take back (leased, never handed out).
    pub requests: Vec<(String, bool, i64, i64)>,
    /// Concurrency slots to let go.
    pub running: Vec<(String, bool, i64, i64)>,
}
