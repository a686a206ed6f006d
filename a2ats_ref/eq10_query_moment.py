"""EQ-10 — the query second moment H = E[q~^T q~], q~ = q R_b, one H per KV head.

Pre-RoPE calibration queries are rotated by R_b (far tokens see the query at
relative position b), pooled over the query heads of each GQA group, normalised
by the RMS of H's entries and given a small ridge so EQ-15 can factorise it.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.precision import mm
from a2ats_ref.rope import rope_apply


def query_moment(queries, *, n_kv_heads: int, b: int, inv_freqs, traditional: bool, ridge: float = 1e-6) -> mx.array:
    """EQ-10: queries (..., n_q, N, d) pre-RoPE -> H (..., n_kv, d, d) float32."""
    q = checks.as_float(queries, "queries")
    checks.check_ndim(q, "queries", 3, "(..., n_q, N, d)")
    n_q, N, d = q.shape[-3:]
    checks.check_head_dim(d, "queries.shape[-1] (head_dim)")
    n_kv = checks.check_pos_int(n_kv_heads, "n_kv_heads")
    if n_q % n_kv:
        raise ValueError(f"n_kv_heads: {n_kv} KV heads must divide the {n_q} query heads")
    if N < 1:
        raise ValueError("queries: expected at least one calibration token (N >= 1), got N = 0")
    checks.check_nonneg_int(b, "b")
    if isinstance(ridge, bool) or not (isinstance(ridge, numbers.Real) and math.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge: expected a finite non-negative number (default 1e-6), got {ridge!r}")
    G = n_q // n_kv
    qt = rope_apply(q, b, inv_freqs, traditional=traditional)
    qt = qt.reshape(q.shape[:-3] + (n_kv, G * N, d))
    H = checks.check_no_overflow(mm(mx.swapaxes(qt, -1, -2), qt) / (G * N), "H (EQ-10)", "queries")
    # The RMS is taken of H / max|H|: squaring H itself overflows float32 once its entries pass ~1e19.
    peak = mx.max(mx.abs(H), axis=(-2, -1), keepdims=True)
    if not mx.all(peak > 0).item():
        raise ValueError("queries: a KV head's queries are all zero, so H cannot be RMS-normalised")
    rms = peak * mx.sqrt(mx.mean(mx.square(H / peak), axis=(-2, -1), keepdims=True))   # >= peak / d > 0
    out = H / rms + float(ridge) * mx.eye(d, dtype=mx.float32)
    return checks.check_no_overflow(out, "H (EQ-10)", "queries")
