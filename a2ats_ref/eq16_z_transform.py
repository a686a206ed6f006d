"""EQ-16 — whitening: z = k L turns the H-weighted error into a Euclidean one.

(k - c) H (k - c)^T = ||k L - c L||^2 when H = L L^T, so the runtime assignment
is the nearest z-space codeword Cz (= C L) to k L. assign_z validates and calls
assign_z_unchecked, the kernel the cache runs on every batch of keys; it ranks
-2 k . (Cz_j L^T) + ||Cz_j||^2, the same distances less ||k L||^2 (z_space_operands).
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.codes import code_dtype, mx_code_dtype
from a2ats_ref.eq14_assign import check_codebook_args, distance_operand, nearest_rows
from a2ats_ref.precision import mm


def z_transform(k, L) -> mx.array:
    """EQ-16: z = k L; k (..., d), L (d, d) or batched (..., d, d) -> float32."""
    k = checks.as_float(k, "k")
    L = checks.as_float(L, "L")
    checks.check_ndim(k, "k", 1, "(..., d)")
    d = checks.check_head_dim(k.shape[-1], "k.shape[-1] (head_dim)")
    checks.check_lower_triangular(L, "L", d=d)
    return mm(k, L)


def z_space_operands(Cz: mx.array, L: mx.array) -> mx.array:
    """nearest_rows' operand for (Cz, L): (Cz L^T)^T = L Cz^T, contiguous (..., d, K), with ||Cz_j||^2 as row d.

    ||k L - Cz_j||^2 = ||k L||^2 - 2 k . (Cz_j L^T) + ||Cz_j||^2, and the first term is the same for every j, so
    the nearest z-space codeword of k L is argmin_j (-2 k . (Cz_j L^T) + ||Cz_j||^2): the keys go into the distance
    GEMM as they are, and z = k L is never formed (one small GEMM less per batch of keys). It depends on the
    codebook only, so a caller that assigns many times (the cache) builds it once.
    """
    Yb = distance_operand(mm(Cz, mx.swapaxes(L, -1, -2)), mx.sum(Cz * Cz, axis=-1)[..., None, :])
    mx.eval(Yb)
    return Yb


def assign_z_unchecked(k: mx.array, Cz: mx.array, L: mx.array, operands=None, *, host: bool = False):
    """EQ-16 kernel of assign_z, no validation: float32 k (..., N, d), Cz (..., K, d), L (..., d, d) -> codes (..., N)
    in the CODES-DTYPE dtype, an mx.array, or a NumPy array when host=True (nearest_rows).

    operands: z_space_operands(Cz, L), when the caller keeps it; computed here otherwise.
    """
    Yb = operands if operands is not None else z_space_operands(Cz, L)
    codes = nearest_rows(k, Yb, host=host)
    K = Cz.shape[-2]
    return codes.astype(code_dtype(K)) if host else codes.astype(mx_code_dtype(K))


def assign_z(k, Cz, L) -> mx.array:
    """EQ-16: codes = argmin_j ||k L - Cz_j||^2; Cz (K, d) or (..., K, d) -> codes (...) uint8/uint16."""
    k, Cz, L, d = check_codebook_args(k, Cz, L, "k", "Cz", "L")
    checks.check_lower_triangular(L, "L")
    flat = Cz.ndim == 2 and L.ndim == 2
    codes = assign_z_unchecked(k.reshape(-1, d) if flat else k, Cz, L)
    return codes.reshape(k.shape[:-1])
