//! Launch plans: pure functions from an op's (already checked) arguments to the grid, block and
//! shared memory of its launches, and the small index lists a launch needs (LoRA tiles, prefill
//! tiles). No CUDA here: every plan is unit-tested on any machine, and a launch only consumes one.
//!
//! The constants mirror the `#define`s of `kernels/cuda/*.cu`; a plan that disagrees with its
//! kernel is a bug the GPU tests catch.

use crate::{KernelError, Result};

/// Largest head dimension the attention kernels hold in registers (`MAX_LANE_DIMS * 32`).
pub const MAX_HEAD_DIM: usize = 256;
/// Query tokens per prefill tile (`PREFILL_Q`).
pub const PREFILL_Q: usize = 16;
/// Keys staged per prefill step (`PREFILL_K`).
pub const PREFILL_K: usize = 32;
/// Warps of a prefill block (`PREFILL_WARPS`).
pub const PREFILL_WARPS: usize = 4;
/// Warps of a decode block.
pub const DECODE_WARPS: usize = 4;
/// Below this many keys a decode row is never split into partitions.
pub const DECODE_MIN_PART: usize = 256;
/// Tokens per LoRA tile (`LORA_TILE`).
pub const LORA_TILE: usize = 8;
/// Warps of a LoRA shrink block (one block per tile and rank row; the warps split its inputs).
pub const SHRINK_WARPS: usize = 8;
/// Threads of a LoRA expand block; each owns one output.
pub const EXPAND_THREADS: usize = 128;
/// Shared memory a block gets without opting in.
pub const DEFAULT_SMEM: usize = 48 * 1024;
/// Blocks of a grid-stride elementwise launch, at most.
const MAX_STRIDE_BLOCKS: usize = 4096;
/// Largest grid dimension y and z.
const MAX_GRID_YZ: usize = 65535;
/// Largest grid dimension x.
const MAX_GRID_X: usize = (1 << 31) - 1;

/// One kernel launch's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
}

fn dim(op: &'static str, what: &str, n: usize, limit: usize) -> Result<u32> {
    if n == 0 || n > limit {
        return Err(KernelError::Shape { op, detail: format!("{what} of {n} does not fit a launch (1..={limit})") });
    }
    Ok(n as u32)
}

/// Threads for a loop over `n` elements of a row: a multiple of 32 from 32 to `max`.
fn row_threads(n: usize, max: usize) -> u32 {
    n.div_ceil(32).clamp(1, max / 32) as u32 * 32
}

/// One block per row of `dim` elements (embedding, RMS norm, row gather).
pub fn per_row(op: &'static str, rows: usize, row_len: usize) -> Result<Launch> {
    Ok(Launch { grid: (dim(op, "rows", rows, MAX_GRID_X)?, 1, 1), block: row_threads(row_len, 256), smem: 0 })
}

/// A grid-stride loop over `n` elements.
pub fn elementwise(op: &'static str, n: usize) -> Result<Launch> {
    let blocks = n.div_ceil(256).min(MAX_STRIDE_BLOCKS);
    Ok(Launch { grid: (dim(op, "elements", blocks, MAX_GRID_X)?, 1, 1), block: 256, smem: 0 })
}

/// Rotary embedding over `tokens` rows of `heads` heads.
pub fn rope(op: &'static str, tokens: usize, heads: usize, head_dim: usize) -> Result<Launch> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(KernelError::Shape { op, detail: format!("head_dim {head_dim} is odd") });
    }
    Ok(Launch { grid: (dim(op, "tokens", tokens, MAX_GRID_X)?, 1, 1), block: row_threads(heads * head_dim / 2, 256), smem: 0 })
}

/// How attention runs for one batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttentionPlan {
    /// One query token per sequence: `attn_decode`, split over `parts` partitions of
    /// `part_size` keys; with more than one part, `combine` merges them.
    /// `kernel` is the kernel's name without its type suffix: `attn_decode`, one block per query
    /// head, or a grouped one (`attn_decode_g{G}_d{LD}`), one block per KV head for its G query
    /// heads.
    Decode { launch: Launch, part_size: u32, parts: u32, combine: Option<Launch>, kernel: &'static str },
    /// Any batch: `attn_prefill` over tiles of (sequence, first token, token count).
    Prefill { launch: Launch, tiles: Vec<u32> },
}

/// What a plan needs to know of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Multiprocessors.
    pub sm_count: usize,
    /// Shared memory a block may use after opting in.
    pub max_smem: usize,
    /// Decode with the grouped kernels where the heads' grouping has one (see
    /// [`grouped_decode_kernel`]).
    pub grouped_decode: bool,
}

/// The grouped decode kernel for `group` query heads a KV head and `head_dim`, if there is one:
/// groups of 2, 4 and 8, head_dim up to 256.
pub fn grouped_decode_kernel(group: usize, head_dim: usize) -> Option<&'static str> {
    let wide = head_dim > 128;
    Some(match (group, wide) {
        (2, false) => "attn_decode_g2_d4",
        (2, true) => "attn_decode_g2_d8",
        (4, false) => "attn_decode_g4_d4",
        (4, true) => "attn_decode_g4_d8",
        (8, false) => "attn_decode_g8_d4",
        (8, true) => "attn_decode_g8_d8",
        _ => return None,
    })
    .filter(|_| head_dim <= MAX_HEAD_DIM)
}

/// Every grouped decode kernel's name (without its type suffix).
pub const GROUPED_DECODE_KERNELS: [&str; 6] =
    ["attn_decode_g2_d4", "attn_decode_g2_d8", "attn_decode_g4_d4", "attn_decode_g4_d8", "attn_decode_g8_d4", "attn_decode_g8_d8"];

/// The attention plan for a checked batch: `seq_starts` (`[seqs + 1]`), each token's position
/// and key window; `heads` query heads over `kv_heads` KV heads.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    op: &'static str,
    seq_starts: &[u32],
    positions: &[u32],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    limits: Limits,
) -> Result<AttentionPlan> {
    let Limits { sm_count, max_smem, grouped_decode } = limits;
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(KernelError::Shape { op, detail: format!("head_dim {head_dim} is outside 1..={MAX_HEAD_DIM}") });
    }
    let tokens = positions.len();
    let seqs = seq_starts.len().saturating_sub(1);
    dim(op, "tokens", tokens, MAX_GRID_X)?;
    let heads_dim = dim(op, "heads", heads, MAX_GRID_YZ)?;
    if tokens == seqs {
        // Decode: split long contexts when the batch alone cannot fill the device.
        let keys = |p: u32| {
            let p = p as usize + 1;
            window.map_or(p, |w| p.min(w))
        };
        let max_keys = positions.iter().map(|&p| keys(p)).max().unwrap_or(1);
        let group = if kv_heads > 0 && heads.is_multiple_of(kv_heads) { heads / kv_heads } else { 1 };
        let grouped = grouped_decode.then(|| grouped_decode_kernel(group, head_dim)).flatten();
        // A block per query head, or per KV head for the grouped kernels.
        let (kernel, block_heads) = match grouped {
            Some(name) => (name, dim(op, "KV heads", kv_heads, MAX_GRID_YZ)?),
            None => ("attn_decode", heads_dim),
        };
        let blocks = tokens * block_heads as usize;
        let want = 2 * sm_count.max(1);
        let parts =
            if blocks >= want || max_keys <= DECODE_MIN_PART { 1 } else { want.div_ceil(blocks).min(max_keys.div_ceil(DECODE_MIN_PART)).clamp(1, MAX_GRID_YZ) };
        let part_size = max_keys.div_ceil(parts).next_multiple_of(32);
        let parts = max_keys.div_ceil(part_size);
        let smem = match grouped {
            Some(_) => (group * head_dim + 2 * DECODE_WARPS * group + DECODE_WARPS * group * head_dim) * 4,
            None => ((2 + head_dim) * DECODE_WARPS + head_dim) * 4,
        };
        if smem > max_smem {
            return Err(KernelError::Shape { op, detail: format!("decode needs {smem} bytes of shared memory, the device allows {max_smem}") });
        }
        let launch = Launch { grid: (tokens as u32, block_heads, parts as u32), block: (DECODE_WARPS * 32) as u32, smem: smem as u32 };
        let combine = (parts > 1).then(|| Launch { grid: (tokens as u32, heads_dim, 1), block: row_threads(head_dim, 256), smem: 0 });
        return Ok(AttentionPlan::Decode { launch, part_size: part_size as u32, parts: parts as u32, combine, kernel });
    }
    let smem = prefill_smem(head_dim);
    if smem > max_smem {
        return Err(KernelError::Shape { op, detail: format!("head_dim {head_dim} needs {smem} bytes of shared memory, the device allows {max_smem}") });
    }
    let mut tiles = Vec::new();
    for s in 0..seqs {
        let (a, b) = (seq_starts[s] as usize, seq_starts[s + 1] as usize);
        for t0 in (a..b).step_by(PREFILL_Q) {
            tiles.extend_from_slice(&[s as u32, t0 as u32, (b - t0).min(PREFILL_Q) as u32]);
        }
    }
    let n = tiles.len() / 3;
    Ok(AttentionPlan::Prefill {
        launch: Launch { grid: (dim(op, "tiles", n, MAX_GRID_X)?, heads_dim, 1), block: (PREFILL_WARPS * 32) as u32, smem: smem as u32 },
        tiles,
    })
}

/// Shared memory of a prefill block: Q tile, padded K tile, V tile, as f32.
pub fn prefill_smem(head_dim: usize) -> usize {
    (PREFILL_Q * head_dim + PREFILL_K * (head_dim + 1) + PREFILL_K * head_dim) * 4
}

/// LoRA tiles (slot, first token, count) from segments: each segment cut into runs of at most
/// [`LORA_TILE`] tokens. With `keep_idle`, segments without an adapter stay (shrink writes their
/// zeros); otherwise they and empty segments are dropped.
pub fn segment_tiles(starts: &[u32], slots: &[u32], keep: impl Fn(u32) -> bool) -> Vec<u32> {
    let mut tiles = Vec::new();
    for (s, &slot) in slots.iter().enumerate() {
        if !keep(slot) {
            continue;
        }
        let (a, b) = (starts[s] as usize, starts[s + 1] as usize);
        for t0 in (a..b).step_by(LORA_TILE) {
            tiles.extend_from_slice(&[slot, t0 as u32, (b - t0).min(LORA_TILE) as u32]);
        }
    }
    tiles
}

/// LoRA tiles from one slot per row (decode): runs of consecutive rows with the same slot, each
/// cut into at most [`LORA_TILE`] rows, so rows sharing an adapter read its weights once.
pub fn row_tiles(slots: &[u32], keep: impl Fn(u32) -> bool) -> Vec<u32> {
    let mut tiles = Vec::new();
    let mut t = 0;
    while t < slots.len() {
        let slot = slots[t];
        let mut end = t + 1;
        while end < slots.len() && end - t < LORA_TILE && slots[end] == slot {
            end += 1;
        }
        if keep(slot) {
            tiles.extend_from_slice(&[slot, t as u32, (end - t) as u32]);
        }
        t = end;
    }
    tiles
}

/// The shrink launch over `tiles` (a list of triples) for a target of `max_rank`.
pub fn lora_shrink(op: &'static str, tiles: usize, max_rank: usize) -> Result<Launch> {
    Ok(Launch { grid: (dim(op, "tiles", tiles, MAX_GRID_X)?, dim(op, "rank rows", max_rank, MAX_GRID_YZ)?, 1), block: (SHRINK_WARPS * 32) as u32, smem: 0 })
}

/// The expand launch over `tiles` for a target of `out_features` outputs.
pub fn lora_expand(op: &'static str, tiles: usize, out_features: usize) -> Result<Launch> {
    Ok(Launch {
        grid: (dim(op, "tiles", tiles, MAX_GRID_X)?, dim(op, "output blocks", out_features.div_ceil(EXPAND_THREADS), MAX_GRID_YZ)?, 1),
        block: EXPAND_THREADS as u32,
        smem: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NO_ADAPTER;

    fn lim(sm_count: usize, max_smem: usize) -> Limits {
        Limits { sm_count, max_smem, grouped_decode: false }
    }

    #[test]
    fn row_launches_round_threads_to_warps() {
        let l = per_row("t", 3, 100).unwrap();
        assert_eq!(l, Launch { grid: (3, 1, 1), block: 128, smem: 0 });
        assert_eq!(per_row("t", 1, 4096).unwrap().block, 256);
        assert_eq!(per_row("t", 1, 1).unwrap().block, 32);
        assert!(per_row("t", 0, 8).is_err());
    }

    #[test]
    fn elementwise_caps_the_grid_and_strides() {
        assert_eq!(elementwise("t", 1000).unwrap().grid.0, 4);
        assert_eq!(elementwise("t", 1 << 40).unwrap().grid.0, MAX_STRIDE_BLOCKS as u32);
        assert!(elementwise("t", 0).is_err());
    }

    #[test]
    fn rope_rejects_odd_heads() {
        assert!(rope("t", 2, 4, 7).is_err());
        assert_eq!(rope("t", 2, 32, 128).unwrap().block, 256);
        assert_eq!(rope("t", 2, 1, 6).unwrap().block, 32);
    }

    #[test]
    fn decode_batches_split_long_contexts_only_when_the_grid_is_small() {
        // One sequence, 4096 keys, 8 heads, 132 SMs: 8 blocks want splitting.
        let p = attention("t", &[0, 1], &[4095], 8, 8, 128, None, lim(132, 227 * 1024)).unwrap();
        let AttentionPlan::Decode { launch, part_size, parts, combine, kernel } = p else { panic!("{p:?}") };
        assert_eq!(kernel, "attn_decode");
        assert!(parts > 1 && parts as usize * part_size as usize >= 4096 && (parts as usize - 1) * (part_size as usize) < 4096);
        assert_eq!(part_size % 32, 0);
        assert_eq!(launch.grid, (1, 8, parts));
        assert_eq!(launch.smem as usize, ((2 + 128) * DECODE_WARPS + 128) * 4);
        assert!(combine.is_some());
        // Many sequences fill the device: no split.
        let starts: Vec<u32> = (0..=64).collect();
        let positions = vec![4095u32; 64];
        let p = attention("t", &starts, &positions, 32, 32, 128, None, lim(132, 227 * 1024)).unwrap();
        assert!(matches!(p, AttentionPlan::Decode { parts: 1, combine: None, .. }), "{p:?}");
        // A sliding window bounds the keys.
        let p = attention("t", &[0, 1], &[100_000], 8, 8, 128, Some(128), lim(132, 227 * 1024)).unwrap();
        assert!(matches!(p, AttentionPlan::Decode { parts: 1, .. }), "{p:?}");
    }

    #[test]
    fn grouped_decode_takes_a_block_per_kv_head_where_a_kernel_fits_the_group() {
        let grouped = Limits { grouped_decode: true, ..lim(132, 227 * 1024) };
        let starts: Vec<u32> = (0..=16).collect();
        let positions = vec![1023u32; 16];
        // 32 heads over 8 KV heads: groups of 4, a block per KV head.
        let p = attention("t", &starts, &positions, 32, 8, 128, None, grouped).unwrap();
        let AttentionPlan::Decode { launch, kernel, .. } = p else { panic!("{p:?}") };
        assert_eq!((kernel, launch.grid.1), ("attn_decode_g4_d4", 8));
        assert_eq!(launch.smem as usize, (4 * 128 + 2 * DECODE_WARPS * 4 + DECODE_WARPS * 4 * 128) * 4);
        // head_dim 256 takes the wide variant; groups without a kernel (3) and plain multi-head
        // attention keep a block per query head, as does a backend that does not group.
        let wide = attention("t", &starts, &positions, 16, 2, 256, None, grouped).unwrap();
        assert!(matches!(wide, AttentionPlan::Decode { kernel: "attn_decode_g8_d8", .. }), "{wide:?}");
        for (heads, kv, limits) in [(24, 8, grouped), (32, 32, grouped), (32, 8, lim(132, 227 * 1024))] {
            let p = attention("t", &starts, &positions, heads, kv, 128, None, limits).unwrap();
            assert!(matches!(p, AttentionPlan::Decode { kernel: "attn_decode", launch: Launch { grid: (16, h, _), .. }, .. } if h as usize == heads), "{p:?}");
        }
        assert!(
            GROUPED_DECODE_KERNELS
                .iter()
                .all(|k| (1..=3).any(|g| grouped_decode_kernel(1 << g, 64) == Some(*k) || grouped_decode_kernel(1 << g, 200) == Some(*k)))
        );
    }

    #[test]
    fn prefill_tiles_cover_every_token_once_within_its_sequence() {
        let starts = [0u32, 5, 5, 40];
        let positions: Vec<u32> = (0..40).collect();
        let p = attention("t", &starts, &positions, 4, 4, 64, None, lim(132, DEFAULT_SMEM)).unwrap();
        let AttentionPlan::Prefill { launch, tiles } = p else { panic!() };
        let mut seen = [0; 40];
        for t in tiles.chunks_exact(3) {
            let (s, t0, n) = (t[0] as usize, t[1] as usize, t[2] as usize);
            assert!((1..=PREFILL_Q).contains(&n));
            assert!(t0 >= starts[s] as usize && t0 + n <= starts[s + 1] as usize);
            for c in &mut seen[t0..t0 + n] {
                *c += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
        assert_eq!(launch.grid, ((tiles.len() / 3) as u32, 4, 1));
        assert_eq!(launch.smem as usize, prefill_smem(64));
    }

    #[test]
    fn attention_rejects_head_dims_it_cannot_hold() {
        assert!(attention("t", &[0, 1], &[0], 1, 1, 512, None, lim(1, 1 << 20)).is_err());
        // 256 needs more than the default shared memory for prefill.
        assert!(attention("t", &[0, 2], &[0, 1], 1, 1, 256, None, lim(1, DEFAULT_SMEM)).is_err());
        assert!(attention("t", &[0, 2], &[0, 1], 1, 1, 256, None, lim(1, 227 * 1024)).is_ok());
    }

    #[test]
    fn lora_tiles_group_rows_of_one_adapter() {
        let slots = [1, 1, 1, NO_ADAPTER, 0, 0, 1];
        assert_eq!(row_tiles(&slots, |_| true), vec![1, 0, 3, NO_ADAPTER, 3, 1, 0, 4, 2, 1, 6, 1]);
        assert_eq!(row_tiles(&slots, |s| s != NO_ADAPTER), vec![1, 0, 3, 0, 4, 2, 1, 6, 1]);
        let long = [2u32; 19];
        let t = row_tiles(&long, |_| true);
        assert_eq!(t, vec![2, 0, 8, 2, 8, 8, 2, 16, 3]);
        let t = segment_tiles(&[0, 19, 19, 20], &[5, 6, NO_ADAPTER], |s| s != NO_ADAPTER);
        assert_eq!(t, vec![5, 0, 8, 5, 8, 8, 5, 16, 3]);
        assert_eq!(segment_tiles(&[0, 3], &[NO_ADAPTER], |_| true), vec![NO_ADAPTER, 0, 3]);
    }

    #[test]
    fn lora_launches_cover_ranks_and_outputs() {
        let s = lora_shrink("t", 5, 17).unwrap();
        assert_eq!(s.grid, (5, 17, 1));
        assert_eq!(s.block as usize, SHRINK_WARPS * 32);
        let e = lora_expand("t", 5, 4097).unwrap();
        assert_eq!(e.grid, (5, 33, 1));
        assert!(lora_shrink("t", 0, 8).is_err());
    }
}
