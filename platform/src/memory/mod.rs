//! Device memory bookkeeping: the page pool and the KV blocks carved from it.
//!
//! The pool only counts pages; the bytes live in one device buffer owned by [`KvCache`]. A page
//! holds one KV block: `block_size` tokens of K and V for every layer (see
//! [`loraplex_kernels::KvLayout`]).

mod kv;
mod pool;

pub use kv::{BlockTable, KvCache};
pub use pool::{PageLease, PagePool, PoolStats};
