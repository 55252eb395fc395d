// The paged KV cache: writing new keys and values into their pages, and attention over it.
//
// A page holds `block_size` consecutive tokens of one sequence for every layer, laid out
// [layer][k|v][kv_head][token_in_block][head_dim] (KvLayout on the host). A sequence's pages are
// listed in its row of `block_tables`. Queries are [tokens, heads, head_dim]; `token_seq` maps each
// query token to its sequence and `positions` gives its position, so a token at position p attends
// to keys first..=p (first = p + 1 - window with a sliding window, else 0).
//
// Two attention kernels:
// - decode: one block per (token, head, partition of the keys); each warp runs an online softmax
//   over tiles of 32 keys of the partition, one key a lane against the query in shared memory,
//   then the warps merge in shared memory. With several partitions (long contexts, few tokens), each writes its
//   running max, sum and unnormalised output, and `attn_combine` merges them.
// - prefill: one block per (tile of up to PREFILL_Q query tokens of one sequence, head); the
//   block walks the keys in tiles of 32 staged in shared memory, one warp per query row with one
//   lane per key, flash-style (online softmax, the scores never leave registers).

#define MAX_LANE_DIMS 8 // head_dim <= 32 * MAX_LANE_DIMS
#define PREFILL_Q 16
#define PREFILL_K 32
#define PREFILL_WARPS 4
#define PREFILL_ROWS (PREFILL_Q / PREFILL_WARPS)  // query rows per warp

// grid (tokens), block (threads)
template <typename T>
__device__ void write_kv_impl(const T* __restrict__ k, const T* __restrict__ v, T* cache, const u32* __restrict__ slots, u32 kv_heads,
                              u32 head_dim, u32 block_size, u64 page_elems, u32 layer) {
    const u32 t = blockIdx.x;
    const u32 slot = slots[t];
    const u32 page = slot / block_size, off = slot - page * block_size;
    const u64 per_head = (u64)block_size * head_dim, per_kv = kv_heads * per_head;
    const u64 base = (u64)page * page_elems + (u64)layer * 2 * per_kv + (u64)off * head_dim;
    const u32 row = kv_heads * head_dim;
    for (u32 i = threadIdx.x; i < row; i += blockDim.x) {
        const u32 h = i / head_dim, d = i - h * head_dim;
        const u64 dst = base + h * per_head + d;
        cache[dst] = k[(u64)t * row + i];
        cache[dst + per_kv] = v[(u64)t * row + i];
    }
}

// grid (tokens), block (threads): rope_impl's rotation of q's `heads` and k's `kv_heads` heads in
// place, and write_kv_impl's copy of k (rotated) and v into the token's cache slot, in one pass:
// the same values, bit for bit, as those three kernels one after the other.
template <typename T>
__device__ void rope_write_kv_impl(T* q, T* k, const T* __restrict__ v, T* cache, const u32* __restrict__ positions, const float* __restrict__ cos_sin,
                                   const u32* __restrict__ slots, u32 heads, u32 kv_heads, u32 head_dim, u32 block_size, u64 page_elems, u32 layer) {
    const u32 t = blockIdx.x, half = head_dim / 2;
    const float* cs = cos_sin + (u64)positions[t] * head_dim;
    const u64 qb = (u64)t * heads * head_dim;
    for (u32 i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const u32 h = i / half, j = i - h * half;
        const u64 o = qb + (u64)h * head_dim + j;
        rope_pair(q[o], q[o + half], cs[j], cs[half + j]);
    }
    const u32 slot = slots[t];
    const u32 page = slot / block_size, off = slot - page * block_size;
    const u64 per_head = (u64)block_size * head_dim, per_kv = kv_heads * per_head;
    const u64 base = (u64)page * page_elems + (u64)layer * 2 * per_kv + (u64)off * head_dim;
    const u32 row = kv_heads * head_dim;
    const u64 kb = (u64)t * row;
    for (u32 i = threadIdx.x; i < kv_heads * half; i += blockDim.x) {
        const u32 h = i / half, j = i - h * half;
        const u64 o = kb + (u64)h * head_dim + j;
        rope_pair(k[o], k[o + half], cs[j], cs[half + j]);
        const u64 dst = base + h * per_head + j;
        cache[dst] = k[o];
        cache[dst + half] = k[o + half];
    }
    for (u32 i = threadIdx.x; i < row; i += blockDim.x) {
        const u32 h = i / head_dim, d = i - h * head_dim;
        cache[base + h * per_head + d + per_kv] = v[kb + i];
    }
}

// Pointer to the key row of `key` (the value row is `per_kv` further).
template <typename T>
__device__ __forceinline__ const T* key_row(const T* cache, const u32* table, u32 key, u32 block_size, u64 page_elems, u64 head_off,
                                            u32 head_dim) {
    const u32 page = table[key / block_size];
    return cache + (u64)page * page_elems + head_off + (u64)(key % block_size) * head_dim;
}

// What one decode block reads: the keys [k0, k1) of token t's partition `part` (a sliding
// window honoured), the token's block table, and where KV head kvh's rows lie in a page (the
// value rows `per_kv` after the keys). `vec`: key rows start 16-byte aligned when the pool does
// and every offset to them is a whole number of 16-byte chunks.
struct DecodeSpan {
    u32 k0, k1;
    const u32* table;
    u64 per_kv, head_off;
    bool vec;
};

template <typename T>
__device__ __forceinline__ DecodeSpan decode_span(const T* cache, const u32* token_seq, const u32* positions, const u32* block_tables,
                                                  u32 max_blocks, u32 t, u32 kvh, u32 kv_heads, u32 head_dim, u32 block_size,
                                                  u64 page_elems, u32 layer, u32 window, u32 part, u32 part_size) {
    const u32 pos = positions[t];
    const u32 first = (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
    DecodeSpan s;
    s.k0 = first + part * part_size;
    s.k1 = min(s.k0 + part_size, pos + 1);
    s.table = block_tables + (u64)token_seq[t] * max_blocks;
    s.per_kv = (u64)kv_heads * block_size * head_dim;
    s.head_off = (u64)layer * 2 * s.per_kv + (u64)kvh * block_size * head_dim;
    constexpr u32 V = 16 / sizeof(T);
    s.vec = head_dim % V == 0 && page_elems % V == 0 && (((u64)cache) & 15u) == 0;
    return s;
}

// q . (the key row at kp), q in shared memory (scaled), the row read in 16-byte loads when
// `vec` (rows and pages 16-byte aligned), else element by element.
template <typename T>
__device__ __forceinline__ float key_dot(const float* __restrict__ s_q, const T* kp, u32 head_dim, bool vec) {
    float dot = 0.0f;
    if (vec) {
        constexpr u32 V = 16 / sizeof(T);
        const vec16_t* kv = (const vec16_t*)kp;
        const u32 chunks = head_dim / V;
#pragma unroll 4
        for (u32 c = 0; c < chunks; ++c) {
            float f[V];
            unpack16<T>(kv[c], f);
#pragma unroll
            for (u32 e = 0; e < V; ++e) dot += s_q[c * V + e] * f[e];
        }
    } else {
        for (u32 d = 0; d < head_dim; ++d) dot += s_q[d] * to_f32(kp[d]);
    }
    return dot;
}

// grid (tokens, heads, parts), block (warps * 32), dynamic shared memory
// (2 + head_dim) * warps + head_dim floats.
//
// Each warp takes tiles of 32 consecutive keys of the partition, one key a lane: the lane reads
// its whole key row (16-byte loads where aligned) and dots it with the query in shared memory, so
// a tile costs one max and one sum across the warp rather than one reduction per key. The value
// rows are then summed lane-per-dimension, the tile's 32 rows loaded independently of each other.
template <typename T>
__device__ void attn_decode_impl(const T* __restrict__ q, const T* __restrict__ cache, T* __restrict__ out, float* __restrict__ part_acc,
                                 float* __restrict__ part_ml, const u32* __restrict__ token_seq, const u32* __restrict__ positions,
                                 const u32* __restrict__ block_tables, u32 max_blocks, u32 heads, u32 kv_heads, u32 head_dim,
                                 u32 block_size, u64 page_elems, u32 layer, float scale, u32 window, u32 part_size) {
    DYNAMIC_SHARED(float, smem);
    const u32 t = blockIdx.x, h = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 kvh = h / (heads / kv_heads);
    const auto [k0, k1, table, per_kv, head_off, vec] =
        decode_span(cache, token_seq, positions, block_tables, max_blocks, t, kvh, kv_heads, head_dim, block_size, page_elems, layer, window, part, part_size);

    float* s_q = smem + (2 + head_dim) * warps;
    const T* qp = q + ((u64)t * heads + h) * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) s_q[d] = to_f32(qp[d]) * scale;
    __syncthreads();

    float acc[MAX_LANE_DIMS];
#pragma unroll
    for (int i = 0; i < MAX_LANE_DIMS; ++i) acc[i] = 0.0f;
    float m = neg_inf(), l = 0.0f;
    for (u32 kt = k0 + warp * 32u; kt < k1; kt += warps * 32u) {
        const u32 key = kt + lane;
        const bool valid = key < k1;
        const float s = valid ? key_dot(s_q, key_row(cache, table, key, block_size, page_elems, head_off, head_dim), head_dim, vec) : neg_inf();
        const float m_new = fmaxf(m, warp_max(s));  // the tile's first key is valid
        const float corr = expf(m - m_new);
        const float p = valid ? expf(s - m_new) : 0.0f;
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < MAX_LANE_DIMS; ++i) acc[i] *= corr;
        const u32 n = min(32u, k1 - kt);
#pragma unroll 8
        for (u32 j = 0; j < 32u; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            if (j < n) {
                const T* vp = key_row(cache, table, kt + j, block_size, page_elems, head_off, head_dim) + per_kv;
#pragma unroll
                for (int i = 0; i < MAX_LANE_DIMS; ++i) {
                    const u32 d = lane + 32u * i;
                    if (d < head_dim) acc[i] += pj * to_f32(vp[d]);
                }
            }
        }
        m = m_new;
    }

    // Merge the warps: smem = [m per warp][l per warp][acc per warp, head_dim each].
    float* s_m = smem;
    float* s_l = smem + warps;
    float* s_acc = smem + 2 * warps;
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_LANE_DIMS; ++i) {
        const u32 d = lane + 32u * i;
        if (d < head_dim) s_acc[warp * head_dim + d] = acc[i];
    }
    __syncthreads();
    float mx = neg_inf();
    for (u32 w = 0; w < warps; ++w) mx = fmaxf(mx, s_m[w]);
    float sum = 0.0f;
    for (u32 w = 0; w < warps; ++w) {
        if (s_m[w] != neg_inf()) sum += s_l[w] * expf(s_m[w] - mx);
    }
    const u64 row = ((u64)t * heads + h) * parts + part;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (u32 w = 0; w < warps; ++w) {
            if (s_m[w] != neg_inf()) a += s_acc[w * head_dim + d] * expf(s_m[w] - mx);
        }
        if (parts == 1) {
            out[((u64)t * heads + h) * head_dim + d] = from_f32<T>(a / sum);
        } else {
            part_acc[row * head_dim + d] = a;
        }
    }
    if (parts > 1 && threadIdx.x == 0) {
        part_ml[row * 2] = mx;
        part_ml[row * 2 + 1] = sum;
    }
}

// The grouped decode kernel: one block per (token, KV head, partition) for the G query heads
// that share the KV head (grouped-query attention), so each key and value row is read once for
// the G of them rather than once per query head. As attn_decode otherwise: tiles of 32 keys, one
// key a lane, its row dotted with the G queries in shared memory; the value row loaded once and
// added into the G heads' sums. LD: the most dims a lane keeps per head (head_dim <= 32 * LD).
// grid (tokens, kv_heads, parts), block (warps * 32), dynamic shared memory
// (G * head_dim + 2 * warps * G + warps * G * head_dim) floats.
template <typename T, int G, int LD>
__device__ void attn_decode_group_impl(const T* __restrict__ q, const T* __restrict__ cache, T* __restrict__ out,
                                       float* __restrict__ part_acc, float* __restrict__ part_ml, const u32* __restrict__ token_seq,
                                       const u32* __restrict__ positions, const u32* __restrict__ block_tables, u32 max_blocks,
                                       u32 heads, u32 kv_heads, u32 head_dim, u32 block_size, u64 page_elems, u32 layer, float scale,
                                       u32 window, u32 part_size) {
    DYNAMIC_SHARED(float, smem);
    const u32 t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 h0 = kvh * G;  // the group's first query head
    const auto [k0, k1, table, per_kv, head_off, vec] =
        decode_span(cache, token_seq, positions, block_tables, max_blocks, t, kvh, kv_heads, head_dim, block_size, page_elems, layer, window, part, part_size);
    constexpr u32 V = 16 / sizeof(T);

    // smem: [G][head_dim] queries, then [warps][G] maxima, [warps][G] sums, [warps][G][head_dim] sums.
    float* s_q = smem;
    float* s_m = s_q + G * head_dim;
    float* s_l = s_m + warps * G;
    float* s_acc = s_l + warps * G;
    for (u32 i = threadIdx.x; i < G * head_dim; i += blockDim.x) {
        const u32 g = i / head_dim, d = i - g * head_dim;
        s_q[i] = to_f32(q[((u64)t * heads + h0 + g) * head_dim + d]) * scale;
    }
    __syncthreads();

    float acc[G][LD], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = neg_inf();
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < LD; ++i) acc[g][i] = 0.0f;
    }
    for (u32 kt = k0 + warp * 32u; kt < k1; kt += warps * 32u) {
        const u32 key = kt + lane;
        const bool valid = key < k1;
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.0f;
        if (valid) {
            const T* kp = key_row(cache, table, key, block_size, page_elems, head_off, head_dim);
            if (vec) {
                const vec16_t* kv = (const vec16_t*)kp;
                for (u32 c = 0; c < head_dim / V; ++c) {
                    float f[V];
                    unpack16<T>(kv[c], f);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const float* qg = s_q + g * head_dim + c * V;
#pragma unroll
                        for (u32 e = 0; e < V; ++e) s[g] += qg[e] * f[e];
                    }
                }
            } else {
                for (u32 d = 0; d < head_dim; ++d) {
                    const float f = to_f32(kp[d]);
#pragma unroll
                    for (int g = 0; g < G; ++g) s[g] += s_q[g * head_dim + d] * f;
                }
            }
        }
        float p[G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float sg = valid ? s[g] : neg_inf();
            const float m_new = fmaxf(m[g], warp_max(sg));  // the tile's first key is valid
            const float corr = expf(m[g] - m_new);
            p[g] = valid ? expf(sg - m_new) : 0.0f;
            l[g] = l[g] * corr + warp_sum(p[g]);
#pragma unroll
            for (int i = 0; i < LD; ++i) acc[g][i] *= corr;
            m[g] = m_new;
        }
        const u32 n = min(32u, k1 - kt);
#pragma unroll 4
        for (u32 j = 0; j < 32u; ++j) {
            float pj[G];
#pragma unroll
            for (int g = 0; g < G; ++g) pj[g] = __shfl_sync(0xffffffffu, p[g], j);
            if (j < n) {
                const T* vp = key_row(cache, table, kt + j, block_size, page_elems, head_off, head_dim) + per_kv;
#pragma unroll
                for (int i = 0; i < LD; ++i) {
                    const u32 d = lane + 32u * i;
                    if (d < head_dim) {
                        const float v = to_f32(vp[d]);
#pragma unroll
                        for (int g = 0; g < G; ++g) acc[g][i] += pj[g] * v;
                    }
                }
            }
        }
    }

    // Merge the warps, per query head of the group.
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            s_m[warp * G + g] = m[g];
            s_l[warp * G + g] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int i = 0; i < LD; ++i) {
            const u32 d = lane + 32u * i;
            if (d < head_dim) s_acc[(warp * G + g) * head_dim + d] = acc[g][i];
        }
    }
    __syncthreads();
    for (u32 idx = threadIdx.x; idx < G * head_dim; idx += blockDim.x) {
        const u32 g = idx / head_dim, d = idx - g * head_dim;
        float mx = neg_inf();
        for (u32 w = 0; w < warps; ++w) mx = fmaxf(mx, s_m[w * G + g]);
        float sum = 0.0f, a = 0.0f;
        for (u32 w = 0; w < warps; ++w) {
            const float mw = s_m[w * G + g];
            if (mw != neg_inf()) {
                const float f = expf(mw - mx);
                sum += s_l[w * G + g] * f;
                a += s_acc[(w * G + g) * head_dim + d] * f;
            }
        }
        const u32 h = h0 + g;
        const u64 row = ((u64)t * heads + h) * parts + part;
        if (parts == 1) {
            out[((u64)t * heads + h) * head_dim + d] = from_f32<T>(a / sum);
        } else {
            part_acc[row * head_dim + d] = a;
            if (d == 0) {
                part_ml[row * 2] = mx;
                part_ml[row * 2 + 1] = sum;
            }
        }
    }
}

// grid (tokens, heads), block (threads): merges the partitions of attn_decode.
template <typename T>
__device__ void attn_combine_impl(const float* __restrict__ part_acc, const float* __restrict__ part_ml, T* __restrict__ out, u32 heads,
                                  u32 head_dim, u32 parts) {
    const u32 t = blockIdx.x, h = blockIdx.y;
    const u64 base = ((u64)t * heads + h) * parts;
    float mx = neg_inf();
    for (u32 p = 0; p < parts; ++p) mx = fmaxf(mx, part_ml[(base + p) * 2]);
    float sum = 0.0f;
    for (u32 p = 0; p < parts; ++p) {
        const float mp = part_ml[(base + p) * 2];
        if (mp != neg_inf()) sum += part_ml[(base + p) * 2 + 1] * expf(mp - mx);
    }
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (u32 p = 0; p < parts; ++p) {
            const float mp = part_ml[(base + p) * 2];
            if (mp != neg_inf()) a += part_acc[(base + p) * head_dim + d] * expf(mp - mx);
        }
        out[((u64)t * heads + h) * head_dim + d] = from_f32<T>(a / sum);
    }
}

// grid (tiles, heads), block (PREFILL_WARPS * 32), dynamic shared memory:
// Q [PREFILL_Q][head_dim] + K [PREFILL_K][head_dim + 1] + V [PREFILL_K][head_dim] floats.
// `tiles` holds (sequence, first token, token count) per tile; the tile's tokens are consecutive
// query tokens of that sequence.
template <typename T>
__device__ void attn_prefill_impl(const T* __restrict__ q, const T* __restrict__ cache, T* __restrict__ out, const u32* __restrict__ tiles,
                                  const u32* __restrict__ positions, const u32* __restrict__ block_tables, u32 max_blocks, u32 heads,
                                  u32 kv_heads, u32 head_dim, u32 block_size, u64 page_elems, u32 layer, float scale, u32 window) {
    DYNAMIC_SHARED(float, smem);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 seq = tiles[blockIdx.x * 3], t0 = tiles[blockIdx.x * 3 + 1], count = tiles[blockIdx.x * 3 + 2];
    const u32 h = blockIdx.y;
    const u32 kvh = h / (heads / kv_heads);
    const u32* table = block_tables + (u64)seq * max_blocks;
    const u64 per_kv = (u64)kv_heads * block_size * head_dim;
    const u64 head_off = (u64)layer * 2 * per_kv + (u64)kvh * block_size * head_dim;
    const u32 kstride = head_dim + 1;
    float* s_q = smem;
    float* s_k = s_q + PREFILL_Q * head_dim;
    float* s_v = s_k + PREFILL_K * kstride;

    // The keys the tile needs: from the earliest first key of its tokens to its last position.
    u32 lo = 0xffffffffu, hi = 0;
    for (u32 i = 0; i < count; ++i) {
        const u32 p = positions[t0 + i];
        const u32 f = (window != 0 && p + 1 > window) ? p + 1 - window : 0;
        lo = min(lo, f);
        hi = max(hi, p + 1);
    }
    for (u32 idx = threadIdx.x; idx < PREFILL_Q * head_dim; idx += blockDim.x) {
        const u32 r = idx / head_dim, d = idx - r * head_dim;
        s_q[idx] = r < count ? to_f32(q[((u64)(t0 + r) * heads + h) * head_dim + d]) * scale : 0.0f;
    }

    float m[PREFILL_ROWS], l[PREFILL_ROWS], acc[PREFILL_ROWS][MAX_LANE_DIMS];
    u32 my_pos[PREFILL_ROWS], my_first[PREFILL_ROWS];
#pragma unroll
    for (int r = 0; r < PREFILL_ROWS; ++r) {
        m[r] = neg_inf();
        l[r] = 0.0f;
        const u32 row = warp * PREFILL_ROWS + r;
        const bool live = row < count;
        const u32 p = live ? positions[t0 + row] : 0;
        my_pos[r] = p;
        my_first[r] = live ? ((window != 0 && p + 1 > window) ? p + 1 - window : 0) : 1;  // first > pos: no keys
#pragma unroll
        for (int i = 0; i < MAX_LANE_DIMS; ++i) acc[r][i] = 0.0f;
    }

    for (u32 kt = lo; kt < hi; kt += PREFILL_K) {
        __syncthreads();  // the previous tile's K and V are no longer read
        for (u32 idx = threadIdx.x; idx < PREFILL_K * head_dim; idx += blockDim.x) {
            const u32 j = idx / head_dim, d = idx - j * head_dim;
            const u32 key = kt + j;
            float kv = 0.0f, vv = 0.0f;
            if (key < hi) {
                const T* kp = key_row(cache, table, key, block_size, page_elems, head_off, head_dim);
                kv = to_f32(kp[d]);
                vv = to_f32(kp[per_kv + d]);
            }
            s_k[j * kstride + d] = kv;
            s_v[j * head_dim + d] = vv;
        }
        __syncthreads();
        const u32 key = kt + lane;
#pragma unroll
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            const u32 row = warp * PREFILL_ROWS + r;
            const bool valid = row < count && key < hi && key >= my_first[r] && key <= my_pos[r];
            float s = neg_inf();
            if (valid) {
                const float* qrow = s_q + row * head_dim;
                const float* krow = s_k + lane * kstride;
                float dot = 0.0f;
                for (u32 d = 0; d < head_dim; ++d) dot += qrow[d] * krow[d];
                s = dot;
            }
            const float tile_max = warp_max(s);
            if (tile_max == neg_inf()) continue;  // no key of this tile for this row (uniform across the warp)
            const float m_new = fmaxf(m[r], tile_max);
            const float corr = expf(m[r] - m_new);
            const float p = valid ? expf(s - m_new) : 0.0f;
            l[r] = l[r] * corr + warp_sum(p);
#pragma unroll
            for (int i = 0; i < MAX_LANE_DIMS; ++i) acc[r][i] *= corr;
            for (u32 j = 0; j < PREFILL_K; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                if (pj == 0.0f) continue;
                const float* vrow = s_v + j * head_dim;
#pragma unroll
                for (int i = 0; i < MAX_LANE_DIMS; ++i) {
                    const u32 d = lane + 32u * i;
                    if (d < head_dim) acc[r][i] += pj * vrow[d];
                }
            }
            m[r] = m_new;
        }
    }
#pragma unroll
    for (int r = 0; r < PREFILL_ROWS; ++r) {
        const u32 row = warp * PREFILL_ROWS + r;
        if (row >= count) continue;
        const float inv = 1.0f / l[r];
        T* op = out + ((u64)(t0 + row) * heads + h) * head_dim;
#pragma unroll
        for (int i = 0; i < MAX_LANE_DIMS; ++i) {
            const u32 d = lane + 32u * i;
            if (d < head_dim) op[d] = from_f32<T>(acc[r][i] * inv);
        }
    }
}

// attn_decode_g{G}_d{LD}_{type}: the grouped decode kernel for G query heads a KV head and
// head_dim up to 32 * LD.
#define ATTN_DECODE_GROUP(name, T, G, LD)                                                                                  \
    extern "C" __global__ void attn_decode_g##G##_d##LD##_##name(                                                           \
        const T* q, const T* cache, T* out, float* part_acc, float* part_ml, const u32* token_seq, const u32* positions,    \
        const u32* block_tables, u32 max_blocks, u32 heads, u32 kv_heads, u32 hd, u32 block_size, u64 page_elems,           \
        u32 layer, float scale, u32 window, u32 part_size) {                                                                \
        attn_decode_group_impl<T, G, LD>(q, cache, out, part_acc, part_ml, token_seq, positions, block_tables, max_blocks,  \
                                         heads, kv_heads, hd, block_size, page_elems, layer, scale, window, part_size);     \
    }

#define ATTENTION_KERNELS(name, T)                                                                                          \
    extern "C" __global__ void write_kv_##name(const T* k, const T* v, T* cache, const u32* slots, u32 kv_heads, u32 hd,    \
                                               u32 block_size, u64 page_elems, u32 layer) {                                 \
        write_kv_impl<T>(k, v, cache, slots, kv_heads, hd, block_size, page_elems, layer);                                  \
    }                                                                                                                       \
    extern "C" __global__ void rope_write_kv_##name(T* q, T* k, const T* v, T* cache, const u32* positions,                 \
                                                    const float* cos_sin, const u32* slots, u32 heads, u32 kv_heads, u32 hd, \
                                                    u32 block_size, u64 page_elems, u32 layer) {                             \
        rope_write_kv_impl<T>(q, k, v, cache, positions, cos_sin, slots, heads, kv_heads, hd, block_size, page_elems, layer); \
    }                                                                                                                       \
    extern "C" __global__ void attn_decode_##name(const T* q, const T* cache, T* out, float* part_acc, float* part_ml,     \
                                                  const u32* token_seq, const u32* positions, const u32* block_tables,     \
                                                  u32 max_blocks, u32 heads, u32 kv_heads, u32 hd, u32 block_size,         \
                                                  u64 page_elems, u32 layer, float scale, u32 window, u32 part_size) {     \
        attn_decode_impl<T>(q, cache, out, part_acc, part_ml, token_seq, positions, block_tables, max_blocks, heads,        \
                            kv_heads, hd, block_size, page_elems, layer, scale, window, part_size);                         \
    }                                                                                                                       \
    ATTN_DECODE_GROUP(name, T, 2, 4) ATTN_DECODE_GROUP(name, T, 2, 8) ATTN_DECODE_GROUP(name, T, 4, 4)                     \
    ATTN_DECODE_GROUP(name, T, 4, 8) ATTN_DECODE_GROUP(name, T, 8, 4) ATTN_DECODE_GROUP(name, T, 8, 8)                     \
    extern "C" __global__ void attn_combine_##name(const float* part_acc, const float* part_ml, T* out, u32 heads, u32 hd, \
                                                   u32 parts) {                                                             \
        attn_combine_impl<T>(part_acc, part_ml, out, heads, hd, parts);                                                     \
    }                                                                                                                       \
    extern "C" __global__ void attn_prefill_##name(const T* q, const T* cache, T* out, const u32* tiles,                   \
                                                   const u32* positions, const u32* block_tables, u32 max_blocks,           \
                                                   u32 heads, u32 kv_heads, u32 hd, u32 block_size, u64 page_elems,         \
                                                   u32 layer, float scale, u32 window) {                                    \
        attn_prefill_impl<T>(q, cache, out, tiles, positions, block_tables, max_blocks, heads, kv_heads, hd, block_size,    \
                             page_elems, layer, scale, window);                                                             \
    }

FOR_EACH_DTYPE(ATTENTION_KERNELS)
