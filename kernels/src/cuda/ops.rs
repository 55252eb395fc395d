//! The Backend trait on the CUDA device: each op checks its arguments on the host (the checks
//! the CPU backend runs), asks a plan for its launch shape and launches the kernel instantiated
//! for its buffers' storage type.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, PushKernelArg};

use super::plan::{self, AttentionPlan};
use super::{ATTENTION, CudaBackend, CudaBuffer, CudaWeight, DENSE, Data, LORA, SAMPLING, dev_err, suffix};
use crate::check::{Batch, Directory, Segments, check_slots, ensure_len, ensure_rows, rows_of};
use crate::{
    AttentionOps, AttentionParams, BatchMeta, DType, DenseOps, KernelError, KvLayout, LoraOps, LoraRows, LoraSegments, LoraTarget, Memory, NO_ADAPTER, Result,
    RowDType, RowLogprobs, SampleParams, SamplingOps, WeightData,
};

/// Fails unless every buffer holds the same float type; returns it.
/// A size passed to a kernel as `u32`, refused when it does not fit.
fn u32_arg(op: &'static str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| KernelError::Shape { op, detail: format!("{what} of {n} does not fit a u32") })
}

fn same_float(op: &'static str, bufs: &[&CudaBuffer]) -> Result<DType> {
    let dtype = bufs[0].float(op)?;
    for b in &bufs[1..] {
        b.expect(op, dtype)?;
    }
    Ok(dtype)
}

impl Memory for CudaBackend {
    type Buffer = CudaBuffer;
    type Weight = CudaWeight;

    fn device_name(&self) -> String {
        self.device_name_str()
    }

    fn compute_dtype(&self) -> DType {
        self.compute
    }

    fn supports_kv_dtype(&self, dtype: RowDType) -> bool {
        dtype.dtype() == self.compute
    }

    fn zeros(&self, len: usize) -> Result<CudaBuffer> {
        self.zeros_as(len, self.compute)
    }

    fn zeros_f32(&self, len: usize) -> Result<CudaBuffer> {
        self.zeros_as(len, DType::F32)
    }

    fn upload_f32(&self, data: &[f32]) -> Result<CudaBuffer> {
        self.upload_as(data, self.compute)
    }

    fn upload_u32(&self, data: &[u32]) -> Result<CudaBuffer> {
        let padded = if data.is_empty() { &[0u32][..] } else { data };
        let dev = self.stream.clone_htod(padded).map_err(|e| dev_err("upload_u32", e))?;
        Ok(CudaBuffer { len: data.len(), data: Data::U32(dev, data.to_vec()) })
    }

    fn download_f32(&self, buf: &CudaBuffer) -> Result<Vec<f32>> {
        const OP: &str = "download_f32";
        let mut out = match &buf.data {
            Data::F32(s) => self.stream.clone_dtoh(s).map_err(|e| dev_err(OP, e))?,
            Data::F16(s) => super::from_bits(&self.stream.clone_dtoh(s).map_err(|e| dev_err(OP, e))?, DType::F16),
            Data::Bf16(s) => super::from_bits(&self.stream.clone_dtoh(s).map_err(|e| dev_err(OP, e))?, DType::Bf16),
            Data::U32(..) => return Err(KernelError::DType { op: OP, expected: DType::F32, actual: DType::U32 }),
        };
        out.truncate(buf.len);
        Ok(out)
    }

    fn write_f32(&self, buf: &mut CudaBuffer, offset: usize, data: &[f32]) -> Result<()> {
        const OP: &str = "write_f32";
        let end = offset.checked_add(data.len()).filter(|&end| end <= buf.len);
        let Some(end) = end else {
            return Err(KernelError::Index { op: OP, index: offset.saturating_add(data.len()), limit: buf.len });
        };
        if data.is_empty() {
            return Ok(());
        }
        match &mut buf.data {
            Data::F32(s) => self.stream.memcpy_htod(data, &mut s.slice_mut(offset..end)),
            Data::F16(s) => self.stream.memcpy_htod(&super::to_bits(data, DType::F16), &mut s.slice_mut(offset..end)),
            Data::Bf16(s) => self.stream.memcpy_htod(&super::to_bits(data, DType::Bf16), &mut s.slice_mut(offset..end)),
            Data::U32(..) => return Err(KernelError::DType { op: OP, expected: DType::F32, actual: DType::U32 }),
        }
        .map_err(|e| dev_err(OP, e))
    }

    fn start_upload(&self, buf: &mut CudaBuffer, writes: &[(usize, &[f32])]) -> Result<crate::Upload> {
        self.upload_on_copy_stream(buf, writes)
    }

    fn copy_within(&self, buf: &mut CudaBuffer, src: usize, dst: usize, len: usize) -> Result<()> {
        const OP: &str = "copy_within";
        for start in [src, dst] {
            match start.checked_add(len) {
                Some(end) if end <= buf.len => {}
                _ => return Err(KernelError::Index { op: OP, index: start.saturating_add(len), limit: buf.len }),
            }
        }
        if src < dst + len && dst < src + len && len > 0 {
            return Err(KernelError::Shape { op: OP, detail: format!("source {src} and destination {dst} overlap over {len} values") });
        }
        if len == 0 {
            return Ok(());
        }
        macro_rules! copy {
            ($s:expr) => {{
                if src < dst {
                    let (a, mut b) = $s.split_at_mut(dst);
                    self.stream.memcpy_dtod(&a.slice(src..src + len), &mut b.slice_mut(0..len))
                } else {
                    let (mut a, b) = $s.split_at_mut(src);
                    self.stream.memcpy_dtod(&b.slice(0..len), &mut a.slice_mut(dst..dst + len))
                }
            }};
        }
        match &mut buf.data {
            Data::F32(s) => copy!(s),
            Data::F16(s) | Data::Bf16(s) => copy!(s),
            Data::U32(..) => return Err(KernelError::DType { op: OP, expected: DType::F32, actual: DType::U32 }),
        }
        .map_err(|e| dev_err(OP, e))
    }

    fn load_weight(&self, data: &[f32], out_features: usize, in_features: usize) -> Result<CudaWeight> {
        self.load_weight_as(data, out_features, in_features, self.compute)
    }

    fn load_weight_data(&self, data: WeightData<'_>, out_features: usize, in_features: usize) -> Result<CudaWeight> {
        match (data, self.compute) {
            // A bf16 checkpoint on a bf16 backend goes up as it is stored, never widened.
            (WeightData::Bf16(bits), DType::Bf16) => self.load_weight_bits(bits, out_features, in_features, DType::Bf16),
            _ => self.load_weight_as(&data.to_f32(), out_features, in_features, self.compute),
        }
    }
}

fn cuda_type(dtype: DType) -> cudaDataType {
    match dtype {
        DType::F16 => cudaDataType::CUDA_R_16F,
        DType::Bf16 => cudaDataType::CUDA_R_16BF,
        _ => cudaDataType::CUDA_R_32F,
    }
}

impl CudaBackend {
    /// RMS norm fused with the residual add: `residual += x`, then `out = rms_norm(residual)`.
    pub fn rms_norm_residual(&self, x: &CudaBuffer, residual: &mut CudaBuffer, weight: &CudaBuffer, out: &mut CudaBuffer, eps: f32) -> Result<()> {
        self.rms_norm_impl("rms_norm_residual", x, Some(residual), weight, out, eps)
    }

    fn rms_norm_impl(
        &self,
        op: &'static str,
        x: &CudaBuffer,
        residual: Option<&mut CudaBuffer>,
        weight: &CudaBuffer,
        out: &mut CudaBuffer,
        eps: f32,
    ) -> Result<()> {
        let dtype = same_float(op, &[x, weight, out])?;
        let dim = weight.len;
        let rows = rows_of(op, "x", x.len, dim)?;
        ensure_len(op, "out", out.len, rows * dim)?;
        if let Some(r) = &residual {
            r.expect(op, dtype)?;
            ensure_len(op, "residual", r.len, rows * dim)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let name = format!("rms_norm_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let l = plan::per_row(op, rows, dim)?;
        let (dim, null) = (dim as u32, 0u64);
        let residual = residual.map(|r| &*r);
        self.launch(op, &name, &f, &l, |b| {
            x.push(b);
            match residual {
                Some(r) => r.push(b),
                None => {
                    b.arg(&null);
                }
            }
            weight.push(b);
            out.push(b);
            b.arg(&dim).arg(&eps);
        })
    }

    /// `out[i] = x[rows[i]]` over rows of `dim` (the embedding lookup when `x` is the table).
    fn gather(&self, op: &'static str, x: &CudaBuffer, rows: &CudaBuffer, out: &CudaBuffer, dim: usize) -> Result<()> {
        let dtype = same_float(op, &[x, out])?;
        let total = rows_of(op, "the source", x.len, dim)?;
        let host = crate::check::HostU32::host_u32(rows, op)?;
        ensure_len(op, "out", out.len, host.len() * dim)?;
        if let Some(&bad) = host.iter().find(|&&r| r as usize >= total) {
            return Err(KernelError::Index { op, index: bad as usize, limit: total });
        }
        if host.is_empty() {
            return Ok(());
        }
        let name = format!("gather_rows_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let l = plan::per_row(op, host.len(), dim)?;
        let dim = dim as u32;
        self.launch(op, &name, &f, &l, |b| {
            x.push(b);
            rows.push(b);
            out.push(b);
            b.arg(&dim);
        })
    }

    /// `y[rows, n] += bias`.
    fn add_bias(&self, y: &CudaBuffer, bias: &CudaBuffer, rows: usize, n: usize) -> Result<()> {
        const OP: &str = "add_bias";
        let dtype = same_float(OP, &[y, bias])?;
        ensure_len(OP, "bias", bias.len, n)?;
        let name = format!("add_bias_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let total = (rows * n) as u64;
        let l = plan::elementwise(OP, rows * n)?;
        let n = n as u32;
        self.launch(OP, &name, &f, &l, |b| {
            y.push(b);
            bias.push(b);
            b.arg(&total).arg(&n);
        })
    }
}

impl DenseOps for CudaBackend {
    fn embedding(&self, table: &CudaBuffer, ids: &CudaBuffer, out: &mut CudaBuffer, hidden: usize) -> Result<()> {
        // The lookup is a row gather from the table.
        self.gather("embedding", table, ids, out, hidden)
    }

    fn rms_norm(&self, x: &CudaBuffer, weight: &CudaBuffer, out: &mut CudaBuffer, eps: f32) -> Result<()> {
        self.rms_norm_impl("rms_norm", x, None, weight, out, eps)
    }

    fn matmul(&self, x: &CudaBuffer, w: &CudaWeight, bias: Option<&CudaBuffer>, out: &mut CudaBuffer, rows: usize) -> Result<()> {
        const OP: &str = "matmul";
        let dtype = same_float(OP, &[x, &w.data])?;
        // out is x's type, or f32 without a bias (cuBLAS writes f32 from 16-bit inputs).
        let out_type = out.float(OP)?;
        if out_type != dtype && (out_type != DType::F32 || bias.is_some()) {
            return Err(KernelError::DType { op: OP, expected: dtype, actual: out_type });
        }
        let (n, k) = (w.out_features, w.in_features);
        ensure_rows(OP, "x", x.len, rows, k)?;
        ensure_rows(OP, "out", out.len, rows, n)?;
        if let Some(bias) = bias {
            bias.expect(OP, dtype)?;
            ensure_len(OP, "bias", bias.len, n)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let int = |v: usize| i32::try_from(v).map_err(|_| KernelError::Shape { op: OP, detail: format!("dimension {v} exceeds cuBLAS's range") });
        let (m_, n_, k_) = (int(n)?, int(rows)?, int(k)?);
        let ptr = |b: &CudaBuffer| match &b.data {
            Data::F32(s) => s.device_ptr(&self.stream).0,
            Data::F16(s) | Data::Bf16(s) => s.device_ptr(&self.stream).0,
            Data::U32(s, _) => s.device_ptr(&self.stream).0,
        };
        let (pw, px, po) = (ptr(&w.data), ptr(x), ptr(out));
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (ty, out_ty) = (cuda_type(dtype), cuda_type(out_type));
        // Launches bind the context themselves; the raw cuBLAS call does not.
        self.ctx.bind_to_thread().map_err(|e| dev_err(OP, e))?;
        {
            let blas = self.blas.lock().unwrap_or_else(|p| p.into_inner());
            // Row-major out[rows, n] = x[rows, k] · w[n, k]ᵀ is column-major outᵀ = w · xᵀ: w read
            // transposed (lda = k), x as is (ldb = k), out with ldc = n.
            // SAFETY: the three pointers are live device buffers of this context holding at least
            // n*k and rows*k elements of `ty` and rows*n of `out_ty` (checked above); alpha and beta are f32 as the
            // 32F compute type requires; the handle's stream is this backend's stream.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    m_,
                    n_,
                    k_,
                    &alpha as *const f32 as *const _,
                    pw as *const _,
                    ty,
                    k_,
                    px as *const _,
                    ty,
                    k_,
                    &beta as *const f32 as *const _,
                    po as *mut _,
                    out_ty,
                    m_,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| dev_err(OP, e))?;
        }
        match bias {
            Some(bias) => self.add_bias(out, bias, rows, n),
            None => Ok(()),
        }
    }

    fn silu_mul(&self, gate: &CudaBuffer, up: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        const OP: &str = "silu_mul";
        let dtype = same_float(OP, &[gate, up, out])?;
        ensure_len(OP, "up", up.len, gate.len)?;
        ensure_len(OP, "out", out.len, gate.len)?;
        if gate.len == 0 {
            return Ok(());
        }
        let name = format!("silu_mul_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let l = plan::elementwise(OP, gate.len)?;
        let n = gate.len as u64;
        self.launch(OP, &name, &f, &l, |b| {
            gate.push(b);
            up.push(b);
            out.push(b);
            b.arg(&n);
        })
    }

    fn silu_mul_fused(&self, x: &CudaBuffer, out: &mut CudaBuffer, width: usize) -> Result<()> {
        const OP: &str = "silu_mul_fused";
        let dtype = same_float(OP, &[x, out])?;
        let row = width.checked_mul(2).ok_or_else(|| KernelError::Shape { op: OP, detail: format!("width {width} overflows") })?;
        let rows = rows_of(OP, "x", x.len, row)?;
        ensure_rows(OP, "out", out.len, rows, width)?;
        if rows == 0 {
            return Ok(());
        }
        let name = format!("silu_mul_fused_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let total = rows * width;
        let l = plan::elementwise(OP, total)?;
        let (total, width) = (total as u64, u32_arg(OP, "width", width)?);
        self.launch(OP, &name, &f, &l, |b| {
            x.push(b);
            out.push(b);
            b.arg(&total).arg(&width);
        })
    }

    fn split_columns(&self, src: &CudaBuffer, rows: usize, parts: &mut [(&mut CudaBuffer, usize)]) -> Result<()> {
        const OP: &str = "split_columns";
        let dtype = src.float(OP)?;
        for (p, _) in parts.iter() {
            p.expect(OP, dtype)?;
        }
        let shape: Vec<(usize, usize)> = parts.iter().map(|(p, w)| (p.len, *w)).collect();
        let total = crate::check::split_columns(OP, src.len, rows, &shape)?;
        if rows == 0 {
            return Ok(());
        }
        let name = format!("split_columns_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let l = plan::per_row(OP, rows, total)?;
        let width = |i: usize| shape.get(i).map_or(Ok(0), |&(_, w)| u32_arg(OP, "a width", w));
        let (wa, wb, wc) = (width(0)?, width(1)?, width(2)?);
        let bufs: Vec<&CudaBuffer> = parts.iter().map(|(p, _)| &**p).collect();
        // An absent part is never written (its width is 0); the first stands in for it.
        let pick = |i: usize| bufs.get(i).copied().unwrap_or(bufs[0]);
        self.launch(OP, &name, &f, &l, |b| {
            src.push(b);
            pick(0).push(b);
            pick(1).push(b);
            pick(2).push(b);
            b.arg(&wa).arg(&wb).arg(&wc);
        })
    }

    fn add_assign(&self, acc: &mut CudaBuffer, x: &CudaBuffer) -> Result<()> {
        const OP: &str = "add_assign";
        let dtype = same_float(OP, &[acc, x])?;
        ensure_len(OP, "x", x.len, acc.len)?;
        if acc.len == 0 {
            return Ok(());
        }
        let name = format!("add_assign_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let l = plan::elementwise(OP, acc.len)?;
        let n = acc.len as u64;
        self.launch(OP, &name, &f, &l, |b| {
            acc.push(b);
            x.push(b);
            b.arg(&n);
        })
    }

    fn gather_rows(&self, x: &CudaBuffer, rows: &CudaBuffer, out: &mut CudaBuffer, dim: usize) -> Result<()> {
        self.gather("gather_rows", x, rows, out, dim)
    }

    fn add_rms_norm(&self, residual: &mut CudaBuffer, x: &CudaBuffer, weight: &CudaBuffer, out: &mut CudaBuffer, eps: f32) -> Result<()> {
        self.rms_norm_residual(x, residual, weight, out, eps)
    }
}

impl AttentionOps for CudaBackend {
    fn rope(&self, x: &mut CudaBuffer, positions: &CudaBuffer, cos_sin: &CudaBuffer, heads: usize, head_dim: usize) -> Result<()> {
        const OP: &str = "rope";
        let dtype = x.float(OP)?;
        let tokens = check_positions(OP, positions, cos_sin, head_dim)?;
        if tokens == 0 {
            return Ok(());
        }
        let l = plan::rope(OP, tokens, heads, head_dim)?;
        ensure_len(OP, "x", x.len, tokens * heads * head_dim)?;
        let name = format!("rope_{}", suffix(dtype));
        let f = self.function(DENSE, &name)?;
        let (heads, hd) = (heads as u32, head_dim as u32);
        self.launch(OP, &name, &f, &l, |b| {
            x.push(b);
            positions.push(b);
            cos_sin.push(b);
            b.arg(&heads).arg(&hd);
        })
    }

    fn write_kv(&self, k: &CudaBuffer, v: &CudaBuffer, cache: &mut CudaBuffer, meta: &BatchMeta<CudaBuffer>, layout: &KvLayout, layer: usize) -> Result<()> {
        const OP: &str = "write_kv";
        let (dtype, pe) = check_kv_write(OP, same_float(OP, &[k, v])?, k, v, cache, meta, layout, layer)?;
        if meta.num_tokens == 0 {
            return Ok(());
        }
        let name = format!("write_kv_{}", suffix(dtype));
        let f = self.function(ATTENTION, &name)?;
        let l = plan::per_row(OP, meta.num_tokens, layout.num_kv_heads * layout.head_dim)?;
        let (kvh, hd, bs, layer) = (layout.num_kv_heads as u32, layout.head_dim as u32, layout.block_size as u32, layer as u32);
        self.launch(OP, &name, &f, &l, |b| {
            k.push(b);
            v.push(b);
            cache.push(b);
            meta.slots.push(b);
            b.arg(&kvh).arg(&hd).arg(&bs).arg(&pe).arg(&layer);
        })
    }

    fn rope_write_kv(
        &self,
        q: &mut CudaBuffer,
        k: &mut CudaBuffer,
        v: &CudaBuffer,
        cos_sin: &CudaBuffer,
        num_heads: usize,
        cache: &mut CudaBuffer,
        meta: &BatchMeta<CudaBuffer>,
        layout: &KvLayout,
        layer: usize,
    ) -> Result<()> {
        const OP: &str = "rope_write_kv";
        // Both ops' checks: write_kv's, then the rope's (an even head size, every position in
        // the table).
        let (dtype, pe) = check_kv_write(OP, same_float(OP, &[q, k, v])?, k, v, cache, meta, layout, layer)?;
        let (hd, kvh) = (layout.head_dim, layout.num_kv_heads);
        let row = kvh * hd;
        ensure_len(OP, "q", q.len, meta.num_tokens * num_heads * hd)?;
        if meta.num_tokens == 0 {
            return Ok(());
        }
        plan::rope(OP, meta.num_tokens, num_heads, hd)?;
        ensure_len(OP, "positions", check_positions(OP, &meta.positions, cos_sin, hd)?, meta.num_tokens)?;
        let name = format!("rope_write_kv_{}", suffix(dtype));
        let f = self.function(ATTENTION, &name)?;
        let l = plan::per_row(OP, meta.num_tokens, (num_heads * hd / 2).max(row))?;
        let (heads, kvh, hd, bs, layer) = (num_heads as u32, kvh as u32, hd as u32, layout.block_size as u32, layer as u32);
        self.launch(OP, &name, &f, &l, |b| {
            q.push(b);
            k.push(b);
            v.push(b);
            cache.push(b);
            meta.positions.push(b);
            cos_sin.push(b);
            meta.slots.push(b);
            b.arg(&heads).arg(&kvh).arg(&hd).arg(&bs).arg(&pe).arg(&layer);
        })
    }

    fn attention(
        &self,
        q: &CudaBuffer,
        cache: &CudaBuffer,
        out: &mut CudaBuffer,
        meta: &BatchMeta<CudaBuffer>,
        layout: &KvLayout,
        p: &AttentionParams,
    ) -> Result<()> {
        const OP: &str = "attention";
        let (dtype, pe) = kv_access(OP, layout, cache, same_float(OP, &[q, out])?)?;
        let m = Batch::read(OP, meta)?;
        let token_seq = m.check_attention(OP, layout, p, cache.len / layout.page_elems())?;
        let (hd, heads) = (p.head_dim, p.num_heads);
        ensure_len(OP, "q", q.len, meta.num_tokens * heads * hd)?;
        ensure_len(OP, "out", out.len, meta.num_tokens * heads * hd)?;
        if meta.num_tokens == 0 {
            return Ok(());
        }
        let attn_plan = plan::attention(
            OP,
            m.seq_starts,
            m.positions,
            heads,
            p.num_kv_heads,
            hd,
            p.sliding_window,
            plan::Limits { sm_count: self.info.sm_count, max_smem: self.info.max_smem_optin, grouped_decode: self.grouped_decode() },
        )?;
        let (mb, nh, nkv, hd32, bs) = (m.max_blocks as u32, heads as u32, p.num_kv_heads as u32, hd as u32, layout.block_size as u32);
        let (layer, scale) = (p.layer as u32, p.scale);
        let window = p.sliding_window.map_or(0u32, |w| w.min(u32::MAX as usize) as u32);
        let s = suffix(dtype);
        match attn_plan {
            AttentionPlan::Decode { launch, part_size, parts, combine, kernel } => {
                let token_seq = self.upload_meta(OP, &token_seq)?;
                let name = format!("{kernel}_{s}");
                let f = self.function(ATTENTION, &name)?;
                // The partials' device addresses (null when one partition covers the keys).
                let decode = |(acc, ml): &(u64, u64)| {
                    self.launch(OP, &name, &f, &launch, |b| {
                        q.push(b);
                        cache.push(b);
                        out.push(b);
                        b.arg(acc).arg(ml);
                        b.arg(&*token_seq);
                        meta.positions.push(b);
                        meta.block_tables.push(b);
                        b.arg(&mb).arg(&nh).arg(&nkv).arg(&hd32).arg(&bs).arg(&pe).arg(&layer).arg(&scale).arg(&window).arg(&part_size);
                    })
                };
                let Some(combine) = combine else {
                    return decode(&(0, 0));
                };
                // Each (token, head, partition) row: head_dim partial sums, then its max and
                // denominator. Every partition's block writes its row, empty ones included.
                let rows = meta.num_tokens * heads * parts as usize;
                let (acc_len, ml_len) = (rows * hd, rows * 2);
                self.with_attn_scratch(acc_len + ml_len, |scratch| {
                    let base = scratch.device_ptr(&self.stream).0;
                    let (acc, ml) = (base, base + (acc_len * std::mem::size_of::<f32>()) as u64);
                    decode(&(acc, ml))?;
                    let name = format!("attn_combine_{s}");
                    let f = self.function(ATTENTION, &name)?;
                    self.launch(OP, &name, &f, &combine, |b| {
                        b.arg(&acc).arg(&ml);
                        out.push(b);
                        b.arg(&nh).arg(&hd32).arg(&parts);
                    })
                })
            }
            AttentionPlan::Prefill { launch, tiles } => {
                let tiles = self.upload_meta(OP, &tiles)?;
                let name = format!("attn_prefill_{s}");
                let f = self.function(ATTENTION, &name)?;
                self.launch(OP, &name, &f, &launch, |b| {
                    q.push(b);
                    cache.push(b);
                    out.push(b);
                    b.arg(&*tiles);
                    meta.positions.push(b);
                    meta.block_tables.push(b);
                    b.arg(&mb).arg(&nh).arg(&nkv).arg(&hd32).arg(&bs).arg(&pe).arg(&layer).arg(&scale).arg(&window);
                })
            }
        }
    }
}

impl SamplingOps for CudaBackend {
    fn draws_on_device(&self) -> bool {
        true
    }

    fn argmax_rows(&self, logits: &CudaBuffer, vocab: usize) -> Result<Vec<u32>> {
        const OP: &str = "argmax_rows";
        logits.expect(OP, DType::F32)?;
        let rows = rows_of(OP, "logits", logits.len, vocab)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let out = self.zeros_as(rows, DType::U32)?;
        let f = self.function(SAMPLING, "argmax_rows")?;
        let l = plan::per_row(OP, rows, vocab)?;
        let v = vocab as u32;
        self.launch(OP, "argmax_rows", &f, &l, |b| {
            logits.push(b);
            out.push(b);
            b.arg(&v);
        })?;
        self.download_u32(OP, &out)
    }

    fn sample_rows(&self, logits: &CudaBuffer, vocab: usize, params: &[SampleParams]) -> Result<Vec<u32>> {
        const OP: &str = "sample_rows";
        logits.expect(OP, DType::F32)?;
        let rows = rows_of(OP, "logits", logits.len, vocab)?;
        crate::check_sample_params(OP, params, rows)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let temps: Vec<f32> = params.iter().map(|p| p.temperature).collect();
        let ks: Vec<u32> = params.iter().map(|p| p.top_k).collect();
        let ps: Vec<f32> = params.iter().map(|p| p.top_p).collect();
        let us: Vec<f32> = params.iter().map(|p| p.uniform).collect();
        let (temps, ps, us) = (self.upload_as(&temps, DType::F32)?, self.upload_as(&ps, DType::F32)?, self.upload_as(&us, DType::F32)?);
        let ks = self.upload_u32(&ks)?;
        let out = self.zeros_as(rows, DType::U32)?;
        let f = self.function(SAMPLING, "sample_rows")?;
        let l = plan::per_row(OP, rows, vocab)?;
        let v = vocab as u32;
        self.launch(OP, "sample_rows", &f, &l, |b| {
            logits.push(b);
            temps.push(b);
            ks.push(b);
            ps.push(b);
            us.push(b);
            out.push(b);
            b.arg(&v);
        })?;
        self.download_u32(OP, &out)
    }

    fn row_logprobs(&self, logits: &CudaBuffer, vocab: usize, tokens: &[u32], n: usize) -> Result<Vec<RowLogprobs>> {
        const OP: &str = "row_logprobs";
        logits.expect(OP, DType::F32)?;
        let rows = rows_of(OP, "logits", logits.len, vocab)?;
        crate::check_logprob_args(OP, tokens, rows, vocab, n)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let toks = self.upload_u32(tokens)?;
        let vals = self.zeros_as(rows * (n + 1), DType::F32)?;
        // At least one id per row, so that no buffer is empty.
        let ids = self.zeros_as(rows * n.max(1), DType::U32)?;
        let f = self.function(SAMPLING, "row_logprobs")?;
        let l = plan::per_row(OP, rows, vocab)?;
        let (n32, v) = (n as u32, vocab as u32);
        self.launch(OP, "row_logprobs", &f, &l, |b| {
            logits.push(b);
            toks.push(b);
            vals.push(b);
            ids.push(b);
            b.arg(&n32);
            b.arg(&v);
        })?;
        let vals = self.download_f32(&vals)?;
        let ids = self.download_u32(OP, &ids)?;
        let kept = n.min(vocab);
        Ok((0..rows)
            .map(|r| {
                let top = (0..kept).map(|j| (ids[r * n + j], vals[r * (n + 1) + 1 + j])).collect();
                RowLogprobs { logprob: vals[r * (n + 1)], top }
            })
            .collect())
    }
}

impl CudaBackend {
    fn download_u32(&self, op: &'static str, buf: &CudaBuffer) -> Result<Vec<u32>> {
        match &buf.data {
            Data::U32(s, _) => {
                let mut v = self.stream.clone_dtoh(s).map_err(|e| dev_err(op, e))?;
                v.truncate(buf.len);
                Ok(v)
            }
            _ => Err(KernelError::DType { op, expected: DType::U32, actual: buf.dtype() }),
        }
    }

    /// The shrink over `n_tiles` uploaded tiles: `v[t, r]` for every token the tiles cover and
    /// every `r < max_rank` (zeros for `r` at or past the tile's adapter's rank).
    #[allow(clippy::too_many_arguments)]
    fn lora_shrink(
        &self,
        op: &'static str,
        x: &CudaBuffer,
        pool: &CudaBuffer,
        rows: &LoraRows<CudaBuffer>,
        tiles: &CudaSlice<u32>,
        n_tiles: usize,
        target: &LoraTarget,
        v: &CudaSlice<f32>,
    ) -> Result<()> {
        let dtype = x.float(op)?;
        let name = super::lora_kernel(true, dtype);
        let l = plan::lora_shrink(op, n_tiles, target.max_rank)?;
        let f = self.function(LORA, name)?;
        let (inf, mr, nl, layer, module) =
            (target.in_features as u32, target.max_rank as u32, rows.num_layers as u32, target.layer as u32, target.module as u32);
        self.launch(op, name, &f, &l, |b| {
            x.push(b);
            pool.push(b);
            rows.directory.push(b);
            rows.a_rows.push(b);
            rows.slot_dtypes.push(b);
            b.arg(tiles);
            b.arg(v);
            b.arg(&inf).arg(&mr).arg(&nl).arg(&layer).arg(&module);
        })
    }

    /// The expand over `n_tiles` uploaded tiles: `y[t] += v[t] · Bᵀ` for every token the tiles
    /// cover; reads `v[t, r]` only for those tokens and `r` below their adapter's rank.
    #[allow(clippy::too_many_arguments)]
    fn lora_expand(
        &self,
        op: &'static str,
        v: &CudaSlice<f32>,
        pool: &CudaBuffer,
        rows: &LoraRows<CudaBuffer>,
        tiles: &CudaSlice<u32>,
        n_tiles: usize,
        target: &LoraTarget,
        y: &CudaBuffer,
    ) -> Result<()> {
        let dtype = y.float(op)?;
        let name = super::lora_kernel(false, dtype);
        let l = plan::lora_expand(op, n_tiles, target.out_features)?;
        let f = self.function(LORA, name)?;
        let (outf, mr, nl, layer, module) =
            (target.out_features as u32, target.max_rank as u32, rows.num_layers as u32, target.layer as u32, target.module as u32);
        self.launch(op, name, &f, &l, |b| {
            b.arg(v);
            pool.push(b);
            rows.directory.push(b);
            rows.b_rows.push(b);
            rows.slot_dtypes.push(b);
            b.arg(tiles);
            y.push(b);
            b.arg(&outf).arg(&mr).arg(&nl).arg(&layer).arg(&module);
        })
    }
}

impl LoraOps for CudaBackend {
    fn sgmv_shrink(
        &self,
        x: &CudaBuffer,
        pool: &CudaBuffer,
        rows: &LoraRows<CudaBuffer>,
        segs: &LoraSegments<CudaBuffer>,
        target: &LoraTarget,
        v: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "sgmv_shrink";
        pool.expect(OP, DType::F32)?;
        x.float(OP)?;
        v.expect(OP, DType::F32)?;
        let _dir = Directory::read(OP, rows, target, pool.len)?;
        let segs = Segments::read(OP, segs, rows.num_slots)?;
        ensure_rows(OP, "x", x.len, segs.tokens, target.in_features)?;
        ensure_rows(OP, "v", v.len, segs.tokens, target.max_rank)?;
        // Every token's row of v is written, zeros where there is no adapter.
        let tiles = plan::segment_tiles(segs.starts, segs.slots, |_| true);
        if tiles.is_empty() {
            return Ok(());
        }
        let dev_tiles = self.upload_meta(OP, &tiles)?;
        self.lora_shrink(OP, x, pool, rows, &dev_tiles, tiles.len() / 3, target, v.f32_slice(OP)?)
    }

    fn sgmv_expand(
        &self,
        v: &CudaBuffer,
        pool: &CudaBuffer,
        rows: &LoraRows<CudaBuffer>,
        segs: &LoraSegments<CudaBuffer>,
        target: &LoraTarget,
        y: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "sgmv_expand";
        pool.expect(OP, DType::F32)?;
        v.expect(OP, DType::F32)?;
        y.float(OP)?;
        let dir = Directory::read(OP, rows, target, pool.len)?;
        let segs = Segments::read(OP, segs, rows.num_slots)?;
        ensure_rows(OP, "v", v.len, segs.tokens, target.max_rank)?;
        ensure_rows(OP, "y", y.len, segs.tokens, target.out_features)?;
        let tiles = plan::segment_tiles(segs.starts, segs.slots, |s| dir.active(s));
        if tiles.is_empty() {
            return Ok(());
        }
        let dev_tiles = self.upload_meta(OP, &tiles)?;
        self.lora_expand(OP, v.f32_slice(OP)?, pool, rows, &dev_tiles, tiles.len() / 3, target, y)
    }

    fn bgmv(&self, x: &CudaBuffer, pool: &CudaBuffer, rows: &LoraRows<CudaBuffer>, slots: &CudaBuffer, target: &LoraTarget, y: &mut CudaBuffer) -> Result<()> {
        const OP: &str = "bgmv";
        pool.expect(OP, DType::F32)?;
        same_float(OP, &[x, y])?;
        let dir = Directory::read(OP, rows, target, pool.len)?;
        let host = crate::check::HostU32::host_u32(slots, OP)?;
        check_slots(OP, host, rows.num_slots)?;
        let n = host.len();
        ensure_rows(OP, "x", x.len, n, target.in_features)?;
        ensure_rows(OP, "y", y.len, n, target.out_features)?;
        let tiles = plan::row_tiles(host, |s| s != NO_ADAPTER && dir.active(s));
        if tiles.is_empty() {
            return Ok(());
        }
        // One upload (or cache hit) serves both launches.
        let n_tiles = tiles.len() / 3;
        let dev_tiles = self.upload_meta(OP, &tiles)?;
        // The rank buffer v ([n, max_rank]) is the backend's reused scratch, neither allocated
        // nor zeroed here: its old contents are never read. Shrink and expand run over the same
        // tiles; shrink's grid covers every r < max_rank (one block per tile and r) and writes
        // v[t, r] for every token t of its tile, x[t]·A[r] for r < rank and 0 for r >= rank. Expand reads v[t, r] only for the
        // tokens of its tiles and r < rank, and rank <= max_rank (`Directory::read` checks it).
        // Rows whose slot is NO_ADAPTER or inactive get no tile: neither kernel touches them.
        // kernels/tests/cuda_sim.rs runs this pair with v poisoned with NaN.
        self.with_lora_scratch(n * target.max_rank, |v| {
            self.lora_shrink(OP, x, pool, rows, &dev_tiles, n_tiles, target, v)?;
            self.lora_expand(OP, v, pool, rows, &dev_tiles, n_tiles, target, y)
        })
    }
}

/// The type the KV kernels read and write for activations of type `act`, and the page stride
/// in its elements. With f32 pages the pool buffer's own element type (f32, f16 or bf16) is the
/// KV type, one value per element; with bf16 pages the pool is f32 slots, two bf16 values each
/// (the lower-addressed first), which the bf16 kernels read as a bf16 array of twice the length.
/// What `rope` checks of its positions: each within the cos/sin table (f32, `head_dim` wide).
/// Their number.
fn check_positions(op: &'static str, positions: &CudaBuffer, cos_sin: &CudaBuffer, head_dim: usize) -> Result<usize> {
    cos_sin.expect(op, DType::F32)?;
    let pos = crate::check::HostU32::host_u32(positions, op)?;
    if pos.is_empty() {
        return Ok(0);
    }
    let max_pos = rows_of(op, "cos_sin", cos_sin.len, head_dim)?;
    if let Some(&p) = pos.iter().find(|&&p| p as usize >= max_pos) {
        return Err(KernelError::Index { op, index: p as usize, limit: max_pos });
    }
    Ok(pos.len())
}

/// What `write_kv` checks before writing: the cache's type against the activations' (`act`), K
/// and V rows for every token, the layer, every slot within the cache. The kernels' type and a
/// page's elements, as [`kv_access`].
#[allow(clippy::too_many_arguments)]
fn check_kv_write(
    op: &'static str,
    act: DType,
    k: &CudaBuffer,
    v: &CudaBuffer,
    cache: &CudaBuffer,
    meta: &BatchMeta<CudaBuffer>,
    layout: &KvLayout,
    layer: usize,
) -> Result<(DType, u64)> {
    let access = kv_access(op, layout, cache, act)?;
    let m = Batch::read(op, meta)?;
    let row = layout.num_kv_heads * layout.head_dim;
    ensure_len(op, "k", k.len, meta.num_tokens * row)?;
    ensure_len(op, "v", v.len, meta.num_tokens * row)?;
    if layer >= layout.num_layers {
        return Err(KernelError::Index { op, index: layer, limit: layout.num_layers });
    }
    m.check_slots(op, layout, cache.len / layout.page_elems())?;
    Ok(access)
}

fn kv_access(op: &'static str, layout: &KvLayout, cache: &CudaBuffer, act: DType) -> Result<(DType, u64)> {
    match layout.dtype {
        RowDType::F32 => {
            cache.expect(op, act)?;
            Ok((act, layout.page_elems() as u64))
        }
        RowDType::Bf16 => {
            cache.expect(op, DType::F32)?;
            if act != DType::Bf16 {
                return Err(KernelError::DType { op, expected: DType::Bf16, actual: act });
            }
            Ok((DType::Bf16, layout.page_values() as u64))
        }
    }
}
