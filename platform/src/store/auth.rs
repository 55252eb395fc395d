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
        let Some(key) = self.key_by_hash(&hash).await? else {
            self.auth.entries.invalidate(&hash);
            return Ok(None);
        };
        let tenant = match &key.tenant_id {
            None => None,
            Some(id) => {
                // Deleted between the two reads: the key is no longer live.
                let Some(tenant) = self.tenant(id).await? else {
                    self.auth.entries.invalidate(&hash);
                    return Ok(None);
                };
                let plan =
                    self.plan(&tenant.plan).await?.ok_or_else(|| StoreError::Inconsistent(format!("tenant {} has no plan {:?}", tenant.id, tenant.plan)))?;
                Some((tenant, plan))
            }
        };
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
