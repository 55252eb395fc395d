//! Tenant limits shared by the replicas of one PostgreSQL database: the rows behind
//! `api::limits` when it runs in its shared mode.
//!
//! Every decision is one transaction holding the tenant's advisory lock, so two replicas never
//! both take the last slot; time is the database's clock, so replicas whose clocks differ still
//! agree on what the last minute is.

use super::{DbKind, Store, StoreError};

/// A replica not seen for this long is gone: its requests' concurrency slots no longer count.
pub const REPLICA_TIMEOUT_MS: i64 = 15_000;

/// The requests-per-minute window.
pub const WINDOW_MS: i64 = 60_000;

/// What a tenant's rows say, as of `now_ms`, for one admission.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LimitView {
    pub now_ms: i64,
    /// Requests of the last minute, and the oldest one's time.
    pub requests: i64,
    pub oldest_ms: Option<i64>,
    /// Requests holding a concurrency slot on a live replica.
    pub running: i64,
    /// The same for batch work alone.
    pub batch_requests: i64,
    pub batch_oldest_ms: Option<i64>,
    pub batch_running: i64,
    /// The burst bucket of the class asked for: (requests held, as of when).
    pub bucket: Option<(f64, i64)>,
}

/// A transaction on one tenant's limit rows; dropped without [`LimitTx::commit`], it changes
/// nothing.
pub struct LimitTx {
    tx: sqlx::Transaction<'static, sqlx::Any>,
    tenant: String,
    pub now_ms: i64,
}

impl Store {
    /// Opens a transaction on `tenant`'s limit rows, holding its lock until the end.
    pub async fn limit_tx(&self, tenant: &str) -> Result<LimitTx, StoreError> {
        if self.kind != DbKind::Postgres {
            return Err(StoreError::Unavailable("shared limits need PostgreSQL".into()));
        }
        let mut tx = self.pool.begin().await?;
        let (now_ms,): (i64,) = sqlx::query_as(
            "SELECT CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT) FROM (SELECT pg_advisory_xact_lock(hashtext($1))) AS locked",
        )
        .bind(format!("limits:{tenant}"))
        .fetch_one(&mut *tx)
        .await?;
        Ok(LimitTx { tx, tenant: tenant.to_string(), now_ms })
    }

    /// Marks this replica alive, and deletes rows nothing counts any more: requests older than
    /// the window that hold no slot (or whose replica is gone), and replicas gone for an hour.
    pub async fn limit_heartbeat(&self, replica: &str) -> Result<(), StoreError> {
        let (now,): (i64,) = sqlx::query_as("SELECT CAST(FLOOR(EXTRACT(EPOCH FROM clock_timestamp()) * 1000) AS BIGINT)").fetch_one(&self.pool).await?;
        sqlx::query("INSERT INTO replicas (id, seen_ms) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET seen_ms = excluded.seen_ms")
            .bind(replica)
            .bind(now)
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM limit_events WHERE at_ms < $1 AND (running = 0 OR replica NOT IN (SELECT id FROM replicas WHERE seen_ms > $2))")
            .bind(now - 2 * WINDOW_MS)
            .bind(now - REPLICA_TIMEOUT_MS)
            .execute(&self.pool)
            .await?;
        sqlx::query("DELETE FROM replicas WHERE seen_ms < $1").bind(now - 3_600_000).execute(&self.pool).await?;
        Ok(())
    }

    /// Lets go every slot `replica` holds: its previous run ended without releasing them.
    pub async fn limit_restart(&self, replica: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE limit_events SET running = 0 WHERE replica = $1 AND running = 1").bind(replica).execute(&self.pool).await?;
        Ok(())
    }

    /// Lets the concurrency slots of these requests go.
    pub async fn limit_release(&self, ids: &[String]) -> Result<(), StoreError> {
        for chunk in ids.chunks(256) {
            let marks: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            // Only numbered placeholders are formatted in; the ids are bound.
            let sql = sqlx::AssertSqlSafe(format!("UPDATE limit_events SET running = 0 WHERE id IN ({})", marks.join(", ")));
            let mut q = sqlx::query(sql);
            for id in chunk {
                q = q.bind(id);
            }
            q.execute(&self.pool).await?;
        }
        Ok(())
    }

    /// Replaces a request's reserved tokens with what it used.
    pub async fn limit_settle(&self, id: &str, tokens: i64) -> Result<(), StoreError> {
        sqlx::query("UPDATE limit_events SET tokens = $1 WHERE id = $2").bind(tokens).bind(id).execute(&self.pool).await?;
        Ok(())
    }
}

impl LimitTx {
    /// The tenant's counts, and the bucket of the batch class or not.
    pub async fn view(&mut self, batch: bool) -> Result<LimitView, StoreError> {
        let since = self.now_ms - WINDOW_MS;
        let alive = self.now_ms - REPLICA_TIMEOUT_MS;
        let (requests, oldest_ms, running, batch_requests, batch_oldest_ms, batch_running): (i64, Option<i64>, i64, i64, Option<i64>, i64) = sqlx::query_as(
            "SELECT COUNT(*) FILTER (WHERE e.at_ms > $2), MIN(e.at_ms) FILTER (WHERE e.at_ms > $2), \
                    COUNT(*) FILTER (WHERE e.running = 1 AND r.seen_ms > $3), \
                    COUNT(*) FILTER (WHERE e.batch = 1 AND e.at_ms > $2), MIN(e.at_ms) FILTER (WHERE e.batch = 1 AND e.at_ms > $2), \
                    COUNT(*) FILTER (WHERE e.batch = 1 AND e.running = 1 AND r.seen_ms > $3) \
             FROM limit_events e LEFT JOIN replicas r ON r.id = e.replica \
             WHERE e.tenant_id = $1 AND (e.at_ms > $2 OR e.running = 1)",
        )
        .bind(&self.tenant)
        .bind(since)
        .bind(alive)
        .fetch_one(&mut *self.tx)
        .await?;
        let bucket: Option<(i64, i64)> = sqlx::query_as("SELECT held_milli, at_ms FROM limit_buckets WHERE tenant_id = $1 AND batch = $2")
            .bind(&self.tenant)
            .bind(batch as i64)
            .fetch_optional(&mut *self.tx)
            .await?;
        Ok(LimitView {
            now_ms: self.now_ms,
            requests,
            oldest_ms,
            running,
            batch_requests,
            batch_oldest_ms,
            batch_running,
            bucket: bucket.map(|(milli, at)| (milli as f64 / 1000.0, at)),
        })
    }

    /// Records an admitted request (holding a concurrency slot) and the bucket after it.
    pub async fn admit(&mut self, id: &str, batch: bool, replica: &str, bucket: Option<f64>) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO limit_events (id, tenant_id, batch, at_ms, tokens, replica, running) VALUES ($1, $2, $3, $4, 0, $5, 1)")
            .bind(id)
            .bind(&self.tenant)
            .bind(batch as i64)
            .bind(self.now_ms)
            .bind(replica)
            .execute(&mut *self.tx)
            .await?;
        if let Some(held) = bucket {
            sqlx::query(
                "INSERT INTO limit_buckets (tenant_id, batch, held_milli, at_ms) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (tenant_id, batch) DO UPDATE SET held_milli = excluded.held_milli, at_ms = excluded.at_ms",
            )
            .bind(&self.tenant)
            .bind(batch as i64)
            .bind((held * 1000.0).floor() as i64)
            .bind(self.now_ms)
            .execute(&mut *self.tx)
            .await?;
        }
        Ok(())
    }

    /// Tokens the tenant's requests of the last minute hold: all of them, and batch work's.
    pub async fn token_sums(&mut self) -> Result<(u64, u64), StoreError> {
        let (all, batch): (Option<i64>, Option<i64>) = sqlx::query_as(
            "SELECT CAST(SUM(tokens) AS BIGINT), CAST(SUM(CASE WHEN batch = 1 THEN tokens ELSE 0 END) AS BIGINT) \
             FROM limit_events WHERE tenant_id = $1 AND at_ms > $2",
        )
        .bind(&self.tenant)
        .bind(self.now_ms - WINDOW_MS)
        .fetch_one(&mut *self.tx)
        .await?;
        Ok((all.unwrap_or(0).max(0) as u64, batch.unwrap_or(0).max(0) as u64))
    }

    /// The (time, tokens) of the last minute's requests (batch work's alone with `batch`),
    /// oldest first: when a refused reservation would fit.
    pub async fn token_rows(&mut self, batch: bool) -> Result<Vec<(i64, u64)>, StoreError> {
        let rows: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT at_ms, tokens FROM limit_events WHERE tenant_id = $1 AND at_ms > $2 AND tokens > 0 AND (batch = 1 OR $3 = 0) ORDER BY at_ms",
        )
        .bind(&self.tenant)
        .bind(self.now_ms - WINDOW_MS)
        .bind(batch as i64)
        .fetch_all(&mut *self.tx)
        .await?;
        Ok(rows.into_iter().map(|(at, n)| (at, n.max(0) as u64)).collect())
    }

    /// Sets a request's reserved tokens.
    pub async fn reserve(&mut self, id: &str, tokens: u64) -> Result<(), StoreError> {
        sqlx::query("UPDATE limit_events SET tokens = $1 WHERE id = $2")
            .bind(i64::try_from(tokens).unwrap_or(i64::MAX))
            .bind(id)
            .execute(&mut *self.tx)
            .await?;
        Ok(())
    }

    pub async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await?;
        Ok(())
    }
}
