"""INPUT-ERRORS — shared precondition checks for the MLX reference (all clauses).

Every failure is a ValueError whose message names the argument, what was
expected and what was received, so the caller knows what to fix.
"""

from __future__ import annotations

import numbers

import mlx.core as mx
import numpy as np

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# Positions travel as float32 angles; integers above 2**24 are not exact there.
MAX_POSITION = 2**24
MAX_CODEBOOK = 65536
# A Cholesky factor of a calibrated H (RMS-normalised, ridge 1e-6, d <= 256) has a smallest/largest
# diagonal ratio above sqrt(1e-6 / 256) ~ 6e-5; far below that, C = Cz L^-1 overflows float32.
MIN_L_DIAG_RATIO = 1e-6


def _dtype_name(dt) -> str:
    return str(dt).replace("mlx.core.", "")


def as_array(x, name: str) -> mx.array:
    """Return x as an mx.array (NumPy arrays, lists and scalars are accepted)."""
    if isinstance(x, mx.array):
        return x
    try:
        return mx.array(np.asarray(x))
    except Exception as exc:  # noqa: BLE001 - reported with the argument name
        raise ValueError(f"{name}: expected an array, got {type(x).__name__} ({exc})") from None


def as_float(x, name: str, *, finite: bool = True) -> mx.array:
    """Float input in, float32 out (float16/bfloat16/float32; float64 from NumPy is narrowed)."""
    a = as_array(x, name)
    if a.dtype == mx.float64:
        a = a.astype(mx.float32)
    if a.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}: expected a float16, bfloat16 or float32 array, got dtype {_dtype_name(a.dtype)}"
        )
    a = a.astype(mx.float32)
    if finite:
        check_finite(a, name)
    return a


def as_value_float(x, name: str) -> tuple[mx.array, mx.Dtype]:
    """Like as_float, but also return the original dtype (attention outputs keep it)."""
    a = as_array(x, name)
    dt = mx.float32 if a.dtype == mx.float64 else a.dtype
    return as_float(a, name), dt


def check_finite(a: mx.array, name: str) -> None:
    if a.size and not mx.all(mx.isfinite(a)).item():
        bad = int(mx.sum(~mx.isfinite(a)).item())
        raise ValueError(f"{name}: expected finite values, found {bad} NaN/inf entries")


def check_no_overflow(a: mx.array, name: str, inputs: str) -> mx.array:
    """``a`` computed from finite inputs: an inf/NaN entry means a product or sum overflowed float32 (max ~3.4e38),
    and the result would be garbage; raise, naming the result and the inputs to scale down."""
    if a.size and not mx.all(mx.isfinite(a)).item():
        bad = int(mx.sum(~mx.isfinite(a)).item())
        raise ValueError(f"{name}: float32 overflow ({bad} inf/NaN entries from finite inputs); {inputs} are too "
                         "large in magnitude: scale them down")
    return a


def check_ndim(a: mx.array, name: str, min_ndim: int, layout: str) -> None:
    if a.ndim < min_ndim:
        raise ValueError(f"{name}: expected shape {layout} (at least {min_ndim} dims), got shape {tuple(a.shape)}")


def check_head_dim(d: int, name: str = "head_dim") -> int:
    if not isinstance(d, numbers.Integral) or d <= 0 or d % 2:
        raise ValueError(f"{name}: expected a positive even head dimension, got {d!r}")
    return int(d)


def check_dim(a: mx.array, name: str, axis: int, expected: int, what: str) -> None:
    if a.shape[axis] != expected:
        raise ValueError(
            f"{name}: expected size {expected} on axis {axis} ({what}), got shape {tuple(a.shape)}"
        )


def check_inv_freqs(inv_freqs, d: int) -> mx.array:
    w = as_float(inv_freqs, "inv_freqs")
    if w.shape != (d // 2,):
        raise ValueError(f"inv_freqs: expected shape ({d // 2},) for head_dim {d}, got shape {tuple(w.shape)}")
    return w


def as_positions(positions, name: str = "positions", *, real: bool = False) -> mx.array:
    """Positions (any shape); returned as float32 for angle computation.

    Integer positions always; with ``real`` (ROPE-APPLY/ROPE-INVERSE and the clauses that rotate as they do,
    EQ-12) also finite real ones, as ROPE-APPLY allows ("real positions are allowed (negative ones too)").
    """
    if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        p = np.asarray(int(positions))
    elif isinstance(positions, mx.array):
        p = positions
    elif real and isinstance(positions, numbers.Real) and not isinstance(positions, bool):
        p = np.asarray(float(positions))
    else:
        p = np.asarray(positions)
    if isinstance(p, np.ndarray):
        kind = p.dtype.kind
    elif mx.issubdtype(p.dtype, mx.integer):
        kind = "i"
    else:
        kind = "f" if mx.issubdtype(p.dtype, mx.floating) else "?"
    if kind not in ("iuf" if real else "iu"):
        expected = "integer or real" if real else "integer"
        raise ValueError(f"{name}: expected {expected} positions, got dtype {p.dtype}")
    if kind == "f":
        p = mx.array(p) if isinstance(p, np.ndarray) else p
        check_finite(p, name)
    if p.size:
        # Extremes as Python numbers in the input's own dtype: an abs() or int64 cast can wrap (uint64, INT64_MIN).
        lo, hi = (p.min().item(), p.max().item()) if isinstance(p, np.ndarray) else (mx.min(p).item(), mx.max(p).item())
        if hi >= MAX_POSITION or lo <= -MAX_POSITION:
            raise ValueError(f"{name}: expected |position| < 2**24 (float32-exact), got range [{lo}, {hi}]")
    p = mx.array(p) if isinstance(p, np.ndarray) else p
    return p.astype(mx.float32)


def check_broadcast(a_shape, b_shape, a_name: str, b_name: str) -> tuple:
    try:
        return tuple(np.broadcast_shapes(tuple(a_shape), tuple(b_shape)))
    except ValueError:
        raise ValueError(
            f"{a_name} shape {tuple(a_shape)} does not broadcast with {b_name} shape {tuple(b_shape)}"
        ) from None


def check_nonneg_int(v, name: str) -> int:
    if type(v) is int and v >= 0:   # the common case without the ABC check: these run on every decode step
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {v!r}")
    return int(v)


def check_bool(v, name: str) -> bool:
    """A real bool (or NumPy bool): bool("no") and bool(1.0) are True, so a string or number would pick a branch
    the caller did not ask for."""
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {v!r} ({type(v).__name__})")
    return bool(v)


#: 2^24: float32 holds every integer below it, not all above (R_b's angle is b * inv_freq in float32)
B_LIMIT = 1 << 24


def check_pos_int(v, name: str) -> int:
    if type(v) is int and v > 0:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    return int(v)


def check_topk(topk) -> bool:
    """Validate RET-TOPK's topk; True when it is a token count (an int), False when a fraction of the tokens."""
    if type(topk) is float and 0.0 < topk <= 1.0:
        return False
    if isinstance(topk, bool):
        raise ValueError(f"topk: expected a float in (0, 1] or an int >= 1, got {topk!r}")
    if isinstance(topk, numbers.Integral):
        if topk < 1:
            raise ValueError(f"topk: expected an int >= 1 (or a float fraction in (0, 1]), got {topk}")
        return True
    if isinstance(topk, numbers.Real):
        if not (0.0 < float(topk) <= 1.0):
            raise ValueError(f"topk: expected a float fraction in (0, 1] (or an int >= 1), got {topk}")
        return False
    raise ValueError(f"topk: expected a float in (0, 1] or an int >= 1, got {type(topk).__name__}")


def check_codebook_size(K) -> int:
    K = check_pos_int(K, "K")
    if K > MAX_CODEBOOK:
        raise ValueError(f"K: codes are at most 16-bit, so K must be <= 65536, got {K}")
    return K


def check_codebook(C: mx.array, d: int, name: str = "C") -> None:
    if C.ndim < 2 or C.shape[-1] != d:
        raise ValueError(f"{name}: expected codebook shape (..., K, {d}) matching head_dim {d}, got shape {tuple(C.shape)}")
    check_codebook_size(C.shape[-2])


def as_codes(codes, name: str = "codes") -> mx.array:
    c = as_array(codes, name)
    if not mx.issubdtype(c.dtype, mx.integer):
        raise ValueError(f"{name}: expected an integer array (uint8/uint16), got dtype {_dtype_name(c.dtype)}")
    return c


def check_codes_range(c: mx.array, K: int, name: str = "codes") -> None:
    if c.size:
        lo, hi = mx.min(c).item(), mx.max(c).item()
        if lo < 0 or hi >= K:
            raise ValueError(f"{name}: expected values in [0, {K}) for a codebook of {K} entries, got range [{lo}, {hi}]")


def _flat_mats(H: mx.array):
    d = H.shape[-1]
    return H.reshape(-1, d, d)


def _index(i: int, batch_shape) -> tuple:
    return tuple(int(v) for v in np.unravel_index(i, batch_shape)) if batch_shape else ()


def check_square(H: mx.array, name: str = "H") -> int:
    if H.ndim < 2 or H.shape[-1] != H.shape[-2]:
        raise ValueError(f"{name}: expected square matrices (..., d, d), got shape {tuple(H.shape)}")
    return H.shape[-1]


def check_symmetric(H: mx.array, name: str = "H", rtol: float = 1e-5) -> None:
    """EQ-13's band: reject max|H - H^T| > 1e-5 max|H| (SPEC allows rejection from 1e-10 max|H|; the reference takes
    the lenient end so that a float32 moment whose triangles differ by a few ulps is accepted)."""
    check_square(H, name)
    flat = _flat_mats(H)
    asym = mx.max(mx.abs(flat - mx.swapaxes(flat, -1, -2)), axis=(-2, -1))
    scale = mx.maximum(mx.max(mx.abs(flat), axis=(-2, -1)), 1e-30)
    bad = np.nonzero(np.array(asym > rtol * scale))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}: expected symmetric matrices; matrix {_index(i, H.shape[:-2])} has max |H - H^T| = "
            f"{asym[i].item():.3g} (relative tolerance {rtol:g})"
        )


def check_spd(H: mx.array, name: str = "H") -> None:
    """Symmetric positive definite, checked per matrix (reports the failing index)."""
    check_symmetric(H, name)
    flat = _flat_mats(H)
    # eigvalsh is CPU-only in MLX; the matrices are small (d x d).
    ev = mx.linalg.eigvalsh(0.5 * (flat + mx.swapaxes(flat, -1, -2)), stream=mx.cpu)
    lo = mx.min(ev, axis=-1)
    bad = np.nonzero(np.array(lo <= 0))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}: expected positive definite matrices; matrix {_index(i, H.shape[:-2])} has smallest "
            f"eigenvalue {lo[i].item():.3g} (add a ridge, e.g. query_moment(..., ridge=1e-6))"
        )


def check_cholesky_conditioning(L: mx.array, name: str = "L") -> None:
    """A stored Cholesky factor must be invertible in float32: smallest/largest diagonal >= MIN_L_DIAG_RATIO."""
    diag = mx.diagonal(L, axis1=-2, axis2=-1)
    ratio = mx.min(diag, axis=-1) / mx.max(diag, axis=-1)
    if diag.size and mx.any(ratio < MIN_L_DIAG_RATIO).item():
        raise ValueError(
            f"{name}: ill-conditioned Cholesky factor (smallest/largest diagonal {mx.min(ratio).item():.3g} < "
            f"{MIN_L_DIAG_RATIO:g}); C = Cz L^-1 would overflow. Recalibrate (EQ-10's ridge prevents this)"
        )


def check_lower_triangular(L: mx.array, name: str = "L", *, d: int | None = None) -> None:
    """L must be (..., d, d) lower triangular with a positive diagonal (a Cholesky factor); d: the head dim it must match."""
    if d is not None and (L.ndim < 2 or L.shape[-2:] != (d, d)):
        raise ValueError(f"{name}: expected shape (..., {d}, {d}) matching head_dim {d}, got shape {tuple(L.shape)}")
    check_square(L, name)
    upper = mx.triu(L.reshape(-1, L.shape[-1], L.shape[-1]), k=1)
    if mx.any(upper != 0).item():
        raise ValueError(f"{name}: expected lower-triangular matrices (zero above the diagonal)")
    diag = mx.diagonal(L, axis1=-2, axis2=-1)
    if diag.size and not mx.all(diag > 0).item():
        raise ValueError(f"{name}: expected a positive diagonal (a Cholesky factor), got min {mx.min(diag).item():.3g}")
