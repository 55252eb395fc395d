//! A fixed set of equal pages handed out as RAII leases.
//!
//! Invariants: every page id is either in the free list or owned by exactly one live lease;
//! leasing and returning a page are O(1); dropping a lease returns all its pages.

use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Debug)]
struct PoolState {
    total: usize,
    free: Vec<u32>,
}

/// The page allocator of one device. Cheap to clone: clones share the same pages.
#[derive(Debug, Clone)]
pub struct PagePool {
    state: Arc<Mutex<PoolState>>,
}

/// A snapshot of the pool's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub total: usize,
    pub free: usize,
}

impl PagePool {
    pub fn new(total: usize) -> Self {
        // Hand out low page ids first.
        let free = (0..total as u32).rev().collect();
        Self { state: Arc::new(Mutex::new(PoolState { total, free })) }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // The state is a plain free list that is consistent between statements, so a panic in
        // another holder cannot leave it half-updated.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn stats(&self) -> PoolStats {
        let s = self.lock();
        PoolStats { total: s.total, free: s.free.len() }
    }

    /// An empty lease that can grow with [`PageLease::grow`].
    pub fn empty_lease(&self) -> PageLease {
        PageLease { pool: self.clone(), pages: Vec::new() }
    }

    /// Leases `n` pages, or none at all if fewer than `n` are free.
    pub fn lease(&self, n: usize) -> Option<PageLease> {
        let mut lease = self.empty_lease();
        lease.grow(n).then_some(lease)
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

    /// Adds `n` pages from the same pool; all or nothing. Returns whether it succeeded.
    pub fn grow(&mut self, n: usize) -> bool {
        let mut s = self.pool.lock();
        if s.free.len() < n {
            return false;
        }
        let at = s.free.len() - n;
        self.pages.extend(s.free.drain(at..).rev());
        true
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            self.pool.lock().free.append(&mut self.pages);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_return_pages_on_drop() {
        let pool = PagePool::new(4);
        let a = pool.lease(3).unwrap();
        assert_eq!(a.pages(), &[0, 1, 2]);
        assert!(pool.lease(2).is_none(), "all or nothing");
        assert_eq!(pool.stats(), PoolStats { total: 4, free: 1 });
        let mut b = pool.empty_lease();
        assert!(b.grow(1));
        assert!(!b.grow(1));
        drop(a);
        assert_eq!(pool.stats().free, 3);
        assert!(b.grow(3));
        let mut all: Vec<u32> = b.pages().to_vec();
        all.sort();
        assert_eq!(all, vec![0, 1, 2, 3], "no page handed out twice");
        drop(b);
        assert_eq!(pool.stats().free, 4);
    }
}
