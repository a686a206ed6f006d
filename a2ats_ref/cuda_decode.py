"""RET-DECODE on MLX's CUDA backend: the sort-free step's compaction and attention as fused CUDA kernels.

The selection is the sort-free step's (``fast_decode.sortfree_code_levels``: per-code levels from the LUT and
the kept code counts), and so is the slot order: level-1 tokens first, then level-2 ties, each in index
order, cut at S slots. Only two parts change, each a pass over memory that plain MLX ops split into many:

* compaction: one kernel counts each 1,024-token block's level-1 and level-2 tokens (warp ballots), a
  cumsum over the blocks gives each block its first slot, and a second kernel writes every selected token's
  index to its slot (ballot prefix counts inside the block). The slots are the portable path's, exactly;
* attention: one kernel gathers the selected rows straight from the cache buffer (no gathered copy, no cast
  of it) and runs an online softmax per warp and per block over its slots (float32), writing a partial
  (max, sum, weighted V) per block; a few MLX ops merge the partials. Same exact attention over the same set
  as ``fast_decode._attend_fn``, summed in another order (float32 rounding apart).

``fast_decode`` uses this for method="cuda" (asked for explicitly; "auto" keeps the portable step, which was
as fast on the H200). ``usable()`` checks, once per process, that the kernels compile and reproduce the
portable step (same slots, outputs equal to float32 tolerance); ``a2ats-bench speed`` times the method beside
the others only then. Anything else (Metal, CPU, a head dim not a multiple of 32, shapes too large
for the block's shared memory) runs the portable sort-free step, which the conformance suite checks on every
backend. The kernels are JIT-compiled by NVRTC once per dtype and head shape; every per-step number (T, the
candidate range, the slot count) is data, so decoding never recompiles.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import mlx.core as mx

#: tokens per block of the compaction kernels (32 warps of 32: one ballot per warp)
BLOCK = 1024
#: warps per block of the attention kernel, and slots each warp walks
WARPS, SLOTS_PER_WARP = 8, 64
#: the attention kernel's static shared memory (per-warp partials) must stay under CUDA's 48 KB
_SHARED_LIMIT = 40 * 1024

_HEADER = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ inline float a2ats_f32(float x) { return x; }
__device__ inline float a2ats_f32(__half x) { return __half2float(x); }
__device__ inline float a2ats_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
"""

# levels (BH, K) uint8: 1 must, 2 may (a tie at the threshold), 0 not; rng = (c0, c1, S) int32.
_LEVEL = """
    const int r = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int Tc = codes_shape[1];
    const int K = levels_shape[1];
    int lv = 0;
    if (j < Tc && j >= rng[0] && j < rng[1]) {
        lv = (int)levels[(size_t)r * K + (int)codes[(size_t)r * Tc + j]];
    }
    const unsigned b1 = __ballot_sync(0xffffffffu, lv == 1);
    const unsigned b2 = __ballot_sync(0xffffffffu, lv == 2);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ int s1[32], s2[32];
    if (lane == 0) { s1[warp] = __popc(b1); s2[warp] = __popc(b2); }
    __syncthreads();
"""

_COUNT_SRC = _LEVEL + """
    if (threadIdx.x == 0) {
        int a = 0, b = 0;
        for (int w = 0; w < 32; ++w) { a += s1[w]; b += s2[w]; }
        const size_t o = ((size_t)r * gridDim.x + blockIdx.x) * 2;
        cnt[o] = a;
        cnt[o + 1] = b;
    }
"""

# base (BH, NB, 2): the block's first level-1 slot and first level-2 slot (n1 + earlier level-2 tokens)
_SCATTER_SRC = _LEVEL + """
    int w1 = 0, w2 = 0;
    for (int w = 0; w < warp; ++w) { w1 += s1[w]; w2 += s2[w]; }
    const unsigned below = (1u << lane) - 1u;
    const size_t o = ((size_t)r * gridDim.x + blockIdx.x) * 2;
    const int S = rng[2];
    if (lv == 1) {
        const int p = base[o] + w1 + __popc(b1 & below);
        if (p < S) idx[(size_t)r * S + p] = j;
    } else if (lv == 2) {
        const int p = base[o + 1] + w2 + __popc(b2 & below);
        if (p < S) idx[(size_t)r * S + p] = j;
    }
"""

# q (BH, G, D) float32, already scaled; keys/values (B, n_kv, T_buf, D); idx (BH, SA) int32 with the valid
# slots first, nvalid (BH,) of them. Outputs per (row, block, head): pm max logit, pl sum, pacc (D,) p @ V.
_ATTEND_SRC = """
    constexpr int DPL = D / 32;
    const int r = blockIdx.y, c = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int SA = idx_shape[1];
    const int Tb = keys_shape[2];
    const int nv = nvalid[r];
    float qv[G][DPL], acc[G][DPL], m[G], l[G];
    for (int g = 0; g < G; ++g) {
        m[g] = __int_as_float(0xff800000);
        l[g] = 0.0f;
        for (int i = 0; i < DPL; ++i) {
            qv[g][i] = q[((size_t)r * G + g) * D + lane * DPL + i];
            acc[g][i] = 0.0f;
        }
    }
    const int s0 = (c * NW + warp) * CH;
    const int s1 = min(s0 + CH, min(nv, SA));
    for (int s = s0; s < s1; ++s) {
        const size_t row = ((size_t)r * Tb + (size_t)idx[(size_t)r * SA + s]) * D + lane * DPL;
        float kf[DPL], vf[DPL];
        for (int i = 0; i < DPL; ++i) { kf[i] = a2ats_f32(keys[row + i]); vf[i] = a2ats_f32(values[row + i]); }
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
            for (int i = 0; i < DPL; ++i) dot += qv[g][i] * kf[i];
            for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            const float mn = fmaxf(m[g], dot);
            const float corr = expf(m[g] - mn);
            const float p = expf(dot - mn);
            l[g] = l[g] * corr + p;
            for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * corr + p * vf[i];
            m[g] = mn;
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
        float M = __int_as_float(0xff800000);
        for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w * G + g]);
        float L = 0.0f, A = 0.0f;
        if (M > __int_as_float(0xff800000)) {
            for (int w = 0; w < NW; ++w) {
                const float f = expf(sm[w * G + g] - M);
                L += f * sl[w * G + g];
                A += f * sacc[(w * G + g) * D + dd];
            }
        }
        const size_t o = ((size_t)r * gridDim.x + c) * G + g;
        pacc[o * D + dd] = A;
        if (dd == 0) { pm[o] = M; pl[o] = L; }
    }
"""


def on_cuda() -> bool:
    """True when MLX's default device is a CUDA GPU (not Metal, not the CPU)."""
    if mx.default_device().type == mx.cpu:
        return False
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and hasattr(mx.fast, "cuda_kernel"))


def shapes_supported(G: int, d: int, dv: int) -> bool:
    """The attention kernel holds d/32 dims per lane and per-warp partials in static shared memory."""
    return d == dv and d % 32 == 0 and 4 * WARPS * G * (d + 2) <= _SHARED_LIMIT


@lru_cache(maxsize=None)
def _kernels():
    ck = mx.fast.cuda_kernel
    count = ck(name="a2ats_select_count", input_names=["codes", "levels", "rng"], output_names=["cnt"],
               source=_COUNT_SRC, header=_HEADER)
    scatter = ck(name="a2ats_select_scatter", input_names=["codes", "levels", "rng", "base"],
                 output_names=["idx"], source=_SCATTER_SRC, header=_HEADER)
    attend = ck(name="a2ats_select_attend", input_names=["q", "keys", "values", "idx", "nvalid"],
                output_names=["pm", "pl", "pacc"], source=_ATTEND_SRC, header=_HEADER)
    return count, scatter, attend


def compact(levels, n1, n2, codes2d, c0, c1, S: int):
    """The sort-free slots (fast_decode._sortfree_select's idx and keep) by two kernels and one cumsum.

    levels (BH, K) uint8, n1/n2 (BH,) int32, codes2d (BH, T_codes), c0/c1 int32 scalars (arrays)."""
    count, scatter, _ = _kernels()
    BH, T_codes = codes2d.shape
    NB = -(-T_codes // BLOCK)
    rng = mx.stack([c0.astype(mx.int32), c1.astype(mx.int32), mx.array(S, dtype=mx.int32)])
    # the template names the codes' dtype only so each dtype gets its own compiled kernel (NVRTC modules are
    # cached by name and template)
    tmpl = [("CodeT", codes2d.dtype)]
    (cnt,) = count(inputs=[codes2d, levels, rng], output_shapes=[(BH, NB, 2)], output_dtypes=[mx.int32],
                   grid=(NB * BLOCK, BH, 1), threadgroup=(BLOCK, 1, 1), template=tmpl)
    base = mx.cumsum(cnt, axis=1) - cnt
    base = base + mx.stack([mx.zeros_like(n1), n1], axis=-1)[:, None, :]
    (idx,) = scatter(inputs=[codes2d, levels, rng, base], output_shapes=[(BH, S)], output_dtypes=[mx.int32],
                     grid=(NB * BLOCK, BH, 1), threadgroup=(BLOCK, 1, 1), template=tmpl, init_value=0)
    n_sel = mx.minimum(n1 + n2, S)
    keep = mx.arange(S, dtype=mx.int32)[None] < n_sel[:, None]
    return idx, keep, n_sel


def attend(q, keys, values, idx, n_sel, forced_idx, scale):
    """Exact softmax attention over the forced tokens and the first n_sel slots of idx, per (b, kv) row.

    q (B, n_q, 1, d); keys/values (B, n_kv, T_buf, d) the cache buffer; idx (BH, S) int32; n_sel (BH,);
    forced_idx (F,) int32 or None (no forced tokens); scale float32 scalar array. Returns (B, n_q, 1, d) in the values' dtype."""
    _, _, attend_k = _kernels()
    B, n_q, _, d = q.shape
    n_kv = keys.shape[1]
    BH, G, F = B * n_kv, n_q // n_kv, 0 if forced_idx is None else forced_idx.shape[0]
    qs = q.reshape(BH, G, d).astype(mx.float32) * scale
    if F:
        idx = mx.concatenate([mx.broadcast_to(forced_idx[None], (BH, F)), idx], axis=-1)
    nvalid = (n_sel + F).astype(mx.int32)
    SA = idx.shape[-1]
    per_block = WARPS * SLOTS_PER_WARP
    NC = max(1, -(-SA // per_block))
    pm, pl, pacc = attend_k(
        inputs=[qs, keys, values, idx, nvalid],
        output_shapes=[(BH, NC, G), (BH, NC, G), (BH, NC, G, d)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
        grid=(NC * WARPS * 32, BH, 1), threadgroup=(WARPS * 32, 1, 1),
        template=[("T", keys.dtype), ("G", G), ("D", d), ("NW", WARPS), ("CH", SLOTS_PER_WARP)])
    M = mx.max(pm, axis=1, keepdims=True)
    f = mx.where(pm > -mx.inf, mx.exp(pm - M), 0.0)
    num = mx.sum(f[..., None] * pacc, axis=1)
    den = mx.sum(f * pl, axis=1)
    return (num / den[..., None]).reshape(B, n_q, 1, d).astype(values.dtype)


_USABLE: dict = {}


def usable() -> bool:
    """Whether method="cuda" may be taken here: on a CUDA device, the kernels compile and, on a small case,
    give the portable sort-free step's slots exactly and its output to float32 tolerance. Checked once per
    process; a failure warns (with the reason) and leaves "auto" on the portable step."""
    key = str(mx.default_device())
    if key not in _USABLE:
        _USABLE[key] = on_cuda() and _self_check()
    return _USABLE[key]


def compare_cuda_step(*, T: int, n_q: int, n_kv: int, d: int, K: int, dtype=mx.float32, seed: int = 0,
                      topk=0.03, w: int = 64, sinks: int = 8) -> dict:
    """One random decode step by method="cuda" and by the portable "sortfree": whether the slots are the same
    (indices and keep flags) and the largest output difference relative to the output's largest entry."""
    import numpy as np

    from . import fast_decode

    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, n_q, 1, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype)
    codes = mx.array(rng.integers(0, K, (1, n_kv, T)).astype(np.uint16))
    CT = fast_decode.prepare_codebook(mx.array(rng.standard_normal((n_kv, K, d)).astype(np.float32)))
    inv = mx.array((1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    counts = fast_decode.code_counts(codes, K)
    kw = dict(query_pos=T - 1, b=2048, w=w, sinks=sinks, topk=topk, inv_freqs=inv, traditional=False,
              code_counts=(counts, T), return_selection=True)
    out_c, sel_c = fast_decode.decode_step_fast(q, k, v, codes, CT, method="cuda", **kw)
    out_s, sel_s = fast_decode.decode_step_fast(q, k, v, codes, CT, method="sortfree", **kw)
    mx.eval(out_c, out_s, sel_c.idx, sel_c.keep, sel_s.idx, sel_s.keep)
    keep_c, keep_s = np.array(sel_c.keep), np.array(sel_s.keep)
    same = bool((keep_c == keep_s).all() and (np.array(sel_c.idx)[keep_s] == np.array(sel_s.idx)[keep_s]).all())
    a, b = np.array(out_c.astype(mx.float32)), np.array(out_s.astype(mx.float32))
    err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
    return {"same_slots": same, "max_rel_err": err, "selected": int(keep_s.sum()), "dtype": str(dtype), "T": T}


def _self_check() -> bool:
    try:
        for dtype, (n_q, n_kv, d) in ((mx.float32, (8, 2, 64)), (mx.float16, (32, 8, 128))):
            diff = compare_cuda_step(T=3000, n_q=n_q, n_kv=n_kv, d=d, K=64, dtype=dtype, seed=1)
            if not diff["same_slots"] or diff["max_rel_err"] > 2e-3:
                warnings.warn(f"a2ats_ref: the CUDA decode kernels disagree with the portable step ({diff}); "
                              "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
                return False
        return True
    except Exception as e:  # a compile or launch failure on this CUDA build: fall back, and say why
        warnings.warn(f"a2ats_ref: the CUDA decode kernels cannot run here ({type(e).__name__}: {e}); "
                      "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
        return False
