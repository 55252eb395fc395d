//! The CPU backend: f32 arithmetic on host memory, matmuls through packed weights, rayon for the
//! row-parallel ops, every kernel compiled for AVX-512, AVX2 + FMA, NEON and scalar code from one
//! source and the widest the CPU has chosen at run time (see [`isa`]). It is the reference every
//! other backend is compared against.

mod attention;
pub mod isa;
mod lora;
mod matmul;
mod ops;
mod packed;
pub mod probe;
mod simd;

use std::sync::atomic::{AtomicU32, Ordering};

use crate::{DType, InFlight, KernelError, Memory, Result, RowDType, Upload, WeightData};

pub use isa::Path;

pub use matmul::CpuWeight;

/// Below about this much work (multiply-adds, or elements read and written) a kernel runs on
/// the thread that called it. Handing part of a kernel to another thread of the pool means
/// waking it, letting it steal, joining it, and then the thread spinning and yielding before it
/// sleeps again: tens of microseconds of CPU, more than a small kernel's share saves. A small
/// model's step is dozens of such kernels, and with every one split its pool spent more CPU
/// idling than computing.
pub(crate) const PAR_MIN_WORK: usize = 1 << 16;

/// The fewest items a task of a parallel iterator takes when each item is `per_item` work, so
/// that a kernel of less than [`PAR_MIN_WORK`] in all stays one task on the calling thread.
/// How items are grouped into tasks never changes what each item computes.
pub(crate) fn min_items(per_item: usize) -> usize {
    PAR_MIN_WORK.div_ceil(per_item.max(1))
}

thread_local! {
    /// The pool a thread that runs engine steps belongs to, as its first thread (see
    /// [`join_step_pool`]); `None` when it could not be built.
    static STEP_POOL: std::cell::OnceCell<Option<rayon::ThreadPool>> = const { std::cell::OnceCell::new() };
}

/// Makes the calling thread the first thread of a pool of its own, of as many threads as the
/// global pool, once per thread; whether it is one. An engine's thread steps hundreds of times a
/// second, and a step handed to another pool's thread costs that thread's wake-up, the caller's
/// sleep and wake-up, and the pool thread's spinning and yielding before it sleeps again: on a
/// small model, more CPU than the step. As a pool's own thread it runs each step's kernels
/// itself, and wakes the pool's other threads only for a kernel large enough to split. The
/// pool lives as long as the thread (rayon keeps such a thread's registry for good).
fn join_step_pool() -> bool {
    STEP_POOL.with(|pool| {
        pool.get_or_init(|| {
            let threads = rayon::current_num_threads();
            let built = rayon::ThreadPoolBuilder::new().num_threads(threads).use_current_thread().thread_name(|i| format!("loraplex-step-{i}")).build();
            built
                .map_err(|e| eprintln!("warning: the CPU kernels could not start a pool for this thread's steps ({e}); each step is handed to the global pool"))
                .ok()
        })
        .is_some()
    })
}

/// The CPU device. Work runs on rayon's global pool, an engine step's on a pool its thread
/// joins (of as many threads as the global one; see [`join_step_pool`]); size it with
/// `RAYON_NUM_THREADS` or `rayon::ThreadPoolBuilder` before the first op.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend {
    path: Path,
    inputs: MatmulInputs,
    /// Checks an upload reports in flight before it lands (see [`CpuBackend::with_upload_polls`]).
    upload_polls: u32,
    /// Runs [`Memory::join`]'s halves one after the other (see [`CpuBackend::serial`]).
    serial: bool,
}

/// What the activations enter a matmul with bf16 weights as.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum MatmulInputs {
    /// f32, exact: bf16 weights give the same bits as f32 weights of the same values.
    #[default]
    F32,
    /// Rounded to bf16 (to nearest, ties to even), products summed in f32: what PyTorch and
    /// llama.cpp do with bf16 weights. Where the CPU has a bf16 dot product (AVX-512 BF16, Arm's
    /// BF16 extension) it does twice the multiply-adds per instruction of f32. Weights of other
    /// types are multiplied exactly, as with `F32`.
    Bf16,
}

impl CpuBackend {
    /// A backend on the widest instruction set of this CPU (or the one [`isa::ISA_ENV`] names).
    pub fn new() -> Self {
        Self { path: Path::detect(), ..Self::default() }
    }

    /// A backend on one instruction set (from [`Path::available`]): to test or measure each.
    pub fn with_path(path: Path) -> Self {
        Self { path, ..Self::default() }
    }

    /// This backend with bf16 weights multiplied by `inputs` (weights loaded afterwards).
    pub fn with_matmul_inputs(self, inputs: MatmulInputs) -> Self {
        Self { inputs, ..self }
    }

    /// This backend with uploads ([`Memory::start_upload`]) that report themselves in flight for
    /// their first `polls` checks, as a device's copy queue would, though the values are written
    /// at once: for tests of code that must not use an upload before it lands.
    pub fn with_upload_polls(self, polls: u32) -> Self {
        Self { upload_polls: polls, ..self }
    }

    /// This backend running [`Memory::join`]'s halves one after the other and reporting that it
    /// does not overlap work, as a GPU backend does: for tests of the callers' sequential path.
    pub fn serial(self) -> Self {
        Self { serial: true, ..self }
    }

    /// The instruction set this backend's kernels run with.
    pub fn path(&self) -> Path {
        self.path
    }

    pub fn matmul_inputs(&self) -> MatmulInputs {
        self.inputs
    }

    /// The kernels this backend runs, as benchmarks and `serve` print them: the instruction set,
    /// and with bf16 matmul inputs, whether a bf16 dot product multiplies them.
    pub fn describe(&self) -> String {
        match self.inputs {
            MatmulInputs::F32 => self.path.name().to_string(),
            MatmulInputs::Bf16 if packed::bf16_dot(self.path) => format!("{}, bf16 matmul inputs on {} dot products", self.path.name(), packed::BF16_DOT),
            MatmulInputs::Bf16 => format!("{}, bf16 matmul inputs rounded and widened (no bf16 dot product on this path)", self.path.name()),
        }
    }
}

/// An upload that lands after a number of checks ([`CpuBackend::with_upload_polls`]).
struct Countdown(AtomicU32);

impl InFlight for Countdown {
    fn landed(&self) -> Result<bool> {
        Ok(self.0.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_err())
    }
}

/// A buffer in host memory.
#[derive(Debug, Clone, PartialEq)]
pub enum CpuBuffer {
    F32(Vec<f32>),
    U32(Vec<u32>),
}

impl CpuBuffer {
    pub fn dtype(&self) -> DType {
        match self {
            CpuBuffer::F32(_) => DType::F32,
            CpuBuffer::U32(_) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuBuffer::F32(v) => v.len(),
            CpuBuffer::U32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn f32(&self, op: &'static str) -> Result<&[f32]> {
        match self {
            CpuBuffer::F32(v) => Ok(v),
            other => Err(KernelError::DType { op, expected: DType::F32, actual: other.dtype() }),
        }
    }

    pub(crate) fn f32_mut(&mut self, op: &'static str) -> Result<&mut [f32]> {
        match self {
            CpuBuffer::F32(v) => Ok(v),
            other => Err(KernelError::DType { op, expected: DType::F32, actual: other.dtype() }),
        }
    }

    pub(crate) fn u32(&self, op: &'static str) -> Result<&[u32]> {
        match self {
            CpuBuffer::U32(v) => Ok(v),
            other => Err(KernelError::DType { op, expected: DType::U32, actual: other.dtype() }),
        }
    }
}

impl crate::check::HostU32 for CpuBuffer {
    fn host_u32(&self, op: &'static str) -> Result<&[u32]> {
        self.u32(op)
    }
}

pub(crate) use crate::check::{ensure_len, rows_of};

/// An output buffer shared by the tasks of one parallel kernel (a matmul, the attention), each
/// writing only its own disjoint part of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

impl OutPtr {
    /// The element `offset` past the start. Taking `self` whole keeps closures capturing the
    /// `Send` wrapper rather than the bare pointer.
    ///
    /// # Safety
    /// `offset` must lie within the output buffer.
    unsafe fn at(self, offset: usize) -> OutPtr {
        // SAFETY: forwarded from this function's contract.
        OutPtr(unsafe { self.0.add(offset) })
    }
}

// SAFETY: every kernel that shares an `OutPtr` has its tasks write disjoint ranges of the
// output, never the same element, and keeps the buffer alive past its parallel loop (see
// `packed::matmul` and the attention).
unsafe impl Send for OutPtr {}
// SAFETY: as above; the pointer itself is only copied, never written through concurrently at
// the same address.
unsafe impl Sync for OutPtr {}

impl Memory for CpuBackend {
    type Buffer = CpuBuffer;
    type Weight = CpuWeight;

    fn device_name(&self) -> String {
        "cpu".to_string()
    }

    fn weight_dtype(&self) -> DType {
        match self.inputs {
            MatmulInputs::F32 => DType::F32,
            MatmulInputs::Bf16 => DType::Bf16,
        }
    }

    /// A tenth: what the attention kernels ran at against the packed matmuls' FLOP/s when the
    /// schedulers' step budget was tuned with it (20 against 180–240 GFLOP/s on a 2-core AVX-512
    /// machine, `bench engine` on long prompts). They now run at about half (in a profile of a
    /// 2,048-token prefill on the `bench` preset, Zen 4, 2026-11-28), but a tenth stays until
    /// the step budget is tuned again: with the cost at half, one `bench noisy-neighbor
    /// --patterns huge-prompts:fits` run put the light tenant's p99 time to first token at 2.10x
    /// its time alone (target 2x), against 1.31x with a tenth.
    fn attention_efficiency(&self) -> f64 {
        0.1
    }

    fn run_step<R: Send>(&self, step: impl FnOnce() -> R + Send) -> R {
        if rayon::current_thread_index().is_some() || join_step_pool() {
            return step();
        }
        // The thread could not join a pool of its own: one hand-off to the global pool for
        // the whole step.
        rayon::scope(|_| step())
    }

    fn supports_kv_dtype(&self, _dtype: RowDType) -> bool {
        true
    }

    fn overlaps(&self) -> bool {
        !self.serial
    }

    fn join<RA: Send, RB: Send>(&self, a: impl FnOnce() -> RA + Send, b: impl FnOnce() -> RB + Send) -> (RA, RB) {
        if self.serial {
            let ra = a();
            return (ra, b());
        }
        rayon::join(a, b)
    }

    fn fill_zero(&self, buf: &mut CpuBuffer, len: usize) -> Result<()> {
        const OP: &str = "fill_zero";
        let data = buf.f32_mut(OP)?;
        ensure_len(OP, "buf", data.len(), len)?;
        data[..len].fill(0.0);
        Ok(())
    }

    fn zeros(&self, len: usize) -> Result<CpuBuffer> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| KernelError::OutOfMemory { device: self.device_name(), bytes: len.saturating_mul(4) })?;
        advise_huge_pages(v.spare_capacity_mut());
        v.resize(len, 0.0);
        Ok(CpuBuffer::F32(v))
    }

    fn start_upload(&self, buf: &mut CpuBuffer, writes: &[(usize, &[f32])]) -> Result<Upload> {
        for &(offset, data) in writes {
            self.write_f32(buf, offset, data)?;
        }
        Ok(match self.upload_polls {
            0 => Upload::landed(),
            n => Upload::in_flight(Countdown(AtomicU32::new(n))),
        })
    }

    fn upload_f32(&self, data: &[f32]) -> Result<CpuBuffer> {
        Ok(CpuBuffer::F32(data.to_vec()))
    }

    fn upload_u32(&self, data: &[u32]) -> Result<CpuBuffer> {
        Ok(CpuBuffer::U32(data.to_vec()))
    }

    fn download_f32(&self, buf: &CpuBuffer) -> Result<Vec<f32>> {
        Ok(buf.f32("download_f32")?.to_vec())
    }

    fn write_f32(&self, buf: &mut CpuBuffer, offset: usize, data: &[f32]) -> Result<()> {
        const OP: &str = "write_f32";
        let dst = buf.f32_mut(OP)?;
        let end = offset.checked_add(data.len()).filter(|&end| end <= dst.len());
        let Some(end) = end else {
            return Err(KernelError::Index { op: OP, index: offset.saturating_add(data.len()), limit: dst.len() });
        };
        dst[offset..end].copy_from_slice(data);
        Ok(())
    }

    fn copy_within(&self, buf: &mut CpuBuffer, src: usize, dst: usize, len: usize) -> Result<()> {
        const OP: &str = "copy_within";
        let data = buf.f32_mut(OP)?;
        for start in [src, dst] {
            match start.checked_add(len) {
                Some(end) if end <= data.len() => {}
                _ => return Err(KernelError::Index { op: OP, index: start.saturating_add(len), limit: data.len() }),
            }
        }
        if src < dst + len && dst < src + len && len > 0 {
            return Err(KernelError::Shape { op: OP, detail: format!("source {src} and destination {dst} overlap over {len} values") });
        }
        data.copy_within(src..src + len, dst);
        Ok(())
    }

    fn load_weight(&self, data: &[f32], out_features: usize, in_features: usize) -> Result<CpuWeight> {
        CpuWeight::pack(self.path, WeightData::F32(data), out_features, in_features, self.inputs)
    }

    fn load_weight_data(&self, data: WeightData<'_>, out_features: usize, in_features: usize) -> Result<CpuWeight> {
        CpuWeight::pack(self.path, data, out_features, in_features, self.inputs)
    }
}

/// Asks the kernel to back `buf` with transparent huge pages (2 MiB) where it can: large
/// buffers that are streamed (weights, the page pool) then need far fewer TLB entries. Call it
/// before the memory is first written. Only a hint: where it is refused, or off this OS,
/// nothing changes.
pub(crate) fn advise_huge_pages<T>(buf: &mut [T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (buf.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (buf.as_ptr() as usize + std::mem::size_of_val(buf)) & !(HUGE - 1);
        if end > start {
            // SAFETY: the range lies within `buf`, which this call borrows mutably; madvise
            // with MADV_HUGEPAGE changes only how the pages are backed, never their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn fill_zero_clears_the_front_and_join_runs_both_halves() {
        let cpu = CpuBackend::new();
        let mut buf = cpu.upload_f32(&[1.0; 6]).unwrap();
        cpu.fill_zero(&mut buf, 4).unwrap();
        assert_eq!(cpu.download_f32(&buf).unwrap(), [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]);
        let err = cpu.fill_zero(&mut buf, 7).unwrap_err();
        assert!(err.to_string().contains("6 elements, 7 needed"), "{err}");
        for (cpu, overlaps) in [(CpuBackend::new(), true), (CpuBackend::new().serial(), false)] {
            assert_eq!(cpu.overlaps(), overlaps);
            let (mut a, mut b) = (vec![0u32; 1000], vec![0u32; 1000]);
            let (ra, rb) = cpu.join(
                || a.par_iter_mut().enumerate().for_each(|(i, v)| *v = i as u32),
                || {
                    b.iter_mut().for_each(|v| *v = 7);
                    'b'
                },
            );
            assert_eq!((ra, rb), ((), 'b'));
            assert!(a.iter().enumerate().all(|(i, &v)| v == i as u32) && b.iter().all(|&v| v == 7));
        }
    }

    #[test]
    fn copy_within_copies_one_range_and_checks_bounds() {
        let cpu = CpuBackend::new();
        let mut buf = cpu.upload_f32(&[0., 1., 2., 3., 4., 5., 6., 7.]).unwrap();
        cpu.copy_within(&mut buf, 1, 5, 3).unwrap();
        assert_eq!(cpu.download_f32(&buf).unwrap(), [0., 1., 2., 3., 4., 1., 2., 3.]);
        assert!(cpu.copy_within(&mut buf, 6, 0, 3).is_err(), "source past the end");
        assert!(cpu.copy_within(&mut buf, 0, 2, 3).is_err(), "overlapping ranges");
        assert_eq!(cpu.download_f32(&buf).unwrap(), [0., 1., 2., 3., 4., 1., 2., 3.], "a refused copy writes nothing");
    }

    #[test]
    fn a_step_runs_on_its_own_thread_as_the_first_of_a_pool() {
        let cpu = CpuBackend::new();
        let global = rayon::current_num_threads();
        let caller = std::thread::current().id();
        assert_eq!(rayon::current_thread_index(), None);
        // A kernel large enough to split: which threads ran its parts.
        let split = || -> std::collections::HashSet<std::thread::ThreadId> {
            (0..64)
                .into_par_iter()
                .map(|_| {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    std::thread::current().id()
                })
                .collect()
        };
        let mut helpers = std::collections::HashSet::new();
        for _ in 0..3 {
            let (thread, index, threads, parts) =
                cpu.run_step(|| (std::thread::current().id(), rayon::current_thread_index(), rayon::current_num_threads(), split()));
            // The step stays on the calling thread, the first of a pool as large as the global one ...
            assert_eq!(thread, caller, "the step was handed to another thread");
            assert_eq!(index, Some(0));
            assert_eq!(threads, global);
            assert!(parts.contains(&caller));
            if global > 1 {
                assert!(parts.len() > 1, "a large kernel did not split");
            }
            helpers.extend(parts);
        }
        // ... the same pool every time.
        assert!(helpers.len() <= global, "{} threads ran the steps' kernels, the pool has {global}", helpers.len());
        // A step started on a thread of another pool stays on it.
        let other = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let (outer, inner) = other.install(|| (std::thread::current().id(), cpu.run_step(|| std::thread::current().id())));
        assert_eq!(inner, outer);
        // The step's result and panics come back to the caller.
        assert_eq!(cpu.run_step(|| 7), 7);
        assert!(std::panic::catch_unwind(|| cpu.run_step(|| panic!("in a step"))).is_err());
    }
}
