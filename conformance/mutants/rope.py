"""Mutants of RoPE (ROPE-FREQ, ROPE-APPLY, ROPE-INVERSE, and the INPUT-ERRORS of rope_inv_freqs and the
rotations): scaling defaults and key order, positions taken as an offset, truncated, cut or read from one row."""

from __future__ import annotations

import numpy as np

from a2ats_conformance.mutants.base import Mutant


class Llama3WrongDefaults(Mutant):
    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and (scaling.get("type") or scaling.get("rope_type")) == "llama3":
            scaling = {"original_max_position_embeddings": 4096, "high_freq_factor": 2.0, **scaling}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


class RopeScalarAsOffset(Mutant):
    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.ndim == 0:
            p = p + np.arange(np.shape(x)[-2], dtype=p.dtype)
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


class RopeTruncatesRealPositions(Mutant):
    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.dtype.kind == "f":
            p = np.trunc(p).astype(np.int64)
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


class RopeInvertFirstRowPositions(Mutant):
    def rope_invert(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.ndim >= 2:
            p = np.broadcast_to(p.reshape(-1, p.shape[-1])[0], p.shape).copy()
        return self._ref.rope_invert(x, p, inv_freqs, traditional=traditional)


class RopeTypeKeyOrder(Mutant):
    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and scaling.get("rope_type"):
            scaling = {**scaling, "type": scaling["rope_type"]}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


class RopeUnsupportedAsLinear(Mutant):
    def rope_inv_freqs(self, head_dim, base, scaling=None):
        kind = (scaling.get("type") or scaling.get("rope_type")) if isinstance(scaling, dict) else None
        if kind not in (None, "default", "linear", "llama3"):
            scaling = {"type": "linear", "factor": scaling.get("factor", 1.0)}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


class RopeCutsLongPositions(Mutant):
    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if np.ndim(x) >= 2 and p.ndim == 1 and p.shape[0] > np.shape(x)[-2]:
            p = p[-np.shape(x)[-2]:]
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)
