"""A faithful port whose RoPE frequencies follow transformers (4.45's ``modeling_rope_utils``), ROPE-FREQ.

transformers reads a llama3 ``rope_scaling`` with ``rope_scaling["low_freq_factor"]`` and the like, so a dict that
leaves a key out raises KeyError where mlx-lm fills ROPE-FREQ's defaults. Released configs carry every key, so
the port is faithful on every real model; it declares ``rope_scaling: ("complete",)`` and the suite draws
complete dicts for it. The type is read as transformers reads it (``rope_type``, else ``type``); the suite's
dicts never give two different types. Built on the independent NumPy port.
"""

from __future__ import annotations

import math

import numpy as np

from a2ats_conformance.examples import numpy_port as _np_port


def _default_inv_freq(dim: int, base: float) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))


def rope_inv_freqs(head_dim, base, scaling=None):
    """transformers' ROPE_INIT_FUNCTIONS for "default", "linear" and "llama3", in NumPy (float64)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even int >= 2, got {head_dim!r}")
    if not isinstance(base, (int, float, np.floating)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base: expected a finite number > 1, got {base!r}")
    inv_freq = _default_inv_freq(int(head_dim), float(base))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"scaling: unsupported rope type {kind!r}; supported: default, linear, llama3")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]                      # KeyError when left out, as in transformers
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


class Adapter:
    name = "transformers-RoPE port (tests/ports)"
    version = "1"
    dtypes = ("float64", "float32")
    capabilities = {"rope_scaling": ("complete",)}

    def __init__(self):
        port = _np_port.NumpyPort()
        for name, fn in vars(port).items():
            if callable(fn) and name != "rope_inv_freqs":
                setattr(self, name, fn)
        self.make_cache = port.make_cache
        self.rope_inv_freqs = rope_inv_freqs


class Undeclared(Adapter):
    """The same port without its declaration: the defaults test fails and says what to declare."""

    capabilities = None
