"""A faithful port whose k-means draws its own randomness (EQ-17-INIT, EQ-17-FIT).

Like the authors' code (torch's generator), this port does not take the suite's uniforms: it is called
``kmeanspp_init(z, K, *, seed)`` and ``kmeans(z, K, *, seed, max_iter, tol)`` and draws from a Philox
generator, a stream the oracle does not follow. It declares ``randomness: "own"``, so the suite checks
its k-means with stream-independent properties only. Built on the independent NumPy port.
"""

from __future__ import annotations

import numpy as np

from a2ats_conformance.examples import numpy_port as _np_port


def _uniforms(seed, K):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise ValueError(f"K: expected an int >= 1, got {K!r}")
    return np.random.Generator(np.random.Philox(int(seed))).random(int(K))


class Adapter:
    name = "own-RNG port (tests/suite/ports)"
    version = "1"
    dtypes = ("float64", "float32")
    capabilities = {"randomness": "own"}

    def __init__(self):
        port = _np_port.NumpyPort()
        for name, fn in vars(port).items():
            if callable(fn) and name not in ("kmeanspp_init", "kmeans"):
                setattr(self, name, fn)
        self.make_cache = port.make_cache

    def kmeanspp_init(self, z, K, *, seed):
        return _np_port.kmeanspp_init(z, K, _uniforms(seed, K))

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return _np_port.kmeans_from_uniforms(z, K, _uniforms(seed, K), max_iter, tol)
