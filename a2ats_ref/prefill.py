"""PREFILL — query length > 1: dense causal attention, no retrieval.

Keys are end-aligned with the queries (query t sits at position Tk - Tq + t),
as in mlx-lm's causal mask; GQA query head h reads KV head h // G. Codes are
still assigned for every prefill token (by the cache, via EQ-16).
"""

from __future__ import annotations

import mlx.core as mx

from . import checks
from .retrieval import attend, attention_scale, gqa_group


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
