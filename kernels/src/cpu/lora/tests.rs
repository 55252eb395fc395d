use super::*;
use crate::cpu::Path;
use crate::{DType, KernelError, NO_ADAPTER, NUM_MODULES};

const LAYERS: usize = 2;
/// (in_features, out_features) of q, k, v, o, gate, up, down: hidden 53, kv 19, intermediate 100,
/// none a multiple of the vector width.
const SHAPES: [(usize, usize); NUM_MODULES] = [(53, 53), (53, 19), (53, 19), (53, 53), (53, 100), (53, 100), (100, 53)];
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const O: usize = 3;
const GATE: usize = 4;
const UP: usize = 5;
const DOWN: usize = 6;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() >> 33) as usize % n
    }

    fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0).collect()
    }
}

/// The (layer, module, rank) targets of each adapter slot: ranks 4 (6 on down, a rank pattern),
/// 8, 16, 64 and 2, with different target sets.
fn adapter_targets(slot: usize) -> Vec<(usize, usize, usize)> {
    let both = |mods: &[usize], rank: usize| -> Vec<(usize, usize, usize)> { (0..LAYERS).flat_map(|l| mods.iter().map(move |&m| (l, m, rank))).collect() };
    match slot {
        0 => (0..LAYERS).flat_map(|l| (0..NUM_MODULES).map(move |m| (l, m, if m == DOWN { 6 } else { 4 }))).collect(),
        1 => both(&[Q, V], 8),
        2 => both(&[GATE, UP, DOWN], 16),
        3 => vec![(0, Q, 64), (1, Q, 64), (0, O, 64), (1, DOWN, 64)],
        4 => vec![(1, K, 2)],
        _ => unreachable!(),
    }
}

const SLOTS: usize = 5;

/// Dense copy of one adapter's matrices for one (layer, module): A `[rank, in]`, Bᵀ `[rank, out]`.
struct Dense {
    a: Vec<f32>,
    bt: Vec<f32>,
}

/// A pool with several adapters' rows scattered through it, and the dense truth next to it.
struct Fixture {
    pool: Vec<f32>,
    directory: Vec<u32>,
    a_rows: Vec<u32>,
    b_rows: Vec<u32>,
    /// `[slot][layer * NUM_MODULES + module]`.
    dense: Vec<Vec<Option<Dense>>>,
}

impl Fixture {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut directory = vec![0u32; SLOTS * LAYERS * NUM_MODULES * 2];
        let (mut a_rows, mut b_rows) = (Vec::new(), Vec::new());
        let mut dense: Vec<Vec<Option<Dense>>> = (0..SLOTS).map(|_| (0..LAYERS * NUM_MODULES).map(|_| None).collect()).collect();
        // Every row to place: (is A, index into a_rows/b_rows, data).
        let mut pending: Vec<(bool, usize, Vec<f32>)> = Vec::new();
        for (slot, dense_slot) in dense.iter_mut().enumerate() {
            for (layer, module, rank) in adapter_targets(slot) {
                let (inf, outf) = SHAPES[module];
                let a = rng.vec(rank * inf);
                let bt = rng.vec(rank * outf);
                let e = ((slot * LAYERS + layer) * NUM_MODULES + module) * 2;
                directory[e] = a_rows.len() as u32;
                directory[e + 1] = rank as u32;
                for r in 0..rank {
                    pending.push((true, a_rows.len(), a[r * inf..(r + 1) * inf].to_vec()));
                    pending.push((false, a_rows.len(), bt[r * outf..(r + 1) * outf].to_vec()));
                    a_rows.push(0);
                    b_rows.push(0);
                }
                dense_slot[layer * NUM_MODULES + module] = Some(Dense { a, bt });
            }
        }
        // Not-targeted entries carry a junk first index: rank 0 must make it irrelevant.
        for e in (0..directory.len()).step_by(2) {
            if directory[e + 1] == 0 {
                directory[e] = 0xdead_beef;
            }
        }
        // Place the rows in random order with random gaps; everything else in the pool is NaN, so
        // reading outside a row poisons the result.
        for i in (1..pending.len()).rev() {
            pending.swap(i, rng.below(i + 1));
        }
        let mut pool = vec![f32::NAN; 37 * LORA_ROW_ALIGN];
        for (is_a, index, data) in pending {
            pool.resize(pool.len() + rng.below(4) * LORA_ROW_ALIGN, f32::NAN);
            let unit = pool.len() / LORA_ROW_ALIGN;
            pool.extend_from_slice(&data);
            pool.resize(pool.len().next_multiple_of(LORA_ROW_ALIGN), f32::NAN);
            if is_a { a_rows[index] = unit as u32 } else { b_rows[index] = unit as u32 }
        }
        Fixture { pool, directory, a_rows, b_rows, dense }
    }

    fn rows(&self) -> LoraRows<CpuBuffer> {
        rows_of(&self.directory, &self.a_rows, &self.b_rows)
    }

    fn rank(&self, slot: u32, layer: usize, module: usize) -> usize {
        if slot == NO_ADAPTER {
            return 0;
        }
        let e = ((slot as usize * LAYERS + layer) * NUM_MODULES + module) * 2;
        self.directory[e + 1] as usize
    }

    /// The max_rank of a target: the largest rank any slot has there.
    fn max_rank(&self, layer: usize, module: usize) -> usize {
        (0..SLOTS as u32).map(|s| self.rank(s, layer, module)).max().unwrap()
    }
}

fn rows_of(directory: &[u32], a_rows: &[u32], b_rows: &[u32]) -> LoraRows<CpuBuffer> {
    LoraRows {
        num_slots: SLOTS,
        num_layers: LAYERS,
        directory: CpuBuffer::U32(directory.to_vec()),
        a_rows: CpuBuffer::U32(a_rows.to_vec()),
        b_rows: CpuBuffer::U32(b_rows.to_vec()),
        slot_dtypes: CpuBuffer::U32(vec![0; SLOTS]),
    }
}

fn target(layer: usize, module: usize, max_rank: usize) -> LoraTarget {
    let (in_features, out_features) = SHAPES[module];
    LoraTarget { layer, module, in_features, out_features, max_rank }
}

/// Segments from (slot, tokens) pairs.
fn segments(parts: &[(u32, usize)]) -> LoraSegments<CpuBuffer> {
    let mut starts = vec![0u32];
    for &(_, n) in parts {
        starts.push(starts.last().unwrap() + n as u32);
    }
    LoraSegments { num_segments: parts.len(), seg_starts: CpuBuffer::U32(starts), seg_slots: CpuBuffer::U32(parts.iter().map(|p| p.0).collect()) }
}

/// Each token's slot under `parts`.
fn token_slots(parts: &[(u32, usize)]) -> Vec<u32> {
    parts.iter().flat_map(|&(s, n)| std::iter::repeat_n(s, n)).collect()
}

/// Adapters mixed with unadapted tokens, an empty segment, a segment longer than a task's block,
/// the same adapter twice, and one adapter (slot 4) that targets almost nothing: 47 tokens.
const MIXED: [(u32, usize); 8] = [(2, 5), (NO_ADAPTER, 3), (3, 19), (0, 1), (4, 0), (2, 7), (NO_ADAPTER, 2), (1, 10)];

/// A recognizable, exactly representable pre-fill for accumulated outputs.
fn prefill(len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 31) % 17) as f32 * 0.25 - 2.0).collect()
}

fn f32s(buf: &CpuBuffer) -> &[f32] {
    buf.f32("test").unwrap()
}

/// Checks `v` (`[tokens, max_rank]`) and `y` (`y0` plus the update) against f64 arithmetic on
/// the dense matrices. Outputs of tokens without an update must be exactly zero (v) or exactly
/// as before (y).
fn check_against_reference(fx: &Fixture, t: &LoraTarget, slots: &[u32], x: &[f32], v: Option<&[f32]>, y0: &[f32], y: &[f32]) {
    let (inf, outf, mr) = (t.in_features, t.out_features, t.max_rank);
    for (tok, &slot) in slots.iter().enumerate() {
        let rank = fx.rank(slot, t.layer, t.module);
        let xt = &x[tok * inf..(tok + 1) * inf];
        let (y0t, yt) = (&y0[tok * outf..(tok + 1) * outf], &y[tok * outf..(tok + 1) * outf]);
        if rank == 0 {
            if let Some(v) = v {
                assert!(v[tok * mr..(tok + 1) * mr].iter().all(|&e| e.to_bits() == 0), "token {tok}: v must be zeros");
            }
            assert!(yt.iter().zip(y0t).all(|(a, b)| a.to_bits() == b.to_bits()), "token {tok} (slot {slot}) must be untouched");
            continue;
        }
        let d = fx.dense[slot as usize][t.layer * NUM_MODULES + t.module].as_ref().unwrap();
        // v_r and Σ|x_i a_ri|, which bounds its rounding error.
        let (vr, mag): (Vec<f64>, Vec<f64>) = (0..rank)
            .map(|r| {
                let ar = &d.a[r * inf..(r + 1) * inf];
                let terms = xt.iter().zip(ar).map(|(&p, &q)| p as f64 * q as f64);
                (terms.clone().sum::<f64>(), terms.map(f64::abs).sum::<f64>())
            })
            .unzip();
        if let Some(v) = v {
            let vt = &v[tok * mr..(tok + 1) * mr];
            for r in 0..rank {
                assert!((vt[r] as f64 - vr[r]).abs() <= 1e-5 * mag[r] + 1e-6, "token {tok} v[{r}] = {} vs {}", vt[r], vr[r]);
            }
            assert!(vt[rank..].iter().all(|&e| e.to_bits() == 0), "token {tok}: v beyond rank {rank} must be zeros");
        }
        for j in 0..outf {
            let (mut want, mut bound) = (y0t[j] as f64, (y0t[j] as f64).abs());
            for r in 0..rank {
                let b = d.bt[r * outf + j] as f64;
                want += vr[r] * b;
                bound += mag[r] * b.abs();
            }
            assert!((yt[j] as f64 - want).abs() <= 1e-5 * bound + 1e-6, "token {tok} (slot {slot}) y[{j}] = {} vs {want}", yt[j]);
        }
    }
}

/// Every (layer, module), with max_rank exactly the largest rank and with room to spare.
fn all_targets(fx: &Fixture) -> Vec<LoraTarget> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        for module in 0..NUM_MODULES {
            let need = fx.max_rank(layer, module);
            out.push(target(layer, module, need));
            out.push(target(layer, module, need + 5));
        }
    }
    out
}

/// SGMV shrink then expand over `parts`: (v, y) from a NaN-poisoned v and a pre-filled y.
fn run_sgmv(cpu: &CpuBackend, fx: &Fixture, parts: &[(u32, usize)], t: &LoraTarget, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let tokens = token_slots(parts).len();
    let (pool, rows, segs) = (CpuBuffer::F32(fx.pool.clone()), fx.rows(), segments(parts));
    let x = CpuBuffer::F32(x.to_vec());
    let mut v = CpuBuffer::F32(vec![f32::NAN; tokens * t.max_rank]);
    cpu.sgmv_shrink(&x, &pool, &rows, &segs, t, &mut v).unwrap();
    let mut y = CpuBuffer::F32(prefill(tokens * t.out_features));
    cpu.sgmv_expand(&v, &pool, &rows, &segs, t, &mut y).unwrap();
    (f32s(&v).to_vec(), f32s(&y).to_vec())
}

fn run_bgmv(cpu: &CpuBackend, fx: &Fixture, slots: &[u32], t: &LoraTarget, x: &[f32]) -> Vec<f32> {
    let (pool, rows) = (CpuBuffer::F32(fx.pool.clone()), fx.rows());
    let mut y = CpuBuffer::F32(prefill(slots.len() * t.out_features));
    cpu.bgmv(&CpuBuffer::F32(x.to_vec()), &pool, &rows, &CpuBuffer::U32(slots.to_vec()), t, &mut y).unwrap();
    f32s(&y).to_vec()
}

#[test]
fn sgmv_matches_dense_reference_for_mixed_segments() {
    for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
        let fx = Fixture::new(7);
        let slots = token_slots(&MIXED);
        assert_eq!(slots.len(), 47);
        let mut rng = Rng(99);
        for t in all_targets(&fx) {
            let x = rng.vec(slots.len() * t.in_features);
            let (v, y) = run_sgmv(&cpu, &fx, &MIXED, &t, &x);
            check_against_reference(&fx, &t, &slots, &x, Some(&v), &prefill(y.len()), &y);
        }
    }
}

#[test]
fn bgmv_matches_dense_reference_with_unadapted_rows() {
    for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
        let fx = Fixture::new(11);
        let slots = [3, NO_ADAPTER, 0, 2, 4, 1, 3, NO_ADAPTER, 2, 0, 1, 4, 3];
        let mut rng = Rng(5);
        for t in all_targets(&fx) {
            let x = rng.vec(slots.len() * t.in_features);
            let y = run_bgmv(&cpu, &fx, &slots, &t, &x);
            check_against_reference(&fx, &t, &slots, &x, None, &prefill(y.len()), &y);
        }
    }
}

#[test]
fn results_do_not_depend_on_segmentation() {
    for cpu in Path::available().into_iter().map(CpuBackend::with_path) {
        let fx = Fixture::new(23);
        let slots = token_slots(&MIXED);
        let per_token: Vec<(u32, usize)> = slots.iter().map(|&s| (s, 1)).collect();
        // The same tokens cut at other places: pieces of 3 within each segment.
        let pieces: Vec<(u32, usize)> = MIXED.iter().flat_map(|&(s, n)| (0..n).step_by(3).map(move |i| (s, 3.min(n - i)))).collect();
        assert_eq!(token_slots(&pieces), slots);
        let mut rng = Rng(1234);
        for t in all_targets(&fx) {
            let x = rng.vec(slots.len() * t.in_features);
            let (v_grouped, y_grouped) = run_sgmv(&cpu, &fx, &MIXED, &t, &x);
            let (v_single, y_single) = run_sgmv(&cpu, &fx, &per_token, &t, &x);
            let (v_pieces, y_pieces) = run_sgmv(&cpu, &fx, &pieces, &t, &x);
            let y_bgmv = run_bgmv(&cpu, &fx, &slots, &t, &x);
            assert_same_bits(&v_grouped, &v_single, &format!("{t:?}: v, grouped vs one segment per token"));
            assert_same_bits(&v_grouped, &v_pieces, &format!("{t:?}: v, grouped vs pieces"));
            assert_same_bits(&y_grouped, &y_single, &format!("{t:?}: y, grouped vs one segment per token"));
            assert_same_bits(&y_grouped, &y_pieces, &format!("{t:?}: y, grouped vs pieces"));
            assert_same_bits(&y_grouped, &y_bgmv, &format!("{t:?}: y, SGMV vs BGMV"));
        }
    }
}

/// Fails at the first element whose bits differ.
fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} is {} vs {}", a[i], b[i]);
    }
}

/// Runs all three ops with the given arguments and asserts each fails as `expect` says, leaving
/// its output exactly as it was.
struct Call {
    x: CpuBuffer,
    pool: CpuBuffer,
    rows: LoraRows<CpuBuffer>,
    segs: LoraSegments<CpuBuffer>,
    slots: CpuBuffer,
    target: LoraTarget,
    v: CpuBuffer,
    y: CpuBuffer,
}

/// Layer 1, q: every slot but 4 has rows there, slot 3 with rank 64.
const T_LAYER: usize = 1;
const T_MODULE: usize = Q;

impl Call {
    fn new(fx: &Fixture) -> Self {
        let t = target(T_LAYER, T_MODULE, 64);
        let tokens = token_slots(&MIXED).len();
        let slots = token_slots(&MIXED);
        Call {
            x: CpuBuffer::F32(Rng(3).vec(tokens * t.in_features)),
            pool: CpuBuffer::F32(fx.pool.clone()),
            rows: fx.rows(),
            segs: segments(&MIXED),
            slots: CpuBuffer::U32(slots),
            target: t,
            v: CpuBuffer::F32(vec![0.5; tokens * t.max_rank]),
            y: CpuBuffer::F32(prefill(tokens * t.out_features)),
        }
    }

    fn ok(mut self) {
        let cpu = CpuBackend::new();
        cpu.sgmv_shrink(&self.x, &self.pool, &self.rows, &self.segs, &self.target, &mut self.v).unwrap();
        cpu.sgmv_expand(&self.v, &self.pool, &self.rows, &self.segs, &self.target, &mut self.y).unwrap();
        cpu.bgmv(&self.x, &self.pool, &self.rows, &self.slots, &self.target, &mut self.y).unwrap();
    }

    /// `expect(op, error)` for each op whose arguments were spoiled (`ops`: "shrink", "expand",
    /// "bgmv").
    fn fails(mut self, ops: &[&str], expect: impl Fn(&KernelError) -> bool) {
        let cpu = CpuBackend::new();
        let (v0, y0) = (self.v.clone(), self.y.clone());
        let mut results = Vec::new();
        if ops.contains(&"shrink") {
            results.push(("sgmv_shrink", cpu.sgmv_shrink(&self.x, &self.pool, &self.rows, &self.segs, &self.target, &mut self.v)));
        }
        if ops.contains(&"expand") {
            results.push(("sgmv_expand", cpu.sgmv_expand(&self.v, &self.pool, &self.rows, &self.segs, &self.target, &mut self.y)));
        }
        if ops.contains(&"bgmv") {
            results.push(("bgmv", cpu.bgmv(&self.x, &self.pool, &self.rows, &self.slots, &self.target, &mut self.y)));
        }
        assert_eq!(results.len(), ops.len());
        for (op, r) in results {
            match r {
                Err(e) => assert!(expect(&e), "{op}: unexpected error {e:?}"),
                Ok(()) => panic!("{op} accepted bad arguments"),
            }
        }
        assert_eq!(self.v, v0, "v written before failing");
        assert_eq!(self.y, y0, "y written before failing");
    }
}

const ALL: [&str; 3] = ["shrink", "expand", "bgmv"];

fn is_index(e: &KernelError) -> bool {
    matches!(e, KernelError::Index { .. })
}

fn is_shape(e: &KernelError) -> bool {
    matches!(e, KernelError::Shape { .. })
}

#[test]
fn unspoiled_arguments_are_accepted() {
    let fx = Fixture::new(1);
    Call::new(&fx).ok();
}

#[test]
fn rows_beyond_the_pool_are_rejected() {
    let fx = Fixture::new(1);
    let pool_len = fx.pool.len();
    let e = ((3 * LAYERS + T_LAYER) * NUM_MODULES + T_MODULE) * 2;
    let last = fx.directory[e] as usize + 63;
    let (inf, outf) = SHAPES[T_MODULE];
    // The first offset whose row would run past the end, and one far beyond.
    let just_past_a = ((pool_len - inf) / LORA_ROW_ALIGN + 1) as u32;
    let just_past_b = ((pool_len - outf) / LORA_ROW_ALIGN + 1) as u32;
    for (is_a, off) in [(true, just_past_a), (true, u32::MAX), (false, just_past_b), (false, u32::MAX)] {
        let (mut a, mut b) = (fx.a_rows.clone(), fx.b_rows.clone());
        if is_a {
            a[last] = off
        } else {
            b[last] = off
        }
        let mut call = Call::new(&fx);
        call.rows = rows_of(&fx.directory, &a, &b);
        call.fails(&ALL, |e| matches!(e, KernelError::Index { index, .. } if *index == off as usize));
    }
    // The last offset that fits is fine (the pool's tail is NaN, so only check it is accepted).
    let mut a = fx.a_rows.clone();
    a[last] = just_past_a - 1;
    let mut call = Call::new(&fx);
    call.rows = rows_of(&fx.directory, &a, &fx.b_rows);
    call.ok();
    // A shorter pool cuts off rows that were valid.
    let mut call = Call::new(&fx);
    call.pool = CpuBuffer::F32(fx.pool[..fx.a_rows[last] as usize * LORA_ROW_ALIGN + inf - 1].to_vec());
    call.fails(&ALL, is_index);
}

#[test]
fn slots_out_of_range_are_rejected() {
    let fx = Fixture::new(2);
    for bad in [SLOTS as u32, SLOTS as u32 + 7, NO_ADAPTER - 1] {
        let mut parts = MIXED;
        parts[3].0 = bad;
        let mut call = Call::new(&fx);
        call.segs = segments(&parts);
        call.slots = CpuBuffer::U32(token_slots(&parts));
        call.fails(&ALL, |e| matches!(e, KernelError::Index { index, limit: SLOTS, .. } if *index == bad as usize));
    }
}

#[test]
fn ranks_above_max_rank_are_rejected() {
    let fx = Fixture::new(3);
    // Slot 3 has rank 64 at the target; 63 is not enough even though slot 3's tokens are few.
    let mut call = Call::new(&fx);
    call.target.max_rank = 63;
    call.v = CpuBuffer::F32(vec![0.5; 47 * 63]);
    call.fails(&ALL, is_shape);
    // The check covers every slot, used in this batch or not.
    let parts = [(0u32, 4usize), (NO_ADAPTER, 3)];
    let mut call = Call::new(&fx);
    call.target.max_rank = 8;
    call.segs = segments(&parts);
    call.slots = CpuBuffer::U32(token_slots(&parts));
    call.fails(&ALL, is_shape);
}

#[test]
fn bad_segment_bounds_are_rejected() {
    let fx = Fixture::new(4);
    let good: Vec<u32> = match segments(&MIXED).seg_starts {
        CpuBuffer::U32(s) => s,
        _ => unreachable!(),
    };
    let spoil = |f: &dyn Fn(&mut Vec<u32>)| {
        let mut s = good.clone();
        f(&mut s);
        let mut call = Call::new(&fx);
        call.segs.seg_starts = CpuBuffer::U32(s);
        call
    };
    // Runs backwards.
    spoil(&|s| s[3] = s[2] - 1).fails(&["shrink", "expand"], is_shape);
    // Does not start at 0.
    spoil(&|s| s[0] = 1).fails(&["shrink", "expand"], is_shape);
    // Ends past the tokens that x, v and y hold.
    spoil(&|s| *s.last_mut().unwrap() += 1).fails(&["shrink", "expand"], is_shape);
    spoil(&|s| *s.last_mut().unwrap() = u32::MAX).fails(&["shrink", "expand"], is_shape);
    // Too short for num_segments.
    spoil(&|s| {
        s.pop();
    })
    .fails(&["shrink", "expand"], is_shape);
    let mut call = Call::new(&fx);
    call.segs.seg_slots = CpuBuffer::U32(vec![0; MIXED.len() - 1]);
    call.fails(&["shrink", "expand"], is_shape);
    // bgmv's x and y must hold a row per slot.
    let mut call = Call::new(&fx);
    call.slots = CpuBuffer::U32(vec![0; 48]);
    call.fails(&["bgmv"], is_shape);
}

#[test]
fn wrong_dtypes_are_rejected() {
    let fx = Fixture::new(5);
    let u32_of = |b: &CpuBuffer| CpuBuffer::U32(vec![0; b.len()]);
    let f32_of = |b: &CpuBuffer| CpuBuffer::F32(vec![0.0; b.len()]);
    let dtype = |expected: DType| move |e: &KernelError| matches!(e, KernelError::DType { expected: x, .. } if *x == expected);
    let mut c = Call::new(&fx);
    c.x = u32_of(&c.x);
    c.fails(&["shrink", "bgmv"], dtype(DType::F32));
    let mut c = Call::new(&fx);
    c.pool = u32_of(&c.pool);
    c.fails(&ALL, dtype(DType::F32));
    let mut c = Call::new(&fx);
    c.rows.directory = f32_of(&c.rows.directory);
    c.fails(&ALL, dtype(DType::U32));
    let mut c = Call::new(&fx);
    c.rows.a_rows = f32_of(&c.rows.a_rows);
    c.fails(&ALL, dtype(DType::U32));
    let mut c = Call::new(&fx);
    c.rows.b_rows = f32_of(&c.rows.b_rows);
    c.fails(&ALL, dtype(DType::U32));
    let mut c = Call::new(&fx);
    c.segs.seg_starts = f32_of(&c.segs.seg_starts);
    c.fails(&["shrink", "expand"], dtype(DType::U32));
    let mut c = Call::new(&fx);
    c.segs.seg_slots = f32_of(&c.segs.seg_slots);
    c.fails(&["shrink", "expand"], dtype(DType::U32));
    let mut c = Call::new(&fx);
    c.slots = f32_of(&c.slots);
    c.fails(&["bgmv"], dtype(DType::U32));
    // Outputs of the wrong type: v for shrink, v read by expand, y.
    let mut c = Call::new(&fx);
    c.v = u32_of(&c.v);
    c.fails(&["shrink", "expand"], dtype(DType::F32));
    let mut c = Call::new(&fx);
    c.y = u32_of(&c.y);
    c.fails(&["expand", "bgmv"], dtype(DType::F32));
}

#[test]
fn bad_targets_and_directories_are_rejected() {
    let fx = Fixture::new(6);
    let spoil_target = |f: &dyn Fn(&mut LoraTarget)| {
        let mut c = Call::new(&fx);
        f(&mut c.target);
        c
    };
    spoil_target(&|t| t.layer = LAYERS).fails(&ALL, |e| matches!(e, KernelError::Index { limit: LAYERS, .. }));
    spoil_target(&|t| t.module = NUM_MODULES).fails(&ALL, |e| matches!(e, KernelError::Index { limit: NUM_MODULES, .. }));
    spoil_target(&|t| t.in_features = 0).fails(&ALL, is_shape);
    spoil_target(&|t| t.out_features = 0).fails(&ALL, is_shape);
    spoil_target(&|t| t.max_rank = 0).fails(&ALL, is_shape);
    // x, v or y one element short.
    let short = |b: &CpuBuffer| CpuBuffer::F32(f32s(b)[..b.len() - 1].to_vec());
    let mut c = Call::new(&fx);
    c.x = short(&c.x);
    c.fails(&["shrink", "bgmv"], is_shape);
    let mut c = Call::new(&fx);
    c.y = short(&c.y);
    c.fails(&["expand", "bgmv"], is_shape);
    let mut c = Call::new(&fx);
    c.v = CpuBuffer::F32(vec![0.5; 47 * 64 - 1]);
    c.fails(&["shrink", "expand"], is_shape);
    // A directory range past the end of a_rows / b_rows.
    let slot_entry = |slot: usize| ((slot * LAYERS + T_LAYER) * NUM_MODULES + T_MODULE) * 2;
    let e = slot_entry(1);
    let mut dir = fx.directory.clone();
    dir[e] = (fx.a_rows.len() - 4) as u32;
    let mut c = Call::new(&fx);
    c.rows = rows_of(&dir, &fx.a_rows, &fx.b_rows);
    c.fails(&ALL, is_shape);
    let mut c = Call::new(&fx);
    // Cuts off the last B row of slot 3 at the target.
    let last3 = fx.directory[slot_entry(3)] as usize + 63;
    c.rows = rows_of(&fx.directory, &fx.a_rows, &fx.b_rows[..last3]);
    c.fails(&ALL, is_shape);
    // A directory too short for num_slots × num_layers.
    let mut c = Call::new(&fx);
    c.rows = rows_of(&fx.directory[..fx.directory.len() - 2], &fx.a_rows, &fx.b_rows);
    c.fails(&ALL, is_shape);
    // A rank that points far past the end must not overflow.
    let mut dir = fx.directory.clone();
    dir[e] = u32::MAX;
    dir[e + 1] = 60;
    let mut c = Call::new(&fx);
    c.rows = rows_of(&dir, &fx.a_rows, &fx.b_rows);
    c.fails(&ALL, is_shape);
}

/// An adapter stored as bf16 rows computes exactly what the same (bf16-representable) values
/// stored as f32 rows compute, in both SGMV and BGMV, with odd row lengths.
#[test]
fn bf16_rows_give_the_same_results_as_f32_rows_of_the_same_values() {
    for be in Path::available().into_iter().map(CpuBackend::with_path) {
        let (inf, outf, rank) = (37usize, 21usize, 5usize);
        let mut rng = Rng(99);
        let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| f32::from_bits(x.to_bits() & 0xFFFF_0000)).collect() };
        let a = round(rng.vec(rank * inf));
        let b = round(rng.vec(rank * outf));
        // Slot 0: f32 rows; slot 1: the same rows as bf16, packed two per f32 slot.
        let mut pool: Vec<f32> = Vec::new();
        let (mut a_rows, mut b_rows) = (Vec::new(), Vec::new());
        for dtype in [RowDType::F32, RowDType::Bf16] {
            for (data, len, table) in [(&a, inf, &mut a_rows), (&b, outf, &mut b_rows)] {
                for r in 0..rank {
                    let row = &data[r * len..(r + 1) * len];
                    table.push((pool.len() / LORA_ROW_ALIGN) as u32);
                    let start = pool.len();
                    pool.resize(start + dtype.slots(len).next_multiple_of(LORA_ROW_ALIGN), f32::NAN);
                    match dtype {
                        RowDType::F32 => pool[start..start + len].copy_from_slice(row),
                        RowDType::Bf16 => {
                            let halves: &mut [u16] = bytemuck::cast_slice_mut(&mut pool[start..]);
                            for (i, v) in row.iter().enumerate() {
                                halves[i] = (v.to_bits() >> 16) as u16;
                            }
                        }
                    }
                }
            }
        }
        let directory = vec![0, rank as u32, rank as u32, rank as u32];
        let rows = LoraRows {
            num_slots: 2,
            num_layers: 1,
            directory: CpuBuffer::U32(entries(&directory)),
            a_rows: CpuBuffer::U32(a_rows),
            b_rows: CpuBuffer::U32(b_rows),
            slot_dtypes: CpuBuffer::U32(vec![RowDType::F32 as u32, RowDType::Bf16 as u32]),
        };
        let target = LoraTarget { layer: 0, module: 0, in_features: inf, out_features: outf, max_rank: rank };
        let pool = CpuBuffer::F32(pool);
        // Tokens 0..3 use slot 0, tokens 3..6 the same inputs with slot 1.
        let x3 = rng.vec(3 * inf);
        let x = CpuBuffer::F32([x3.clone(), x3].concat());
        let mut y_bgmv = CpuBuffer::F32(vec![0.5; 6 * outf]);
        be.bgmv(&x, &pool, &rows, &CpuBuffer::U32(vec![0, 0, 0, 1, 1, 1]), &target, &mut y_bgmv).unwrap();
        let segs = segments(&[(0, 3), (1, 3)]);
        let mut v = CpuBuffer::F32(vec![0.0; 6 * rank]);
        be.sgmv_shrink(&x, &pool, &rows, &segs, &target, &mut v).unwrap();
        let mut y_sgmv = CpuBuffer::F32(vec![0.5; 6 * outf]);
        be.sgmv_expand(&v, &pool, &rows, &segs, &target, &mut y_sgmv).unwrap();
        let (yb, ys) = (y_bgmv.f32("t").unwrap(), y_sgmv.f32("t").unwrap());
        assert_eq!(yb, ys);
        assert_eq!(&yb[..3 * outf], &yb[3 * outf..], "bf16 storage changed the result");
        assert!(yb.iter().all(|v| v.is_finite()) && yb.iter().any(|&v| v != 0.5));
    }
}

/// A directory for one layer with only module 0 set: `pairs` holds (first, rank) per slot.
fn entries(pairs: &[u32]) -> Vec<u32> {
    let mut d = vec![0; pairs.len() / 2 * NUM_MODULES * 2];
    for (slot, p) in pairs.chunks_exact(2).enumerate() {
        d[slot * NUM_MODULES * 2] = p[0];
        d[slot * NUM_MODULES * 2 + 1] = p[1];
    }
    d
}
