//! Device memory bookkeeping: the unified page pool, KV block tables, and adapter residency.
//!
//! One device buffer ([`DevicePool`]) is cut into equal pages. A page holds either one KV block
//! (`block_size` tokens of K and V for every layer, see [`loraplex_kernels::KvLayout`]) or rank
//! rows of adapters. [`PagePool`] only counts pages: who holds which, which are pinned, and the
//! LRU of unpinned ones. [`AdapterResidency`] moves adapters from disk through host memory into
//! pages.

mod adapters;
mod host;
mod kv;
mod pool;
mod prefix;

pub use adapters::{
    AdapterLocation, AdapterRef, AdapterResidency, HoldError, Holder, Location, Residency, ResidencyEvent, ResidentAdapter, ResidentRows, Tier,
};
pub use host::{AdapterLoader, HostAdapter, LoadTask, LoaderConfig, LoaderPool};
pub use kv::{BlockTable, DevicePool};
pub use pool::{CachedPages, EntryKind, PageLease, PagePin, PagePool, PoolStats};
pub use prefix::{BlockHash, PrefixCache, PrefixStats};
