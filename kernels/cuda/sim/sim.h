// A CUDA-on-CPU simulator for the loraplex kernels, so their logic is tested without a GPU.
//
// Built as C++20 with LORAPLEX_SIM defined and this header included first. Each block runs with
// one OS thread per CUDA thread; blocks run one after another, so `__shared__` variables can be
// plain statics and the block's dynamic shared memory one buffer. __syncthreads is a barrier of
// the block's threads; warp shuffles exchange through a per-warp buffer between two barriers of
// the warp's 32 threads. A thread that returns leaves both barriers. Only what the kernels use
// is provided; anything else fails to compile.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define LORAPLEX_SIM 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) alignas(n)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint2 {
    unsigned x, y;
};
struct float4 {
    float x, y, z, w;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

struct SimWarp {
    std::unique_ptr<std::barrier<>> bar;
    uint64_t slots[32];
};

struct SimBlock {
    std::unique_ptr<std::barrier<>> bar;
    std::vector<SimWarp> warps;
    std::vector<unsigned char> smem;
};

inline SimBlock* sim_block = nullptr;

#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(sim_block->smem.data())

inline void __syncthreads() { sim_block->bar->arrive_and_wait(); }

template <typename T>
inline T sim_shfl(T v, unsigned (*src)(unsigned lane)) {
    static_assert(sizeof(T) <= 8, "shuffle of a wide type");
    const unsigned lane = threadIdx.x & 31u;
    SimWarp& w = sim_block->warps[threadIdx.x >> 5];
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    w.slots[lane] = bits;
    w.bar->arrive_and_wait();
    const unsigned from = src(lane);
    uint64_t got = w.slots[from < 32 ? from : lane];
    w.bar->arrive_and_wait();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}

inline thread_local int sim_arg;
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
    sim_arg = mask;
    return sim_shfl<T>(v, [](unsigned lane) { return lane ^ (unsigned)sim_arg; });
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src) {
    sim_arg = src;
    return sim_shfl<T>(v, [](unsigned) { return (unsigned)sim_arg; });
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
    sim_arg = (int)delta;
    return sim_shfl<T>(v, [](unsigned lane) { return lane >= (unsigned)sim_arg ? lane - (unsigned)sim_arg : lane; });
}

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float v) { unsigned u; std::memcpy(&u, &v, 4); return u; }
inline int __float_as_int(float v) { int u; std::memcpy(&u, &v, 4); return u; }

template <typename T> inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> inline T max(T a, T b) { return a < b ? b : a; }

inline std::mutex sim_atomic_lock;
inline unsigned atomicMin(unsigned* p, unsigned v) {
    std::lock_guard<std::mutex> g(sim_atomic_lock);
    unsigned old = *p;
    if (v < old) *p = v;
    return old;
}

// IEEE half conversions, round to nearest even.
inline float sim_f16_to_f32(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    unsigned bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {
            float f = std::ldexp((float)man, -24);
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

inline unsigned short sim_f32_to_f16(float f) {
    const unsigned u = __float_as_uint(f), sign = (u >> 16) & 0x8000u;
    const float a = std::fabs(f);
    if (std::isnan(f)) return (unsigned short)(sign | 0x7e00u);
    if (a >= 65520.0f) return (unsigned short)(sign | 0x7c00u);
    if (a < std::ldexp(1.0f, -14)) {
        // Subnormal: a multiple of 2^-24, rounded to nearest even by nearbyint.
        return (unsigned short)(sign | (unsigned)std::nearbyint(std::ldexp(a, 24)));
    }
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    unsigned mant = (unsigned)std::nearbyint(std::ldexp(m, 11));  // 1024..2048
    if (mant == 2048) {
        mant = 1024;
        e += 1;
    }
    if (e + 14 >= 31) return (unsigned short)(sign | 0x7c00u);
    return (unsigned short)(sign | ((unsigned)(e + 14) << 10) | (mant - 1024));
}

// Runs `kernel` (the thread body) over the grid: blocks in order, their threads concurrently.
inline void sim_launch(dim3 grid, unsigned block, unsigned smem_bytes, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = dim3{block, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                SimBlock b;
                b.bar = std::make_unique<std::barrier<>>((std::ptrdiff_t)block);
                b.warps.resize((block + 31) / 32);
                for (auto& w : b.warps) w.bar = std::make_unique<std::barrier<>>(32);
                b.smem.assign(smem_bytes + 16, 0xff);  // poisoned: NaN floats, all-ones ints
                sim_block = &b;
                std::vector<std::thread> threads;
                threads.reserve(block);
                for (unsigned t = 0; t < block; ++t) {
                    threads.emplace_back([&, t] {
                        threadIdx = dim3{t, 0, 0};
                        blockIdx = dim3{x, y, z};
                        kernel();
                        b.warps[t >> 5].bar->arrive_and_drop();
                        b.bar->arrive_and_drop();
                    });
                }
                for (auto& th : threads) th.join();
                sim_block = nullptr;
            }
}
