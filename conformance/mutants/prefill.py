"""Mutants of attention with query length > 1 (PREFILL): prefill_attention's causal alignment and the
GQA grouping of calibration's collection attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from a2ats_conformance.mutants.base import Mutant, _np

from a2ats_ref.calibration.collect import causal_attention


class PrefillPositiveAxes(Mutant):
    def prefill_attention(self, q, k, v, *, scale=None):
        q, k, v = _np(q), _np(k), _np(v)
        shift = k.shape[1] - q.shape[1]   # Tk - Tq for (n, T, d) inputs only
        Tq, Tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        G = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)
        s = q @ np.swapaxes(k, -1, -2) * (scale or d ** -0.5)
        s = np.where(np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + shift, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True) @ v).astype(np.float32)


class CollectionStridedGroups(Mutant):
    def collection_attention(self, q, k, v, *, scale=None):
        q = np.asarray(q, np.float32)
        n_q, n_kv = q.shape[-3], np.shape(k)[-3]
        G = n_q // n_kv
        perm = [(h % n_kv) * G + h // n_kv for h in range(n_q)]   # head h sits where KV head h % n_kv's group is
        moved = np.empty_like(q)
        moved[..., perm, :, :] = q
        out = causal_attention(mx.array(moved), mx.array(np.asarray(k, np.float32)), mx.array(np.asarray(v, np.float32)),
                               scale=float(scale if scale is not None else q.shape[-1] ** -0.5))
        return np.asarray(out)[..., perm, :, :]
