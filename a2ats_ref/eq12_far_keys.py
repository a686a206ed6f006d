"""EQ-12 — far tokens: the key side is the pre-RoPE key, R_b rides on the query.

q_i R_b k_j^T = (q_i R_b) k_j^T, so a cache can keep position-free keys (and their
codes) and rotate only the query. Cached mlx-lm keys are post-RoPE, hence the
per-token de-rotation in far_keys.

far_keys / far_query validate their inputs; the *_unchecked kernels they call are
what the cache's per-token path uses (validation costs host syncs).
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.rope import rotate_unchecked, rotation_args


def far_keys_unchecked(k_post: mx.array, positions: mx.array, inv_freqs: mx.array, *, traditional: bool) -> mx.array:
    """EQ-12 kernel of far_keys: float32 inputs, no validation."""
    return rotate_unchecked(k_post, positions, inv_freqs, traditional, -1.0)


def far_query_unchecked(q: mx.array, b: mx.array, inv_freqs: mx.array, *, traditional: bool,
                        positions: mx.array | None = None) -> mx.array:
    """EQ-12 kernel of far_query: float32 q, b (a position) and positions, no validation."""
    if positions is not None:
        # Undo the exact float32 angle mlx-lm used, then apply b: closer to q R_b than one (b - p) angle.
        q = rotate_unchecked(q, positions, inv_freqs, traditional, -1.0)
    return rotate_unchecked(q, b, inv_freqs, traditional, 1.0)


def far_keys(k_post, positions, inv_freqs, *, traditional: bool) -> mx.array:
    """EQ-12: pre-RoPE keys k_j = k_post_j R_{p_j}^T, de-rotated per token."""
    k, p, w = rotation_args(k_post, positions, inv_freqs)
    return far_keys_unchecked(k, p, w, traditional=traditional)


def far_query(q, *, b: int, inv_freqs, traditional: bool, positions=None) -> mx.array:
    """EQ-12: q R_b for pre-RoPE q (positions=None), else q R_{b - p} for q post-RoPE at p."""
    checks.check_nonneg_int(b, "b")
    if positions is None:
        q, pb, w = rotation_args(q, b, inv_freqs)
        return far_query_unchecked(q, pb, w, traditional=traditional)
    q, p, w = rotation_args(q, positions, inv_freqs)
    return far_query_unchecked(q, checks.as_positions(b), w, traditional=traditional, positions=p)
