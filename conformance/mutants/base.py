"""What every mutant port stands on: ``Mutant``, the reference adapter whose subclasses override one
callable, and the helpers the mutants' caches share."""

from __future__ import annotations

import numpy as np

from a2ats_conformance.adapters.reference import ReferenceAdapter


def _np(x):
    return np.asarray(x, dtype=np.float64)


class Mutant(ReferenceAdapter):
    """Base: the reference adapter; subclasses override one callable."""

    expected_clause = ""
    bug = ""

    def __init__(self):
        self._ref = ReferenceAdapter()   # the unmodified callables, for the mutants to build on
        super().__init__()
        self.name = f"mutant {type(self).__name__}"

    @property
    def input_dtype(self):
        return self._ref.input_dtype

    @input_dtype.setter
    def input_dtype(self, value):
        self._ref.input_dtype = value


def _rows(cache, x):
    """A protocol array as the wrapped A2ATSCache's (B, ...) mx array."""
    import mlx.core as mx  # deferred: mlx loads after a2ats_ref, which the reference adapter imports first

    return mx.array(x) if getattr(cache, "batched", False) else mx.array(x)[None]


class _SameClassOnLoad:
    """Mixin: load() returns the mutant's own cache class, so a loaded cache keeps the bug."""

    def load(self, path):
        return type(self)(self.config, super().load(path)._c)
