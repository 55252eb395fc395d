//! The device's page memory (one buffer for KV blocks and adapter rows) and the KV block table
//! of a sequence.

use loraplex_kernels::{Backend, KernelError, KvLayout};

use super::{PageLease, PagePool};

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
        Ok(Self { buffer: backend.zeros(pages * layout.page_elems())?, layout, pages: PagePool::new(pages) })
    }

    /// Values in one page.
    pub fn page_elems(&self) -> usize {
        self.layout.page_elems()
    }
}

/// The KV blocks of one sequence: block `i` holds its tokens `i * block_size ..`.
#[derive(Debug)]
pub struct BlockTable {
    block_size: usize,
    blocks: PageLease,
}

impl BlockTable {
    pub fn new(pool: &PagePool, block_size: usize) -> Self {
        Self { block_size, blocks: pool.empty_lease() }
    }

    pub fn pages(&self) -> &[u32] {
        self.blocks.pages()
    }

    /// Tokens the table can hold without growing.
    pub fn capacity(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows the table to hold `tokens` tokens; false (and unchanged) if the pool is short.
    pub fn reserve(&mut self, tokens: usize) -> bool {
        let need = self.blocks_for(tokens).saturating_sub(self.blocks.len());
        need == 0 || self.blocks.grow(need)
    }

    /// The cache slot of the token at `pos` (which must be below `capacity()`).
    pub fn slot(&self, pos: usize) -> u32 {
        self.blocks.pages()[pos / self.block_size] * self.block_size as u32 + (pos % self.block_size) as u32
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
}
