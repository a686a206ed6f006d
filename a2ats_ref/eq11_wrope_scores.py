"""EQ-11 — windowed RoPE (WRoPE) scores that choose the tokens.

u_ij = q_i R_{i-j} k_j^T when i - j < w (near: exact RoPE), else q_i R_b k_j^T
(far: a fixed relative position b). q and k are pre-RoPE; there is no causal
mask here (j > i has i - j < 0 < w and so counts as near).
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.precision import mm
from a2ats_ref.rope import rope_apply


def _positions(p, n: int, name: str) -> mx.array:
    if p is None:
        return mx.arange(n, dtype=mx.float32)
    p = checks.as_positions(p, name)
    if p.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got shape {tuple(p.shape)}")
    return p


def wrope_scores(q, k, *, w: int, b: int, inv_freqs, traditional: bool, q_positions=None, k_positions=None) -> mx.array:
    """EQ-11: q (..., Tq, d), k (..., Tk, d) pre-RoPE, leading dims broadcast -> u (..., Tq, Tk) float32."""
    q = checks.as_float(q, "q")
    k = checks.as_float(k, "k")
    checks.check_ndim(q, "q", 2, "(..., Tq, d)")
    checks.check_ndim(k, "k", 2, "(..., Tk, d)")
    d = checks.check_head_dim(q.shape[-1], "q.shape[-1] (head_dim)")
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head_dim {d} (from q) on the last axis, got shape {tuple(k.shape)}")
    checks.check_broadcast(q.shape[:-2], k.shape[:-2], "q[..., :-2]", "k[..., :-2]")
    w = checks.check_nonneg_int(w, "w")
    b = checks.check_nonneg_int(b, "b")
    pq = _positions(q_positions, q.shape[-2], "q_positions")
    pk = _positions(k_positions, k.shape[-2], "k_positions")
    # R_i R_j^T depends only on i - j: shift both by a common origin to keep float32 angles small.
    origin = mx.minimum(mx.min(pq), mx.min(pk))
    qn = rope_apply(q, (pq - origin).astype(mx.int32), inv_freqs, traditional=traditional)
    kn = rope_apply(k, (pk - origin).astype(mx.int32), inv_freqs, traditional=traditional)
    near = mm(qn, mx.swapaxes(kn, -1, -2))
    far = mm(rope_apply(q, b, inv_freqs, traditional=traditional), mx.swapaxes(k, -1, -2))
    return mx.where((pq[:, None] - pk[None, :]) < w, near, far)
