"""EQ-13 — expected squared score error of replacing key k by codeword c.

E_q[(q k^T - q c^T)^2] = (k - c) H (k - c)^T with H = E[q^T q]; it is the plain
squared distance only when H is a multiple of the identity.
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.precision import mm


def score_error(k, c, H) -> mx.array:
    """EQ-13: (k - c) H (k - c)^T over the last axis; k, c (..., d), H (..., d, d) -> (...) float32."""
    k = checks.as_float(k, "k")
    c = checks.as_float(c, "c")
    H = checks.as_float(H, "H")
    checks.check_ndim(k, "k", 1, "(..., d)")
    d = checks.check_head_dim(k.shape[-1], "k.shape[-1] (head_dim)")
    if c.ndim < 1 or c.shape[-1] != d:
        raise ValueError(f"c: expected last axis {d} (head_dim of k), got shape {tuple(c.shape)}")
    if H.ndim < 2 or H.shape[-2:] != (d, d):
        raise ValueError(f"H: expected shape (..., {d}, {d}), got shape {tuple(H.shape)}")
    checks.check_symmetric(H, "H")
    e = k - c
    return mx.sum(mm(e[..., None, :], H)[..., 0, :] * e, axis=-1)
