"""The float64 oracle as an IUT: it must pass the whole suite at float64 tolerance.

This checks the suite itself (a property that rejects the oracle is a wrong property) and gives
port authors an example of the smallest possible adapter.  Its cache is ``OracleCache``, the
float64 model of the cache protocol, so the CACHE-* clauses run too (batch included).
"""

from __future__ import annotations

from a2ats_spec import oracle as _oracle

from a2ats_conformance.harness.adapter import FUNCTION_NAMES


class OracleAdapter:
    name = "a2ats_spec.oracle"
    version = "float64 oracle"
    dtypes = ("float64",)

    def __init__(self):
        for fn in FUNCTION_NAMES:
            setattr(self, fn, getattr(_oracle, fn))

    def make_cache(self, config: dict):
        return _oracle.OracleCache(config)
