"""EQ-14 — query-aware assignment: code = argmin_j (k - c_j) H (k - c_j)^T in key space.

This is the brute-force definition (no Cholesky); EQ-16's assign_z must agree
with it. k H k^T is the same for every j, so only -2 k H c_j^T + c_j H c_j^T is
compared. Ties go to the lowest index.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from a2ats_ref import checks
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.precision import mm

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


#: most bytes of one block of the (..., rows, K) distance matrix: evaluated, reduced, then dropped. Each block
#: reads the whole codebook once, so a decode batch (w + 1 = 65 tokens: 33 MiB at Llama-3.1-8B shapes) must be
#: one block; only long prefills are split.
BLOCK_BYTES = 1 << 26


def row_blocks(N: int, row_bytes: int) -> list[tuple[int, int]]:
    """[s, e) ranges covering N rows in the fewest blocks of at most BLOCK_BYTES (and ROW_CHUNK rows),
    as equal as possible (a short last block would cost a whole codebook read for a few rows)."""
    cap = max(1, min(ROW_CHUNK, BLOCK_BYTES // max(1, row_bytes)))
    n_blocks = -(-N // cap)
    size = -(-N // max(1, n_blocks))
    return [(s, min(s + size, N)) for s in range(0, N, size)]


def distance_operand(Y: mx.array, bias: mx.array) -> mx.array:
    """(..., d + 1, K) contiguous float32: Y transposed with the bias as one more row, the right operand of
    nearest_rows. A caller that assigns many times (the cache) builds it once per codebook."""
    return mx.contiguous(mx.concatenate([mx.swapaxes(Y, -1, -2), bias], axis=-2))


def _head_halves(x: mx.array, Yb: mx.array) -> list[tuple[mx.array, mx.array]]:
    """(x, Yb) split into two halves along the heads axis (-3) they share, else [(x, Yb)]."""
    h = Yb.shape[-3] if Yb.ndim >= 3 else 1
    if h < 2 or x.ndim < 3 or x.shape[-3] != h:
        return [(x, Yb)]
    m = h // 2
    return [(x[..., :m, :, :], Yb[..., :m, :, :]), (x[..., m:, :, :], Yb[..., m:, :, :])]


def nearest_rows(x: mx.array, Yb: mx.array, *, host: bool = False):
    """argmin_j (-2 x . Y_j + bias_j) over row blocks; x (..., N, d), Yb = distance_operand(Y, bias)
    (..., d + 1, K) -> uint32 codes (..., N), an mx.array, or a NumPy array when host=True.

    Each block's distances come out of one batched GEMM of [-2x, 1] with Yb, so no elementwise pass over
    the (rows, K) block is needed before the argmin (x2 is exact; the bias is one more product term).
    On the CPU the block is reduced by NumPy's argmin (same rule: first minimum; MLX's CPU argmin costs
    several times the GEMM): a batch of tokens costs about one read of the codebook plus its FLOPs.
    host=True hands back those NumPy codes as they are (a caller that counts them on the host saves a copy
    back and forth); on a GPU it copies the device's codes to the host.
    """
    lead = tuple(np.broadcast_shapes(x.shape[:-2], Yb.shape[:-2]))
    N, K = x.shape[-2], Yb.shape[-1]
    if N == 0:  # no keys: empty codes of the broadcast shape (argmin refuses empty arrays)
        return np.zeros(lead + (0,), np.uint32) if host else mx.zeros(lead + (0,), dtype=mx.uint32)
    xa = mx.concatenate([-2.0 * x, mx.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1)
    blocks = row_blocks(N, 4 * K * max(1, math.prod(lead)))
    out = []
    if mx.default_device().type != mx.cpu:
        # On a GPU the block stays there: MLX's argmin is cheap there, a host copy of each block is not.
        for s, e in blocks:
            out.append(mx.argmin(mm(xa[..., s:e, :], Yb), axis=-1).astype(mx.uint32))
            mx.eval(out[-1])
        codes = mx.concatenate(out, axis=-1) if len(out) > 1 else out[0]
        return np.array(codes) if host else codes
    for s, e in blocks:
        dists = [mm(a, b) for a, b in _head_halves(xa[..., s:e, :], Yb)]
        mx.async_eval(dists)   # NumPy reduces the first half while MLX multiplies the second
        codes = [np.asarray(dist).argmin(axis=-1).astype(np.uint32) for dist in dists]
        out.append(np.concatenate(codes, axis=-2) if len(codes) > 1 else codes[0])
    codes = np.concatenate(out, axis=-1) if len(out) > 1 else out[0]
    return codes if host else mx.array(codes)


def assign(k, C, H) -> mx.array:
    """EQ-14: k (..., d), C (K, d) or (..., K, d), H (d, d) or (..., d, d) -> codes (...) uint8/uint16."""
    k, C, H, d = check_codebook_args(k, C, H, "k", "C", "H")
    checks.check_symmetric(H, "H")
    K = C.shape[-2]
    flat = C.ndim == 2 and H.ndim == 2
    x = k.reshape(-1, d) if flat else k
    CH = mm(C, H)
    bias = mx.sum(CH * C, axis=-1)[..., None, :]
    codes = nearest_rows(mm(x, H), distance_operand(C, bias))
    return codes.reshape(k.shape[:-1]).astype(mx_code_dtype(K))
