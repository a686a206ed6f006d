"""EQ-16 — whitening: z = k L turns the H-weighted error into a Euclidean one.

(k - c) H (k - c)^T = ||k L - c L||^2 when H = L L^T, so the runtime assignment
is the nearest z-space codeword Cz (= C L) to k L.
"""

from __future__ import annotations

import mlx.core as mx

from . import checks
from .codes import mx_code_dtype
from .eq14_assign import _check_codebook_args, nearest_rows


def z_transform(k, L) -> mx.array:
    """EQ-16: z = k L; k (..., d), L (d, d) or batched (..., d, d) -> float32."""
    k = checks.as_float(k, "k")
    L = checks.as_float(L, "L")
    checks.check_ndim(k, "k", 1, "(..., d)")
    d = checks.check_head_dim(k.shape[-1], "k.shape[-1] (head_dim)")
    if L.ndim < 2 or L.shape[-2:] != (d, d):
        raise ValueError(f"L: expected shape (..., {d}, {d}), got shape {tuple(L.shape)}")
    checks.check_lower_triangular(L, "L")
    return k @ L


def assign_z(k, Cz, L) -> mx.array:
    """EQ-16: codes = argmin_j ||k L - Cz_j||^2; Cz (K, d) or (..., K, d) -> codes (...) uint8/uint16."""
    k, Cz, L, d = _check_codebook_args(k, Cz, L, "k", "Cz", "L")
    checks.check_lower_triangular(L, "L")
    K = Cz.shape[-2]
    flat = Cz.ndim == 2 and L.ndim == 2
    z = (k.reshape(-1, d) if flat else k) @ L
    bias = mx.sum(Cz * Cz, axis=-1)[..., None, :]
    codes = nearest_rows(z, Cz, bias)
    return codes.reshape(k.shape[:-1]).astype(mx_code_dtype(K))
