// Runs the CUDA sources of a2ats_ref/runtime/decode/cuda.py on the host, for tests/gpu/test_cuda_emu.py: one std::thread per
// CUDA thread, a std::barrier per block (__syncthreads) and per warp (shuffles, ballots), `__shared__` as
// function statics (shared by the block running; blocks run one at a time). Built with AddressSanitizer, so an
// index outside an input, output or shared array stops the run. Timing, the memory model and the GPU's
// scheduling are not emulated: this checks indices and logic, not speed.
#pragma once
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
namespace cuda { namespace std { using ::std::array; } }
using std::max;
using std::min;

// 16-bit floats: conversions exact to float, back with round-to-nearest-even (what the GPU's casts do)
struct __half {
    uint16_t bits = 0;
    __half() = default;
    explicit __half(float f) {
        uint32_t x; std::memcpy(&x, &f, 4);
        const uint32_t sign = (x >> 16) & 0x8000u, e8 = (x >> 23) & 0xffu;
        uint32_t mant = x & 0x7fffffu;
        if (e8 == 0xffu) { bits = uint16_t(sign | 0x7c00u | (mant ? 0x200u : 0u)); return; }
        const int e = int(e8) - 127 + 15;
        if (e >= 31) { bits = uint16_t(sign | 0x7c00u); return; }
        if (e <= 0) {
            if (e < -10) { bits = uint16_t(sign); return; }
            mant |= 0x800000u;
            const int shift = 14 - e;
            uint32_t h = mant >> shift;
            const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
            if (rem > half || (rem == half && (h & 1u))) ++h;
            bits = uint16_t(sign | h);
            return;
        }
        uint32_t h = (uint32_t(e) << 10) | (mant >> 13);
        const uint32_t rem = mant & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
        bits = uint16_t(sign | h);
    }
};
inline float __half2float(__half h) {
    const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16, e = (h.bits >> 10) & 0x1fu, m = h.bits & 0x3ffu;
    uint32_t x;
    if (e == 0) {
        if (m == 0) x = sign;
        else { float f = std::ldexp(float(m), -24); std::memcpy(&x, &f, 4); x |= sign; }
    } else if (e == 31) x = sign | 0x7f800000u | (m << 13);
    else x = sign | ((e - 15 + 127) << 23) | (m << 13);
    float f; std::memcpy(&f, &x, 4);
    return f;
}
struct __nv_bfloat16 {
    uint16_t bits = 0;
    __nv_bfloat16() = default;
    explicit __nv_bfloat16(float f) {
        uint32_t x; std::memcpy(&x, &f, 4);
        bits = (x & 0x7fffffffu) > 0x7f800000u ? uint16_t((x >> 16) | 0x40u) : uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    }
};
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t x = uint32_t(h.bits) << 16; float f; std::memcpy(&f, &x, 4); return f; }

struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(int(x)); }
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicSub(int* p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }

// the block's barrier and each warp's exchange slots, made per block launch
struct a2ats_warp { std::barrier<> bar{32}; uint32_t slot[32]; };
inline std::unique_ptr<std::barrier<>> a2ats_block_bar;
inline std::vector<std::unique_ptr<a2ats_warp>> a2ats_warps;
inline void __syncthreads() { a2ats_block_bar->arrive_and_wait(); }
template <typename T> inline T a2ats_exchange(T v, int src) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const int lane = int(threadIdx.x) & 31;
    a2ats_warp& w = *a2ats_warps[threadIdx.x >> 5];
    std::memcpy(&w.slot[lane], &v, 4);
    w.bar.arrive_and_wait();
    T r;
    std::memcpy(&r, &w.slot[src], 4);
    w.bar.arrive_and_wait();
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int off) { return a2ats_exchange(v, (int(threadIdx.x) & 31) ^ off); }
template <typename T> inline T __shfl_up_sync(unsigned, T v, int d) {
    const int lane = int(threadIdx.x) & 31;
    return a2ats_exchange(v, lane >= d ? lane - d : lane);
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, int d) {
    const int lane = int(threadIdx.x) & 31;
    return a2ats_exchange(v, lane + d < 32 ? lane + d : lane);
}
inline unsigned __ballot_sync(unsigned, bool p) {
    const int lane = int(threadIdx.x) & 31;
    a2ats_warp& w = *a2ats_warps[threadIdx.x >> 5];
    w.slot[lane] = p ? 1u : 0u;
    w.bar.arrive_and_wait();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= w.slot[i] << i;
    w.bar.arrive_and_wait();
    return r;
}

// Run `body` as a grid of blocks (block.x a multiple of 32), one block at a time.
template <typename F> void a2ats_launch(dim3 grid, dim3 block, F body) {
    blockDim = block;
    gridDim = grid;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            a2ats_block_bar = std::make_unique<std::barrier<>>(block.x);
            a2ats_warps.clear();
            for (unsigned w = 0; w < block.x / 32; ++w) a2ats_warps.push_back(std::make_unique<a2ats_warp>());
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < block.x; ++t)
                threads.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; body(); });
            for (auto& th : threads) th.join();
        }
}
