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
//! Unknown secrets are not remembered: a flood of made-up keys gains nothing from a cache, and
//! remembering them would let it fill one.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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

/// The remembered lookups, by hash of the secret.
#[derive(Debug)]
pub(super) struct AuthCache {
    pub(super) entries: Cache<String, Arc<Principal>>,
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
        if let Some(p) = self.auth.entries.get(&hash) {
            return Ok(Some(p));
        }
        let generation = self.auth.generation.load(Ordering::Acquire);
        let Some(key) = self.key_by_hash(&hash).await? else { return Ok(None) };
        let tenant = match &key.tenant_id {
            None => None,
            Some(id) => {
                // Deleted between the two reads: the key is no longer live.
                let Some(tenant) = self.tenant(id).await? else { return Ok(None) };
                let plan =
                    self.plan(&tenant.plan).await?.ok_or_else(|| StoreError::Inconsistent(format!("tenant {} has no plan {:?}", tenant.id, tenant.plan)))?;
                Some((tenant, plan))
            }
        };
        let principal = Arc::new(Principal { key, tenant });
        // A change that committed while this was read may not be in it: keep it only if none
        // did, checked again after the insert for a change that came between the check and it.
        if self.auth.generation.load(Ordering::Acquire) == generation {
            self.auth.entries.insert(hash.clone(), principal.clone());
            if self.auth.generation.load(Ordering::Acquire) != generation {
                self.auth.entries.invalidate(&hash);
            }
        }
        Ok(Some(principal))
    }
}
