"""EQ-16 — whitening: z = k L turns the H-weighted error into a Euclidean one.

(k - c) H (k - c)^T = ||k L - c L||^2 when H = L L^T, so the runtime assignment
is the nearest z-space codeword Cz (= C L) to k L. assign_z validates and calls
assign_z_unchecked, the kernel the cache runs on every appended token.
"""

from __future__ import annotations

import mlx.core as mx

from . import checks
from .codes import mx_code_dtype
from .eq14_assign import check_codebook_args, nearest_rows
from .precision import mm


def z_transform(k, L) -> mx.array:
    """EQ-16: z = k L; k (..., d), L (d, d) or batched (..., d, d) -> float32."""
    k = checks.as_float(k, "k")
    L = checks.as_float(L, "L")
    checks.check_ndim(k, "k", 1, "(..., d)")
    d = checks.check_head_dim(k.shape[-1], "k.shape[-1] (head_dim)")
    checks.check_lower_triangular(L, "L", d=d)
    return mm(k, L)


def z_space_operands(Cz: mx.array) -> tuple[mx.array, mx.array]:
    """(CzT, bias) for assign_z_unchecked: Cz transposed to contiguous (..., d, K) and ||Cz_j||^2 (..., 1, K).

    Both depend on the codebook only, so a caller that assigns many times (the cache) builds them once.
    """
    CzT = mx.contiguous(mx.swapaxes(Cz, -1, -2))
    bias = mx.sum(Cz * Cz, axis=-1)[..., None, :]
    mx.eval(CzT, bias)
    return CzT, bias


def assign_z_unchecked(k: mx.array, Cz: mx.array, L: mx.array, operands=None) -> mx.array:
    """EQ-16 kernel of assign_z, no validation: float32 k (..., N, d), Cz (..., K, d), L (..., d, d) -> codes (..., N).

    operands: z_space_operands(Cz), when the caller keeps them; computed here otherwise.
    """
    CzT, bias = operands if operands is not None else (None, mx.sum(Cz * Cz, axis=-1)[..., None, :])
    return nearest_rows(mm(k, L), Cz, bias, Yt=CzT).astype(mx_code_dtype(Cz.shape[-2]))


def assign_z(k, Cz, L) -> mx.array:
    """EQ-16: codes = argmin_j ||k L - Cz_j||^2; Cz (K, d) or (..., K, d) -> codes (...) uint8/uint16."""
    k, Cz, L, d = check_codebook_args(k, Cz, L, "k", "Cz", "L")
    checks.check_lower_triangular(L, "L")
    flat = Cz.ndim == 2 and L.ndim == 2
    codes = assign_z_unchecked(k.reshape(-1, d) if flat else k, Cz, L)
    return codes.reshape(k.shape[:-1])
