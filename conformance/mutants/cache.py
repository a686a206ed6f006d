"""Mutants of the cache protocol (CACHE-*, CODES-DTYPE): trim, chunked prefill, decode, far codes, save and
load, batches, and the dtype of stored codes; each is a ReferenceCache subclass with one bug and the Mutant that
builds it."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from a2ats_spec import oracle as _o

from a2ats_conformance.adapters.reference import ReferenceCache
from a2ats_conformance.mutants.base import Mutant, _SameClassOnLoad, _np, _rows


class _ForgetfulCache(ReferenceCache):
    """trim() rolls back keys, values and offset, but not the position counter that de-rotates
    (and so to code) the tokens written afterwards."""

    def __init__(self, config, _cache=None):
        super().__init__(config, _cache)
        self._drift = 0

    def trim(self, n):
        got = super().trim(n)
        self._drift += got
        return got

    def append(self, keys_post, values):
        if not self._drift:
            return super().append(keys_post, values)
        prev = self.offset
        t = keys_post.shape[-2]
        inv = _np(self.config["inv_freqs"])
        # codes computed as if the tokens sat `drift` positions later: de-rotation by p + drift
        shifted = _o.rope_invert(_np(keys_post), np.full(t, self._drift), inv, traditional=self.config["traditional"])
        super().append(shifted.astype(keys_post.dtype), values)
        self._c.codes_view()   # code the shifted keys now: the cache codes pending tokens lazily, from stored keys
        self._c.keys[..., prev:prev + t, :] = mx.array(keys_post)[None]   # the stored keys themselves are right


class TrimForgetsPositions(Mutant):
    def make_cache(self, config):
        return _ForgetfulCache(config)


class _RowZeroSelectionCache(ReferenceCache):
    """Batched decode selects every row's tokens with row 0's selection (each row attends its own keys)."""

    def decode(self, q_post):
        out, mask = super().decode(q_post)
        if not getattr(self, "batched", False) or mask.shape[0] < 2:
            return out, mask
        mask = np.broadcast_to(mask[:1], mask.shape).copy()
        k, v = self.keys_values()
        out = _o.retrieval_attention(_np(q_post), _np(k), _np(v), mask, scale=self.config.get("scale"))
        return out.astype(np.float32), mask


class BatchRowsReadRowZero(Mutant):
    def make_cache(self, config):
        return _RowZeroSelectionCache(config)


def _bf16_positions(p):
    return np.array(mx.array(np.asarray(p, np.float32)).astype(mx.bfloat16).astype(mx.float32))


class _LowPrecisionPositionsCache(_SameClassOnLoad, ReferenceCache):
    """Codes from keys de-rotated at positions rounded through bfloat16 (exact only up to 256)."""

    def append(self, keys_post, values):
        t = keys_post.shape[-2]
        pos = np.arange(self.offset, self.offset + t)
        err = _bf16_positions(pos) - pos
        if not np.any(err):
            return super().append(keys_post, values)
        prev = self.offset
        # keys rotated by p - round(p): the cache's de-rotation at p then lands at round(p)
        moved = _o.rope_invert(_np(keys_post), err, _np(self.config["inv_freqs"]), traditional=self.config["traditional"])
        super().append(moved.astype(keys_post.dtype), values)
        self._c.codes_view()   # code the moved keys now: the cache codes pending tokens lazily, from stored keys
        self._c.keys[..., prev:prev + t, :] = _rows(self, keys_post)   # the stored keys themselves are right


class PositionsLowPrecision(Mutant):
    def make_cache(self, config):
        return _LowPrecisionPositionsCache(config)


class _ChunkRerotatedCache(_SameClassOnLoad, ReferenceCache):
    """A chunk written after the first stores its keys rotated again by the chunk's start offset (RoPE with
    offset applied to keys that are already post-RoPE); codes are assigned before, so they stay right."""

    def append(self, keys_post, values):
        prev = self.offset
        super().append(keys_post, values)
        if prev:
            t = keys_post.shape[-2]
            again = _o.rope_apply(_np(keys_post), np.full(t, prev), _np(self.config["inv_freqs"]),
                                  traditional=self.config["traditional"])
            self._c.keys[..., prev:prev + t, :] = _rows(self, again.astype(keys_post.dtype))


class ChunkRerotated(Mutant):
    def make_cache(self, config):
        return _ChunkRerotatedCache(config)


class _NoScaleCache(_SameClassOnLoad, ReferenceCache):
    """config["scale"] never reaches the cache's decode (prefill still gets it)."""

    def decode(self, q_post):
        q = self._in(q_post)
        out = self._c.decode(q[:, :, None, :], scale=None)
        return self._out(out[:, :, 0, :]), self._out(self._c.last_selection)


class CacheIgnoresScale(Mutant):
    def make_cache(self, config):
        return _NoScaleCache(config)


class _HalfNoScaleCache(_NoScaleCache):
    """A float16 decode branch that never reads config["scale"]; the float32 branch is right."""

    def decode(self, q_post):
        if np.asarray(q_post).dtype != np.float16:
            return ReferenceCache.decode(self, q_post)
        return super().decode(q_post)


class HalfCacheIgnoresScale(Mutant):
    def make_cache(self, config):
        return _HalfNoScaleCache(config)


class _U16At256Cache(_SameClassOnLoad, ReferenceCache):
    """Codes stored as uint8 only for K < 256: off by one, K = 256 codes (0..255) fit uint8."""

    def codes(self):
        K = np.asarray(self.config["Cz"]).shape[1]
        return super().codes().astype(np.uint8 if K < 256 else np.uint16)


class CacheCodesU16At256(Mutant):
    def make_cache(self, config):
        return _U16At256Cache(config)


class _TrimKeepsCountsCache(_SameClassOnLoad, ReferenceCache):
    """The sort-free (GPU) decode path, which walks per-code counts of the coded tokens; trim drops keys,
    values, codes and offset but leaves those counts as they were."""

    def __init__(self, config, _cache=None):
        super().__init__(config, _cache)
        self._c.select_method = "sortfree"

    def trim(self, n):
        counts = self._c._counts
        kept = None if counts is None else counts.copy()
        got = super().trim(n)
        if kept is not None:
            self._c._counts, self._c._counts_mx = kept, None
        return got


class TrimKeepsCodeCounts(Mutant):
    def make_cache(self, config):
        return _TrimKeepsCountsCache(config)


class _TrimZeroCache(_SameClassOnLoad, ReferenceCache):
    """trim slices the buffers with [:-n]: keys[..., :-0, :] is empty, so trim(0) drops every token."""

    def trim(self, n):
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n == 0:
            self._c.trim(self.offset)
            return 0
        return super().trim(n)


class TrimZeroClears(Mutant):
    def make_cache(self, config):
        return _TrimZeroCache(config)


class _SaveDropsParamCache(ReferenceCache):
    """save() does not write one retrieval parameter; load() leaves it at A2ATSConfig's default."""

    param = ""

    def load(self, path):
        from a2ats_ref.runtime.cache import A2ATSConfig  # deferred: needs mlx-lm, unlike function mutants

        r = super().load(path)
        r._c.config = dataclasses.replace(r._c.config, **{self.param: getattr(A2ATSConfig(), self.param)})
        return type(self)(self.config, r._c)


class _SaveDropsWindowCache(_SaveDropsParamCache):
    param = "w"


class _SaveDropsBCache(_SaveDropsParamCache):
    param = "b"


class SaveDropsWindow(Mutant):
    def make_cache(self, config):
        return _SaveDropsWindowCache(config)


class SaveDropsB(Mutant):
    def make_cache(self, config):
        return _SaveDropsBCache(config)


class _PrefillRowZeroCache(_SameClassOnLoad, ReferenceCache):
    """A batched cache whose prefill reads the cached keys and values of row 0 for every row (k[:1] broadcast
    to the batch, as a port written for batch one does); decode and the batch-of-one cache are right."""

    def prefill(self, q_post):
        if not self.batched:
            return super().prefill(q_post)
        from mlx_lm.models.base import scaled_dot_product_attention  # deferred: needs mlx-lm, unlike function mutants

        k, v = self._c.keys_and_values()
        k, v = mx.broadcast_to(k[:1], k.shape), mx.broadcast_to(v[:1], v.shape)
        scale = self.config.get("scale") or q_post.shape[-1] ** -0.5
        return self._out(scaled_dot_product_attention(self._in(q_post), k, v, cache=self._c, scale=scale, mask="causal"))


class BatchedPrefillRowZero(Mutant):
    def make_cache(self, config):
        return _PrefillRowZeroCache(config)


class _SaveRowZeroCache(_SameClassOnLoad, ReferenceCache):
    """A batched cache whose load restores row 0's keys, values and codes into every row (a save that wrote
    keys[0], as a port written for batch one does); the batch-of-one cache is right."""

    def load(self, path):
        r = super().load(path)
        if self.batched and r.offset:
            r._c.state = tuple(mx.broadcast_to(a[:1], a.shape) for a in r._c.state)
        return r


class SaveBatchRowZero(Mutant):
    def make_cache(self, config):
        return _SaveRowZeroCache(config)


class _PositionsOneBasedCache(_SameClassOnLoad, ReferenceCache):
    """positions() counts from 1 (a cache_position + 1 style slip); keys, codes and decode are right."""

    def positions(self):
        return np.arange(1, self.offset + 1)


class PositionsOneBased(Mutant):
    def make_cache(self, config):
        return _PositionsOneBasedCache(config)


class _CodesWidenOnGrowthCache(_SameClassOnLoad, ReferenceCache):
    """Codes right while the first 256-token buffer lasts; a grown buffer is concatenated with int32 zeros, so
    every code comes back as int32 once more than 256 tokens are cached."""

    def codes(self):
        c = super().codes()
        return c.astype(np.int32) if self.offset > 256 else c


class CodesWidenOnGrowth(Mutant):
    def make_cache(self, config):
        return _CodesWidenOnGrowthCache(config)


class _DecodeSkipsPendingCache(_SameClassOnLoad, ReferenceCache):
    """Codes are assigned lazily; codes() assigns the pending ones, the decode does not and scores pending
    tokens with the buffer's zeros (code 0)."""

    def decode(self, q_post):
        c = self._c
        c._assign_pending = lambda upto: None   # instance attribute: shadows the method for this decode only
        try:
            return super().decode(q_post)
        finally:
            del c._assign_pending


class DecodeSkipsPendingCodes(Mutant):
    def make_cache(self, config):
        return _DecodeSkipsPendingCache(config)


class _StaleQueryAngleCache(_SameClassOnLoad, ReferenceCache):
    """The far query's de-rotation angle is cached at the first decode and reused: later decodes score with
    q_post R_(-i0) R_b, i0 the first decode's position; attention uses the true query."""

    first = None

    def decode(self, q_post):
        i = self.offset - 1
        if self.first is None:
            self.first = i
        if i == self.first:
            return super().decode(q_post)
        cfg = self.config
        inv = _np(cfg["inv_freqs"])
        # q R_(i - i0): the reference de-rotates it by i, which leaves q_post R_(-i0)
        moved = _o.rope_apply(_np(q_post), np.full(np.shape(q_post)[:-1], i - self.first), inv,
                              traditional=cfg["traditional"])
        _, mask = super().decode(moved.astype(np.asarray(q_post).dtype))
        k, v = self.keys_values()
        out = _o.retrieval_attention(_np(q_post), _np(k), _np(v), np.asarray(mask), scale=cfg.get("scale"))
        return out.astype(np.float32), mask


class StaleQueryAngle(Mutant):
    def make_cache(self, config):
        return _StaleQueryAngleCache(config)


class _LoadKeepsCallerOffsetCache(ReferenceCache):
    """load() reads keys, values and codes from the file but keeps the offset of the cache it is called on
    (new = copy(self); new.keys = file keys ...): right only when that cache is the one that saved."""

    def load(self, path):
        r = super().load(path)
        r._c.offset = min(self.offset, r._c.offset)
        r._c._coded = min(r._c._coded, r._c.offset)
        return type(self)(self.config, r._c)


class LoadKeepsCallerOffset(Mutant):
    def make_cache(self, config):
        return _LoadKeepsCallerOffsetCache(config)


class _SaveTrimmedTailCache(ReferenceCache):
    """save() writes every token up to the most ever written (a high-water mark trim does not lower), so the
    tokens of a rejected draft come back on load."""

    def __init__(self, config, _cache=None):
        super().__init__(config, _cache)
        self.written = self.offset

    def append(self, keys_post, values):
        super().append(keys_post, values)
        self.written = max(self.written, self.offset)

    def save(self, path):
        kept = self._c.offset
        self._c.offset = max(self.written, kept)   # the buffers still hold the trimmed tokens
        try:
            super().save(path)
        finally:
            self._c.trim(self._c.offset - kept)


class SaveKeepsTrimmedTokens(Mutant):
    def make_cache(self, config):
        return _SaveTrimmedTailCache(config)


class _BatchOneSqueezedCache(_SameClassOnLoad, ReferenceCache):
    """A batched cache drops the leading batch axis when batch = 1 (np.squeeze on every result)."""

    def _squeeze(self, x):
        return x[0] if self.batched and np.shape(x)[:1] == (1,) else x

    def _out(self, x):
        return self._squeeze(super()._out(x))

    def codes(self):
        return self._squeeze(super().codes())

    def keys_values(self):
        return tuple(self._squeeze(a) for a in super().keys_values())


class BatchOneSqueezed(Mutant):
    def make_cache(self, config):
        return _BatchOneSqueezedCache(config)


class _Float16LutOperandCache(_SameClassOnLoad, ReferenceCache):
    """The cache's LUT operand Cᵀ is prepared in float16 (half the bytes), so every decode's LUT is a product of
    float16 codewords: near ties are ranked wrongly."""

    def __init__(self, config, _cache=None):
        super().__init__(config, _cache)
        cb = self._c.codebook
        cb.__dict__["CT"] = cb.CT.astype(mx.float16)   # the cached_property's slot: every decode reads it


class CacheFloat16LutOperand(Mutant):
    def make_cache(self, config):
        return _Float16LutOperandCache(config)
