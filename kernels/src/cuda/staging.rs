//! How an upload's writes are laid out in page-locked staging chunks: every chunk the same size,
//! so that chunks are kept and reused whatever the size of the upload (an adapter of any rank on
//! any model), never allocated and freed per upload, which costs far more than the copy.
//!
//! The layout is planned on the host alone, so it is tested without a device: the writes go into
//! the chunks back to back in order, a write split where a chunk ends; each chunk's copies to the
//! device are the pieces that landed in it, neighbours merged where both their staging and their
//! destination continue one another (consecutive pool pages make one copy).

/// A part of one write as it lands in a chunk: `len` values of write `write` from its value
/// `from`, at `at` in the chunk (where it goes on the device is its chunk's copies' business).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub write: usize,
    pub from: usize,
    pub at: usize,
    pub len: usize,
}

/// One host-to-device copy: `len` values at `at` in the chunk to `dst` in the device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    pub at: usize,
    pub dst: usize,
    pub len: usize,
}

/// What one chunk holds, and the copies that send it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    pub pieces: Vec<Piece>,
    pub copies: Vec<Copy>,
}

/// The chunks of `chunk` values (more than zero) that `writes`, each `(destination, length)`,
/// fill in order; empty writes take no room.
pub(crate) fn plan(writes: &[(usize, usize)], chunk: usize) -> Vec<ChunkPlan> {
    assert!(chunk > 0, "a staging chunk holds at least one value");
    let mut chunks: Vec<ChunkPlan> = Vec::new();
    let mut at = chunk; // the first write opens a chunk
    for (write, &(dst, len)) in writes.iter().enumerate() {
        let mut from = 0;
        while from < len {
            if at == chunk {
                chunks.push(ChunkPlan::default());
                at = 0;
            }
            let n = (len - from).min(chunk - at);
            let current = chunks.last_mut().expect("a chunk was opened above");
            current.pieces.push(Piece { write, from, at, len: n });
            match current.copies.last_mut() {
                Some(c) if c.at + c.len == at && c.dst + c.len == dst + from => c.len += n,
                _ => current.copies.push(Copy { at, dst: dst + from, len: n }),
            }
            from += n;
            at += n;
        }
    }
    chunks
}

/// Values a thread fills at least: below this a thread's start costs more than it saves.
const FILL_SHARE_MIN: usize = 1 << 18;

/// Threads one chunk is filled on at most: a copy is bound by memory bandwidth, which a few
/// threads use up (one thread copies 6 to 7 GB/s on a Xeon server, so an 80 MB adapter alone
/// took 12 ms to stage).
const FILL_THREADS: usize = 8;

/// Writes a chunk's `pieces` of `writes` (each `(destination, values)`) into `host`, split into
/// equal contiguous shares filled in parallel where the chunk is large enough to pay for it.
pub(crate) fn fill(host: &mut [f32], pieces: &[Piece], writes: &[(usize, &[f32])]) {
    use rayon::prelude::*;
    let end = pieces.iter().map(|p| p.at + p.len).max().unwrap_or(0);
    let threads = (end / FILL_SHARE_MIN).clamp(1, FILL_THREADS);
    let share = end.div_ceil(threads).max(1);
    let fill_share = |(k, part): (usize, &mut [f32])| {
        let lo = k * share;
        let hi = lo + part.len();
        for p in pieces {
            let (from, to) = (p.at.max(lo), (p.at + p.len).min(hi));
            if from < to {
                let data = &writes[p.write].1[p.from + (from - p.at)..p.from + (to - p.at)];
                part[from - lo..to - lo].copy_from_slice(data);
            }
        }
    };
    if threads == 1 {
        fill_share((0, &mut host[..end]));
    } else {
        host[..end].par_chunks_mut(share).enumerate().for_each(fill_share);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stages `writes` (destination, values) through the plan into chunks, then copies each
    /// chunk's copies into a device image: the image must hold what writing each directly does.
    fn replay(writes: &[(usize, Vec<f32>)], chunk: usize, device_len: usize) -> (Vec<f32>, Vec<ChunkPlan>) {
        let shape: Vec<(usize, usize)> = writes.iter().map(|(d, v)| (*d, v.len())).collect();
        let plans = plan(&shape, chunk);
        let mut device = vec![0f32; device_len];
        for p in &plans {
            let mut staged = vec![f32::NAN; chunk];
            for piece in &p.pieces {
                staged[piece.at..piece.at + piece.len].copy_from_slice(&writes[piece.write].1[piece.from..piece.from + piece.len]);
            }
            for c in &p.copies {
                assert!(c.at + c.len <= chunk, "a copy past its chunk: {c:?}");
                device[c.dst..c.dst + c.len].copy_from_slice(&staged[c.at..c.at + c.len]);
            }
        }
        (device, plans)
    }

    fn direct(writes: &[(usize, Vec<f32>)], device_len: usize) -> Vec<f32> {
        let mut device = vec![0f32; device_len];
        for (d, v) in writes {
            device[*d..*d + v.len()].copy_from_slice(v);
        }
        device
    }

    fn values(start: usize, n: usize) -> Vec<f32> {
        (start..start + n).map(|i| i as f32 + 1.0).collect()
    }

    #[test]
    fn writes_split_across_chunks_land_where_each_was_aimed() {
        // Scattered destinations, lengths below, at and above the chunk, an empty write.
        let writes = vec![(500, values(0, 7)), (40, values(100, 16)), (200, vec![]), (300, values(200, 37)), (0, values(400, 3))];
        for chunk in [1, 3, 16, 20, 64, 1000] {
            let (device, plans) = replay(&writes, chunk, 600);
            assert_eq!(device, direct(&writes, 600), "chunk {chunk}");
            let total: usize = writes.iter().map(|(_, v)| v.len()).sum();
            assert_eq!(plans.len(), total.div_ceil(chunk), "chunk {chunk}: chunks filled back to back");
            for p in &plans {
                assert!(!p.pieces.is_empty() && !p.copies.is_empty(), "chunk {chunk}: no empty chunk");
            }
        }
    }

    #[test]
    fn consecutive_destinations_make_one_copy_a_chunk() {
        // Eight pool pages of 10 values, one after another, then one elsewhere.
        let mut writes: Vec<(usize, Vec<f32>)> = (0..8).map(|i| (1000 + 10 * i, values(10 * i, 10))).collect();
        writes.push((50, values(500, 10)));
        let (device, plans) = replay(&writes, 1 << 10, 2000);
        assert_eq!(device, direct(&writes, 2000));
        assert_eq!(plans.len(), 1);
        assert_eq!(plans[0].copies, vec![Copy { at: 0, dst: 1000, len: 80 }, Copy { at: 80, dst: 50, len: 10 }]);
        assert_eq!(plans[0].pieces.len(), 9, "each write is still filled on its own");
        // Split by a chunk boundary at 25 values: the run continues as one copy in each chunk.
        let (device, plans) = replay(&writes, 25, 2000);
        assert_eq!(device, direct(&writes, 2000));
        let copies: Vec<Vec<Copy>> = plans.iter().map(|p| p.copies.clone()).collect();
        assert_eq!(copies[0], vec![Copy { at: 0, dst: 1000, len: 25 }]);
        assert_eq!(copies[3], vec![Copy { at: 0, dst: 1075, len: 5 }, Copy { at: 5, dst: 50, len: 10 }]);
    }

    #[test]
    fn a_chunk_filled_in_shares_holds_what_one_thread_writes() {
        // Enough values for several shares, pieces straddling the shares' edges, a tail write
        // that ends inside the chunk.
        let chunk = FILL_SHARE_MIN * 5 + 13;
        let lens = [FILL_SHARE_MIN / 3, FILL_SHARE_MIN * 2 + 7, 1, FILL_SHARE_MIN + 100, FILL_SHARE_MIN * 3, FILL_SHARE_MIN * 2];
        let data: Vec<Vec<f32>> = lens.iter().enumerate().map(|(i, &n)| values(i * 1_000_000, n)).collect();
        let writes: Vec<(usize, &[f32])> = data.iter().enumerate().map(|(i, v)| (i * 10_000_000, v.as_slice())).collect();
        let shape: Vec<(usize, usize)> = writes.iter().map(|(d, v)| (*d, v.len())).collect();
        let plans = plan(&shape, chunk);
        assert!(plans.len() >= 2);
        for p in &plans {
            let mut want = vec![f32::NAN; chunk];
            for piece in &p.pieces {
                want[piece.at..piece.at + piece.len].copy_from_slice(&writes[piece.write].1[piece.from..piece.from + piece.len]);
            }
            let mut got = vec![f32::NAN; chunk];
            fill(&mut got, &p.pieces, &writes);
            let end = p.pieces.iter().map(|x| x.at + x.len).max().unwrap();
            assert!(end / FILL_SHARE_MIN > 1, "the chunk is filled by several threads");
            assert_eq!(got[..end], want[..end]);
            assert!(got[end..].iter().all(|v| v.is_nan()), "nothing past the pieces is written");
        }
        let mut small = vec![0f32; 4];
        fill(&mut small, &[Piece { write: 0, from: 1, at: 1, len: 2 }], &[(0, &[5.0, 6.0, 7.0])]);
        assert_eq!(small, [0.0, 6.0, 7.0, 0.0]);
    }

    #[test]
    fn nothing_to_write_needs_no_chunk() {
        assert!(plan(&[], 8).is_empty());
        assert!(plan(&[(3, 0), (9, 0)], 8).is_empty());
    }
}
