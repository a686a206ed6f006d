"""EQ-14 — query-aware assignment: code = argmin_j (k - c_j) H (k - c_j)^T in key space.

This is the brute-force definition (no Cholesky); EQ-16's assign_z must agree
with it. k H k^T is the same for every j, so only -2 k H c_j^T + c_j H c_j^T is
compared. Ties go to the lowest index.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from . import checks
from .codes import mx_code_dtype
from .precision import mm

ROW_CHUNK = 8192


def check_codebook_args(k, C, M, k_name: str, C_name: str, M_name: str):
    """EQ-14/EQ-16 preconditions: float32 (k, C, M) and d; batched codebooks need a token axis on k."""
    k = checks.as_float(k, k_name)
    C = checks.as_float(C, C_name)
    M = checks.as_float(M, M_name)
    checks.check_ndim(k, k_name, 1, "(..., d)")
    d = checks.check_head_dim(k.shape[-1], f"{k_name}.shape[-1] (head_dim)")
    checks.check_codebook(C, d, C_name)
    if M.ndim < 2 or M.shape[-2:] != (d, d):
        raise ValueError(f"{M_name}: expected shape (..., {d}, {d}), got shape {tuple(M.shape)}")
    if C.ndim > 2 or M.ndim > 2:
        # Per-head codebooks: k must carry a token axis in front of d that the batch dims broadcast over.
        checks.check_ndim(k, k_name, 2, "(..., N, d) when codebooks are batched")
        checks.check_broadcast(C.shape[:-2], M.shape[:-2], f"{C_name}[..., :-2]", f"{M_name}[..., :-2]")
        checks.check_broadcast(k.shape[:-2], C.shape[:-2], f"{k_name}[..., :-2]", f"{C_name}[..., :-2]")
    return k, C, M, d


#: bytes of one block of the (..., rows, K) distance matrix: evaluated, reduced, then dropped
BLOCK_BYTES = 1 << 23


def nearest_rows(x: mx.array, Y: mx.array, bias: mx.array, *, Yt: mx.array | None = None) -> mx.array:
    """argmin_j (-2 x . Y_j + bias_j) over row blocks; x (..., N, d), Y (..., K, d), bias (..., 1, K) -> uint32.

    Yt, a contiguous (..., d, K) copy of Y, may be passed in: a transposed view is copied on every
    call, which dominates the one-token case. Each block of distances is one batched GEMM in MLX and
    is reduced by NumPy's argmin (same rule: first minimum; MLX's CPU argmin costs several times the
    GEMM): a batch of tokens then costs about one read of the codebook plus its FLOPs.
    """
    if Yt is None:
        Yt = mx.swapaxes(Y, -1, -2)
    lead = tuple(np.broadcast_shapes(x.shape[:-2], Y.shape[:-2]))
    N, K = x.shape[-2], Y.shape[-2]
    if N == 0:  # no keys: empty codes of the broadcast shape (argmin refuses empty arrays)
        return mx.zeros(lead + (0,), dtype=mx.uint32)
    rows = max(1, min(ROW_CHUNK, BLOCK_BYTES // (4 * K * max(1, math.prod(lead)))))
    out = []
    if mx.default_device().type != mx.cpu:
        # On a GPU the block stays there: MLX's argmin is cheap there, a host copy of each block is not.
        for s in range(0, N, rows):
            out.append(mx.argmin(bias - 2.0 * mm(x[..., s : s + rows, :], Yt), axis=-1).astype(mx.uint32))
            mx.eval(out[-1])
        return mx.concatenate(out, axis=-1) if len(out) > 1 else out[0]
    for s in range(0, N, rows):
        dist = bias - 2.0 * mm(x[..., s : s + rows, :], Yt)
        mx.eval(dist)
        out.append(np.asarray(dist).argmin(axis=-1).astype(np.uint32))
    return mx.array(np.concatenate(out, axis=-1) if len(out) > 1 else out[0])


def assign(k, C, H) -> mx.array:
    """EQ-14: k (..., d), C (K, d) or (..., K, d), H (d, d) or (..., d, d) -> codes (...) uint8/uint16."""
    k, C, H, d = check_codebook_args(k, C, H, "k", "C", "H")
    checks.check_symmetric(H, "H")
    K = C.shape[-2]
    flat = C.ndim == 2 and H.ndim == 2
    x = k.reshape(-1, d) if flat else k
    CH = mm(C, H)
    bias = mx.sum(CH * C, axis=-1)[..., None, :]
    codes = nearest_rows(mm(x, H), C, bias)
    return codes.reshape(k.shape[:-1]).astype(mx_code_dtype(K))
