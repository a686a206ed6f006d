"""Mutants of the windowed RoPE score and the far side (EQ-11, EQ-12): the near/far boundary, the far
position b, far keys left rotated or de-rotated at the wrong positions, the far query's positions."""

from __future__ import annotations

import numpy as np

from a2ats_conformance.mutants.base import Mutant


class DerotateScalarOffset(Mutant):
    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        p0 = np.full_like(p, p.reshape(-1)[0]) if p.size else p
        return self._ref.far_keys(k_post, p0, inv_freqs, traditional=traditional)


class WindowOffByOne(Mutant):
    def wrope_scores(self, q, k, *, w, b, **kw):
        return self._ref.wrope_scores(q, k, w=w + 1, b=b, **kw)


class BTiedToW(Mutant):
    def wrope_scores(self, q, k, *, w, b, **kw):
        return self._ref.wrope_scores(q, k, w=w, b=w, **kw)


class FarKeysRotated(Mutant):
    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        return np.array(k_post, copy=True)


class WropeDefaultRightAligned(Mutant):
    def wrope_scores(self, q, k, *, q_positions=None, k_positions=None, **kw):
        Tq, Tk = np.shape(q)[-2], np.shape(k)[-2]
        if q_positions is None and Tk >= Tq:
            q_positions = np.arange(Tk - Tq, Tk)
        return self._ref.wrope_scores(q, k, q_positions=q_positions, k_positions=k_positions, **kw)


class FarQueryScalarAsOffset(Mutant):
    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        if positions is not None and np.ndim(positions) == 0:
            positions = int(positions) + np.arange(np.shape(q)[-2])
        return self._ref.far_query(q, b=b, inv_freqs=inv_freqs, traditional=traditional, positions=positions)


class FarKeysFlattenedHeads(Mutant):
    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        k, p = np.asarray(k_post), np.asarray(positions)
        if k.ndim > 2 and p.ndim == 1:
            rows = np.repeat(p, int(np.prod(k.shape[:-2])))
            flat = self._ref.far_keys(k.reshape(-1, k.shape[-1]), rows, inv_freqs, traditional=traditional)
            return np.asarray(flat).reshape(k.shape)
        return self._ref.far_keys(k_post, positions, inv_freqs, traditional=traditional)
