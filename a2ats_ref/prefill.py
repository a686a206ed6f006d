"""PREFILL — query length > 1: dense causal attention, no retrieval.

Keys are end-aligned with the queries (query t sits at position Tk - Tq + t),
as in mlx-lm's causal mask; GQA query head h reads KV head h // G. Codes are
still assigned for every prefill token (by the cache, via EQ-16).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from a2ats_ref import checks
from a2ats_ref.retrieval import attend, attention_scale, gqa_group


def prefill_attention(q, k, v, *, scale=None) -> mx.array:
    """PREFILL: q (..., n_q, Tq, d), k (..., n_kv, Tk, d), v (..., n_kv, Tk, dv) -> (..., n_q, Tq, dv) in v's dtype."""
    q = checks.as_float(q, "q")
    k = checks.as_float(k, "k")
    v, vdt = checks.as_value_float(v, "v")
    checks.check_ndim(q, "q", 3, "(..., n_q, Tq, d)")
    checks.check_ndim(k, "k", 3, "(..., n_kv, Tk, d)")
    checks.check_ndim(v, "v", 3, "(..., n_kv, Tk, dv)")
    n_q, Tq, d = q.shape[-3:]
    n_kv, Tk = k.shape[-3], k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head_dim {d} (from q) on the last axis, got shape {tuple(k.shape)}")
    if v.shape[-3:-1] != (n_kv, Tk):
        raise ValueError(f"v: expected shape (..., {n_kv}, {Tk}, dv) to match k, got {tuple(v.shape)}")
    if Tq < 1 or Tk < Tq:
        raise ValueError(f"q, k: need 1 <= Tq <= Tk (queries are the last Tq cached tokens), got Tq={Tq}, Tk={Tk}")
    G = gqa_group(n_q, n_kv)
    checks.check_broadcast(q.shape[:-3], k.shape[:-3], "q[..., :-3]", "k[..., :-3]")
    qpos = mx.arange(Tk - Tq, Tk)
    bias = mx.where(mx.arange(Tk)[None, :] <= qpos[:, None], 0.0, -mx.inf)  # (Tq, Tk)
    qg = q.reshape(q.shape[:-3] + (n_kv, G * Tq, d))
    out = attend(qg, k, v, mx.tile(bias, (G, 1)), attention_scale(scale, d), vdt)
    return out.reshape(out.shape[:-3] + (n_q, Tq, v.shape[-1]))


#: query × key count from which A2ATSCache's prefill attends on the host (CPU only). MLX's CPU exp costs
#: about 23 ns per element against NumPy's 1.5 ns (measured on the project's 2-core machine), and a long
#: prefill is one exp per (query head, query, key): below this size mlx-lm's own path is kept, bit for bit.
HOST_PREFILL_MIN = 1 << 20

#: bytes of float32 scores one query block of the host prefill holds (bounds its memory at long contexts)
HOST_PREFILL_BLOCK_BYTES = 1 << 25


def use_host_prefill(queries: mx.array, keys: mx.array) -> bool:
    """True when causal_attention_host should run this prefill: on the CPU, from HOST_PREFILL_MIN query × key pairs."""
    return mx.default_device().type == mx.cpu and queries.shape[-2] * keys.shape[-2] >= HOST_PREFILL_MIN


def causal_attention_host(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float) -> mx.array:
    """PREFILL in mlx-lm's layout: scores by MLX's BLAS GEMM, softmax and p @ V in NumPy (vectorised exp).

    queries (B, n_q, Tq, d) post-RoPE, keys/values (B, n_kv, Tk, d|dv) with the queries end-aligned (query t
    at position Tk - Tq + t sees keys j <= Tk - Tq + t) -> (B, n_q, Tq, dv) in the queries' dtype. Same
    softmax as prefill_attention (max-subtracted, float32), evaluated in query blocks of at most
    HOST_PREFILL_BLOCK_BYTES of scores (NumPy works in place on the block MLX wrote); the normalisation
    divides p @ V instead of p.
    """
    B, n_q, Tq, d = queries.shape
    n_kv, Tk, dv = keys.shape[1], keys.shape[2], values.shape[3]
    G = n_q // n_kv
    f32 = mx.float32
    q = (queries.astype(f32) * scale).reshape(B, n_kv, G, Tq, d)
    kT = mx.contiguous(keys.astype(f32).swapaxes(-1, -2))
    v = np.asarray(values.astype(f32))
    out = np.empty((B, n_kv, G, Tq, dv), np.float32)
    rows = max(1, HOST_PREFILL_BLOCK_BYTES // (4 * B * n_q * Tk))
    for s in range(0, Tq, rows):
        e = min(s + rows, Tq)
        b = e - s
        block = q[:, :, :, s:e].reshape(B, n_kv, G * b, d) @ kT
        mx.eval(block)
        scores = np.asarray(block)            # a view of MLX's fresh result: the softmax runs in place on it
        sc = scores.reshape(B, n_kv, G, b, Tk)
        lo = Tk - Tq + s + 1   # keys from here on are hidden from some query of the block (column c >= row t)
        if lo < Tk:
            sc[..., lo:] += np.where(np.triu(np.ones((b, Tk - lo), dtype=bool)), np.float32(-np.inf), np.float32(0))
        sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        denom = sc.sum(axis=-1, keepdims=True)
        o = (scores @ v).reshape(B, n_kv, G, b, dv)
        np.divide(o, denom, out=out[:, :, :, s:e])
    return mx.array(out.reshape(B, n_q, Tq, dv)).astype(queries.dtype)
