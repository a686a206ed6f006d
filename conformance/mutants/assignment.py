"""Mutants of the query-aware assignment (EQ-13, EQ-14): an assignment that ignores H, codes saturated to
uint8, an H never checked for symmetry."""

from __future__ import annotations

import numpy as np

from a2ats_conformance.mutants.base import Mutant, _np


class CosineBlend(Mutant):
    def assign(self, k, C, H):
        k, C = _np(k), _np(C)
        kn = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-12)
        Cn = C / (np.linalg.norm(C, axis=-1, keepdims=True) + 1e-12)
        cos = kn @ Cn.T
        d2 = np.sum((k[..., None, :] - C) ** 2, axis=-1)
        return np.argmax(0.5 * cos - 0.5 * d2 / (1.0 + d2.max(axis=-1, keepdims=True)), axis=-1)


class AssignCodesSaturate255(Mutant):
    def assign(self, k, C, H):
        return np.minimum(np.asarray(self._ref.assign(k, C, H)).astype(np.int64), 255).astype(np.uint8)


class AssignSymmetrisesH(Mutant):
    def assign(self, k, C, H):
        H = _np(H)
        return self._ref.assign(k, C, ((H + H.T) / 2).astype(np.float32))
