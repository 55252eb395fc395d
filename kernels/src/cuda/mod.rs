//! The CUDA backend: cudarc over the driver API, kernels compiled at run time by NVRTC from
//! `kernels/cuda/*.cu`, cuBLAS for the base model's GEMMs.
//!
//! CUDA is loaded dynamically: this module builds everywhere, and [`probe`] tells whether the
//! driver, NVRTC and cuBLAS libraries are present before any of them is called (a missing library
//! would otherwise panic inside the loader). All `unsafe` of the crate's CUDA use lives here and
//! in [`compile`].
//!
//! Buffers carry their element type: f32, f16 or bf16 storage (arithmetic is f32 in every
//! kernel), or u32 for indices. A u32 buffer keeps a host copy of what was uploaded, so every
//! index is checked on the host (the same checks as the CPU backend) before a launch reads it.
//! Each op picks the kernel instantiated for its buffers' type. The trait's `zeros`,
//! `upload_f32` and `load_weight` make buffers of the backend's compute type (f32 unless
//! [`CudaBackend::with_compute_dtype`] chose bf16; `zeros_f32` always f32: the page pool, LoRA's
//! rank buffers, logits), and [`CudaBackend::upload_as`], [`CudaBackend::zeros_as`] and
//! [`CudaBackend::load_weight_as`] make any float type.
//!
//! With bf16 compute the model runs in bf16 end to end, as transformers does in bf16: weights,
//! activations and the residual stream are bf16, every kernel and GEMM accumulates in f32, and
//! the KV pages are bf16 packed two to an f32 slot of the pool ([`crate::RowDType::Bf16`]), which
//! the bf16 attention kernels read as a bf16 array.

pub mod compile;
mod ops;
pub mod plan;
mod staging;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchArgs, LaunchConfig, PinnedHostSlice, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::{DType, KernelError, Result};
use plan::Launch;

/// Why CUDA cannot be used on this machine, or how many devices it has.
pub fn probe() -> std::result::Result<usize, String> {
    // SAFETY: each call only tries to open a shared library; no CUDA function is called.
    let (driver, blas) = unsafe { (cudarc::driver::sys::is_culib_present(), cudarc::cublas::sys::is_culib_present()) };
    if !driver {
        return Err("the CUDA driver library (libcuda) cannot be loaded".into());
    }
    if !compile::nvrtc_present() {
        return Err("the NVRTC library (libnvrtc) cannot be loaded".into());
    }
    if !blas {
        return Err("the cuBLAS library (libcublas) cannot be loaded".into());
    }
    match CudaContext::device_count() {
        Ok(0) => Err("the CUDA driver reports no device".into()),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(format!("the CUDA driver failed to start: {e}")),
    }
}

pub(crate) fn dev_err(op: &'static str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Device { op, detail: format!("{e:?}") }
}

/// A device buffer.
#[derive(Debug)]
pub struct CudaBuffer {
    len: usize,
    data: Data,
}

#[derive(Debug)]
enum Data {
    F32(CudaSlice<f32>),
    F16(CudaSlice<u16>),
    Bf16(CudaSlice<u16>),
    /// The device copy and the host copy the checks read.
    U32(CudaSlice<u32>, Vec<u32>),
}

impl CudaBuffer {
    pub fn dtype(&self) -> DType {
        match self.data {
            Data::F32(_) => DType::F32,
            Data::F16(_) => DType::F16,
            Data::Bf16(_) => DType::Bf16,
            Data::U32(..) => DType::U32,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Fails unless this buffer holds floats (f32, f16 or bf16); returns their type.
    fn float(&self, op: &'static str) -> Result<DType> {
        match self.dtype() {
            DType::U32 => Err(KernelError::DType { op, expected: DType::F32, actual: DType::U32 }),
            d => Ok(d),
        }
    }

    /// The device data of an f32 buffer.
    fn f32_slice(&self, op: &'static str) -> Result<&CudaSlice<f32>> {
        match &self.data {
            Data::F32(s) => Ok(s),
            _ => Err(KernelError::DType { op, expected: DType::F32, actual: self.dtype() }),
        }
    }

    fn expect(&self, op: &'static str, dtype: DType) -> Result<()> {
        if self.dtype() != dtype {
            return Err(KernelError::DType { op, expected: dtype, actual: self.dtype() });
        }
        Ok(())
    }

    /// Pushes the buffer's device pointer as a kernel argument.
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        match &self.data {
            Data::F32(s) => b.arg(s),
            Data::F16(s) | Data::Bf16(s) => b.arg(s),
            Data::U32(s, _) => b.arg(s),
        };
    }
}

impl crate::check::HostU32 for CudaBuffer {
    fn host_u32(&self, op: &'static str) -> Result<&[u32]> {
        match &self.data {
            Data::U32(_, host) => Ok(&host[..self.len]),
            _ => Err(KernelError::DType { op, expected: DType::U32, actual: self.dtype() }),
        }
    }
}

/// A linear layer's weight, `[out_features, in_features]` row-major on the device.
#[derive(Debug)]
pub struct CudaWeight {
    pub out_features: usize,
    pub in_features: usize,
    data: CudaBuffer,
}

impl CudaWeight {
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
}

/// Facts about the device the plans need.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// `sm_XY`.
    pub arch: String,
    pub sm_count: usize,
    /// Shared memory a block may use after opting in.
    pub max_smem_optin: usize,
}

/// One CUDA device with its stream, its cuBLAS handle and its compiled kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
    info: DeviceInfo,
    cache_dir: Option<PathBuf>,
    modules: [OnceLock<Arc<CudaModule>>; compile::SOURCES.len()],
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Functions whose dynamic shared memory limit was raised, with the limit.
    smem_raised: Mutex<HashMap<String, u32>>,
    /// Recently uploaded index lists (LoRA tiles, token maps): every layer of a step launches
    /// with the same lists, so each is uploaded once per step, not once per op.
    meta_cache: Mutex<Vec<MetaEntry>>,
    /// BGMV's rank buffer `v` (`[rows, max_rank]` f32), reused by every call and grown
    /// geometrically; the lock is held from the shrink's launch to the expand's, so two threads
    /// never interleave their use of it on the stream.
    lora_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Split decode attention's partial results (`[rows, head_dim]` sums, then `[rows, 2]` max
    /// and denominator), reused by every layer and step as `lora_scratch` is: every partition's
    /// block writes its whole row, so nothing is read that the step did not write.
    attn_scratch: Mutex<Option<CudaSlice<f32>>>,
    /// The type of activations and weights (f32 or bf16).
    compute: DType,
    /// Decode attention with the grouped kernels (a block per KV head for its query heads) where
    /// the model's grouping has one; on by default (see [`CudaBackend::set_grouped_decode`]).
    grouped_decode: AtomicBool,
    /// The copy queue for [`crate::Memory::start_upload`]: a second, non-blocking stream, made
    /// at the first upload.
    copy_stream: OnceLock<Arc<CudaStream>>,
    /// Page-locked staging chunks of landed uploads, kept for the next ones.
    staging: Arc<Mutex<Vec<PinnedHostSlice<f32>>>>,
}

/// A staging chunk, in f32s (16 MiB). Uploads are staged in as many chunks as they need, all
/// this size, so a chunk serves any later upload: page-locking memory costs far more than
/// copying through it (an 80 MB adapter's buffer, allocated and freed per upload, took about
/// 45 ms where its copy takes under 10).
const STAGING_CHUNK: usize = 1 << 22;

/// Chunks kept for reuse once their copies have landed (512 MiB of page-locked host memory per
/// device at most); uploads in flight beyond that allocate chunks that are freed after landing.
const STAGING_KEPT: usize = 32;

/// Chunks page-locked when a server or benchmark opens the device (80 MiB, a 7b's rank-16
/// adapter on q, k, v and o), so that the first adapter to become resident does not wait for them.
const STAGING_WARM: usize = 5;

/// An upload in flight on the copy stream: the event recorded after its copies, and the staging
/// chunks they read, returned to the backend's list once they have landed.
struct CudaUpload {
    event: CudaEvent,
    staging: Vec<PinnedHostSlice<f32>>,
    kept: Arc<Mutex<Vec<PinnedHostSlice<f32>>>>,
}

impl crate::InFlight for CudaUpload {
    fn landed(&self) -> Result<bool> {
        self.event.try_is_complete().map_err(|e| dev_err("upload", e))
    }
}

impl Drop for CudaUpload {
    fn drop(&mut self) {
        // The device may still be reading the staging buffer: it is reused or freed only after.
        if self.event.synchronize().is_err() {
            // The context is broken; freeing the page-locked memory would be as unsafe as the
            // copy's state is unknown, so it is leaked.
            std::mem::forget(std::mem::take(&mut self.staging));
            return;
        }
        keep_staging(&self.kept, std::mem::take(&mut self.staging));
    }
}

/// Returns staging chunks that no copy reads any more to the `kept` list (up to its bound; the
/// rest are freed).
fn keep_staging(kept: &Mutex<Vec<PinnedHostSlice<f32>>>, chunks: Vec<PinnedHostSlice<f32>>) {
    let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
    for chunk in chunks {
        if kept.len() < STAGING_KEPT {
            kept.push(chunk);
        }
    }
}

/// An uploaded index list and its host copy.
type MetaEntry = (Vec<u32>, Arc<CudaSlice<u32>>);

/// Index lists kept uploaded.
const META_CACHE: usize = 16;

/// Smallest device buffer of an uploaded index list, in u32s: lists are stored in power-of-two
/// buffers so an evicted one can take the next list without a new allocation.
const META_MIN: usize = 256;

/// Smallest scratch buffer (BGMV's rank buffer, decode attention's partials), in f32s.
const SCRATCH_MIN: usize = 4096;

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("info", &self.info).finish_non_exhaustive()
    }
}

impl CudaBackend {
    /// Opens device `ordinal`. Kernels are compiled (or read from `cache_dir`) at first use;
    /// `None` keeps no cache. Fails with a clear message when CUDA is missing or the device does
    /// not exist.
    pub fn new(ordinal: usize, cache_dir: Option<PathBuf>) -> Result<Self> {
        const OP: &str = "cuda";
        let count = probe().map_err(|detail| KernelError::Device { op: OP, detail })?;
        if ordinal >= count {
            return Err(KernelError::Device { op: OP, detail: format!("no device cuda:{ordinal}: the driver reports {count}") });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| dev_err(OP, e))?;
        // One stream orders every op: the per-buffer event tracking cudarc does for several
        // streams is not needed.
        // SAFETY: no buffer exists yet on this context, so none has events to track.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err(OP, e))?;
        let attr = |a| ctx.attribute(a).map_err(|e| dev_err(OP, e));
        let (major, minor) = ctx.compute_capability().map_err(|e| dev_err(OP, e))?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(|e| dev_err(OP, e))?,
            arch: format!("sm_{major}{minor}"),
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            max_smem_optin: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
        };
        Ok(CudaBackend {
            ctx,
            stream,
            blas: Mutex::new(blas),
            info,
            cache_dir,
            modules: Default::default(),
            functions: Mutex::new(HashMap::new()),
            smem_raised: Mutex::new(HashMap::new()),
            meta_cache: Mutex::new(Vec::new()),
            lora_scratch: Mutex::new(None),
            attn_scratch: Mutex::new(None),
            compute: DType::F32,
            grouped_decode: AtomicBool::new(true),
            copy_stream: OnceLock::new(),
            staging: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Starts `writes` into the f32 buffer `buf` on the copy stream (see
    /// [`crate::Memory::start_upload`]): the values are staged in page-locked memory, the copy
    /// stream waits for what the compute stream has queued so far, copies, and records an event.
    pub(crate) fn upload_on_copy_stream(&self, buf: &mut CudaBuffer, writes: &[(usize, &[f32])]) -> Result<crate::Upload> {
        const OP: &str = "start_upload";
        let Data::F32(dst) = &mut buf.data else {
            return Err(KernelError::DType { op: OP, expected: DType::F32, actual: buf.dtype() });
        };
        let mut total = 0usize;
        for &(offset, data) in writes {
            match offset.checked_add(data.len()) {
                Some(end) if end <= buf.len => {}
                _ => return Err(KernelError::Index { op: OP, index: offset.saturating_add(data.len()), limit: buf.len }),
            }
            total = total.checked_add(data.len()).ok_or_else(|| KernelError::Shape { op: OP, detail: "the writes' lengths overflow".into() })?;
        }
        if total == 0 {
            return Ok(crate::Upload::landed());
        }
        let copy = match self.copy_stream.get() {
            Some(s) => s.clone(),
            None => {
                let made = self.ctx.new_stream().map_err(|e| dev_err(OP, e))?;
                self.copy_stream.get_or_init(|| made).clone()
            }
        };
        // The layout first (host only), then as many chunks as it fills: kept ones, else new.
        let shape: Vec<(usize, usize)> = writes.iter().map(|&(offset, data)| (offset, data.len())).collect();
        let plans = staging::plan(&shape, STAGING_CHUNK);
        let mut chunks = {
            let mut kept = self.staging.lock().unwrap_or_else(|p| p.into_inner());
            let reused = kept.len().min(plans.len());
            let at = kept.len() - reused;
            kept.split_off(at)
        };
        while chunks.len() < plans.len() {
            // SAFETY: a chunk's values are read only by the copies planned for it, and each
            // copy reads values that the fill below has written first.
            match unsafe { self.ctx.alloc_pinned::<f32>(STAGING_CHUNK) } {
                Ok(c) => chunks.push(c),
                Err(e) => {
                    keep_staging(&self.staging, chunks);
                    return Err(dev_err(OP, e));
                }
            }
        }
        // Ordered after every op queued so far on the compute stream (they may read the pages
        // these values replace).
        if let Err(e) = copy.join(&self.stream) {
            keep_staging(&self.staging, chunks);
            return Err(dev_err(OP, e));
        }
        // Each chunk is filled, then its copies queued: the device copies one chunk while the
        // host fills the next.
        let queued = (|| {
            for (chunk, p) in chunks.iter_mut().zip(&plans) {
                staging::fill(chunk.as_mut_slice()?, &p.pieces, writes);
                let host = chunk.as_slice()?;
                for c in &p.copies {
                    copy.memcpy_htod(&host[c.at..c.at + c.len], &mut dst.slice_mut(c.dst..c.dst + c.len))?;
                }
            }
            copy.record_event(None)
        })();
        match queued {
            Ok(event) => Ok(crate::Upload::in_flight(CudaUpload { event, staging: chunks, kept: self.staging.clone() })),
            Err(e) => {
                // Copies queued before the failure may still read the chunks: they are kept
                // only once the copy stream is idle (or, if even that fails, leaked).
                if copy.synchronize().is_err() {
                    std::mem::forget(chunks);
                } else {
                    keep_staging(&self.staging, chunks);
                }
                Err(dev_err(OP, e))
            }
        }
    }

    /// Device `ordinal` computing in `compute`, its kernels compiled (or read from the default
    /// cache): what a server or a benchmark opens.
    pub fn open(ordinal: usize, compute: DType) -> Result<Self> {
        let backend = Self::new(ordinal, compile::default_cache_dir())?.with_compute_dtype(compute)?;
        backend.warm_up()?;
        Ok(backend)
    }

    /// Computes in `dtype` (f32, the default, or bf16): see the module's documentation. f16 is
    /// refused: the pool has no f16 KV layout.
    pub fn with_compute_dtype(mut self, dtype: DType) -> Result<Self> {
        match dtype {
            DType::F32 | DType::Bf16 => {
                self.compute = dtype;
                Ok(self)
            }
            other => Err(KernelError::Device { op: "cuda", detail: format!("cannot compute in {other}: f32 or bf16") }),
        }
    }

    /// Whether decode attention uses the grouped kernels (one block per KV head reading each
    /// key and value row once for the query heads that share it) where the heads' grouping has
    /// one (groups of 2, 4 and 8); otherwise one block per query head. On by default: on an
    /// H200 they made 7b decode steps with 8 KV heads 34% and 41% faster at batch 8 and 32, and
    /// 1% slower at batch 1.
    pub fn set_grouped_decode(&self, on: bool) {
        self.grouped_decode.store(on, Ordering::Relaxed);
    }

    pub fn grouped_decode(&self) -> bool {
        self.grouped_decode.load(Ordering::Relaxed)
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for every queued op; reports a failure of any of them.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))
    }

    /// Compiles (or loads from the cache) every module now rather than at first use, and
    /// page-locks the staging chunks of a first adapter upload, which would otherwise pay for
    /// them (about 45 ms for five chunks).
    pub fn warm_up(&self) -> Result<()> {
        for i in 0..compile::SOURCES.len() {
            self.module(i)?;
        }
        let mut kept = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        while kept.len() < STAGING_WARM {
            // SAFETY: no copy reads a kept chunk before an upload has filled what it reads.
            kept.push(unsafe { self.ctx.alloc_pinned::<f32>(STAGING_CHUNK) }.map_err(|e| dev_err("warm_up", e))?);
        }
        Ok(())
    }

    fn module(&self, index: usize) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules[index].get() {
            return Ok(m.clone());
        }
        let (name, body) = compile::SOURCES[index];
        let cubin = compile::cubin_cached(self.cache_dir.as_deref(), name, body, &self.info.arch)?;
        let module = self.ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| dev_err("load module", e))?;
        // Two threads may compile at once; either result is the same module.
        Ok(self.modules[index].get_or_init(|| module).clone())
    }

    /// The kernel `name` of module `source` (an index into [`compile::SOURCES`]).
    fn function(&self, source: usize, name: &str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Ok(f.clone());
        }
        let f = self.module(source)?.load_function(name).map_err(|e| KernelError::Device { op: "load kernel", detail: format!("{name}: {e:?}") })?;
        self.functions.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Raises a kernel's dynamic shared memory limit when a plan needs more than the default.
    fn allow_smem(&self, name: &str, f: &CudaFunction, bytes: u32) -> Result<()> {
        if bytes as usize <= plan::DEFAULT_SMEM {
            return Ok(());
        }
        let mut raised = self.smem_raised.lock().unwrap_or_else(|p| p.into_inner());
        if raised.get(name).is_some_and(|&b| b >= bytes) {
            return Ok(());
        }
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
            .map_err(|e| KernelError::Device { op: "shared memory", detail: format!("{name}: {e:?}") })?;
        raised.insert(name.to_string(), bytes);
        Ok(())
    }

    /// Launches `f` with a plan's shape; `args` pushes the arguments in the kernel's order.
    fn launch<'a>(&'a self, op: &'static str, name: &str, f: &'a CudaFunction, plan: &Launch, args: impl FnOnce(&mut LaunchArgs<'a>)) -> Result<()> {
        self.allow_smem(name, f, plan.smem)?;
        let mut b = self.stream.launch_builder(f);
        args(&mut b);
        let cfg = LaunchConfig { grid_dim: plan.grid, block_dim: (plan.block, 1, 1), shared_mem_bytes: plan.smem };
        // SAFETY: the plan was made for this kernel from checked arguments: every pointer pushed
        // is a live buffer of this context holding at least the elements the kernel indexes
        // (lengths and indices were checked on the host), and the arguments follow the kernel's
        // signature in `kernels/cuda` in number, order and type.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| KernelError::Device { op, detail: format!("{name}: {e:?}") })
    }

    /// Uploads host u32 data (kernel metadata that is not an op argument: tiles, token maps),
    /// or finds the same list uploaded recently. Lists are never written by kernels.
    ///
    /// A list not in the cache takes the device buffer of the least recently used entry when
    /// nothing else holds that buffer and it is large enough (buffers are power-of-two sized),
    /// so a new list (every step's first layer) costs one host-to-device copy on the stream, not
    /// an allocation. Overwriting it is safe: every kernel that read the old list was queued
    /// earlier on this backend's one stream, so the copy lands after they finished; and no
    /// launch still to come can hold it, since `Arc::get_mut` proves the cache holds the only
    /// reference (clones are handed out only under this lock). The copy reads pageable host
    /// memory, which the driver stages before `memcpy_htod` returns, so `data` may go at once.
    fn upload_meta(&self, op: &'static str, data: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        let mut cache = self.meta_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = cache.iter().position(|(k, _)| k == data) {
            let entry = cache.remove(i);
            let dev = entry.1.clone();
            cache.push(entry);
            return Ok(dev);
        }
        let copy = |slice: &mut CudaSlice<u32>| match data.is_empty() {
            true => Ok(()),
            false => self.stream.memcpy_htod(data, &mut slice.slice_mut(0..data.len())).map_err(|e| dev_err(op, e)),
        };
        let mut reused = None;
        if cache.len() >= META_CACHE {
            let (key, mut dev) = cache.remove(0);
            if dev.len() >= data.len()
                && let Some(slice) = Arc::get_mut(&mut dev)
            {
                copy(slice)?;
                reused = Some((key, dev));
            }
        }
        let (mut key, dev) = match reused {
            Some(entry) => entry,
            None => {
                let cap = data.len().next_power_of_two().max(META_MIN);
                let mut fresh = self.stream.alloc_zeros::<u32>(cap).map_err(|_| KernelError::OutOfMemory { device: self.device_name_str(), bytes: cap * 4 })?;
                copy(&mut fresh)?;
                (Vec::with_capacity(data.len()), Arc::new(fresh))
            }
        };
        key.clear();
        key.extend_from_slice(data);
        cache.push((key, dev.clone()));
        Ok(dev)
    }

    /// Runs `f` with BGMV's rank buffer of at least `len` f32s (see [`Self::with_scratch`]).
    fn with_lora_scratch<R>(&self, len: usize, f: impl FnOnce(&CudaSlice<f32>) -> Result<R>) -> Result<R> {
        self.with_scratch(&self.lora_scratch, len, f)
    }

    /// Runs `f` with split decode attention's partials buffer of at least `len` f32s.
    fn with_attn_scratch<R>(&self, len: usize, f: impl FnOnce(&CudaSlice<f32>) -> Result<R>) -> Result<R> {
        self.with_scratch(&self.attn_scratch, len, f)
    }

    /// Runs `f` with the f32 scratch buffer `slot` grown to at least `len` elements, holding its
    /// lock throughout (so what `f` queues on the stream is not interleaved with another
    /// caller's use). The buffer's contents are whatever an earlier call left: `f` must write
    /// every element it reads. A buffer too small is freed (stream-ordered: kernels queued
    /// before still read it) and replaced by one at least twice its size.
    fn with_scratch<R>(&self, slot: &Mutex<Option<CudaSlice<f32>>>, len: usize, f: impl FnOnce(&CudaSlice<f32>) -> Result<R>) -> Result<R> {
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let old = guard.as_ref().map_or(0, |s| s.len());
        if old < len.max(1) {
            *guard = None;
            let cap = len.max(old.saturating_mul(2)).max(SCRATCH_MIN);
            let fresh = self.stream.alloc_zeros::<f32>(cap).map_err(|_| KernelError::OutOfMemory { device: self.device_name_str(), bytes: cap * 4 })?;
            *guard = Some(fresh);
        }
        match guard.as_ref() {
            Some(scratch) => f(scratch),
            None => unreachable!("the scratch buffer was just made"),
        }
    }

    /// A zero-filled buffer of `len` elements of `dtype`.
    pub fn zeros_as(&self, len: usize, dtype: DType) -> Result<CudaBuffer> {
        let n = len.max(1);
        let oom = |_| KernelError::OutOfMemory { device: self.device_name_str(), bytes: n * dtype.size() };
        let data = match dtype {
            DType::F32 => Data::F32(self.stream.alloc_zeros(n).map_err(oom)?),
            DType::F16 => Data::F16(self.stream.alloc_zeros(n).map_err(oom)?),
            DType::Bf16 => Data::Bf16(self.stream.alloc_zeros(n).map_err(oom)?),
            DType::U32 => Data::U32(self.stream.alloc_zeros(n).map_err(oom)?, vec![0; len]),
        };
        Ok(CudaBuffer { len, data })
    }

    /// Uploads f32 host data stored as `dtype` (f32, f16 or bf16; rounded to nearest even).
    pub fn upload_as(&self, data: &[f32], dtype: DType) -> Result<CudaBuffer> {
        const OP: &str = "upload";
        let padded: &[f32] = if data.is_empty() { &[0.0] } else { data };
        let d = match dtype {
            DType::F32 => Data::F32(self.stream.clone_htod(padded).map_err(|e| dev_err(OP, e))?),
            DType::F16 => Data::F16(self.stream.clone_htod(&to_bits(padded, DType::F16)).map_err(|e| dev_err(OP, e))?),
            DType::Bf16 => Data::Bf16(self.stream.clone_htod(&to_bits(padded, DType::Bf16)).map_err(|e| dev_err(OP, e))?),
            DType::U32 => return Err(KernelError::DType { op: OP, expected: DType::F32, actual: DType::U32 }),
        };
        Ok(CudaBuffer { len: data.len(), data: d })
    }

    /// Uploads f16 or bf16 values as they are.
    pub fn upload_bits(&self, bits: &[u16], dtype: DType) -> Result<CudaBuffer> {
        const OP: &str = "upload";
        let padded: &[u16] = if bits.is_empty() { &[0] } else { bits };
        let dev = self.stream.clone_htod(padded).map_err(|e| dev_err(OP, e))?;
        let d = match dtype {
            DType::F16 => Data::F16(dev),
            DType::Bf16 => Data::Bf16(dev),
            other => return Err(KernelError::DType { op: OP, expected: DType::Bf16, actual: other }),
        };
        Ok(CudaBuffer { len: bits.len(), data: d })
    }

    /// A weight stored as `dtype`.
    pub fn load_weight_as(&self, data: &[f32], out_features: usize, in_features: usize, dtype: DType) -> Result<CudaWeight> {
        check_weight_shape(data.len(), out_features, in_features)?;
        Ok(CudaWeight { out_features, in_features, data: self.upload_as(data, dtype)? })
    }

    /// A weight from f16 or bf16 values, stored as they are.
    pub fn load_weight_bits(&self, bits: &[u16], out_features: usize, in_features: usize, dtype: DType) -> Result<CudaWeight> {
        check_weight_shape(bits.len(), out_features, in_features)?;
        Ok(CudaWeight { out_features, in_features, data: self.upload_bits(bits, dtype)? })
    }

    /// The median device time of one run of `f`, in seconds: `warmup` runs first, then `iters`
    /// runs each bracketed by events on the stream (so host work between launches does not
    /// count unless the device waits for it).
    pub fn time_runs(&self, warmup: usize, iters: usize, mut f: impl FnMut(usize) -> Result<()>) -> Result<f64> {
        const OP: &str = "timing";
        for i in 0..warmup {
            f(i)?;
        }
        let mut events = Vec::with_capacity(iters + 1);
        // Events created without flags cannot time (cudarc's default is CU_EVENT_DISABLE_TIMING).
        for i in 0..iters {
            let e = self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| dev_err(OP, e))?;
            e.record(&self.stream).map_err(|e| dev_err(OP, e))?;
            events.push(e);
            f(warmup + i)?;
        }
        let end = self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| dev_err(OP, e))?;
        end.record(&self.stream).map_err(|e| dev_err(OP, e))?;
        events.push(end);
        self.synchronize()?;
        let mut ms: Vec<f64> = Vec::with_capacity(iters);
        for w in events.windows(2) {
            ms.push(w[0].elapsed_ms(&w[1]).map_err(|e| dev_err(OP, e))? as f64);
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms.get(ms.len() / 2).copied().unwrap_or(0.0) / 1e3)
    }

    /// Device-to-device copy bandwidth over `bytes`, counting bytes read plus bytes written.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let n = bytes / 4;
        let src = self.zeros_as(n, DType::F32)?;
        let mut dst = self.zeros_as(n, DType::F32)?;
        let (Data::F32(s), Data::F32(d)) = (&src.data, &mut dst.data) else { unreachable!("f32 buffers") };
        let secs = self.time_runs(2, 10, |_| self.stream.memcpy_dtod(s, d).map_err(|e| dev_err("copy", e)))?;
        Ok(2.0 * (n * 4) as f64 / secs)
    }

    fn device_name_str(&self) -> String {
        format!("cuda:{} ({})", self.info.ordinal, self.info.name)
    }
}

/// Fails unless `len` values fill a non-empty `[out_features, in_features]` weight.
fn check_weight_shape(len: usize, out_features: usize, in_features: usize) -> Result<()> {
    if out_features == 0 || in_features == 0 || len != out_features * in_features {
        return Err(KernelError::Shape { op: "load_weight", detail: format!("{len} values for a [{out_features}, {in_features}] weight") });
    }
    Ok(())
}

/// f32 values as the bits of `dtype` (f16 or bf16), rounded to nearest even.
pub fn to_bits(data: &[f32], dtype: DType) -> Vec<u16> {
    match dtype {
        DType::F16 => data.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect(),
        _ => data.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect(),
    }
}

/// The f32 values of `dtype` bits.
pub fn from_bits(bits: &[u16], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 => bits.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect(),
        _ => bits.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect(),
    }
}

/// Rounds f32 values through `dtype` storage and back: what a buffer of that type holds.
pub fn round_to(data: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F16 | DType::Bf16 => from_bits(&to_bits(data, dtype), dtype),
        _ => data.to_vec(),
    }
}

/// The kernel-name suffix of a storage type.
fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::Bf16 => "bf16",
        DType::U32 => "u32",
    }
}

/// The name of `lora_shrink` (or `lora_expand` when `shrink` is false) for a storage type,
/// without formatting a string per launch.
fn lora_kernel(shrink: bool, dtype: DType) -> &'static str {
    match (shrink, dtype) {
        (true, DType::F16) => "lora_shrink_f16",
        (true, DType::Bf16) => "lora_shrink_bf16",
        (true, _) => "lora_shrink_f32",
        (false, DType::F16) => "lora_expand_f16",
        (false, DType::Bf16) => "lora_expand_bf16",
        (false, _) => "lora_expand_f32",
    }
}

/// Indices into [`compile::SOURCES`].
const DENSE: usize = 0;
const ATTENTION: usize = 1;
const LORA: usize = 2;
const SAMPLING: usize = 3;

/// Every kernel name the backend launches: the CI compile test checks each exists.
pub fn kernel_names() -> Vec<(&'static str, String)> {
    let mut names = Vec::new();
    for dt in [DType::F32, DType::F16, DType::Bf16] {
        let s = suffix(dt);
        for k in ["rms_norm", "rope", "silu_mul", "silu_mul_fused", "split_columns", "add_assign", "gather_rows", "add_bias"] {
            names.push((compile::SOURCES[DENSE].0, format!("{k}_{s}")));
        }
        for k in ["write_kv", "rope_write_kv", "attn_decode", "attn_combine", "attn_prefill"].into_iter().chain(plan::GROUPED_DECODE_KERNELS) {
            names.push((compile::SOURCES[ATTENTION].0, format!("{k}_{s}")));
        }
        for k in ["lora_shrink", "lora_expand"] {
            names.push((compile::SOURCES[LORA].0, format!("{k}_{s}")));
        }
    }
    names.push((compile::SOURCES[SAMPLING].0, "argmax_rows".to_string()));
    names.push((compile::SOURCES[SAMPLING].0, "sample_rows".to_string()));
    names.push((compile::SOURCES[SAMPLING].0, "row_logprobs".to_string()));
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversions_round_to_nearest_even() {
        let v = [1.0f32, 1.0 + 1.0 / 256.0, -3.140625, 65504.0, 1e-8];
        assert_eq!(round_to(&v, DType::Bf16)[0], 1.0);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one, 1.0.
        assert_eq!(round_to(&v, DType::Bf16)[1], 1.0);
        assert_eq!(round_to(&v, DType::F16)[1], 1.0 + 1.0 / 256.0);
        assert_eq!(round_to(&v, DType::F16)[3], 65504.0);
        assert_eq!(round_to(&v, DType::F32), v.to_vec());
    }

    #[test]
    fn every_kernel_name_is_unique_and_typed() {
        let names = kernel_names();
        let mut seen = std::collections::HashSet::new();
        for (_, n) in &names {
            assert!(seen.insert(n.clone()), "{n} twice");
        }
        assert!(names.iter().any(|(m, n)| *m == "lora" && n == "lora_shrink_bf16"));
        for dt in [DType::F32, DType::F16, DType::Bf16] {
            assert_eq!(lora_kernel(true, dt), format!("lora_shrink_{}", suffix(dt)));
            assert_eq!(lora_kernel(false, dt), format!("lora_expand_{}", suffix(dt)));
        }
    }
}
