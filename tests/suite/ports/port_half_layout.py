"""A faithful port that implements only the half-split RoPE layout (ROPE-*, EQ-10 … EQ-12, RET-DECODE).

HF Llama and the authors' code pair ``(x[i], x[i + d/2])``; this port knows nothing else. Its own
functions take no layout flag; the adapter accepts ``traditional=False`` and rejects ``True`` with
ValueError. It declares ``rope_layouts: ("half",)``, so the suite only draws the half-split layout.
Built on the independent NumPy port.
"""

from __future__ import annotations

from a2ats_conformance.examples import numpy_port as _np_port

_LAYOUT_FUNCTIONS = ("rope_apply", "rope_invert", "query_moment", "wrope_scores", "far_keys", "far_query",
                     "decode_step")


def _half_only(fn):
    def call(*args, traditional, **kw):
        if traditional is not False:
            raise ValueError(f"traditional: this port implements the half-split layout only (False), got {traditional!r}")
        return fn(*args, traditional=False, **kw)
    call.__name__ = fn.__name__
    return call


class HalfSplitCache:
    def __init__(self, config):
        if config["traditional"] is not False:
            raise ValueError("config['traditional']: this port's cache is half-split only (False)")
        self._inner = _np_port.NumpyCache(config)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class Adapter:
    name = "half-split-only port (tests/suite/ports)"
    version = "1"
    dtypes = ("float64", "float32")
    capabilities = {"rope_layouts": ("half",)}

    def __init__(self):
        port = _np_port.NumpyPort()
        for name, fn in vars(port).items():
            if callable(fn):
                setattr(self, name, _half_only(fn) if name in _LAYOUT_FUNCTIONS else fn)

    def make_cache(self, config):
        return HalfSplitCache(config)
