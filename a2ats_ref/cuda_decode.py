"""RET-DECODE on MLX's CUDA backend: the whole sort-free decode step in four CUDA kernels.

The selection is the portable sort-free step's (``fast_decode``: RET-SELECT's sets from per-code levels, ties
at a head's threshold taken whole, level-1 tokens first and then level-2 ties, each in index order, cut at S
slots), and so is the attention. What changes is the number of launches: the portable step is ~80 small MLX
kernels and its time on an H200 was launch overhead (ncu: 81 kernels, most of 2-3 us). Each launch through
MLX's custom-kernel path still costs ~0.03-0.05 ms of wall time there, so the step is as few kernels as its
data dependencies allow:

1. ``lut``: EQ-12 on the query (undo the angle mlx-lm applied, apply b) and the LUT q_b C for every code, in
   float32 FMAs (no TF32: closer to the oracle than the portable step's GEMM under MLX's TF32 default);
2. ``levels`` (one block per row): the kept code counts corrected by the sinks and the coded window tail (as
   ``fast_decode._candidate_counts``), then each query head's kk-th largest candidate score by a radix select
   over the K code scores weighted by their counts (4 passes of 8 bits; T tokens are never sorted), then each
   code's level (1 must, 2 tie at a threshold, 0 not), the level token counts, and the level-1/level-2 tokens
   of each 1,024-token block;
3. ``scatter``: each selected token's slot: its block's offset summed from the earlier blocks' counts, plus
   warp-ballot prefix counts inside the block;
4. ``attend``: the forced (sink and window) rows and the selected rows read in place from the cache buffer, an
   online softmax per warp and per block (float32), a partial (max, sum, weighted V) per block, and the row's
   last block merges the partials into the output, in the values' dtype.

Every per-step number (kk, the candidate range, the coded count, the slot count, the token count; b, the query
position and the scale as float32 bits) travels as the shape of an empty array (step_params), which MLX passes to
the kernel by value: decoding never recompiles a kernel and hands the GPU no host-written memory. NVRTC compiles
each kernel once per dtype and head shape.

``fast_decode`` runs this for method="cuda", and "auto" takes it on CUDA when ``usable()``: a once-per-process
self-check that the kernels compile and reproduce the portable parts (the LUT against float64, the slots
against the portable selection given the same LUT, exactly, and the attention to float32 tolerance). Anything
else (Metal, CPU, shapes outside ``shapes_supported``) runs the portable sort-free step, which the conformance
suite checks on every backend.
"""

from __future__ import annotations

import struct
import warnings
from functools import lru_cache

import mlx.core as mx
import numpy as np

#: tokens per block of the compaction kernels (32 warps of 32: one ballot per warp)
BLOCK = 1024
#: warps per block of the attention kernel, slots each warp walks, and rows each warp loads at once
WARPS, SLOTS_PER_WARP, ROWS_IN_FLIGHT = 8, 16, 4
#: threads per block of the LUT kernel (one code per thread)
LUT_THREADS = 64
#: static shared memory a kernel may use (CUDA's limit without opt-in is 48 KB)
_SHARED_LIMIT = 46 * 1024

_HEADER = f"#define A2ATS_BLOCK {BLOCK}\n" + """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ inline float a2ats_f32(float x) { return x; }
__device__ inline float a2ats_f32(__half x) { return __half2float(x); }
__device__ inline float a2ats_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
// N consecutive elements as one load (a lane's share of a row: 8 or 16 bytes)
template <typename T, int N> struct alignas(sizeof(T) * N) a2ats_vec { T v[N]; };
// The per-step numbers, read from the shapes of two empty int32 arrays (step_params; MLX passes an input's shape
// by value). The forced tokens are the sinks [0, c0) and the window [c1, n): slot s < F holds forced(s).
struct a2ats_step {
    int kk, c0, c1, counted, S, kept, n, sinks, w;
    float b, qpos, scale;
    template <typename SA, typename SB>
    __device__ a2ats_step(const SA& a, const SB& z)
        : kk(a[1]), c0(a[2]), c1(a[3]), counted(a[4]), S(a[5]), kept(a[6]), n(a[7]), sinks(z[1]), w(z[2]),
          b(__int_as_float(z[3])), qpos(__int_as_float(z[4])), scale(__int_as_float(z[5])) {}
    __device__ int F() const { return c0 + n - c1; }
    __device__ int forced(int s) const { return s < c0 ? s : c1 + (s - c0); }
};
// order-preserving key of a float (larger float, larger key); -0 and +0 share one key, as they compare equal
__device__ inline unsigned a2ats_key(float f) {
    const unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
"""

# q (B, n_q, 1, D) post-RoPE in the cache dtype; CT (n_kv, D, K); inv, tc, ts (D/2,); (b, query position, scale) from
# the step. Undo the applied angle (tables tc/ts when TABLES, else position * inv), apply b,
# scale: the LUT.
_LUT_SRC = """
    constexpr int H2 = D / 2;
    const int bh = blockIdx.y, h = bh % NKV;
    const int K = CT_shape[2];
    __shared__ float qs[G * D], rot[4 * H2];
    const a2ats_step P(ipa_shape, ipb_shape);
    const float bpos = P.b, qpos = P.qpos, scale = P.scale;
    // the angles depend on the pair i only: once per block, not per query head. The applied angle is the float32
    // product qpos * inv[i] (what mlx-lm's rope formed) and its cos/sin are taken in double: cosf/sinf of an
    // argument past ~1e5 rad (positions past 105,615 at inv = 1) take CUDA's slow reduction path, which made
    // this kernel 0.23 ms at 256K
    for (int i = threadIdx.x; i < H2; i += blockDim.x) {
        if (TABLES) { rot[i] = tc[i]; rot[H2 + i] = ts[i]; }
        else { double sd, cd; sincos((double)(qpos * inv[i]), &sd, &cd); rot[i] = (float)cd; rot[H2 + i] = (float)sd; }
        float s2, c2;
        sincosf(bpos * inv[i], &s2, &c2);
        rot[2 * H2 + i] = c2;
        rot[3 * H2 + i] = s2;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * H2; e += blockDim.x) {
        const int g = e / H2, i = e - g * H2;
        const int ia = TRAD ? 2 * i : i, ib = TRAD ? 2 * i + 1 : i + H2;
        const size_t base = ((size_t)bh * G + g) * D;
        const float x0 = a2ats_f32(q[base + ia]), x1 = a2ats_f32(q[base + ib]);
        const float c1 = rot[i], s1 = rot[H2 + i], c2 = rot[2 * H2 + i], s2 = rot[3 * H2 + i];
        const float a1 = x0 * c1 + x1 * s1, b1 = x1 * c1 - x0 * s1;
        qs[g * D + ia] = (a1 * c2 - b1 * s2) * scale;
        qs[g * D + ib] = (a1 * s2 + b1 * c2) * scale;
    }
    __syncthreads();
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < K) {
        float acc[G];
        for (int g = 0; g < G; ++g) acc[g] = 0.0f;
        const float* col = CT + (size_t)h * D * K + k;
#pragma unroll 16
        for (int dd = 0; dd < D; ++dd) {
            const float c = col[(size_t)dd * K];
            for (int g = 0; g < G; ++g) acc[g] = fmaf(qs[g * D + dd], c, acc[g]);
        }
        for (int g = 0; g < G; ++g) lut[((size_t)bh * G + g) * K + k] = acc[g];
    }
"""

# The step's numbers (a2ats_step): kk, [c0, c1), counted, kept, sinks, w. One block of 1,024
# threads per (b, kv) row.
_LEVELS_SRC = """
    const int r = blockIdx.y, tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5, lane = tid & 31;
    const int Tc = codes_shape[2];   // codes (B, n_kv, T): row r = b * n_kv + h
    const a2ats_step P(ipa_shape, ipb_shape);
    const int kk = P.kk, c0 = P.c0, c1 = P.c1, counted = P.counted, kept = P.kept, sinks = P.sinks, w = P.w;
    __shared__ int cnt[KS];
    __shared__ int hist[G * 256];
    __shared__ unsigned pre[G];
    __shared__ int rem[G], above[G], nge[G], n12[2];
    __shared__ unsigned char lvs[KS];
    if (kept) {
        for (int c = tid; c < KS; c += nt) cnt[c] = counts[(size_t)r * KS + c];
        __syncthreads();
        for (int p = tid; p < sinks; p += nt)
            if (p < c0) atomicSub(&cnt[(int)codes[(size_t)r * Tc + p]], 1);
        for (int j = tid; j < w; j += nt)
            if (c1 + j < counted) atomicSub(&cnt[(int)codes[(size_t)r * Tc + c1 + j]], 1);
    } else {
        for (int c = tid; c < KS; c += nt) cnt[c] = 0;
        __syncthreads();
        for (int j = c0 + tid; j < c1; j += nt) atomicAdd(&cnt[(int)codes[(size_t)r * Tc + j]], 1);
    }
    if (tid < G) { pre[tid] = 0u; rem[tid] = kk; above[tid] = 0; }
    if (tid < 2) n12[tid] = 0;
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const unsigned himask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
        for (int e = tid; e < G * 256; e += nt) hist[e] = 0;
        __syncthreads();
        for (int c = tid; c < KS; c += nt) {
            const int n = cnt[c];
            if (n > 0) {
                for (int g = 0; g < G; ++g) {
                    const unsigned key = a2ats_key(lut[((size_t)r * G + g) * KS + c]);
                    if (((key ^ pre[g]) & himask) == 0u) atomicAdd(&hist[g * 256 + ((key >> shift) & 255u)], n);
                }
            }
        }
        __syncthreads();
        if (warp < G) {
            const int g = warp;
            int loc = 0;
            for (int i = 0; i < 8; ++i) loc += hist[g * 256 + 255 - 8 * lane - i];
            int incl = loc;
            for (int off = 1; off < 32; off <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += y;
            }
            const int need = rem[g];
            const unsigned hit = __ballot_sync(0xffffffffu, incl >= need && incl - loc < need);
            const int L = hit ? __ffs(hit) - 1 : 31;
            if (lane == L) {
                int acc = incl - loc, digit = 255 - 8 * lane - 7;
                for (int i = 0; i < 8; ++i) {
                    const int bin = 255 - 8 * lane - i;
                    const int hb = hist[g * 256 + bin];
                    if (acc + hb >= need) { digit = bin; break; }
                    acc += hb;
                }
                pre[g] |= ((unsigned)digit) << shift;
                rem[g] = need - acc;
                above[g] += acc;
                if (pass == 3) nge[g] = above[g] + hist[g * 256 + digit];
            }
        }
        __syncthreads();
    }
    int a1 = 0, a2 = 0;
    for (int c = tid; c < KS; c += nt) {
        bool must = false, ge = false;
        for (int g = 0; g < G; ++g) {
            const unsigned key = a2ats_key(lut[((size_t)r * G + g) * KS + c]);
            const bool gt = key > pre[g], eq = key == pre[g];
            must = must || gt || (eq && nge[g] == kk);
            ge = ge || gt || eq;
        }
        const int lv = must ? 1 : (ge ? 2 : 0);
        levels[(size_t)r * KS + c] = (unsigned char)lv;
        lvs[c] = (unsigned char)lv;
        if (lv == 1) a1 += cnt[c];
        if (lv == 2) a2 += cnt[c];
    }
    for (int off = 16; off > 0; off >>= 1) {
        a1 += __shfl_down_sync(0xffffffffu, a1, off);
        a2 += __shfl_down_sync(0xffffffffu, a2, off);
    }
    if (lane == 0) { atomicAdd(&n12[0], a1); atomicAdd(&n12[1], a2); }
    __syncthreads();
    if (tid == 0) { nsel[r * 3] = n12[0]; nsel[r * 3 + 1] = n12[1]; nsel[r * 3 + 2] = 0; }
    // the compaction's per-block counts (what a separate kernel did, one launch fewer): each warp takes blocks of
    // A2ATS_BLOCK tokens; the candidates are [c0, c1). A block wholly inside them, at a 16-byte aligned address, is
    // read in 16-byte vectors, each warp load 512 consecutive bytes (which tokens a lane counts does not matter,
    // only the block's sum); the blocks at the edges token by token.
    constexpr int PER_VEC = 16 / sizeof(CodeT);
    const int NB = (Tc + A2ATS_BLOCK - 1) / A2ATS_BLOCK;
    for (int q = warp; q < NB; q += nt >> 5) {
        int b1 = 0, b2 = 0;
        const int j0 = q * A2ATS_BLOCK;
        const CodeT* row = codes + (size_t)r * Tc + j0;
        if (j0 >= c0 && j0 + A2ATS_BLOCK <= min(c1, Tc) && ((size_t)row & 15) == 0) {
            const uint4* vrow = reinterpret_cast<const uint4*>(row);
#pragma unroll
            for (int t = 0; t < A2ATS_BLOCK / PER_VEC / 32; ++t) {
                const uint4 v = vrow[t * 32 + lane];
                const CodeT* c = reinterpret_cast<const CodeT*>(&v);
#pragma unroll
                for (int e = 0; e < PER_VEC; ++e) {
                    const int lv = lvs[(int)c[e]];
                    b1 += lv == 1;
                    b2 += lv == 2;
                }
            }
        } else {
            for (int t = 0; t < A2ATS_BLOCK / 32; ++t) {
                const int j = j0 + t * 32 + lane;
                if (j < Tc && j >= c0 && j < c1) {
                    const int lv = lvs[(int)row[t * 32 + lane]];
                    b1 += lv == 1;
                    b2 += lv == 2;
                }
            }
        }
        for (int off = 16; off > 0; off >>= 1) {
            b1 += __shfl_down_sync(0xffffffffu, b1, off);
            b2 += __shfl_down_sync(0xffffffffu, b2, off);
        }
        if (lane == 0) { bcnt[((size_t)r * NB + q) * 2] = b1; bcnt[((size_t)r * NB + q) * 2 + 1] = b2; }
    }
"""

# levels (BH, K) uint8 (1 must, 2 may, 0 not); the candidates are [c0, c1). Each warp ballots its tokens' levels.
# This block's first level-1 slot: the level-1 tokens of the blocks before it; first level-2 slot: n1 plus
# the level-2 tokens before it.
_SCATTER_SRC = """
    const int r = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int Tc = codes_shape[2];   // codes (B, n_kv, T): row r = b * n_kv + h
    const int K = levels_shape[1];
    const a2ats_step P(ipa_shape, ipb_shape);
    int lv = 0;
    if (j < Tc && j >= P.c0 && j < P.c1) lv = (int)levels[(size_t)r * K + (int)codes[(size_t)r * Tc + j]];
    const unsigned b1 = __ballot_sync(0xffffffffu, lv == 1);
    const unsigned b2 = __ballot_sync(0xffffffffu, lv == 2);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ int s1[32], s2[32];
    if (lane == 0) { s1[warp] = __popc(b1); s2[warp] = __popc(b2); }
    __syncthreads();
    __shared__ int base[2];
    if (threadIdx.x < 2) base[threadIdx.x] = 0;
    __syncthreads();
    int p1 = 0, p2 = 0;
    for (int q = threadIdx.x; q < (int)blockIdx.x; q += blockDim.x) {
        const size_t o = ((size_t)r * gridDim.x + q) * 2;
        p1 += bcnt[o];
        p2 += bcnt[o + 1];
    }
    for (int off = 16; off > 0; off >>= 1) {
        p1 += __shfl_down_sync(0xffffffffu, p1, off);
        p2 += __shfl_down_sync(0xffffffffu, p2, off);
    }
    if (lane == 0 && (p1 || p2)) { atomicAdd(&base[0], p1); atomicAdd(&base[1], p2); }
    __syncthreads();
    int w1 = 0, w2 = 0;
    for (int q = 0; q < warp; ++q) { w1 += s1[q]; w2 += s2[q]; }
    const unsigned below = (1u << lane) - 1u;
    const int S = P.S;
    // slots past the selection hold 0 (disjoint from the slots written below): no separate fill kernel, and no
    // reader of idx (the portable attention gathers every slot) ever meets an index outside the cache
    if (j >= min(nsel[r * 3] + nsel[r * 3 + 1], S) && j < S) idx[(size_t)r * S + j] = 0;
    if (lv == 1) {
        const int p = base[0] + w1 + __popc(b1 & below);
        if (p < S) idx[(size_t)r * S + p] = j;
    } else if (lv == 2) {
        const int p = nsel[r * 3] + base[1] + w2 + __popc(b2 & below);
        if (p < S) idx[(size_t)r * S + p] = j;
    }
"""

# q (B, n_q, 1, D) post-RoPE; keys/values (B, n_kv, T_buf, D); slot s < F is the forced token P.forced(s), slot
# s >= F is idx[s - F]; F + min(n1 + n2, S) slots are valid. Per (row, block, head): pm max logit, pl sum,
# pacc (D,) sum of p * V.
_ATTEND_SRC = """
    constexpr int DPL = D / 32;
    const int r = blockIdx.y, c = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const a2ats_step P(ipa_shape, ipb_shape);
    const int S = P.S, F = P.F();
    const int nv = F + min(nsel[r * 3] + nsel[r * 3 + 1], S);
    const int Tb = keys_shape[2];
    const float scale = P.scale;
    const float NEG = __int_as_float(0xff800000);
    float qv[G][DPL], acc[G][DPL], m[G], l[G];
    for (int g = 0; g < G; ++g) {
        m[g] = NEG;
        l[g] = 0.0f;
        for (int i = 0; i < DPL; ++i) {
            qv[g][i] = a2ats_f32(q[((size_t)r * G + g) * D + lane * DPL + i]) * scale;
            acc[g][i] = 0.0f;
        }
    }
    const int s0 = (c * NW + warp) * CH;
    const int s1 = min(s0 + CH, nv);
    for (int s = s0; s < s1; s += U) {
        float kf[U][DPL], vf[U][DPL];
        for (int u = 0; u < U; ++u) {
            const int ss = s + u;
            const int tok = ss >= s1 ? 0 : (ss < F ? P.forced(ss) : idx[(size_t)r * S + ss - F]);
            const size_t row = ((size_t)r * Tb + (size_t)tok) * D + lane * DPL;
            const a2ats_vec<T, DPL> kx = *reinterpret_cast<const a2ats_vec<T, DPL>*>(keys + row);
            const a2ats_vec<T, DPL> vx = *reinterpret_cast<const a2ats_vec<T, DPL>*>(values + row);
            for (int i = 0; i < DPL; ++i) { kf[u][i] = a2ats_f32(kx.v[i]); vf[u][i] = a2ats_f32(vx.v[i]); }
        }
        for (int u = 0; u < U && s + u < s1; ++u) {
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
                for (int i = 0; i < DPL; ++i) dot += qv[g][i] * kf[u][i];
                for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
                const float mn = fmaxf(m[g], dot);
                const float corr = expf(m[g] - mn);
                const float p = expf(dot - mn);
                l[g] = l[g] * corr + p;
                for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * corr + p * vf[u][i];
                m[g] = mn;
            }
        }
    }
    __shared__ float sm[NW * G], sl[NW * G], sacc[NW * G * D];
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { sm[warp * G + g] = m[g]; sl[warp * G + g] = l[g]; }
        for (int i = 0; i < DPL; ++i) sacc[(warp * G + g) * D + lane * DPL + i] = acc[g][i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
        const int g = e / D, dd = e - g * D;
        float M = NEG;
        for (int q2 = 0; q2 < NW; ++q2) M = fmaxf(M, sm[q2 * G + g]);
        float Ls = 0.0f, A = 0.0f;
        if (M > NEG) {
            for (int q2 = 0; q2 < NW; ++q2) {
                const float f = expf(sm[q2 * G + g] - M);
                Ls += f * sl[q2 * G + g];
                A += f * sacc[(q2 * G + g) * D + dd];
            }
        }
        const size_t o = ((size_t)r * gridDim.x + c) * G + g;
        pacc[o * D + dd] = A;
        if (dd == 0) { pm[o] = M; pl[o] = Ls; }
    }
    // The row's last block to finish merges every block's partials into out (what a separate kernel did, one
    // launch fewer): a ticket per row, zeroed by the levels kernel in nsel's third column, counts the finished
    // blocks; the fence makes each block's partials visible before its ticket, and the merge reads them from L2.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(const_cast<int*>(nsel) + r * 3 + 2, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // every other block has taken its ticket: reset it, so a second attend over the same nsel merges too
    if (threadIdx.x == 0) const_cast<int*>(nsel)[r * 3 + 2] = 0;
    // One block merges NC partials (hundreds at long contexts), so the work is spread over the whole block: warps
    // find each head's max and sum over the blocks, then tiles of the blocks' weights go to shared memory and every
    // thread sums its (head, dim) outputs over a tile with independent loads in flight.
    const int NC = gridDim.x;
    const size_t base = (size_t)r * NC;
    constexpr int TILE = 1024 / G;
    __shared__ float Mg[G], Lg[G], wt[TILE * G];
    for (int g = warp; g < G; g += NW) {
        float M = NEG, L = 0.0f;
        for (int c2 = lane; c2 < NC; c2 += 32) M = fmaxf(M, __ldcg(pm + (base + c2) * G + g));
        for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        for (int c2 = lane; c2 < NC; c2 += 32) {
            const float mc = __ldcg(pm + (base + c2) * G + g);
            if (mc > NEG) L += expf(mc - M) * __ldcg(pl + (base + c2) * G + g);
        }
        for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
        if (lane == 0) { Mg[g] = M; Lg[g] = L; }
    }
    constexpr int PER_T = (G * D + NW * 32 - 1) / (NW * 32);   // outputs per thread
    float A[PER_T];
    for (int i = 0; i < PER_T; ++i) A[i] = 0.0f;
    for (int t0 = 0; t0 < NC; t0 += TILE) {
        const int nt_ = min(TILE, NC - t0);
        __syncthreads();   // Mg/Lg written (first tile), the previous tile's weights read
        for (int e = threadIdx.x; e < nt_ * G; e += blockDim.x) {
            const int g = e % G;
            const float mc = __ldcg(pm + (base + t0) * G + e);
            wt[e] = mc > NEG ? expf(mc - Mg[g]) : 0.0f;
        }
        __syncthreads();
        for (int i = 0; i < PER_T; ++i) {
            const int e = threadIdx.x + i * NW * 32;
            if (e < G * D) {
                const int g = e / D, dd = e - g * D;
                const float* src = pacc + ((base + t0) * G + g) * D + dd;
                float a = 0.0f;
#pragma unroll 8
                for (int c2 = 0; c2 < nt_; ++c2) a += wt[c2 * G + g] * __ldcg(src + (size_t)c2 * G * D);
                A[i] += a;
            }
        }
    }
    for (int i = 0; i < PER_T; ++i) {
        const int e = threadIdx.x + i * NW * 32;
        if (e < G * D) {
            const int g = e / D, dd = e - g * D;
            out[((size_t)r * G + g) * D + dd] = static_cast<T>(A[i] / Lg[g]);
        }
    }
"""

def on_cuda() -> bool:
    """True when MLX's default device is a CUDA GPU (not Metal, not the CPU)."""
    return mx.default_device().type != mx.cpu and _cuda_backend()


@lru_cache(maxsize=None)
def _cuda_backend() -> bool:
    """Whether this MLX build's GPU is CUDA (asked once: the decode step checks on_cuda on every token)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and hasattr(mx.fast, "cuda_kernel"))


@lru_cache(maxsize=None)
def shapes_supported(G: int, d: int, dv: int, K: int = 4096) -> bool:
    """The kernels hold d/32 dims per lane, one warp per query head of a group in the radix select, the code
    counts, their levels and G 256-bin histograms in one block's shared memory, the rotated queries and angles
    in the LUT's, and per-warp partials plus a 1,024-weight merge tile in the attention's."""
    return (d == dv and d % 32 == 0 and 1 <= G <= 32 and G * d <= 4096
            and 5 * K + 4 * 256 * G + 16 * G + 64 <= _SHARED_LIMIT
            and 4 * WARPS * G * (d + 2) + 4 * 1024 + 8 * G + 16 <= _SHARED_LIMIT and 4 * G * d + 8 * d <= _SHARED_LIMIT)


@lru_cache(maxsize=None)
def _kernels():
    ck = mx.fast.cuda_kernel
    return {
        "lut": ck(name="a2ats_lut", input_names=["q", "CT", "inv", "tc", "ts", "ipa", "ipb"], output_names=["lut"],
                  source=_LUT_SRC, header=_HEADER),
        "levels": ck(name="a2ats_levels", input_names=["lut", "counts", "codes", "ipa", "ipb"],
                     output_names=["levels", "nsel", "bcnt"], source=_LEVELS_SRC, header=_HEADER),
        "scatter": ck(name="a2ats_scatter", input_names=["codes", "levels", "ipa", "ipb", "bcnt", "nsel"],
                      output_names=["idx"], source=_SCATTER_SRC, header=_HEADER),
        "attend": ck(name="a2ats_attend", input_names=["q", "keys", "values", "idx", "nsel", "ipa", "ipb"],
                     output_names=["pm", "pl", "pacc", "out"], source=_ATTEND_SRC, header=_HEADER),
    }


def step_params(*, kk: int, c0: int, c1: int, counted: int, S: int, kept: bool, n: int, sinks: int, w: int,
                b: float, query_pos: float, scale: float):
    """The per-step numbers as the kernels read them (a2ats_step): the shapes of two empty int32 arrays, the leading
    0 keeping them empty, and (b, query position, scale) as float32 bits.

    MLX passes an input's shape to a kernel by value. An array with data would be written on the host and read by
    the GPU, and on the H200 that first read cost ~0.15 ms per step (0.59 against 0.44 ms at 256K float16, with
    the same array reused; two device arrays used in turn cost nothing: it is the host-written page, not the
    pointer). Empty arrays have no page."""
    bits = struct.unpack("3i", struct.pack("3f", b, query_pos, scale))
    if min(bits) < 0:
        raise ValueError(f"b, query_pos and scale must be >= 0, got {b}, {query_pos}, {scale}")
    empty = mx.array([], dtype=mx.int32)
    return (empty.reshape(0, kk, c0, c1, counted, S, int(kept), n), empty.reshape(0, sinks, w, *bits))


def lut(queries, CT, inv, ip, *, traditional: bool, applied_angle=None) -> mx.array:
    """(B·n_kv, G, K) float32: scale · q R_{b - applied} · C per code (kernel 1)."""
    B, n_q, _, d = queries.shape
    n_kv, K = CT.shape[0], CT.shape[-1]
    G, BH = n_q // n_kv, B * n_kv
    tables = applied_angle is not None
    tc, ts = applied_angle if tables else (inv, inv)
    (out,) = _kernels()["lut"](
        inputs=[queries, CT, inv, tc, ts, *ip], output_shapes=[(BH, G, K)], output_dtypes=[mx.float32],
        grid=(-(-K // LUT_THREADS) * LUT_THREADS, BH, 1), threadgroup=(LUT_THREADS, 1, 1),
        template=[("T", queries.dtype), ("G", G), ("D", d), ("NKV", n_kv), ("TRAD", int(traditional)),
                  ("TABLES", int(tables))])
    return out


def levels(lut_, counts, codes, ip):
    """(levels (BH, K) uint8, nsel (BH, 3) int32, bcnt (BH, NB, 2) int32) (kernel 2). nsel holds the level-1 and
    level-2 token counts and, zeroed here, the attention's ticket; bcnt the level-1/level-2 tokens of each block of
    BLOCK tokens, for the scatter. counts (B, n_kv, K) and codes (B, n_kv, T) as the cache holds them (no reshape:
    every op is host time on every step)."""
    BH, G, K = lut_.shape
    NB = -(-codes.shape[-1] // BLOCK)
    return _kernels()["levels"](
        inputs=[lut_, counts, codes, *ip], output_shapes=[(BH, K), (BH, 3), (BH, NB, 2)],
        output_dtypes=[mx.uint8, mx.int32, mx.int32], grid=(BLOCK, BH, 1), threadgroup=(BLOCK, 1, 1),
        template=[("G", G), ("KS", K), ("CodeT", codes.dtype)])


def compact(lv, nsel, bcnt, codes, ip, S: int):
    """idx (BH, S) int32: the selected candidates, level 1 first, each level in index order (kernel 3).

    Slots past the selection hold 0 (written by the scatter kernel itself; keep is False there)."""
    BH, T_codes = lv.shape[0], codes.shape[-1]
    NB = -(-T_codes // BLOCK)
    (idx,) = _kernels()["scatter"](inputs=[codes, lv, *ip, bcnt, nsel], output_shapes=[(BH, S)], output_dtypes=[mx.int32],
                                   grid=(NB * BLOCK, BH, 1), threadgroup=(BLOCK, 1, 1), template=[("CodeT", codes.dtype)])
    return idx


def attend(queries, keys, values, idx, nsel, ip, F: int) -> mx.array:
    """Exact softmax attention over the forced tokens and the valid slots of idx, merged by each row's last block
    (kernel 4); (B, n_q, 1, d). The blocks count themselves on the ticket in nsel's third column, which levels
    zeroes and the last block resets."""
    B, n_q, _, d = queries.shape
    n_kv = keys.shape[1]
    BH, G, S = B * n_kv, n_q // n_kv, idx.shape[-1]
    per_block = WARPS * SLOTS_PER_WARP
    NC = max(1, -(-(S + F) // per_block))
    *_, out = _kernels()["attend"](
        inputs=[queries, keys, values, idx, nsel, *ip],
        output_shapes=[(BH, NC, G), (BH, NC, G), (BH, NC, G, d), (B, n_q, 1, d)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, values.dtype],
        grid=(NC * WARPS * 32, BH, 1), threadgroup=(WARPS * 32, 1, 1),
        template=[("T", keys.dtype), ("G", G), ("D", d), ("NW", WARPS), ("CH", SLOTS_PER_WARP),
                  ("U", ROWS_IN_FLIGHT)])
    return out


def decode(queries, keys, values, codes, CT, inv, *, counts, kept: bool, kk: int, c0: int, c1: int, counted: int,
           S: int, n: int, sinks: int, w: int, b: float, query_pos: float, scale: float, traditional: bool,
           applied_angle=None):
    """One sort-free decode step in four kernels: (out (B, n_q, 1, d), idx (BH, S), nsel (BH, 3)); keep_flags(nsel,
    S) gives the valid slots (only built when asked for: each extra op costs host time on every step)."""
    ip = step_params(kk=kk, c0=c0, c1=c1, counted=counted, S=S, kept=kept, n=n, sinks=sinks, w=w, b=b,
                     query_pos=query_pos, scale=scale)
    table = lut(queries, CT, inv, ip, traditional=traditional, applied_angle=applied_angle)
    lv, nsel, bcnt = levels(table, counts, codes, ip)
    idx = compact(lv, nsel, bcnt, codes, ip, S)
    return attend(queries, keys, values, idx, nsel, ip, c0 + n - c1), idx, nsel


def keep_flags(nsel, S: int) -> mx.array:
    """(BH, S) bool: which of decode's slots hold a selected token (the first nsel level-1 + level-2 ones)."""
    return mx.arange(S, dtype=mx.int32)[None] < mx.minimum(nsel[:, 0] + nsel[:, 1], S)[:, None]


_USABLE: dict = {}


def usable(*, dtype=None, G: int | None = None, n_kv: int | None = None, d: int | None = None,
           K: int | None = None) -> bool:
    """Whether method="cuda" may be taken here: on a CUDA device, the kernels compile and reproduce the portable
    parts (compare_parts) on a small case of this head shape and dtype (a small float16 case when none is given),
    so the check compiles the kernel instances the step will use. Checked once per process and shape; a failure
    warns (with the reason) and leaves "auto" on the portable step."""
    if not on_cuda():
        return False
    key = (str(mx.default_device()), str(dtype), G, n_kv, d, K)
    if key not in _USABLE:
        _USABLE[key] = _self_check(dtype or mx.float16, G or 4, n_kv or 2, d or 64, K or 64)
    return _USABLE[key]


def _random_case(*, T, n_q, n_kv, d, K, dtype, seed):
    from . import fast_decode

    rng = np.random.default_rng(seed)
    x = dict(
        q=mx.array(rng.standard_normal((1, n_q, 1, d)).astype(np.float32)).astype(dtype),
        k=mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype),
        v=mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype),
        codes=mx.array(rng.integers(0, K, (1, n_kv, T)).astype(np.uint16 if K > 256 else np.uint8)),
        C=rng.standard_normal((n_kv, K, d)).astype(np.float32),
        inv=(1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    x["CT"] = fast_decode.prepare_codebook(mx.array(x["C"]))
    return x


def compare_parts(*, T: int, n_q: int, n_kv: int, d: int, K: int, dtype=mx.float32, seed: int = 0,
                  topk=0.03, w: int = 64, sinks: int = 8, b: int = 2048, kept: bool = True) -> dict:
    """One random decode step by the kernels, part by part against the portable step and float64:

    lut_rel_err: the LUT kernel against a float64 NumPy LUT (relative to its largest entry);
    same_slots: levels + compaction against the portable selection (fast_decode._sortfree_select) given the
    kernel's LUT: indices and keep flags exactly;
    max_rel_err: the attention against the portable attention (fast_decode._attend_fn) over those slots.
    """
    from . import fast_decode as fd
    from .retrieval import topk_count

    x = _random_case(T=T, n_q=n_q, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=seed)
    n = T
    forced, c0, c1 = fd._regions(n, w, sinks)
    kk = topk_count(n, topk, c1 - c0)
    G, BH = n_q // n_kv, n_kv
    S = fd.sortfree_width(kk, G, K, c1 - c0)
    inv = mx.array(x["inv"])
    counts = fd.code_counts(x["codes"], K) if kept else mx.zeros((1, n_kv, K), dtype=mx.int32)
    scale = 1.0 / np.sqrt(d)
    step = dict(kk=kk, c0=c0, c1=c1, counted=n if kept else 0, S=S, kept=kept, n=n, sinks=sinks, w=w,
                b=float(b), query_pos=float(n - 1), scale=float(scale))
    out, idx, nsel = decode(x["q"], x["k"], x["v"], x["codes"], x["CT"], inv, counts=counts, traditional=False, **step)
    keep = keep_flags(nsel, S)
    table = lut(x["q"], x["CT"], inv, step_params(**step), traditional=False)   # the LUT decode used, on its own
    # float64 LUT: q de-rotated by (n - 1) * inv, rotated by b * inv, scaled, times C
    q64 = np.array(x["q"].astype(mx.float32), dtype=np.float64).reshape(n_kv, G, d)
    # EQ-12 undoes the float32 angle mlx-lm applied: the angles are float32 products, the rest float64
    th_q = (np.float32(n - 1) * x["inv"]).astype(np.float64)
    th_b = (np.float32(b) * x["inv"]).astype(np.float64)
    half = d // 2
    a, bb = q64[..., :half], q64[..., half:]
    a1, b1 = a * np.cos(th_q) + bb * np.sin(th_q), bb * np.cos(th_q) - a * np.sin(th_q)
    qb = np.concatenate([a1 * np.cos(th_b) - b1 * np.sin(th_b), a1 * np.sin(th_b) + b1 * np.cos(th_b)], -1) * scale
    lut64 = np.einsum("hgd,hkd->hgk", qb, x["C"].astype(np.float64))
    lut_err = float(np.abs(np.array(table).reshape(lut64.shape) - lut64).max() / np.abs(lut64).max())
    cand = fd._step_counts(x["codes"], counts, mx.array(c0), mx.array(c1), mx.array(n), kept=kept, BH=BH, K=K,
                           T_codes=T, sinks=sinks, w=w)
    idx_p, keep_p = fd._sortfree_select(table, x["codes"], cand, mx.array(kk, mx.int32), mx.array(c0), mx.array(c1),
                                        mx.array(S), BH=BH, T_codes=T, S=S)
    forced_idx = mx.array(np.asarray(forced, dtype=np.int32))
    att = fd._attend_fn(1, n_q, n_kv, d, d, T, len(forced), (None,))
    ref = att(x["q"], x["k"], x["v"], idx, keep, forced_idx, mx.array(scale, dtype=mx.float32))
    mx.eval(out, idx, keep, idx_p, keep_p, ref)
    kc, kp = np.array(keep), np.array(keep_p)
    same = bool((kc == kp).all() and (np.array(idx)[kp] == np.array(idx_p)[kp]).all())
    o, r = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    return {"lut_rel_err": lut_err, "same_slots": same, "selected": int(kp.sum()),
            "max_rel_err": float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)), "dtype": str(dtype), "T": T}


#: the self-check's bound on the attention's relative difference from the portable step, per value dtype: both
#: outputs are rounded to that dtype, so bfloat16 (8 significant bits, an ulp of 2^-8 = 3.9e-3 relative at the
#: top of a binade) needs a wider bound than float16/float32; the H200's bfloat16 check at d2a0105..f821255 differed
#: by 3.2e-3 and fell back to the portable step for want of one ulp
SELF_CHECK_ATTN_REL = {"float32": 2e-3, "float16": 2e-3, "bfloat16": 1e-2}


def _self_check(dtype, G: int, n_kv: int, d: int, K: int) -> bool:
    try:
        diff = compare_parts(T=3000, n_q=G * n_kv, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=1)
        bound = SELF_CHECK_ATTN_REL[str(dtype).rsplit(".", 1)[-1]]
        if not (diff["same_slots"] and diff["lut_rel_err"] <= 1e-5 and diff["max_rel_err"] <= bound):
            warnings.warn(f"a2ats_ref: the CUDA decode kernels disagree with the portable step ({diff}); "
                          "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
            return False
        return True
    except Exception as e:  # a compile or launch failure on this CUDA build: fall back, and say why
        warnings.warn(f"a2ats_ref: the CUDA decode kernels cannot run here ({type(e).__name__}: {e}); "
                      "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
        return False
