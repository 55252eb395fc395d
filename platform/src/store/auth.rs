//! Who a secret belongs to, remembered for a moment.
//!
//! Every request starts by finding its key, its tenant and the tenant's plan; refusing a
//! request over its tenant's limits needs all three. Three queries per request would make the
//! database the price of every refusal, so a live key's answer is kept for [`TTL`]. Changes made
//! through this process (a key revoked, a tenant patched or deleted) take effect at once: they
//! empty the cache after they commit, and a lookup that raced with such a change does not keep
//! what it read. Changes made through another process sharing the database (another replica)
//! take effect within [`TTL`].
//!
//! A key in use does not wait for the database when its answer ages: a lookup that finds one
//! older than half of [`TTL`] still answers from it and has it read again in the background (one
//! read at a time per key), so that steady traffic on a key never misses. No answer is used
//! more than [`TTL`] after its read began.
//!
//! Unknown secrets are not remembered: a flood of made-up keys gains nothing from a cache, and
//! remembering them would let it fill one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moka::sync::Cache;

use super::{ApiKey, Plan, Store, StoreError, Tenant};

/// How long a lookup is trusted without asking the database again.
pub const TTL: Duration = Duration::from_secs(1);

/// Keys remembered at most.
const CAPACITY: u64 = 100_000;

/// A live key, with its tenant and the tenant's plan for a tenant's key.
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    pub key: ApiKey,
    pub tenant: Option<(Tenant, Plan)>,
}

/// A remembered lookup.
#[derive(Debug)]
pub(super) struct Remembered {
    pub(super) principal: Arc<Principal>,
    /// When the read that found it began.
    pub(super) read_at: Instant,
    /// Whether a read in the background has been started for it.
    refreshing: AtomicBool,
}

/// The remembered lookups, by hash of the secret.
#[derive(Debug)]
pub(super) struct AuthCache {
    pub(super) entries: Cache<String, Arc<Remembered>>,
    /// Bumped by every change to keys and tenants, after it commits.
    generation: AtomicU64,
}

impl AuthCache {
    pub(super) fn new() -> Self {
        Self { entries: Cache::builder().max_capacity(CAPACITY).time_to_live(TTL).build(), generation: AtomicU64::new(0) }
    }

    /// Forgets everything; called after a change to keys or tenants has committed.
    pub(super) fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.entries.invalidate_all();
    }
}

impl Store {
    /// The live key `secret` belongs to, with its tenant and plan; `None` for an unknown,
    /// revoked or deleted tenant's key. See the module's documentation for how fresh it is.
    pub async fn principal(&self, secret: &str) -> Result<Option<Arc<Principal>>, StoreError> {
        let hash = super::hash_secret(secret);
        if let Some(e) = self.auth.entries.get(&hash) {
            let age = e.read_at.elapsed();
            if age < TTL {
                if age >= TTL / 2
                    && !e.refreshing.swap(true, Ordering::AcqRel)
                    && let Ok(runtime) = tokio::runtime::Handle::try_current()
                {
                    let store = self.clone();
                    // A failed read leaves the entry to its time to live.
                    runtime.spawn(async move { store.read_principal(hash).await });
                }
                return Ok(Some(e.principal.clone()));
            }
        }
        self.read_principal(hash).await
    }

    /// Reads the principal of the secret whose hash is `hash` and remembers it (or forgets it,
    /// when it is no longer live).
    async fn read_principal(&self, hash: String) -> Result<Option<Arc<Principal>>, StoreError> {
        let read_at = Instant::now();
        let generation = self.auth.generation.load(Ordering::Acquire);
        let Some(row) = self.principal_row(&hash).await? else {
            self.auth.entries.invalidate(&hash);
            return Ok(None);
        };
        let (key, tenant) = row.split()?;
        let principal = Arc::new(Principal { key, tenant });
        // A change that committed while this was read may not be in it: keep it only if none
        // did, checked again after the insert for a change that came between the check and it.
        if self.auth.generation.load(Ordering::Acquire) == generation {
            let remembered = Arc::new(Remembered { principal: principal.clone(), read_at, refreshing: AtomicBool::new(false) });
            self.auth.entries.insert(hash.clone(), remembered);
            if self.auth.generation.load(Ordering::Acquire) != generation {
                self.auth.entries.invalidate(&hash);
            }
        }
        Ok(Some(principal))
    }
}

/// A live key with its tenant and the tenant's plan (with the tenant's own prices over the
/// plan's), read in one statement (so one snapshot
/// and one round trip): the tenant's and plan's columns are NULL for an operator's key.
#[derive(Debug, sqlx::FromRow)]
struct PrincipalRow {
    id: String,
    tenant_id: Option<String>,
    prefix: String,
    scopes: String,
    created_at: i64,
    t_name: Option<String>,
    t_weight: Option<f64>,
    t_plan: Option<String>,
    t_requests_per_min: Option<i64>,
    t_tokens_per_min: Option<i64>,
    t_max_concurrent: Option<i64>,
    t_max_adapters: Option<i64>,
    t_max_adapter_bytes: Option<i64>,
    t_max_pinned_pages: Option<i64>,
    t_created_at: Option<i64>,
    p_name: Option<String>,
    p_prompt_price: Option<i64>,
    p_cached_prompt_price: Option<i64>,
    p_completion_price: Option<i64>,
    p_batch_percent: Option<i64>,
}

impl PrincipalRow {
    fn split(self) -> Result<(ApiKey, Option<(Tenant, Plan)>), StoreError> {
        let key = ApiKey { id: self.id, tenant_id: self.tenant_id, prefix: self.prefix, scopes: self.scopes, created_at: self.created_at };
        let Some(tenant_id) = key.tenant_id.clone() else { return Ok((key, None)) };
        let missing = |what: &str| StoreError::Inconsistent(format!("key {}: its tenant {tenant_id}'s {what} was not read", key.id));
        let tenant = Tenant {
            id: tenant_id.clone(),
            name: self.t_name.ok_or_else(|| missing("name"))?,
            weight: self.t_weight.ok_or_else(|| missing("weight"))?,
            plan: self.t_plan.ok_or_else(|| missing("plan"))?,
            requests_per_min: self.t_requests_per_min,
            tokens_per_min: self.t_tokens_per_min,
            max_concurrent: self.t_max_concurrent,
            max_adapters: self.t_max_adapters,
            max_adapter_bytes: self.t_max_adapter_bytes,
            max_pinned_pages: self.t_max_pinned_pages,
            created_at: self.t_created_at.ok_or_else(|| missing("creation time"))?,
        };
        let Some(name) = self.p_name else {
            return Err(StoreError::Inconsistent(format!("tenant {} has no plan {:?}", tenant.id, tenant.plan)));
        };
        let plan = Plan {
            name,
            prompt_price: self.p_prompt_price.ok_or_else(|| missing("plan's prompt price"))?,
            cached_prompt_price: self.p_cached_prompt_price.ok_or_else(|| missing("plan's cached prompt price"))?,
            completion_price: self.p_completion_price.ok_or_else(|| missing("plan's completion price"))?,
            batch_percent: self.p_batch_percent.ok_or_else(|| missing("plan's batch percent"))?,
        };
        Ok((key, Some((tenant, plan))))
    }
}

impl Store {
    /// The live key whose secret hashes to `hash`, with its tenant (not deleted) and plan, in
    /// one statement; `None` for an unknown or revoked key or a deleted tenant's.
    async fn principal_row(&self, hash: &str) -> Result<Option<PrincipalRow>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT k.id, k.tenant_id, k.prefix, k.scopes, k.created_at, \
                    t.name AS t_name, t.weight AS t_weight, t.plan AS t_plan, t.requests_per_min AS t_requests_per_min, \
                    t.tokens_per_min AS t_tokens_per_min, t.max_concurrent AS t_max_concurrent, t.max_adapters AS t_max_adapters, \
                    t.max_adapter_bytes AS t_max_adapter_bytes, t.max_pinned_pages AS t_max_pinned_pages, t.created_at AS t_created_at, \
                    p.name AS p_name, COALESCE(o.prompt_price, p.prompt_price) AS p_prompt_price, \
                    COALESCE(o.cached_prompt_price, p.cached_prompt_price) AS p_cached_prompt_price, \
                    COALESCE(o.completion_price, p.completion_price) AS p_completion_price, \
                    COALESCE(o.batch_percent, p.batch_percent) AS p_batch_percent \
             FROM api_keys k \
             LEFT JOIN tenants t ON t.id = k.tenant_id AND t.deleted_at IS NULL \
             LEFT JOIN plans p ON p.name = t.plan \
             LEFT JOIN tenant_prices o ON o.tenant_id = t.id \
             WHERE k.secret_hash = $1 AND k.revoked_at IS NULL AND (k.tenant_id IS NULL OR t.id IS NOT NULL)",
        )
        .bind(hash)
        .fetch_optional(&self.pool)
        .await?)
    }
}
