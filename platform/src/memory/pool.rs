//! The unified page pool: one set of equal pages for KV blocks and adapter rows (S-LoRA).
//!
//! Pages are handed out in two forms, both RAII:
//! - a [`PageLease`]: pages a running sequence writes its KV into. Always pinned; dropping the
//!   lease frees them.
//! - a cache entry ([`CachedPages`]): pages whose contents outlive any one sequence (an adapter's
//!   rows, later cached prefix blocks). An entry is pinned while some [`PagePin`] exists; when
//!   the last pin goes, it joins the pool's single LRU of unpinned entries. When a lease or a new
//!   entry needs more pages than are free, the least recently unpinned entries are evicted: their
//!   pages go back to the free list and their owners see them as no longer resident.
//!
//! Invariants: every page is either free, held by exactly one lease, or held by exactly one
//! resident entry; an entry with a pin is never evicted; the LRU holds exactly the resident,
//! unpinned entries whose owner is alive.
//!
//! Cached prefix blocks belong to a tenant (their cache namespace). With a share set
//! ([`PagePool::set_tenant_share`]), the unpinned blocks a tenant holds beyond its share are
//! evicted before anything else, its own oldest first: a tenant that floods the server with
//! distinct prompts may fill pages nobody else wants, but under pressure it evicts its own
//! blocks, not the prefixes other tenants reuse.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// What a cache entry holds, for the pool's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// Rank rows of one adapter.
    Adapter,
    /// Cached KV blocks of a prompt prefix.
    Prefix,
}

#[derive(Debug)]
struct Entry {
    kind: EntryKind,
    /// Empty once evicted.
    pages: Vec<u32>,
    pins: usize,
    /// The owner handle still exists.
    owned: bool,
    /// Position in the LRU while resident, unpinned and owned.
    lru_tick: Option<u64>,
    /// The tenant whose blocks these are (prefix blocks; adapters have none).
    tenant: Option<Arc<str>>,
}

/// One tenant's entries in the LRU.
#[derive(Debug, Default)]
struct TenantLru {
    /// Their pages.
    pages: usize,
    /// By tick, as in the pool's LRU.
    lru: BTreeMap<u64, u64>,
}

#[derive(Debug)]
struct PoolState {
    total: usize,
    free: Vec<u32>,
    /// Pages held by leases.
    leased: usize,
    entries: HashMap<u64, Entry>,
    /// Unpinned resident entries by the time they were last unpinned: first is least recent.
    lru: BTreeMap<u64, u64>,
    /// Pages of the entries in `lru`.
    reclaimable: usize,
    /// The entries of `lru` that belong to a tenant, by tenant.
    tenants: HashMap<Arc<str>, TenantLru>,
    /// The pages of a tenant's entries in the LRU beyond which they are evicted first.
    tenant_share: Option<usize>,
    adapter_pages: usize,
    prefix_pages: usize,
    clock: u64,
    next_id: u64,
    evictions: u64,
    adapter_evictions: u64,
}

impl PoolState {
    /// Pops `n` free pages, evicting least recently used unpinned entries as needed (a
    /// tenant's beyond its share first); all or nothing.
    fn take(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.free.len() + self.reclaimable < n {
            return None;
        }
        while self.free.len() < n {
            let id = self.victim()?;
            self.unlist(id);
            self.evict(id);
        }
        let at = self.free.len() - n;
        Some(self.free.drain(at..).rev().collect())
    }

    /// The entry to evict next: the oldest of the tenant furthest beyond its share, if one is;
    /// else the least recently used of all.
    fn victim(&self) -> Option<u64> {
        if let Some(share) = self.tenant_share
            && let Some(over) = self.tenants.values().filter(|t| t.pages > share).max_by_key(|t| t.pages)
            && let Some((_, &id)) = over.lru.first_key_value()
        {
            return Some(id);
        }
        self.lru.first_key_value().map(|(_, &id)| id)
    }

    /// Puts a resident, unpinned, owned entry at the LRU's recent end.
    fn list(&mut self, id: u64) {
        self.clock += 1;
        let tick = self.clock;
        let Some(e) = self.entries.get_mut(&id) else { return };
        e.lru_tick = Some(tick);
        let n = e.pages.len();
        self.reclaimable += n;
        self.lru.insert(tick, id);
        if let Some(t) = &e.tenant {
            let lru = self.tenants.entry(t.clone()).or_default();
            lru.pages += n;
            lru.lru.insert(tick, id);
        }
    }

    /// Takes an entry out of the LRU (pinned, evicted or removed); nothing if it is not there.
    fn unlist(&mut self, id: u64) {
        let Some(e) = self.entries.get_mut(&id) else { return };
        let Some(tick) = e.lru_tick.take() else { return };
        let n = e.pages.len();
        self.lru.remove(&tick);
        self.reclaimable -= n;
        if let Some(t) = &e.tenant
            && let Some(lru) = self.tenants.get_mut(t)
        {
            lru.pages -= n;
            lru.lru.remove(&tick);
            if lru.lru.is_empty() {
                self.tenants.remove(t);
            }
        }
    }

    /// Frees an unlisted entry's pages; its owner sees it as no longer resident.
    fn evict(&mut self, id: u64) {
        let Some(e) = self.entries.get_mut(&id) else { return };
        let (kind, pages) = (e.kind, std::mem::take(&mut e.pages));
        *self.kind_pages(kind) -= pages.len();
        self.free.extend(pages);
        self.evictions += 1;
        if kind == EntryKind::Adapter {
            self.adapter_evictions += 1;
        }
    }

    /// The page count of entries of `kind`.
    fn kind_pages(&mut self, kind: EntryKind) -> &mut usize {
        match kind {
            EntryKind::Adapter => &mut self.adapter_pages,
            EntryKind::Prefix => &mut self.prefix_pages,
        }
    }

    /// Frees a resident entry's pages and forgets it (its owner and pins are all gone).
    fn remove(&mut self, id: u64) {
        self.unlist(id);
        let Some(mut e) = self.entries.remove(&id) else { return };
        *self.kind_pages(e.kind) -= e.pages.len();
        self.free.append(&mut e.pages);
    }

    fn pin(&mut self, id: u64) -> bool {
        let Some(e) = self.entries.get_mut(&id) else { return false };
        if e.pages.is_empty() {
            return false;
        }
        e.pins += 1;
        self.unlist(id);
        true
    }

    fn unpin(&mut self, id: u64) {
        let Some(e) = self.entries.get_mut(&id) else { return };
        e.pins -= 1;
        if e.pins > 0 {
            return;
        }
        if !e.owned {
            self.remove(id);
        } else if !e.pages.is_empty() {
            self.list(id);
        }
    }
}

/// A snapshot of the pool's occupancy, in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PoolStats {
    pub total: usize,
    pub free: usize,
    /// Held by running sequences' KV blocks.
    pub kv: usize,
    /// Holding adapter rows (pinned or not).
    pub adapter: usize,
    /// Holding cached prefix blocks (pinned or not).
    pub cached: usize,
    /// Unpinned adapter and prefix pages: reclaimable under pressure.
    pub reclaimable: usize,
    /// Entries evicted so far.
    pub evictions: u64,
    /// Of which adapters (the rest are prefix blocks).
    pub adapter_evictions: u64,
}

/// The page allocator of one device. Cheap to clone: clones share the same pages.
#[derive(Debug, Clone)]
pub struct PagePool {
    state: Arc<Mutex<PoolState>>,
}

impl PagePool {
    pub fn new(total: usize) -> Self {
        // Hand out low page ids first.
        let free = (0..total as u32).rev().collect();
        let state = PoolState {
            total,
            free,
            leased: 0,
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            reclaimable: 0,
            tenants: HashMap::new(),
            tenant_share: None,
            adapter_pages: 0,
            prefix_pages: 0,
            clock: 0,
            next_id: 0,
            evictions: 0,
            adapter_evictions: 0,
        };
        Self { state: Arc::new(Mutex::new(state)) }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // Every method restores the invariants before it can panic, so a poisoned lock still
        // guards consistent state.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps each tenant's unpinned cached blocks to `percent` of the pages under pressure:
    /// beyond it, they are evicted before anything else (`None`: one LRU for everything).
    pub fn set_tenant_share(&self, percent: Option<u32>) {
        let mut s = self.lock();
        s.tenant_share = percent.map(|p| (s.total as u128 * p.min(100) as u128 / 100) as usize);
    }

    /// Unpinned cached pages of `tenant`'s prefix blocks.
    #[cfg(test)]
    pub fn tenant_cached(&self, tenant: &str) -> usize {
        self.lock().tenants.get(tenant).map_or(0, |t| t.pages)
    }

    pub fn stats(&self) -> PoolStats {
        let s = self.lock();
        PoolStats {
            total: s.total,
            free: s.free.len(),
            kv: s.leased,
            adapter: s.adapter_pages,
            cached: s.prefix_pages,
            reclaimable: s.reclaimable,
            evictions: s.evictions,
            adapter_evictions: s.adapter_evictions,
        }
    }

    /// Pages that a new lease or entry could get now: free plus reclaimable.
    pub fn available(&self) -> usize {
        let s = self.lock();
        s.free.len() + s.reclaimable
    }

    /// An empty lease that can grow with [`PageLease::grow`].
    pub fn empty_lease(&self) -> PageLease {
        PageLease { pool: self.clone(), pages: Vec::new() }
    }

    /// Leases `n` pages (evicting unpinned entries if needed), or none at all if that is not
    /// enough.
    pub fn lease(&self, n: usize) -> Option<PageLease> {
        let mut lease = self.empty_lease();
        lease.grow(n).then_some(lease)
    }

    /// Creates a cache entry of `n` pages, returned pinned once so that its owner can fill it
    /// before it becomes evictable. `None` if the pages cannot be found even by eviction.
    pub fn insert(&self, kind: EntryKind, n: usize) -> Option<(CachedPages, PagePin)> {
        let mut s = self.lock();
        let pages = s.take(n)?;
        *s.kind_pages(kind) += n;
        let id = s.next_id;
        s.next_id += 1;
        s.entries.insert(id, Entry { kind, pages, pins: 1, owned: true, lru_tick: None, tenant: None });
        drop(s);
        Some((CachedPages { pool: self.clone(), id }, PagePin { pool: self.clone(), id }))
    }
}

/// Pages owned by one holder (a sequence's KV blocks). Dropping the lease frees them.
#[derive(Debug)]
pub struct PageLease {
    pool: PagePool,
    pages: Vec<u32>,
}

impl PageLease {
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Adds `n` pages from the same pool, evicting unpinned entries if needed; all or nothing.
    /// Returns whether it succeeded.
    pub fn grow(&mut self, n: usize) -> bool {
        let mut s = self.pool.lock();
        match s.take(n) {
            Some(pages) => {
                s.leased += n;
                self.pages.extend(pages);
                true
            }
            None => false,
        }
    }
}

impl PageLease {
    /// Moves one of this lease's pages into a new cache entry of `kind` (a full KV block that
    /// becomes a shared, cached prefix block of `tenant`'s), returned pinned once. `None` if
    /// the lease does not hold `page`.
    pub fn into_entry(&mut self, page: u32, kind: EntryKind, tenant: Option<Arc<str>>) -> Option<(CachedPages, PagePin)> {
        let at = self.pages.iter().position(|&p| p == page)?;
        self.pages.swap_remove(at);
        let mut s = self.pool.lock();
        s.leased -= 1;
        *s.kind_pages(kind) += 1;
        let id = s.next_id;
        s.next_id += 1;
        s.entries.insert(id, Entry { kind, pages: vec![page], pins: 1, owned: true, lru_tick: None, tenant });
        drop(s);
        Some((CachedPages { pool: self.pool.clone(), id }, PagePin { pool: self.pool.clone(), id }))
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            let mut s = self.pool.lock();
            s.leased -= self.pages.len();
            s.free.append(&mut self.pages);
        }
    }
}

/// The owner's handle of a cache entry. The entry stays until this handle is dropped and no pin
/// remains, unless the pool evicts it while it is unpinned.
#[derive(Debug)]
pub struct CachedPages {
    pool: PagePool,
    id: u64,
}

impl CachedPages {
    /// Pins the entry if it is still resident.
    pub fn pin(&self) -> Option<PagePin> {
        self.pool.lock().pin(self.id).then(|| PagePin { pool: self.pool.clone(), id: self.id })
    }

    /// Whether the pages still hold the entry's contents (it was not evicted).
    pub fn is_resident(&self) -> bool {
        self.pool.lock().entries.get(&self.id).is_some_and(|e| !e.pages.is_empty())
    }

    /// The entry's pages in order, empty once evicted.
    pub fn pages(&self) -> Vec<u32> {
        self.pool.lock().entries.get(&self.id).map(|e| e.pages.clone()).unwrap_or_default()
    }
}

impl Drop for CachedPages {
    fn drop(&mut self) {
        let mut s = self.pool.lock();
        let Some(e) = s.entries.get_mut(&self.id) else { return };
        e.owned = false;
        if e.pins == 0 {
            s.remove(self.id);
        }
    }
}

/// Keeps a cache entry resident. Clones pin again; dropping the last pin makes the entry the
/// most recently used one in the LRU (or frees it if its owner is gone).
#[derive(Debug)]
pub struct PagePin {
    pool: PagePool,
    id: u64,
}

impl Clone for PagePin {
    fn clone(&self) -> Self {
        let pinned = self.pool.lock().pin(self.id);
        debug_assert!(pinned, "a pinned entry is resident");
        PagePin { pool: self.pool.clone(), id: self.id }
    }
}

impl Drop for PagePin {
    fn drop(&mut self) {
        self.pool.lock().unpin(self.id);
    }
}

#[cfg(test)]
mod tests;
