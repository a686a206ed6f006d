"""Mutant ports: the reference adapter with one realistic bug each.  The suite must reject every
one of them, on the clause the bug violates (tests/suite/test_mutants.py proves it).

Run one by hand:  a2ats-conformance --iut a2ats_conformance.mutants:FarKeysRotated --clauses EQ-12

Several are the departures of VeloxQuant-MLX's "A2ATS-adapted" port listed in DESIGN.md
(cosine-blend assignment, attention over quantized keys); the others are the bugs a port is
likely to have (off-by-one window, one-offset de-rotation, transposed factor, ...).
"""

from __future__ import annotations

import math

import numpy as np

from a2ats_spec import oracle as _o

from a2ats_conformance.adapters.reference import ReferenceAdapter, ReferenceCache

__all__ = ["MUTANTS", "COVERAGE_MUTANTS", "GAP_MUTANTS", "Mutant"]


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


class DerotateScalarOffset(Mutant):
    expected_clause = "EQ-12"
    bug = "far keys de-rotated as a block by the first token's position (mx.fast.rope(offset=-p0) style)"

    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        p0 = np.full_like(p, p.reshape(-1)[0]) if p.size else p
        return self._ref.far_keys(k_post, p0, inv_freqs, traditional=traditional)


class WindowOffByOne(Mutant):
    expected_clause = "EQ-11"
    bug = "near/far boundary off by one: i - j <= w counted as near"

    def wrope_scores(self, q, k, *, w, b, **kw):
        return self._ref.wrope_scores(q, k, w=w + 1, b=b, **kw)


class BTiedToW(Mutant):
    expected_clause = "EQ-11"
    bug = "far position b tied to the window: far tokens scored with R_w instead of R_b"

    def wrope_scores(self, q, k, *, w, b, **kw):
        return self._ref.wrope_scores(q, k, w=w, b=w, **kw)


class FarKeysRotated(Mutant):
    expected_clause = "EQ-12"
    bug = "far keys left rotated (post-RoPE key used as the position-free key)"

    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        return np.array(k_post, copy=True)


class LTransposed(Mutant):
    expected_clause = "EQ-16"
    bug = "z-space transform with L transposed (z = k Lᵀ)"

    def z_transform(self, k, L):
        return _np(k) @ np.swapaxes(_np(L), -1, -2)

    def assign_z(self, k, Cz, L):
        z = self.z_transform(k, L)
        d2 = np.sum((z[..., None, :] - _np(Cz)) ** 2, axis=-1)
        return np.argmin(d2, axis=-1)


class HNotPooled(Mutant):
    expected_clause = "EQ-10"
    bug = "H from the first query head of each GQA group only (not pooled over the group)"

    def query_moment(self, queries, *, n_kv_heads, **kw):
        q = np.asarray(queries)
        G = q.shape[0] // n_kv_heads
        return self._ref.query_moment(q[::G], n_kv_heads=n_kv_heads, **kw)


class CosineBlend(Mutant):
    expected_clause = "EQ-14"
    bug = "VeloxQuant-style cosine-blend assignment instead of Eq. 14 (ignores H)"

    def assign(self, k, C, H):
        k, C = _np(k), _np(C)
        kn = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-12)
        Cn = C / (np.linalg.norm(C, axis=-1, keepdims=True) + 1e-12)
        cos = kn @ Cn.T
        d2 = np.sum((k[..., None, :] - C) ** 2, axis=-1)
        return np.argmax(0.5 * cos - 0.5 * d2 / (1.0 + d2.max(axis=-1, keepdims=True)), axis=-1)


class TopkCeil(Mutant):
    expected_clause = "RET-TOPK"
    bug = "top-k count rounded up (ceil) instead of the authors' int()"

    def topk_count(self, T, topk, n_candidates=None):
        if isinstance(topk, float):
            n = int(math.ceil(topk * T))
            return n if n_candidates is None else min(n, n_candidates)
        return self._ref.topk_count(T, topk) if n_candidates is None else self._ref.topk_count(T, topk, n_candidates)


class UnionMissing(Mutant):
    expected_clause = "RET-SELECT"
    bug = "no GQA union: the group's selection is the first query head's top-k only"

    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        G = s.shape[-2] // n_kv_heads
        return self._ref.select_tokens(s[..., ::G, :], n_kv_heads=n_kv_heads, **kw)


class CompressionOnly(Mutant):
    expected_clause = "RET-DECODE"
    bug = "VeloxQuant-style compression-only attention: quantized keys C[code] (re-rotated) fed to attention"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        out, mask = self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                          topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=scale,
                                          return_mask=True)
        c = np.asarray(codes).astype(np.int64)
        Cq = _np(C)[np.arange(c.shape[-2])[:, None], c]                   # (n_kv, T, d) quantized pre-RoPE keys
        k_hat = _o.rope_apply(Cq, np.arange(c.shape[-1]), _np(inv_freqs), traditional=traditional)
        out = _o.retrieval_attention(_np(q_post), k_hat, _np(v), np.asarray(mask), scale=scale).astype(np.float32)
        return (out, mask) if return_mask else out


class FarQueryInAttention(Mutant):
    expected_clause = "RET-DECODE"
    bug = ("far-position query in exact attention: q R_b against keys at their true positions (relative position "
           "b - j), as the authors' kernel path vqkey/models/llama.py does")

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        out, mask = self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                          topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=scale,
                                          return_mask=True)
        q_far = _o.far_query(_np(q_post), b=b, inv_freqs=_np(inv_freqs), traditional=traditional,
                             positions=query_pos)
        out = _o.retrieval_attention(q_far, _np(k_post), _np(v), np.asarray(mask), scale=scale).astype(np.float32)
        return (out, mask) if return_mask else out


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
        import mlx.core as mx

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
    expected_clause = "CACHE-TRIM"
    bug = "cache trim does not roll back the position counter that codes later tokens"

    def make_cache(self, config):
        return _ForgetfulCache(config)


#: name -> mutant class (each names its expected_clause and bug)
MUTANTS = {cls.__name__: cls for cls in (
    DerotateScalarOffset, WindowOffByOne, BTiedToW, FarKeysRotated, LTransposed, HNotPooled, CosineBlend,
    TopkCeil, UnionMissing, CompressionOnly, TrimForgetsPositions,
    FarQueryInAttention,
)}


# --------------------------------------------------------------------------- coverage mutants
# Bugs in code paths a suite can easily leave unreached: each names the coverage property that kills it
# (tests/suite/test_coverage_mutants.py proves the kill on its clause).

class Float16Lut(Mutant):
    expected_clause = "RET-DECODE"
    coverage_item = "near ties"
    bug = "LUT computed in float16 (q_b and C rounded to float16, float16 scores): near ties ranked wrongly"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        qb = _np(self._ref.far_query(q_post, b=b, inv_freqs=inv_freqs, traditional=traditional,
                                     positions=np.int64(query_pos)))
        C16 = np.asarray(C).astype(np.float16)
        n_q, d = qb.shape[-2:]
        G = n_q // C16.shape[0]
        s = np.float16(1.0 / math.sqrt(d) if scale is None else scale)
        lut = np.stack([(qb[h].astype(np.float16) @ C16[h // G].T) * s for h in range(n_q)])
        scores = _o.token_scores(lut.astype(np.float64), np.asarray(codes)).astype(np.float32)
        mask = self._ref.select_tokens(scores, n_kv_heads=C16.shape[0], query_pos=query_pos, w=w, sinks=sinks, topk=topk)
        out = self._ref.retrieval_attention(q_post, k_post, v, mask, scale=scale)
        return (out, mask) if return_mask else out


def _rows(cache, x):
    """A protocol array as the wrapped A2ATSCache's (B, ...) mx array."""
    import mlx.core as mx

    return mx.array(x) if getattr(cache, "batched", False) else mx.array(x)[None]


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
    expected_clause = "CACHE-BATCH"
    coverage_item = "CACHE-BATCH"
    bug = "batched decode: every row uses row 0's token selection"

    def make_cache(self, config):
        return _RowZeroSelectionCache(config)


class _SameClassOnLoad:
    """Mixin: load() returns the mutant's own cache class, so a loaded cache keeps the bug."""

    def load(self, path):
        return type(self)(self.config, super().load(path)._c)


def _bf16_positions(p):
    import mlx.core as mx

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
    expected_clause = "CACHE-FAR-CODES"
    coverage_item = "positions"
    bug = "token positions held in bfloat16 when keys are de-rotated for their codes (wrong past position 256)"

    def make_cache(self, config):
        return _LowPrecisionPositionsCache(config)


class _HostPathHeadZeroCache(_SameClassOnLoad, ReferenceCache):
    """On the host selection path only (>= HOST_SELECT_MIN candidates), every query head of a GQA group
    ranks tokens with the group's first head's LUT row: the union degenerates to one head's top-k."""

    def decode(self, q_post):
        import mlx.core as mx
        from a2ats_ref.runtime.decode import portable as fd
        from a2ats_ref.runtime.decode import dispatch

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
    expected_clause = "CACHE-DECODE"
    coverage_item = "host selection"
    bug = "host selection path (>= HOST_SELECT_MIN candidates) ranks every head of a GQA group by the first head's scores"

    def make_cache(self, config):
        return _HostPathHeadZeroCache(config)


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
    expected_clause = "CACHE-CHUNK"
    coverage_item = "CACHE-CHUNK"
    bug = "chunked prefill: keys of every chunk after the first stored re-rotated by the chunk's offset"

    def make_cache(self, config):
        return _ChunkRerotatedCache(config)


#: name -> coverage mutant: each reaches a path a thin suite misses, and is killed on expected_clause
COVERAGE_MUTANTS = {cls.__name__: cls for cls in (
    Float16Lut, BatchRowsReadRowZero, PositionsLowPrecision, HostPathHeadZero, ChunkRerotated,
)}


# --------------------------------------------------------------------------- gap mutants
# Bugs a port writer makes that pass a suite which only draws the easy cases. Each class names the clause that
# must reject it (expected_clause), the property that does (gap: "file::test"), and, where the diagnosis
# catalogue has it, the known deviation its failure must name (expected_cause, an id of conformance/deviations.py).
GAP_MUTANTS: dict = {}


def _gap(cls):
    GAP_MUTANTS[cls.__name__] = cls
    return cls


# ---- gaps in EQ-10 and EQ-17 (query moment, k-means)
@_gap
class RidgeIgnored(Mutant):
    expected_clause = "EQ-10"
    bug = "query_moment accepts ridge but never adds ridge*I (H stays singular when N*G < d)"
    gap = "test_eq10_query_moment.py::test_query_moment_matches_oracle"
    expected_cause = "ridge-missing"

    def query_moment(self, queries, *, n_kv_heads, ridge=1e-6, **kw):
        return self._ref.query_moment(queries, n_kv_heads=n_kv_heads, ridge=0.0, **kw)


@_gap
class KmeansppSearchsortedLeft(Mutant):
    expected_clause = "EQ-17-INIT"
    bug = "inverse CDF by np.searchsorted(cum, u*S) (side='left': cum >= u*S, not >): u=0 re-picks a chosen point"
    gap = "test_eq17_kmeans.py::test_kmeanspp_init_on_cdf_boundaries"
    expected_cause = "kmeanspp-cdf-inclusive"

    def kmeanspp_init(self, z, K, uniforms):
        z, u = _np(z), _np(uniforms)
        chosen = [int(math.floor(u[0] * z.shape[0]))]
        D2 = np.sum((z - z[chosen[0]]) ** 2, axis=-1)
        for t in range(1, K):
            cum = np.cumsum(D2)
            n = int(np.searchsorted(cum, u[t] * cum[-1]))
            chosen.append(n)
            D2 = np.minimum(D2, np.sum((z - z[n]) ** 2, axis=-1))
        return z[chosen].astype(np.float32)

def _lloyd_empty_rule(z, C, *, stale_counts=False, tie_high=False):
    """EQ-17-STEP with one empty-cluster bug: donors judged by the sizes before any move, or ties of the
    largest error going to the highest point index."""
    z, C = _np(z), _np(C)
    N, K = z.shape[0], C.shape[0]
    d2 = np.sum((z[:, None, :] - C[None]) ** 2, axis=-1)
    codes = np.argmin(d2, axis=1)
    err = d2[np.arange(N), codes]
    members = codes.copy()
    counts = np.bincount(members, minlength=K)
    before = counts.copy()
    taken = np.zeros(N, bool)
    for e in range(K):
        if counts[e] > 0:
            continue
        size = before[codes] if stale_counts else counts[members]
        cand = np.flatnonzero(~taken & (size >= 2))
        n = int(cand[np.argsort(err[cand], kind="stable")[-1]] if tie_high else cand[np.argmax(err[cand])])
        counts[members[n]] -= 1
        members[n] = e
        counts[e] = 1
        taken[n] = True
    # a cluster the bug empties keeps its input centre (the usual guard against 0/0)
    C_new = np.stack([z[members == j].mean(axis=0) if np.any(members == j) else C[j] for j in range(K)])
    return C_new.astype(np.float32), codes.astype(np.int64), np.float32(err.sum())


@_gap
class EmptyClusterTieHighIndex(Mutant):
    expected_clause = "EQ-17-STEP"
    bug = "empty cluster takes the worst point via argsort(err)[-1]: ties go to the highest point index, not the lowest"
    gap = "test_eq17_kmeans.py::test_lloyd_step_empty_clusters_with_exact_ties"
    expected_cause = "empty-cluster-tie-highest"

    def lloyd_step(self, z, C):
        return _lloyd_empty_rule(z, C, tie_high=True)


@_gap
class EmptyClusterStaleCounts(Mutant):
    expected_clause = "EQ-17-STEP"
    bug = "empty-cluster donors judged by the cluster sizes before any move (not the running sizes): a donor can be emptied"
    gap = "test_eq17_kmeans.py::test_lloyd_step_empty_clusters_with_exact_ties"
    expected_cause = "empty-cluster-stale-sizes"

    def lloyd_step(self, z, C):
        return _lloyd_empty_rule(z, C, stale_counts=True)


# ---- gaps in ROPE-FREQ, RET-TOPK and INPUT-ERRORS
@_gap
class Llama3WrongDefaults(Mutant):
    expected_clause = "ROPE-FREQ"
    bug = ("llama3 scaling: a left-out original_max_position_embeddings defaults to 4096 and high_freq_factor to 2 "
           "(spec and mlx-lm: 8192 and 4)")
    gap = "test_rope.py::test_llama3_left_out_keys_take_the_defaults"
    expected_cause = "llama3-defaults"

    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and (scaling.get("type") or scaling.get("rope_type")) == "llama3":
            scaling = {"original_max_position_embeddings": 4096, "high_freq_factor": 2.0, **scaling}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


@_gap
class TopkFloat32(Mutant):
    expected_clause = "RET-TOPK"
    bug = "top-k count from a float32 product, int(float32(topk) * float32(T)), as the authors' PyTorch computes it"
    gap = "test_retrieval.py::test_topk_count_matches_oracle"
    expected_cause = "topk-float32"

    def topk_count(self, T, topk, n_candidates=None):
        if isinstance(topk, float):
            n = int(np.float32(topk) * np.float32(T))
            return n if n_candidates is None else min(n, n_candidates)
        return self._ref.topk_count(T, topk) if n_candidates is None else self._ref.topk_count(T, topk, n_candidates)


@_gap
class SelectClampsQueryPos(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "select_tokens clamps query_pos into [0, T - 1] instead of raising ValueError"
    gap = "test_input_errors.py::test_select_tokens_rejects_query_pos_out_of_range"

    def select_tokens(self, scores, *, query_pos, **kw):
        T = np.asarray(scores).shape[-1]
        return self._ref.select_tokens(scores, query_pos=min(max(int(query_pos), 0), T - 1), **kw)


@_gap
class TokenScoresClipsCodes(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "token_scores gathers with clipped indices (mx.take does no bounds check): a code >= K reads LUT[K - 1]"
    gap = "test_input_errors.py::test_token_scores_rejects_codes_out_of_range"

    def token_scores(self, lut, codes):
        K = np.asarray(lut).shape[-1]
        c = np.asarray(codes)
        return self._ref.token_scores(lut, np.clip(c.astype(np.int64), 0, K - 1).astype(c.dtype))


@_gap
class DecodeClampsQueryPos(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "decode_step clamps query_pos into [0, T - 1] (the cache's length) instead of raising ValueError"
    gap = "test_input_errors.py::test_decode_step_rejects_query_pos_out_of_range"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, **kw):
        T = np.asarray(k_post).shape[-2]
        return self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=min(max(int(query_pos), 0), T - 1), **kw)


@_gap
class DecodeWrapsCodes(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "decode_step reduces codes modulo K (a wrapping gather) instead of raising ValueError on codes outside [0, K)"
    gap = "test_input_errors.py::test_decode_step_rejects_codes_out_of_range"

    def decode_step(self, q_post, k_post, v, codes, C, **kw):
        K = np.asarray(C).shape[-2]
        c = np.asarray(codes)
        return self._ref.decode_step(q_post, k_post, v, (c.astype(np.int64) % K).astype(np.uint16), C, **kw)


# ---- gaps in the decode scale and the cache (RET-DECODE, CACHE-*, CODES-DTYPE)

@_gap
class DecodeIgnoresScale(Mutant):
    expected_clause = "RET-DECODE"
    bug = "decode_step drops its scale argument (always 1/sqrt(d)), e.g. Gemma's query_pre_attn_scalar ignored"
    gap = "test_retrieval.py::test_decode_step_matches_oracle"
    expected_cause = "attention-scale-wrong"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        return self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                     topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=None,
                                     return_mask=return_mask)


class _NoScaleCache(_SameClassOnLoad, ReferenceCache):
    """config["scale"] never reaches the cache's decode (prefill still gets it)."""

    def decode(self, q_post):
        q = self._in(q_post)
        out = self._c.decode(q[:, :, None, :], scale=None)
        return self._out(out[:, :, 0, :]), self._out(self._c.last_selection)


@_gap
class CacheIgnoresScale(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "the cache's decode ignores config['scale'] (always 1/sqrt(d))"
    gap = "test_cache.py::test_decode_matches_oracle"
    expected_cause = "attention-scale-wrong"

    def make_cache(self, config):
        return _NoScaleCache(config)


class _HalfNoScaleCache(_NoScaleCache):
    """A float16 decode branch that never reads config["scale"]; the float32 branch is right."""

    def decode(self, q_post):
        if np.asarray(q_post).dtype != np.float16:
            return ReferenceCache.decode(self, q_post)
        return super().decode(q_post)


@_gap
class HalfCacheIgnoresScale(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "the cache's float16 decode branch ignores config['scale'] (float32 decodes are right)"
    gap = "test_cache.py::test_decode_matches_oracle"
    half_precision = True   # shows only in the default run's dtype matrix

    def make_cache(self, config):
        return _HalfNoScaleCache(config)


class _U16At256Cache(_SameClassOnLoad, ReferenceCache):
    """Codes stored as uint8 only for K < 256: off by one, K = 256 codes (0..255) fit uint8."""

    def codes(self):
        K = np.asarray(self.config["Cz"]).shape[1]
        return super().codes().astype(np.uint8 if K < 256 else np.uint16)


@_gap
class CacheCodesU16At256(Mutant):
    expected_clause = "CODES-DTYPE"
    bug = "cache stores codes as uint8 only for K < 256 (K = 256 gets uint16); code_dtype() itself is right"
    gap = "test_cache.py::test_cache_codes_dtype"

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


@_gap
class TrimKeepsCodeCounts(Mutant):
    expected_clause = "CACHE-TRIM"
    bug = "trim rolls back keys, values, codes and offset but not the per-code counts the sort-free (GPU) top-k walks"
    gap = "test_cache.py::test_trim_rollback"

    def make_cache(self, config):
        return _TrimKeepsCountsCache(config)


class _TrimZeroCache(_SameClassOnLoad, ReferenceCache):
    """trim slices the buffers with [:-n]: keys[..., :-0, :] is empty, so trim(0) drops every token."""

    def trim(self, n):
        if isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n == 0:
            self._c.trim(self.offset)
            return 0
        return super().trim(n)


@_gap
class TrimZeroClears(Mutant):
    expected_clause = "CACHE-TRIM"
    bug = "trim slices buffers with [:-n]; trim(0) (speculative decoding, every draft accepted) empties the cache"
    gap = "test_cache.py::test_trim_rollback"

    def make_cache(self, config):
        return _TrimZeroCache(config)


# ---- diagnosis gaps (the failure named no cause, or the wrong one)
@_gap
class LutPostRopeQuery(Mutant):
    expected_clause = "RET-DECODE"
    bug = "LUT query is the post-RoPE query times R_b (q_post R_b = q_pre R_{i+b}): never de-rotated from position i"
    gap = "test_retrieval.py::test_decode_step_matches_oracle"
    expected_cause = "query-not-derotated"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        qb = _o.far_query(_np(q_post), b=b, inv_freqs=_np(inv_freqs), traditional=traditional)   # positions left out
        s = _o.token_scores(_o.lut_scores(qb, _np(C)), np.asarray(codes))
        mask = np.asarray(self._ref.select_tokens(s.astype(np.float32), n_kv_heads=np.asarray(C).shape[0],
                                                  query_pos=query_pos, w=w, sinks=sinks, topk=topk))
        out = self._ref.retrieval_attention(q_post, k_post, v, mask, scale=scale)
        return (out, mask) if return_mask else out


@_gap
class TopkOverCandidates(Mutant):
    expected_clause = "RET-SELECT"
    bug = "top-k count int(topk * #candidates) (the i + 1 visible tokens less sinks and window), not int(topk * (i + 1))"
    gap = "test_retrieval.py::test_select_tokens_is_an_allowed_selection"
    expected_cause = "topk-over-candidates"

    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        j = np.arange(np.asarray(scores).shape[-1])
        i = int(query_pos)
        n_cand = int(np.sum((j <= i) & (j >= sinks) & (i - j >= w)))
        if isinstance(topk, float):
            k = int(topk * n_cand)
            topk = k if k >= 1 else 1e-12     # a count of 0 (the never-empty rule still applies)
        return self._ref.select_tokens(scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks, topk=topk)


class _SaveDropsParamCache(ReferenceCache):
    """save() does not write one retrieval parameter; load() leaves it at A2ATSConfig's default."""

    param = ""

    def load(self, path):
        import dataclasses

        from a2ats_ref.runtime.cache import A2ATSConfig

        r = super().load(path)
        r._c.config = dataclasses.replace(r._c.config, **{self.param: getattr(A2ATSConfig(), self.param)})
        return type(self)(self.config, r._c)


class _SaveDropsWindowCache(_SaveDropsParamCache):
    param = "w"


class _SaveDropsBCache(_SaveDropsParamCache):
    param = "b"


@_gap
class SaveDropsWindow(Mutant):
    expected_clause = "CACHE-SAVE"
    bug = "save/load does not store the window w; a loaded cache uses the default w = 64"
    gap = "test_cache.py::test_save_load_roundtrip"
    expected_cause = "load-resets-parameter"

    def make_cache(self, config):
        return _SaveDropsWindowCache(config)


@_gap
class SaveDropsB(Mutant):
    expected_clause = "CACHE-SAVE"
    bug = "save/load does not store the far position b; a loaded cache uses the default b = 2048"
    gap = "test_cache.py::test_save_load_roundtrip"
    expected_cause = "load-resets-parameter"

    def make_cache(self, config):
        return _SaveDropsBCache(config)


# ---- gaps in EQ-13 to EQ-18
def _first_L(L):
    """A stack of L (..., d, d) collapsed to its first matrix: the broadcast written as L[0]."""
    L = np.asarray(L)
    return L.reshape(-1, L.shape[-2], L.shape[-1])[0] if L.ndim > 2 else L


@_gap
class ZTransformBatchedFirstL(Mutant):
    expected_clause = "EQ-16"
    bug = "z_transform with a per-head stack L (n_kv, d, d) uses L[0] for every head"
    gap = "test_eq15_eq16_eq18.py::test_z_transform_per_head_L"

    def z_transform(self, k, L):
        return self._ref.z_transform(k, _first_L(L))


@_gap
class BackTransformBatchedFirstL(Mutant):
    expected_clause = "EQ-18"
    bug = "back_transform with a per-head stack L (n_kv, d, d) solves every head with L[0]"
    gap = "test_eq15_eq16_eq18.py::test_back_transform_per_head_L"

    def back_transform(self, Cz, L):
        return self._ref.back_transform(Cz, _first_L(L))


@_gap
class AssignZCodesUint8(Mutant):
    expected_clause = "EQ-16"
    bug = "assign_z returns uint8 codes (the 256-entry sub-vector habit): codes of K > 256 codebooks wrap modulo 256"
    gap = "test_eq15_eq16_eq18.py::test_assign_z_large_codebook"

    def assign_z(self, k, Cz, L):
        return np.asarray(self._ref.assign_z(k, Cz, L)).astype(np.uint8)


@_gap
class AssignCodesSaturate255(Mutant):
    expected_clause = "EQ-14"
    bug = "assign stores codes in uint8 with a saturating cast (np.minimum(codes, 255)): codes >= 256 read as 255"
    gap = "test_eq13_eq14_assign.py::test_assign_large_codebook"

    def assign(self, k, C, H):
        return np.minimum(np.asarray(self._ref.assign(k, C, H)).astype(np.int64), 255).astype(np.uint8)


@_gap
class CholeskyLooseSymmetry(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "cholesky calls H symmetric up to |H - Hᵀ| <= 1e-3 * max(1, max|H|) (np.allclose-style) and symmetrises it"
    gap = "test_input_errors.py::test_slightly_asymmetric_H"

    def cholesky(self, H):
        H = _np(H)
        asym = float(np.abs(H - np.swapaxes(H, -1, -2)).max()) if H.size else 0.0
        if asym <= 1e-3 * max(1.0, float(np.abs(H).max()) if H.size else 1.0):
            H = (H + np.swapaxes(H, -1, -2)) / 2
        return self._ref.cholesky(H.astype(np.float32))


@_gap
class AssignSymmetrisesH(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "assign never checks that H is symmetric: it uses (H + Hᵀ)/2, so an asymmetric H is silently accepted"
    gap = "test_input_errors.py::test_slightly_asymmetric_H"

    def assign(self, k, C, H):
        H = _np(H)
        return self._ref.assign(k, C, ((H + H.T) / 2).astype(np.float32))


# ---- gaps in batched selection and batched prefill
@_gap
class SelectBatchedStridedGroups(Mutant):
    expected_clause = "RET-SELECT"
    bug = ("select_tokens on scores with leading dims groups query heads strided (h % n_kv, a tile for a repeat) "
           "instead of h // G; (n_q, T) scores are grouped right")
    gap = "test_retrieval.py::test_select_tokens_is_an_allowed_selection"
    expected_cause = "gqa-strided-groups"

    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        if s.ndim > 2:
            G = s.shape[-2] // n_kv_heads
            # KV head g gets query heads g, g + n_kv, ... (as heads laid out kv-major) instead of g*G ... g*G+G-1
            s = s[..., [g + n_kv_heads * j for g in range(n_kv_heads) for j in range(G)], :]
        return self._ref.select_tokens(s, n_kv_heads=n_kv_heads, **kw)


class _PrefillRowZeroCache(_SameClassOnLoad, ReferenceCache):
    """A batched cache whose prefill reads the cached keys and values of row 0 for every row (k[:1] broadcast
    to the batch, as a port written for batch one does); decode and the batch-of-one cache are right."""

    def prefill(self, q_post):
        if not self.batched:
            return super().prefill(q_post)
        import mlx.core as mx
        from mlx_lm.models.base import scaled_dot_product_attention

        k, v = self._c.keys_and_values()
        k, v = mx.broadcast_to(k[:1], k.shape), mx.broadcast_to(v[:1], v.shape)
        scale = self.config.get("scale") or q_post.shape[-1] ** -0.5
        return self._out(scaled_dot_product_attention(self._in(q_post), k, v, cache=self._c, scale=scale, mask="causal"))


@_gap
class BatchedPrefillRowZero(Mutant):
    expected_clause = "CACHE-BATCH"
    bug = "batched prefill attends every row's queries to row 0's keys and values (k[:1] broadcast over the batch)"
    gap = "test_cache.py::test_batched_decode_rows"

    def make_cache(self, config):
        return _PrefillRowZeroCache(config)


class _SaveRowZeroCache(_SameClassOnLoad, ReferenceCache):
    """A batched cache whose load restores row 0's keys, values and codes into every row (a save that wrote
    keys[0], as a port written for batch one does); the batch-of-one cache is right."""

    def load(self, path):
        import mlx.core as mx

        r = super().load(path)
        if self.batched and r.offset:
            r._c.state = tuple(mx.broadcast_to(a[:1], a.shape) for a in r._c.state)
        return r


@_gap
class SaveBatchRowZero(Mutant):
    expected_clause = "CACHE-SAVE"
    bug = "save of a batched cache keeps row 0 only (keys[0]); load gives every row row 0's keys, values and codes"
    gap = "test_cache.py::test_save_load_batched_rows"
    expected_cause = "load-keeps-row-zero"

    def make_cache(self, config):
        return _SaveRowZeroCache(config)


# ---- gaps in ROPE-APPLY and ROPE-INVERSE positions
@_gap
class RopeScalarAsOffset(Mutant):
    expected_clause = "ROPE-APPLY"
    bug = "a scalar position is taken as mx.fast.rope's offset: token t rotated by p + t instead of p"
    gap = "test_rope.py::test_rope_apply_matches_oracle"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.ndim == 0:
            p = p + np.arange(np.shape(x)[-2], dtype=p.dtype)
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


@_gap
class RopeTruncatesRealPositions(Mutant):
    expected_clause = "ROPE-APPLY"
    bug = "positions cast to int before the angle (astype(int32)): real positions 2.5 -> 2, -1.5 -> -1"
    gap = "test_rope.py::test_rope_apply_matches_oracle"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.dtype.kind == "f":
            p = np.trunc(p).astype(np.int64)
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


@_gap
class RopeInvertFirstRowPositions(Mutant):
    expected_clause = "ROPE-INVERSE"
    bug = "rope_invert takes positions as one (T,) vector: a (B, T) positions array uses row 0's for every row"
    gap = "test_rope.py::test_rope_invert_matches_oracle"

    def rope_invert(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.ndim >= 2:
            p = np.broadcast_to(p.reshape(-1, p.shape[-1])[0], p.shape).copy()
        return self._ref.rope_invert(x, p, inv_freqs, traditional=traditional)


# ---- gaps in RoPE and EQ-10..12
# Bugs that pass a suite in which b is only ever drawn at
# values bfloat16 holds exactly, far_keys/far_query and wrope_scores only on 2-D inputs with explicit (T,) positions,
# the two scaling-type keys never disagreed, and the INPUT-ERRORS of RoPE, EQ-10 and ROPE-FREQ were barely probed.

@_gap
class RopeTypeKeyOrder(Mutant):
    expected_clause = "ROPE-FREQ"
    bug = "scaling type read as HF transformers reads it, rope_type before type (spec and mlx-lm: type first)"
    gap = "test_rope.py::test_inv_freqs_type_key_read_first"
    expected_cause = "rope-type-key-order"

    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and scaling.get("rope_type"):
            scaling = {**scaling, "type": scaling["rope_type"]}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


@_gap
class QueryMomentBBfloat16(Mutant):
    expected_clause = "EQ-10"
    bug = "b held as a bfloat16 position tensor (the model's dtype) before R_b: exact at 64, 2048, 4096, not at 3001"
    gap = "test_eq10_query_moment.py::test_query_moment_matches_oracle"
    expected_cause = "b-low-precision"

    def query_moment(self, queries, *, b, inv_freqs, traditional, **kw):
        from a2ats_conformance.deviations import _round

        # the reference rotates by b; rotating the queries by bf16(b) - b first makes that bf16(b) in all
        shift = float(_round(b, "bfloat16")) - b
        q = np.asarray(queries)
        q = _o.rope_apply(_np(q), shift, _np(inv_freqs), traditional=traditional).astype(q.dtype)
        return self._ref.query_moment(q, b=b, inv_freqs=inv_freqs, traditional=traditional, **kw)


@_gap
class WropeDefaultRightAligned(Mutant):
    expected_clause = "EQ-11"
    bug = ("positions left out: queries right-aligned to the keys (Tk - Tq + arange(Tq), as in a decode) instead of "
           "arange(Tq)")
    gap = "test_eq11_eq12_wrope.py::test_wrope_scores_leading_dims_and_default_positions"

    def wrope_scores(self, q, k, *, q_positions=None, k_positions=None, **kw):
        Tq, Tk = np.shape(q)[-2], np.shape(k)[-2]
        if q_positions is None and Tk >= Tq:
            q_positions = np.arange(Tk - Tq, Tk)
        return self._ref.wrope_scores(q, k, q_positions=q_positions, k_positions=k_positions, **kw)


@_gap
class FarQueryScalarAsOffset(Mutant):
    expected_clause = "EQ-12"
    bug = "far_query takes an int position as an offset (mx.fast.rope style): query head h moved by b - (p + h)"
    gap = "test_eq11_eq12_wrope.py::test_far_side_leading_dims_and_position_forms"

    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        if positions is not None and np.ndim(positions) == 0:
            positions = int(positions) + np.arange(np.shape(q)[-2])
        return self._ref.far_query(q, b=b, inv_freqs=inv_freqs, traditional=traditional, positions=positions)


@_gap
class FarKeysFlattenedHeads(Mutant):
    expected_clause = "EQ-12"
    bug = ("far_keys flattens (n_kv, T, d) to rows and pairs them with np.repeat(positions, n_kv) (np.tile is the "
           "right order): heads' keys de-rotated at other tokens' positions")
    gap = "test_eq11_eq12_wrope.py::test_far_side_leading_dims_and_position_forms"

    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        k, p = np.asarray(k_post), np.asarray(positions)
        if k.ndim > 2 and p.ndim == 1:
            rows = np.repeat(p, int(np.prod(k.shape[:-2])))
            flat = self._ref.far_keys(k.reshape(-1, k.shape[-1]), rows, inv_freqs, traditional=traditional)
            return np.asarray(flat).reshape(k.shape)
        return self._ref.far_keys(k_post, positions, inv_freqs, traditional=traditional)


@_gap
class RopeUnsupportedAsLinear(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "unsupported scaling types (yarn, dynamic, longrope, ...) built as linear with their factor, not rejected"
    gap = "test_input_errors.py::test_rope_inv_freqs_rejects_unsupported_types"

    def rope_inv_freqs(self, head_dim, base, scaling=None):
        kind = (scaling.get("type") or scaling.get("rope_type")) if isinstance(scaling, dict) else None
        if kind not in (None, "default", "linear", "llama3"):
            scaling = {"type": "linear", "factor": scaling.get("factor", 1.0)}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


@_gap
class RopeCutsLongPositions(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "positions longer than the T rows silently cut to their last T (positions[-T:], a cache idiom)"
    gap = "test_input_errors.py::test_rotation_rejects_bad_positions_and_inv_freqs"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if np.ndim(x) >= 2 and p.ndim == 1 and p.shape[0] > np.shape(x)[-2]:
            p = p[-np.shape(x)[-2]:]
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


@_gap
class QueryMomentEpsNormalise(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "H / (rms + 1e-12): a KV group whose queries are all zero gets ridge*I instead of a ValueError"
    gap = "test_input_errors.py::test_query_moment_rejects_bad_input"

    def query_moment(self, queries, *, n_kv_heads, b, inv_freqs, traditional, ridge=1e-6):
        q = _o.rope_apply(_np(queries), b, _np(inv_freqs), traditional=traditional)
        n_q, N, d = q.shape
        Q = q.reshape(n_kv_heads, n_q // n_kv_heads * N, d)
        H = np.swapaxes(Q, -1, -2) @ Q / Q.shape[1]
        rms = np.sqrt(np.mean(H ** 2, axis=(-2, -1), keepdims=True))
        return (H / (rms + 1e-12) + ridge * np.eye(d)).astype(np.float32)


# ---- gaps in EQ-13..18 and retrieval
# Bugs that pass a suite drawing only the common shapes and counts; the eight below guard: leading dims, the k-means stop rule and returned codes, the int top-k
# count 1, the never-empty rule beside sinks, a query before the last token, an empty selection, batched attention.
@_gap
class AssignZLeadingRowZero(Mutant):
    expected_clause = "EQ-16"
    bug = "assign_z with keys (..., T, d) (several heads or sequences) codes the first row and broadcasts its codes"
    gap = "test_eq15_eq16_eq18.py::test_assign_z_leading_dims"

    def assign_z(self, k, Cz, L):
        k = np.asarray(k)
        if k.ndim <= 2:
            return self._ref.assign_z(k, Cz, L)
        first = np.asarray(self._ref.assign_z(k.reshape((-1,) + k.shape[-2:])[0], Cz, L))
        return np.broadcast_to(first, k.shape[:-1]).copy()


def _kmeans_fit(z, K, seed, max_iter, tol, stop, codes_of_last_step=False):
    """EQ-17-FIT on the oracle's seeding and Lloyd steps with another stop test ``stop(hist, C_prev, C, tol)``;
    codes_of_last_step: return the last step's codes (nearest its input centres) instead of nearest(z, C_s)."""
    z = _np(z)
    C = _o.kmeanspp_init(z, K, np.random.default_rng(seed).random(K))
    hist = []
    for _ in range(max_iter):
        C_prev = C
        C, codes, f = _o.lloyd_step(z, C_prev)
        hist.append(float(f))
        if stop(hist, C_prev, C, tol):
            break
    if not codes_of_last_step:
        codes = np.argmin(np.sum((z[:, None, :] - C[None]) ** 2, axis=-1), axis=1)
    return C.astype(np.float32), codes.astype(np.int64), np.array(hist, np.float32)


def _relative_stop(hist, C_prev, C, tol):
    return hist[-1] == 0 or (len(hist) >= 2 and hist[-2] - hist[-1] < tol * hist[-2])


@_gap
class KmeansCentroidShiftStop(Mutant):
    expected_clause = "EQ-17-FIT"
    bug = ("k-means stops when the centroids move less than tol (‖C_s − C_(s−1)‖_F < tol, the authors' absolute test) "
           "instead of on the relative objective decrease")
    gap = "test_eq17_kmeans.py::test_kmeans_fit"

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return _kmeans_fit(z, K, seed, max_iter, tol, lambda h, P, C, t: float(np.linalg.norm(C - P)) < t)


@_gap
class KmeansCodesOfLastStep(Mutant):
    expected_clause = "EQ-17-FIT"
    bug = "kmeans returns the last Lloyd step's codes (nearest to C_(s−1)) instead of nearest(z, C_s) of the returned C"
    gap = "test_eq17_kmeans.py::test_kmeans_fit"

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return _kmeans_fit(z, K, seed, max_iter, tol, _relative_stop, codes_of_last_step=True)


@_gap
class TopkOneIsAFraction(Mutant):
    expected_clause = "RET-TOPK"
    bug = "topk_count tests `topk <= 1` for a fraction: the int 1 (one token) is read as 1.0, all T tokens"
    gap = "test_retrieval.py::test_topk_count_matches_oracle"

    def topk_count(self, T, topk, n_candidates=None):
        if not isinstance(topk, bool) and topk <= 1:
            topk = float(topk)
        return self._ref.topk_count(T, topk) if n_candidates is None else self._ref.topk_count(T, topk, n_candidates)


@_gap
class OwnTokenAtCountZero(Mutant):
    expected_clause = "RET-SELECT"
    bug = ("the never-empty rule fires whenever the top-k count is 0: with w = 0 the query's own token is added "
           "although sinks are selected")
    gap = "test_retrieval.py::test_select_tokens_is_never_empty"
    expected_cause = "never-empty-beside-sinks"

    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        mask = np.array(self._ref.select_tokens(scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks,
                                                topk=topk))
        i = int(query_pos)
        n_cand = sum(1 for j in range(i + 1) if j >= sinks and i - j >= w)
        if _o.topk_count(i + 1, topk, n_cand) == 0:
            mask[..., i] = True
        return mask


@_gap
class DecodeQueryAtLastToken(Mutant):
    expected_clause = "RET-DECODE"
    bug = "decode_step takes the query position from the keys' length (i = T − 1) and ignores query_pos"
    gap = "test_retrieval.py::test_decode_step_query_before_the_last_token"
    expected_cause = "decode-query-at-last-token"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, **kw):
        return self._ref.decode_step(q_post, k_post, v, codes, C, query_pos=np.asarray(k_post).shape[-2] - 1, **kw)


@_gap
class AttentionEmptyRowAverages(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = ("retrieval_attention fills unselected logits with -1e9: a KV head that selects nothing averages all its "
           "values instead of raising ValueError")
    gap = "test_input_errors_b.py::test_retrieval_and_codebook_inputs_are_checked"

    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        m = np.asarray(mask)
        if m.dtype != np.bool_ or m.any(axis=-1).all():
            return self._ref.retrieval_attention(q, k, v, mask, scale=scale)
        q, k, v = _np(q), _np(k), _np(v)
        G = q.shape[-2] // k.shape[-3]
        kk, vv, mm = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3), np.repeat(m, G, axis=-2)
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        logits = np.where(mm, s * np.einsum("...hd,...htd->...ht", q, kk), -1e9)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return np.einsum("...ht,...htd->...hd", p / p.sum(axis=-1, keepdims=True), vv).astype(np.float32)


@_gap
class AttentionBatchRowZeroMask(Mutant):
    expected_clause = "RET-ATTN"
    bug = "retrieval_attention with leading dims applies the first row's mask to every row (mask[0] broadcast)"
    gap = "test_retrieval.py::test_retrieval_attention_matches_oracle"

    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        m = np.asarray(mask)
        if m.ndim > 2:
            m = np.broadcast_to(m.reshape((-1,) + m.shape[-2:])[0], m.shape).copy()
        return self._ref.retrieval_attention(q, k, v, m, scale=scale)


# ---- gaps in the cache
# Cache bugs that pass a suite in which positions() is never checked
# against the rule, codes' dtype checked only before the buffers grow, decodes checked only after codes() had
# coded every token and only once per cache, load always called on the cache that saved, batch = 1 and batched
# prefill inputs never drawn.
class _PositionsOneBasedCache(_SameClassOnLoad, ReferenceCache):
    """positions() counts from 1 (a cache_position + 1 style slip); keys, codes and decode are right."""

    def positions(self):
        return np.arange(1, self.offset + 1)


@_gap
class PositionsOneBased(Mutant):
    expected_clause = "CACHE-TRIM"
    bug = "positions() reports 1 .. offset instead of 0 .. offset - 1 (both caches of the trim test agreed)"
    gap = "test_cache.py::test_trim_rollback"

    def make_cache(self, config):
        return _PositionsOneBasedCache(config)


class _CodesWidenOnGrowthCache(_SameClassOnLoad, ReferenceCache):
    """Codes right while the first 256-token buffer lasts; a grown buffer is concatenated with int32 zeros, so
    every code comes back as int32 once more than 256 tokens are cached."""

    def codes(self):
        c = super().codes()
        return c.astype(np.int32) if self.offset > 256 else c


@_gap
class CodesWidenOnGrowth(Mutant):
    expected_clause = "CODES-DTYPE"
    bug = "codes buffer grown past 256 tokens with int32 zeros (concatenate promotes): codes int32 from token 257 on"
    gap = "test_cache.py::test_cache_codes_dtype"

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


# Not a gap mutant: the reference codes every multi-token append as it is written, so the only tokens pending at a
# decode are single appends inside the window, whose codes no selection reads; a cache of this kind shows the bug
# only where more than w single tokens are written between decodes. Kept for the diagnosis's deviation.
class DecodeSkipsPendingCodes(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "lazily coded tokens are coded by codes() but not by decode, which scores them as code 0"
    gap = "test_cache.py::test_generation_steps"
    expected_cause = "decode-scores-uncoded"

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


@_gap
class StaleQueryAngle(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "the far query's de-rotation angle cached at the first decode: every later decode scores as at that position"
    gap = "test_cache.py::test_generation_steps"
    expected_cause = "query-angle-stale"

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


@_gap
class LoadKeepsCallerOffset(Mutant):
    expected_clause = "CACHE-SAVE"
    bug = "load() takes the offset of the cache it is called on, not the file's: a fresh cache loads an empty cache"
    gap = "test_cache.py::test_save_load_roundtrip"

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


@_gap
class SaveKeepsTrimmedTokens(Mutant):
    expected_clause = "CACHE-SAVE"
    bug = "save() writes tokens up to a high-water mark trim does not lower: trimmed draft tokens come back on load"
    gap = "test_cache.py::test_save_load_roundtrip"

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


@_gap
class BatchOneSqueezed(Mutant):
    expected_clause = "CACHE-BATCH"
    bug = "a batched cache with batch = 1 returns its arrays without the leading batch axis (squeezed)"
    gap = "test_cache.py::test_batched_decode_rows"

    def make_cache(self, config):
        return _BatchOneSqueezedCache(config)


@_gap
class PrefillPositiveAxes(Mutant):
    expected_clause = "PREFILL"
    bug = "prefill_attention reads Tq, Tk as q.shape[1], k.shape[1] (written for 3-D inputs): with a leading batch " \
          "axis the causal mask is aligned by n_kv - n_q instead of Tk - Tq"
    gap = "test_prefill_codes.py::test_prefill_attention_matches_oracle"

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


# ---- what users have: GQA groups past 8 heads, k-means past one 512-row block, half-precision inputs
# Each passed the suite whose draws stopped at groups of 3 heads, 40 k-means points and float32 inputs by default.

@_gap
class GroupUnionFirst8Heads(Mutant):
    expected_clause = "RET-SELECT"
    bug = "the GQA union keeps an 8-lane head mask: in groups of 9-16 query heads only the first 8 heads' top-k count"
    gap = "test_retrieval.py::test_select_tokens_is_an_allowed_selection"

    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        G = s.shape[-2] // n_kv_heads
        if G <= 8:
            return self._ref.select_tokens(s, n_kv_heads=n_kv_heads, **kw)
        lanes = np.arange(s.shape[-2]) % G < 8
        return self._ref.select_tokens(s[..., lanes, :], n_kv_heads=n_kv_heads, **kw)


#: rows of one distance block of the reference's k-means (a2ats_ref.eq17_kmeans.BLOCK_ROWS on the CPU)
_KMEANS_BLOCK = 512


@_gap
class KmeansFirstBlockBias(Mutant):
    expected_clause = "EQ-17-STEP"
    bug = "Lloyd assignment over more than one 512-row block adds ||c||^2 twice to the first block's distances " \
          "(a pipelined block prefetch that also adds the norms): rows 0..511 are pulled to small codewords"
    gap = "test_eq17_kmeans.py::test_lloyd_step_matches_oracle"

    def lloyd_step(self, z, C):
        from a2ats_ref.eq17_kmeans import _fix_empty
        from a2ats_spec.oracle import code_dtype

        z64, C64 = _np(z), _np(C)
        if z64.shape[0] <= _KMEANS_BLOCK:
            return self._ref.lloyd_step(z, C)
        c2 = np.sum(C64 ** 2, axis=1)
        dist = c2[None, :] - 2.0 * z64 @ C64.T
        dist[:_KMEANS_BLOCK] += c2[None, :]
        codes = np.argmin(dist, axis=1)
        err = np.sum((z64 - C64[codes]) ** 2, axis=1)
        members = _fix_empty(codes, err, C64.shape[0])
        C_new = np.stack([z64[members == k].mean(axis=0) for k in range(C64.shape[0])])
        return C_new.astype(np.float32), codes.astype(code_dtype(C64.shape[0])), float(err.sum())


@_gap
class Float16ScaleDropped(Mutant):
    expected_clause = "RET-ATTN"
    bug = "with float16 inputs (a separate half-precision kernel) retrieval attention ignores an explicit scale and " \
          "uses 1/sqrt(d)"
    gap = "test_retrieval.py::test_retrieval_attention_matches_oracle"

    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        if np.asarray(q).dtype == np.float16:
            scale = None
        return self._ref.retrieval_attention(q, k, v, mask, scale=scale)


class _Float16LutOperandCache(_SameClassOnLoad, ReferenceCache):
    """The cache's LUT operand Cᵀ is prepared in float16 (half the bytes), so every decode's LUT is a product of
    float16 codewords: near ties are ranked wrongly."""

    def __init__(self, config, _cache=None):
        import mlx.core as mx

        super().__init__(config, _cache)
        cb = self._c.codebook
        cb.__dict__["CT"] = cb.CT.astype(mx.float16)   # the cached_property's slot: every decode reads it


@_gap
class CacheFloat16LutOperand(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "the cache's LUT operand (C transposed) held in float16: the decode ranks near ties by float16 codewords"
    gap = "test_cache_near_ties.py::test_cache_decode_near_ties"
    expected_cause = "float16-lut"

    def make_cache(self, config):
        return _Float16LutOperandCache(config)


# ---- gaps on the path make_a2ats_cache builds (the model's own RoPE: fast_rope, angle tables), the host decode
# path and the host attention kernels (prefill through the hook, calibration's collection)
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
    import mlx.core as mx
    from a2ats_ref.runtime import cache as _cache
    from a2ats_ref.eq16_z_transform import assign_z_unchecked

    original = _cache.assign_codes

    def assign_codes(k_post, positions, codebook, inv_freqs, *, traditional, fast_rope=None, host=False):
        if fast_rope is None:
            return original(k_post, positions, codebook, inv_freqs, traditional=traditional, host=host)
        k_pre = bug(k_post.astype(mx.float32), positions, k_post.shape[-1], traditional, fast_rope)
        return assign_z_unchecked(k_pre, codebook.Cz, codebook.L, codebook.z_operands, host=host)

    return assign_codes


def _undo_tables(k, positions, d, traditional, fast_rope):
    from a2ats_ref.rope import applied_cos_sin, rotate_by_tables

    c, s = applied_cos_sin(positions, d, traditional, fast_rope)
    return rotate_by_tables(k, c, s, traditional, -1.0)


class _CodesPostRopeCache(_PatchedCache):
    def patches(self):
        from a2ats_ref.runtime import cache as _cache
        return [(_cache, "assign_codes", _fast_rope_codes(lambda k, p, d, t, fr: k))]


@_gap
class FastRopeCodesPostRope(Mutant):
    expected_clause = "CACHE-FAR-CODES"
    bug = "with the model's own RoPE (fast_rope), codes are assigned from the post-RoPE keys (no de-rotation)"
    gap = "test_cache.py::test_decode_matches_oracle"

    def make_cache(self, config):
        return _CodesPostRopeCache(config)


class _BatchFirstPositionCache(_PatchedCache):
    def patches(self):
        from a2ats_ref.runtime import cache as _cache

        def first_only(k, p, d, t, fr):
            start = p.start if isinstance(p, range) else int(p.reshape(-1)[0].item())
            return _undo_tables(k, range(start, start + 1), d, t, fr)   # (1, d/2) tables broadcast over the batch
        return [(_cache, "assign_codes", _fast_rope_codes(first_only))]


@_gap
class FastRopeBatchFirstPosition(Mutant):
    expected_clause = "CACHE-FAR-CODES"
    bug = "with the model's own RoPE, every key of a coding batch is de-rotated at the batch's first position"
    gap = "test_cache.py::test_decode_matches_oracle"

    def make_cache(self, config):
        return _BatchFirstPositionCache(config)


class _TraditionalIgnoredCache(_PatchedCache):
    def patches(self):
        from a2ats_ref.runtime import cache as _cache
        return [(_cache, "assign_codes", _fast_rope_codes(lambda k, p, d, t, fr: _undo_tables(k, p, d, False, fr)))]


@_gap
class FastRopeTraditionalIgnored(Mutant):
    expected_clause = "CACHE-FAR-CODES"
    bug = "with the model's own RoPE, keys are de-rotated in the half-split layout whatever `traditional` says"
    gap = "test_cache.py::test_codes_do_not_depend_on_position"

    def make_cache(self, config):
        return _TraditionalIgnoredCache(config)


class _Bf16PositionsFastRopeCache(_PatchedCache):
    def patches(self):
        import mlx.core as mx
        from a2ats_ref.runtime import cache as _cache

        def rounded(k, p, d, t, fr):
            pos = mx.arange(p.start, p.stop) if isinstance(p, range) else p
            return _undo_tables(k, pos.astype(mx.bfloat16).astype(mx.int32), d, t, fr)
        return [(_cache, "assign_codes", _fast_rope_codes(rounded))]


@_gap
class FastRopePositionsBfloat16(Mutant):
    expected_clause = "CACHE-FAR-CODES"
    bug = "with the model's own RoPE, key positions pass through bfloat16 before the de-rotation (wrong past 256)"
    gap = "test_cache.py::test_long_positions"

    def make_cache(self, config):
        return _Bf16PositionsFastRopeCache(config)


class _QueryAngleNextCache(_PatchedCache):
    """The query's angle table is read at offset, one past the query's own position offset - 1."""

    def patches(self):
        import mlx.core as mx
        from a2ats_ref.runtime import cache as _cache
        from a2ats_ref.rope import applied_cos_sin

        def query_angle(c):
            if c.fast_rope is None:
                return None
            cs, sn = applied_cos_sin(mx.array([c.offset]), c.codebook.head_dim, c.traditional, c.fast_rope)
            return cs[0], sn[0]
        return [(_cache.A2ATSCache, "_query_angle", query_angle)]


@_gap
class FastRopeQueryAngleNext(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "with the model's own RoPE, the decode query is de-rotated at offset (the next token), not offset - 1"
    gap = "test_cache.py::test_decode_matches_oracle"

    def make_cache(self, config):
        return _QueryAngleNextCache(config)


class _OneTiedTooFewCache(_PatchedCache):
    """Host top-k: of a tie that straddles a head's k-th score, one token fewer than needed is taken (the first
    head of each group; the tie of the others stays right)."""

    def patches(self):
        import mlx.core as mx
        from a2ats_ref.runtime.decode import dispatch
        from a2ats_ref.runtime.decode import portable as fd

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


@_gap
class HostTopkOneTiedTooFew(Mutant):
    expected_clause = "CACHE-DECODE"
    bug = "host top-k (>= HOST_SELECT_MIN candidates) takes one token too few of a tie at a head's k-th score"
    gap = "test_cache.py::test_host_selection_path"

    def make_cache(self, config):
        return _OneTiedTooFewCache(config)


class _HostPrefillStartAlignedCache(_PatchedCache):
    """The host prefill (causal_attention_host) aligns its causal mask to the start: query t sees keys <= t,
    right only for a first chunk (Tq = Tk)."""

    def patches(self):
        from a2ats_ref import prefill as _prefill

        original = _prefill.causal_attention_host

        def start_aligned(queries, keys, values, *, scale):
            Tq = queries.shape[2]
            return original(queries, keys[:, :, :Tq], values[:, :, :Tq], scale=scale)
        return [(_prefill, "causal_attention_host", start_aligned)]


@_gap
class HostPrefillStartAligned(Mutant):
    expected_clause = "CACHE-CHUNK"
    bug = "host prefill (>= HOST_PREFILL_MIN query x key pairs, through the hook) masks queries start-aligned: " \
          "a later chunk's query t sees keys <= t instead of <= offset + t"
    gap = "test_cache.py::test_long_prefill_chunks"

    def make_cache(self, config):
        return _HostPrefillStartAlignedCache(config)


@_gap
class CollectionStridedGroups(Mutant):
    expected_clause = "PREFILL"
    bug = "calibration's collection attention groups query heads strided: head h reads KV head h % n_kv, not h // G"
    gap = "test_prefill_codes.py::test_collection_attention_matches_oracle"

    def collection_attention(self, q, k, v, *, scale=None):
        import mlx.core as mx
        from a2ats_ref.calibration.collect import causal_attention

        q = np.asarray(q, np.float32)
        n_q, n_kv = q.shape[-3], np.shape(k)[-3]
        G = n_q // n_kv
        perm = [(h % n_kv) * G + h // n_kv for h in range(n_q)]   # head h sits where KV head h % n_kv's group is
        moved = np.empty_like(q)
        moved[..., perm, :, :] = q
        out = causal_attention(mx.array(moved), mx.array(np.asarray(k, np.float32)), mx.array(np.asarray(v, np.float32)),
                               scale=float(scale if scale is not None else q.shape[-1] ** -0.5))
        return np.asarray(out)[..., perm, :, :]
