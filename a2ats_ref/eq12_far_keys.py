"""EQ-12 — far tokens: the key side is the pre-RoPE key, R_b rides on the query.

q_i R_b k_j^T = (q_i R_b) k_j^T, so a cache can keep position-free keys (and their
codes) and rotate only the query. Cached mlx-lm keys are post-RoPE, hence the
per-token de-rotation in far_keys.
"""

from __future__ import annotations

import mlx.core as mx

from . import checks
from .rope import rope_apply, rope_invert


def far_keys(k_post, positions, inv_freqs, *, traditional: bool) -> mx.array:
    """EQ-12: pre-RoPE keys k_j = k_post_j R_{p_j}^T, de-rotated per token."""
    return rope_invert(k_post, positions, inv_freqs, traditional=traditional)


def far_query(q, *, b: int, inv_freqs, traditional: bool, positions=None) -> mx.array:
    """EQ-12: q R_b for pre-RoPE q (positions=None), else q R_{b - p} for q post-RoPE at p."""
    checks.check_nonneg_int(b, "b")
    if positions is not None:
        # Undo the exact float32 angle mlx-lm used, then apply b: closer to q R_b than one (b - p) angle.
        q = rope_invert(q, positions, inv_freqs, traditional=traditional)
    return rope_apply(q, b, inv_freqs, traditional=traditional)
