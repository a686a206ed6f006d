// Shared device helpers of the A2ATS decode kernels (RET-DECODE on CUDA); A2ATS_CHUNK_MAX is defined
// by the loader (runtime/decode/cuda.py, CHUNK_MAX) before this header.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ inline float a2ats_f32(float x) { return x; }
__device__ inline float a2ats_f32(__half x) { return __half2float(x); }
__device__ inline float a2ats_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
// N consecutive elements as one load (a lane's share of a row: 8, 16 or 32 bytes)
template <typename T, int N> struct alignas(sizeof(T) * N) a2ats_vec { T v[N]; };
// The per-step numbers, read from the shapes of two empty int32 arrays (step_params; MLX passes an input's shape
// by value). The forced tokens are the sinks [0, c0) and the window [c1, n).
struct a2ats_step {
    int kk, c0, c1, counted, S, kept, n, sinks, w, chunk;
    float b, qpos, scale;
    template <typename SA, typename SB>
    __device__ a2ats_step(const SA& a, const SB& z)
        : kk(a[1]), c0(a[2]), c1(a[3]), counted(a[4]), S(a[5]), kept(a[6]), n(a[7]), sinks(z[1]), w(z[2]),
          chunk(z[6]), b(__int_as_float(z[3])), qpos(__int_as_float(z[4])), scale(__int_as_float(z[5])) {}
};
// exclusive prefix sum of v over the block's threads in thread order, and the block's total (ws: NW ints). The
// closing barrier lets the caller reuse ws and read what other threads wrote before the call.
template <int NW> __device__ inline int a2ats_block_scan(int v, int* ws, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
    }
    if (lane == 31) ws[warp] = incl;
    __syncthreads();
    int below = 0;
    total = 0;
    for (int q = 0; q < NW; ++q) {
        const int t = ws[q];
        below += q < warp ? t : 0;
        total += t;
    }
    __syncthreads();
    return below + incl - v;
}
// order-preserving key of a float (larger float, larger key); -0 and +0 share one key, as they compare equal
__device__ inline unsigned a2ats_key(float f) {
    const unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
