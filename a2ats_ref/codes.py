"""CODES-DTYPE — the integer dtype that stores codes for a codebook of K entries.

uint8 for K <= 256, uint16 for K <= 65536; larger codebooks are rejected.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from a2ats_ref import checks


def code_dtype(K: int) -> np.dtype:
    """CODES-DTYPE: smallest unsigned NumPy dtype holding codes 0..K-1."""
    K = checks.check_codebook_size(K)
    return np.dtype(np.uint8) if K <= 256 else np.dtype(np.uint16)


def mx_code_dtype(K: int) -> mx.Dtype:
    """The MLX twin of code_dtype (for caches that store codes as mx.arrays)."""
    return mx.uint8 if code_dtype(K) == np.uint8 else mx.uint16
