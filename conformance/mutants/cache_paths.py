"""Mutants of the cache's inner paths (CACHE-DECODE, CACHE-FAR-CODES, CACHE-CHUNK): the path
make_a2ats_cache builds (the model's own RoPE: fast_rope, angle tables), the host decode path and the host
attention kernels (prefill through the hook). Each runs the reference cache with some a2ats_ref functions
replaced for the length of a call."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from a2ats_conformance.adapters.reference import ReferenceCache
from a2ats_conformance.mutants.base import Mutant, _SameClassOnLoad

from a2ats_ref import prefill as _prefill
from a2ats_ref.eq16_z_transform import assign_z_unchecked
from a2ats_ref.rope import applied_cos_sin, rotate_by_tables
from a2ats_ref.runtime import coding as _coding
from a2ats_ref.runtime.decode import dispatch, portable as fd


class _HostPathHeadZeroCache(_SameClassOnLoad, ReferenceCache):
    """On the host selection path only (>= HOST_SELECT_MIN candidates), every query head of a GQA group
    ranks tokens with the group's first head's LUT row: the union degenerates to one head's top-k."""

    def decode(self, q_post):
        original, auto = fd._select_host, dispatch.auto_method

        def first_head_only(lut, codes, **kw):
            return original(mx.broadcast_to(lut[:, :1, :], lut.shape), codes, **kw)

        fd._select_host = first_head_only
        # the host path on every device (off the CPU, auto takes the sort-free step at any length)
        dispatch.auto_method = lambda n, **shape: "host" if n >= fd.HOST_SELECT_MIN else auto(n, **shape)
        try:
            return super().decode(q_post)
        finally:
            fd._select_host, dispatch.auto_method = original, auto


class HostPathHeadZero(Mutant):
    def make_cache(self, config):
        return _HostPathHeadZeroCache(config)


class _PatchedCache(_SameClassOnLoad, ReferenceCache):
    """A reference cache whose calls run with some a2ats_ref functions replaced: ``patches(self)`` returns
    (module, name, replacement) triples, applied for the length of each protocol call only."""

    def patches(self):
        return []

    def _run(self, method, *a, **kw):
        saved = [(m, n, getattr(m, n)) for m, n, _ in self.patches()]
        for m, n, f in self.patches():
            setattr(m, n, f)
        try:
            return method(*a, **kw)
        finally:
            for m, n, f in reversed(saved):
                setattr(m, n, f)

    def append(self, keys_post, values):
        return self._run(super().append, keys_post, values)

    def decode(self, q_post):
        return self._run(super().decode, q_post)

    def prefill(self, q_post):
        return self._run(super().prefill, q_post)

    def codes(self):
        return self._run(super().codes)

    def save(self, path):
        return self._run(super().save, path)


def _fast_rope_codes(bug):
    """assign_codes whose fast_rope branch (the model's own RoPE) is ``bug(k_post, positions, d, traditional,
    fast_rope) -> k_pre``; the inv_freqs branch is left as it is."""
    original = _coding.assign_codes

    def assign_codes(k_post, positions, codebook, inv_freqs, *, traditional, fast_rope=None, host=False):
        if fast_rope is None:
            return original(k_post, positions, codebook, inv_freqs, traditional=traditional, host=host)
        k_pre = bug(k_post.astype(mx.float32), positions, k_post.shape[-1], traditional, fast_rope)
        return assign_z_unchecked(k_pre, codebook.Cz, codebook.L, codebook.z_operands, host=host)

    return assign_codes


def _undo_tables(k, positions, d, traditional, fast_rope):
    c, s = applied_cos_sin(positions, d, traditional, fast_rope)
    return rotate_by_tables(k, c, s, traditional, -1.0)


class _CodesPostRopeCache(_PatchedCache):
    def patches(self):
        return [(_coding, "assign_codes", _fast_rope_codes(lambda k, p, d, t, fr: k))]


class FastRopeCodesPostRope(Mutant):
    def make_cache(self, config):
        return _CodesPostRopeCache(config)


class _BatchFirstPositionCache(_PatchedCache):
    def patches(self):
        def first_only(k, p, d, t, fr):
            start = p.start if isinstance(p, range) else int(p.reshape(-1)[0].item())
            return _undo_tables(k, range(start, start + 1), d, t, fr)   # (1, d/2) tables broadcast over the batch
        return [(_coding, "assign_codes", _fast_rope_codes(first_only))]


class FastRopeBatchFirstPosition(Mutant):
    def make_cache(self, config):
        return _BatchFirstPositionCache(config)


class _TraditionalIgnoredCache(_PatchedCache):
    def patches(self):
        return [(_coding, "assign_codes", _fast_rope_codes(lambda k, p, d, t, fr: _undo_tables(k, p, d, False, fr)))]


class FastRopeTraditionalIgnored(Mutant):
    def make_cache(self, config):
        return _TraditionalIgnoredCache(config)


class _Bf16PositionsFastRopeCache(_PatchedCache):
    def patches(self):
        def rounded(k, p, d, t, fr):
            pos = mx.arange(p.start, p.stop) if isinstance(p, range) else p
            return _undo_tables(k, pos.astype(mx.bfloat16).astype(mx.int32), d, t, fr)
        return [(_coding, "assign_codes", _fast_rope_codes(rounded))]


class FastRopePositionsBfloat16(Mutant):
    def make_cache(self, config):
        return _Bf16PositionsFastRopeCache(config)


class _QueryAngleNextCache(_PatchedCache):
    """The query's angle table is read at offset, one past the query's own position offset - 1."""

    def patches(self):
        from a2ats_ref.runtime import cache as _cache  # deferred: needs mlx-lm, unlike function mutants

        def query_angle(c):
            if c.fast_rope is None:
                return None
            cs, sn = applied_cos_sin(mx.array([c.offset]), c.codebook.head_dim, c.traditional, c.fast_rope)
            return cs[0], sn[0]
        return [(_cache.A2ATSCache, "_query_angle", query_angle)]


class FastRopeQueryAngleNext(Mutant):
    def make_cache(self, config):
        return _QueryAngleNextCache(config)


class _OneTiedTooFewCache(_PatchedCache):
    """Host top-k: of a tie that straddles a head's k-th score, one token fewer than needed is taken (the first
    head of each group; the tie of the others stays right)."""

    def patches(self):
        original, auto = fd._select_host, dispatch.auto_method

        def one_too_few(lut, codes, *, BH, G, K, kk, c0, c1, bucket):
            idx, keep = original(lut, codes, BH=BH, G=G, K=K, kk=kk, c0=c0, c1=c1, bucket=bucket)
            L, cds = np.asarray(lut), np.asarray(codes).reshape(BH, -1)
            idx, keep = np.array(idx), np.array(keep)
            for g in range(BH):
                cand = L[g, 0, cds[g, c0:c1]]
                thr = np.sort(cand)[::-1][kk - 1]
                taken = idx[g][keep[g]]
                tied = taken[L[g, 0, cds[g, taken]] == thr]
                if 0 < len(tied) < int((cand == thr).sum()):
                    keep[g, idx[g] == tied.max()] = False
            return mx.array(idx), mx.array(keep)

        # the host path on every device (off the CPU, auto takes the sort-free step at any length)
        pick = lambda n, **shape: "host" if n >= fd.HOST_SELECT_MIN else auto(n, **shape)  # noqa: E731
        return [(fd, "_select_host", one_too_few), (dispatch, "auto_method", pick)]


class HostTopkOneTiedTooFew(Mutant):
    def make_cache(self, config):
        return _OneTiedTooFewCache(config)


class _HostPrefillStartAlignedCache(_PatchedCache):
    """The host prefill (causal_attention_host) aligns its causal mask to the start: query t sees keys <= t,
    right only for a first chunk (Tq = Tk)."""

    def patches(self):
        original = _prefill.causal_attention_host

        def start_aligned(queries, keys, values, *, scale):
            Tq = queries.shape[2]
            return original(queries, keys[:, :, :Tq], values[:, :, :Tq], scale=scale)
        return [(_prefill, "causal_attention_host", start_aligned)]


class HostPrefillStartAligned(Mutant):
    def make_cache(self, config):
        return _HostPrefillStartAlignedCache(config)
