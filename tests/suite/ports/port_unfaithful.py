"""Unfaithful ports: the independent NumPy port with exactly one known bug each, so that the diagnosis can be
shown to name each bug.

Each class is a port a real author could write: the NumPy port (conformance/examples/numpy_port.py) with one
callable (and, where the bug lives there, its cache) replaced. They are written here, independently of the
shipped mutants (conformance/mutants/) and of the diagnosis library (conformance/diagnosis/deviations.py).
Each says which clause must fail (``clause``), which test of it (``test``, optional) and which known deviation
the report must name as the likely cause (``deviation``, an id of conformance/diagnosis/deviations.py; None
where the library has no entry, e.g. for k-means). tests/suite/ports/test_ports.py runs the suite on each.
"""

from __future__ import annotations

import numpy as np

from a2ats_conformance.examples import numpy_port as P


class _OneBug:
    """The NumPy port's callables, so that a subclass replaces one of them (methods win over these)."""

    version = "1"
    dtypes = ("float64", "float32")
    capabilities: dict = {}
    clause = ""
    test = ""
    profile = "selftest"      # the suite's profile that reliably reaches the bug
    deviation: str | None = None
    cache_class = P.NumpyCache

    def __init__(self):
        self.name = f"unfaithful port {type(self).__name__} (tests/suite/ports)"
        for name, fn in vars(P.NumpyPort()).items():
            if callable(fn) and not callable(getattr(type(self), name, None)):
                setattr(self, name, fn)

    def make_cache(self, config):
        return self.cache_class(config)


def _forced(T, query_pos, w, sinks):
    j = np.arange(T)
    return (j <= query_pos) & ((j < sinks) | (query_pos - j < w))


# ----------------------------------------------------------------------------- RoPE and far position

class LayoutSwapped(_OneBug):
    """Pairs (x[i], x[i+d/2]) where the flag asks for (x[2i], x[2i+1]), and the other way round."""
    clause, deviation = "ROPE-APPLY", "rope-layout-swapped"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        return P.rope_apply(x, positions, inv_freqs, traditional=not traditional)

    def rope_invert(self, x, positions, inv_freqs, *, traditional):
        return P.rope_invert(x, positions, inv_freqs, traditional=not traditional)


class FarWithoutRb(_OneBug):
    """The far query is never rotated to b: q R_0 = q (a port that forgot R_b)."""
    clause, deviation = "EQ-12", "b-missing"

    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        return P.far_query(q, b=0, inv_freqs=inv_freqs, traditional=traditional, positions=positions)


class ScalarDerotation(_OneBug):
    """A block of cached keys de-rotated by its first token's position (rope(offset=-p0) style)."""
    clause, deviation = "EQ-12", "derotate-scalar-position"

    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        first = p.reshape(-1)[0] if p.size else 0
        return P.far_keys(k_post, np.full(p.shape, first), inv_freqs, traditional=traditional)


# ----------------------------------------------------------------------------- calibration and assignment

class HNotNormalised(_OneBug):
    """H = mean of q̃ᵀq̃ + ridge, without the division by its RMS."""
    clause, deviation = "EQ-10", "h-not-normalised"

    def query_moment(self, queries, *, n_kv_heads, b, inv_freqs, traditional, ridge=1e-6):
        q = np.asarray(queries)
        n_q, N, d = q.shape
        qb = P.rope_apply(q, b, inv_freqs, traditional=traditional).reshape(n_kv_heads, -1, d)
        return np.einsum("gnd,gne->gde", qb, qb) / qb.shape[1] + ridge * np.eye(d)


class LTransposed(_OneBug):
    """z = k Lᵀ (the factor used as if it were upper triangular)."""
    clause, deviation = "EQ-16", "l-transposed"

    def z_transform(self, k, L):
        P.z_transform(k, L)                    # same input checks
        return np.asarray(k) @ np.swapaxes(np.asarray(L), -1, -2)

    def assign_z(self, k, Cz, L):
        z = self.z_transform(k, L)
        d2 = np.sum((z[..., None, :] - np.asarray(Cz)) ** 2, axis=-1)
        return np.argmin(d2, axis=-1)


class CosineBlend(_OneBug):
    """VeloxQuant-MLX's assignment without a calibrated H: argmax of ½·cos(k, c) − ½·‖k − c‖² / (1 + max‖k − c‖²)."""
    clause, deviation = "EQ-14", "cosine-blend"

    def assign(self, k, C, H):
        P.assign(k, C, H)                      # same input checks
        k, C = np.asarray(k, np.float64), np.asarray(C, np.float64)
        unit = lambda x: x / (np.linalg.norm(x, axis=-1, keepdims=True) + 1e-12)  # noqa: E731
        cos = unit(k) @ unit(C).T
        d2 = np.sum((k[..., None, :] - C) ** 2, axis=-1)
        return np.argmax(0.5 * cos - 0.5 * d2 / (1.0 + d2.max(axis=-1, keepdims=True)), axis=-1)


# ----------------------------------------------------------------------------- selection

class WindowInclusive(_OneBug):
    """The window keeps i − j <= w instead of i − j < w."""
    clause, deviation = "RET-SELECT", "window-inclusive"

    def select_tokens(self, scores, *, w, **kw):
        return P.select_tokens(scores, w=w + 1, **kw)


class SinksNotForced(_OneBug):
    """The first `sinks` tokens compete as ordinary candidates."""
    clause, deviation = "RET-SELECT", "sinks-not-forced"

    def select_tokens(self, scores, *, sinks, **kw):
        return P.select_tokens(scores, sinks=0, **kw)


class GqaOneHead(_OneBug):
    """Each KV head keeps the top-k of the first query head of its group (no union over the group)."""
    clause, deviation = "RET-SELECT", "gqa-one-head"

    def select_tokens(self, scores, *, n_kv_heads, **kw):
        s = np.asarray(scores)
        G = s.shape[-2] // n_kv_heads
        return P.select_tokens(s[..., ::G, :], n_kv_heads=n_kv_heads, **kw)


class TopkOverT(_OneBug):
    """The top-k count is taken over the whole row, int(topk · T), not over the i + 1 tokens the query sees."""
    clause, deviation = "RET-SELECT", "topk-over-T"
    capabilities = {"topk": ("fraction",)}     # an int count is the same over T and over i + 1
    profile = "ci"              # the bug shows only for query_pos < T - 1 with a fraction whose counts differ

    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        s = np.asarray(scores)
        T = s.shape[-1]
        forced = _forced(T, query_pos, w, sinks)
        n_cand = int(np.sum(np.arange(T) <= query_pos) - forced.sum())
        k = P.topk_count(T, topk, n_cand)
        kw = dict(n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks)
        if k >= 1:
            return P.select_tokens(s, topk=k, **kw)
        if forced.any():                                      # no candidate at all: sinks and window only
            return P.select_tokens(s, topk=1, **kw) & forced
        return np.zeros_like(P.select_tokens(s, topk=1, **kw)) | (np.arange(T) == query_pos)   # never empty: own token


# ----------------------------------------------------------------------------- decode

def _decode_with(scores_fn=None, keys_fn=None, duplicates=False):
    """RET-DECODE assembled from parts, one of which is replaced by the bug."""

    def decode_step(q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        q_post, k_post, v = (np.asarray(x, np.float64) for x in (q_post, k_post, v))
        codes, C = np.asarray(codes).astype(np.int64), np.asarray(C, np.float64)
        n_q, d = q_post.shape[-2:]
        n_kv, T = k_post.shape[-3:-1]
        G = n_q // n_kv
        kw = dict(b=b, inv_freqs=inv_freqs, traditional=traditional)
        if scores_fn is None:
            q_b = P.far_query(q_post, positions=query_pos, **kw)
        else:
            q_b = scores_fn(q_post, k_post, query_pos, G, kw)
        scores = P.token_scores(P.lut_scores(q_b, C, scale=scale), codes)
        forced = _forced(T, query_pos, w, sinks)
        visible = np.arange(T) <= query_pos
        if duplicates:   # top-k over every visible token, forced ones included, then forced added again
            k = P.topk_count(query_pos + 1, topk, int(visible.sum() - forced.sum()))
            if k == 0 and not forced.any():          # RET-SELECT never empty: the query's own token
                forced = np.arange(T) == query_pos
            ranked = np.where(visible, scores, -np.inf)
            top = np.argsort(-ranked, axis=-1, kind="stable")[..., :k]
            picked = np.zeros(scores.shape, bool)
            np.put_along_axis(picked, top, True, axis=-1)
            picked = picked.reshape(scores.shape[:-2] + (n_kv, G, T)).any(axis=-2)
            mult = picked.astype(np.float64) + forced
        else:
            mult = P.select_tokens(scores, n_kv_heads=n_kv, query_pos=query_pos, w=w, sinks=sinks,
                                   topk=topk).astype(np.float64)
        keys = k_post if keys_fn is None else keys_fn(codes, C, T, kw)
        s = 1.0 / np.sqrt(d) if scale is None else scale
        kh, vh, mh = np.repeat(keys, G, axis=-3), np.repeat(v, G, axis=-3), np.repeat(mult, G, axis=-2)
        logits = s * np.einsum("...hd,...htd->...ht", q_post, kh)
        logits = np.where(mh > 0, logits, -np.inf)
        p = mh * np.exp(logits - logits.max(axis=-1, keepdims=True))
        out = np.einsum("...ht,...htv->...hv", p / p.sum(axis=-1, keepdims=True), vh)
        mask = mult > 0
        return (out, mask) if return_mask else out

    return decode_step


def _proxy_query(q_post, k_post, query_pos, G, kw):
    """The newest key of each KV head stands in for its heads' queries (VeloxQuant-MLX)."""
    proxy = np.repeat(k_post[..., int(query_pos), :], G, axis=-2)
    return P.far_query(proxy, positions=query_pos, **kw)


def _quantized_keys(codes, C, T, kw):
    """Attention over the codewords of the tokens, re-rotated to their positions (compression only)."""
    cw = C[np.arange(C.shape[0])[:, None], codes]      # (..., n_kv, T, d)
    return P.rope_apply(cw, np.arange(T), kw["inv_freqs"], traditional=kw["traditional"])


class DuplicateTokens(_OneBug):
    """Top-k runs over all visible tokens; a sink/window token it also picks is attended twice."""
    clause, deviation = "RET-DECODE", "duplicate-tokens"
    decode_step = staticmethod(_decode_with(duplicates=True))


class KeyAsProxyQuery(_OneBug):
    """Tokens are scored with the newest key instead of the query."""
    clause, deviation = "RET-DECODE", "key-as-proxy-query"
    decode_step = staticmethod(_decode_with(scores_fn=_proxy_query))


class CompressionOnly(_OneBug):
    """Attention over the quantized keys C[code] (re-rotated), not the exact retrieved keys."""
    clause, deviation = "RET-DECODE", "quantized-keys-in-attention"
    decode_step = staticmethod(_decode_with(keys_fn=_quantized_keys))


class Float16Lut(_OneBug):
    """The LUT q_b · C is held in float16."""
    clause, deviation = "RET-LUT", "float16-lut"

    def lut_scores(self, q_b, C, *, scale=None):
        out = P.lut_scores(q_b, C, scale=scale)
        return out.astype(np.float16).astype(out.dtype)


# ----------------------------------------------------------------------------- cache

class _ValuesF16Cache(P.NumpyCache):
    def append(self, keys_post, values):
        v = np.asarray(values)
        super().append(keys_post, v.astype(np.float16).astype(v.dtype))


class ValuesQuantized(_OneBug):
    """The cache stores values in float16."""
    clause, deviation = "CACHE-DECODE", "values-quantized"
    test = "test_decode_matches_oracle"       # the long-position and near-tie decode tests add only time here
    cache_class = _ValuesF16Cache


class _PostRopeCodesCache(P.NumpyCache):
    def assign_codes(self, keys_post, positions):
        return np.stack([P.assign_z(keys_post[:, g], self.Cz[g], self.L[g]) for g in range(keys_post.shape[1])],
                        axis=1)


class CodesFromPostRopeKeys(_OneBug):
    """The cache codes the post-RoPE key as it arrives, without de-rotating it (so codes depend on position)."""
    clause, deviation = "CACHE-FAR-CODES", "codes-from-post-rope-keys"
    test = "test_codes_do_not_depend_on_position"
    cache_class = _PostRopeCodesCache


class _LazyCodesCache(P.NumpyCache):
    """Codes live in their own buffer, and only tokens beyond it are coded; trim forgets to cut it."""

    def __init__(self, config):
        super().__init__(config)
        self._coded = self.codes_

    def append(self, keys_post, values):
        start = self.offset
        super().append(keys_post, values)
        fresh = self.codes_[..., max(start, self._coded.shape[-1]):]
        self._coded = np.concatenate([self._coded, fresh], axis=-1)
        self.codes_ = self._coded[..., :self.offset].copy()

    def trim(self, n):
        return super().trim(n)     # self._coded keeps the trimmed tokens' codes


class TrimKeepsCodes(_OneBug):
    """trim() rolls back keys, values and offset, but re-appended tokens reuse the trimmed tokens' codes."""
    clause, deviation = "CACHE-TRIM", "trim-keeps-codes"
    cache_class = _LazyCodesCache


# ----------------------------------------------------------------------------- k-means, own randomness

class _OwnRng(_OneBug):
    capabilities = {"randomness": "own"}

    @staticmethod
    def uniforms(seed, K):
        return np.random.Generator(np.random.Philox(int(seed))).random(int(K))

    def kmeanspp_init(self, z, K, *, seed):
        return P.kmeanspp_init(z, K, self.uniforms(seed, K))

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return P.kmeans_from_uniforms(z, K, self.uniforms(seed, K), max_iter, tol)


class UniformSeeding(_OwnRng):
    """k-means++ replaced by K distinct points drawn uniformly (no D² weighting)."""
    clause, test = "EQ-17-INIT", "test_seeding_frequencies_are_d2_weighted"

    def kmeanspp_init(self, z, K, *, seed):
        z = np.asarray(z)
        rows = np.unique(z, axis=0, return_index=True)[1]
        pick = np.random.Generator(np.random.Philox(int(seed))).choice(np.sort(rows), int(K), replace=False)
        return z[pick]


class SeedingPerturbed(_OwnRng):
    """Seeds are jittered copies of the chosen points (a "break ties" nudge), not input points."""
    clause, test = "EQ-17-INIT", "test_seeding_picks_distinct_input_points"

    def kmeanspp_init(self, z, K, *, seed):
        C = super().kmeanspp_init(z, K, seed=seed)
        return C + 1e-3


class KmeansSumUpdate(_OwnRng):
    """The Lloyd update sets each centre to the sum of its members, not their mean."""
    clause, test = "EQ-17-FIT", "test_kmeans_fit"

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        z = np.asarray(z)
        C = self.kmeanspp_init(z, K, seed=seed)
        hist = []
        for _ in range(max_iter):
            C, codes, f = P.lloyd_step(z, C)
            counts = np.bincount(codes, minlength=K)[:, None]
            C = C * np.maximum(counts, 1)
            hist.append(f)
            if len(hist) >= 2 and hist[-2] - f < tol * hist[-2]:
                break
        d2 = np.sum((z[:, None] - C[None]) ** 2, axis=-1)
        return C, np.argmin(d2, axis=1), hist


class KmeansStaleCodes(_OwnRng):
    """The fit returns the codes of its first assignment (against the seeds), not those of its final centres."""
    clause, test = "EQ-17-FIT", "test_kmeans_fit"

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        C = self.kmeanspp_init(z, K, seed=seed)
        hist, first = [], None
        for _ in range(max_iter):
            C, codes, f = P.lloyd_step(z, C)
            first = codes if first is None else first
            hist.append(f)
            if f == 0 or (len(hist) >= 2 and hist[-2] - f < tol * hist[-2]):
                break
        return C, first, hist


class KmeansOneStep(_OwnRng):
    """The fit stops after one Lloyd step whatever max_iter and tol say."""
    clause, test = "EQ-17-FIT", "test_kmeans_converged_fit_is_a_fixed_point"

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return super().kmeans(z, K, seed=seed, max_iter=1, tol=tol)




class KmeansOldCentreCounted(_OwnRng):
    """The Lloyd update averages the old centre in with its members (a running mean that starts at the centre)."""
    clause, test = "EQ-17-FIT", "test_kmeans_converged_fit_is_a_fixed_point"

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        z = np.asarray(z)
        C = self.kmeanspp_init(z, K, seed=seed)
        hist = []
        for _ in range(max_iter):
            d2 = np.sum((z[:, None] - C[None]) ** 2, axis=-1)
            codes = np.argmin(d2, axis=1)
            hist.append(float(d2[np.arange(len(z)), codes].sum()))
            sums = np.zeros_like(C)
            np.add.at(sums, codes, z)
            C = (sums + C) / (np.bincount(codes, minlength=K) + 1)[:, None]
            if hist[-1] == 0 or (len(hist) >= 2 and hist[-2] - hist[-1] < tol * hist[-2]):
                break
        d2 = np.sum((z[:, None] - C[None]) ** 2, axis=-1)
        return C, np.argmin(d2, axis=1), hist


UNFAITHFUL = {cls.__name__: cls for cls in _OneBug.__subclasses__() + _OwnRng.__subclasses__()
              if cls is not _OwnRng}
