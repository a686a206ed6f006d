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

__all__ = ["Tol", "TOLERANCES", "OVERRIDES", "tolerance", "tie_margin", "dtype_name", "DTYPES"]


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
    "RoPE angles m*omega are formed in the port's compute precision: for positions up to 4096 (the "
    "suite's bound) a float32 angle carries up to ~2.5e-4 rad of rounding error, which is the error of "
    "every rotated coordinate"
)

#: Per-clause overrides: OVERRIDES[clause][dtype] -> Tol. Only loosen with a reason.
OVERRIDES: dict[str, dict[str, Tol]] = {
    "ROPE-APPLY": {"float32": Tol(1e-4, 1e-3, _ANGLE)},
    "ROPE-INVERSE": {"float32": Tol(1e-4, 1e-3, _ANGLE + "; the round trip doubles it")},
    "EQ-10": {
        "float32": Tol(1e-4, 1e-4, "rotation by R_b (b up to 4096: angle error) then a sum of N*G outer products "
                                   "and an RMS normalisation"),
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
    "RET-LUT": {"float32": Tol(1e-4, 1e-4, "q_b comes out of a rotation (see ROPE-APPLY), then d-term dot products")},
    "RET-ATTN": {"float32": Tol(1e-5, 1e-5, "softmax of d-term logits, weighted sum of values")},
    "RET-DECODE": {"float32": Tol(1e-4, 1e-4, "exact attention over a selected set; scores feed only the discrete selection")},
    "PREFILL": {"float32": Tol(1e-5, 1e-5, "dense causal softmax attention (mlx-lm's fused kernel in float32)")},
    "CACHE-DECODE": {"float32": Tol(1e-4, 1e-4, "same as RET-DECODE, run through the cache object")},
    "CACHE-DENSE-EQUIV": {"float32": Tol(1e-5, 1e-5, "prefill through the cache is dense attention (see PREFILL)")},
}


def dtype_name(dtype) -> str:
    """Canonical dtype name: accepts a string, a numpy dtype/type, or an object with ``.name``."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = getattr(dtype, "name", None)
        if name is None:
            try:
                import numpy as np

                name = np.dtype(dtype).name
            except TypeError as exc:
                raise ValueError(f"dtype: expected a dtype name such as 'float32', got {dtype!r}") from exc
    name = name.replace("mlx.core.", "")
    if name not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance entry for {name!r}; known dtypes are {sorted(TOLERANCES)}")
    return name


def tolerance(dtype, clause: str | None = None) -> tuple[float, float]:
    """(rtol, atol) for outputs computed from ``dtype`` inputs under ``clause``.

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
    return rtol, atol


def tie_margin(dtype, clause: str | None = None) -> float:
    """Absolute margin under which two oracle scores count as tied for discrete outputs.

    An argmin/top-K result is accepted when it is optimal up to this margin (allowed-result
    set).  It is the comparison tolerance at scale 1, times 4 for headroom, because the
    quantities being ranked are themselves outputs with ``tolerance(dtype, clause)`` error.
    """
    rtol, atol = tolerance(dtype, clause)
    return 4.0 * (atol + rtol)
