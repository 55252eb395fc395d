// Sampling helpers over rows of logits, so that only token ids cross back to the host.
//
// argmax: grid (rows), block (threads, a multiple of 32). The first largest value of each row;
//         NaN never wins; a row with nothing above -inf gives 0.
// sample: grid (rows), block (threads, a multiple of 32). Per row: z = logits / temperature (NaN
//         counts as -inf), weights w = exp(z - max z). Top-k keeps z >= the k-th largest z (ties
//         at the threshold kept; k = 0 keeps all); top-p then keeps z >= the largest threshold
//         whose kept weight reaches top_p times the top-k weight. The token is the first index
//         whose running sum of kept weights exceeds u times their total. Thresholds are found by
//         bisection over the order-preserving integer image of the floats, one pass per step.
// logprobs: grid (rows), block (threads, a multiple of 32). Per row, over the clean logits x (NaN
//         as -inf, +inf as FLT_MAX): the log-softmax of the row's chosen token, then its n largest
//         as (id, log-softmax), largest first, the lower id first among equals: one pass over the
//         row per entry, each taking the best entry ranked after the last one taken. A row with
//         nothing above -inf gives -inf everywhere and ids 0, 1, ...

__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float from_order_key(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ void better(float& bv, u32& bi, float v, u32 i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// The block's best (value, index) under `better`, in thread 0 (each thread brings its own; the
// lowest index wins ties). `s_v` and `s_i` hold 32 entries of shared memory; every thread must call
// it, and a caller that calls it again must __syncthreads() first.
__device__ __forceinline__ void block_best(float& bv, u32& bi, float* s_v, u32* s_i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) {
        s_v[warp] = bv;
        s_i[warp] = bi;
    }
    __syncthreads();
    if (warp == 0) {
        bv = lane < warps ? s_v[lane] : neg_inf();
        bi = lane < warps ? s_i[lane] : 0xffffffffu;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    }
}

extern "C" __global__ void argmax_rows(const float* __restrict__ logits, u32* __restrict__ out, u32 vocab) {
    __shared__ float s_v[32];
    __shared__ u32 s_i[32];
    const float* row = logits + (u64)blockIdx.x * vocab;
    float bv = neg_inf();
    u32 bi = 0xffffffffu;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > bv) {
            bv = v;
            bi = i;
        }
    }
    block_best(bv, bi, s_v, s_i);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
}

__device__ __forceinline__ float scaled(const float* row, u32 i, float inv_t) {
    const float z = row[i] * inv_t;
    return z == z ? z : neg_inf();
}

// Σ w over z >= threshold (or the count of such z when `count` is set).
__device__ float mass_at_least(const float* row, u32 vocab, float inv_t, float mx, float threshold, bool count, float* scratch) {
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float z = scaled(row, i, inv_t);
        if (z >= threshold && z != neg_inf()) s += count ? 1.0f : expf(z - mx);
    }
    return block_sum(s, scratch);
}

// The largest threshold x in [lo, hi] with mass_at_least(x) >= need (the predicate holds at lo).
__device__ float bisect(const float* row, u32 vocab, float inv_t, float mx, float lo, float hi, float need, bool count, float* scratch) {
    u32 a = order_key(lo), b = order_key(hi);
    while (a < b) {
        const u32 mid = a + (b - a + 1) / 2;
        if (mass_at_least(row, vocab, inv_t, mx, from_order_key(mid), count, scratch) >= need) {
            a = mid;
        } else {
            b = mid - 1;
        }
    }
    return from_order_key(a);
}

extern "C" __global__ void sample_rows(const float* __restrict__ logits, const float* __restrict__ temperature,
                                       const u32* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ uniform,
                                       u32* __restrict__ out, u32 vocab) {
    __shared__ float scratch[32];
    __shared__ float s_warp[32];
    __shared__ u32 s_found;
    const float* row = logits + (u64)blockIdx.x * vocab;
    const float inv_t = 1.0f / temperature[blockIdx.x];
    const u32 k = top_k[blockIdx.x];
    const float p = top_p[blockIdx.x];

    float mx = neg_inf(), mn = __int_as_float(0x7f800000);
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float z = scaled(row, i, inv_t);
        if (z != neg_inf()) {
            mx = fmaxf(mx, z);
            mn = fminf(mn, z);
        }
    }
    mx = block_max(mx, scratch);
    mn = -block_max(-mn, scratch);
    if (mx == neg_inf()) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0;
        return;
    }
    float threshold = mn;
    if (k > 0 && k < vocab) {
        threshold = bisect(row, vocab, inv_t, mx, mn, mx, (float)k, true, scratch);
    }
    if (p < 1.0f) {
        const float kept = mass_at_least(row, vocab, inv_t, mx, threshold, false, scratch);
        threshold = bisect(row, vocab, inv_t, mx, threshold, mx, p * kept, false, scratch);
    }
    const float total = mass_at_least(row, vocab, inv_t, mx, threshold, false, scratch);
    const float target = uniform[blockIdx.x] * total;

    // Scan the kept weights in index order, a block-wide chunk at a time.
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) s_found = 0xffffffffu;
    float running = 0.0f;
    u32 last_kept = 0;
    for (u32 base = 0; base < vocab; base += blockDim.x) {
        const u32 i = base + threadIdx.x;
        float w = 0.0f;
        if (i < vocab) {
            const float z = scaled(row, i, inv_t);
            if (z >= threshold && z != neg_inf()) {
                w = expf(z - mx);
                last_kept = i;
            }
        }
        float incl = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float n = __shfl_up_sync(0xffffffffu, incl, o);
            if ((int)lane >= o) incl += n;
        }
        __syncthreads();
        if (lane == 31) s_warp[warp] = incl;
        __syncthreads();
        float before = running;
        for (u32 x = 0; x < warp; ++x) before += s_warp[x];
        float chunk = 0.0f;
        for (u32 x = 0; x < warps; ++x) chunk += s_warp[x];
        const float excl = before + incl - w;
        if (w > 0.0f && excl <= target && before + incl > target) atomicMin(&s_found, i);
        __syncthreads();
        if (s_found != 0xffffffffu) break;
        running += chunk;
    }
    __syncthreads();
    if (s_found == 0xffffffffu) {
        // The running sum fell short of the target by rounding: the last kept token.
        const float last = block_max((float)last_kept, scratch);
        if (threadIdx.x == 0) out[blockIdx.x] = (u32)last;
    } else if (threadIdx.x == 0) {
        out[blockIdx.x] = s_found;
    }
}

__device__ __forceinline__ float clean_logit(float x) {
    return x != x ? neg_inf() : fminf(x, __int_as_float(0x7f7fffff));
}

extern "C" __global__ void row_logprobs(const float* __restrict__ logits, const u32* __restrict__ tokens, float* __restrict__ out_vals,
                                        u32* __restrict__ out_ids, u32 n, u32 vocab) {
    __shared__ float scratch[32];
    __shared__ float s_v[32];
    __shared__ u32 s_i[32];
    __shared__ float s_best_v;
    __shared__ u32 s_best_i;
    const float* row = logits + (u64)blockIdx.x * vocab;
    float* vals = out_vals + (u64)blockIdx.x * (n + 1);
    u32* ids = out_ids + (u64)blockIdx.x * n;

    float mx = neg_inf();
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, clean_logit(row[i]));
    mx = block_max(mx, scratch);
    float s = 0.0f;
    if (mx != neg_inf()) {
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(clean_logit(row[i]) - mx);
    }
    s = block_sum(s, scratch);
    // log-softmax(x) = x - mx - log Σ exp(x - mx); everything is -inf when no logit is finite.
    const float lz = logf(s);
    const bool none = mx == neg_inf();
    if (threadIdx.x == 0) vals[0] = none ? neg_inf() : (clean_logit(row[tokens[blockIdx.x]]) - mx) - lz;

    float pv = 0.0f;
    u32 pi = 0xffffffffu;
    for (u32 j = 0; j < n; ++j) {
        float bv = neg_inf();
        u32 bi = 0xffffffffu;
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = clean_logit(row[i]);
            if (j == 0 || v < pv || (v == pv && i > pi)) better(bv, bi, v, i);
        }
        block_best(bv, bi, s_v, s_i);
        if (threadIdx.x == 0) {
            s_best_v = bv;
            s_best_i = bi;
            ids[j] = bi;
            vals[1 + j] = none ? neg_inf() : (bv - mx) - lz;
        }
        __syncthreads();
        pv = s_best_v;
        pi = s_best_i;
    }
}
