"""The one tolerance table of a2ats-ref, keyed by dtype, with per-clause overrides.

Every comparison of a continuous output in the conformance suite and in the package's own tests
uses ``tolerance(dtype, clause)``.  An element passes when

    |actual - expected| <= atol + rtol * |expected|

(``numpy.isclose`` semantics).  Test inputs are drawn with entries of order 1, so ``atol`` is
effectively "relative to the scale of the data".

Discrete outputs (codes, top-K selections, token masks) are NEVER compared with a tolerance:
they are compared against allowed-result sets computed from the oracle's margins, and the
margin used there is ``tie_margin(dtype, clause)``.

``dtype`` is the dtype of the *inputs* handed to the implementation under test ("float64",
"float32", "float16", "bfloat16"; a numpy dtype or anything with a ``name`` also works).
Every entry carries a written reason; a meta-test checks that.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Tol", "TOLERANCES", "OVERRIDES", "tolerance", "tie_margin", "dtype_name", "DTYPES", "TABLE_MAX_POSITION",
           "POSITION_CLAUSES", "angle_error", "ROTATION_HEADROOM", "pair_angle_errors", "query_moment_atol"]


class Tol(NamedTuple):
    rtol: float
    atol: float
    reason: str


DTYPES = ("float64", "float32", "float16", "bfloat16")

#: Base tolerance per input dtype.
TOLERANCES: dict[str, Tol] = {
    "float64": Tol(1e-12, 1e-12, "float64 end to end (oracle as IUT): only reassociation error, ~1e-15 per op over short reductions"),
    "float32": Tol(1e-5, 1e-5, "float32 compute on float32 inputs; reductions over d <= 256 terms give ~1e-6 relative error"),
    "float16": Tol(2e-3, 2e-3, "inputs are float16 (the oracle sees the same rounded values); attention outputs come back in float16 (eps 9.8e-4)"),
    "bfloat16": Tol(1.6e-2, 1.6e-2, "inputs are bfloat16 (same rounded values reach the oracle); attention outputs come back in bfloat16 (eps 7.8e-3)"),
}

_ANGLE = (
    "RoPE angles m*omega are formed in the port's compute precision: for positions up to 4096 "
    "(TABLE_MAX_POSITION) a float32 angle carries up to ~2.5e-4 rad of rounding error, which is the error of "
    "every rotated coordinate; beyond 4096 tolerance() grows atol with the position (angle_error)"
)

#: Per-clause overrides: OVERRIDES[clause][dtype] -> Tol. Only loosen with a reason.
OVERRIDES: dict[str, dict[str, Tol]] = {
    "ROPE-APPLY": {"float32": Tol(1e-4, 1e-3, _ANGLE)},
    "ROPE-INVERSE": {"float32": Tol(1e-4, 1e-3, _ANGLE + "; the round trip doubles it")},
    "EQ-10": {
        "float32": Tol(1e-4, 1e-4, "a sum of N*G outer products and an RMS normalisation; the rotation by R_b adds "
                                   "an error that grows with b and with the entries of H: query_moment_atol"),
    },
    "EQ-11": {"float32": Tol(1e-4, 2e-3, _ANGLE + "; scores are d-term dot products of rotated vectors")},
    "EQ-12": {"float32": Tol(1e-4, 1e-3, _ANGLE)},
    "EQ-13": {"float32": Tol(1e-4, 1e-4, "quadratic form: d*d products of differences, cancellation in (k - c)")},
    "EQ-15": {
        "float32": Tol(1e-4, 1e-4, "Cholesky error grows with cond(H); the strategies bound cond(H) <= ~1e3"),
    },
    "EQ-16": {"float32": Tol(1e-4, 1e-4, "z = k L after a float32 Cholesky (see EQ-15)")},
    "EQ-17-STEP": {"float32": Tol(1e-4, 1e-4, "centres are means of up to N points; objective is a sum of N*d squares")},
    "EQ-17-FIT": {"float32": Tol(1e-3, 1e-3, "tens of Lloyd iterations, each with EQ-17-STEP error")},
    "EQ-18": {
        "float32": Tol(1e-4, 1e-4, "triangular solve error grows with cond(L) = sqrt(cond(H)) <= ~30"),
    },
    "RET-LUT": {"float32": Tol(1e-5, 2e-5, "float32 d-term dot products (d <= 128: ~1e-6 of |q_b||c|); q_b comes out of a "
                                           "float32 rotation whose angle error (see ROPE-APPLY) reaches a score only through "
                                           "scale*|q_pair||c_pair| of the fast pairs: <= 1e-5 measured at d = 128, b = 2048 "
                                           "(near_tie_case); this is the margin that judges near ties of LUT scores")},
    "RET-ATTN": {"float32": Tol(1e-5, 1e-5, "softmax of d-term logits, weighted sum of values")},
    "RET-DECODE": {"float32": Tol(1e-4, 1e-4, "exact attention over a selected set; scores feed only the discrete selection")},
    "PREFILL": {"float32": Tol(1e-5, 1e-5, "dense causal softmax attention (mlx-lm's fused kernel in float32)")},
    "CACHE-DECODE": {"float32": Tol(1e-4, 1e-4, "same as RET-DECODE, run through the cache object")},
    "CACHE-DENSE-EQUIV": {"float32": Tol(1e-5, 1e-5, "prefill through the cache is dense attention (see PREFILL)")},
}


#: The table's entries hold for RoPE positions (and b) up to this bound; the suite draws up to 131,072.
TABLE_MAX_POSITION = 4096

#: Clauses whose error grows with the largest RoPE position m (or b) of an example, and by how many
#: float32 angle errors: a rotated coordinate, a de-rotated key, a far query q R_(b-i), a score or a code
#: distance built from one rotation carries one angle error; a round trip (ROPE-INVERSE of ROPE-APPLY) or a
#: near score (both sides rotated, EQ-11) two.
POSITION_CLAUSES: dict[str, int] = {
    "ROPE-APPLY": 1, "ROPE-INVERSE": 2, "EQ-11": 2, "EQ-12": 1, "RET-LUT": 1, "RET-DECODE": 1,
    "CACHE-DECODE": 1, "CACHE-FAR-CODES": 1, "CACHE-CHUNK": 1, "CACHE-BATCH": 1, "CACHE-TRIM": 1,
}


def angle_error(max_position: float) -> float:
    """Bound (radians) on the float32 rounding of a RoPE angle m·ω with |m| <= max_position and ω <= 1.

    The product is rounded once to float32 (unit roundoff 2^-24), so its error is at most |m|·2^-24: about
    2.4e-4 rad at the table's bound 4096 (the reason of the ROPE-APPLY entry) and 7.8e-3 rad at 131,072.
    Every rotated coordinate of an order-1 vector carries that much error; nothing in float32 can avoid it.
    """
    return abs(float(max_position)) * 2.0 ** -24


def dtype_name(dtype) -> str:
    """Canonical dtype name: accepts a string, a numpy dtype/type, or an object with ``.name``."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = getattr(dtype, "name", None)
        if name is None:
            try:
                name = np.dtype(dtype).name
            except TypeError as exc:
                raise ValueError(f"dtype: expected a dtype name such as 'float32', got {dtype!r}") from exc
    name = name.replace("mlx.core.", "")
    if name not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance entry for {name!r}; known dtypes are {sorted(TOLERANCES)}")
    return name


def tolerance(dtype, clause: str | None = None, max_position: float | None = None) -> tuple[float, float]:
    """(rtol, atol) for outputs computed from ``dtype`` inputs under ``clause``.

    ``max_position``: the largest RoPE position (or b) of the example. Past TABLE_MAX_POSITION, for the
    POSITION_CLAUSES and every dtype but float64, atol grows with it: at least 4 (headroom, as in the table)
    times the clause's number of angle errors times angle_error(max_position). Below the bound the table
    entry applies unchanged, so small-position examples keep the tight tolerances.

    Overrides are only ever looser than the base entry (a tighter override would be silently
    ineffective for some dtypes); the result is the elementwise max of the base and the override.
    For float16/bfloat16 the base already dominates the float32 overrides, but an override given
    for float32 is also applied to the lower-precision dtypes (their compute is float32 too).
    """
    name = dtype_name(dtype)
    base = TOLERANCES[name]
    rtol, atol = base.rtol, base.atol
    per_clause = OVERRIDES.get(clause or "", {})
    candidates = [per_clause.get(name)]
    if name in ("float16", "bfloat16"):
        candidates.append(per_clause.get("float32"))
    for ov in candidates:
        if ov is not None:
            rtol, atol = max(rtol, ov.rtol), max(atol, ov.atol)
    n_angles = POSITION_CLAUSES.get(clause or "", 0)
    if n_angles and name != "float64" and max_position is not None and abs(max_position) > TABLE_MAX_POSITION:
        atol = max(atol, 4.0 * n_angles * angle_error(max_position))
    return rtol, atol


def tie_margin(dtype, clause: str | None = None, max_position: float | None = None) -> float:
    """Absolute margin under which two oracle scores count as tied for discrete outputs.

    An argmin/top-K result is accepted when it is optimal up to this margin (allowed-result
    set).  It is the comparison tolerance at scale 1, times 4 for headroom, because the
    quantities being ranked are themselves outputs with ``tolerance(dtype, clause)`` error
    (position-dependent past TABLE_MAX_POSITION, see ``tolerance``).
    """
    rtol, atol = tolerance(dtype, clause, max_position)
    return 4.0 * (atol + rtol)


#: Factor on the first-order rotation bounds below: covers sin/cos evaluation (a few float32 ulp of an order-1
#: result) and the second-order terms the bounds leave out. The bound itself reached 0.63 of the measured
#: reference error on the worst of 600 random cases (b up to 131,071, head_dim up to 64).
ROTATION_HEADROOM = 2.0


def pair_angle_errors(b: float, inv_freqs) -> "np.ndarray":
    """Bound (radians) on the float32 rounding of each pair's angle b·ω_k: |b|·ω_k·2^-24 (one rounding of the
    product; ω_k are inputs, so the port and the oracle share them). Pairs with ω_k near 1 carry angle_error(b);
    the slow pairs carry almost none, which is why the bound is per pair and not one number per example."""

    return abs(float(b)) * np.abs(np.asarray(inv_freqs, dtype=np.float64)) * 2.0 ** -24


def query_moment_atol(expected, *, b: float, inv_freqs, traditional: bool, ridge: float = 1e-6) -> "np.ndarray":
    """EQ-10: elementwise bound on the error that the float32 rotation by R_b puts into H (n_kv, d, d).

    A rotated query coordinate i of pair k is off by at most e_k·|x_pair| (pair_angle_errors). With
    Hn = H - ridge·I (RMS 1) and P_i = Hn_ii + Hn_i'i' (the pair of i), Cauchy-Schwarz over the pooled queries
    bounds the error of the moment by E_ij = e_i·sqrt(P_i·Hn_jj) + e_j·sqrt(Hn_ii·P_j); the RMS normalisation
    moves every entry by at most |Hn_ij|·||E||_F / ||Hn||_F more. So the bound grows linearly with b, with the
    pair frequencies, and with the entries of H, which for few pooled queries reach head_dim (one query: H =
    d·x xᵀ/|x|²). Times ROTATION_HEADROOM; add it to the table's EQ-10 atol."""

    H = np.asarray(expected, dtype=np.float64)
    d = H.shape[-1]
    Hn = H - float(ridge) * np.eye(d)
    i = np.arange(d)
    pair = i // 2 if traditional else i % (d // 2)
    partner = (i ^ 1) if traditional else (i + d // 2) % d
    e = pair_angle_errors(b, inv_freqs)[pair]
    diag = np.clip(np.diagonal(Hn, axis1=-2, axis2=-1), 0.0, None)
    P = diag + diag[..., partner]
    E = (e[:, None] * np.sqrt(P[..., :, None] * diag[..., None, :])
         + e[None, :] * np.sqrt(diag[..., :, None] * P[..., None, :]))
    norm = np.sqrt(np.sum(Hn ** 2, axis=(-2, -1), keepdims=True))
    shift = np.sqrt(np.sum(E ** 2, axis=(-2, -1), keepdims=True)) / np.where(norm > 0, norm, 1.0)
    return ROTATION_HEADROOM * (E + np.abs(Hn) * shift)
