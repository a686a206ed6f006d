"""Float64 oracle for A2ATS: one NumPy/SciPy function per clause of spec/SPEC.md.

Written for clarity, not speed, and independent of the MLX code (never imports
``a2ats_ref``). Every function's docstring opens with the clause ID it defines.
Row-vector convention throughout: a rotation acts as ``x @ R``.
"""

from __future__ import annotations

import math
import numbers
import json
import os
from typing import Any, Callable

import numpy as np
import scipy.linalg

__all__ = [
    # ROPE-*
    "rope_inv_freqs", "rope_apply", "rope_invert", "rope_matrix",
    # EQ-10 .. EQ-18
    "query_moment", "wrope_scores", "far_keys", "far_query", "score_error",
    "assign", "assign_distances", "cholesky", "z_transform", "assign_z", "assign_z_distances",
    "kmeanspp_init", "lloyd_step", "kmeans", "back_transform",
    # RET-*, PREFILL, CODES-DTYPE
    "lut_scores", "token_scores", "topk_count", "select_tokens", "select_tokens_allowed", "select_tokens_head_counts",
    "retrieval_attention", "decode_step", "prefill_attention", "collection_attention", "code_dtype",
    # near-tie helpers
    "topk_allowed", "argmin_allowed",
    "SUPPORTED_ROPE_TYPES",
    # CACHE-*: float64 model of the adapter cache protocol
    "OracleCache",
]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


# --------------------------------------------------------------------------- input checks
# INPUT-ERRORS: every failed precondition is a ValueError naming the argument and the fix.

def _array(x: Any, name: str, *, min_ndim: int = 0) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected a real numeric array, got {type(x).__name__} ({exc})") from None
    if a.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        bad = int(np.size(a) - np.count_nonzero(np.isfinite(a)))
        raise ValueError(f"{name}: contains {bad} non-finite value(s) (nan/inf); pass finite values only")
    return a


def _int(x: Any, name: str, *, lo: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name}: expected an int, got {x!r} ({type(x).__name__})")
    x = int(x)
    if lo is not None and x < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x}")
    return x


def _real(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{name}: expected a real number, got {x!r} ({type(x).__name__})")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number, got {x}")
    return x


def _head_dim(d: int, name: str) -> None:
    if d < 2 or d % 2:
        raise ValueError(f"{name}: head dim must be even and >= 2 (RoPE rotates pairs), got {d}")


def _inv_freqs(inv_freqs: Any, d: int, name: str = "inv_freqs") -> np.ndarray:
    w = _array(inv_freqs, name)
    if w.shape != (d // 2,):
        raise ValueError(f"{name}: expected shape ({d // 2},) = (head_dim/2,) for head_dim {d}, got {w.shape}")
    return w


def _groups(n_q: int, n_kv: int, what: str = "query heads") -> int:
    if n_kv < 1:
        raise ValueError(f"n_kv_heads: expected >= 1, got {n_kv}")
    if n_q % n_kv:
        raise ValueError(f"{what}: n_q={n_q} must be a multiple of n_kv={n_kv} (GQA groups are contiguous)")
    return n_q // n_kv


def _scale(scale: Any, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    return _real(scale, "scale")


def _symmetric(H: np.ndarray, name: str) -> None:
    if H.ndim < 2 or H.shape[-1] != H.shape[-2]:
        raise ValueError(f"{name}: expected a square (..., d, d) matrix, got shape {H.shape}")
    # EQ-13's band: reject above 1e-5 max|H|, accept up to 1e-10 max|H|; the oracle takes the strict end
    tol = 1e-10 * (float(np.max(np.abs(H))) if H.size else 0.0)
    asym = float(np.max(np.abs(H - np.swapaxes(H, -1, -2)))) if H.size else 0.0
    if asym > tol:
        raise ValueError(f"{name}: must be symmetric; max |H - H^T| = {asym:.3g} > {tol:.3g}. Symmetrise it, e.g. (H + H^T)/2")


def _lower(L: np.ndarray, name: str, d: int | None = None) -> None:
    if L.ndim < 2 or L.shape[-1] != L.shape[-2]:
        raise ValueError(f"{name}: expected a square (..., d, d) lower-triangular factor, got shape {L.shape}")
    if d is not None and L.shape[-1] != d:
        raise ValueError(f"{name}: expected ({d}, {d}) to match head dim {d}, got {L.shape[-2:]}")
    if np.any(np.triu(L, 1) != 0):
        raise ValueError(f"{name}: must be lower triangular (entries above the diagonal must be exactly 0)")
    diag = np.diagonal(L, axis1=-2, axis2=-1)
    if np.any(diag <= 0):
        raise ValueError(f"{name}: diagonal must be strictly positive (a Cholesky factor of an SPD H), "
                         f"min diagonal = {float(np.min(diag)):.3g}")


def _codebook(C: np.ndarray, name: str, d: int, *, ndim: int = 2) -> None:
    if C.ndim != ndim:
        want = "(K, d)" if ndim == 2 else "(n_kv, K, d)"
        raise ValueError(f"{name}: expected shape {want}, got {C.shape}")
    if C.shape[-1] != d:
        raise ValueError(f"{name}: codeword width {C.shape[-1]} != head dim {d}; the codebook must be full head dim")
    if C.shape[-2] < 1:
        raise ValueError(f"{name}: codebook is empty (K = 0); need K >= 1")


# --------------------------------------------------------------------------- ROPE-*

def rope_inv_freqs(head_dim: int, base: float, scaling: dict | None = None) -> np.ndarray:
    """ROPE-FREQ. Inverse frequencies ω (head_dim/2,) as mlx-lm's RoPE modules build them.

    default: ω_i = base^(-2i/d).  linear: ω_i / factor (mlx-lm scales positions by 1/factor).
    llama3: mlx-lm's Llama3RoPE periods P_i (angle = pos / P_i), returned as ω_i = 1 / P_i.
    Any other type raises ValueError listing the supported ones.
    """
    d = _int(head_dim, "head_dim")
    _head_dim(d, "head_dim")
    base = _real(base, "base")
    if base <= 1.0:
        raise ValueError(f"base: expected a RoPE base > 1, got {base}")
    omega = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if scaling is None:
        return omega
    if not isinstance(scaling, dict):
        raise ValueError(f"scaling: expected None or a rope_scaling dict, got {type(scaling).__name__}")
    kind = scaling.get("type") or scaling.get("rope_type", "default")
    if kind == "default":
        return omega
    if kind == "linear":
        if "factor" not in scaling:
            raise ValueError("scaling['factor']: linear RoPE scaling needs a 'factor'")
        factor = _real(scaling["factor"], "scaling['factor']")
        if factor <= 0:
            raise ValueError(f"scaling['factor']: expected > 0 for linear RoPE scaling, got {factor}")
        return omega / factor
    if kind == "llama3":
        if "factor" not in scaling:
            raise ValueError("scaling['factor']: llama3 RoPE scaling needs a 'factor'")
        factor = _real(scaling["factor"], "scaling['factor']")
        low = _real(scaling.get("low_freq_factor", 1.0), "scaling['low_freq_factor']")
        high = _real(scaling.get("high_freq_factor", 4.0), "scaling['high_freq_factor']")
        old_len = _real(scaling.get("original_max_position_embeddings", 8192),
                        "scaling['original_max_position_embeddings']")
        if factor <= 0 or low <= 0 or high <= low or old_len <= 0:
            raise ValueError("scaling: llama3 needs factor > 0, 0 < low_freq_factor < high_freq_factor, "
                             f"original_max_position_embeddings > 0; got factor={factor}, low={low}, "
                             f"high={high}, original_max_position_embeddings={old_len}")
        out = np.empty_like(omega)
        for i, w in enumerate(omega):
            wavelen = 2.0 * math.pi / w
            if wavelen > old_len / low:  # low-frequency band: slowed down by factor
                out[i] = w / factor
            elif wavelen > old_len / high:  # medium band (strict on both sides): smooth blend
                s = (old_len / wavelen - low) / (high - low)
                out[i] = w * ((1.0 - s) / factor + s)
            else:  # high-frequency band (and the band edges): unchanged
                out[i] = w
        return out
    raise ValueError(f"scaling: RoPE type {kind!r} is not supported (its rotation is not a fixed per-position "
                     f"rotation we can invert exactly, or it is not implemented); supported types: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _pairs(d: int, traditional: bool) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(traditional, (bool, np.bool_)):
        raise ValueError(f"traditional: expected a bool, got {traditional!r}")
    if traditional:
        return np.arange(0, d, 2), np.arange(1, d, 2)
    return np.arange(d // 2), np.arange(d // 2, d)


def rope_matrix(position: float, inv_freqs: Any, *, traditional: bool) -> np.ndarray:
    """ROPE-APPLY. The d×d rotation R_m with x R_m == rope_apply(x, m); block diagonal in pair space."""
    w = _array(inv_freqs, "inv_freqs", min_ndim=1)
    d = 2 * w.shape[0]
    m = _real(position, "position")
    ia, ib = _pairs(d, traditional)
    R = np.zeros((d, d))
    for i, (a, b) in enumerate(zip(ia, ib)):
        c, s = math.cos(m * w[i]), math.sin(m * w[i])
        # row-vector: (x_a, x_b) -> (x_a c - x_b s, x_a s + x_b c)
        R[a, a], R[b, a] = c, -s
        R[a, b], R[b, b] = s, c
    return R


def _rotate(x: np.ndarray, theta: np.ndarray, traditional: bool) -> np.ndarray:
    d = x.shape[-1]
    ia, ib = _pairs(d, traditional)
    xa, xb = x[..., ia], x[..., ib]
    c, s = np.cos(theta), np.sin(theta)
    out = np.empty(np.broadcast_shapes(x.shape, theta.shape[:-1] + (d,)))
    out[..., ia] = xa * c - xb * s
    out[..., ib] = xa * s + xb * c
    return out


def _angles(x: np.ndarray, positions: Any, w: np.ndarray, name: str = "positions") -> np.ndarray:
    p = _array(positions, name)
    try:
        np.broadcast_shapes(p.shape, x.shape[:-1])
    except ValueError:
        raise ValueError(f"{name}: shape {p.shape} does not broadcast against x.shape[:-1] = {x.shape[:-1]} "
                         f"(pass a scalar, a (T,) vector, or one position per row)") from None
    return p[..., None] * w


def rope_apply(x: Any, positions: Any, inv_freqs: Any, *, traditional: bool) -> np.ndarray:
    """ROPE-APPLY. x R_p per row: each row of x (..., T, d) rotated by angle p·ω_i on pair i.

    positions: scalar, (T,), or any shape broadcasting against x.shape[:-1]. Pairs are (2i, 2i+1) when
    traditional, else (i, i + d/2).
    """
    x = _array(x, "x", min_ndim=1)
    _head_dim(x.shape[-1], "x.shape[-1]")
    w = _inv_freqs(inv_freqs, x.shape[-1])
    return _rotate(x, _angles(x, positions, w), traditional)


def rope_invert(x: Any, positions: Any, inv_freqs: Any, *, traditional: bool) -> np.ndarray:
    """ROPE-INVERSE. Per-row inverse x R_p^T = x R_{-p}: rope_invert(rope_apply(x, p), p) == x.

    Each row uses its own position; this is not a block rotation by -p_0.
    """
    x = _array(x, "x", min_ndim=1)
    _head_dim(x.shape[-1], "x.shape[-1]")
    w = _inv_freqs(inv_freqs, x.shape[-1])
    return _rotate(x, -_angles(x, positions, w), traditional)


# --------------------------------------------------------------------------- EQ-10 .. EQ-12

def query_moment(queries: Any, *, n_kv_heads: int, b: int, inv_freqs: Any, traditional: bool,
                 ridge: float = 1e-6) -> np.ndarray:
    """EQ-10. H[g] = mean over the G query heads of group g and all N tokens of q̃ᵀq̃, q̃ = q R_b;
    then H / sqrt(mean(H**2)); then + ridge·I.

    queries (n_q, N, d) pre-RoPE -> (n_kv, d, d).
    """
    q = _array(queries, "queries")
    if q.ndim != 3:
        raise ValueError(f"queries: expected shape (n_q, N, d), got {q.shape}")
    n_q, N, d = q.shape
    _head_dim(d, "queries.shape[-1]")
    if N < 1:
        raise ValueError("queries: need at least one token (N >= 1)")
    n_kv = _int(n_kv_heads, "n_kv_heads", lo=1)
    G = _groups(n_q, n_kv, "queries")
    b = _int(b, "b", lo=0)
    ridge = _real(ridge, "ridge")
    if ridge < 0:
        raise ValueError(f"ridge: expected >= 0, got {ridge}")
    qb = rope_apply(q, b, inv_freqs, traditional=traditional)
    out = np.empty((n_kv, d, d))
    for g in range(n_kv):
        Q = qb[g * G:(g + 1) * G].reshape(-1, d)
        H = Q.T @ Q / Q.shape[0]
        rms = math.sqrt(float(np.mean(H ** 2)))
        if rms == 0.0:
            raise ValueError(f"queries: all queries of KV group {g} are zero; H cannot be normalised")
        out[g] = H / rms + ridge * np.eye(d)
    return out


def _positions(p: Any, n: int, name: str) -> np.ndarray:
    if p is None:
        return np.arange(n, dtype=np.float64)
    a = _array(p, name)
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
    return a


def wrope_scores(q: Any, k: Any, *, w: int, b: int, inv_freqs: Any, traditional: bool,
                 q_positions: Any = None, k_positions: Any = None) -> np.ndarray:
    """EQ-11. u_ij = q_i R_{i-j} k_jᵀ if i - j < w (near), else q_i R_b k_jᵀ (far). No causal mask.

    q (..., Tq, d), k (..., Tk, d) pre-RoPE, leading dims broadcast -> (..., Tq, Tk).
    Positions default to arange(Tq) and arange(Tk).
    """
    q = _array(q, "q", min_ndim=2)
    k = _array(k, "k", min_ndim=2)
    d = q.shape[-1]
    _head_dim(d, "q.shape[-1]")
    if k.shape[-1] != d:
        raise ValueError(f"k: last dim {k.shape[-1]} != q's head dim {d}")
    try:
        np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except ValueError:
        raise ValueError(f"q, k: leading dims {q.shape[:-2]} and {k.shape[:-2]} do not broadcast") from None
    om = _inv_freqs(inv_freqs, d)
    w = _int(w, "w", lo=0)
    b = _int(b, "b", lo=0)
    Tq, Tk = q.shape[-2], k.shape[-2]
    pq = _positions(q_positions, Tq, "q_positions")
    pk = _positions(k_positions, Tk, "k_positions")
    # near: q_i R_{i-j} k_jᵀ = (q_i R_i)(k_j R_j)ᵀ because R_i R_jᵀ = R_{i-j} (checked in tests/oracle/test_oracle.py)
    near = rope_apply(q, pq, om, traditional=traditional) @ np.swapaxes(
        rope_apply(k, pk, om, traditional=traditional), -1, -2)
    # far: (q_i R_b) k_jᵀ, the key side carries no position
    far = rope_apply(q, b, om, traditional=traditional) @ np.swapaxes(k, -1, -2)
    is_near = (pq[:, None] - pk[None, :]) < w
    return np.where(is_near, near, far)


def far_keys(k_post: Any, positions: Any, inv_freqs: Any, *, traditional: bool) -> np.ndarray:
    """EQ-12. Far-side key = pre-RoPE key: de-rotate each cached post-RoPE key at its own position."""
    return rope_invert(k_post, positions, inv_freqs, traditional=traditional)


def far_query(q: Any, *, b: int, inv_freqs: Any, traditional: bool, positions: Any = None) -> np.ndarray:
    """EQ-12. Query side of a far score: q R_b.

    positions None: q is pre-RoPE, returns q R_b. Otherwise q is post-RoPE at ``positions`` (broadcasting
    against q.shape[:-1]) and the result is q R_{b - p} (= q_pre R_b).
    """
    b = _int(b, "b", lo=0)
    q = _array(q, "q", min_ndim=1)
    if positions is None:
        return rope_apply(q, b, inv_freqs, traditional=traditional)
    p = _array(positions, "positions")
    return rope_apply(q, b - p, inv_freqs, traditional=traditional)


# --------------------------------------------------------------------------- EQ-13 .. EQ-16, EQ-18

def score_error(k: Any, c: Any, H: Any) -> np.ndarray:
    """EQ-13. (k - c) H (k - c)ᵀ, which equals E_q[(q kᵀ - q cᵀ)²] when H = E[qᵀq]. -> (...)"""
    k = _array(k, "k", min_ndim=1)
    c = _array(c, "c", min_ndim=1)
    H = _array(H, "H")
    d = k.shape[-1]
    if c.shape[-1] != d or H.shape != (d, d):
        raise ValueError(f"k, c, H: expected k (..., d), c (..., d), H (d, d) with d={d}; "
                         f"got c {c.shape}, H {H.shape}")
    _symmetric(H, "H")
    e = k - c
    return np.einsum("...i,ij,...j->...", e, H, e)


def _assign_shapes(k: np.ndarray, C: np.ndarray, M: np.ndarray, Cname: str, Mname: str) -> int:
    d = k.shape[-1]
    _codebook(C, Cname, d)
    if M.shape != (d, d):
        raise ValueError(f"{Mname}: expected shape ({d}, {d}) to match head dim {d}, got {M.shape}")
    return d


def assign_distances(k: Any, C: Any, H: Any) -> np.ndarray:
    """EQ-14. All distances (k - c_j) H (k - c_j)ᵀ, k (..., d), C (K, d), H (d, d) -> (..., K)."""
    k = _array(k, "k", min_ndim=1)
    C = _array(C, "C")
    H = _array(H, "H")
    _assign_shapes(k, C, H, "C", "H")
    _symmetric(H, "H")
    # (k - c) H (k - c)ᵀ = kHkᵀ - 2 kHcᵀ + cHcᵀ for symmetric H: the same quadratic form, evaluated with
    # two matmuls so that K = 4096 codewords against thousands of keys stays usable (tests check it per pair).
    kH = k @ H
    kHk = np.sum(kH * k, axis=-1)[..., None]
    cHc = np.sum((C @ H) * C, axis=-1)
    return kHk - 2.0 * (kH @ C.T) + cHc


def assign(k: Any, C: Any, H: Any) -> np.ndarray:
    """EQ-14. codes = argmin_j (k - c_j) H (k - c_j)ᵀ (key space, brute force), ties -> lowest j. int64 (...)."""
    return np.argmin(assign_distances(k, C, H), axis=-1).astype(np.int64)


def cholesky(H: Any) -> np.ndarray:
    """EQ-15. H = L Lᵀ with L lower triangular, positive diagonal; batched over leading dims.

    H must be symmetric positive definite.
    """
    H = _array(H, "H", min_ndim=2)
    _symmetric(H, "H")
    flat = H.reshape((-1,) + H.shape[-2:])
    out = np.empty_like(flat)
    for n, Hn in enumerate(flat):
        try:
            out[n] = scipy.linalg.cholesky((Hn + Hn.T) / 2, lower=True)
        except np.linalg.LinAlgError:
            raise ValueError(f"H: must be symmetric positive definite (matrix {n} of the batch is not); "
                             "add a ridge, e.g. H + 1e-6*I") from None
    return out.reshape(H.shape)


def z_transform(k: Any, L: Any) -> np.ndarray:
    """EQ-16. z = k L (row vectors). k (..., d); L (d, d) or (..., d, d) with matmul broadcasting."""
    k = _array(k, "k", min_ndim=1)
    L = _array(L, "L", min_ndim=2)
    _lower(L, "L", k.shape[-1])
    return k @ L


def assign_z_distances(k: Any, Cz: Any, L: Any) -> np.ndarray:
    """EQ-16. ‖k L - Cz_j‖² for all j. k (..., d), Cz (K, d), L (d, d) -> (..., K)."""
    k = _array(k, "k", min_ndim=1)
    Cz = _array(Cz, "Cz")
    L = _array(L, "L")
    _assign_shapes(k, Cz, L, "Cz", "L")
    z = z_transform(k, L)
    dist = np.empty(k.shape[:-1] + (Cz.shape[0],))
    for j in range(Cz.shape[0]):
        dist[..., j] = np.sum((z - Cz[j]) ** 2, axis=-1)
    return dist


def assign_z(k: Any, Cz: Any, L: Any) -> np.ndarray:
    """EQ-16. Runtime assignment: nearest z-space codeword to k L, ties -> lowest j. int64 (...).

    The result is argmin(assign_z_distances(k, Cz, L)), to the bit: the distances of the codewords that can be
    nearest are the same direct differences, and the others are ruled out first by a bound (_nearest_rows)."""
    k = _array(k, "k", min_ndim=1)
    Cz = _array(Cz, "Cz")
    L = _array(L, "L")
    d = _assign_shapes(k, Cz, L, "Cz", "L")
    z = z_transform(k, L).reshape(-1, d)
    if not np.all(np.isfinite(z)):   # k L overflowed: the bound below would be meaningless
        return np.argmin(assign_z_distances(k, Cz, L), axis=-1).astype(np.int64)
    rows = max(1, _PRUNE_BLOCK // max(1, Cz.shape[0]))
    out = np.empty(z.shape[0], np.int64)
    for s in range(0, z.shape[0], rows):
        out[s:s + rows] = _nearest_rows(z[s:s + rows], Cz)
    return out.reshape(k.shape[:-1])


#: most entries of one block of the (rows, K) distance estimate: small enough to stay in cache between passes
_PRUNE_BLOCK = 1 << 16


def _nearest_rows(z: np.ndarray, Cz: np.ndarray) -> np.ndarray:
    """argmin_j ‖z_i - Cz_j‖² per row (ties -> lowest j), computed as assign_z_distances does, for fewer j.

    Row i's distances, less the constant ‖z_i‖², are estimated with one matmul: e_ij = ‖Cz_j‖² - 2 z_i·Cz_j.
    Against the true t_ij - ‖z_i‖², e_ij errs by at most (d + 2) u (‖z_i‖ + ‖Cz_j‖)², and the direct-difference
    sum D_ij errs from t_ij by at most (d + 3) u (‖z_i‖ + ‖Cz_j‖)² (u = 2^-53; Higham, Accuracy and Stability of
    Numerical Algorithms, 2nd ed., 3.1). Take B_i, four times their sum at the largest ‖Cz_j‖. A j with
    e_ij > min_j e_ij + 2 B_i then has D_ij > D_ij* for the j* attaining the minimum, so it is neither the
    nearest nor tied with it. D is evaluated for the other j only, by the same NumPy reduction over rows of d
    elements as assign_z_distances: equal bits, since each row is reduced alone. Subnormal results add an absolute
    error (the 2^-1074 term); where the estimate overflows, no j is ruled out."""
    d = z.shape[-1]
    with np.errstate(over="ignore", invalid="ignore"):   # an overflowed estimate rules nothing out (below)
        cc = np.einsum("kd,kd->k", Cz, Cz)
        est = z @ Cz.T
        est *= -2.0
        est += cc
        # 2^-1074 per operation: the absolute error of a subnormal result, which the relative bound u misses
        slack = 8 * (2 * d + 5) * (2.0 ** -53 * (np.sqrt(np.einsum("nd,nd->n", z, z)) + np.sqrt(cc.max())) ** 2
                                   + 2.0 ** -1074)
    if np.all(np.isfinite(est)) and np.all(np.isfinite(slack)):
        keep = est <= (np.min(est, axis=1) + slack)[:, None]
    else:                                            # overflow: every j stays
        keep = np.ones(est.shape, dtype=bool)
    i, j = np.nonzero(keep)                          # row-major: j ascending within each row
    dist = np.sum((z[i] - Cz[j]) ** 2, axis=-1)
    order = np.lexsort((j, dist, i))                 # by row, then distance, then lowest j
    first = np.unique(i[order], return_index=True)[1]
    return j[order][first]


def back_transform(Cz: Any, L: Any) -> np.ndarray:
    """EQ-18. Key-space codebook C = Cz L⁻¹, by solving C L = Cz (triangular solve, no explicit inverse).

    Cz (..., K, d), L (d, d) or (..., d, d) with matching leading dims.
    """
    Cz = _array(Cz, "Cz", min_ndim=2)
    L = _array(L, "L", min_ndim=2)
    d = Cz.shape[-1]
    _lower(L, "L", d)
    try:
        lead = np.broadcast_shapes(Cz.shape[:-2], L.shape[:-2])
    except ValueError:
        raise ValueError(f"Cz, L: leading dims {Cz.shape[:-2]} and {L.shape[:-2]} do not broadcast") from None
    Czb = np.broadcast_to(Cz, lead + Cz.shape[-2:]).reshape((-1,) + Cz.shape[-2:])
    Lb = np.broadcast_to(L, lead + (d, d)).reshape((-1, d, d))
    out = np.empty_like(Czb)
    for n in range(Czb.shape[0]):
        # C L = Cz  <=>  Lᵀ Cᵀ = Czᵀ, and Lᵀ is upper triangular
        out[n] = scipy.linalg.solve_triangular(Lb[n].T, Czb[n].T, lower=False).T
    return out.reshape(lead + Cz.shape[-2:])


# --------------------------------------------------------------------------- EQ-17

def _nearest(z: np.ndarray, C: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dist = np.empty((z.shape[0], C.shape[0]))
    for j in range(C.shape[0]):
        dist[:, j] = np.sum((z - C[j]) ** 2, axis=-1)
    codes = np.argmin(dist, axis=-1)
    return codes, dist[np.arange(z.shape[0]), codes]


def _points(z: Any, name: str = "z") -> np.ndarray:
    z = _array(z, name)
    if z.ndim != 2 or z.shape[0] < 1 or z.shape[1] < 1:
        raise ValueError(f"{name}: expected shape (N, d) with N, d >= 1, got {z.shape}")
    return z


def kmeanspp_init(z: Any, K: int, uniforms: Any) -> np.ndarray:
    """EQ-17-INIT. k-means++ seeding driven by explicit uniforms u (K,) in [0, 1).

    Centre 0 is z[floor(u_0 N)]. Centre t is z[n] for the smallest n with cumsum(D²)[n] > u_t · sum(D²),
    where D²[n] is the squared distance from z[n] to its nearest already-chosen centre.
    """
    z = _points(z)
    N = z.shape[0]
    K = _int(K, "K", lo=1)
    u = _array(uniforms, "uniforms")
    if u.shape != (K,):
        raise ValueError(f"uniforms: expected shape ({K},) (one uniform per centre), got {u.shape}")
    if np.any(u < 0) or np.any(u >= 1):
        raise ValueError("uniforms: every value must lie in [0, 1)")
    if N < K:
        raise ValueError(f"z: need at least K={K} points, got N={N}")
    n_distinct = np.unique(z, axis=0).shape[0]
    if n_distinct < K:
        raise ValueError(f"z: need at least K={K} distinct points for k-means++, got {n_distinct}")
    chosen = [int(math.floor(u[0] * N))]
    D2 = np.sum((z - z[chosen[0]]) ** 2, axis=-1)
    for t in range(1, K):
        cum = np.cumsum(D2)
        n = int(np.argmax(cum > u[t] * cum[-1]))  # first index where the cumulative weight exceeds the draw
        chosen.append(n)
        D2 = np.minimum(D2, np.sum((z - z[n]) ** 2, axis=-1))
    return z[chosen].copy()


def lloyd_step(z: Any, C: Any) -> tuple[np.ndarray, np.ndarray, float]:
    """EQ-17-STEP. One Lloyd step with the explicit empty-cluster rule.

    Returns (C_new, codes, objective): codes = nearest row of the INPUT C (ties -> lowest index) and
    objective = sum ‖z - C[codes]‖² under the input C. Each empty cluster (in increasing index order) takes
    the not-yet-moved point with the largest current error among clusters that still have >= 2 members
    (ties -> lowest point index); then every centre is the mean of its members.
    """
    z = _points(z)
    C = _array(C, "C")
    if C.ndim != 2 or C.shape[1] != z.shape[1] or C.shape[0] < 1:
        raise ValueError(f"C: expected shape (K, {z.shape[1]}) matching z's width, got {C.shape}")
    N, K = z.shape[0], C.shape[0]
    if N < K:
        raise ValueError(f"z: need at least K={K} points, got N={N}")
    codes, err = _nearest(z, C)
    objective = float(np.sum(err))
    members = codes.copy()
    counts = np.bincount(members, minlength=K)
    taken = np.zeros(N, dtype=bool)
    for e in range(K):
        if counts[e] > 0:
            continue
        eligible = (~taken) & (counts[members] >= 2)
        cand = np.flatnonzero(eligible)
        n = int(cand[np.argmax(err[cand])])  # argmax returns the first (lowest index) maximum
        counts[members[n]] -= 1
        members[n] = e
        counts[e] = 1
        taken[n] = True
    C_new = np.empty_like(C)
    for j in range(K):
        C_new[j] = z[members == j].mean(axis=0)
    return C_new, codes.astype(np.int64), objective


def kmeans(z: Any, K: int, *, seed: int, max_iter: int = 300, tol: float = 1e-4
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EQ-17-FIT. uniforms = numpy.random.default_rng(seed).random(K); kmeanspp_init; Lloyd steps.

    Step s records f_s (objective under its input centres). Stop after step s when s == max_iter, or f_s == 0,
    or s >= 2 and f_{s-1} - f_s < tol · f_{s-1}. Returns (C, codes, history): C = the last step's output,
    codes = nearest row of C (ties -> lowest), history = array of f_1..f_s.
    """
    z = _points(z)
    K = _int(K, "K", lo=1)
    seed = _int(seed, "seed", lo=0)
    max_iter = _int(max_iter, "max_iter", lo=1)
    tol = _real(tol, "tol")
    if tol < 0:
        raise ValueError(f"tol: expected >= 0, got {tol}")
    uniforms = np.random.default_rng(seed).random(K)
    C = kmeanspp_init(z, K, uniforms)
    history: list[float] = []
    for s in range(1, max_iter + 1):
        C, _, f = lloyd_step(z, C)
        history.append(f)
        if f == 0.0:
            break
        if s >= 2 and history[-2] - f < tol * history[-2]:
            break
    codes, _ = _nearest(z, C)
    return C, codes.astype(np.int64), np.asarray(history)


# --------------------------------------------------------------------------- RET-*

def lut_scores(q_b: Any, C: Any, *, scale: float | None = None) -> np.ndarray:
    """RET-LUT. LUT[..., h, k] = scale · (q_b[..., h] · C[h // G, k]); scale defaults to 1/sqrt(d).

    q_b (..., n_q, d) (already rotated by R_b), C (n_kv, K, d) key-space codebooks -> (..., n_q, K).
    """
    q = _array(q_b, "q_b", min_ndim=2)
    C = _array(C, "C")
    n_q, d = q.shape[-2:]
    _codebook(C, "C", d, ndim=3)
    G = _groups(n_q, C.shape[0], "q_b")
    s = _scale(scale, d)
    out = np.empty(q.shape[:-1] + (C.shape[1],))
    for h in range(n_q):
        out[..., h, :] = s * (q[..., h, :] @ C[h // G].T)
    return out


def token_scores(lut: Any, codes: Any) -> np.ndarray:
    """RET-LUT. s[..., h, t] = lut[..., h, codes[..., h // G, t]]. (..., n_q, K), (..., n_kv, T) -> (..., n_q, T)."""
    lut = _array(lut, "lut", min_ndim=2)
    c = np.asarray(codes)
    if c.ndim < 2 or not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"codes: expected an integer array (..., n_kv, T), got dtype {c.dtype}, shape {c.shape}")
    n_q, K = lut.shape[-2:]
    n_kv, T = c.shape[-2:]
    G = _groups(n_q, n_kv, "lut")
    if c.size and (c.min() < 0 or c.max() >= K):
        raise ValueError(f"codes: values must lie in [0, K={K}), got range [{c.min()}, {c.max()}]")
    try:
        lead = np.broadcast_shapes(lut.shape[:-2], c.shape[:-2])
    except ValueError:
        raise ValueError(f"lut, codes: leading dims {lut.shape[:-2]} and {c.shape[:-2]} do not broadcast") from None
    lut = np.broadcast_to(lut, lead + (n_q, K))
    c = np.broadcast_to(c, lead + (n_kv, T))
    out = np.empty(lead + (n_q, T))
    for h in range(n_q):
        out[..., h, :] = np.take_along_axis(lut[..., h, :], c[..., h // G, :], axis=-1)
    return out


def topk_count(T: int, topk: float | int, n_candidates: int | None = None) -> int:
    """RET-TOPK. float topk in (0, 1] -> int(topk · T) (floor); int topk >= 1 -> topk; then min(., n_candidates)."""
    T = _int(T, "T", lo=1)
    if isinstance(topk, bool):
        raise ValueError(f"topk: expected a float in (0, 1] or an int >= 1, got {topk!r}")
    if isinstance(topk, numbers.Integral):
        if topk < 1:
            raise ValueError(f"topk: an int topk must be >= 1, got {topk}")
        count = int(topk)
    elif isinstance(topk, numbers.Real):
        f = float(topk)
        if not (0.0 < f <= 1.0):
            raise ValueError(f"topk: a float topk is a fraction of the sequence and must lie in (0, 1], got {f}")
        count = int(f * T)
    else:
        raise ValueError(f"topk: expected a float in (0, 1] or an int >= 1, got {topk!r}")
    if n_candidates is not None:
        count = min(count, _int(n_candidates, "n_candidates", lo=0))
    return count


def _selection_regions(T: int, query_pos: Any, w: Any, sinks: Any) -> tuple[int, np.ndarray, np.ndarray]:
    i = _int(query_pos, "query_pos", lo=0)
    if i > T - 1:
        raise ValueError(f"query_pos: must be <= T-1 = {T - 1} (the query's own key is cached), got {i}")
    w = _int(w, "w", lo=0)
    sinks = _int(sinks, "sinks", lo=0)
    j = np.arange(T)
    causal = j <= i
    forced = causal & ((j < sinks) | (i - j < w))   # sinks and local window (0 <= i-j < w)
    candidates = causal & ~forced
    return i, forced, candidates


def _never_empty(forced: np.ndarray, count: int, i: int) -> np.ndarray:
    """RET-SELECT: when neither sinks, window nor top-k select anything, the query's own token i is selected."""
    if count == 0 and not forced.any():
        forced = forced.copy()
        forced[i] = True
    return forced


def _check_scores(scores: Any, n_kv_heads: int) -> tuple[np.ndarray, int, int]:
    s = _array(scores, "scores", min_ndim=2)
    n_kv = _int(n_kv_heads, "n_kv_heads", lo=1)
    G = _groups(s.shape[-2], n_kv, "scores")
    if s.shape[-1] < 1:
        raise ValueError("scores: need T >= 1 tokens")
    return s, n_kv, G


def select_tokens(scores: Any, *, n_kv_heads: int, query_pos: int, w: int, sinks: int,
                  topk: float | int) -> np.ndarray:
    """RET-SELECT. Selected-token mask (..., n_kv, T) for a query at position query_pos.

    Sinks j < sinks and the window 0 <= i - j < w are always kept; the other j <= i are candidates. Each query
    head keeps its topk_count(i + 1, topk, #candidates) highest candidate scores (ties -> lowest index); the
    union over each GQA group is taken; then sinks and window are added back. A selection that would be
    empty (w = 0, sinks = 0, count 0) holds the query's own token i instead.
    """
    s, n_kv, G = _check_scores(scores, n_kv_heads)
    T = s.shape[-1]
    i, forced, cand = _selection_regions(T, query_pos, w, sinks)
    count = topk_count(i + 1, topk, int(cand.sum()))  # tokens the query can see, the authors' seq_len
    forced = _never_empty(forced, count, i)
    cand_idx = np.flatnonzero(cand)
    flat = s.reshape((-1,) + s.shape[-2:])
    mask = np.zeros((flat.shape[0], n_kv, T), dtype=bool)
    for n in range(flat.shape[0]):
        for h in range(flat.shape[1]):
            mask[n, h // G, cand_idx[highest(flat[n, h, cand_idx], count)]] = True
    mask |= forced
    return mask.reshape(s.shape[:-2] + (n_kv, T))


def highest(x: np.ndarray, k: int) -> np.ndarray:
    """RET-SELECT's ranking. Indices (ascending) of the k highest entries of the 1-D ``x``, ties -> lowest index:
    the first k of a stable descending argsort, found with one partition instead of a sort."""
    n = x.size
    if k >= n:
        return np.arange(n)
    if k <= 0:
        return np.empty(0, dtype=np.intp)
    if np.isnan(x).any():   # NaN has no place in a partition's order; the sort puts it last
        return np.sort(np.argsort(-x, kind="stable")[:k])
    kth = np.partition(x, n - k)[n - k]
    above = np.flatnonzero(x > kth)            # fewer than k: kth is the k-th highest
    return np.union1d(above, np.flatnonzero(x == kth)[:k - above.size])


def topk_allowed(scores: Any, k: int, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """RET-TOPK. Allowed results of a top-k over the last axis under near ties.

    With s_(k) the k-th largest and s_(k+1) the (k+1)-th largest score: must = s > s_(k+1) + margin (in every
    valid top-k), may = s >= s_(k) - margin (in some valid top-k). A selection S of k entries is accepted when
    must ⊆ S ⊆ may. k >= n: everything is must; k == 0: nothing may be chosen.
    """
    s = _array(scores, "scores", min_ndim=1)
    k = _int(k, "k", lo=0)
    margin = _real(margin, "margin")
    if margin < 0:
        raise ValueError(f"margin: expected >= 0, got {margin}")
    n = s.shape[-1]
    if k >= n:
        full = np.ones(s.shape, dtype=bool)
        return full, full.copy()
    if k == 0:
        empty = np.zeros(s.shape, dtype=bool)
        return empty, empty.copy()
    part = np.partition(s, (n - k - 1, n - k), axis=-1)   # the (k+1)-th and k-th highest, in place of a sort
    kth = part[..., n - k:n - k + 1]
    next_ = part[..., n - k - 1:n - k]
    return s > next_ + margin, s >= kth - margin


def select_tokens_allowed(scores: Any, *, n_kv_heads: int, query_pos: int, w: int, sinks: int,
                          topk: float | int, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """RET-SELECT. (must, may) masks (..., n_kv, T) for select_tokens under near ties (see topk_allowed).

    A port's mask M is accepted when must ⊆ M ⊆ may (necessary condition; the suite also checks the count).
    """
    s, n_kv, G = _check_scores(scores, n_kv_heads)
    T = s.shape[-1]
    i, forced, cand = _selection_regions(T, query_pos, w, sinks)
    count = topk_count(i + 1, topk, int(cand.sum()))  # tokens the query can see, the authors' seq_len
    forced = _never_empty(forced, count, i)
    cand_idx = np.flatnonzero(cand)
    must_h, may_h = topk_allowed(s[..., cand_idx], count, margin)
    lead = s.shape[:-2]
    must = np.zeros(lead + (n_kv, T), dtype=bool)
    may = np.zeros(lead + (n_kv, T), dtype=bool)
    for h in range(s.shape[-2]):
        must[..., h // G, cand_idx] |= must_h[..., h, :]
        may[..., h // G, cand_idx] |= may_h[..., h, :]
    return must | forced, may | forced


def select_tokens_head_counts(mask: Any, scores: Any, *, n_kv_heads: int, query_pos: int, w: int, sinks: int,
                              topk: float | int, margin: float) -> tuple[np.ndarray, np.ndarray, int]:
    """RET-SELECT. Per-head count: (held (..., n_q), taken (..., n_kv), k) for a selection mask (..., n_kv, T).

    k is the number of candidates each query head's top-k takes (RET-TOPK); held[h] counts the mask's
    candidates (on head h's KV row) that lie in head h's allowed top-k set (topk_allowed's ``may``: ties and
    near ties resolved by the allowed set); taken[g] counts the mask's candidates on KV row g. A selection
    made of each head's own k tokens has held >= k for every head (select_tokens also taken <= G k; a decode
    step may take a tie at the k-th score whole). A top-k that takes one tied token too few has held = k - 1.
    """
    s, n_kv, G = _check_scores(scores, n_kv_heads)
    T = s.shape[-1]
    m = np.asarray(mask)
    if m.dtype != np.bool_ or m.shape != s.shape[:-2] + (n_kv, T):
        raise ValueError(f"mask: expected a bool array of shape {s.shape[:-2] + (n_kv, T)}, got {m.dtype} {m.shape}")
    i, forced, cand = _selection_regions(T, query_pos, w, sinks)
    count = topk_count(i + 1, topk, int(cand.sum()))
    cand_idx = np.flatnonzero(cand & ~_never_empty(forced, count, i))   # the own token of the never-empty rule
    _, may_h = topk_allowed(s[..., cand_idx], count, margin)
    on_row = np.repeat(m[..., cand_idx], G, axis=-2)   # query head h reads KV row h // G
    return (on_row & may_h).sum(axis=-1), m[..., cand_idx].sum(axis=-1), count


def argmin_allowed(dist: Any, margin: float) -> np.ndarray:
    """EQ-14. Allowed argmin set over the last axis under near ties: dist <= min(dist) + margin."""
    dist = _array(dist, "dist", min_ndim=1)
    margin = _real(margin, "margin")
    if margin < 0:
        raise ValueError(f"margin: expected >= 0, got {margin}")
    if dist.shape[-1] < 1:
        raise ValueError("dist: last axis is empty")
    return dist <= np.min(dist, axis=-1, keepdims=True) + margin


def _softmax_rows(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    x = np.where(keep, logits, -np.inf)
    x = x - np.max(x, axis=-1, keepdims=True)
    p = np.exp(x)
    return p / np.sum(p, axis=-1, keepdims=True)


def retrieval_attention(q: Any, k: Any, v: Any, mask: Any, *, scale: float | None = None) -> np.ndarray:
    """RET-ATTN. Exact softmax attention of each query head over the selected keys/values of its KV head.

    q (..., n_q, d) post-RoPE, k (..., n_kv, T, d) post-RoPE, v (..., n_kv, T, dv), mask (..., n_kv, T) bool
    -> (..., n_q, dv). Scale defaults to 1/sqrt(d). Every KV head must select at least one token.
    """
    q = _array(q, "q", min_ndim=2)
    k = _array(k, "k", min_ndim=3)
    v = _array(v, "v", min_ndim=3)
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise ValueError(f"mask: expected a bool array, got dtype {m.dtype}")
    n_q, d = q.shape[-2:]
    n_kv, T = k.shape[-3:-1]
    if k.shape[-1] != d:
        raise ValueError(f"k: last dim {k.shape[-1]} != q's head dim {d}")
    if v.shape[-3:-1] != (n_kv, T):
        raise ValueError(f"v: expected (..., {n_kv}, {T}, dv) to match k {k.shape}, got {v.shape}")
    if m.shape[-2:] != (n_kv, T):
        raise ValueError(f"mask: expected (..., {n_kv}, {T}) to match k {k.shape}, got {m.shape}")
    G = _groups(n_q, n_kv, "q")
    if not np.all(np.any(m, axis=-1)):
        raise ValueError("mask: every KV head must select at least one token")
    s = _scale(scale, d)
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-3], v.shape[:-3], m.shape[:-2])
    except ValueError:
        raise ValueError(f"q, k, v, mask: leading dims {q.shape[:-2]}, {k.shape[:-3]}, {v.shape[:-3]}, "
                         f"{m.shape[:-2]} do not broadcast") from None
    out = np.empty(lead + (n_q, v.shape[-1]))
    for h in range(n_q):
        g = h // G
        logits = s * np.einsum("...d,...td->...t", q[..., h, :], k[..., g, :, :])
        p = _softmax_rows(logits, m[..., g, :])
        out[..., h, :] = np.einsum("...t,...tv->...v", p, v[..., g, :, :])
    return out


def decode_step(q_post: Any, k_post: Any, v: Any, codes: Any, C: Any, *, query_pos: int, b: int, w: int,
                sinks: int, topk: float | int, inv_freqs: Any, traditional: bool, scale: float | None = None,
                return_mask: bool = False):
    """RET-DECODE. One decode step: q_b = far_query(q_post, positions=query_pos); LUT; token scores;
    select_tokens; exact retrieval_attention with true positions.

    q_post (..., n_q, d), k_post (..., n_kv, T, d), v (..., n_kv, T, dv), codes (..., n_kv, T),
    C (n_kv, K, d) key-space codebooks. Returns (..., n_q, dv), or (out, mask) when return_mask.
    """
    q_post = _array(q_post, "q_post", min_ndim=2)
    k_post = _array(k_post, "k_post", min_ndim=3)
    n_kv = k_post.shape[-3]
    c = np.asarray(codes)
    if c.shape[-1:] != k_post.shape[-2:-1]:
        raise ValueError(f"codes: expected (..., n_kv, T) with T={k_post.shape[-2]}, got {c.shape}")
    q_b = far_query(q_post, b=b, inv_freqs=inv_freqs, traditional=traditional, positions=query_pos)
    lut = lut_scores(q_b, C, scale=scale)
    scores = token_scores(lut, c)
    mask = select_tokens(scores, n_kv_heads=n_kv, query_pos=query_pos, w=w, sinks=sinks, topk=topk)
    out = retrieval_attention(q_post, k_post, v, mask, scale=scale)
    return (out, mask) if return_mask else out


# --------------------------------------------------------------------------- PREFILL, CODES-DTYPE

def prefill_attention(q: Any, k: Any, v: Any, *, scale: float | None = None) -> np.ndarray:
    """PREFILL. Dense causal attention, keys end-aligned with queries (query t sits at Tk - Tq + t).

    q (..., n_q, Tq, d), k (..., n_kv, Tk, d), v (..., n_kv, Tk, dv), Tk >= Tq -> (..., n_q, Tq, dv).
    """
    q = _array(q, "q", min_ndim=3)
    k = _array(k, "k", min_ndim=3)
    v = _array(v, "v", min_ndim=3)
    n_q, Tq, d = q.shape[-3:]
    n_kv, Tk = k.shape[-3:-1]
    if k.shape[-1] != d:
        raise ValueError(f"k: last dim {k.shape[-1]} != q's head dim {d}")
    if v.shape[-3:-1] != (n_kv, Tk):
        raise ValueError(f"v: expected (..., {n_kv}, {Tk}, dv) to match k {k.shape}, got {v.shape}")
    if Tq < 1 or Tk < Tq:
        raise ValueError(f"q, k: need 1 <= Tq <= Tk (queries are the last Tq cached tokens), got Tq={Tq}, Tk={Tk}")
    G = _groups(n_q, n_kv, "q")
    s = _scale(scale, d)
    qpos = Tk - Tq + np.arange(Tq)
    causal = np.arange(Tk)[None, :] <= qpos[:, None]   # (Tq, Tk)
    lead = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    out = np.empty(lead + (n_q, Tq, v.shape[-1]))
    for h in range(n_q):
        g = h // G
        logits = s * np.einsum("...id,...jd->...ij", q[..., h, :, :], k[..., g, :, :])
        p = _softmax_rows(logits, causal)
        out[..., h, :, :] = np.einsum("...ij,...jv->...iv", p, v[..., g, :, :])
    return out


def collection_attention(q: Any, k: Any, v: Any, *, scale: float | None = None) -> np.ndarray:
    """PREFILL. Calibration's collection attention (the attention it runs between layers), mlx-lm's layout.

    q (B, n_q, Tq, d), k (B, n_kv, Tk, d), v (B, n_kv, Tk, dv), Tk >= Tq -> (B, n_q, Tq, dv): dense causal
    attention with the queries end-aligned to the keys (a later chunk's queries see every earlier chunk).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise ValueError(f"{name}: expected 4 axes (B, heads, T, d) as mlx-lm's attention passes, got shape "
                             f"{np.shape(x)}")
    return prefill_attention(q, k, v, scale=scale)


def code_dtype(K: int) -> np.dtype:
    """CODES-DTYPE. Smallest unsigned integer dtype holding codes 0..K-1: uint8 (K <= 256), uint16 (K <= 65536)."""
    K = _int(K, "K", lo=1)
    if K <= 256:
        return np.dtype(np.uint8)
    if K <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"K: codes are at most 16-bit, so K must be <= 65536, got {K}")


# --------------------------------------------------------------------------- CACHE-*
# CACHE-*: float64 model of the adapter cache protocol (conformance/README-ADAPTER.md), built only from
# the oracle's clause functions.
# 
# ``OracleCache(config)`` takes the same config dict as an adapter's ``make_cache`` and has the same members
# (``append``, ``decode``, ``prefill``, ``trim``, ``codes``, ``positions``, ``keys_values``, ``offset``,
# ``save``/``load``, ``copy``). Codes are EQ-12 de-rotation at each token's own position then EQ-16
# assignment (CACHE-FAR-CODES), decode is RET-DECODE at position ``offset - 1`` (CACHE-DECODE), prefill is
# PREFILL over everything cached (CACHE-CHUNK).
# 
# Batch (CACHE-BATCH): ``config["batch"] = B`` (an int >= 1) makes every array carry a leading batch axis
# (keys (B, n_kv, t, d), queries (B, n_q, d), codes (B, n_kv, T) ...); all rows share the positions. Without
# the key, arrays have no batch axis (a batch of one).
# 
# Checkers compare a port against allowed-result sets, never against this model's tie-broken choices:
# ``code_allowed(margin)`` is the allowed code set of every cached token, ``decode_allowed(q, codes, margin)``
# the (must, may) selection sets of a decode query given the codes the port actually holds, and
# ``attention(q, mask)`` the exact attention over a given mask.

#: tokens per block of code assignment: bounds the (tokens, K, d) temporaries of a long append
_BLOCK = 4096
_KEYS = ("n_kv_heads", "n_q_heads", "head_dim", "Cz", "L", "inv_freqs", "traditional", "w", "b", "sinks", "topk")


def _cache_margin(margin: float | Callable[[np.ndarray], float], values: np.ndarray) -> float:
    return float(margin(values)) if callable(margin) else float(margin)


class OracleCache:
    """CACHE-DECODE. One layer's A2ATS cache in float64, the model of every CACHE-* clause (module docstring)."""

    def __init__(self, config: dict):
        if not isinstance(config, dict):
            raise ValueError(f"config: expected a dict (README-ADAPTER.md, cache protocol), got {type(config).__name__}")
        missing = [k for k in _KEYS if k not in config]
        if missing:
            raise ValueError(f"config: missing key(s) {missing}; the cache protocol needs {list(_KEYS)}")
        self.config = dict(config)
        self.n_kv = _int(config["n_kv_heads"], "config['n_kv_heads']", lo=1)
        self.n_q = _int(config["n_q_heads"], "config['n_q_heads']", lo=1)
        _groups(self.n_q, self.n_kv, "config['n_q_heads']")
        self.d = _int(config["head_dim"], "config['head_dim']")
        _head_dim(self.d, "config['head_dim']")
        self.Cz = _array(config["Cz"], "config['Cz']")
        _codebook(self.Cz, "config['Cz']", self.d, ndim=3)
        if self.Cz.shape[0] != self.n_kv:
            raise ValueError(f"config['Cz']: expected {self.n_kv} KV heads, got shape {self.Cz.shape}")
        self.L = _array(config["L"], "config['L']")
        if self.L.shape != (self.n_kv, self.d, self.d):
            raise ValueError(f"config['L']: expected shape ({self.n_kv}, {self.d}, {self.d}), got {self.L.shape}")
        _lower(self.L, "config['L']", self.d)
        C = config.get("C")
        self.C = back_transform(self.Cz, self.L) if C is None else _array(C, "config['C']")
        if self.C.shape != self.Cz.shape:
            raise ValueError(f"config['C']: expected shape {self.Cz.shape} (= Cz L^-1), got {self.C.shape}")
        self.inv_freqs = _inv_freqs(config["inv_freqs"], self.d, "config['inv_freqs']")
        self.traditional = config["traditional"]
        _pairs(self.d, self.traditional)
        for k in ("w", "b", "sinks"):
            _int(config[k], f"config['{k}']", lo=0)
        topk_count(1, config["topk"])           # validates the topk form
        self.scale = config.get("scale")
        batch = config.get("batch")
        self.batched = batch is not None
        self.B = 1 if batch is None else _int(batch, "config['batch']", lo=1)
        self.K = self.Cz.shape[1]
        self._k = np.zeros((self.B, self.n_kv, 0, self.d))
        self._v = np.zeros((self.B, self.n_kv, 0, self.d))
        self._c = np.zeros((self.B, self.n_kv, 0), dtype=np.int64)

    # ------------------------------------------------------------------ shapes
    def _in(self, x: Any, name: str, tail: tuple) -> np.ndarray:
        """Caller array -> (B, *tail) float64; tail entries None are free."""
        a = _array(x, name)
        lead = (self.B,) if self.batched else ()
        want = lead + tail
        if a.ndim != len(want) or any(w is not None and w != s for w, s in zip(want, a.shape)):
            shown = "(" + ", ".join("·" if w is None else str(w) for w in want) + ")"
            hint = "" if self.batched else " (no batch axis: config has no 'batch')"
            raise ValueError(f"{name}: expected shape {shown}{hint}, got {a.shape}")
        return a if self.batched else a[None]

    def _out(self, x: np.ndarray) -> np.ndarray:
        return x if self.batched else x[0]

    def _assign(self, k_post: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """CACHE-FAR-CODES: EQ-12 de-rotation at each token's own position, then EQ-16, per KV head."""
        k_pre = far_keys(k_post, pos, self.inv_freqs, traditional=self.traditional)
        return np.stack([assign_z(k_pre[:, g], self.Cz[g], self.L[g]) for g in range(self.n_kv)], axis=1)

    # ------------------------------------------------------------------ protocol
    @property
    def offset(self) -> int:
        return self._k.shape[2]

    def append(self, keys_post: Any, values: Any) -> None:
        """Write t tokens at positions offset..offset+t-1; codes = assign_z(far_keys(k, p), Cz, L) per KV head."""
        k = self._in(keys_post, "keys_post", (self.n_kv, None, self.d))
        v = self._in(values, "values", (self.n_kv, k.shape[-2], None))
        if self.offset and v.shape[-1] != self._v.shape[-1]:
            raise ValueError(f"values: value dim {v.shape[-1]} differs from the cached {self._v.shape[-1]}")
        t = k.shape[-2]
        pos = np.arange(self.offset, self.offset + t)
        codes = np.concatenate([self._assign(k[:, :, a:a + _BLOCK], pos[a:a + _BLOCK])
                                for a in range(0, t, _BLOCK)] or [np.zeros((self.B, self.n_kv, 0), np.int64)], axis=2)
        if self.offset == 0:
            self._v = np.zeros(v.shape[:2] + (0, v.shape[-1]))
        self._k = np.concatenate([self._k, k], axis=2)
        self._v = np.concatenate([self._v, v], axis=2)
        self._c = np.concatenate([self._c, codes], axis=2)

    def decode(self, q_post: Any) -> tuple[np.ndarray, np.ndarray]:
        """RET-DECODE for one query (n_q, d) post-RoPE at position offset-1 -> (out (n_q, dv), mask (n_kv, offset))."""
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        self._need_tokens("decode")
        cfg = self.config
        out, mask = decode_step(q, self._k, self._v, self._c, self.C, query_pos=self.offset - 1, b=cfg["b"],
                                   w=cfg["w"], sinks=cfg["sinks"], topk=cfg["topk"], inv_freqs=self.inv_freqs,
                                   traditional=self.traditional, scale=self.scale, return_mask=True)
        return self._out(out), self._out(mask)

    def prefill(self, q_post: Any) -> np.ndarray:
        """PREFILL: queries (n_q, t, d) of the last t cached tokens, dense causal attention -> (n_q, t, dv)."""
        q = self._in(q_post, "q_post", (self.n_q, None, self.d))
        if not 1 <= q.shape[-2] <= self.offset:
            raise ValueError(f"q_post: expected 1..offset={self.offset} queries (the last cached tokens), got {q.shape[-2]}")
        return self._out(prefill_attention(q, self._k, self._v, scale=self.scale))

    def trim(self, n: Any) -> int:
        """Drop the last min(n, offset) tokens; returns how many."""
        n = min(_int(n, "n", lo=0), self.offset)
        keep = self.offset - n
        self._k, self._v, self._c = self._k[:, :, :keep], self._v[:, :, :keep], self._c[:, :, :keep]
        return n

    def codes(self) -> np.ndarray:
        return self._out(self._c.astype(code_dtype(self.K)))

    def positions(self) -> np.ndarray:
        return np.arange(self.offset, dtype=np.int64)

    def keys_values(self) -> tuple[np.ndarray, np.ndarray]:
        return self._out(self._k.copy()), self._out(self._v.copy())

    def copy(self) -> "OracleCache":
        c = OracleCache(self.config)
        c._k, c._v, c._c = self._k.copy(), self._v.copy(), self._c.copy()
        return c

    def save(self, path: str) -> None:
        """npz (no pickle): keys, values, codes and the config's scalar parameters (the codebook is not saved)."""
        meta = {k: self.config[k] for k in ("w", "b", "sinks", "topk", "traditional", "batch") if k in self.config}
        with open(_npz(path), "wb") as f:
            np.savez(f, keys=self._k, values=self._v, codes=self._c, meta=np.array(json.dumps(meta)))

    def load(self, path: str) -> "OracleCache":
        """A new cache with this cache's codebook and the saved state; ValueError if the parameters differ."""
        with np.load(_npz(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            ours = {k: self.config[k] for k in meta}
            if meta != json.loads(json.dumps(ours)):
                raise ValueError(f"path: saved with parameters {meta}, this cache has {ours}; load it with a matching cache")
            c = OracleCache(self.config)
            c._k, c._v, c._c = z["keys"], z["values"], z["codes"].astype(np.int64)
        if c._k.shape[:2] != (self.B, self.n_kv) or c._c.shape != c._k.shape[:3]:
            raise ValueError(f"path: saved keys {c._k.shape} / codes {c._c.shape} do not fit this cache "
                             f"(batch {self.B}, n_kv {self.n_kv})")
        return c

    # ------------------------------------------------------------------ checkers
    def _need_tokens(self, what: str) -> None:
        if self.offset == 0:
            raise ValueError(f"{what}: the cache is empty; append the query's own key/value first")

    def code_distances(self, tokens: Any = None) -> np.ndarray:
        """EQ-16 distances ‖k_pre L - Cz_j‖² of the cached tokens: (n_kv, n, K) (batch axis first if batched).

        tokens: indices or a slice of the cached tokens (default all of them).
        """
        idx = np.arange(self.offset)[slice(None) if tokens is None else tokens]
        k_pre = far_keys(self._k[:, :, idx], idx, self.inv_freqs, traditional=self.traditional)
        dist = np.stack([assign_z_distances(k_pre[:, g], self.Cz[g], self.L[g]) for g in range(self.n_kv)], axis=1)
        return self._out(dist)

    def code_allowed(self, margin: float | Callable[[np.ndarray], float], tokens: Any = None) -> np.ndarray:
        """CACHE-FAR-CODES. Allowed codes (n_kv, n, K) bool: argmin_allowed of code_distances(tokens).

        margin: a number, or a callable of the distances returning one (e.g. a tolerance-table margin).
        """
        dist = self.code_distances(tokens)
        return argmin_allowed(dist, _cache_margin(margin, dist))

    def decode_scores(self, q_post: Any, codes: Any) -> np.ndarray:
        """RET-LUT token scores (n_q, offset) of a decode query over the given codes (the port's, typically)."""
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        c = np.asarray(codes)
        c = c if self.batched else c[None]
        if c.shape != self._c.shape:
            raise ValueError(f"codes: expected shape {self._out(self._c).shape}, got {np.asarray(codes).shape}")
        qb = far_query(q, b=self.config["b"], inv_freqs=self.inv_freqs, traditional=self.traditional,
                          positions=self.offset - 1)
        return self._out(token_scores(lut_scores(qb, self.C, scale=self.scale), c))

    def decode_allowed(self, q_post: Any, codes: Any, margin: float | Callable[[np.ndarray], float]
                       ) -> tuple[np.ndarray, np.ndarray]:
        """CACHE-DECODE. (must, may) selection masks (n_kv, offset) for a decode query, scored with ``codes``.

        Scoring the codes the port holds (not this model's) means a port's tie-broken code choices never
        fail it here; the codes themselves are checked with code_allowed.
        """
        self._need_tokens("decode_allowed")
        s = self.decode_scores(q_post, codes)
        cfg = self.config
        return select_tokens_allowed(s, n_kv_heads=self.n_kv, query_pos=self.offset - 1, w=cfg["w"],
                                        sinks=cfg["sinks"], topk=cfg["topk"], margin=_cache_margin(margin, s))

    def attention(self, q_post: Any, mask: Any) -> np.ndarray:
        """RET-ATTN. Exact attention (n_q, dv) of a decode query over the cached keys/values where mask is True."""
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        m = np.asarray(mask)
        m = m if self.batched else m[None]
        return self._out(retrieval_attention(q, self._k, self._v, m, scale=self.scale))


def _npz(path: Any) -> str:
    p = os.fspath(path)
    return p if p.endswith(".npz") else p + ".npz"
