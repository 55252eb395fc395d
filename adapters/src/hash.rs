//! Content addressing of adapters: a SHA-256 over a canonical encoding of what the serving path
//! computes with, independent of how the file stored it.
//!
//! Encoding (all integers little-endian):
//! - the 16 bytes `loraplex-lora-v1`;
//! - `u64` number of entries;
//! - per entry, sorted by layer then module ([`crate::TargetModule::ALL`] order):
//!   `u32` layer, `u8` module index ([`crate::TargetModule::index`]), `u32` rank,
//!   `u32` in_features, `u32` out_features, `u32` bit pattern of the f32 `scaling`,
//!   then the f32 bit patterns of `a` (`rank * in_features` values, row-major `[rank, in]`)
//!   and of `b` (`out_features * rank` values, row-major `[out, rank]`).
//!
//! Alpha is not hashed on its own: only `scaling` reaches the computation. Values are hashed as
//! their exact f32 bits after conversion, so an f16/bf16 file and an f32 file holding the same
//! (converted) values hash the same, and the order of tensors in the file does not matter.

use sha2::{Digest, Sha256};

use crate::LoraAdapter;

const DOMAIN: &[u8; 16] = b"loraplex-lora-v1";

fn u32_le(n: usize) -> [u8; 4] {
    // Dimensions are bounded by file sizes far below 4 Gi elements per axis; saturate rather
    // than wrap if a caller builds something larger by hand.
    u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes()
}

/// SHA-256 of the canonical encoding described in the module documentation.
pub fn content_hash(adapter: &LoraAdapter) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update((adapter.len() as u64).to_le_bytes());
    let mut buf = Vec::new();
    for m in adapter.modules() {
        h.update(u32_le(m.layer));
        h.update([m.module.index() as u8]);
        h.update(u32_le(m.rank));
        h.update(u32_le(m.in_features));
        h.update(u32_le(m.out_features));
        h.update(m.scaling.to_bits().to_le_bytes());
        for values in [&m.a, &m.b] {
            buf.clear();
            buf.extend(values.iter().flat_map(|v| v.to_bits().to_le_bytes()));
            h.update(&buf);
        }
    }
    h.finalize().into()
}

/// Lowercase hex of a digest.
pub fn to_hex(digest: &[u8; 32]) -> String {
    use std::fmt::Write;
    digest.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}
