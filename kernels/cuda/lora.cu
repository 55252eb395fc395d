// Batched LoRA over adapter rows that live anywhere in the page pool (S-LoRA's unified pool,
// Punica's SGMV/BGMV).
//
// Work comes as tiles: (adapter slot, first token, token count <= LORA_TILE), consecutive tokens
// sharing an adapter. Prefill (SGMV) cuts each segment into tiles; decode (BGMV) gives every token
// its own tile, so each row gathers its own adapter. The host builds the tile list.
//
// An adapter's rows for (layer, module) are found through the directory: entry
// ((slot * num_layers + layer) * 7 + module) * 2 holds the first index into a_rows / b_rows and
// the rank (0: the adapter does not target the module). a_rows[first + r] is the pool offset of
// A row r in units of 16 elements; b_rows the same for row r of Bᵀ (scaling folded in). Rows are
// f32, or bf16 packed two per f32 slot, per slot_dtypes[slot]. Ranks differ per adapter and are
// never padded: a tile costs only its own adapter's rank.
//
// shrink: grid (tiles, max_rank), block (warps * 32). Block (i, r) computes v[t, r] = x[t] · A[r]
//         for the tokens of tile i, zeros for r >= rank: its threads split the input features
//         (4 consecutive per thread, strided by the block), and the partial sums meet in shared
//         memory. A whole block per (tile, rank row) keeps the GPU busy when tiles are few.
// expand: grid (tiles, ceil(out_features / threads)), block (threads). Each thread owns one output
//         of every token of the tile: y[t, o] += Σ_r v[t, r] · Bᵀ[r, o], the B-row offsets and
//         v values staged in shared memory a chunk of ranks at a time. One output per thread
//         (not four) gives four times the blocks: at decode sizes the grid is what limits it.

#define LORA_TILE 8

__device__ __forceinline__ void load4_row(const float* pool, u32 row_off, u32 bf16, u32 c, u32 len, float a[4]) {
    if (bf16) {
        const u16* row = reinterpret_cast<const u16*>(pool) + (u64)row_off * LORA_ROW_ALIGN * 2;
        if (c + 4 <= len) {
            const uint2 w = *reinterpret_cast<const uint2*>(row + c);
            a[0] = bf16_bits_to_f32((u16)(w.x & 0xffffu));
            a[1] = bf16_bits_to_f32((u16)(w.x >> 16));
            a[2] = bf16_bits_to_f32((u16)(w.y & 0xffffu));
            a[3] = bf16_bits_to_f32((u16)(w.y >> 16));
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = c + j < len ? bf16_bits_to_f32(row[c + j]) : 0.0f;
        }
    } else {
        const float* row = pool + (u64)row_off * LORA_ROW_ALIGN;
        if (c + 4 <= len) {
            const float4 w = *reinterpret_cast<const float4*>(row + c);
            a[0] = w.x;
            a[1] = w.y;
            a[2] = w.z;
            a[3] = w.w;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = c + j < len ? row[c + j] : 0.0f;
        }
    }
}

__device__ __forceinline__ float load1_row(const float* pool, u32 row_off, u32 bf16, u32 c) {
    if (bf16) return bf16_bits_to_f32(reinterpret_cast<const u16*>(pool)[(u64)row_off * LORA_ROW_ALIGN * 2 + c]);
    return pool[(u64)row_off * LORA_ROW_ALIGN + c];
}

template <typename T>
__device__ void lora_shrink_impl(const T* __restrict__ x, const float* __restrict__ pool, const u32* __restrict__ directory,
                                 const u32* __restrict__ a_rows, const u32* __restrict__ slot_dtypes, const u32* __restrict__ tiles,
                                 float* __restrict__ v, u32 in_features, u32 max_rank, u32 num_layers, u32 layer, u32 module) {
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, warps = blockDim.x >> 5;
    const u32 slot = tiles[blockIdx.x * 3], t0 = tiles[blockIdx.x * 3 + 1], count = tiles[blockIdx.x * 3 + 2];
    const u32 r = blockIdx.y;
    if (r >= max_rank) return;
    u32 first = 0, rank = 0;
    if (slot != NO_ADAPTER) {
        const u64 e = (((u64)slot * num_layers + layer) * 7 + module) * 2;
        first = directory[e];
        rank = directory[e + 1];
    }
    // Uniform over the block: every thread returns, or none does (the barrier below).
    if (r >= rank) {
        if (tid < count) v[(u64)(t0 + tid) * max_rank + r] = 0.0f;
        return;
    }
    const u32 row_off = a_rows[first + r];
    const u32 bf16 = slot_dtypes[slot];
    float acc[LORA_TILE];
#pragma unroll
    for (int i = 0; i < LORA_TILE; ++i) acc[i] = 0.0f;
    for (u32 c = tid * 4; c < in_features; c += blockDim.x * 4) {
        float a[4];
        load4_row(pool, row_off, bf16, c, in_features, a);
#pragma unroll
        for (int i = 0; i < LORA_TILE; ++i) {
            if ((u32)i < count) {
                const T* xr = x + (u64)(t0 + i) * in_features + c;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if (c + j < in_features) acc[i] += a[j] * to_f32(xr[j]);
                }
            }
        }
    }
    // Per-warp sums, then warp 0 adds the warps' sums of each token.
    __shared__ float part[LORA_TILE][32];
#pragma unroll
    for (int i = 0; i < LORA_TILE; ++i) {
        const float s = warp_sum(acc[i]);
        if (lane == 0) part[i][warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < LORA_TILE; ++i) {
            const float s = warp_sum(lane < warps ? part[i][lane] : 0.0f);
            if (lane == 0 && (u32)i < count) v[(u64)(t0 + i) * max_rank + r] = s;
        }
    }
}

// Ranks whose B-row offsets and v values an expand block stages in shared memory at a time. The
// CPU simulator stages fewer, so that the small ranks of its tests cross chunk boundaries.
#ifdef LORAPLEX_SIM
#define EXPAND_CHUNK 8
#else
#define EXPAND_CHUNK 64
#endif

template <typename T>
__device__ void lora_expand_impl(const float* __restrict__ v, const float* __restrict__ pool, const u32* __restrict__ directory,
                                 const u32* __restrict__ b_rows, const u32* __restrict__ slot_dtypes, const u32* __restrict__ tiles,
                                 T* __restrict__ y, u32 out_features, u32 max_rank, u32 num_layers, u32 layer, u32 module) {
    const u32 slot = tiles[blockIdx.x * 3], t0 = tiles[blockIdx.x * 3 + 1], count = tiles[blockIdx.x * 3 + 2];
    // Uniform over the block, like every return before the barriers below.
    if (slot == NO_ADAPTER) return;
    const u64 e = (((u64)slot * num_layers + layer) * 7 + module) * 2;
    const u32 first = directory[e], rank = directory[e + 1];
    if (rank == 0) return;
    const u32 o = blockIdx.y * blockDim.x + threadIdx.x;
    const bool active = o < out_features;
    const u32 bf16 = slot_dtypes[slot];
    // A chunk of ranks at a time, the block loads the row offsets and the tile's v values once
    // into shared memory: the loop over ranks then issues only the B-row loads, independent of
    // each other, instead of chains of dependent global loads per rank.
    __shared__ u32 s_rows[EXPAND_CHUNK];
    __shared__ float s_v[LORA_TILE][EXPAND_CHUNK];
    float acc[LORA_TILE];
#pragma unroll
    for (int i = 0; i < LORA_TILE; ++i) acc[i] = 0.0f;
    for (u32 r0 = 0; r0 < rank; r0 += EXPAND_CHUNK) {
        const u32 n = rank - r0 < EXPAND_CHUNK ? rank - r0 : EXPAND_CHUNK;
        __syncthreads();  // the previous chunk's readers are done with it
        for (u32 k = threadIdx.x; k < n; k += blockDim.x) s_rows[k] = b_rows[first + r0 + k];
        for (u32 k = threadIdx.x; k < LORA_TILE * EXPAND_CHUNK; k += blockDim.x) {
            const u32 i = k / EXPAND_CHUNK, r = k % EXPAND_CHUNK;
            if (i < count && r < n) s_v[i][r] = v[(u64)(t0 + i) * max_rank + r0 + r];
        }
        __syncthreads();
        if (active) {
#pragma unroll 4
            for (u32 r = 0; r < n; ++r) {
                const float b = load1_row(pool, s_rows[r], bf16, o);
#pragma unroll
                for (int i = 0; i < LORA_TILE; ++i) {
                    if ((u32)i < count) acc[i] += s_v[i][r] * b;
                }
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int i = 0; i < LORA_TILE; ++i) {
        if ((u32)i < count) {
            T* yr = y + (u64)(t0 + i) * out_features + o;
            *yr = from_f32<T>(to_f32(*yr) + acc[i]);
        }
    }
}

#define LORA_KERNELS(name, T)                                                                                              \
    extern "C" __global__ void lora_shrink_##name(const T* x, const float* pool, const u32* directory, const u32* a_rows,  \
                                                  const u32* slot_dtypes, const u32* tiles, float* v, u32 in_features,      \
                                                  u32 max_rank, u32 num_layers, u32 layer, u32 module) {                   \
        lora_shrink_impl<T>(x, pool, directory, a_rows, slot_dtypes, tiles, v, in_features, max_rank, num_layers, layer,    \
                            module);                                                                                       \
    }                                                                                                                      \
    extern "C" __global__ void lora_expand_##name(const float* v, const float* pool, const u32* directory, const u32* b_rows, \
                                                  const u32* slot_dtypes, const u32* tiles, T* y, u32 out_features,         \
                                                  u32 max_rank, u32 num_layers, u32 layer, u32 module) {                   \
        lora_expand_impl<T>(v, pool, directory, b_rows, slot_dtypes, tiles, y, out_features, max_rank, num_layers, layer,   \
                            module);                                                                                       \
    }

FOR_EACH_DTYPE(LORA_KERNELS)
