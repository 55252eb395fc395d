//! The Batch API's durable state: files (uploaded inputs and the outputs batches write), batches
//! and their status, and the result of each finished line of a running batch.
//!
//! A batch's progress is its `batch_results` rows: a line is done once its row is written, so a
//! server that restarts runs only the lines without one. When the batch ends, its rows become
//! its output and error files and are deleted, in the transaction that records the end.

use serde::Serialize;

use super::{Store, StoreError, now_ms};

/// The statuses of a batch (OpenAI's).
pub mod batch_status {
    pub const VALIDATING: &str = "validating";
    pub const IN_PROGRESS: &str = "in_progress";
    pub const FINALIZING: &str = "finalizing";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const EXPIRED: &str = "expired";
    pub const CANCELLING: &str = "cancelling";
    pub const CANCELLED: &str = "cancelled";

    /// A batch in one of these has work left, or its files to write.
    pub const ACTIVE: [&str; 4] = [VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING];

    /// The column that records when a batch entered `status`.
    pub(crate) fn column(status: &str) -> Option<&'static str> {
        Some(match status {
            IN_PROGRESS => "in_progress_at",
            FINALIZING => "finalizing_at",
            COMPLETED => "completed_at",
            FAILED => "failed_at",
            EXPIRED => "expired_at",
            CANCELLING => "cancelling_at",
            CANCELLED => "cancelled_at",
            _ => return None,
        })
    }
}

/// The purposes of a file.
pub mod file_purpose {
    /// Uploaded by a tenant: the input of batches.
    pub const BATCH: &str = "batch";
    /// Written by a batch: its output or its errors.
    pub const BATCH_OUTPUT: &str = "batch_output";
}

/// A file's metadata.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct FileRecord {
    pub id: String,
    pub tenant_id: String,
    pub purpose: String,
    pub filename: String,
    pub bytes: i64,
    pub lines: i64,
    /// Relative to the data directory.
    pub path: String,
    pub created_at: i64,
}

/// A batch.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct BatchRecord {
    pub id: String,
    pub tenant_id: String,
    pub key_id: String,
    pub endpoint: String,
    pub input_file_id: String,
    pub completion_window: String,
    pub status: String,
    pub instance: String,
    /// A JSON object.
    pub metadata: String,
    pub total: i64,
    /// Final counts, once the batch has ended (see [`Store::batch_counts`] while it runs).
    pub completed: i64,
    pub failed: i64,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    /// A JSON list of batch-level errors.
    pub errors: Option<String>,
    pub created_at: i64,
    pub expires_at: i64,
    pub in_progress_at: Option<i64>,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub failed_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
}

impl BatchRecord {
    pub fn is_active(&self) -> bool {
        batch_status::ACTIVE.contains(&self.status.as_str())
    }
}

/// A finished line of a running batch.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct BatchResult {
    pub batch_id: String,
    /// Its line in the input file, from 0.
    pub line: i64,
    /// 1 if it succeeded, 0 if it failed.
    pub ok: i64,
    /// Its line of the output or error file.
    pub body: String,
    /// The usage row that bills it; empty if it failed before it was admitted.
    pub usage_id: String,
}

/// Tokens a batch's lines used, from the ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct BatchUsage {
    pub prompt_tokens: i64,
    pub cached_prompt_tokens: i64,
    pub completion_tokens: i64,
}

const FILE_COLUMNS: &str = "id, tenant_id, purpose, filename, bytes, lines, path, created_at";

const BATCH_COLUMNS: &str = "id, tenant_id, key_id, endpoint, input_file_id, completion_window, status, instance, metadata, total, completed, failed, \
     output_file_id, error_file_id, errors, created_at, expires_at, in_progress_at, finalizing_at, completed_at, failed_at, expired_at, \
     cancelling_at, cancelled_at";

/// `status IN (...)` for the active statuses (constants only: no input reaches the SQL).
fn active_in() -> String {
    let list: Vec<String> = batch_status::ACTIVE.iter().map(|s| format!("'{s}'")).collect();
    format!("status IN ({})", list.join(", "))
}

/// A page of a listing: the newest first (or oldest first), after the row `after`.
#[derive(Debug, Clone, Default)]
pub struct Page<'a> {
    pub after: Option<&'a str>,
    pub limit: i64,
    pub ascending: bool,
}

impl Page<'_> {
    /// The condition that keeps the rows after the cursor (bound as `$cursor`, empty for the
    /// first page) in the order of `(created_at, id)`, and that order.
    fn sql(&self, table: &str, cursor: usize) -> (String, &'static str) {
        let (cmp, order) = if self.ascending { (">", "ORDER BY created_at ASC, id ASC") } else { ("<", "ORDER BY created_at DESC, id DESC") };
        let at = format!("(SELECT created_at FROM {table} WHERE id = ${cursor})");
        let condition = format!("(${cursor} = '' OR created_at {cmp} {at} OR (created_at = {at} AND id {cmp} ${cursor}))");
        (condition, order)
    }
}

impl Store {
    // -----------------------------------------------------------------------------------------
    // Files

    /// Records a file, unless the tenant's live files would then hold more than `quota` bytes
    /// (checked in the same transaction).
    pub async fn insert_file(&self, file: &FileRecord, quota: Option<i64>) -> Result<(), StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            self.lock_owner(&mut tx, &format!("files:{}", file.tenant_id)).await?;
            if let Some(max) = quota {
                let used = Self::storage_used(&mut tx, &file.tenant_id).await?;
                if used.saturating_add(file.bytes) > max {
                    return Err(StoreError::Quota(format!(
                        "file storage limit: {used} bytes in files and the output of running batches, this one is {}, the limit is {max}; delete files first",
                        file.bytes
                    )));
                }
            }
            sqlx::query("INSERT INTO files (id, tenant_id, purpose, filename, bytes, lines, path, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")
                .bind(&file.id)
                .bind(&file.tenant_id)
                .bind(&file.purpose)
                .bind(&file.filename)
                .bind(file.bytes)
                .bind(file.lines)
                .bind(&file.path)
                .bind(file.created_at)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// The bytes a tenant holds: its live files, and the output its running batches have
    /// recorded so far (their output files to be).
    async fn storage_used(tx: &mut sqlx::Transaction<'static, sqlx::Any>, tenant: &str) -> Result<i64, sqlx::Error> {
        let (files,): (Option<i64>,) = sqlx::query_as("SELECT CAST(SUM(bytes) AS BIGINT) FROM files WHERE tenant_id = $1 AND deleted_at IS NULL")
            .bind(tenant)
            .fetch_one(&mut **tx)
            .await?;
        let sql = format!("SELECT CAST(SUM(output_bytes) AS BIGINT) FROM batches WHERE tenant_id = $1 AND {}", active_in());
        let (running,): (Option<i64>,) = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(tenant).fetch_one(&mut **tx).await?;
        Ok(files.unwrap_or(0).saturating_add(running.unwrap_or(0)))
    }

    /// The bytes of file storage a tenant uses (see `storage_used`).
    pub async fn file_storage_used(&self, tenant: &str) -> Result<i64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let used = Self::storage_used(&mut tx, tenant).await?;
        tx.commit().await?;
        Ok(used)
    }

    /// A live file of `tenant`.
    pub async fn file(&self, tenant: &str, id: &str) -> Result<Option<FileRecord>, StoreError> {
        let sql = format!("SELECT {FILE_COLUMNS} FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).bind(tenant).fetch_optional(&self.pool).await?)
    }

    /// A page of `tenant`'s live files, of one purpose or all.
    pub async fn files(&self, tenant: &str, purpose: Option<&str>, page: &Page<'_>) -> Result<Vec<FileRecord>, StoreError> {
        let (cursor, order) = page.sql("files", 3);
        let sql =
            format!("SELECT {FILE_COLUMNS} FROM files WHERE tenant_id = $1 AND deleted_at IS NULL AND ($2 = '' OR purpose = $2) AND {cursor} {order} LIMIT $4");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(tenant)
            .bind(purpose.unwrap_or(""))
            .bind(page.after.unwrap_or(""))
            .bind(page.limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Deletes a live file of `tenant`; its record as it was, for removing its bytes. A file an
    /// active batch reads is a conflict.
    pub async fn delete_file(&self, tenant: &str, id: &str) -> Result<Option<FileRecord>, StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            let sql = format!("SELECT {FILE_COLUMNS} FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL");
            let Some(file): Option<FileRecord> = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).bind(tenant).fetch_optional(&mut *tx).await? else {
                return Ok(None);
            };
            let sql = format!("SELECT id FROM batches WHERE input_file_id = $1 AND {} LIMIT 1", active_in());
            let user: Option<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).fetch_optional(&mut *tx).await?;
            if let Some((batch,)) = user {
                return Err(StoreError::InUse(format!("batch {batch} reads the file; cancel it or wait for it to end first")));
            }
            sqlx::query("UPDATE files SET deleted_at = $1 WHERE id = $2").bind(now_ms()).bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(Some(file))
        })
        .await
    }

    /// The paths of every file record, live or deleted (for sweeping the data directory).
    pub async fn file_paths(&self) -> Result<Vec<(String, bool)>, StoreError> {
        let rows: Vec<(String, Option<i64>)> = sqlx::query_as("SELECT path, deleted_at FROM files").fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(p, d)| (p, d.is_none())).collect())
    }

    // -----------------------------------------------------------------------------------------
    // Batches

    /// Records a new batch, unless its tenant has `max_active` batches with work left already.
    pub async fn insert_batch(&self, batch: &BatchRecord, max_active: Option<i64>) -> Result<(), StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            self.lock_owner(&mut tx, &format!("batches:{}", batch.tenant_id)).await?;
            if let Some(max) = max_active {
                let sql = format!("SELECT COUNT(*) FROM batches WHERE tenant_id = $1 AND {}", active_in());
                let (active,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(&batch.tenant_id).fetch_one(&mut *tx).await?;
                if active >= max {
                    return Err(StoreError::Quota(format!("{active} batches are running, the limit is {max}; wait for one to end or cancel one")));
                }
            }
            let sql = format!(
                "INSERT INTO batches ({BATCH_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, \
                 $19, $20, $21, $22, $23, $24)"
            );
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&batch.id)
                .bind(&batch.tenant_id)
                .bind(&batch.key_id)
                .bind(&batch.endpoint)
                .bind(&batch.input_file_id)
                .bind(&batch.completion_window)
                .bind(&batch.status)
                .bind(&batch.instance)
                .bind(&batch.metadata)
                .bind(batch.total)
                .bind(batch.completed)
                .bind(batch.failed)
                .bind(&batch.output_file_id)
                .bind(&batch.error_file_id)
                .bind(&batch.errors)
                .bind(batch.created_at)
                .bind(batch.expires_at)
                .bind(batch.in_progress_at)
                .bind(batch.finalizing_at)
                .bind(batch.completed_at)
                .bind(batch.failed_at)
                .bind(batch.expired_at)
                .bind(batch.cancelling_at)
                .bind(batch.cancelled_at)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    /// A batch of `tenant`.
    pub async fn batch(&self, tenant: &str, id: &str) -> Result<Option<BatchRecord>, StoreError> {
        let sql = format!("SELECT {BATCH_COLUMNS} FROM batches WHERE id = $1 AND tenant_id = $2");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).bind(tenant).fetch_optional(&self.pool).await?)
    }

    /// A batch, whoever's it is (for its runner).
    pub async fn batch_by_id(&self, id: &str) -> Result<Option<BatchRecord>, StoreError> {
        let sql = format!("SELECT {BATCH_COLUMNS} FROM batches WHERE id = $1");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(id).fetch_optional(&self.pool).await?)
    }

    /// A page of `tenant`'s batches.
    pub async fn batches(&self, tenant: &str, page: &Page<'_>) -> Result<Vec<BatchRecord>, StoreError> {
        let (cursor, order) = page.sql("batches", 2);
        let sql = format!("SELECT {BATCH_COLUMNS} FROM batches WHERE tenant_id = $1 AND {cursor} {order} LIMIT $3");
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(tenant).bind(page.after.unwrap_or("")).bind(page.limit).fetch_all(&self.pool).await?)
    }

    /// The batches `instance` runs that were told to cancel (through any replica).
    pub async fn batches_cancelling(&self, instance: &str) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as("SELECT id FROM batches WHERE instance = $1 AND status = $2")
            .bind(instance)
            .bind(batch_status::CANCELLING)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// Makes `instance` the runner of every batch with work left whose runner has not been seen
    /// (in `replicas`) since `seen_after_ms`: a replica that died or was replaced leaves its
    /// batches to the others. Returns their ids.
    pub async fn adopt_batches(&self, instance: &str, seen_after_ms: i64) -> Result<Vec<String>, StoreError> {
        let sql = format!(
            "UPDATE batches SET instance = $1 WHERE {} AND instance <> $1 AND instance NOT IN (SELECT id FROM replicas WHERE seen_ms > $2) RETURNING id",
            active_in()
        );
        let rows: Vec<(String,)> = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(instance).bind(seen_after_ms).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// Which of the batches `ids` another replica than `instance` runs now (one took them over).
    pub async fn batches_run_elsewhere(&self, ids: &[String], instance: &str) -> Result<Vec<String>, StoreError> {
        let mut out = Vec::new();
        for chunk in ids.chunks(256) {
            let marks: Vec<String> = (2..chunk.len() + 2).map(|i| format!("${i}")).collect();
            // Only numbered placeholders are formatted in; the ids are bound.
            let sql = sqlx::AssertSqlSafe(format!("SELECT id FROM batches WHERE instance <> $1 AND id IN ({})", marks.join(", ")));
            let mut q = sqlx::query_as::<_, (String,)>(sql).bind(instance);
            for id in chunk {
                q = q.bind(id);
            }
            out.extend(q.fetch_all(&self.pool).await?.into_iter().map(|(id,)| id));
        }
        Ok(out)
    }

    /// The batches `instance` runs that have work left, oldest first.
    pub async fn active_batches(&self, instance: &str) -> Result<Vec<BatchRecord>, StoreError> {
        let sql = format!("SELECT {BATCH_COLUMNS} FROM batches WHERE instance = $1 AND {} ORDER BY created_at, id", active_in());
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(instance).fetch_all(&self.pool).await?)
    }

    /// Moves a batch from one of `from` to `to`, recording when; false if it was in none of them.
    pub async fn set_batch_status(&self, id: &str, from: &[&str], to: &str) -> Result<bool, StoreError> {
        let column = batch_status::column(to).ok_or_else(|| StoreError::Invalid { field: "status", why: format!("{to:?} is not a status to move to") })?;
        let known: Vec<&str> = from.iter().copied().filter(|s| batch_status::ACTIVE.contains(s) || batch_status::column(s).is_some()).collect();
        if known.is_empty() {
            return Ok(false);
        }
        let list: Vec<String> = known.iter().map(|s| format!("'{s}'")).collect();
        let sql = format!("UPDATE batches SET status = $1, {column} = $2 WHERE id = $3 AND status IN ({})", list.join(", "));
        let done = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(to).bind(now_ms()).bind(id).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records why a batch with work left fails as a whole (OpenAI's error list, JSON); its
    /// end is recorded by [`Store::finish_batch`], or [`Store::fail_batch`].
    pub async fn set_batch_errors(&self, id: &str, errors: &str) -> Result<bool, StoreError> {
        let sql = format!("UPDATE batches SET errors = $1 WHERE id = $2 AND {}", active_in());
        let done = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(errors).bind(id).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records that a batch with work left failed, without files (they could not be written).
    pub async fn fail_batch(&self, id: &str) -> Result<bool, StoreError> {
        let sql = format!("UPDATE batches SET status = $1, failed_at = $2 WHERE id = $3 AND {}", active_in());
        let done = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(batch_status::FAILED).bind(now_ms()).bind(id).execute(&self.pool).await?;
        Ok(done.rows_affected() > 0)
    }

    /// Records a finished line (the first result of a line stays), and its bytes as output of
    /// the batch, which belongs to `tenant`: whether the tenant's files and running batches'
    /// output now hold more than `quota` bytes.
    pub async fn insert_batch_result(&self, r: &BatchResult, tenant: &str, quota: Option<i64>) -> Result<bool, StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            self.lock_owner(&mut tx, &format!("files:{tenant}")).await?;
            let added = sqlx::query(
                "INSERT INTO batch_results (batch_id, line, ok, body, usage_id) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (batch_id, line) DO NOTHING",
            )
            .bind(&r.batch_id)
            .bind(r.line)
            .bind(r.ok)
            .bind(&r.body)
            .bind(&r.usage_id)
            .execute(&mut *tx)
            .await?;
            if added.rows_affected() > 0 {
                // As the output file will hold it: the line and its newline.
                let bytes = i64::try_from(r.body.len()).unwrap_or(i64::MAX).saturating_add(1);
                sqlx::query("UPDATE batches SET output_bytes = output_bytes + $1 WHERE id = $2").bind(bytes).bind(&r.batch_id).execute(&mut *tx).await?;
            }
            let over = match quota {
                Some(max) => Self::storage_used(&mut tx, tenant).await? > max,
                None => false,
            };
            tx.commit().await?;
            Ok(over)
        })
        .await
    }

    /// Counts a start of line `line` of batch `id`: how many times it has been started, this
    /// one included. Durable before the line runs, so that starts whose server died count.
    pub async fn start_batch_line(&self, id: &str, line: i64) -> Result<i64, StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            sqlx::query(
                "INSERT INTO batch_tries (batch_id, line, tries) VALUES ($1, $2, 1) ON CONFLICT (batch_id, line) DO UPDATE SET tries = batch_tries.tries + 1",
            )
            .bind(id)
            .bind(line)
            .execute(&mut *tx)
            .await?;
            let (tries,): (i64,) =
                sqlx::query_as("SELECT tries FROM batch_tries WHERE batch_id = $1 AND line = $2").bind(id).bind(line).fetch_one(&mut *tx).await?;
            tx.commit().await?;
            Ok(tries)
        })
        .await
    }

    /// The lines of batch `id` that have been started, with how many times.
    pub async fn batch_tries(&self, id: &str) -> Result<Vec<(i64, i64)>, StoreError> {
        Ok(sqlx::query_as("SELECT line, tries FROM batch_tries WHERE batch_id = $1").bind(id).fetch_all(&self.pool).await?)
    }

    /// The lines of a running batch that are done.
    pub async fn batch_done_lines(&self, id: &str) -> Result<Vec<i64>, StoreError> {
        let rows: Vec<(i64,)> = sqlx::query_as("SELECT line FROM batch_results WHERE batch_id = $1").bind(id).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(l,)| l).collect())
    }

    /// (succeeded, failed) lines of a running batch so far.
    pub async fn batch_counts(&self, id: &str) -> Result<(i64, i64), StoreError> {
        let (ok, all): (Option<i64>, i64) =
            sqlx::query_as("SELECT CAST(SUM(ok) AS BIGINT), COUNT(*) FROM batch_results WHERE batch_id = $1").bind(id).fetch_one(&self.pool).await?;
        let ok = ok.unwrap_or(0);
        Ok((ok, all - ok))
    }

    /// Up to `limit` results of a batch after line `after`, in line order.
    pub async fn batch_results(&self, id: &str, after: i64, limit: i64) -> Result<Vec<BatchResult>, StoreError> {
        Ok(sqlx::query_as("SELECT batch_id, line, ok, body, usage_id FROM batch_results WHERE batch_id = $1 AND line > $2 ORDER BY line LIMIT $3")
            .bind(id)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Records the end of a batch in one transaction: its output and error files, its status
    /// (from an active one; false if it had none any more), its counts; the usage rows no result
    /// records are voided ([`Self::void_unrecorded`]) and the results deleted.
    pub async fn finish_batch(
        &self,
        id: &str,
        status: &str,
        output: Option<&FileRecord>,
        errors: Option<&FileRecord>,
        counts: (i64, i64),
    ) -> Result<bool, StoreError> {
        let column = batch_status::column(status).ok_or_else(|| StoreError::Invalid { field: "status", why: format!("{status:?} does not end a batch") })?;
        let files: Vec<&FileRecord> = output.into_iter().chain(errors).collect();
        let (output, errors) = (output.map(|f| f.id.clone()), errors.map(|f| f.id.clone()));
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            let sql = format!(
                "UPDATE batches SET status = $1, {column} = $2, output_file_id = $3, error_file_id = $4, completed = $5, failed = $6 \
                 WHERE id = $7 AND {}",
                active_in()
            );
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(status)
                .bind(now_ms())
                .bind(&output)
                .bind(&errors)
                .bind(counts.0)
                .bind(counts.1)
                .bind(id)
                .execute(&mut *tx)
                .await?;
            if done.rows_affected() == 0 {
                return Ok(false);
            }
            Self::void_unrecorded(&mut tx, id, status == batch_status::CANCELLED).await?;
            for f in &files {
                sqlx::query(
                    "INSERT INTO files (id, tenant_id, purpose, filename, bytes, lines, path, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                     ON CONFLICT (id) DO NOTHING",
                )
                .bind(&f.id)
                .bind(&f.tenant_id)
                .bind(&f.purpose)
                .bind(&f.filename)
                .bind(f.bytes)
                .bind(f.lines)
                .bind(&f.path)
                .bind(f.created_at)
                .execute(&mut *tx)
                .await?;
            }
            sqlx::query("DELETE FROM batch_results WHERE batch_id = $1").bind(id).execute(&mut *tx).await?;
            sqlx::query("DELETE FROM batch_tries WHERE batch_id = $1").bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            Ok(true)
        })
        .await
    }

    /// Takes the charge off the usage rows of a batch that no result records, in `tx`: a
    /// batch bills the lines in its output and error files, once each. Rows without a result
    /// are lines cancelled while they ran, tries of a line that were refused for capacity and
    /// tried again, and lines whose server stopped between the usage row and the result (they
    /// run again). They become `interrupted` (a cancelled one stays `cancelled`), without
    /// charge; at the end of a cancelled batch (`cancelled`), a line still ending, or that
    /// finished as the cancel came before its result was recorded, is `cancelled` too: it was
    /// never delivered (and its request's own end, written later, keeps that).
    async fn void_unrecorded(tx: &mut sqlx::Transaction<'static, sqlx::Any>, id: &str, cancelled: bool) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE usage SET outcome = CASE WHEN outcome = $1 OR ($4 = 1 AND outcome IN ($5, $6)) THEN $1 ELSE $2 END, \
             prompt_price = 0, cached_prompt_price = 0, completion_price = 0 \
             WHERE batch_id = $3 AND id NOT IN (SELECT usage_id FROM batch_results WHERE batch_id = $3)",
        )
        .bind(super::outcome::CANCELLED)
        .bind(super::outcome::INTERRUPTED)
        .bind(id)
        .bind(i32::from(cancelled))
        .bind(super::outcome::OK)
        .bind(super::outcome::RUNNING)
        .execute(&mut **tx)
        .await?;
        Ok(done.rows_affected())
    }

    /// [`Self::void_unrecorded`] on its own, when a batch resumes.
    pub async fn void_unrecorded_batch_usage(&self, id: &str) -> Result<u64, StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            let n = Self::void_unrecorded(&mut tx, id, false).await?;
            tx.commit().await?;
            Ok(n)
        })
        .await
    }

    /// Tokens of a batch's lines that the ledger bills: those that ended, as answers or errors
    /// (lines cancelled while they ran, and lines run again after a restart, are not billed).
    pub async fn batch_usage(&self, id: &str) -> Result<BatchUsage, StoreError> {
        let (p, c, o): (Option<i64>, Option<i64>, Option<i64>) = sqlx::query_as(
            "SELECT CAST(SUM(prompt_tokens) AS BIGINT), CAST(SUM(cached_prompt_tokens) AS BIGINT), CAST(SUM(completion_tokens) AS BIGINT) \
             FROM usage WHERE batch_id = $1 AND outcome IN ($2, $3)",
        )
        .bind(id)
        .bind(super::outcome::OK)
        .bind(super::outcome::ERROR)
        .fetch_one(&self.pool)
        .await?;
        Ok(BatchUsage { prompt_tokens: p.unwrap_or(0), cached_prompt_tokens: c.unwrap_or(0), completion_tokens: o.unwrap_or(0) })
    }
}
