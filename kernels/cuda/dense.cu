// Row-wise dense ops: row gather (also the embedding lookup), RMS norm fused with the residual add, rotary embedding,
// SiLU·mul, elementwise add and bias add. Launch shapes come from the host's plans
// (`kernels/src/cuda/plan.rs`); indices were checked on the host before launch.

// grid (rows), block (threads, a multiple of 32). Without a residual: out = x / rms(x) * w.
// With one: h = x + residual is written back to `residual` (rounded to T), then out = h / rms(h) * w.
// `out` may be `x`.
template <typename T>
__device__ void rms_norm_impl(const T* x, T* residual, const T* __restrict__ w, T* out, u32 dim, float eps) {
    __shared__ float scratch[32];
    const u64 base = (u64)blockIdx.x * dim;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
        float h = to_f32(x[base + c]);
        if (residual != nullptr) {
            const T hr = from_f32<T>(h + to_f32(residual[base + c]));
            residual[base + c] = hr;
            h = to_f32(hr);
        }
        ss += h * h;
    }
    const float total = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(total / (float)dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) {
        const float h = residual != nullptr ? to_f32(residual[base + c]) : to_f32(x[base + c]);
        out[base + c] = from_f32<T>(to_f32(w[c]) * (h * inv));
    }
}

// grid (tokens), block (threads): rotates each head of x [tokens, heads, head_dim] in place, the
// half-split convention. cos_sin [max_pos, head_dim] holds per position head_dim/2 cosines, then
// as many sines (the rope variant, default, linear or llama3, is in how the table was built).
template <typename T>
__device__ void rope_impl(T* x, const u32* __restrict__ positions, const float* __restrict__ cos_sin, u32 heads, u32 head_dim) {
    const u32 half = head_dim / 2;
    const float* cs = cos_sin + (u64)positions[blockIdx.x] * head_dim;
    const u64 base = (u64)blockIdx.x * heads * head_dim;
    for (u32 i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const u32 h = i / half, j = i - h * half;
        const u64 o = base + (u64)h * head_dim + j;
        rope_pair(x[o], x[o + half], cs[j], cs[half + j]);
    }
}

// grid-stride over n: out = silu(gate) * up
template <typename T>
__device__ void silu_mul_impl(const T* gate, const T* up, T* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i]);
        out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(up[i]));
    }
}

// grid-stride over rows * width: out[r, c] = silu(x[r, c]) * x[r, width + c] (a fused gate/up
// projection's output, rows of 2 * width)
template <typename T>
__device__ void silu_mul_fused_impl(const T* __restrict__ x, T* __restrict__ out, u64 total, u32 width) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / width, c = i % width;
        const float g = to_f32(x[r * 2 * width + c]);
        out[i] = from_f32<T>(g / (1.0f + expf(-g)) * to_f32(x[r * 2 * width + width + c]));
    }
}

// grid (rows), block (threads): the columns of src's row, [wa | wb | wc], copied to the same row
// of a, b and c (wb and wc may be 0, and then b or c is not touched: the caller may pass a there)
template <typename T>
__device__ void split_columns_impl(const T* __restrict__ src, T* a, T* b, T* c, u32 wa, u32 wb, u32 wc) {
    const u64 r = blockIdx.x;
    const u32 total = wa + wb + wc;
    const T* row = src + r * total;
    for (u32 i = threadIdx.x; i < total; i += blockDim.x) {
        if (i < wa) {
            a[r * wa + i] = row[i];
        } else if (i < wa + wb) {
            b[r * wb + (i - wa)] = row[i];
        } else {
            c[r * wc + (i - wa - wb)] = row[i];
        }
    }
}

// grid-stride over n: acc += x
template <typename T>
__device__ void add_assign_impl(T* acc, const T* x, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        acc[i] = from_f32<T>(to_f32(acc[i]) + to_f32(x[i]));
    }
}

// grid (rows), block (threads): out[i, :] = x[rows[i], :] (with x the embedding table, the lookup)
template <typename T>
__device__ void gather_rows_impl(const T* __restrict__ x, const u32* __restrict__ rows, T* __restrict__ out, u32 dim) {
    const u64 src = (u64)rows[blockIdx.x] * dim;
    const u64 dst = (u64)blockIdx.x * dim;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) out[dst + c] = x[src + c];
}

// grid-stride over rows * n: y[r, c] += bias[c]
template <typename T>
__device__ void add_bias_impl(T* y, const T* __restrict__ bias, u64 total, u32 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % n]));
    }
}

#define DENSE_KERNELS(name, T)                                                                                     \
    extern "C" __global__ void rms_norm_##name(const T* x, T* residual, const T* w, T* out, u32 dim, float eps) { \
        rms_norm_impl<T>(x, residual, w, out, dim, eps);                                                           \
    }                                                                                                              \
    extern "C" __global__ void rope_##name(T* x, const u32* positions, const float* cos_sin, u32 heads, u32 hd) {  \
        rope_impl<T>(x, positions, cos_sin, heads, hd);                                                            \
    }                                                                                                              \
    extern "C" __global__ void silu_mul_##name(const T* gate, const T* up, T* out, u64 n) {                        \
        silu_mul_impl<T>(gate, up, out, n);                                                                        \
    }                                                                                                              \
    extern "C" __global__ void add_assign_##name(T* acc, const T* x, u64 n) { add_assign_impl<T>(acc, x, n); }     \
    extern "C" __global__ void silu_mul_fused_##name(const T* x, T* out, u64 total, u32 width) {                 \
        silu_mul_fused_impl<T>(x, out, total, width);                                                              \
    }                                                                                                              \
    extern "C" __global__ void split_columns_##name(const T* src, T* a, T* b, T* c, u32 wa, u32 wb, u32 wc) {       \
        split_columns_impl<T>(src, a, b, c, wa, wb, wc);                                                           \
    }                                                                                                              \
    extern "C" __global__ void gather_rows_##name(const T* x, const u32* rows, T* out, u32 dim) {                  \
        gather_rows_impl<T>(x, rows, out, dim);                                                                    \
    }                                                                                                              \
    extern "C" __global__ void add_bias_##name(T* y, const T* bias, u64 total, u32 n) {                            \
        add_bias_impl<T>(y, bias, total, n);                                                                       \
    }

FOR_EACH_DTYPE(DENSE_KERNELS)
