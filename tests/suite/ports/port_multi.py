"""Ports with several deviations at once, and a port built on the authors' documented choices.

Each is the independent NumPy port (conformance/examples/numpy_port.py) with several callables (and its cache's
decode) written again here: on purpose without importing the catalogue, the deviation library or the mutants,
so that the port profile is tested on code it has not seen. ``named`` maps each mechanism the port departs in
(an id of a2ats_conformance.catalogue.MECHANISMS) to the variant the profile must name; every other mechanism
must read the spec's variant or not-implemented / not-applicable.
"""

from __future__ import annotations

import numpy as np

from a2ats_conformance.examples import numpy_port as P


class _Port:
    """The NumPy port's callables; a subclass's methods replace them."""

    version = "1"
    dtypes = ("float64", "float32")
    capabilities: dict = {}
    named: dict = {}

    def __init__(self):
        self.name = f"multi-deviation port {type(self).__name__} (tests/ports)"
        for name, fn in vars(P.NumpyPort()).items():
            if callable(fn) and not callable(getattr(type(self), name, None)):
                setattr(self, name, fn)

    def make_cache(self, config):
        # a class of its own, so that a loaded cache (type(self)(config)) decodes as this port does
        return type("Cache", (P.NumpyCache,), {"decode_step": staticmethod(self.decode_step)})(config)


# ----------------------------------------------------------------------------- a compression-style port

_GRID = np.array([[x, y] for x in (-1.8, -0.6, 0.6, 1.8) for y in (-1.7, -0.5, 0.5, 1.7)])   # 16 codewords


def _vq_values(v):
    """Each pair of value components replaced by its nearest 2-D codeword of a fixed 16-entry grid."""
    v = np.asarray(v, dtype=np.float64)
    pairs = v.reshape(v.shape[:-1] + (v.shape[-1] // 2, 2))
    idx = np.argmin(np.sum((pairs[..., None, :] - _GRID) ** 2, axis=-1), axis=-1)
    return _GRID[idx].reshape(v.shape)


class CompressionPort(_Port):
    """Scores tokens with the newest key as a proxy query and without de-rotating it (q·R_i·k), attends over
    the quantized keys C[code] re-rotated at their positions, and reads vector-quantized values."""

    named = {"far-logits": "query-own-position", "decode-far-logits": "query-own-position",
             "selection-signal": "key-proxy", "attention-keys": "quantized", "attention-values": "quantized",
             "cache-values": "quantized"}

    def wrope_scores(self, q, k, *, w, b, inv_freqs, traditional, q_positions=None, k_positions=None):
        q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
        pq = np.arange(q.shape[-2]) if q_positions is None else np.asarray(q_positions)
        pk = np.arange(k.shape[-2]) if k_positions is None else np.asarray(k_positions)
        kw = dict(inv_freqs=inv_freqs, traditional=traditional)
        q_at = P.rope_apply(q, pq, **kw)
        near = q_at @ P.rope_apply(k, pk, **kw).T
        far = q_at @ k.T                      # the query where it sits, the key as cached (position-free)
        return np.where(pq[:, None] - pk[None, :] < w, near, far)

    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        return np.asarray(q, np.float64).copy()   # the query is used where it sits

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        q_post, k_post, C = (np.asarray(x, np.float64) for x in (q_post, k_post, C))
        codes = np.asarray(codes).astype(np.int64)
        n_kv, T = codes.shape[-2:]
        G = q_post.shape[-2] // n_kv
        proxy = np.repeat(k_post[..., int(query_pos), :], G, axis=-2)         # the newest key, for every head
        scores = P.token_scores(P.lut_scores(proxy, C, scale=scale), codes)
        mask = P.select_tokens(scores, n_kv_heads=n_kv, query_pos=query_pos, w=w, sinks=sinks, topk=topk)
        k_hat = np.stack([P.rope_apply(C[g][codes[..., g, :]], np.arange(T), inv_freqs, traditional=traditional)
                          for g in range(n_kv)], axis=-3)
        out = P.retrieval_attention(q_post, k_hat, _vq_values(v), mask, scale=scale)
        return (out, mask) if return_mask else out


# ----------------------------------------------------------------------------- function-level bugs, several per probe

class CalibrationPort(_Port):
    """H from the first head of each group, neither RMS-normalised nor given its ridge; top-k rounded up;
    the window one token wider (i − j <= w)."""

    named = {"h-pooling": "one-head", "h-normalisation": "raw", "h-ridge": "missing", "topk-rounding": "ceil",
             "window": "inclusive"}

    def query_moment(self, queries, *, n_kv_heads, b, inv_freqs, traditional, ridge=1e-6):
        q = np.asarray(queries, np.float64)
        G = q.shape[0] // n_kv_heads
        qb = P.rope_apply(q[::G], b, inv_freqs, traditional=traditional)
        return np.einsum("gnd,gne->gde", qb, qb) / qb.shape[1]

    def topk_count(self, T, topk, n_candidates=None):
        n = int(np.ceil(float(topk) * T)) if isinstance(topk, float) else int(topk)
        return n if n_candidates is None else min(n, n_candidates)

    def wrope_scores(self, q, k, *, w, **kw):
        return P.wrope_scores(q, k, w=w + 1, **kw)


# ----------------------------------------------------------------------------- the authors' documented choices

def _authors_count(T, topk, n_candidates=None):
    """int(topk * seq_len) with PyTorch's promotion: a float32 product."""
    n = int(np.float32(topk) * np.float32(T)) if isinstance(topk, float) else int(topk)
    return n if n_candidates is None else min(n, n_candidates)


class AuthorsPort(_Port):
    """The authors' code where SPEC.md departs from it: an empty cluster's centre collapses to zero, k-means
    stops on an absolute centroid shift, codes are int64, nothing is selected when sinks, window and top-k are
    all empty, and the top-k count is a float32 product."""

    named = {"empty-cluster": "zero", "kmeans-stop": "absolute", "codes-dtype": "int64", "never-empty": "nothing",
             "topk-rounding": "float32"}
    #: the xfails these choices need (clause-or-test-id prefix, reason); test_ports writes them to a file
    xfails = {
        "EQ-17-STEP": "authors: an empty cluster's centre collapses to zero",
        "EQ-17-FIT": "authors: absolute centroid-shift stop, zero-collapse update",
        "CODES-DTYPE": "authors: int64 codes",
        "RET-TOPK": "authors: float32 top-k product",
        "RET-SELECT": "authors: nothing selected at a top-k count of 0; float32 top-k product",
        "RET-DECODE": "authors: float32 top-k product; nothing selected at a top-k count of 0",
        "CACHE-DECODE": "authors: nothing selected at a top-k count of 0 (a NaN output)",
        "CACHE-TRIM": "authors: nothing selected at a top-k count of 0 (a NaN output)",
        "CACHE-SAVE": "authors: nothing selected at a top-k count of 0 (a NaN output)",
        "CACHE-BATCH": "authors: nothing selected at a top-k count of 0 (a NaN output)",
    }

    def lloyd_step(self, z, C):
        P.lloyd_step(z, C)   # its argument checks
        z, C = np.asarray(z, np.float64), np.asarray(C, np.float64)
        d2 = np.sum((z[:, None, :] - C[None]) ** 2, axis=-1)
        labels = np.argmin(d2, axis=1)
        sums = np.zeros_like(C)
        np.add.at(sums, labels, z)
        counts = np.bincount(labels, minlength=C.shape[0]).astype(np.float64)
        return sums / np.where(counts == 0, 1.0, counts)[:, None], labels, float(d2.min(axis=1).sum())

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        P.kmeans(z, K, seed=seed, max_iter=max_iter if isinstance(max_iter, bool) else 1, tol=tol)   # its checks
        P._integer(max_iter, "max_iter", 1)
        z = np.asarray(z, np.float64)
        C = P.kmeanspp_init(z, K, np.random.default_rng(seed).random(K))
        history = []
        for _ in range(max_iter):
            new, _, f = self.lloyd_step(z, C)
            history.append(f)
            shift = float(np.sqrt(np.sum((C - new) ** 2)))
            C = new
            if shift < tol:
                break
        labels = np.argmin(np.sum((z[:, None, :] - C[None]) ** 2, axis=-1), axis=1)
        return C, labels, np.asarray(history)

    def code_dtype(self, K):
        P.code_dtype(K)
        return np.dtype(np.int64)

    def topk_count(self, T, topk, n_candidates=None):
        P.topk_count(T, topk, n_candidates)   # its argument checks
        return _authors_count(T, topk, n_candidates)

    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        P.select_tokens(scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks, topk=topk)   # checks
        s = np.asarray(scores, np.float64)
        n_q, T = s.shape[-2:]
        G = n_q // n_kv_heads
        i, j = int(query_pos), np.arange(T)
        forced = (j <= i) & ((j < sinks) | (i - j < w))
        cand = (j <= i) & ~forced
        k = _authors_count(i + 1, topk, int(cand.sum()))
        ranked = np.where(cand, s, -np.inf)
        top = np.argsort(-ranked, axis=-1, kind="stable")[..., :k]
        pick = np.zeros(s.shape, bool)
        np.put_along_axis(pick, top, True, axis=-1)
        return pick.reshape(s.shape[:-2] + (n_kv_heads, G, T)).any(axis=-2) | forced

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        q_b = P.far_query(q_post, b=b, inv_freqs=inv_freqs, traditional=traditional, positions=query_pos)
        scores = P.token_scores(P.lut_scores(q_b, C, scale=scale), np.asarray(codes))
        mask = self.select_tokens(scores, n_kv_heads=np.asarray(k_post).shape[-3], query_pos=query_pos, w=w,
                                  sinks=sinks, topk=topk)
        q, k, vv = (np.asarray(x, np.float64) for x in (q_post, k_post, v))
        G = q.shape[-2] // k.shape[-3]
        s = (1.0 / np.sqrt(q.shape[-1]) if scale is None else scale) * np.einsum(
            "...hd,...htd->...ht", q, np.repeat(k, G, axis=-3))
        s = np.where(np.repeat(mask, G, axis=-2), s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(axis=-1, keepdims=True))   # an empty selection: NaN, as a softmax over nothing
            out = np.einsum("...ht,...htd->...hd", p / p.sum(axis=-1, keepdims=True), np.repeat(vv, G, axis=-3))
        return (out, mask) if return_mask else out

    def make_cache(self, config):
        port = self

        class Cache(P.NumpyCache):
            decode_step = staticmethod(port.decode_step)

            def __init__(self, config):
                super().__init__(config)
                self.codes_ = self.codes_.astype(np.int64)
        return Cache(config)


MULTI = {cls.__name__: cls for cls in (CompressionPort, CalibrationPort, AuthorsPort)}
