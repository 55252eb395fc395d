// Shared by every loraplex kernel source: element types, conversions and reductions.
//
// The sources are compiled at run time by NVRTC without any include path, so nothing here relies
// on the toolkit's headers: the 16-bit types are plain structs over their bits and convert through
// integer arithmetic (bf16) or one PTX instruction (f16). Storage is f32, f16 or bf16; every kernel
// accumulates in f32. With LORAPLEX_SIM the same sources build as C++ for the CPU simulator
// (`kernels/cuda/sim`), which the tests use to check the kernels' logic without a GPU.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define NO_ADAPTER 0xffffffffu
#define LORA_ROW_ALIGN 16u

struct __align__(2) bf16_t { u16 bits; };
struct __align__(2) f16_t { u16 bits; };

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16_t v) { return __uint_as_float(((u32)v.bits) << 16); }
__device__ __forceinline__ float to_f32(f16_t v) {
#ifdef LORAPLEX_SIM
    return sim_f16_to_f32(v.bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
#endif
}

__device__ __forceinline__ float bf16_bits_to_f32(u16 bits) { return __uint_as_float(((u32)bits) << 16); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
// Round to nearest even, NaN kept quiet: the same rounding as the host's conversion.
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float v) {
    u32 u = __float_as_uint(v);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (u16)((u >> 16) | 0x40u);
    } else {
        r.bits = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float v) {
    f16_t r;
#ifdef LORAPLEX_SIM
    r.bits = sim_f32_to_f16(v);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
#endif
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block; every thread gets the total. blockDim.x must be a multiple of 32 and
// every thread must call it. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : neg_inf();
    return warp_max(v);
}

// Rotary embedding of one pair of a head (elements j and j + head_dim / 2), in place, the
// half-split convention: c and s are the position's cosine and sine for j.
template <typename T> __device__ __forceinline__ void rope_pair(T& x0, T& x1, float c, float s) {
    const float a = to_f32(x0), b = to_f32(x1);
    x0 = from_f32<T>(a * c - b * s);
    x1 = from_f32<T>(b * c + a * s);
}

// 16 bytes, for vector loads of 16-byte aligned data.
struct __align__(16) vec16_t {
    u32 a, b, c, d;
};

// The 4 (f32) or 8 (f16, bf16) values of 16 loaded bytes, as f32.
template <typename T> __device__ __forceinline__ void unpack16(const vec16_t& v, float* f);
template <> __device__ __forceinline__ void unpack16<float>(const vec16_t& v, float* f) {
    f[0] = __uint_as_float(v.a);
    f[1] = __uint_as_float(v.b);
    f[2] = __uint_as_float(v.c);
    f[3] = __uint_as_float(v.d);
}
template <> __device__ __forceinline__ void unpack16<bf16_t>(const vec16_t& v, float* f) {
    const u32 w[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <> __device__ __forceinline__ void unpack16<f16_t>(const vec16_t& v, float* f) {
    const u32 w[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f16_t lo, hi;
        lo.bits = (u16)(w[i] & 0xffffu);
        hi.bits = (u16)(w[i] >> 16);
        f[2 * i] = to_f32(lo);
        f[2 * i + 1] = to_f32(hi);
    }
}

// The block's dynamic shared memory, as an array of T.
#ifndef LORAPLEX_SIM
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// One instantiation per storage type, with the type's name as the kernel name's suffix.
#define FOR_EACH_DTYPE(M) M(f32, float) M(f16, f16_t) M(bf16, bf16_t)
