"""Known deviations: the bugs ports are known to have, each written as a variant of
the float64 oracle, so that a failing example can be replayed through it (diagnose.py).

``Model`` is the oracle's algorithm composed from small hooks (which RoPE layout, which far position,
where the window ends, how many tokens a head keeps, which query scores tokens, ...); every adapter
callable and a NumPy cache are built from those hooks, so replacing one hook changes every function
that depends on it, as the bug would in a port. The faithful ``Model()`` equals the oracle (checked in
tests/suite/test_diagnosis.py). A ``Deviation`` is a stable id, the sentence a port author reads, the
callables it can change, and one or more ``Model`` subclasses (its variants: e.g. float16 or bfloat16).

The ids are stable; tests and unfaithful test ports refer to them (table appended from DEVIATIONS):

"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from a2ats_spec import oracle as _o
from a2ats_spec.oracle_cache import OracleCache

from a2ats_conformance.harness.adapter import FUNCTION_NAMES

__all__ = ["Deviation", "DEVIATIONS", "DeviantAdapter", "Model", "ModelCache", "by_id", "shared_results"]

_ROPE = {"rope_apply", "rope_invert"}
_FAR = {"wrope_scores", "far_query", "far_keys"}
_SELECT = {"select_tokens", "decode_step", "make_cache"}
_DECODE = {"decode_step", "make_cache"}
_CODES = {"far_keys", "assign_z", "z_transform", "make_cache"}


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _round(x, dtype: str):
    """Round float64 values through float16 or bfloat16 (round to nearest even)."""
    x = _f(x)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.astype(np.uint32).view(np.float32).astype(np.float64)
    raise ValueError(f"dtype: expected 'float16' or 'bfloat16', got {dtype!r}")


class AllowedMask(np.ndarray):
    """A selection mask carrying the allowed-result sets ``must`` ⊆ mask ⊆ ``may`` under near ties."""

    must = None
    may = None


class AllowedCodes(np.ndarray):
    """Codes carrying ``allowed`` (..., K) bool: the near-optimal codes of each token (argmin_allowed)."""

    allowed = None


def _with_allowed_codes(codes, allowed):
    c = np.asarray(codes).view(AllowedCodes)
    c.allowed = allowed
    return c


class Decoded(tuple):
    """(out, mask) of a decode, with ``attend(mask)``: the model's output over any given selection."""

    def __new__(cls, items, attend=None):
        t = super().__new__(cls, items)
        t.attend = attend
        return t


def _with_allowed(mask, must, may):
    m = np.asarray(mask).view(AllowedMask)
    m.must, m.may = must, may
    return m


# ---------------------------------------------------------------------- results shared between models
# A diagnosis replays one example through dozens of models that differ in one hook each; coding a long cache
# (Eq. 16 with its near-optimal sets) is most of each replay, and most models code it exactly as the faithful
# one does. A coding result is reused for a later model when the inputs are equal and every model attribute the
# coding read (recorded while it ran) resolves to the same object or value: then the same code ran on the same
# data. A model that overrides any hook the coding used recomputes it.

_READS: list | None = None   # names read from a Model while a shared computation runs
_SHARED: dict | None = None  # input digest -> [(reads, result)]; only inside shared_results()
_MISSING = object()


@contextlib.contextmanager
def shared_results():
    """Within this block, ModelCache coding results are shared between models (see above)."""
    global _SHARED
    outer, _SHARED = _SHARED, {}
    try:
        yield
    finally:
        _SHARED = outer


def _binding(model, name):
    own = object.__getattribute__(model, "__dict__")
    return own[name] if name in own else getattr(type(model), name, _MISSING)


def _same_binding(a, b) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, (bool, int, float, str)) and a == b)


def _digest(*parts) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    for x in parts:
        if isinstance(x, dict):
            for k in sorted(x):
                h.update(repr(k).encode())
                h.update(_digest(x[k]))
        elif x is None or isinstance(x, (str, bool, int, float)):
            h.update(repr(x).encode())
        else:
            a = np.asarray(x)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


def _shared(model, key: bytes, compute):
    """compute(), or the result of an earlier compute() on equal inputs (``key``) by a model that read the same
    bindings; outside shared_results() always compute()."""
    global _READS
    if _SHARED is None or _READS is not None:
        return compute()
    for reads, result in _SHARED.get(key, ()):
        if all(_same_binding(_binding(model, n), v) for n, v in reads):
            return result
    _READS = []
    try:
        result = compute()
    finally:
        names, _READS = _READS, None
    if isinstance(result, np.ndarray):
        result.flags.writeable = False   # shared between models: a caller that wrote to it would change others'
    _SHARED.setdefault(key, []).append((tuple((n, _binding(model, n)) for n in dict.fromkeys(names)), result))
    return result


class Model:
    """The oracle's A2ATS, composed from hooks (faithful by default). Adapter callables are methods.

    ``tie``: when set (diagnosis sets the dtype's tie margin), selections carry their allowed-result sets
    and decodes their attention over any selection, so that a port is compared as the suite compares it."""

    def __getattribute__(self, name):
        if _READS is not None and not name.startswith("__"):
            _READS.append(name)   # a shared computation depends on this binding
        return object.__getattribute__(self, name)

    tie = None
    resolution = 0.0   # relative resolution of the scores the model ranks (float16 LUT: its rounding)

    # ------------------------------------------------------------------ hooks (the faithful rule each)
    def layout(self, traditional):           # ROPE-APPLY: which pairs rotate together
        return bool(traditional)

    def pos(self, positions):                # RoPE positions as the angle sees them
        return _f(positions)

    def far_b(self, b, w=None):              # EQ-11/12: the far position
        return b

    def is_near(self, dist, w):              # EQ-11: i - j < w is near
        return dist < w

    def is_sink(self, j, sinks):             # RET-SELECT: sinks are forced
        return j < sinks

    def topk_length(self, i, T, capacity, n_candidates):   # RET-TOPK: a query at i sees i + 1 tokens
        return i + 1                         # (capacity: the cache's buffer; n_candidates: neither sink nor window)

    def count(self, n, topk, n_candidates):  # RET-TOPK: int() of the fraction
        return _o.topk_count(n, topk, n_candidates)

    def adds_own_token(self, k, forced):     # RET-SELECT: never empty, only when nothing else is selected
        return k == 0 and not forced.any()

    def decode_position(self, query_pos, T):  # RET-DECODE: the query sits at query_pos, whatever T is
        return query_pos

    def voters(self, G):                     # RET-SELECT: every head of the group votes (union)
        return range(G)

    def ranking(self, scores):               # RET-SELECT: each head ranks by its own scores
        return scores

    def pooled_heads(self, G):               # EQ-10: H pools every head of the group
        return range(G)

    def normalise(self, H):                  # EQ-10: RMS normalisation
        return H / math.sqrt(float(np.mean(H ** 2)))

    def ridge_added(self, ridge):            # EQ-10: ridge·I added after the normalisation
        return ridge

    def cdf_pick(self, cum, x):              # EQ-17-INIT: smallest n with cumsum(D²)[n] > u·ΣD² (strict)
        return int(np.argmax(cum > x))

    def donor_sizes(self, counts, before, members, codes):   # EQ-17-STEP: the running cluster sizes
        return counts[members]

    def worst(self, err):                    # EQ-17-STEP: the largest error, ties -> lowest point index
        return int(np.argmax(err))

    def z(self, k, L):                       # EQ-16: z = k L
        return _f(k) @ _f(L)

    def far_key(self, k_post, positions, inv, traditional):   # EQ-12: de-rotate each key at its own position
        return self._rope(k_post, positions, inv, traditional, invert=True)

    def lut(self, q_b, C, scale):            # RET-LUT
        return _o.lut_scores(q_b, C, scale=scale)

    def duplicates(self):                    # RET-ATTN: the selected set is a set
        return False

    def code_keys(self, k_pre, cfg):         # CACHE-FAR-CODES: Eq. 16 assignment of the pre-RoPE key
        heads = [self.assign_z(k_pre[g], cfg["Cz"][g], cfg["L"][g]) for g in range(k_pre.shape[0])]
        codes = np.stack([np.asarray(h) for h in heads])
        if all(getattr(h, "allowed", None) is not None for h in heads):
            return _with_allowed_codes(codes, np.stack([h.allowed for h in heads]))
        return codes

    def attention_keys(self, k_post, codes, C, inv, traditional):   # RET-DECODE: exact keys
        return _f(k_post)

    def attention_values(self, v):           # RET-DECODE: exact values
        return _f(v)

    def attention_query(self, q_post, *, query_pos, b, w, inv, traditional):   # RET-DECODE: q at its own position
        return _f(q_post)

    def attention_scale(self, scale, d):     # RET-ATTN/RET-DECODE: the caller's scale, 1/sqrt(d) when None
        return 1.0 / math.sqrt(d) if scale is None else scale

    def selection_query(self, q_post, k_post, query_pos):   # RET-LUT: the true query scores the tokens
        return q_post

    def token_scores_for(self, q_post, k_post, codes, C, *, query_pos, b, w, inv, traditional, scale):
        """RET-LUT: LUT of q R_b (from the post-RoPE query at query_pos) indexed by the codes."""
        q_post = self.selection_query(q_post, k_post, query_pos)
        q_b = self.far_query(q_post, b=self.far_b(b, w), inv_freqs=inv, traditional=traditional,
                             positions=query_pos)
        return _o.token_scores(self.lut(q_b, C, scale), np.asarray(codes))

    # ------------------------------------------------------------------ adapter callables
    def _rope(self, x, positions, inv, traditional, invert=False):
        fn = _o.rope_invert if invert else _o.rope_apply
        return fn(_f(x), self.pos(positions), _f(inv), traditional=self.layout(traditional))

    def rope_inv_freqs(self, *a, **kw):
        return _o.rope_inv_freqs(*a, **kw)

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        return self._rope(x, positions, inv_freqs, traditional)

    def rope_invert(self, x, positions, inv_freqs, *, traditional):
        return self._rope(x, positions, inv_freqs, traditional, invert=True)

    def query_moment(self, queries, *, n_kv_heads, b, inv_freqs, traditional, ridge=1e-6):
        q = _f(queries)
        n_q, N, d = q.shape
        G = n_q // n_kv_heads
        qb = _o.rope_apply(q, self.far_b(b), _f(inv_freqs), traditional=self.layout(traditional))
        out = np.empty((n_kv_heads, d, d))
        for g in range(n_kv_heads):
            Q = np.concatenate([qb[g * G + h] for h in self.pooled_heads(G)])
            out[g] = self.normalise(Q.T @ Q / Q.shape[0]) + self.ridge_added(ridge) * np.eye(d)
        return out

    def wrope_scores(self, q, k, *, w, b, inv_freqs, traditional, q_positions=None, k_positions=None):
        q, k = _f(q), _f(k)
        pq = np.arange(q.shape[-2]) if q_positions is None else _f(q_positions)
        pk = np.arange(k.shape[-2]) if k_positions is None else _f(k_positions)
        near = self._rope(q, pq, inv_freqs, traditional) @ np.swapaxes(self._rope(k, pk, inv_freqs, traditional), -1, -2)
        far = self.far_scores(q, k, pq, pk, b=b, w=w, inv=inv_freqs, traditional=traditional)
        return np.where(self.is_near(pq[:, None] - pk[None, :], w), near, far)

    def far_scores(self, q, k, pq, pk, *, b, w, inv, traditional):
        qb = _o.rope_apply(q, self.far_b(b, w), _f(inv), traditional=self.layout(traditional))
        return qb @ np.swapaxes(k, -1, -2)

    def far_keys(self, k_post, positions, inv_freqs, *, traditional):
        return self.far_key(k_post, positions, inv_freqs, traditional)

    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        q = _f(q)
        b = self.far_b(b)
        if positions is None:
            return _o.rope_apply(q, b, _f(inv_freqs), traditional=self.layout(traditional))
        return _o.rope_apply(q, b - self.pos(positions), _f(inv_freqs), traditional=self.layout(traditional))

    def score_error(self, k, c, H):
        return _o.score_error(k, c, H)

    def assign(self, k, C, H):
        return _o.assign(k, C, H)

    def cholesky(self, H):
        return _o.cholesky(H)

    def z_transform(self, k, L):
        return self.z(k, L)

    def assign_z(self, k, Cz, L):
        zk, Cz = self.z(k, L), _f(Cz)
        # ‖z - c‖² expanded: one matmul, where T x K x d differences are gigabytes at T = 32768 (host path)
        d2 = np.sum(zk * zk, axis=-1)[..., None] - 2.0 * zk @ Cz.T + np.sum(Cz * Cz, axis=-1)
        codes = np.argmin(d2, axis=-1).astype(np.int64)
        if self.tie is None or d2.size == 0:
            return codes
        return _with_allowed_codes(codes, _o.argmin_allowed(d2, self.tie * max(1.0, float(np.max(np.abs(d2))))))

    def back_transform(self, Cz, L):
        return _o.back_transform(Cz, L)

    def lut_scores(self, q_b, C, *, scale=None):
        return self.lut(_f(q_b), _f(C), scale)

    def token_scores(self, lut, codes):
        return _o.token_scores(lut, codes)

    def topk_count(self, T, topk, n_candidates=None):
        return self.count(T, topk, n_candidates)

    def select(self, scores, *, n_kv_heads, query_pos, w, sinks, topk, capacity=None):
        """RET-SELECT -> (mask (..., n_kv, T) bool, multiplicity (..., n_kv, T): copies in the softmax)."""
        s = _f(scores)
        T, n_q = s.shape[-1], s.shape[-2]
        G = n_q // n_kv_heads
        i = int(query_pos)
        j = np.arange(T)
        forced = (j <= i) & (self.is_sink(j, sinks) | ((i - j >= 0) & self.is_near(i - j, w)))
        pool = (j <= i) if self.duplicates() else ((j <= i) & ~forced)
        idx = np.flatnonzero(pool)
        k = self.count(self.topk_length(i, T, capacity, int(idx.size)), topk, int(idx.size))
        if self.adds_own_token(k, forced):   # RET-SELECT: never empty, the query's own token instead
            forced = forced.copy()
            forced[i] = True
        flat = self.ranking(s).reshape((-1, n_q, T))
        picked = np.zeros((flat.shape[0], n_kv_heads, T), dtype=bool)
        must, may = np.zeros_like(picked), np.zeros_like(picked)
        scale = max(1.0, float(np.max(np.abs(flat))) if flat.size else 1.0)
        margin = None if self.tie is None else max(self.tie, self.resolution) * scale
        for n in range(flat.shape[0]):
            for g in range(n_kv_heads):
                for h in self.voters(G):
                    row = flat[n, g * G + h, idx]
                    picked[n, g, idx[_o.highest(row, k)]] = True
                    if margin is not None:
                        mu, ma = _o.topk_allowed(row, k, margin)
                        must[n, g, idx] |= mu
                        may[n, g, idx] |= ma
        lead = s.shape[:-2] + (n_kv_heads, T)
        picked = picked.reshape(lead)
        mult = picked.astype(np.int64) + forced
        if not self.duplicates():
            mult = np.minimum(mult, 1)
        mask = mult > 0
        if margin is not None:
            mask = _with_allowed(mask, must.reshape(lead) | forced, may.reshape(lead) | forced)
        return mask, mult

    def select_tokens(self, scores, *, n_kv_heads, query_pos, w, sinks, topk):
        return self.select(scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks, topk=topk)[0]

    def retrieval_attention(self, q, k, v, mask, *, scale=None):
        return _o.retrieval_attention(q, k, v, mask, scale=scale)

    def _attend(self, q, k, v, mult, scale):
        """Softmax attention where token t counts mult[g, t] times (1 for a set)."""
        q, k, v = _f(q), _f(k), _f(v)
        n_q, d = q.shape
        G = n_q // k.shape[0]
        s = self.attention_scale(scale, d)
        out = np.empty((n_q, v.shape[-1]))
        for h in range(n_q):
            g = h // G
            logits = s * k[g] @ q[h]
            keep = mult[g] > 0
            x = np.where(keep, logits - logits[keep].max(), -np.inf)
            p = mult[g] * np.exp(x)
            out[h] = p / p.sum() @ v[g]
        return out

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False, capacity=None):
        q_post, k_post = _f(q_post), _f(k_post)
        query_pos = self.decode_position(query_pos, k_post.shape[-2])
        scores = self.token_scores_for(q_post, k_post, codes, _f(C), query_pos=query_pos, b=b, w=w, inv=inv_freqs,
                                       traditional=traditional, scale=scale)
        mask, mult = self.select(scores, n_kv_heads=k_post.shape[-3], query_pos=query_pos, w=w, sinks=sinks,
                                 topk=topk, capacity=capacity)
        keys = self.attention_keys(k_post, codes, _f(C), inv_freqs, traditional)
        q_att = self.attention_query(q_post, query_pos=query_pos, b=b, w=w, inv=inv_freqs, traditional=traditional)
        vals = self.attention_values(v)
        out = self._attend(q_att, keys, vals, mult, scale)
        if not return_mask:
            return out
        extra = mult - mask                   # copies beyond one (duplicate-tokens), kept for any selection
        return Decoded((out, mask), attend=lambda m: self._attend(q_att, keys, vals, np.asarray(m, np.int64) + extra * m,
                                                                  scale))

    def prefill_attention(self, q, k, v, *, scale=None):
        return _o.prefill_attention(q, k, v, scale=scale)

    def collection_attention(self, q, k, v, *, scale=None):
        return _o.collection_attention(q, k, v, scale=scale)

    def code_dtype(self, K):
        return _o.code_dtype(K)

    def kmeanspp_init(self, z, K, uniforms):
        _o.kmeanspp_init(z, K, uniforms)     # the preconditions (ValueError) are the oracle's
        z, u = _f(z), _f(uniforms)
        chosen = [int(math.floor(u[0] * z.shape[0]))]
        D2 = np.sum((z - z[chosen[0]]) ** 2, axis=-1)
        for t in range(1, int(K)):
            cum = np.cumsum(D2)
            chosen.append(self.cdf_pick(cum, u[t] * cum[-1]))
            D2 = np.minimum(D2, np.sum((z - z[chosen[-1]]) ** 2, axis=-1))
        return z[chosen].copy()

    def lloyd_step(self, z, C):
        _o.lloyd_step(z, C)                  # the preconditions (ValueError) are the oracle's
        z, C = _f(z), _f(C)
        N, K = z.shape[0], C.shape[0]
        d2 = np.sum((z[:, None, :] - C[None]) ** 2, axis=-1)
        codes = np.argmin(d2, axis=1)
        err = d2[np.arange(N), codes]
        members, taken = codes.copy(), np.zeros(N, dtype=bool)
        counts = np.bincount(members, minlength=K)
        before = counts.copy()
        for e in range(K):
            if counts[e] > 0:
                continue
            cand = np.flatnonzero(~taken & (self.donor_sizes(counts, before, members, codes) >= 2))
            n = int(cand[self.worst(err[cand])])
            counts[members[n]] -= 1
            members[n], counts[e], taken[n] = e, 1, True
        # a cluster emptied by a deviant rule keeps its input centre (the usual guard against 0/0)
        C_new = np.stack([z[members == j].mean(axis=0) if np.any(members == j) else C[j] for j in range(K)])
        return C_new, codes.astype(np.int64), float(np.sum(err))

    def kmeans(self, *a, **kw):
        return _o.kmeans(*a, **kw)

    def make_cache(self, config):
        return ModelCache(config, self)


class ModelCache(OracleCache):
    """OracleCache (spec/oracle_cache.py) with its codes and decode taken from a Model, so that a deviation
    of the model is a variant of the oracle cache. Trim hooks: ``trim_codes`` (drop the trimmed codes) and
    ``trim_counter`` (roll back the position counter that codes later tokens). save/load keep the state
    in memory: diagnosis replays run after the test's temporary files are gone."""

    trim_codes = True
    trim_counter = True
    step = 256   # buffer growth of the mlx-lm KV cache: the capacity a port may count top-k over

    def __init__(self, config, model: Model):
        super().__init__(config)
        self.m = model
        self._stale = np.zeros((self.B, self.n_kv, 0), np.int64)   # codes left behind by a trim that keeps them
        self._counter = 0                                          # next position used for coding
        self._allowed = None   # (B, n_kv, T, K) near-optimal codes when the model carries them (diagnosis)

    def append(self, keys_post, values):
        k = self._in(keys_post, "keys_post", (self.n_kv, None, self.d))
        v = self._in(values, "values", (self.n_kv, k.shape[-2], None))
        t, start = k.shape[-2], self.offset
        coding = np.arange(self._counter, self._counter + t)
        books = {"Cz": self.Cz, "L": self.L, "C": self.C}
        rows = [_shared(self.m, _digest("code_keys", k[r], coding, self.inv_freqs, int(self.traditional), books),
                        lambda r=r: self.m.code_keys(self.m.far_key(k[r], coding, self.inv_freqs, self.traditional),
                                                     books))
                for r in range(self.B)]
        codes = np.stack([np.asarray(c, np.int64) for c in rows])
        keep = min(t, max(0, self._stale.shape[-1] - start))
        if keep:
            codes[..., :keep] = self._stale[..., start:start + keep]
        allowed = [getattr(c, "allowed", None) for c in rows]
        if keep or any(a is None for a in allowed) or (start and self._allowed is None):
            self._allowed = None
        else:
            new = np.stack(allowed)
            self._allowed = new if start == 0 else np.concatenate([self._allowed, new], axis=2)
        if self.offset == 0:
            self._v = np.zeros(v.shape[:2] + (0, v.shape[-1]))
        self._k = np.concatenate([self._k, k], axis=2)
        self._v = np.concatenate([self._v, self.m.attention_values(v)], axis=2)
        self._c = np.concatenate([self._c, codes], axis=2)
        self._counter += t

    def decode(self, q_post):
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        self._need_tokens("decode")
        c = self.config
        cap = -(-self.offset // self.step) * self.step
        rows = [self.m.decode_step(q[r], self._k[r], self._v[r], self._c[r], self.C, query_pos=self.offset - 1,
                                   b=c["b"], w=c["w"], sinks=c["sinks"], topk=c["topk"], inv_freqs=self.inv_freqs,
                                   traditional=self.traditional, scale=self.scale, return_mask=True, capacity=cap)
                for r in range(self.B)]
        if not self.batched:
            return rows[0]
        return _stack_rows(rows, [r[1] for r in rows])

    def trim(self, n):
        if not self.trim_codes:
            self._stale = np.concatenate([self._c, self._stale[..., self._c.shape[-1]:]], axis=-1)
        n = super().trim(n)
        if self._allowed is not None:
            self._allowed = self._allowed[:, :, :self.offset]
        if self.trim_counter:
            self._counter = self.offset
        return n

    def codes(self):
        c = super().codes()
        return c if self._allowed is None else _with_allowed_codes(c, self._out(self._allowed))

    def adopt_codes(self, codes):
        """Hold a port's codes (checked near-optimal by the caller): decode then scores them, as the suite does."""
        c = np.asarray(codes).astype(np.int64)
        self._c = c if self.batched else c[None]

    def copy(self):
        other = type(self)(self.config, self.m)
        other._allowed = self._allowed
        other._k, other._v, other._c = self._k.copy(), self._v.copy(), self._c.copy()
        other._stale, other._counter = self._stale.copy(), self._counter
        return other

    def save(self, path):
        # kept on the model, by path: any cache of the replay may load it (a fresh one, as CACHE-SAVE does)
        self.m.__dict__.setdefault("_saved_states", {})[str(path)] = self.copy()

    def load(self, path):
        return self.m.__dict__.get("_saved_states", {})[str(path)].copy()


def _stack_rows(rows, masks):
    """One batched Decoded from per-row decodes, every row attending over masks[r]."""
    out = np.stack([r.attend(m) if r.attend else r[0] for r, m in zip(rows, masks)])
    mask = np.stack([np.asarray(m) for m in masks])
    if all(getattr(m, "must", None) is not None for m in masks):
        mask = _with_allowed(mask, np.stack([m.must for m in masks]), np.stack([m.may for m in masks]))
    attend = (lambda ms: np.stack([r.attend(m) for r, m in zip(rows, ms)])) if all(r.attend for r in rows) else None
    return Decoded((out, mask), attend=attend)


class _RowZeroSelection(ModelCache):
    """Batched decode: every row attends its own keys over row 0's selection."""

    def decode(self, q_post):
        if not self.batched or self.B < 2:
            return super().decode(q_post)
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        c = self.config
        rows = [self.m.decode_step(q[r], self._k[r], self._v[r], self._c[r], self.C, query_pos=self.offset - 1,
                                   b=c["b"], w=c["w"], sinks=c["sinks"], topk=c["topk"], inv_freqs=self.inv_freqs,
                                   traditional=self.traditional, scale=self.scale, return_mask=True)
                for r in range(self.B)]
        return _stack_rows(rows, [rows[0][1]] * self.B)


class _ChunkRerotated(ModelCache):
    """A chunk appended after the first is stored rotated again by its start offset (codes stay right)."""

    def append(self, keys_post, values):
        start = self.offset
        super().append(keys_post, values)
        if start:
            t = self._k.shape[2] - start
            self._k[:, :, start:] = _o.rope_apply(self._k[:, :, start:], np.full(t, start), self.inv_freqs,
                                                  traditional=self.traditional)


class _LoadResets(ModelCache):
    """load() gives back the saved tokens with one retrieval parameter at the authors' default (not saved)."""

    param, value = "w", 64

    def load(self, path):
        other = super().load(path)
        other.config = dict(other.config, **{self.param: self.value})
        other.scale = other.config.get("scale")
        return other


class _LoadRowZero(ModelCache):
    """load() of a batched cache gives every row row 0's keys, values and codes (a save that wrote row 0)."""

    def load(self, path):
        other = super().load(path)
        for a in ("_k", "_v", "_c"):
            x = getattr(other, a)
            setattr(other, a, np.broadcast_to(x[:1], x.shape).copy())
        other._allowed = None
        return other


class _DecodeUncoded(ModelCache):
    """Codes are assigned lazily, by codes() only: a decode scores the tokens written since codes() was last
    read as code 0 (a loaded cache starts fully coded)."""

    def __init__(self, config, model):
        super().__init__(config, model)
        self._read = 0

    def codes(self):
        self._read = self.offset
        return super().codes()

    def trim(self, n):
        n = super().trim(n)
        self._read = min(self._read, self.offset)
        return n

    def copy(self):
        other = super().copy()
        other._read = other.offset
        return other

    def decode(self, q_post):
        held = self._c
        self._c = held.copy()
        self._c[..., self._read:] = 0
        try:
            return super().decode(q_post)
        finally:
            self._c = held


class _StaleQueryAngle(ModelCache):
    """The far query's de-rotation is kept from the cache's first decode (position i0): every later decode
    scores with q_post R_(-i0) R_b; attention uses the query as given."""

    first = None

    def decode(self, q_post):
        if self.first is None:
            self.first = self.offset - 1
        m, first, scores = self.m, self.first, self.m.token_scores_for
        m.token_scores_for = lambda *a, query_pos, **kw: scores(*a, query_pos=first, **kw)
        try:
            return super().decode(q_post)
        finally:
            del m.token_scores_for


def _load_resets(param, value):
    m = _cache_model(f"LoadResets_{param}", f"load sets {param} = {value!r}", base=_LoadResets, param=param, value=value)
    shown = "1/sqrt(d)" if value is None else value
    m.cause = (f"save/load does not keep {param}: the loaded cache decodes with the default {param} = {shown} "
               "instead of the saved value")
    return m


# ---------------------------------------------------------------------------------------- deviations

@dataclass(frozen=True)
class Deviation:
    """A known deviation: stable ``id``, the ``cause`` a port author reads, the adapter callables it can
    change (``applies``: names, ``make_cache`` for the whole cache), and its variants (Model classes)."""

    id: str
    cause: str
    applies: frozenset
    variants: tuple

    def models(self):
        return [v() for v in self.variants]

    def describe(self, examples=(), variants=()) -> str:
        """The cause, specialised to the failing examples where that reads better (RoPE layout), or to the one
        variant that matched them all when that variant states its own cause (which parameter load resets)."""
        own = {getattr(v, "cause", None) for v in variants}
        if len(own) == 1 and None not in own:
            return own.pop()
        if self.id == "rope-layout-swapped":
            flags = {bool(e["notes"].get("traditional", _traditional_of(e))) for e in examples}
            flags.discard(None)
            if flags == {True}:
                return "RoPE pairs (x[i], x[i+d/2]) instead of (x[2i], x[2i+1]) (traditional=True ignored)"
            if flags == {False}:
                return "RoPE pairs (x[2i], x[2i+1]) instead of (x[i], x[i+d/2]) (traditional=False ignored)"
        return self.cause


def _traditional_of(example):
    for _, args, kw in example["calls"]:
        if "traditional" in kw:
            return kw["traditional"]
        if args and isinstance(args[0], dict) and "traditional" in args[0]:
            return args[0]["traditional"]
    return None


def _model(name, doc, **hooks):
    return type(name, (Model,), dict(hooks, __doc__=doc))


def _cache_model(name, doc, base=None, **attrs):
    cache = type(name + "Cache", (base or ModelCache,), attrs)
    return type(name, (Model,), {"__doc__": doc, "make_cache": lambda self, config: cache(config, self)})


def _blend_codes(k_pre, C, norm_plus_one):
    """½·cos(k, c_j) − ½·‖k − c_j‖² / (m + max_j ‖k − c_j‖²), m = 1 or 0; argmax over j."""
    k, C = _f(k_pre), _f(C)
    cos = (k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-12)) @ \
          (C / (np.linalg.norm(C, axis=-1, keepdims=True) + 1e-12)).T
    # ‖k − c‖² expanded: one matmul, where T x K x d differences are gigabytes on a long cache
    d2 = np.maximum(np.sum(k * k, axis=-1)[..., None] - 2.0 * k @ C.T + np.sum(C * C, axis=-1), 0.0)
    den = (1.0 if norm_plus_one else 0.0) + d2.max(axis=-1, keepdims=True)
    return np.argmax(0.5 * cos - 0.5 * d2 / np.where(den > 0, den, 1.0), axis=-1).astype(np.int64)


def _blend_model(name, plus_one):
    def assign(self, k, C, H):
        return _blend_codes(k, C, plus_one)

    def code_keys(self, k_pre, cfg):
        return np.stack([_blend_codes(k_pre[g], cfg["C"][g], plus_one) for g in range(k_pre.shape[0])])
    return _model(name, "cosine blend", assign=assign, code_keys=code_keys)


def _lowp(name, dtype, **which):
    hooks = {}
    if "pos" in which:
        hooks["pos"] = lambda self, p: _round(p, dtype)
    if "lut" in which:
        hooks["resolution"] = 2.0 ** (-9 if dtype == "float16" else -6)
        if which["lut"] == "inputs":
            hooks["lut"] = lambda self, q_b, C, scale: _round(_o.lut_scores(_round(q_b, dtype), _round(C, dtype),
                                                                            scale=scale), dtype)
        else:
            hooks["lut"] = lambda self, q_b, C, scale: _round(_o.lut_scores(q_b, C, scale=scale), dtype)
    if "values" in which:
        hooks["attention_values"] = lambda self, v: _round(v, dtype)
    return _model(name, f"{dtype} {sorted(which)}", **hooks)


def _lut_f16_arith(self, q_b, C, scale):
    """q_b and C in float16, float16 products and scale (NumPy float16 arithmetic)."""
    q16, C16 = np.asarray(q_b).astype(np.float16), np.asarray(C).astype(np.float16)
    n_q, d = q16.shape[-2:]
    G = n_q // C16.shape[0]
    s = np.float16(1.0 / math.sqrt(d) if scale is None else scale)
    out = np.empty(q16.shape[:-1] + (C16.shape[1],))
    for h in range(n_q):
        out[..., h, :] = (q16[..., h, :] @ C16[h // G].T) * s
    return out


def _int8_values(self, v):
    v = _f(v)
    s = np.max(np.abs(v), axis=-1, keepdims=True) / 127.0
    s = np.where(s > 0, s, 1.0)
    return np.round(v / s) * s


def _proxy_query(self, q_post, k_post, query_pos):
    """Each query head replaced by its KV head's key at query_pos, standing in for the query."""
    G = q_post.shape[-2] // k_post.shape[-3]
    return np.repeat(k_post[..., int(query_pos), :], G, axis=-2)


def _own_position_scores(self, q_post, k_post, codes, C, *, query_pos, b, w, inv, traditional, scale):
    """score[h, t] = scale · q_post[h] · (C[code_t] R_t): the codeword re-rotated at the token's position."""
    q_post = self.selection_query(q_post, k_post, query_pos)
    c = np.asarray(codes).astype(np.int64)
    n_kv, T = c.shape[-2:]
    G = q_post.shape[-2] // n_kv
    s = 1.0 / math.sqrt(q_post.shape[-1]) if scale is None else scale
    out = np.empty(q_post.shape[:-1] + (T,))
    for g in range(n_kv):
        kq = self._rope(C[g][c[g]], np.arange(T), inv, traditional)
        for h in range(g * G, (g + 1) * G):
            out[..., h, :] = s * kq @ q_post[..., h, :]
    return out


def _own_position_far(self, q, k, pq, pk, *, b, w, inv, traditional):
    return self._rope(q, pq, inv, traditional) @ np.swapaxes(self._rope(k, pk, inv, traditional), -1, -2)


def _quantized_keys(self, k_post, codes, C, inv, traditional):
    c = np.asarray(codes).astype(np.int64)
    Cq = C[np.arange(c.shape[-2])[:, None], c]
    return self._rope(Cq, np.arange(c.shape[-1]), inv, traditional)


def _scalar_far_key(self, k_post, positions, inv, traditional):
    p = _f(positions)
    p0 = np.full(p.shape, p.reshape(-1)[0]) if p.size else p
    return self._rope(k_post, p0, inv, traditional, invert=True)


def _llama3_defaults(**wrong):
    """rope_inv_freqs reading a left-out llama3 key with the wrong default (``wrong``: key -> value)."""
    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and (scaling.get("type") or scaling.get("rope_type")) == "llama3":
            scaling = {**wrong, **scaling}
        return _o.rope_inv_freqs(head_dim, base, scaling)
    return rope_inv_freqs


def _one_type_key(key):
    """rope_inv_freqs reading the scaling type from ``key`` only (the other spelling read as "default")."""
    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict):
            scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_type") or k == key}
        return _o.rope_inv_freqs(head_dim, base, scaling)
    return rope_inv_freqs


def _strided_select(self, scores, *, n_kv_heads, **kw):
    """RET-SELECT with KV head g taking query heads g, g + n_kv, ... (a tile where the spec's h // G is a repeat)."""
    s = _f(scores)
    G = s.shape[-2] // n_kv_heads
    s = s[..., [g + n_kv_heads * j for g in range(n_kv_heads) for j in range(G)], :]
    return Model.select(self, s, n_kv_heads=n_kv_heads, **kw)


def _strided_moment(self, queries, *, n_kv_heads, **kw):
    """EQ-10 with KV head g pooling query heads g, g + n_kv, ... (a tile where the spec's h // G is a repeat)."""
    q = _f(queries)
    G = q.shape[0] // n_kv_heads
    return Model.query_moment(self, q[[g + n_kv_heads * j for g in range(n_kv_heads) for j in range(G)]],
                              n_kv_heads=n_kv_heads, **kw)


def _rope_type_first(self, head_dim, base, scaling=None):
    """rope_inv_freqs reading 'rope_type' before 'type' (HF transformers' order)."""
    if isinstance(scaling, dict) and scaling.get("rope_type"):
        scaling = {**scaling, "type": scaling["rope_type"]}
    return _o.rope_inv_freqs(head_dim, base, scaling)


def _dev(id_, cause, applies, *variants):
    return Deviation(id_, cause, frozenset(applies), tuple(variants))


DEVIATIONS: tuple[Deviation, ...] = (
    _dev("rope-layout-swapped",
         "RoPE layout swapped: pairs (x[i], x[i+d/2]) and (x[2i], x[2i+1]) exchanged (the traditional flag inverted)",
         _ROPE | _FAR | {"query_moment"} | _DECODE,
         _model("LayoutSwapped", "traditional inverted", layout=lambda self, t: not bool(t))),
    _dev("llama3-defaults", "llama3 scaling: a left-out key read with the wrong default (spec and mlx-lm: "
         "low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)", {"rope_inv_freqs"},
         _model("Llama3L0", "original_max_position_embeddings 4096",
                rope_inv_freqs=_llama3_defaults(original_max_position_embeddings=4096)),
         _model("Llama3High", "high_freq_factor 2", rope_inv_freqs=_llama3_defaults(high_freq_factor=2.0)),
         _model("Llama3L0High", "4096 and 2", rope_inv_freqs=_llama3_defaults(original_max_position_embeddings=4096,
                                                                             high_freq_factor=2.0))),
    _dev("rope-type-key-order", "RoPE scaling type read with 'rope_type' first (HF transformers' order): mlx-lm reads "
         "scaling.get('type') or scaling.get('rope_type', 'default'), so where the two disagree 'type' names the type",
         {"rope_inv_freqs"}, _model("RopeTypeFirst", "'rope_type' first", rope_inv_freqs=_rope_type_first)),
    _dev("rope-type-one-key", "RoPE scaling type read from one key only: mlx-lm reads scaling.get('type') or "
         "scaling.get('rope_type', 'default'), so both spellings name the type", {"rope_inv_freqs"},
         _model("TypeOnly", "'type' only", rope_inv_freqs=_one_type_key("type")),
         _model("RopeTypeOnly", "'rope_type' only", rope_inv_freqs=_one_type_key("rope_type"))),
    _dev("b-sign-flipped", "far position negated: queries rotated by R_(-b) instead of R_b (rope_invert where "
         "rope_apply is due)", {"wrope_scores", "far_query", "query_moment"},
         _model("BNegated", "-b", far_b=lambda self, b, w=None: -b)),
    _dev("b-low-precision", "far position b rounded through bfloat16 or float16 (a position tensor in the model's "
         "dtype) before R_b: exact for 64 or 2048, wrong for b such as 3001",
         _FAR - {"far_keys"} | {"query_moment"} | _DECODE,
         _model("BBF16", "bfloat16 b", far_b=lambda self, b, w=None: float(_round(b, "bfloat16"))),
         _model("BF16", "float16 b", far_b=lambda self, b, w=None: float(_round(b, "float16")))),
    _dev("b-missing", "R_b missing: far scores and H use b = 0 (no rotation) instead of the far position b",
         _FAR - {"far_keys"} | {"query_moment"} | _DECODE,
         _model("BMissing", "b = 0", far_b=lambda self, b, w=None: 0)),
    _dev("b-tied-to-w", "far position tied to the window: R_w used where the spec says R_b",
         {"wrope_scores"} | _DECODE,
         _model("BTiedToW", "b = w", far_b=lambda self, b, w=None: b if w is None else w)),
    _dev("never-empty-beside-sinks", "never-empty rule applied whenever the top-k count is 0: the query's own token "
         "added although sinks are selected (with w = 0 it belongs in the selection only when sinks and window are "
         "both empty)", _SELECT,
         _model("OwnTokenAtCountZero", "own token at count 0", adds_own_token=lambda self, k, forced: k == 0)),
    # (before window-inclusive: with w = 0 both explain the same examples, and this one is then the likelier)
    _dev("window-inclusive", "window boundary off by one: i - j <= w counted as near/window (spec: i - j < w)",
         {"wrope_scores"} | _SELECT,
         _model("WindowInclusive", "<=", is_near=lambda self, d, w: d <= w)),
    _dev("window-symmetric", "window measured as |i - j| < w: a key w or more positions after the query counted far "
         "(EQ-11 has no causal mask: i - j < w, so every later key is near when w > 0)", {"wrope_scores"},
         _model("WindowSymmetric", "|i - j| < w", is_near=lambda self, d, w: np.abs(d) < w)),
    _dev("decode-query-at-last-token", "decode_step puts the query at the last cached token (i = T − 1, from the "
         "keys' length) instead of query_pos: de-rotation, window, top-k count and the j > i cut-off all at T − 1",
         {"decode_step"},
         _model("QueryAtLastToken", "i = T - 1", decode_position=lambda self, query_pos, T: T - 1)),
    _dev("sinks-not-forced", "sinks not forced: the first `sinks` tokens compete as top-k candidates instead of "
         "always being kept", _SELECT,
         _model("SinksNotForced", "no sinks", is_sink=lambda self, j, sinks: np.zeros(np.shape(j), bool))),
    _dev("gqa-one-head", "no GQA union: each KV head keeps the top-k of one query head of its group, not the "
         "union over the group's heads", _SELECT,
         _model("OneHeadVotes", "first head votes", voters=lambda self, G: range(1)),
         _model("HeadZeroRanks", "every head ranks by query head 0",
                ranking=lambda self, s: np.broadcast_to(s[..., :1, :], s.shape))),
    _dev("gqa-strided-groups", "GQA groups strided: KV head g unions query heads g, g + n_kv, g + 2·n_kv, ... "
         "(h % n_kv, a tile) instead of its G consecutive heads g·G ... g·G + G − 1 (h // G, a repeat)", _SELECT,
         _model("StridedGroups", "h % n_kv", select=_strided_select)),
    _dev("h-strided-groups", "H of KV head g pooled from query heads g, g + n_kv, g + 2·n_kv, ... (h % n_kv, a "
         "tile) instead of its G consecutive heads g·G ... g·G + G − 1 (h // G, a repeat)", {"query_moment"},
         _model("HStrided", "h % n_kv", query_moment=_strided_moment)),
    _dev("h-one-head", "H from one query head per GQA group, not pooled over the group's heads", {"query_moment"},
         _model("HOneHead", "first head pooled", pooled_heads=lambda self, G: range(1))),
    _dev("topk-over-T", "top-k count int(topk·T) over the whole score row (T tokens) instead of the i + 1 tokens "
         "the query sees", _SELECT,
         _model("TopkOverT", "over T", topk_length=lambda self, i, T, cap, nc: T)),
    _dev("topk-over-buffer", "top-k count over the cache's allocated buffer (a multiple of 256 tokens) instead of "
         "the i + 1 tokens the query sees", {"make_cache"},
         _model("TopkOverBuffer", "over capacity", topk_length=lambda self, i, T, cap, nc: i + 1 if cap is None else cap)),
    _dev("topk-over-candidates", "top-k count int(topk·n) over the candidates (the i + 1 visible tokens less sinks "
         "and window) instead of over the i + 1 tokens the query sees", _SELECT,
         _model("TopkOverCandidates", "over the candidates", topk_length=lambda self, i, T, cap, nc: max(nc, 1))),
    _dev("topk-rounded-up", "top-k count rounded up, ceil(topk·n), instead of the authors' int() (floor)",
         {"topk_count"} | _SELECT,
         _model("TopkCeil", "ceil", count=lambda self, n, topk, nc: (
             _o.topk_count(n, topk, nc) if isinstance(topk, (int, np.integer)) else
             (math.ceil(float(topk) * n) if nc is None else min(math.ceil(float(topk) * n), nc))))),
    _dev("topk-float32", "top-k count from a float32 product, int(float32(topk)·float32(n)) (the authors' PyTorch "
         "arithmetic), instead of int() of the float64 product: off by one where topk·n is an integer",
         {"topk_count"} | _SELECT,
         _model("TopkFloat32", "float32 product", count=lambda self, n, topk, nc: (
             _o.topk_count(n, topk, nc) if isinstance(topk, (int, np.integer)) else
             min(int(np.float32(topk) * np.float32(n)), n if nc is None else nc)))),
    _dev("duplicate-tokens", "duplicate tokens in the softmax: a sink/window token also picked by top-k is "
         "attended twice (top-k not restricted to the non-forced candidates, no de-duplication)", _SELECT,
         _model("Duplicates", "multiset", duplicates=lambda self: True)),
    _dev("ridge-missing", "ridge·I not added to H (the ridge argument ignored): H stays singular when the G·N "
         "pooled queries span fewer than d dimensions", {"query_moment"},
         _model("RidgeMissing", "no ridge", ridge_added=lambda self, ridge: 0.0)),
    _dev("kmeanspp-cdf-inclusive", "k-means++ inverse CDF inclusive: the smallest n with cumsum(D²)[n] >= u·ΣD² "
         "(np.searchsorted side='left') instead of > : a uniform on a boundary (u = 0) can re-pick a chosen point",
         {"kmeanspp_init"},
         _model("CdfInclusive", ">=", cdf_pick=lambda self, cum, x: int(np.argmax(cum >= x)))),
    _dev("empty-cluster-tie-highest", "empty-cluster rule: among tied largest errors the highest point index moves "
         "(argsort(err)[-1]) instead of the lowest", {"lloyd_step"},
         _model("TieHighest", "argsort[-1]", worst=lambda self, err: int(np.argsort(err, kind="stable")[-1]))),
    _dev("empty-cluster-stale-sizes", "empty-cluster rule: donors judged by the cluster sizes before any move, not "
         "the running sizes, so a 2-member cluster can give both members away and become empty", {"lloyd_step"},
         _model("StaleSizes", "sizes before the moves",
                donor_sizes=lambda self, counts, before, members, codes: before[codes])),
    _dev("l-transposed", "z-space transform with L transposed (z = k Lᵀ instead of k L)",
         {"z_transform", "assign_z", "make_cache"},
         _model("LTransposed", "k L^T", z=lambda self, k, L: _f(k) @ np.swapaxes(_f(L), -1, -2))),
    _dev("h-not-normalised", "H not RMS-normalised (H / sqrt(mean(H²)) missing)", {"query_moment"},
         _model("HRaw", "no normalisation", normalise=lambda self, H: H)),
    _dev("cosine-blend", "cosine-blend assignment (½·cos(k, c) − ½·‖k − c‖² / max‖k − c‖²) instead of Eq. 14's "
         "H-weighted distance", {"assign", "make_cache"},
         _blend_model("CosineBlend1", True), _blend_model("CosineBlend0", False)),
    _dev("codes-from-post-rope-keys", "far keys and codes from the post-RoPE key: it is not de-rotated to its "
         "pre-RoPE value at its own position (EQ-12)", {"far_keys", "make_cache"},
         _model("PostRopeKeys", "no de-rotation", far_key=lambda self, k, p, inv, t: _f(k))),
    _dev("derotate-scalar-position", "de-rotation with one scalar position: a block of keys de-rotated by the first "
         "token's position instead of each at its own", {"far_keys", "make_cache"},
         _model("ScalarDerotation", "p0", far_key=_scalar_far_key)),
    _dev("quantized-keys-in-attention", "quantized keys C[code] (re-rotated) fed to attention: compression only, "
         "not exact attention over the retrieved tokens", _DECODE,
         _model("QuantizedKeys", "C[code] R_t", attention_keys=_quantized_keys)),
    _dev("far-query-in-attention", "far-position query in exact attention: q R_b against keys at their true "
         "positions (relative position b - j) instead of the query at its own position i", _DECODE,
         _model("FarQueryAttention", "q R_(b-i) in attention", attention_query=lambda self, q, *, query_pos, b, w, inv,
                traditional: self.far_query(q, b=b, inv_freqs=inv, traditional=traditional, positions=query_pos))),
    _dev("query-not-derotated", "LUT query not de-rotated: the post-RoPE query times R_b (q_post·R_b = "
         "q_pre·R_(i+b)) instead of far_query(q_post, positions=i) = q_pre·R_b (EQ-12: rotate by b - i)",
         {"far_query"} | _DECODE,
         _model("QueryNotDerotated", "q_post R_b", far_query=lambda self, q, *, b, inv_freqs, traditional,
                positions=None: Model.far_query(self, q, b=b, inv_freqs=inv_freqs, traditional=traditional))),
    _dev("key-as-proxy-query", "the incoming key used as a proxy query: tokens scored with the newest key instead "
         "of the query", _DECODE,
         _model("ProxyQuery", "key as query", selection_query=_proxy_query)),
    _dev("attention-scale-wrong", "attention logits scaled wrongly in the decode step: the scale passed (decode_step's "
         "scale, the cache's config['scale']) ignored for 1/sqrt(d), or 1/d used as the default", _DECODE,
         _model("ScaleIgnored", "always 1/sqrt(d)", attention_scale=lambda self, scale, d: 1.0 / math.sqrt(d)),
         _model("ScaleOverD", "1/d by default", attention_scale=lambda self, scale, d: 1.0 / d if scale is None else scale)),
    _dev("values-quantized", "values quantized (float16, bfloat16 or 8-bit per token) before attention",
         _DECODE,
         _lowp("ValuesF16", "float16", values=1), _lowp("ValuesBF16", "bfloat16", values=1),
         _model("ValuesInt8", "int8 absmax per token", attention_values=_int8_values)),
    _dev("far-logits-at-own-position", "far logits computed at the token's own position (plain RoPE, "
         "q R_{i-j} k) instead of with R_b", {"wrope_scores"} | _DECODE,
         _model("OwnPosition", "R_{i-j}", token_scores_for=_own_position_scores, far_scores=_own_position_far)),
    _dev("float16-lut", "LUT (q R_b · C) held in float16 or bfloat16: near-tied scores reorder", {"lut_scores"} | _DECODE,
         _lowp("LutF16", "float16", lut="out"), _lowp("LutF16In", "float16", lut="inputs"),
         _lowp("LutBF16", "bfloat16", lut="out"), _model("LutF16Arith", "float16 arithmetic", lut=_lut_f16_arith, resolution=2.0 ** -9)),
    _dev("positions-low-precision", "positions rounded through float16 or bfloat16 before the RoPE angle",
         _ROPE | _FAR | _DECODE,
         _lowp("PosF16", "float16", pos=1), _lowp("PosBF16", "bfloat16", pos=1),
         _model("PosF16Codes", "float16 positions when coding keys", far_key=lambda self, k, p, inv, t: (
             Model.far_key(self, k, _round(p, "float16"), inv, t))),
         _model("PosBF16Codes", "bfloat16 positions when coding keys", far_key=lambda self, k, p, inv, t: (
             Model.far_key(self, k, _round(p, "bfloat16"), inv, t)))),
    _dev("batch-rows-share-row-zero-selection", "batched decode: every row attends over row 0's token selection "
         "instead of its own", {"make_cache"},
         _cache_model("RowZeroSelection", "row 0's mask for every row", base=_RowZeroSelection)),
    _dev("chunk-keys-rerotated", "chunked prefill: keys of each chunk after the first stored rotated again by the "
         "chunk's start offset (RoPE applied to keys that are already post-RoPE)", {"make_cache"},
         _cache_model("ChunkRerotated", "keys rotated twice", base=_ChunkRerotated)),
    _dev("load-resets-parameter", "save/load does not keep a retrieval parameter: the loaded cache decodes with "
         "the default w = 64, b = 2048, sinks = 8, topk = 0.03 or scale = 1/sqrt(d) instead of the saved one",
         {"make_cache"},
         *(_load_resets(p, v) for p, v in (("w", 64), ("b", 2048), ("sinks", 8), ("topk", 0.03), ("scale", None)))),
    _dev("load-keeps-row-zero", "save/load of a batched cache keeps row 0 only: every loaded row holds row 0's keys, "
         "values and codes", {"make_cache"},
         _cache_model("LoadRowZero", "row 0 for every row", base=_LoadRowZero)),
    _dev("trim-keeps-codes", "trim() drops keys, values and offset but keeps the trimmed tokens' codes for the "
         "tokens written in their place", {"make_cache"},
         _cache_model("TrimKeepsCodes", "stale codes", trim_codes=False)),
    _dev("trim-keeps-position-counter", "trim() does not roll back the position counter that de-rotates (and so "
         "code) later tokens", {"make_cache"},
         _cache_model("TrimKeepsCounter", "counter not rolled back", trim_counter=False)),
    _dev("decode-scores-uncoded", "codes assigned lazily by codes() only: the decode scores tokens not yet coded "
         "(written since codes() was last read) as code 0", {"make_cache"},
         _cache_model("DecodeUncoded", "uncoded tokens as code 0", base=_DecodeUncoded)),
    _dev("query-angle-stale", "the far query's de-rotation kept from the cache's first decode: later decodes score "
         "the query as if it sat at that first position (q_post R_(-i0) R_b, i0 fixed)", {"make_cache"},
         _cache_model("StaleQueryAngle", "angle of the first decode", base=_StaleQueryAngle)),
)

_BY_ID = {d.id: d for d in DEVIATIONS}
assert len(_BY_ID) == len(DEVIATIONS), "deviation ids must be unique"


def by_id(id_: str) -> Deviation:
    try:
        return _BY_ID[id_]
    except KeyError:
        raise ValueError(f"unknown deviation id {id_!r}; known: {', '.join(_BY_ID)}") from None


class DeviantAdapter:
    """An adapter whose callables are a deviation's model (or the faithful model with ``None``): a port
    with exactly that known bug, in float64. Subclass it with a fixed id to pass it as ``--iut``."""

    dtypes = ("float64",)
    version = "deviant model"
    deviation: str | None = None
    variant = 0

    def __init__(self, deviation: str | None = None, variant: int | None = None):
        dev = deviation or self.deviation
        model = Model() if dev is None else by_id(dev).models()[self.variant if variant is None else variant]
        self.name = f"deviant model ({dev or 'faithful'})"

        for fn in FUNCTION_NAMES + ("make_cache",):
            setattr(self, fn, getattr(model, fn))


__doc__ = (__doc__ or "") + "\n".join(f"- ``{d.id}``: {d.cause}" for d in DEVIATIONS) + "\n"
