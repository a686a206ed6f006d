"""ROPE-FREQ, ROPE-APPLY, ROPE-INVERSE — rotary position embedding with per-token positions.

Angle of pair i at position m is m * inv_freqs[i]; a pair (a, b) rotates to
(a cos t - b sin t, a sin t + b cos t). traditional=True pairs (x[2i], x[2i+1]),
traditional=False pairs (x[i], x[i + d/2]). The float32 cos/sin tables use the
same inverse frequencies as mx.fast.rope, so rope_invert undoes mlx-lm's rotation
to rounding, token by token (a block rotation by -offset would not).
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx
import mlx.nn as nn

from a2ats_ref import checks

SUPPORTED_SCALING = ("default", "linear", "llama3")


def _base_inv_freqs(d: int, base: float) -> mx.array:
    # Same float32 expression mx.fast.rope evaluates when given `base`, so angles agree bit for bit.
    half = d // 2
    return mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(base) / half))


def _llama3_inv_freqs(d: int, base: float, factor: float, low: float, high: float, old_len: float) -> mx.array:
    # Mirrors mlx_lm.models.rope_utils.Llama3RoPE, which hands mx.fast.rope periods (angle = pos / period).
    periods = base ** (mx.arange(0, d, 2) / d)
    wavelens = 2 * mx.pi * periods
    periods = mx.where(wavelens > old_len / low, periods * factor, periods)
    medium = (wavelens > old_len / high) & (wavelens < old_len / low)
    smooth = (old_len / wavelens - low) / (high - low)
    periods = mx.where(medium, periods / ((1 - smooth) / factor + smooth), periods)
    return (1.0 / periods).astype(mx.float32)


def rope_inv_freqs(head_dim: int, base: float, scaling: dict | None = None) -> mx.array:
    """ROPE-FREQ: inverse frequencies (head_dim/2,) float32, as mlx-lm's rope modules build them."""
    d = checks.check_head_dim(head_dim)
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
        raise ValueError(f"base: expected a finite RoPE base > 1, got {base!r}")
    kind = "default"
    if scaling is not None:
        kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind not in SUPPORTED_SCALING:
        raise ValueError(
            f"scaling: RoPE scaling type {kind!r} is not supported (A2ATS needs a fixed, invertible "
            f"per-token rotation); supported types: {', '.join(SUPPORTED_SCALING)}"
        )
    if kind == "default":
        return _base_inv_freqs(d, base)
    factor = _scaling_number(scaling, "factor", None)
    if not factor > 0:
        raise ValueError(f"scaling['factor']: expected a positive number for {kind!r} scaling, got {factor!r}")
    if kind == "linear":
        return _base_inv_freqs(d, base) / factor
    low = _scaling_number(scaling, "low_freq_factor", 1.0)
    high = _scaling_number(scaling, "high_freq_factor", 4.0)
    old_len = _scaling_number(scaling, "original_max_position_embeddings", 8192)
    if not (0 < low < high and old_len > 0):
        # low == high would divide by zero in the medium band's blend; low <= 0 makes the bands meaningless
        raise ValueError(f"scaling: llama3 needs 0 < low_freq_factor < high_freq_factor and "
                         f"original_max_position_embeddings > 0; got low_freq_factor={low!r}, "
                         f"high_freq_factor={high!r}, original_max_position_embeddings={old_len!r}")
    return _llama3_inv_freqs(d, base, factor, low, high, old_len)


def _scaling_number(scaling: dict, key: str, default):
    """scaling[key] (or its default when left out) as a finite real, else ValueError naming the key."""
    if key not in scaling and default is not None:
        return default
    v = scaling.get(key)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"scaling[{key!r}]: expected a finite number, got {v!r}")
    return v


def rope_params_from_module(rope_module, head_dim: int | None = None) -> tuple[mx.array, bool]:
    """(inv_freqs, traditional) of an mlx-lm rope module (nn.RoPE or Llama3RoPE, full rotary dim)."""
    from mlx_lm.models.rope_utils import Llama3RoPE  # deferred: equation modules import without mlx-lm

    name = type(rope_module).__name__
    if type(rope_module) is nn.RoPE:
        dims = rope_module.dims
        if dims % 2:
            raise ValueError(f"rope_module: expected an even rotary dim, got {dims}")
        inv = _base_inv_freqs(dims, rope_module.base) * rope_module.scale
    elif type(rope_module) is Llama3RoPE:
        dims = rope_module.dims
        inv = (1.0 / rope_module._freqs).astype(mx.float32)
    else:
        raise ValueError(
            f"rope_module: {name} is not supported (its rotation is not a fixed per-token RoPE that "
            "A2ATS can invert); supported: nn.RoPE (default/linear scaling), Llama3RoPE"
        )
    if head_dim is not None and dims != head_dim:
        raise ValueError(
            f"rope_module: rotates {dims} of {head_dim} head dims (partial rotary); A2ATS needs the full head_dim"
        )
    return inv, bool(rope_module.traditional)


def fast_rope_args(rope_module) -> dict:
    """The angle arguments an mlx-lm rope module hands mx.fast.rope: {"base", "scale"} or {"freqs"}.

    Kept by the cache so it can undo the rotation with the very kernel that applied it (applied_cos_sin).
    """
    from mlx_lm.models.rope_utils import Llama3RoPE  # deferred: equation modules import without mlx-lm

    if type(rope_module) is Llama3RoPE:
        return {"freqs": rope_module._freqs.astype(mx.float32)}
    if type(rope_module) is nn.RoPE:
        return {"base": float(rope_module.base), "scale": float(rope_module.scale)}
    rope_params_from_module(rope_module)  # raises the unsupported-module ValueError
    raise AssertionError("unreachable")


def fast_rope_to_json(args: dict | None):
    """fast_rope_args as JSON-safe data (floats as hex, exact), None stays None."""
    if args is None:
        return None
    if "freqs" in args:
        return {"freqs": [float(x).hex() for x in args["freqs"].tolist()]}
    return {"base": float(args["base"]).hex(), "scale": float(args["scale"]).hex()}


def fast_rope_from_json(obj) -> dict | None:
    """Inverse of fast_rope_to_json."""
    if obj is None:
        return None
    if "freqs" in obj:
        return {"freqs": mx.array([float.fromhex(x) for x in obj["freqs"]], dtype=mx.float32)}
    return {"base": float.fromhex(obj["base"]), "scale": float.fromhex(obj["scale"])}


def applied_cos_sin(positions: mx.array, d: int, traditional: bool, args: dict) -> tuple[mx.array, mx.array]:
    """cos, sin (..., d/2) of the angles mx.fast.rope applies at `positions` (...,) on the current device;
    `positions` may also be a range (step 1): cos, sin (n, d/2).

    mx.fast.rope's angles depend on the device: on MLX CUDA with `base=` they differ from the CPU's (and
    from m * inv_freqs) by up to 1.2e-2 rad at position 90,000. Rotating the unit vectors (1, 0) of every
    pair with the same call reads the angles back exactly as applied: a (N, 1, 1, d) input with an (N,)
    offset array rotates row n by positions[n].
    """
    if isinstance(positions, range):
        # a run of positions: one sequence of n tokens from a scalar offset, the very call mlx-lm makes (and on MLX
        # CUDA 0.32 a (n,) offset array fails to launch for some n, e.g. 251: cudaGraphAddKernelNode)
        if positions.step != 1 or len(positions) < 1:
            raise ValueError(f"positions: expected a non-empty range with step 1, got {positions!r}")
        n, lead, offset = len(positions), (1, 1, len(positions)), positions.start
        shape_out = (n, d // 2)
    else:
        flat = positions.reshape(-1).astype(mx.int32)
        n, lead, offset = flat.shape[0], (flat.shape[0], 1, 1), flat
        shape_out = tuple(positions.shape) + (d // 2,)
    half = d // 2
    one, zero = mx.ones(lead + (half,), mx.float32), mx.zeros(lead + (half,), mx.float32)
    if traditional:
        unit = mx.stack([one, zero], axis=-1).reshape(lead + (d,))
    else:
        unit = mx.concatenate([one, zero], axis=-1)
    y = mx.fast.rope(unit, d, traditional=traditional, base=args.get("base"), scale=args.get("scale", 1.0),
                     offset=offset, freqs=args.get("freqs")).reshape(n, d)
    c, s = (y[:, 0::2], y[:, 1::2]) if traditional else (y[:, :half], y[:, half:])
    return c.reshape(shape_out), s.reshape(shape_out)


def rotate_by_tables(x: mx.array, c: mx.array, s: mx.array, traditional: bool, sign: float) -> mx.array:
    """rotate_unchecked with given cos/sin tables (broadcasting against x's pairs) instead of m * inv_freqs."""
    d = x.shape[-1]
    s = sign * s
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
    ra, rb = a * c - b * s, a * s + b * c
    if traditional:
        return mx.stack([ra, rb], axis=-1).reshape(ra.shape[:-1] + (d,))
    return mx.concatenate([ra, rb], axis=-1)


def rotation_args(x, positions, inv_freqs) -> tuple[mx.array, mx.array, mx.array]:
    """ROPE-APPLY/ROPE-INVERSE preconditions; returns float32 (x, positions, inv_freqs) for rotate_unchecked."""
    x = checks.as_float(x, "x")
    checks.check_ndim(x, "x", 1, "(..., d)")
    d = checks.check_head_dim(x.shape[-1], "x.shape[-1] (head_dim)")
    w = checks.check_inv_freqs(inv_freqs, d)
    p = checks.as_positions(positions, real=True)
    checks.check_broadcast(p.shape, x.shape[:-1], "positions", "x[..., :-1]")
    return x, p, w


def rotate_unchecked(x: mx.array, positions: mx.array, inv_freqs: mx.array, traditional: bool, sign: float) -> mx.array:
    """The rotation (sign=+1: R_p, -1: R_p^T) with no validation, hence no host syncs, for the decode hot path.

    x, positions, inv_freqs must already be float32 (rotation_args makes them so).
    """
    theta = positions[..., None] * inv_freqs
    return rotate_by_tables(x, mx.cos(theta), mx.sin(theta), traditional, sign)


def rope_apply(x, positions, inv_freqs, *, traditional: bool) -> mx.array:
    """ROPE-APPLY: x (..., T, d) rotated by R_p per token; positions broadcast against x.shape[:-1]."""
    return rotate_unchecked(*rotation_args(x, positions, inv_freqs), traditional, 1.0)


def rope_invert(x, positions, inv_freqs, *, traditional: bool) -> mx.array:
    """ROPE-INVERSE: x R_p^T per token, so rope_invert(rope_apply(x, p), p) == x."""
    return rotate_unchecked(*rotation_args(x, positions, inv_freqs), traditional, -1.0)
