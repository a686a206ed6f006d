"""EQ-18 — key-space codebook C = Cz L^-1 from the z-space (whitened) codebook.

Solved as the triangular system C L = Cz (L^T C^T = Cz^T), never through an
explicit inverse. Decode scores use C; new keys are assigned against Cz.
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks


def back_transform(Cz, L) -> mx.array:
    """EQ-18: Cz (..., K, d), L (..., d, d) lower triangular -> C (..., K, d) float32."""
    Cz = checks.as_float(Cz, "Cz")
    L = checks.as_float(L, "L")
    checks.check_ndim(Cz, "Cz", 2, "(..., K, d)")
    d = checks.check_head_dim(Cz.shape[-1], "Cz.shape[-1] (head_dim)")
    checks.check_lower_triangular(L, "L", d=d)
    lead = checks.check_broadcast(Cz.shape[:-2], L.shape[:-2], "Cz[..., :-2]", "L[..., :-2]")
    Lt = mx.broadcast_to(mx.swapaxes(L, -1, -2), lead + (d, d))
    rhs = mx.broadcast_to(mx.swapaxes(Cz, -1, -2), lead + (d, Cz.shape[-2]))
    Ct = mx.linalg.solve_triangular(Lt, rhs, upper=True, stream=mx.cpu)
    return checks.check_no_overflow(mx.swapaxes(Ct, -1, -2), "C = Cz L^-1 (EQ-18)", "Cz (or 1 / L's diagonal)")
