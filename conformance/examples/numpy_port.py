"""Every clause of spec/SPEC.md (ROPE-FREQ … CACHE-SAVE), written again in plain NumPy: an independent port.

This module is a second implementation of A2ATS, written from spec/SPEC.md alone. It imports only
NumPy (not a2ats_ref, a2ats_spec or a2ats_conformance, and not SciPy), so it can disagree with the
oracle, which is why it is worth checking against it. It is three things at once:

* the example port for authors: the whole adapter protocol of conformance/README-ADAPTER.md in one file;
* the base that tests/suite/ports/ wraps into faithful ports (other calling conventions) and unfaithful ones
  (one known bug each);
* the port that reads golden vectors and writes answers (conformance/VECTORS.md).

API
---
``NumpyPort(dtypes=("float64", "float32"))`` is the adapter. ``a2ats-conformance --iut
a2ats_conformance.examples.numpy_port:NumpyPort`` tests it. Its methods have the oracle's names and
signatures (README-ADAPTER.md, table "clause | callable(s)"), take NumPy arrays and return NumPy arrays.
Each function works in the float dtype of its array inputs (float32 in, float32 arithmetic; float64 in,
float64), so a float32 run really exercises float32 rounding. Codes are int64 from the functions and
``code_dtype(K)`` in the cache. Bad input raises ``ValueError`` naming the argument (INPUT-ERRORS).

``kmeans_from_uniforms(z, K, uniforms, max_iter=300, tol=1e-4)`` is EQ-17-FIT with the seeding uniforms
given rather than drawn from ``default_rng(seed)``: a port with its own random stream builds on it.

``NumpyPort.make_cache(config)`` returns a ``NumpyCache`` (cache protocol of README-ADAPTER.md): batch of
one, or ``config["batch"]`` rows with a leading batch axis on every array (CACHE-BATCH); ``save(path)`` writes an ``.npz`` at exactly ``path`` (no pickle) and ``load(path)`` reads it back.

The module-level functions (``rope_apply``, ``select_tokens``, …) are the same callables without the
class, for code that wants a function rather than an adapter; ``PORT`` is a ready instance.
"""

from __future__ import annotations

import numbers
import os

import numpy as np

__all__ = ["NumpyPort", "NumpyCache", "PORT", "kmeans_from_uniforms"]

DTYPES = ("float64", "float32")


# ----------------------------------------------------------------------------- argument checks

def _work(*arrays) -> np.dtype:
    """The float dtype this call computes in: float64 if any float input is float64, else float32."""
    kinds = [np.asarray(a).dtype for a in arrays if a is not None]
    if any(k == np.float64 for k in kinds):
        return np.dtype(np.float64)
    if any(np.issubdtype(k, np.floating) for k in kinds):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def _floats(x, name: str, dtype, *, ndim: int = 0) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.number)):
        raise ValueError(f"{name}: expected a real array, got dtype {a.dtype}")
    if a.ndim < ndim:
        raise ValueError(f"{name}: expected at least {ndim} dims, got shape {a.shape}")
    a = a.astype(dtype, copy=False)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: contains NaN or inf; pass finite values only")
    return a


def _integer(x, name: str, lo: int | None = None) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise ValueError(f"{name}: expected an int, got {x!r} ({type(x).__name__})")
    if lo is not None and x < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {x}")
    return int(x)


def _flag(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {x!r}")
    return bool(x)


def _freqs(inv_freqs, d: int, dtype) -> np.ndarray:
    if d < 2 or d % 2:
        raise ValueError(f"head dim: must be even and >= 2, got {d}")
    w = _floats(inv_freqs, "inv_freqs", dtype)
    if w.shape != (d // 2,):
        raise ValueError(f"inv_freqs: expected shape ({d // 2},) for head dim {d}, got {w.shape}")
    return w


def _group(n_q: int, n_kv, what: str) -> int:
    n_kv = _integer(n_kv, "n_kv_heads", 1)
    if n_q % n_kv:
        raise ValueError(f"{what}: {n_q} query heads is not a multiple of n_kv_heads={n_kv}")
    return n_q // n_kv


def _square_symmetric(H: np.ndarray, name: str) -> None:
    if H.ndim < 2 or H.shape[-1] != H.shape[-2]:
        raise ValueError(f"{name}: expected a square (d, d) matrix, got shape {H.shape}")
    # EQ-13's band: reject above 1e-5 max|H| (this port takes the lenient end, the oracle the strict one)
    if np.max(np.abs(H - np.swapaxes(H, -1, -2)), initial=0.0) > 1e-5 * np.max(np.abs(H), initial=0.0):
        raise ValueError(f"{name}: must be symmetric; symmetrise it as (H + H.T) / 2")


def _lower_factor(L: np.ndarray, d: int | None = None) -> None:
    if L.ndim < 2 or L.shape[-1] != L.shape[-2]:
        raise ValueError(f"L: expected a square (d, d) Cholesky factor, got shape {L.shape}")
    if d is not None and L.shape[-1] != d:
        raise ValueError(f"L: expected ({d}, {d}) to match the head dim, got {L.shape}")
    if np.any(np.triu(L, 1) != 0):
        raise ValueError("L: must be lower triangular (exact zeros above the diagonal); pass cholesky(H)")
    if np.any(np.diagonal(L, axis1=-2, axis2=-1) <= 0):
        raise ValueError("L: diagonal must be strictly positive; pass cholesky(H)")


def _book(C: np.ndarray, name: str, d: int) -> None:
    if C.shape[-1] != d:
        raise ValueError(f"{name}: codeword width {C.shape[-1]} != head dim {d}; codewords span the full head dim")
    if C.shape[-2] < 1:
        raise ValueError(f"{name}: needs K >= 1 codewords")


def _scale_of(scale, d: int) -> float:
    if scale is None:
        return 1.0 / np.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0 or None (1/sqrt(d)), got {scale!r}")
    return float(scale)


def _code_array(codes, K: int, name: str = "codes") -> np.ndarray:
    c = np.asarray(codes)
    if not np.issubdtype(c.dtype, np.integer):
        raise ValueError(f"{name}: expected an integer array, got dtype {c.dtype}")
    if c.size and (c.min() < 0 or c.max() >= K):
        raise ValueError(f"{name}: codes must lie in [0, {K}), got range [{c.min()}, {c.max()}]")
    return c.astype(np.int64)


# ----------------------------------------------------------------------------- ROPE-*

_SCALINGS = ("default", "linear", "llama3")


def rope_inv_freqs(head_dim, base, scaling=None):
    """ROPE-FREQ: ω as mlx-lm builds it (default, linear, llama3)."""
    d = _integer(head_dim, "head_dim")
    if d < 2 or d % 2:
        raise ValueError(f"head_dim: must be an even int >= 2, got {d}")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not np.isfinite(base) or base <= 1:
        raise ValueError(f"base: expected a finite number > 1, got {base!r}")
    omega = float(base) ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    kind = "default" if scaling is None else (scaling.get("type") or scaling.get("rope_type", "default"))
    if kind not in _SCALINGS:
        raise ValueError(f"scaling: type {kind!r} is not supported; supported types are {list(_SCALINGS)}")
    if kind == "default":
        return omega
    factor = float(scaling.get("factor", 0.0))
    if not (np.isfinite(factor) and factor > 0):     # INPUT-ERRORS: floating inputs are finite
        raise ValueError(f"scaling: 'factor' must be > 0, got {scaling.get('factor')!r}")
    if kind == "linear":
        return omega / factor
    lo = float(scaling.get("low_freq_factor", 1.0))
    hi = float(scaling.get("high_freq_factor", 4.0))
    L0 = float(scaling.get("original_max_position_embeddings", 8192))
    if not 0 < lo < hi:
        raise ValueError(f"scaling: need 0 < low_freq_factor < high_freq_factor, got {lo}, {hi}")
    wavelen = 2 * np.pi / omega
    out = omega.copy()
    low_band = wavelen > L0 / lo
    mid_band = (wavelen > L0 / hi) & (wavelen < L0 / lo)
    out[low_band] = omega[low_band] / factor
    s = (L0 / wavelen[mid_band] - lo) / (hi - lo)
    out[mid_band] = omega[mid_band] * ((1 - s) / factor + s)
    return out


def _halves(x: np.ndarray, traditional: bool):
    """The two members (a, b) of every rotation pair, each (..., d/2)."""
    if traditional:
        return x[..., 0::2], x[..., 1::2]
    h = x.shape[-1] // 2
    return x[..., :h], x[..., h:]


def _join(a: np.ndarray, b: np.ndarray, traditional: bool) -> np.ndarray:
    if traditional:
        return np.stack([a, b], axis=-1).reshape(a.shape[:-1] + (2 * a.shape[-1],))
    return np.concatenate([a, b], axis=-1)


def _rotate(x, positions, inv_freqs, traditional, sign: float):
    dt = _work(x)
    x = _floats(x, "x", dt, ndim=1)
    trad = _flag(traditional, "traditional")
    w = _freqs(inv_freqs, x.shape[-1], dt)
    p = _floats(positions, "positions", dt)
    try:
        np.broadcast_shapes(p.shape, x.shape[:-1])
    except ValueError:
        raise ValueError(f"positions: shape {p.shape} does not broadcast against x's {x.shape[:-1]}") from None
    theta = sign * p[..., None] * w
    cos, sin = np.cos(theta), np.sin(theta)
    a, b = _halves(x, trad)
    return _join(a * cos - b * sin, a * sin + b * cos, trad)


def rope_apply(x, positions, inv_freqs, *, traditional):
    """ROPE-APPLY: row t of x rotated by x R_{p_t}."""
    return _rotate(x, positions, inv_freqs, traditional, 1.0)


def rope_invert(x, positions, inv_freqs, *, traditional):
    """ROPE-INVERSE: row t of x rotated back by R_{p_t}ᵀ (each row its own position)."""
    return _rotate(x, positions, inv_freqs, traditional, -1.0)


# ----------------------------------------------------------------------------- EQ-10 … EQ-12

def query_moment(queries, *, n_kv_heads, b, inv_freqs, traditional, ridge=1e-6):
    """EQ-10: H per KV head from its G query heads' pre-RoPE queries rotated by R_b; RMS-normalised; + ridge I."""
    dt = _work(queries)
    q = _floats(queries, "queries", dt)
    if q.ndim != 3 or q.shape[1] < 1:
        raise ValueError(f"queries: expected (n_q, N >= 1, d), got shape {q.shape}")
    n_q, N, d = q.shape
    G = _group(n_q, n_kv_heads, "queries")
    b = _integer(b, "b", 0)
    if isinstance(ridge, bool) or not isinstance(ridge, numbers.Real) or not np.isfinite(ridge) or ridge < 0:
        raise ValueError(f"ridge: expected a finite number >= 0, got {ridge!r}")
    qb = rope_apply(q, b, inv_freqs, traditional=traditional).astype(dt, copy=False)
    grouped = qb.reshape(n_q // G, G * N, d)
    H = np.einsum("gnd,gne->gde", grouped, grouped) / (G * N)
    rms = np.sqrt(np.mean(H * H, axis=(1, 2)))
    if np.any(rms == 0):
        raise ValueError("queries: a KV group's queries are all zero, so its H cannot be normalised")
    return H / rms[:, None, None] + ridge * np.eye(d, dtype=dt)


def _positions_or_default(p, n: int, name: str, dt):
    if p is None:
        return np.arange(n, dtype=dt)
    p = _floats(p, name, dt)
    if p.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},), got {p.shape}")
    return p


def wrope_scores(q, k, *, w, b, inv_freqs, traditional, q_positions=None, k_positions=None):
    """EQ-11: u_ij = q_i R_{p_i − p_j} k_jᵀ when p_i − p_j < w, else q_i R_b k_jᵀ."""
    dt = _work(q, k)
    q = _floats(q, "q", dt, ndim=2)
    k = _floats(k, "k", dt, ndim=2)
    w = _integer(w, "w", 0)
    b = _integer(b, "b", 0)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k: head dims differ ({q.shape[-1]} vs {k.shape[-1]})")
    pq = _positions_or_default(q_positions, q.shape[-2], "q_positions", dt)
    pk = _positions_or_default(k_positions, k.shape[-2], "k_positions", dt)
    kw = dict(inv_freqs=inv_freqs, traditional=traditional)
    near = rope_apply(q, pq, **kw) @ np.swapaxes(rope_apply(k, pk, **kw), -1, -2)
    far = rope_apply(q, b, **kw) @ np.swapaxes(k, -1, -2)
    is_near = (pq[:, None] - pk[None, :]) < w
    return np.where(is_near, near, far)


def far_keys(k_post, positions, inv_freqs, *, traditional):
    """EQ-12: the pre-RoPE key of each cached post-RoPE key (per-token inverse rotation)."""
    return rope_invert(k_post, positions, inv_freqs, traditional=traditional)


def far_query(q, *, b, inv_freqs, traditional, positions=None):
    """EQ-12: q_pre R_b, from a pre-RoPE q (positions None) or a post-RoPE q at `positions` (rotate by b − p)."""
    b = _integer(b, "b", 0)
    if positions is None:
        return rope_apply(q, b, inv_freqs, traditional=traditional)
    p = np.asarray(positions)
    return rope_apply(q, b - p.astype(_work(q)), inv_freqs, traditional=traditional)


# ----------------------------------------------------------------------------- EQ-13 … EQ-16, EQ-18

def score_error(k, c, H):
    """EQ-13: (k − c) H (k − c)ᵀ."""
    dt = _work(k, c, H)
    k, c, H = _floats(k, "k", dt, ndim=1), _floats(c, "c", dt, ndim=1), _floats(H, "H", dt, ndim=2)
    _square_symmetric(H, "H")
    if H.shape != (k.shape[-1],) * 2 or c.shape[-1] != k.shape[-1]:
        raise ValueError(f"k, c, H: need k (..., d), c (..., d), H (d, d); got {k.shape}, {c.shape}, {H.shape}")
    e = k - c
    return np.einsum("...i,ij,...j->...", e, H, e)


def _nearest_index(dist: np.ndarray) -> np.ndarray:
    return np.argmin(dist, axis=-1).astype(np.int64)  # first minimum: ties -> lowest index


def assign(k, C, H):
    """EQ-14: argmin_j (k − C_j) H (k − C_j)ᵀ."""
    dt = _work(k, C, H)
    k, C, H = _floats(k, "k", dt, ndim=1), _floats(C, "C", dt, ndim=2), _floats(H, "H", dt, ndim=2)
    _book(C, "C", k.shape[-1])
    _square_symmetric(H, "H")
    if H.shape[-1] != k.shape[-1]:
        raise ValueError(f"H: expected ({k.shape[-1]}, {k.shape[-1]}), got {H.shape}")
    e = k[..., None, :] - C
    return _nearest_index(np.einsum("...ki,ij,...kj->...k", e, H, e))


def cholesky(H):
    """EQ-15: lower-triangular L with positive diagonal, H = L Lᵀ."""
    dt = _work(H)
    H = _floats(H, "H", dt, ndim=2)
    _square_symmetric(H, "H")
    try:
        L = np.linalg.cholesky(H)
    except np.linalg.LinAlgError:
        raise ValueError("H: not positive definite; add a ridge (query_moment(..., ridge=1e-6))") from None
    if not np.all(np.isfinite(L)) or np.any(np.diagonal(L, axis1=-2, axis2=-1) <= 0):
        raise ValueError("H: not positive definite; add a ridge (query_moment(..., ridge=1e-6))")
    return L


def z_transform(k, L):
    """EQ-16: z = k L."""
    dt = _work(k, L)
    k, L = _floats(k, "k", dt, ndim=1), _floats(L, "L", dt, ndim=2)
    _lower_factor(L, k.shape[-1])
    return k @ L


def assign_z(k, Cz, L):
    """EQ-16: argmin_j ‖k L − Cz_j‖²."""
    dt = _work(k, Cz, L)
    Cz = _floats(Cz, "Cz", dt, ndim=2)
    z = z_transform(k, L)
    _book(Cz, "Cz", z.shape[-1])
    return _nearest_index(_sq_dist(z, Cz))


def _sq_dist(z: np.ndarray, C: np.ndarray) -> np.ndarray:
    """‖z_n − C_k‖² for every pair, (..., K); differences rather than the expanded form, so near ties keep bits."""
    diff = z[..., None, :] - C
    return np.einsum("...kd,...kd->...k", diff, diff)


def back_transform(Cz, L):
    """EQ-18: C with C L = Cz (a solve, never an explicit inverse)."""
    dt = _work(Cz, L)
    Cz, L = _floats(Cz, "Cz", dt, ndim=2), _floats(L, "L", dt, ndim=2)
    _lower_factor(L)
    _book(Cz, "Cz", L.shape[-1])
    # C L = Cz  <=>  Lᵀ Cᵀ = Czᵀ
    return np.swapaxes(np.linalg.solve(np.swapaxes(L, -1, -2), np.swapaxes(Cz, -1, -2)), -1, -2)


# ----------------------------------------------------------------------------- EQ-17 k-means

def _check_points(z, K, dt):
    z = _floats(z, "z", dt)
    if z.ndim != 2 or z.shape[0] < 1:
        raise ValueError(f"z: expected (N, d) points, got shape {z.shape}")
    K = _integer(K, "K", 1)
    if z.shape[0] < K:
        raise ValueError(f"z: need N >= K points, got N={z.shape[0]}, K={K}")
    if np.unique(z, axis=0).shape[0] < K:
        raise ValueError(f"z: need at least K={K} distinct points to seed K centres")
    return z, K


def kmeanspp_init(z, K, uniforms):
    """EQ-17-INIT: k-means++ by the inverse CDF of the D² weights at the given uniforms."""
    dt = _work(z)
    z, K = _check_points(z, K, dt)
    u = np.asarray(uniforms, dtype=np.float64)
    if u.shape != (K,) or np.any(u < 0) or np.any(u >= 1) or not np.all(np.isfinite(u)):
        raise ValueError(f"uniforms: expected {K} values in [0, 1), got shape {u.shape}")
    N = z.shape[0]
    picks = [int(u[0] * N)]
    d2 = _sq_dist(z, z[picks[0]][None])[:, 0]
    for t in range(1, K):
        cdf = np.cumsum(d2)
        n = min(int(np.searchsorted(cdf, u[t] * cdf[-1], side="right")), N - 1)  # first n: cdf[n] > u·total
        picks.append(n)
        d2 = np.minimum(d2, _sq_dist(z, z[n][None])[:, 0])
    return z[picks].copy()


def lloyd_step(z, C):
    """EQ-17-STEP: assign, objective under the input C, re-seed empty clusters, means."""
    dt = _work(z, C)
    C = _floats(C, "C", dt, ndim=2)
    z, K = _check_points_loose(z, C, dt)
    dist = _sq_dist(z, C)
    codes = _nearest_index(dist)
    err = dist[np.arange(z.shape[0]), codes]
    objective = float(np.sum(err))
    members = codes.copy()
    sizes = np.bincount(members, minlength=K)
    moved = np.zeros(z.shape[0], dtype=bool)
    for e in np.flatnonzero(sizes == 0):
        eligible = (~moved) & (sizes[members] >= 2)
        if not np.any(eligible):
            break
        n = int(np.argmax(np.where(eligible, err, -np.inf)))  # largest error, ties -> lowest n
        sizes[members[n]] -= 1
        members[n] = e
        sizes[e] += 1
        moved[n] = True
    C_new = np.zeros_like(C)
    np.add.at(C_new, members, z)
    counts = np.bincount(members, minlength=K).astype(dt)
    C_new = np.where(counts[:, None] > 0, C_new / np.maximum(counts, 1)[:, None], C)
    return C_new, codes, objective


def _check_points_loose(z, C, dt):
    z = _floats(z, "z", dt)
    if z.ndim != 2:
        raise ValueError(f"z: expected (N, d) points, got shape {z.shape}")
    K = C.shape[0]
    if C.shape[1] != z.shape[1]:
        raise ValueError(f"C: expected (K, {z.shape[1]}) centres to match z, got {C.shape}")
    if z.shape[0] < K:
        raise ValueError(f"z: need N >= K points, got N={z.shape[0]}, K={K}")
    return z, K


def kmeans_from_uniforms(z, K, uniforms, max_iter=300, tol=1e-4):
    """EQ-17-FIT from given seeding uniforms: Lloyd steps until max_iter, a zero objective or a small relative gain."""
    max_iter = _integer(max_iter, "max_iter", 1)
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol: expected a number >= 0, got {tol!r}")
    C = kmeanspp_init(z, K, uniforms)
    zz = np.asarray(z, dtype=C.dtype)
    history = []
    for s in range(1, max_iter + 1):
        C, _, f = lloyd_step(zz, C)
        history.append(f)
        if f == 0 or (s >= 2 and history[-2] - f < tol * history[-2]):
            break
    return C, _nearest_index(_sq_dist(zz, C)), history


def kmeans(z, K, *, seed, max_iter=300, tol=1e-4):
    """EQ-17-FIT: uniforms = numpy default_rng(seed).random(K), then kmeans_from_uniforms."""
    seed = _integer(seed, "seed", 0)
    K = _integer(K, "K", 1)
    return kmeans_from_uniforms(z, K, np.random.default_rng(seed).random(K), max_iter, tol)


# ----------------------------------------------------------------------------- RET-*

def lut_scores(q_b, C, *, scale=None):
    """RET-LUT: LUT[h, k] = scale · q_b[h] · C[h // G, k]."""
    dt = _work(q_b, C)
    q = _floats(q_b, "q_b", dt, ndim=2)
    C = _floats(C, "C", dt)
    if C.ndim != 3:
        raise ValueError(f"C: expected (n_kv, K, d) key-space codebooks, got shape {C.shape}")
    _book(C, "C", q.shape[-1])
    G = _group(q.shape[-2], C.shape[0], "q_b")
    s = _scale_of(scale, q.shape[-1])
    per_head = np.repeat(C, G, axis=0)  # (n_q, K, d): head h reads codebook h // G
    return s * np.einsum("...hd,hkd->...hk", q, per_head)


def token_scores(lut, codes):
    """RET-LUT: s[h, t] = LUT[h, codes[h // G, t]]."""
    lut = _floats(lut, "lut", _work(lut), ndim=2)
    c = _code_array(codes, lut.shape[-1])
    if c.ndim < 2:
        raise ValueError(f"codes: expected (..., n_kv, T), got shape {c.shape}")
    G = _group(lut.shape[-2], c.shape[-2], "lut")
    c = np.repeat(c, G, axis=-2)
    lead = np.broadcast_shapes(lut.shape[:-2], c.shape[:-2])
    lut = np.broadcast_to(lut, lead + lut.shape[-2:])
    c = np.broadcast_to(c, lead + c.shape[-2:])
    return np.take_along_axis(lut, c, axis=-1)


def topk_count(T, topk, n_candidates=None):
    """RET-TOPK: floor(topk·T) for a fraction, topk for an int; capped at n_candidates."""
    T = _integer(T, "T", 1)
    if isinstance(topk, (bool, np.bool_)):
        raise ValueError(f"topk: expected a float in (0, 1] or an int >= 1, got {topk!r}")
    if isinstance(topk, numbers.Integral):
        if topk < 1:
            raise ValueError(f"topk: an int topk is a count and must be >= 1, got {topk}")
        n = int(topk)
    elif isinstance(topk, numbers.Real):
        if not 0 < float(topk) <= 1:
            raise ValueError(f"topk: a float topk is a fraction and must be in (0, 1], got {topk}")
        n = int(np.floor(float(topk) * T))
    else:
        raise ValueError(f"topk: expected a float in (0, 1] or an int >= 1, got {topk!r}")
    if n_candidates is not None:
        n = min(n, _integer(n_candidates, "n_candidates", 0))
    return n


def _regions(T: int, query_pos, w, sinks):
    """(forced, candidate) masks over the T cached tokens for a query at position i."""
    i = _integer(query_pos, "query_pos", 0)
    if i > T - 1:
        raise ValueError(f"query_pos: must be <= T - 1 = {T - 1}, got {i}")
    w = _integer(w, "w", 0)
    sinks = _integer(sinks, "sinks", 0)
    j = np.arange(T)
    visible = j <= i
    forced = visible & ((j < sinks) | (i - j < w))
    return i, forced, visible & ~forced


def select_tokens(scores, *, n_kv_heads, query_pos, w, sinks, topk):
    """RET-SELECT: sinks + window + per-head top-k of the candidates (count over i + 1), unioned per GQA group."""
    s = _floats(scores, "scores", _work(scores), ndim=2)
    n_q, T = s.shape[-2:]
    if T < 1:
        raise ValueError("scores: need T >= 1 tokens")
    G = _group(n_q, n_kv_heads, "scores")
    i, forced, cand = _regions(T, query_pos, w, sinks)
    count = topk_count(i + 1, topk, int(cand.sum()))
    ranked = np.where(cand, s, -np.inf)
    order = np.argsort(-ranked, axis=-1, kind="stable")[..., :count]  # descending, ties -> lowest index
    per_head = np.zeros(s.shape, dtype=bool)
    np.put_along_axis(per_head, order, True, axis=-1)
    per_head &= cand  # count <= #candidates, so this only guards against -inf picks
    union = per_head.reshape(s.shape[:-2] + (n_q // G, G, T)).any(axis=-2)
    if count == 0 and not forced.any():  # never empty: the query's own token
        forced = np.arange(T) == i
    return union | forced


def _attend(q, k, v, allowed, scale):
    """softmax(scale · q kᵀ) v per query head over `allowed` (broadcast to (..., n_q, Tq, T)); head h reads KV h // G."""
    G = q.shape[-3] // k.shape[-3]
    kh = np.repeat(k, G, axis=-3)
    vh = np.repeat(v, G, axis=-3)
    logits = scale * (q @ np.swapaxes(kh, -1, -2))
    logits = np.where(allowed, logits, -np.inf)
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    return (p / p.sum(axis=-1, keepdims=True)) @ vh


def retrieval_attention(q, k, v, mask, *, scale=None):
    """RET-ATTN: exact softmax attention of each query head over its KV head's selected tokens."""
    dt = _work(q, k, v)
    q, k, v = _floats(q, "q", dt, ndim=2), _floats(k, "k", dt, ndim=3), _floats(v, "v", dt, ndim=3)
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise ValueError(f"mask: expected a bool array, got dtype {m.dtype}")
    n_kv, T, d = k.shape[-3:]
    if q.shape[-1] != d or v.shape[-3:-1] != (n_kv, T) or m.shape[-2:] != (n_kv, T):
        raise ValueError(f"q, k, v, mask: need (..., n_q, {d}), (..., n_kv, T, {d}), (..., n_kv, T, dv), "
                         f"(..., n_kv, T); got {q.shape}, {k.shape}, {v.shape}, {m.shape}")
    G = _group(q.shape[-2], n_kv, "q")
    if not np.all(m.any(axis=-1)):
        raise ValueError("mask: every KV head must select at least one token")
    s = _scale_of(scale, d)
    allowed = np.repeat(m, G, axis=-2)[..., None, :]  # (..., n_q, 1, T)
    return _attend(q[..., None, :], k, v, allowed, s)[..., 0, :]


def decode_step(q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                scale=None, return_mask=False):
    """RET-DECODE: far query → LUT → token scores → selection → exact attention."""
    k_post = np.asarray(k_post)
    c = np.asarray(codes)
    if k_post.ndim < 3 or c.shape[-1:] != k_post.shape[-2:-1]:
        raise ValueError(f"codes: expected (..., n_kv, T) matching k_post {k_post.shape}, got {c.shape}")
    q_b = far_query(q_post, b=b, inv_freqs=inv_freqs, traditional=traditional, positions=query_pos)
    scores = token_scores(lut_scores(q_b, C, scale=scale), c)
    mask = select_tokens(scores, n_kv_heads=k_post.shape[-3], query_pos=query_pos, w=w, sinks=sinks, topk=topk)
    out = retrieval_attention(q_post, k_post, v, mask, scale=scale)
    return (out, mask) if return_mask else out


def prefill_attention(q, k, v, *, scale=None):
    """PREFILL: dense causal attention, the Tq queries end-aligned with the Tk keys."""
    dt = _work(q, k, v)
    q, k, v = _floats(q, "q", dt, ndim=3), _floats(k, "k", dt, ndim=3), _floats(v, "v", dt, ndim=3)
    Tq, d = q.shape[-2:]
    n_kv, Tk = k.shape[-3:-1]
    if k.shape[-1] != d or v.shape[-3:-1] != (n_kv, Tk):
        raise ValueError(f"q, k, v: need (..., n_q, Tq, {d}), (..., n_kv, Tk, {d}), (..., n_kv, Tk, dv); "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    if not 1 <= Tq <= Tk:
        raise ValueError(f"q: need 1 <= Tq <= Tk (queries are the last Tq cached tokens), got Tq={Tq}, Tk={Tk}")
    _group(q.shape[-3], n_kv, "q")
    causal = np.arange(Tk)[None, :] <= (Tk - Tq + np.arange(Tq))[:, None]
    return _attend(q, k, v, causal, _scale_of(scale, d))


def code_dtype(K):
    """CODES-DTYPE: uint8 up to 256 codewords, uint16 up to 65536."""
    K = _integer(K, "K", 1)
    if K > 65536:
        raise ValueError(f"K: codes are at most 16-bit, so K must be <= 65536, got {K}")
    return np.dtype(np.uint8 if K <= 256 else np.uint16)


# ----------------------------------------------------------------------------- the cache (CACHE-*)

class NumpyCache:
    """One layer's A2ATS KV cache (README-ADAPTER.md, cache protocol), batch of one or ``config["batch"]`` rows.

    Keeps the exact post-RoPE keys and values, each token's position and its code, assigned once when
    written from the de-rotated (pre-RoPE) key (EQ-12, EQ-16, CACHE-FAR-CODES). Arrays are held with a
    leading batch axis (1 without ``batch``); the protocol's arrays have it only when ``batch`` is given.
    """

    def __init__(self, config: dict):
        self.config = dict(config)
        n_kv, d = int(config["n_kv_heads"]), int(config["head_dim"])
        self.Cz = np.asarray(config["Cz"])
        self.L = np.asarray(config["L"])
        self.C = np.asarray(config["C"])
        if self.Cz.shape[0] != n_kv or self.Cz.shape[-1] != d or self.L.shape != (n_kv, d, d):
            raise ValueError(f"config: Cz {self.Cz.shape} / L {self.L.shape} do not match n_kv={n_kv}, d={d}")
        self.batched = config.get("batch") is not None
        self.B = _integer(config["batch"], "config['batch']", 1) if self.batched else 1
        self.K = self.Cz.shape[1]
        self.keys = np.zeros((self.B, n_kv, 0, d))
        self.values = np.zeros((self.B, n_kv, 0, d))
        self.codes_ = np.zeros((self.B, n_kv, 0), code_dtype(self.K))
        self.pos = np.zeros(0, np.int64)

    @property
    def offset(self) -> int:
        return int(self.pos.shape[0])

    def _rope_kw(self):
        return dict(inv_freqs=self.config["inv_freqs"], traditional=bool(self.config["traditional"]))

    def _in(self, x, name: str, ndim: int) -> np.ndarray:
        """A protocol array -> its batched form (B, ...)."""
        a = np.asarray(x)
        a = a if self.batched else a[None]
        if a.ndim != ndim + 1 or a.shape[0] != self.B:
            lead = f"({self.B}, " if self.batched else "("
            raise ValueError(f"{name}: expected {ndim + self.batched} dims {lead}...), got shape {np.shape(x)}")
        return a

    def _out(self, a: np.ndarray) -> np.ndarray:
        return a if self.batched else a[0]

    def assign_codes(self, keys_post: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """EQ-12 + EQ-16: de-rotate each key at its own position, then the nearest z-space codeword per KV head.
        keys_post (B, n_kv, t, d) -> codes (B, n_kv, t)."""
        pre = far_keys(keys_post, positions, **self._rope_kw())
        # Row by row and head by head, so a row's codes are bit-identical to a batch-of-one cache's (BLAS may sum
        # a batched product in another order, and a last-bit difference can flip a near tie; CACHE-BATCH).
        return np.array([[assign_z(row[g], self.Cz[g], self.L[g]) for g in range(row.shape[0])] for row in pre])

    def append(self, keys_post, values) -> None:
        k, v = self._in(keys_post, "keys_post", 3), self._in(values, "values", 3)
        n_kv, d = self.keys.shape[1], self.keys.shape[3]
        if k.shape[1] != n_kv or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"append: expected keys (..., {n_kv}, t, {d}) and values (..., {n_kv}, t, dv), "
                             f"got {np.shape(keys_post)}, {np.shape(values)}")
        new_pos = self.offset + np.arange(k.shape[2])
        codes = self.assign_codes(k, new_pos).astype(self.codes_.dtype)
        if self.offset == 0:   # the first write fixes the cached dtypes and dv
            self.keys, self.values = k[:, :, :0], v[:, :, :0]
        self.keys = np.concatenate([self.keys, k], axis=2)
        self.values = np.concatenate([self.values, v], axis=2)
        self.codes_ = np.concatenate([self.codes_, codes], axis=2)
        self.pos = np.concatenate([self.pos, new_pos])

    def decode(self, q_post):
        cfg = self.config
        if self.offset == 0:
            raise ValueError("decode: the cache is empty; append the query's own key first")
        q = self._in(q_post, "q_post", 2)
        rows = [self.decode_step(q[r], self.keys[r], self.values[r], self.codes_[r], self.C, query_pos=self.offset - 1,
                                 b=cfg["b"], w=cfg["w"], sinks=cfg["sinks"], topk=cfg["topk"], scale=cfg.get("scale"),
                                 return_mask=True, **self._rope_kw())
                for r in range(self.B)]    # row by row: each row's selection is exactly a batch-of-one cache's
        return self._out(np.stack([o for o, _ in rows])), self._out(np.stack([m for _, m in rows]))

    #: RET-DECODE as this cache runs it (a port variant may swap in its own).
    decode_step = staticmethod(decode_step)

    def prefill(self, q_post):
        q = self._in(q_post, "q_post", 3)
        return self._out(prefill_attention(q, self.keys, self.values, scale=self.config.get("scale")))

    def trim(self, n: int) -> int:
        n = min(_integer(n, "n", 0), self.offset)
        keep = self.offset - n
        self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]
        self.codes_, self.pos = self.codes_[:, :, :keep], self.pos[:keep]
        return n

    def codes(self):
        return self._out(self.codes_).copy()

    def positions(self):
        return self.pos.copy()

    def keys_values(self):
        return self._out(self.keys).copy(), self._out(self.values).copy()

    def save(self, path) -> None:
        """Writes an .npz at exactly `path` (arrays only; the codebook is not saved: load takes it from config)."""
        with open(os.fspath(path), "wb") as f:
            np.savez(f, keys=self.keys, values=self.values, codes=self.codes_, pos=self.pos,
                     params=np.array([self.config["w"], self.config["b"], self.config["sinks"], self.B]))

    def load(self, path) -> "NumpyCache":
        with np.load(os.fspath(path), allow_pickle=False) as f:
            params = [int(x) for x in f["params"]]
            mine = [self.config["w"], self.config["b"], self.config["sinks"], self.B]
            if params != mine:
                raise ValueError(f"load: file has w, b, sinks, batch = {params}, this cache's config has {mine}")
            new = type(self)(self.config)
            new.keys, new.values, new.codes_, new.pos = f["keys"], f["values"], f["codes"], f["pos"]
        return new


# ----------------------------------------------------------------------------- the adapter

_FUNCTIONS = (rope_inv_freqs, rope_apply, rope_invert, query_moment, wrope_scores, far_keys, far_query,
              score_error, assign, cholesky, z_transform, assign_z, kmeanspp_init, lloyd_step, kmeans,
              back_transform, lut_scores, token_scores, topk_count, select_tokens, retrieval_attention,
              decode_step, prefill_attention, code_dtype)


class NumpyPort:
    """The adapter: every callable of README-ADAPTER.md plus ``make_cache``."""

    name = "numpy_port (independent NumPy A2ATS)"
    version = "1"
    cache_class = NumpyCache

    def __init__(self, dtypes=DTYPES):
        self.dtypes = tuple(dtypes)
        self.input_dtype = None
        for fn in _FUNCTIONS:
            setattr(self, fn.__name__, fn)

    def make_cache(self, config: dict):
        return self.cache_class(config)


PORT = NumpyPort()
