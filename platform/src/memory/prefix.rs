//! The prefix cache: full KV blocks addressed by what produced them.
//!
//! A block's K/V depend on every token before it, on the adapter (its k and v projections may
//! carry LoRA deltas) and on nothing else. So a block is named by a hash chain: the root hashes
//! the cache namespace (the tenant, unless the caller says otherwise) and the adapter's identity
//! and content hash; each full block hashes its parent's name and its own token ids. Equal
//! names mean equal K/V; another tenant, another adapter or another version of one never share a
//! name.
//!
//! Cached blocks are pool entries ([`EntryKind::Prefix`](super::EntryKind)): pinned while a
//! sequence reads them, otherwise in the pool's single LRU with idle adapters, and evicted under
//! pressure. The cache keeps the owner handles; an evicted block is forgotten when next met.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::{CachedPages, PagePin};

/// The name of a full block: a hash of everything its K/V depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockHash([u8; 32]);

impl BlockHash {
    /// The chain's root: the namespace and the adapter, if any, as (identity, content hash).
    pub fn root(namespace: &str, adapter: Option<(&str, &str)>) -> Self {
        let mut h = Sha256::new();
        h.update(b"loraplex prefix v1\0");
        for part in [namespace, adapter.map_or("", |a| a.0), adapter.map_or("", |a| a.1)] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        h.update([adapter.is_some() as u8]);
        Self(h.finalize().into())
    }

    /// The name of the block holding `tokens` after the block named `self`.
    pub fn next(&self, tokens: &[u32]) -> Self {
        let mut h = Sha256::new();
        h.update(self.0);
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        Self(h.finalize().into())
    }

    /// The names of the full blocks of `tokens`, at most `max_blocks` of them.
    pub fn chain(root: Self, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<Self> {
        let mut out = Vec::new();
        let mut at = root;
        for block in tokens.chunks_exact(block_size).take(max_blocks) {
            at = at.next(block);
            out.push(at);
        }
        out
    }
}

/// Counters of the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixStats {
    /// Blocks known to the cache (some may have been evicted since).
    pub blocks: usize,
    /// Blocks looked up for new sequences, and how many of them were found.
    pub looked_up: u64,
    pub hits: u64,
}

/// Full KV blocks by name, on one device.
#[derive(Debug, Default)]
pub struct PrefixCache {
    blocks: HashMap<BlockHash, CachedPages>,
    looked_up: u64,
    hits: u64,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The longest run of `names`, from the first, whose blocks are resident, pinned for the
    /// caller: `(page, pin)` per block.
    pub fn lookup(&mut self, names: &[BlockHash]) -> Vec<(u32, PagePin)> {
        let mut found = Vec::new();
        for name in names {
            let Some(entry) = self.blocks.get(name) else { break };
            let Some(pin) = entry.pin() else {
                self.blocks.remove(name);
                break;
            };
            let pages = entry.pages();
            found.push((pages[0], pin));
        }
        self.looked_up += names.len() as u64;
        self.hits += found.len() as u64;
        found
    }

    /// Whether a resident block has this name.
    pub fn contains(&self, name: &BlockHash) -> bool {
        self.blocks.get(name).is_some_and(CachedPages::is_resident)
    }

    /// Keeps `entry` as the block named `name`, unless a resident one has that name already;
    /// then `entry` is handed back (its pages are freed once its pins are gone).
    pub fn insert(&mut self, name: BlockHash, entry: CachedPages) -> Result<(), CachedPages> {
        if self.contains(&name) {
            return Err(entry);
        }
        self.blocks.insert(name, entry);
        // Forget evicted blocks now and then, so the map stays near the pool's size.
        if self.blocks.len() >= 1024 && self.blocks.len().is_power_of_two() {
            self.blocks.retain(|_, e| e.is_resident());
        }
        Ok(())
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats { blocks: self.blocks.len(), looked_up: self.looked_up, hits: self.hits }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{BlockTable, PagePool};

    #[test]
    fn names_depend_on_namespace_adapter_version_and_every_token() {
        let tokens: Vec<u32> = (0..8).collect();
        let base = BlockHash::root("acme", None);
        let names = BlockHash::chain(base, &tokens, 4, usize::MAX);
        assert_eq!(names.len(), 2);
        assert_eq!(names, BlockHash::chain(BlockHash::root("acme", None), &tokens, 4, 8), "deterministic");
        let others = [
            BlockHash::root("globex", None),
            BlockHash::root("acme", Some(("acme/support@1", "aa"))),
            BlockHash::root("acme", Some(("acme/support@2", "aa"))),
            BlockHash::root("acme", Some(("acme/support@1", "bb"))),
            BlockHash::root("", None),
        ];
        for root in others {
            assert_ne!(BlockHash::chain(root, &tokens, 4, 8)[0], names[0]);
        }
        let mut changed = tokens.clone();
        changed[1] = 100;
        let changed = BlockHash::chain(base, &changed, 4, 8);
        assert_ne!(changed[0], names[0]);
        assert_ne!(changed[1], names[1], "a block's name carries every token before it");
        assert_eq!(BlockHash::chain(base, &tokens[..7], 4, 8).len(), 1, "only full blocks are named");
    }

    #[test]
    fn lookup_returns_the_longest_resident_run() {
        let pool = PagePool::new(8);
        let mut cache = PrefixCache::new();
        let names = BlockHash::chain(BlockHash::root("t", None), &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, 3);
        let mut table = BlockTable::new(&pool, 4);
        assert!(table.reserve(12));
        for (i, name) in names.iter().enumerate().take(2) {
            cache.insert(*name, table.share(i, None).unwrap()).unwrap();
        }
        assert!(cache.insert(names[0], table.share(2, None).unwrap()).is_err(), "a resident block keeps its name");
        let hit = cache.lookup(&names);
        assert_eq!(hit.iter().map(|h| h.0).collect::<Vec<_>>(), table.pages()[..2]);
        let foreign = BlockHash::chain(BlockHash::root("u", None), &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, 3);
        assert!(cache.lookup(&foreign).is_empty(), "same tokens, another namespace");
        drop((hit, table));
        assert_eq!(pool.stats().reclaimable, 2);
        let _all = pool.lease(7).expect("evicts one cached block");
        assert_eq!(cache.lookup(&names).len(), 1, "the chain's last block went first");
        assert_eq!(cache.stats(), PrefixStats { blocks: 1, looked_up: 9, hits: 3 });
    }
}
