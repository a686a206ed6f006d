"""PRECISION — float32 products at float32 precision on every backend, TF32 or not.

SPEC's clause functions promise float32 arithmetic. MLX's CUDA backend (and Metal on chips with
matrix accelerators) runs float32 matmuls as TF32 by default (MLX_ENABLE_TF32, read once per process
at the first float32 GEMM): ~1e-3 relative error instead of ~1e-7. `mm` keeps the clause functions
exact under TF32 by splitting each float32 operand into a TF32-exact head and a tail (3xTF32):
hi·hi + hi·lo + lo·hi, whose error is ~2^-21 relative. Where the process does full float32 GEMMs
(CPU, MLX_ENABLE_TF32=0) `mm` is one plain matmul. Whether TF32 is active is measured once per
device by `tf32_active` (a GEMM whose exact result TF32 cannot represent), not guessed from the
environment. The runtime decode step (fast_decode) keeps the process's own matmul precision: SPEC's
PRECISION section says what the cache promises under TF32.
"""

from __future__ import annotations

import mlx.core as mx

_TF32: dict[str, bool] = {}
# TF32 keeps 10 explicit mantissa bits of float32's 23: clearing the low 13 makes a value TF32-exact.
_HEAD_MASK = 0xFFFFE000


def tf32_active() -> bool:
    """True when float32 matmuls on the default device round their inputs to TF32 (measured once per device)."""
    key = str(mx.default_device())
    if key not in _TF32:
        n = 64
        a = mx.full((n, n), 1.0 + 2.0 ** -20, dtype=mx.float32)   # 1 + 2^-20: exact in float32, not in TF32
        got = (a @ mx.eye(n, dtype=mx.float32))[0, 0].item()
        _TF32[key] = got != 1.0 + 2.0 ** -20
    return _TF32[key]


def _split(x: mx.array) -> tuple[mx.array, mx.array]:
    hi = (x.view(mx.uint32) & _HEAD_MASK).view(mx.float32)
    return hi, x - hi


def mm(a: mx.array, b: mx.array) -> mx.array:
    """a @ b at float32 precision; float32 operands, matmul broadcasting. Call tf32_active() once before
    using mm inside mx.compile (the probe evaluates an array, which a traced function cannot)."""
    if a.dtype != mx.float32 or b.dtype != mx.float32 or not tf32_active():
        return a @ b
    ah, al = _split(a)
    bh, bl = _split(b)
    return ah @ bh + (ah @ bl + al @ bh)


def addmm(c: mx.array, a: mx.array, b: mx.array) -> mx.array:
    """c + a @ b at float32 precision: MLX's fused addmm where GEMMs are full float32, else c + mm(a, b)."""
    if a.dtype != mx.float32 or b.dtype != mx.float32 or not tf32_active():
        return mx.addmm(c, a, b)
    return c + mm(a, b)
