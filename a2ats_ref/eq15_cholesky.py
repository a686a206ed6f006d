"""EQ-15 — H = L L^T with L lower triangular and a positive diagonal.

H must be symmetric positive definite (EQ-10's ridge guarantees it in practice);
the check names the first failing matrix of a batch.
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks


def cholesky(H) -> mx.array:
    """EQ-15: lower Cholesky factor of symmetric PD H (..., d, d), float32."""
    H = checks.as_float(H, "H")
    checks.check_spd(H, "H")
    # Factorise the exactly symmetric part: the check allows rounding-level asymmetry.
    Hs = 0.5 * (H + mx.swapaxes(H, -1, -2))
    return mx.linalg.cholesky(Hs, upper=False, stream=mx.cpu)
