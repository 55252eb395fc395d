//! Adapters' metadata: versions recorded under the owner's quota, lookups as a tenant sees
//! them (its own, else published ones), deletion, publishing, and the operator's full list.

use super::{AdapterRecord, NewAdapter, Store, StoreError, TenantLimits, now_ms, random_id, validate_adapter_name};

impl Store {
    /// Records a new version of `owner`'s adapter `name` (version 1 for a new name; versions
    /// are never reused, so they stay contiguous). The owner's quota is checked and consumed in
    /// the same transaction: `quota.max_adapters` live names (a new version of a live name does
    /// not count again) and `quota.max_adapter_bytes` over every live version.
    pub async fn insert_adapter(&self, new: &NewAdapter, quota: &TenantLimits) -> Result<AdapterRecord, StoreError> {
        validate_adapter_name(&new.name)?;
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            self.lock_owner(&mut tx, &new.owner).await?;
            let (names, used, has_name): (i64, Option<i64>, Option<i64>) = sqlx::query_as(
                "SELECT COUNT(DISTINCT name), CAST(SUM(bytes) AS BIGINT), CAST(SUM(CASE WHEN name = $2 THEN 1 ELSE 0 END) AS BIGINT) \
                 FROM adapters WHERE owner = $1 AND deleted_at IS NULL",
            )
            .bind(&new.owner)
            .bind(&new.name)
            .fetch_one(&mut *tx)
            .await?;
            let used = used.unwrap_or(0);
            if let Some(max) = quota.max_adapters
                && has_name.unwrap_or(0) == 0
                && names >= max
            {
                return Err(StoreError::Quota(format!("adapter limit reached: {names} of {max}; delete one first")));
            }
            if let Some(max) = quota.max_adapter_bytes
                && used.saturating_add(new.bytes) > max
            {
                return Err(StoreError::Quota(format!(
                    "adapter storage limit: {used} bytes used, this upload is {}, the limit is {max}; delete an adapter first",
                    new.bytes
                )));
            }
            // A new version of a published adapter stays published.
            let (latest, public): (Option<i64>, Option<i64>) =
                sqlx::query_as("SELECT MAX(version), MAX(CASE WHEN deleted_at IS NULL THEN public ELSE 0 END) FROM adapters WHERE owner = $1 AND name = $2")
                    .bind(&new.owner)
                    .bind(&new.name)
                    .fetch_one(&mut *tx)
                    .await?;
            let record = AdapterRecord {
                id: random_id("ada"),
                owner: new.owner.clone(),
                name: new.name.clone(),
                version: latest.unwrap_or(0) + 1,
                public: public.unwrap_or(0),
                rank: new.rank,
                targets: new.targets.clone(),
                bytes: new.bytes,
                content_hash: new.content_hash.clone(),
                blob: new.blob.clone(),
                created_at: now_ms(),
                base_model: Some(new.base_model.clone()),
                base_shape: Some(new.base_shape.clone()),
            };
            sqlx::query(
                "INSERT INTO adapters (id, owner, name, version, rank, targets, bytes, content_hash, blob, created_at, public, base_model, base_shape) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            )
            .bind(&record.id)
            .bind(&record.owner)
            .bind(&record.name)
            .bind(record.version)
            .bind(record.rank)
            .bind(&record.targets)
            .bind(record.bytes)
            .bind(&record.content_hash)
            .bind(&record.blob)
            .bind(record.created_at)
            .bind(record.public)
            .bind(&record.base_model)
            .bind(&record.base_shape)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok(record)
        })
        .await
    }

    /// The latest live version of `owner`'s adapter `name`.
    pub async fn adapter(&self, owner: &str, name: &str) -> Result<Option<AdapterRecord>, StoreError> {
        let sql = concat!("SELECT ", adapter_columns!(), " FROM adapters WHERE owner = $1 AND name = $2 AND deleted_at IS NULL ORDER BY version DESC LIMIT 1");
        Ok(sqlx::query_as(sql).bind(owner).bind(name).fetch_optional(&self.pool).await?)
    }

    /// The adapter `name` as `tenant` sees it: its own, else a published one. Another tenant's
    /// private adapter is never returned (it reads as unknown).
    pub async fn visible_adapter(&self, tenant: &str, name: &str) -> Result<Option<AdapterRecord>, StoreError> {
        if let Some(own) = self.adapter(tenant, name).await? {
            return Ok(Some(own));
        }
        let sql = concat!("SELECT ", adapter_columns!(), " FROM adapters WHERE name = $1 AND public = 1 AND deleted_at IS NULL ORDER BY version DESC LIMIT 1");
        Ok(sqlx::query_as(sql).bind(name).fetch_optional(&self.pool).await?)
    }

    /// The latest version of every adapter `tenant` may use: its own and the published ones.
    pub async fn visible_adapters(&self, tenant: &str) -> Result<Vec<AdapterRecord>, StoreError> {
        let sql = concat!(
            "SELECT ",
            adapter_columns!(),
            " FROM adapters a WHERE deleted_at IS NULL AND (owner = $1 OR public = 1) \
             AND version = (SELECT MAX(version) FROM adapters b WHERE b.owner = a.owner AND b.name = a.name AND b.deleted_at IS NULL) \
             ORDER BY name, owner"
        );
        Ok(sqlx::query_as(sql).bind(tenant).fetch_all(&self.pool).await?)
    }

    /// Every live version of every owner's adapters, by owner, name and version (what the
    /// operator's list folds into one row per adapter).
    pub async fn all_adapter_versions(&self) -> Result<Vec<AdapterRecord>, StoreError> {
        let sql = concat!("SELECT ", adapter_columns!(), " FROM adapters WHERE deleted_at IS NULL ORDER BY owner, name, version");
        Ok(sqlx::query_as(sql).fetch_all(&self.pool).await?)
    }

    /// Deletes every version of `owner`'s adapter `name`; returns the versions deleted (none
    /// if there was no such adapter).
    pub async fn delete_adapter(&self, owner: &str, name: &str) -> Result<Vec<AdapterRecord>, StoreError> {
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            self.lock_owner(&mut tx, owner).await?;
            let sql = concat!("SELECT ", adapter_columns!(), " FROM adapters WHERE owner = $1 AND name = $2 AND deleted_at IS NULL ORDER BY version");
            let live: Vec<AdapterRecord> = sqlx::query_as(sql).bind(owner).bind(name).fetch_all(&mut *tx).await?;
            sqlx::query("UPDATE adapters SET deleted_at = $1 WHERE owner = $2 AND name = $3 AND deleted_at IS NULL")
                .bind(now_ms())
                .bind(owner)
                .bind(name)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(live)
        })
        .await
    }

    /// One version of the adapter `name` as `tenant` sees it (its own, else a published one).
    pub async fn visible_adapter_version(&self, tenant: &str, name: &str, version: i64) -> Result<Option<AdapterRecord>, StoreError> {
        let sql = concat!(
            "SELECT ",
            adapter_columns!(),
            " FROM adapters WHERE name = $1 AND version = $2 AND deleted_at IS NULL AND (owner = $3 OR public = 1) \
             ORDER BY CASE WHEN owner = $3 THEN 0 ELSE 1 END LIMIT 1"
        );
        Ok(sqlx::query_as(sql).bind(name).bind(version).bind(tenant).fetch_optional(&self.pool).await?)
    }

    /// Every live version of `owner`'s adapter `name`, oldest first.
    pub async fn adapter_versions(&self, owner: &str, name: &str) -> Result<Vec<AdapterRecord>, StoreError> {
        let sql = concat!("SELECT ", adapter_columns!(), " FROM adapters WHERE owner = $1 AND name = $2 AND deleted_at IS NULL ORDER BY version");
        Ok(sqlx::query_as(sql).bind(owner).bind(name).fetch_all(&self.pool).await?)
    }

    /// The blob directories of every live adapter version (what the data directory must keep).
    pub async fn live_adapter_blobs(&self) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = sqlx::query_as("SELECT blob FROM adapters WHERE deleted_at IS NULL").fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|(b,)| b).collect())
    }

    /// The versions deleted at or after `since_ms` (Unix milliseconds), oldest first, with when:
    /// what another replica deleted, for this one to drop its copies.
    pub async fn adapters_deleted_since(&self, since_ms: i64) -> Result<Vec<(AdapterRecord, i64)>, StoreError> {
        #[derive(sqlx::FromRow)]
        struct Deleted {
            #[sqlx(flatten)]
            record: AdapterRecord,
            deleted_at: i64,
        }
        let sql = concat!("SELECT ", adapter_columns!(), ", deleted_at FROM adapters WHERE deleted_at >= $1 ORDER BY deleted_at");
        let rows: Vec<Deleted> = sqlx::query_as(sql).bind(since_ms).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(|d| (d.record, d.deleted_at)).collect())
    }

    /// Makes every version of `owner`'s adapter visible to all tenants, or private again.
    pub async fn publish_adapter(&self, owner: &str, name: &str, public: bool) -> Result<bool, StoreError> {
        let n = sqlx::query("UPDATE adapters SET public = $1 WHERE owner = $2 AND name = $3 AND deleted_at IS NULL")
            .bind(public as i64)
            .bind(owner)
            .bind(name)
            .execute(&self.pool)
            .await?;
        Ok(n.rows_affected() > 0)
    }

    /// Live adapters (names; versions count once) and their bytes (every version), for a
    /// tenant's quota.
    pub async fn adapter_footprint(&self, owner: &str) -> Result<(i64, i64), StoreError> {
        let (n, bytes): (i64, Option<i64>) =
            sqlx::query_as("SELECT COUNT(DISTINCT name), CAST(SUM(bytes) AS BIGINT) FROM adapters WHERE owner = $1 AND deleted_at IS NULL")
                .bind(owner)
                .fetch_one(&self.pool)
                .await?;
        Ok((n, bytes.unwrap_or(0)))
    }

    /// Records `model` (its served name and shape) as the base model of every version recorded
    /// before versions named theirs; how many were.
    pub async fn adopt_adapters(&self, model: &str, shape: &str) -> Result<u64, StoreError> {
        let done =
            sqlx::query("UPDATE adapters SET base_model = $1, base_shape = $2 WHERE base_shape IS NULL").bind(model).bind(shape).execute(&self.pool).await?;
        Ok(done.rows_affected())
    }

    /// Records `holder`'s pin ('' the operator's) of adapter version `adapter_id`, to be
    /// restored at the next start.
    pub async fn record_pin(&self, adapter_id: &str, holder: &str) -> Result<(), StoreError> {
        let sql = "INSERT INTO adapter_pins (adapter_id, holder, created_at) VALUES ($1, $2, $3) ON CONFLICT (adapter_id, holder) DO NOTHING";
        self.retrying(|| async {
            sqlx::query(sql).bind(adapter_id).bind(holder).bind(now_ms()).execute(&self.pool).await.map(|_| ()).map_err(StoreError::from)
        })
        .await
    }

    /// Forgets `holder`'s pins of every version of `owner`'s adapter `name`; whether there were any.
    pub async fn forget_pins(&self, owner: &str, name: &str, holder: &str) -> Result<bool, StoreError> {
        let sql = "DELETE FROM adapter_pins WHERE holder = $3 AND adapter_id IN (SELECT id FROM adapters WHERE owner = $1 AND name = $2)";
        self.retrying(|| async {
            let done = sqlx::query(sql).bind(owner).bind(name).bind(holder).execute(&self.pool).await?;
            Ok(done.rows_affected() > 0)
        })
        .await
    }

    /// Every recorded pin of a live adapter version whose holder still exists (the operator, or a
    /// tenant not deleted): (the version, its holder), oldest first. Pins of deleted versions and
    /// holders are forgotten on the way.
    pub async fn pins(&self) -> Result<Vec<(AdapterRecord, String)>, StoreError> {
        sqlx::query(
            "DELETE FROM adapter_pins WHERE adapter_id NOT IN (SELECT id FROM adapters WHERE deleted_at IS NULL) \
             OR (holder <> '' AND holder NOT IN (SELECT id FROM tenants WHERE deleted_at IS NULL))",
        )
        .execute(&self.pool)
        .await?;
        let sql = "SELECT a.id, a.owner, a.name, a.version, a.public, a.rank, a.targets, a.bytes, a.content_hash, a.blob, a.created_at, \
             a.base_model, a.base_shape, p.holder FROM adapter_pins p JOIN adapters a ON a.id = p.adapter_id \
             WHERE a.deleted_at IS NULL ORDER BY p.created_at, p.adapter_id, p.holder";
        let rows = sqlx::query(sql).fetch_all(&self.pool).await?;
        rows.iter()
            .map(|row| {
                use sqlx::{FromRow, Row};
                Ok((AdapterRecord::from_row(row)?, row.try_get::<String, _>("holder")?))
            })
            .collect()
    }
}
