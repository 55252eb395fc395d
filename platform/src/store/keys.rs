//! API keys: minted with scopes for a tenant or the operator, stored as a hash of the secret
//! (shown once), listed without it, revoked by id.

use rand::Rng;
use serde::Serialize;

use super::{ApiKey, Scope, Store, StoreError, hash_secret, hex, now_ms, random_id};

/// A key as an operator lists it: never its secret, revoked keys included.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, Serialize)]
pub struct KeyInfo {
    pub id: String,
    pub tenant_id: Option<String>,
    /// The secret's first characters, to tell keys apart.
    pub prefix: String,
    /// Comma-separated, as minted.
    pub scopes: String,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
}

/// Refuses a key without scopes.
pub(super) fn check_scopes(scopes: &[Scope]) -> Result<(), StoreError> {
    if scopes.is_empty() {
        return Err(StoreError::Invalid { field: "scopes", why: "a key needs at least one scope".into() });
    }
    Ok(())
}

/// Mints a key for `tenant` (`None`: the operator's) and writes its row through `db` (the pool,
/// or a transaction that checked something first); returns it with its secret.
pub(super) async fn insert_key<'e>(
    db: impl sqlx::Executor<'e, Database = sqlx::Any>,
    tenant: Option<&str>,
    scopes: &[Scope],
) -> Result<(ApiKey, String), sqlx::Error> {
    let bytes: [u8; 32] = rand::rng().random();
    let secret = format!("lpx_{}", hex(&bytes));
    let key = ApiKey {
        id: random_id("key"),
        tenant_id: tenant.map(str::to_string),
        prefix: secret[..12].to_string(),
        scopes: Scope::join(scopes),
        created_at: now_ms(),
    };
    sqlx::query("INSERT INTO api_keys (id, tenant_id, secret_hash, prefix, scopes, created_at) VALUES ($1, $2, $3, $4, $5, $6)")
        .bind(&key.id)
        .bind(&key.tenant_id)
        .bind(hash_secret(&secret))
        .bind(&key.prefix)
        .bind(&key.scopes)
        .bind(key.created_at)
        .execute(db)
        .await?;
    Ok((key, secret))
}

impl Store {
    /// A new key for `tenant` (`None`: an operator key) with `scopes`. The secret is returned
    /// once and only its hash is stored.
    pub async fn create_key(&self, tenant: Option<&str>, scopes: &[Scope]) -> Result<(ApiKey, String), StoreError> {
        check_scopes(scopes)?;
        if let Some(t) = tenant
            && self.tenant(t).await?.is_none()
        {
            return Err(StoreError::NotFound("tenant"));
        }
        Ok(insert_key(&self.pool, tenant, scopes).await?)
    }

    /// Makes `secret` a live operator key (as given on the command line); true if it was new.
    pub async fn ensure_admin_key(&self, secret: &str) -> Result<bool, StoreError> {
        if secret.len() < 16 {
            return Err(StoreError::Invalid { field: "admin key", why: "use at least 16 characters".into() });
        }
        if self.authenticate(secret).await?.is_some_and(|k| k.has(Scope::Admin)) {
            return Ok(false);
        }
        sqlx::query("INSERT INTO api_keys (id, tenant_id, secret_hash, prefix, scopes, created_at) VALUES ($1, NULL, $2, $3, $4, $5)")
            .bind(random_id("key"))
            .bind(hash_secret(secret))
            .bind(secret.chars().take(8).collect::<String>())
            .bind(Scope::Admin.as_str())
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(true)
    }

    /// Whether any live operator key exists.
    pub async fn has_admin_key(&self) -> Result<bool, StoreError> {
        let keys: Vec<(String,)> = sqlx::query_as("SELECT scopes FROM api_keys WHERE tenant_id IS NULL AND revoked_at IS NULL").fetch_all(&self.pool).await?;
        Ok(keys.iter().any(|(scopes,)| scopes.split(',').any(|s| s == Scope::Admin.as_str())))
    }

    /// The key a secret belongs to, if it is live (not revoked, its tenant not deleted), read
    /// from the database ([`Store::principal`] is the cached lookup requests use).
    pub async fn authenticate(&self, secret: &str) -> Result<Option<ApiKey>, StoreError> {
        self.key_by_hash(&hash_secret(secret)).await
    }

    pub(super) async fn key_by_hash(&self, hash: &str) -> Result<Option<ApiKey>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT k.id, k.tenant_id, k.prefix, k.scopes, k.created_at FROM api_keys k LEFT JOIN tenants t ON t.id = k.tenant_id \
             WHERE k.secret_hash = $1 AND k.revoked_at IS NULL AND (k.tenant_id IS NULL OR t.deleted_at IS NULL)",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// Revokes a key; false if it was unknown or already revoked.
    pub async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let n = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL").bind(now_ms()).bind(id).execute(&self.pool).await;
        self.auth.changed();
        Ok(n?.rows_affected() > 0)
    }

    /// Every key of `tenant` (`None`: the operator's keys), revoked ones included, newest
    /// first.
    pub async fn keys(&self, tenant: Option<&str>) -> Result<Vec<KeyInfo>, StoreError> {
        let keys = match tenant {
            Some(t) => {
                sqlx::query_as("SELECT id, tenant_id, prefix, scopes, created_at, revoked_at FROM api_keys WHERE tenant_id = $1 ORDER BY created_at DESC, id")
                    .bind(t)
                    .fetch_all(&self.pool)
                    .await?
            }
            None => {
                sqlx::query_as(
                    "SELECT id, tenant_id, prefix, scopes, created_at, revoked_at FROM api_keys WHERE tenant_id IS NULL ORDER BY created_at DESC, id",
                )
                .fetch_all(&self.pool)
                .await?
            }
        };
        Ok(keys)
    }
}
