"""RET-DECODE on MLX's CUDA backend: the whole sort-free decode step in two CUDA kernels.

The selection is the portable sort-free step's (``fast_decode``: RET-SELECT's sets from per-code levels, ties
at a head's threshold taken whole, level-1 tokens first and then level-2 ties, each in index order, cut at S
slots), and so is the attention. What changes is the number of launches and the bytes read: the portable step
is ~80 small MLX kernels and its time on an H200 was launch overhead (ncu: 81 kernels, most of 2-3 us), and each
launch through MLX's custom-kernel path still costs ~0.03-0.05 ms of wall time there. So the step is two
kernels, the fewest its one global dependency allows (every token's fate needs each head's threshold, which
needs every code's score):

1. ``select`` (one block of 1,024 threads per (b, kv) row): EQ-12 on the query (undo the angle mlx-lm applied,
   apply b) and the LUT q_b C for every code, in float32 FMAs (no TF32: closer to the oracle than the portable
   step's GEMM under MLX's TF32 default); then the kept code counts corrected by the sinks and the coded window
   tail (as ``fast_decode._candidate_counts``), each query head's kk-th largest candidate score by a radix
   select over the K code scores weighted by their counts (4 passes of 8 bits; T tokens are never sorted), each
   code's level (1 must, 2 tie at a threshold, 0 not) and the level token counts n1, n2;
2. ``attend`` (one block per chunk of tokens and row): the chunk's tokens are scanned against the code levels
   (the forced sinks and window always taken) and compacted in index order in shared memory by warp ballots, so
   no index list goes through memory; their key and value rows are read in place from the cache buffer, 16
   bytes per lane, several rows in flight per warp, with an online softmax per lane group (float32); each block
   leaves a partial (max, sum, weighted V) and the row's last block merges them into the output, in the values'
   dtype. The S-slot cut of level-2 ties only binds when n1 + n2 > S; only then does a block count the level-1
   and level-2 tokens before its chunk, to rank its own.

The ``mask`` kernel is the same scan writing the selected set instead of attending to it: only run when a caller
asks which tokens were selected (``KernelSelection.mask``, the cache's ``last_selection``, the self-check).

Every per-step number (kk, the candidate range, the coded count, the slot count, the token count; b, the query
position and the scale as float32 bits; the chunk length) travels as the shape of an empty array (step_params),
which MLX passes to the kernel by value: decoding never recompiles a kernel and hands the GPU no host-written
memory. NVRTC compiles each kernel once per dtype and head shape.

``fast_decode`` runs this for method="cuda", and "auto" takes it on CUDA when ``usable()``: a once-per-process
self-check that the kernels compile and reproduce the portable parts (the LUT against float64, the selected set
against the portable selection given the same LUT, exactly, and the attention to float32 tolerance). Anything
else (Metal, CPU, shapes outside ``shapes_supported``) runs the portable sort-free step, which the conformance
suite checks on every backend.
"""

from __future__ import annotations

import struct
import warnings
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

#: threads per block of the select kernel (one block per row: the radix select needs the whole row's scores)
SELECT_THREADS = 1024
#: warps per block of the attend and mask kernels, and row groups each lane keeps in flight
WARPS, ROWS_IN_FLIGHT = 8, 4
#: threads per block of the attend and mask kernels (NT in their source)
ATTEND_THREADS = WARPS * 32
#: the longest chunk of tokens one attend block scans (its shared token list); chunks are powers of two from
#: ATTEND_THREADS to this, picked per step so a row's chunks fill the GPU (chunk_for)
CHUNK_MAX = 2048
#: attend blocks per step that chunk_for aims at: ~8 per SM of a 132-SM H200, enough to hide the gathers' latency
TARGET_BLOCKS = 1024
#: the head sizes the kernels are taken for: the ones shown to run correctly on an H200 (gate and
#: tests/test_gpu.py). kernels_fit admits d = 8..256, and the host emulator (tests/test_cuda_emu.py) runs d = 8 and
#: 256 correctly, but a d = 8 self-check on the GPU can fail to load its kernel and leave the process at an
#: illegal-address error (most likely MLX's shared JIT cache: a2ats_ref/suite_env.py). Other head sizes take the
#: portable step until a GPU run shows them clean
RUN_HEAD_DIMS = (32, 64, 128)
#: static shared memory a kernel may use (CUDA's limit without opt-in is 48 KB)
_SHARED_LIMIT = 46 * 1024

_HEADER = f"#define A2ATS_CHUNK_MAX {CHUNK_MAX}\n" + """
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
"""

# q (B, n_q, 1, D) post-RoPE in the cache dtype; CT (n_kv, D, K) float32; inv, tc, ts (D/2,); counts (B, n_kv, K);
# codes (B, n_kv, T). Row r = b * n_kv + h; its query heads are r * G + g.
_SELECT_SRC = """
    constexpr int H2 = D / 2;
    const int r = blockIdx.y, h = r % NKV, tid = threadIdx.x, nt = blockDim.x, warp = tid >> 5, lane = tid & 31;
    const int Tc = codes_shape[2];
    const a2ats_step P(ipa_shape, ipb_shape);
    const int kk = P.kk, c0 = P.c0, c1 = P.c1, counted = P.counted, kept = P.kept, sinks = P.sinks, w = P.w;
    __shared__ float qs[G * D], rot[4 * H2];
    __shared__ int cnt[KS];
    __shared__ int hist[G * 256];
    __shared__ unsigned pre[G];
    __shared__ int rem[G], above[G], nge[G], n12[2];
    // EQ-12. The angles depend on the pair i only. The applied angle is the float32 product qpos * inv[i] (what
    // mlx-lm's rope formed) and its cos/sin are taken in double: cosf/sinf of an argument past ~1e5 rad
    // (positions past 105,615 at inv = 1) take CUDA's slow reduction path (0.23 ms at 256K)
    for (int i = tid; i < H2; i += nt) {
        if (TABLES) { rot[i] = tc[i]; rot[H2 + i] = ts[i]; }
        else { double sd, cd; sincos((double)(P.qpos * inv[i]), &sd, &cd); rot[i] = (float)cd; rot[H2 + i] = (float)sd; }
        float s2, c2;
        sincosf(P.b * inv[i], &s2, &c2);
        rot[2 * H2 + i] = c2;
        rot[3 * H2 + i] = s2;
    }
    __syncthreads();
    for (int e = tid; e < G * H2; e += nt) {
        const int g = e / H2, i = e - g * H2;
        const int ia = TRAD ? 2 * i : i, ib = TRAD ? 2 * i + 1 : i + H2;
        const size_t base = ((size_t)r * G + g) * D;
        const float x0 = a2ats_f32(q[base + ia]), x1 = a2ats_f32(q[base + ib]);
        const float c1_ = rot[i], s1 = rot[H2 + i], c2 = rot[2 * H2 + i], s2 = rot[3 * H2 + i];
        const float a1 = x0 * c1_ + x1 * s1, b1 = x1 * c1_ - x0 * s1;
        qs[g * D + ia] = (a1 * c2 - b1 * s2) * P.scale;
        qs[g * D + ib] = (a1 * s2 + b1 * c2) * P.scale;
    }
    __syncthreads();
    // The LUT: each thread four adjacent codes, one 16-byte load of CT per dimension (more bytes in flight per
    // thread: one block reads the row's whole codebook)
    float* lrow = lut + (size_t)r * G * KS;
    if (KS % 4 == 0) {
        const float4* col = reinterpret_cast<const float4*>(CT + (size_t)h * D * KS);
        for (int k4 = tid; k4 < KS / 4; k4 += nt) {
            float acc[G][4];
            for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.0f;
#pragma unroll 8
            for (int dd = 0; dd < D; ++dd) {
                const float4 c = col[(size_t)dd * (KS / 4) + k4];
                for (int g = 0; g < G; ++g) {
                    const float qv = qs[g * D + dd];
                    acc[g][0] = fmaf(qv, c.x, acc[g][0]);
                    acc[g][1] = fmaf(qv, c.y, acc[g][1]);
                    acc[g][2] = fmaf(qv, c.z, acc[g][2]);
                    acc[g][3] = fmaf(qv, c.w, acc[g][3]);
                }
            }
            for (int g = 0; g < G; ++g)
                *reinterpret_cast<float4*>(lrow + (size_t)g * KS + 4 * k4) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
        }
    } else {
        for (int k = tid; k < KS; k += nt) {
            float acc[G];
            for (int g = 0; g < G; ++g) acc[g] = 0.0f;
            const float* col = CT + (size_t)h * D * KS + k;
            for (int dd = 0; dd < D; ++dd) {
                const float c = col[(size_t)dd * KS];
                for (int g = 0; g < G; ++g) acc[g] = fmaf(qs[g * D + dd], c, acc[g]);
            }
            for (int g = 0; g < G; ++g) lrow[(size_t)g * KS + k] = acc[g];
        }
    }
    // the candidates' code counts: the kept counts less the sinks and the coded window tail, or counted here
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
    // (the barrier at the first pass also makes this block's LUT stores visible to all its threads)
    for (int pass = 0; pass < 4; ++pass) {
        const int shift = 24 - 8 * pass;
        const unsigned himask = pass == 0 ? 0u : (0xffffffffu << (shift + 8));
        for (int e = tid; e < G * 256; e += nt) hist[e] = 0;
        __syncthreads();
        for (int c = tid; c < KS; c += nt) {
            const int n = cnt[c];
            if (n > 0) {
                for (int g = 0; g < G; ++g) {
                    const unsigned key = a2ats_key(lrow[(size_t)g * KS + c]);
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
            const unsigned key = a2ats_key(lrow[(size_t)g * KS + c]);
            const bool gt = key > pre[g], eq = key == pre[g];
            must = must || gt || (eq && nge[g] == kk);
            ge = ge || gt || eq;
        }
        const int lv = must ? 1 : (ge ? 2 : 0);
        levels[(size_t)r * KS + c] = (unsigned char)lv;
        if (lv == 1) a1 += cnt[c];
        if (lv == 2) a2 += cnt[c];
    }
    for (int off = 16; off > 0; off >>= 1) {
        a1 += __shfl_down_sync(0xffffffffu, a1, off);
        a2 += __shfl_down_sync(0xffffffffu, a2, off);
    }
    if (lane == 0) { atomicAdd(&n12[0], a1); atomicAdd(&n12[1], a2); }
    __syncthreads();
    // the third column is the attend kernel's ticket: zero here, reset by its last block
    if (tid == 0) { nsel[r * 3] = n12[0]; nsel[r * 3 + 1] = n12[1]; nsel[r * 3 + 2] = 0; }
"""

# codes (B, n_kv, T); levels (BH, KS) uint8 (1 must, 2 may, 0 not); nsel (BH, 3): n1, n2, the attend ticket. Block
# (c, r) scans tokens [c * chunk, (c + 1) * chunk) of [0, n) and leaves tok[0, m): the tokens it takes, in index
# order. A candidate j in [c0, c1) of level 1 is taken if fewer than S level-1 tokens precede it, one of level 2
# if n1 plus the level-2 tokens before it are fewer than S (the portable step's slot order: level 1 first, each
# level in index order); the sinks and the window are always taken.
_SCAN_SRC = """
    constexpr int NT = NW * 32, EMAX = A2ATS_CHUNK_MAX / NT;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const a2ats_step P(ipa_shape, ipb_shape);
    const int n = P.n, c0 = P.c0, c1 = P.c1, S = P.S;
    const int Tc = codes_shape[2];
    const int n1 = nsel[r * 3], n2 = nsel[r * 3 + 1];
    const CodeT* crow = codes + (size_t)r * Tc;
    // SMEM bytes: the code levels and the token list here; the attend kernel reuses them for its warps' partials
    __shared__ __align__(16) unsigned char a2ats_smem[SMEM];
    unsigned char* lvs = a2ats_smem;
    int* tok = reinterpret_cast<int*>(a2ats_smem + (KS + 15) / 16 * 16);
    __shared__ int ws[NW], before[2];
    if (KS % 16 == 0)   // rows of levels start 16-byte aligned then (MLX allocates at least that)
        for (int k = tid; k < KS / 16; k += NT)
            reinterpret_cast<uint4*>(lvs)[k] = reinterpret_cast<const uint4*>(levels + (size_t)r * KS)[k];
    else
        for (int k = tid; k < KS; k += NT) lvs[k] = levels[(size_t)r * KS + k];
    if (tid < 2) before[tid] = 0;
    const int j0 = c * P.chunk, j1 = min(j0 + P.chunk, n);
    // each thread E consecutive tokens, their codes loaded at once (one round of memory latency per block)
    const int E = P.chunk / NT, jt = j0 + tid * E;
    int cd[EMAX];
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
        const int j = jt + e;
        cd[e] = (e < E && j < j1 && j >= c0 && j < c1) ? (int)crow[j] : -1;
    }
    const bool cut = n1 + n2 > S;
    __syncthreads();
    int lv[EMAX], k1 = 0, k2 = 0;
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
        const int j = jt + e;
        lv[e] = cd[e] >= 0 ? (int)lvs[cd[e]] : ((e < E && j < j1) ? 3 : 0);
        k1 += lv[e] == 1;
        k2 += lv[e] == 2;
    }
    int r1 = 0, r2 = 0;   // the level-1 and level-2 candidates before this thread's first token
    if (cut) {   // the S-slot cut binds: rank among all candidates, those before the chunk too (O(T) per block)
        int a1 = 0, a2 = 0;
        for (int j = c0 + tid; j < min(j0, c1); j += NT) {
            const int l = lvs[(int)crow[j]];
            a1 += l == 1;
            a2 += l == 2;
        }
        for (int off = 16; off > 0; off >>= 1) {
            a1 += __shfl_down_sync(0xffffffffu, a1, off);
            a2 += __shfl_down_sync(0xffffffffu, a2, off);
        }
        if (lane == 0 && (a1 || a2)) { atomicAdd(&before[0], a1); atomicAdd(&before[1], a2); }
        int total;
        const int ex = a2ats_block_scan<NW>((k1 << 16) | k2, ws, total);   // counts <= A2ATS_CHUNK_MAX < 2^16
        r1 = before[0] + (ex >> 16);
        r2 = before[1] + (ex & 0xffff);
    }
    int kt = 0;
#pragma unroll
    for (int e = 0; e < EMAX; ++e) {
        const bool take = lv[e] == 3 || (lv[e] == 1 && r1 < S) || (lv[e] == 2 && n1 + r2 < S);
        r1 += lv[e] == 1;
        r2 += lv[e] == 2;
        lv[e] = take;
        kt += take;
    }
    int m;
    int pt = a2ats_block_scan<NW>(kt, ws, m);
#pragma unroll
    for (int e = 0; e < EMAX; ++e)
        if (lv[e]) tok[pt++] = jt + e;
    __syncthreads();   // tok[0, m): the chunk's taken tokens, in index order
"""

# sel (BH, n) uint8, zeroed by MLX (init_value): 1 on every token the step attends to.
_MASK_SRC = _SCAN_SRC + """
    for (int i = tid; i < m; i += NT) sel[(size_t)r * n + tok[i]] = 1;
"""

# q (B, n_q, 1, D) post-RoPE; keys/values (B, n_kv, T_buf, D). A lane group of D / EPL lanes holds one row, EPL
# elements per lane (one 8-32 byte load); a warp holds 32 / (D / EPL) rows per load and U such loads in flight.
# Each lane group keeps its own online softmax (max, sum, EPL dims of sum p * V per head); the warp merges its
# groups, the block its warps into a partial per (row, block, head): pm max logit, pl sum, pacc (D,) sum p * V.
_ATTEND_SRC = _SCAN_SRC + """
    constexpr int LPR = D / EPL, RW = 32 / LPR;
    const int warp = tid >> 5, sub = lane / LPR, li = lane % LPR;
    const int Tb = keys_shape[2];
    const float NEG = __int_as_float(0xff800000);
    __shared__ float sq[G * D];
    for (int e = tid; e < G * D; e += NT) sq[e] = a2ats_f32(q[(size_t)r * G * D + e]) * P.scale;
    __syncthreads();
    float acc[G][EPL], mm[G], ll[G];
    for (int g = 0; g < G; ++g) {
        mm[g] = NEG;
        ll[g] = 0.0f;
        for (int e = 0; e < EPL; ++e) acc[g][e] = 0.0f;
    }
    for (int i0 = warp * RW * U; i0 < m; i0 += NW * RW * U) {
        a2ats_vec<T, EPL> kx[U], vx[U];
        bool ok[U];
        for (int u = 0; u < U; ++u) {
            const int i = i0 + u * RW + sub;
            ok[u] = i < m;
            const size_t row = ((size_t)r * Tb + (size_t)tok[ok[u] ? i : i0]) * D + li * EPL;
            kx[u] = *reinterpret_cast<const a2ats_vec<T, EPL>*>(keys + row);
            vx[u] = *reinterpret_cast<const a2ats_vec<T, EPL>*>(values + row);
        }
        float p[U][G];
        for (int u = 0; u < U; ++u) {
            for (int g = 0; g < G; ++g) {
                float s = 0.0f;
                for (int e = 0; e < EPL; ++e) s = fmaf(sq[g * D + li * EPL + e], a2ats_f32(kx[u].v[e]), s);
                for (int off = LPR / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                p[u][g] = ok[u] ? s : NEG;
            }
        }
        float corr[G];
        for (int g = 0; g < G; ++g) {
            float top = mm[g];
            for (int u = 0; u < U; ++u) top = fmaxf(top, p[u][g]);
            corr[g] = top > NEG ? expf(mm[g] - top) : 1.0f;
            float ps = 0.0f;
            for (int u = 0; u < U; ++u) {
                p[u][g] = top > NEG ? expf(p[u][g] - top) : 0.0f;
                ps += p[u][g];
            }
            ll[g] = ll[g] * corr[g] + ps;
            mm[g] = top;
        }
        for (int g = 0; g < G; ++g)
            for (int e = 0; e < EPL; ++e) acc[g][e] *= corr[g];
        for (int u = 0; u < U; ++u) {
            for (int e = 0; e < EPL; ++e) {
                const float v = a2ats_f32(vx[u].v[e]);
                for (int g = 0; g < G; ++g) acc[g][e] = fmaf(p[u][g], v, acc[g][e]);
            }
        }
    }
    // the warp's RW lane groups, merged pairwise (xor over the group index)
    for (int off = LPR; off < 32; off <<= 1) {
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, mm[g], off), lo = __shfl_xor_sync(0xffffffffu, ll[g], off);
            const float M = fmaxf(mm[g], mo);
            const float fa = M > NEG ? expf(mm[g] - M) : 0.0f, fb = M > NEG ? expf(mo - M) : 0.0f;
            ll[g] = ll[g] * fa + lo * fb;
            for (int e = 0; e < EPL; ++e) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][e], off);
                acc[g][e] = acc[g][e] * fa + ao * fb;
            }
            mm[g] = M;
        }
    }
    __syncthreads();   // every warp is done with tok: its bytes take the warps' partials
    float* sm = reinterpret_cast<float*>(a2ats_smem);
    float* sl = sm + NW * G;
    float* sacc = sl + NW * G;
    if (sub == 0) {
        for (int g = 0; g < G; ++g) {
            if (li == 0) { sm[warp * G + g] = mm[g]; sl[warp * G + g] = ll[g]; }
            for (int e = 0; e < EPL; ++e) sacc[(warp * G + g) * D + li * EPL + e] = acc[g][e];
        }
    }
    __syncthreads();
    for (int e = tid; e < G * D; e += NT) {
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
    // The row's last block to finish merges every block's partials into out: a ticket per row, zeroed by the
    // select kernel in nsel's third column, counts the finished blocks; the fence makes each block's partials
    // visible before its ticket, and the merge reads them from L2.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (tid == 0) last = atomicAdd(const_cast<int*>(nsel) + r * 3 + 2, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // every other block has taken its ticket: reset it, so a second attend over the same nsel merges too
    if (tid == 0) const_cast<int*>(nsel)[r * 3 + 2] = 0;
    // One block merges NC partials (over a hundred at long contexts), spread over the whole block: warps find each
    // head's max and sum over the blocks, then every thread sums a float4 of outputs over every SPLIT-th partial
    // (16-byte loads, several in flight), and the SPLIT sums of each float4 meet in shared memory.
    const int NC = gridDim.x;
    const size_t base = (size_t)r * NC;
    __shared__ float Mg[G], Lg[G];
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
    __syncthreads();
    constexpr int T4 = G * D / 4, SPLIT = NT / T4;   // float4 outputs, threads per output (shapes_supported: >= 1)
    const int o4 = tid % T4, part = tid / T4, g4 = o4 * 4 / D;
    float4 A = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (part < SPLIT) {
        const float4* src = reinterpret_cast<const float4*>(pacc + base * G * D) + o4;
#pragma unroll 8
        for (int c2 = part; c2 < NC; c2 += SPLIT) {
            const float mc = __ldcg(pm + (base + c2) * G + g4);
            const float wgt = mc > NEG ? expf(mc - Mg[g4]) : 0.0f;
            const float4 v = __ldcg(src + (size_t)c2 * T4);
            A.x = fmaf(wgt, v.x, A.x);
            A.y = fmaf(wgt, v.y, A.y);
            A.z = fmaf(wgt, v.z, A.z);
            A.w = fmaf(wgt, v.w, A.w);
        }
    }
    float4* red = reinterpret_cast<float4*>(a2ats_smem);   // the partials' shared bytes are free again
    red[tid] = A;
    __syncthreads();
    if (part == 0) {
        for (int p2 = 1; p2 < SPLIT; ++p2) {
            const float4 y = red[p2 * T4 + o4];
            A.x += y.x; A.y += y.y; A.z += y.z; A.w += y.w;
        }
        const float inv_l = 1.0f / Lg[g4];
        T* dst = out + (size_t)r * G * D + o4 * 4;
        dst[0] = static_cast<T>(A.x * inv_l);
        dst[1] = static_cast<T>(A.y * inv_l);
        dst[2] = static_cast<T>(A.z * inv_l);
        dst[3] = static_cast<T>(A.w * inv_l);
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


def lane_elems(d: int, itemsize: int) -> int | None:
    """Elements of a row each lane loads in the attend kernel (EPL): a power of two, at most 16 bytes where one warp
    load covers 2 or 4 rows, 32 where one row takes the whole warp; None if d splits no such way."""
    for rows in (4, 2, 1):   # rows one warp load covers
        lanes = 32 // rows
        epl = d // lanes
        if d % lanes == 0 and epl & (epl - 1) == 0 and epl * itemsize <= (16 if rows > 1 else 32):
            return epl
    return None


@lru_cache(maxsize=None)
def shapes_supported(G: int, d: int, dv: int, K: int = 4096) -> bool:
    """Whether "auto" and method="cuda" take the kernels for this head shape: they fit it (kernels_fit) and d is
    one of RUN_HEAD_DIMS."""
    return d in RUN_HEAD_DIMS and kernels_fit(G, d, dv, K)


@lru_cache(maxsize=None)
def kernels_fit(G: int, d: int, dv: int, K: int = 4096) -> bool:
    """What the kernels can hold: the rotated queries, angles, code counts and G 256-bin histograms in the select
    block's shared memory; the code levels, a chunk's token list, the scaled queries and per-warp partials in the
    attend block's; a row split over lanes in 8-32 byte loads for 2- and 4-byte dtypes; G * EPL accumulators per
    lane; at most one float4 of a row's G * d outputs per thread in the merge."""
    epl = [lane_elems(d, s) for s in (2, 4)]
    return (d == dv and None not in epl and 1 <= G <= 32 and G * max(epl) <= 64 and G * d <= 4 * ATTEND_THREADS
            and 4 * G * d + 8 * d + 4 * K + 4 * 256 * G + 16 * G + 16 <= _SHARED_LIMIT
            and _scan_smem(K, G, d) + 4 * WARPS + 8 + 4 * G * d + 8 * G + 4 <= _SHARED_LIMIT)


def _scan_smem(K: int, G: int = 0, d: int = 0) -> int:
    """Bytes of the attend/mask kernels' shared buffer (SMEM): the code levels and a chunk's token list, which
    the attend kernel then reuses for its warps' partials (max and sum per head, D sums per head) and then for
    the merge's float4 sums (one per thread)."""
    return max(-(-K // 16) * 16 + 4 * CHUNK_MAX, 4 * WARPS * G * (d + 2), 16 * ATTEND_THREADS)


#: each kernel's input names, output names and source (MLX builds the signature from the names and the arrays)
KERNELS = {
    "select": (["q", "CT", "inv", "tc", "ts", "counts", "codes", "ipa", "ipb"], ["lut", "levels", "nsel"], _SELECT_SRC),
    "attend": (["q", "keys", "values", "codes", "levels", "nsel", "ipa", "ipb"], ["pm", "pl", "pacc", "out"], _ATTEND_SRC),
    "mask": (["codes", "levels", "nsel", "ipa", "ipb"], ["sel"], _MASK_SRC),
}


@lru_cache(maxsize=None)
def _kernels():
    return {name: mx.fast.cuda_kernel(name=f"a2ats_{name}", input_names=ins, output_names=outs, source=src,
                                      header=_HEADER)
            for name, (ins, outs, src) in KERNELS.items()}


def mlx_launch(name: str, **spec) -> list:
    """Run kernel `name` through MLX's CUDA custom-kernel path (spec: inputs, output_shapes, output_dtypes, grid,
    threadgroup, template and optionally init_value, as mx.fast.cuda_kernel's call takes them). The functions
    below take another launcher in `launch`; tests/cuda_emu.py runs the same specs on the host."""
    return _kernels()[name](**spec)


def chunk_for(n: int, BH: int) -> int:
    """Tokens per attend block: the power of two from ATTEND_THREADS to CHUNK_MAX that gives about TARGET_BLOCKS
    blocks for n tokens in BH rows (longer chunks mean fewer partials to merge, shorter ones more blocks to fill
    the GPU with)."""
    chunk = ATTEND_THREADS
    while chunk < CHUNK_MAX and -(-n // chunk) * BH > TARGET_BLOCKS:
        chunk *= 2
    return chunk


def step_params(*, kk: int, c0: int, c1: int, counted: int, S: int, kept: bool, n: int, sinks: int, w: int,
                b: float, query_pos: float, scale: float, chunk: int):
    """The per-step numbers as the kernels read them (a2ats_step): the shapes of two empty int32 arrays, the leading
    0 keeping them empty, and (b, query position, scale) as float32 bits.

    MLX passes an input's shape to a kernel by value. An array with data would be written on the host and read by
    the GPU, and on the H200 that first read cost ~0.15 ms per step (0.59 against 0.44 ms at 256K float16, with
    the same array reused; two device arrays used in turn cost nothing: it is the host-written page, not the
    pointer). Empty arrays have no page."""
    bits = struct.unpack("3i", struct.pack("3f", b, query_pos, scale))
    if min(bits) < 0:
        raise ValueError(f"b, query_pos and scale must be >= 0, got {b}, {query_pos}, {scale}")
    if chunk % ATTEND_THREADS or not ATTEND_THREADS <= chunk <= CHUNK_MAX:
        raise ValueError(f"chunk must be a multiple of {ATTEND_THREADS} up to {CHUNK_MAX}, got {chunk}")
    empty = mx.array([], dtype=mx.int32)
    return (empty.reshape(0, kk, c0, c1, counted, S, int(kept), n), empty.reshape(0, sinks, w, *bits, chunk))


def select(queries, CT, inv, counts, codes, ip, *, traditional: bool, applied_angle=None, launch=mlx_launch):
    """(lut (BH, G, K) float32, levels (BH, K) uint8, nsel (BH, 3) int32) (kernel 1): scale · q R_{b - applied} · C
    per code; each code's level; the level-1 and level-2 token counts and, zeroed, the attend kernel's ticket.
    counts (B, n_kv, K) and codes (B, n_kv, T) as the cache holds them (no reshape: every op is host time on every
    step)."""
    B, n_q, _, d = queries.shape
    n_kv, K = CT.shape[0], CT.shape[-1]
    G, BH = n_q // n_kv, B * n_kv
    tables = applied_angle is not None
    tc, ts = applied_angle if tables else (inv, inv)
    return launch(
        "select", inputs=[queries, CT, inv, tc, ts, counts, codes, *ip], output_shapes=[(BH, G, K), (BH, K), (BH, 3)],
        output_dtypes=[mx.float32, mx.uint8, mx.int32], grid=(SELECT_THREADS, BH, 1),
        threadgroup=(SELECT_THREADS, 1, 1),
        template=[("T", queries.dtype), ("G", G), ("D", d), ("NKV", n_kv), ("TRAD", int(traditional)),
                  ("TABLES", int(tables)), ("KS", K), ("CodeT", codes.dtype)])


def attend(queries, keys, values, codes, lv, nsel, ip, *, n: int, chunk: int, launch=mlx_launch) -> mx.array:
    """Exact softmax attention over the tokens the step selects in [0, n), (B, n_q, 1, d) (kernel 2): each block
    scans its chunk of tokens, attends to the ones it takes and leaves a partial; each row's last block merges
    them (a ticket in nsel's third column, which select zeroes and the last block resets)."""
    B, n_q, _, d = queries.shape
    n_kv = keys.shape[1]
    BH, G, K = B * n_kv, n_q // n_kv, lv.shape[-1]
    NC = -(-n // chunk)
    *_, out = launch(
        "attend", inputs=[queries, keys, values, codes, lv, nsel, *ip],
        output_shapes=[(BH, NC, G), (BH, NC, G), (BH, NC, G, d), (B, n_q, 1, d)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, values.dtype],
        grid=(NC * ATTEND_THREADS, BH, 1), threadgroup=(ATTEND_THREADS, 1, 1),
        template=[("T", keys.dtype), ("G", G), ("D", d), ("KS", K), ("NW", WARPS), ("SMEM", _scan_smem(K, G, d)),
                  ("EPL", lane_elems(d, keys.dtype.size)), ("U", ROWS_IN_FLIGHT), ("CodeT", codes.dtype)])
    return out


def selection_mask(codes, lv, nsel, ip, *, n: int, chunk: int, launch=mlx_launch) -> mx.array:
    """(BH, n) bool: the tokens attend takes, by the same scan (the mask kernel)."""
    BH, K = lv.shape
    (sel,) = launch(
        "mask", inputs=[codes, lv, nsel, *ip], output_shapes=[(BH, n)], output_dtypes=[mx.uint8],
        grid=(-(-n // chunk) * ATTEND_THREADS, BH, 1), threadgroup=(ATTEND_THREADS, 1, 1), init_value=0,
        template=[("KS", K), ("NW", WARPS), ("SMEM", _scan_smem(K)), ("CodeT", codes.dtype)])
    return sel.astype(mx.bool_)


class KernelSelection(NamedTuple):
    """The token set one CUDA decode step attended to, kept lazily as the scan's inputs (the mask kernel runs only
    when mask() is asked for): the counterpart of fast_decode.Selection."""

    codes: mx.array
    levels: mx.array
    nsel: mx.array
    ip: tuple
    n: int
    chunk: int
    shape: tuple   # (B, n_kv, n_tokens), n_tokens >= n
    launch: object = mlx_launch

    def mask(self) -> mx.array:
        """Bool (B, n_kv, n_tokens): True on every token the step attended to."""
        B, n_kv, n_tokens = self.shape
        m = selection_mask(self.codes, self.levels, self.nsel, self.ip, n=self.n, chunk=self.chunk, launch=self.launch)
        if n_tokens > self.n:
            m = mx.concatenate([m, mx.zeros((B * n_kv, n_tokens - self.n), dtype=mx.bool_)], axis=-1)
        return m.reshape(B, n_kv, n_tokens)


def decode(queries, keys, values, codes, CT, inv, *, counts, kept: bool, kk: int, c0: int, c1: int, counted: int,
           S: int, n: int, sinks: int, w: int, b: float, query_pos: float, scale: float, traditional: bool,
           applied_angle=None, n_tokens: int | None = None, launch=mlx_launch):
    """One sort-free decode step in two kernels: (out (B, n_q, 1, d), KernelSelection, lut (BH, G, K))."""
    B, n_kv = queries.shape[0], CT.shape[0]
    chunk = chunk_for(n, B * n_kv)
    ip = step_params(kk=kk, c0=c0, c1=c1, counted=counted, S=S, kept=kept, n=n, sinks=sinks, w=w, b=b,
                     query_pos=query_pos, scale=scale, chunk=chunk)
    table, lv, nsel = select(queries, CT, inv, counts, codes, ip, traditional=traditional, applied_angle=applied_angle,
                             launch=launch)
    out = attend(queries, keys, values, codes, lv, nsel, ip, n=n, chunk=chunk, launch=launch)
    shape = (B, n_kv, n if n_tokens is None else n_tokens)
    return out, KernelSelection(codes, lv, nsel, ip, n, chunk, shape, launch), table


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
    from .codes import code_dtype

    rng = np.random.default_rng(seed)
    x = dict(
        q=mx.array(rng.standard_normal((1, n_q, 1, d)).astype(np.float32)).astype(dtype),
        k=mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype),
        v=mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype),
        codes=mx.array(rng.integers(0, K, (1, n_kv, T)).astype(code_dtype(K))),
        C=rng.standard_normal((n_kv, K, d)).astype(np.float32),
        inv=(1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    x["CT"] = fast_decode.prepare_codebook(mx.array(x["C"]))
    return x


def compare_parts(*, T: int, n_q: int, n_kv: int, d: int, K: int, dtype=mx.float32, seed: int = 0,
                  topk=0.03, w: int = 64, sinks: int = 8, b: int = 2048, kept: bool = True, S: int | None = None,
                  launch=mlx_launch) -> dict:
    """One random decode step by the kernels, part by part against the portable step and float64:

    lut_rel_err: the select kernel's LUT against a float64 NumPy LUT (relative to its largest entry);
    same_selection: the tokens the kernels attend to (the mask kernel's scan) against the portable selection
    (fast_decode._sortfree_select given the kernel's LUT, plus the forced tokens), exactly; extra and missing count
    the tokens only the kernels take and only the portable step takes;
    max_rel_err: the attention against the portable attention (fast_decode._attend_fn) over that selection.
    S (default: fast_decode.sortfree_width) may be set smaller to make the slot cut bind. launch runs the kernels
    (default: MLX CUDA; tests/cuda_emu.py's host emulator runs the same sources on any machine).
    """
    from . import fast_decode as fd
    from .retrieval import topk_count

    if not kernels_fit(n_q // n_kv, d, d, K):
        raise ValueError(f"compare_parts: the kernels do not fit G={n_q // n_kv}, d={d}, K={K} (kernels_fit)")
    x = _random_case(T=T, n_q=n_q, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=seed)
    n = T
    forced, c0, c1 = fd._regions(n, w, sinks)
    kk = topk_count(n, topk, c1 - c0)
    G, BH = n_q // n_kv, n_kv
    S = fd.sortfree_width(kk, G, K, c1 - c0) if S is None else S
    inv = mx.array(x["inv"])
    counts = fd.code_counts(x["codes"], K) if kept else mx.zeros((1, n_kv, K), dtype=mx.int32)
    scale = 1.0 / np.sqrt(d)
    step = dict(kk=kk, c0=c0, c1=c1, counted=n if kept else 0, S=S, kept=kept, n=n, sinks=sinks, w=w,
                b=float(b), query_pos=float(n - 1), scale=float(scale))
    out, sel, table = decode(x["q"], x["k"], x["v"], x["codes"], x["CT"], inv, counts=counts, traditional=False,
                             launch=launch, **step)
    mask = sel.mask()
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
    mask_p = fd.Selection(idx_p, keep_p, forced_idx, (1, n_kv, n)).mask()
    att = fd._attend_fn(1, n_q, n_kv, d, d, T, len(forced), (None,))
    ref = att(x["q"], x["k"], x["v"], idx_p, keep_p, forced_idx, mx.array(scale, dtype=mx.float32))
    mx.eval(out, mask, mask_p, ref, sel.nsel)
    o, r = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    n12 = np.array(sel.nsel)[:, :2].sum(-1)
    mk, mp = np.array(mask), np.array(mask_p)
    return {"lut_rel_err": lut_err, "same_selection": bool(np.array_equal(mk, mp)), "selected": int(mk.sum()),
            "extra": int((mk & ~mp).sum()), "missing": int((mp & ~mk).sum()), "cut": bool((n12 > S).any()),
            "max_rel_err": float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)), "dtype": str(dtype), "T": T}


#: the self-check's bound on the attention's relative difference from the portable step, per value dtype: both
#: outputs are rounded to that dtype, so bfloat16 (8 significant bits, an ulp of 2^-8 = 3.9e-3 relative at the
#: top of a binade) needs a wider bound than float16/float32; an H200's bfloat16 check differs by up to 3.2e-3,
#: and a tighter bound sends it to the portable step for want of one ulp
SELF_CHECK_ATTN_REL = {"float32": 2e-3, "float16": 2e-3, "bfloat16": 1e-2}


def _self_check(dtype, G: int, n_kv: int, d: int, K: int) -> bool:
    try:
        diff = compare_parts(T=3000, n_q=G * n_kv, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=1)
        bound = SELF_CHECK_ATTN_REL[str(dtype).rsplit(".", 1)[-1]]
        if not (diff["same_selection"] and diff["lut_rel_err"] <= 1e-5 and diff["max_rel_err"] <= bound):
            warnings.warn(f"a2ats_ref: the CUDA decode kernels disagree with the portable step ({diff}); "
                          "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
            return False
        return True
    except Exception as e:  # a compile or launch failure on this CUDA build: fall back, and say why
        warnings.warn(f"a2ats_ref: the CUDA decode kernels cannot run here ({type(e).__name__}: {e}); "
                      "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
        return False
