//! The operator's business: plans and their prices, a tenant's own prices over its plan's,
//! keys a tenant mints itself (within a cap), and the audit log.
//!
//! Prices are micro-dollars per million tokens. A ledger row keeps the prices in force when its
//! request was admitted, so editing a plan or a tenant's prices never changes a past bill.

use serde::{Deserialize, Serialize};

use super::{ApiKey, Plan, Scope, Store, StoreError, now_ms, random_id, validate_name};

/// The live keys of the tenant `$1`.
const LIVE_KEYS: &str = "SELECT COUNT(*) FROM api_keys WHERE tenant_id = $1 AND revoked_at IS NULL";

/// The highest price accepted: a million dollars per million tokens.
pub const MAX_PRICE: i64 = 1_000_000_000_000;

/// A tenant's own prices; each `None` is its plan's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
#[serde(deny_unknown_fields)]
pub struct PriceOverride {
    #[serde(default)]
    pub prompt_price: Option<i64>,
    #[serde(default)]
    pub cached_prompt_price: Option<i64>,
    #[serde(default)]
    pub completion_price: Option<i64>,
    #[serde(default)]
    pub batch_percent: Option<i64>,
}

impl PriceOverride {
    pub fn is_empty(&self) -> bool {
        *self == PriceOverride::default()
    }

    /// `plan` with these prices over its own.
    pub fn apply(&self, plan: &Plan) -> Plan {
        Plan {
            name: plan.name.clone(),
            prompt_price: self.prompt_price.unwrap_or(plan.prompt_price),
            cached_prompt_price: self.cached_prompt_price.unwrap_or(plan.cached_prompt_price),
            completion_price: self.completion_price.unwrap_or(plan.completion_price),
            batch_percent: self.batch_percent.unwrap_or(plan.batch_percent),
        }
    }

    fn validate(&self) -> Result<(), StoreError> {
        for (field, v) in [("prompt_price", self.prompt_price), ("cached_prompt_price", self.cached_prompt_price), ("completion_price", self.completion_price)]
        {
            if let Some(v) = v {
                check_price(field, v)?;
            }
        }
        if let Some(p) = self.batch_percent {
            check_percent(p)?;
        }
        Ok(())
    }
}

fn check_price(field: &'static str, v: i64) -> Result<(), StoreError> {
    if !(0..=MAX_PRICE).contains(&v) {
        return Err(StoreError::Invalid { field, why: format!("{v}: a price is 0 to {MAX_PRICE} micro-dollars per million tokens") });
    }
    Ok(())
}

fn check_percent(p: i64) -> Result<(), StoreError> {
    if !(0..=100).contains(&p) {
        return Err(StoreError::Invalid { field: "batch_percent", why: format!("{p}: a percent of the prices, 0 to 100") });
    }
    Ok(())
}

/// Checks a plan's name and prices.
pub fn validate_plan(plan: &Plan) -> Result<(), StoreError> {
    validate_name("plan name", &plan.name)?;
    check_price("prompt_price", plan.prompt_price)?;
    check_price("cached_prompt_price", plan.cached_prompt_price)?;
    check_price("completion_price", plan.completion_price)?;
    check_percent(plan.batch_percent)
}

/// One change, as the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct AuditEntry {
    pub id: String,
    /// Unix milliseconds.
    pub at: i64,
    /// The tenant that made it, or `""` for the operator.
    pub actor: String,
    /// The key it was made with.
    pub key_id: String,
    /// The tenant it is about (`""`: none).
    pub tenant_id: String,
    /// What was done, as `thing.verb` (`tenant.create`, `key.revoke`, `plan.update`, ...).
    pub action: String,
    /// What it was done to (an id or a name).
    pub target: String,
    /// The change's fields, as JSON.
    pub detail: String,
}

impl Store {
    /// Creates a plan; a conflict if one of its name exists.
    pub async fn create_plan(&self, plan: &Plan) -> Result<Plan, StoreError> {
        validate_plan(plan)?;
        let done = sqlx::query("INSERT INTO plans (name, prompt_price, cached_prompt_price, completion_price, batch_percent) VALUES ($1, $2, $3, $4, $5)")
            .bind(&plan.name)
            .bind(plan.prompt_price)
            .bind(plan.cached_prompt_price)
            .bind(plan.completion_price)
            .bind(plan.batch_percent)
            .execute(&self.pool)
            .await;
        match done {
            Ok(_) => Ok(plan.clone()),
            Err(e) if super::is_unique_violation(&e) => Err(StoreError::Conflict { what: "plan", name: plan.name.clone() }),
            Err(e) => Err(e.into()),
        }
    }

    /// Sets a plan's prices to `plan`'s (its name names it). Requests admitted from now on pay
    /// them; rows already in the ledger keep theirs.
    pub async fn update_plan(&self, plan: &Plan) -> Result<Plan, StoreError> {
        validate_plan(plan)?;
        let done = sqlx::query("UPDATE plans SET prompt_price = $1, cached_prompt_price = $2, completion_price = $3, batch_percent = $4 WHERE name = $5")
            .bind(plan.prompt_price)
            .bind(plan.cached_prompt_price)
            .bind(plan.completion_price)
            .bind(plan.batch_percent)
            .bind(&plan.name)
            .execute(&self.pool)
            .await?;
        self.auth.changed();
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound("plan"));
        }
        Ok(plan.clone())
    }

    /// A tenant's own prices (empty when it pays its plan's).
    pub async fn price_override(&self, tenant: &str) -> Result<PriceOverride, StoreError> {
        let row: Option<PriceOverride> =
            sqlx::query_as("SELECT prompt_price, cached_prompt_price, completion_price, batch_percent FROM tenant_prices WHERE tenant_id = $1")
                .bind(tenant)
                .fetch_optional(&self.pool)
                .await?;
        Ok(row.unwrap_or_default())
    }

    /// Sets a live tenant's own prices (an empty override clears them: it pays its plan's).
    pub async fn set_price_override(&self, tenant: &str, prices: &PriceOverride) -> Result<(), StoreError> {
        prices.validate()?;
        if self.tenant(tenant).await?.is_none() {
            return Err(StoreError::NotFound("tenant"));
        }
        if prices.is_empty() {
            sqlx::query("DELETE FROM tenant_prices WHERE tenant_id = $1").bind(tenant).execute(&self.pool).await?;
        } else {
            sqlx::query(
                "INSERT INTO tenant_prices (tenant_id, prompt_price, cached_prompt_price, completion_price, batch_percent) VALUES ($1, $2, $3, $4, $5) \
                 ON CONFLICT (tenant_id) DO UPDATE SET prompt_price = excluded.prompt_price, cached_prompt_price = excluded.cached_prompt_price, \
                 completion_price = excluded.completion_price, batch_percent = excluded.batch_percent",
            )
            .bind(tenant)
            .bind(prices.prompt_price)
            .bind(prices.cached_prompt_price)
            .bind(prices.completion_price)
            .bind(prices.batch_percent)
            .execute(&self.pool)
            .await?;
        }
        self.auth.changed();
        Ok(())
    }

    /// A key the tenant mints itself: refused (a quota) when it holds `max_keys` live keys.
    /// Counted and created in one write transaction, so concurrent mints cannot pass the cap.
    pub async fn mint_tenant_key(&self, tenant: &str, scopes: &[Scope], max_keys: i64) -> Result<(ApiKey, String), StoreError> {
        super::keys::check_scopes(scopes)?;
        self.retrying(|| async {
            let mut tx = self.write_tx().await?;
            self.lock_owner(&mut tx, &format!("keys:{tenant}")).await?;
            let (live,): (i64,) = sqlx::query_as(LIVE_KEYS).bind(tenant).fetch_one(&mut *tx).await?;
            if live >= max_keys {
                return Err(StoreError::Quota(format!("key limit reached: {live} live keys of {max_keys}; revoke one first")));
            }
            let minted = super::keys::insert_key(&mut *tx, Some(tenant), scopes).await?;
            tx.commit().await?;
            Ok(minted)
        })
        .await
    }

    /// Revokes one of `tenant`'s keys; false if it has no such live key.
    pub async fn revoke_tenant_key(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND tenant_id = $3 AND revoked_at IS NULL")
            .bind(now_ms())
            .bind(id)
            .bind(tenant)
            .execute(&self.pool)
            .await?;
        self.auth.changed();
        Ok(done.rows_affected() > 0)
    }

    /// How many live keys a tenant holds.
    pub async fn live_keys(&self, tenant: &str) -> Result<i64, StoreError> {
        let (n,): (i64,) = sqlx::query_as(LIVE_KEYS).bind(tenant).fetch_one(&self.pool).await?;
        Ok(n)
    }

    /// Appends a change to the audit log.
    pub async fn audit(&self, actor: &str, key_id: &str, tenant_id: &str, action: &str, target: &str, detail: &serde_json::Value) -> Result<(), StoreError> {
        let sql = "INSERT INTO audit_log (id, at, actor, key_id, tenant_id, action, target, detail) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";
        let (id, at, detail) = (random_id("aud"), now_ms(), detail.to_string());
        self.retrying(|| async {
            sqlx::query(sql).bind(&id).bind(at).bind(actor).bind(key_id).bind(tenant_id).bind(action).bind(target).bind(&detail).execute(&self.pool).await?;
            Ok(())
        })
        .await
    }

    /// The newest `limit` entries before `before` (Unix ms; `None`: now), of one tenant's (as
    /// actor or subject) or everyone's, newest first.
    pub async fn audit_log(&self, tenant: Option<&str>, before: Option<i64>, limit: i64) -> Result<Vec<AuditEntry>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, at, actor, key_id, tenant_id, action, target, detail FROM audit_log \
             WHERE ($1 = '' OR tenant_id = $1 OR actor = $1) AND at < $2 ORDER BY at DESC, id DESC LIMIT $3",
        )
        .bind(tenant.unwrap_or(""))
        .bind(before.unwrap_or(i64::MAX))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The tenant a key belongs to (`None` for an operator's key or an unknown one).
    pub async fn key_tenant(&self, id: &str) -> Result<Option<String>, StoreError> {
        let row: Option<(Option<String>,)> = sqlx::query_as("SELECT tenant_id FROM api_keys WHERE id = $1").bind(id).fetch_optional(&self.pool).await?;
        Ok(row.and_then(|(t,)| t))
    }
}
