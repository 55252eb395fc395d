//! The device's page memory (one buffer for KV blocks and adapter rows) and the KV block table
//! of a sequence.

use loraplex_kernels::{Backend, KernelError, KvLayout};

use super::{CachedPages, EntryKind, PageLease, PagePin, PagePool};

/// The one device buffer every page lives in, and the pool that hands the pages out. A page is
/// one KV block (see [`KvLayout`]) or a page of adapter rows of the same size.
pub struct DevicePool<B: Backend> {
    pub buffer: B::Buffer,
    pub layout: KvLayout,
    pub pages: PagePool,
}

impl<B: Backend> DevicePool<B> {
    /// Allocates as many pages as fit in `bytes` (at least one).
    pub fn with_bytes(backend: &B, layout: KvLayout, bytes: usize) -> Result<Self, KernelError> {
        let pages = (bytes / layout.page_bytes()).max(1);
        Ok(Self { buffer: backend.zeros_f32(pages * layout.page_elems())?, layout, pages: PagePool::new(pages) })
    }

    /// Values in one page.
    pub fn page_elems(&self) -> usize {
        self.layout.page_elems()
    }
}

/// The KV blocks of one sequence: block `i` holds its tokens `i * block_size ..`.
///
/// A block is either owned (leased by this table, written as the sequence computes) or shared:
/// a full block of the prefix cache, or one that a sibling sample also reads, held by a pin and
/// never written again. Blocks only become shared once full, so writes only ever go to owned
/// blocks; a partly filled block another sequence needs is copied first.
#[derive(Debug)]
pub struct BlockTable {
    block_size: usize,
    /// Every block's page, in order.
    pages: Vec<u32>,
    /// `Some` for a shared block.
    pins: Vec<Option<PagePin>>,
    /// The owned blocks' pages.
    owned: PageLease,
}

impl BlockTable {
    pub fn new(pool: &PagePool, block_size: usize) -> Self {
        Self { block_size, pages: Vec::new(), pins: Vec::new(), owned: pool.empty_lease() }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// Blocks in the table.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Tokens the table can hold without growing.
    pub fn capacity(&self) -> usize {
        self.pages.len() * self.block_size
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows the table to hold `tokens` tokens; false (and unchanged) if the pool is short.
    pub fn reserve(&mut self, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(self.pages.len());
        if need == 0 {
            return true;
        }
        let before = self.owned.len();
        if !self.owned.grow(need) {
            return false;
        }
        self.pages.extend_from_slice(&self.owned.pages()[before..]);
        self.pins.extend((0..need).map(|_| None));
        true
    }

    /// Appends a shared, full block held by `pin`.
    pub fn push_shared(&mut self, page: u32, pin: PagePin) {
        self.pages.push(page);
        self.pins.push(Some(pin));
    }

    /// Whether block `i` is shared (read-only).
    pub fn is_shared(&self, i: usize) -> bool {
        self.pins.get(i).is_some_and(Option::is_some)
    }

    /// A new pin of shared block `i`.
    pub fn pin_of(&self, i: usize) -> Option<PagePin> {
        self.pins.get(i)?.clone()
    }

    /// Turns owned block `i`, which must be full, into a pool cache entry (of `tenant`'s) this
    /// table keeps pinned. Returns the entry's owner handle; whoever keeps it keeps the block
    /// cached after the table lets go. `None` if block `i` is not owned.
    pub fn share(&mut self, i: usize, tenant: Option<&std::sync::Arc<str>>) -> Option<CachedPages> {
        if self.pins.get(i)?.is_some() {
            return None;
        }
        let (entry, pin) = self.owned.into_entry(self.pages[i], EntryKind::Prefix, tenant.cloned())?;
        self.pins[i] = Some(pin);
        Some(entry)
    }

    /// The cache slot of the token at `pos` (which must be below `capacity()`).
    pub fn slot(&self, pos: usize) -> u32 {
        self.pages[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
    }
}

impl Drop for BlockTable {
    /// Lets go of shared blocks from the last: the pool's LRU then evicts a chain's tail before
    /// its head, and what stays cached is still a prefix.
    fn drop(&mut self) {
        while let Some(pin) = self.pins.pop() {
            drop(pin);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_table_maps_positions_to_slots() {
        let pool = PagePool::new(8);
        let _hole = pool.lease(2).unwrap();
        let mut t = BlockTable::new(&pool, 4);
        assert!(t.reserve(5));
        assert_eq!(t.pages(), &[2, 3]);
        assert_eq!(t.capacity(), 8);
        assert_eq!(t.slot(0), 8);
        assert_eq!(t.slot(5), 13);
        assert!(t.reserve(8), "already enough");
        assert_eq!(pool.stats().free, 4);
        assert!(!t.reserve(100));
        assert_eq!(t.pages().len(), 2, "a failed reserve changes nothing");
        drop(t);
        assert_eq!(pool.stats().free, 6);
    }

    #[test]
    fn shared_blocks_are_pinned_and_outlive_the_table() {
        let pool = PagePool::new(6);
        let mut a = BlockTable::new(&pool, 4);
        assert!(a.reserve(10));
        let entry = a.share(0, None).expect("block 0 is owned");
        assert!(a.share(0, None).is_none(), "already shared");
        assert!(a.is_shared(0) && !a.is_shared(1));
        let mut b = BlockTable::new(&pool, 4);
        b.push_shared(a.pages()[0], a.pin_of(0).unwrap());
        assert!(b.reserve(6));
        assert_eq!(b.pages()[0], a.pages()[0]);
        assert_ne!(b.pages()[1], a.pages()[1]);
        assert_eq!(b.slot(2), a.slot(2), "the shared block maps the same slots");
        assert_eq!((pool.stats().kv, pool.stats().cached), (3, 1));
        drop(a);
        drop(b);
        assert_eq!((pool.stats().free, pool.stats().reclaimable), (5, 1), "the shared block stays cached");
        assert!(entry.is_resident());
        drop(entry);
        assert_eq!(pool.stats().free, 6);
    }
}
