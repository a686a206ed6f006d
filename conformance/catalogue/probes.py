"""The port profile's probes: for each group of mechanisms, a few fixed calls built so that only those
mechanisms decide the output, and every variant of the catalogue predicts a different one.

A probe is a list of calls ``(name, args, kwargs)`` as Context records them (float64 arrays; cache calls as
``make_cache`` then ``cache0.<method>``), the clause each call is judged under (its tolerance), the callables
it needs and, for cache probes, the cache operations it needs (a capability, capabilities.py). The inputs are
fixed (seeded), small (d = 8, at most 32 tokens) and in the region where every variant shows: b >= 1,
positions past 2048 that float16 and bfloat16 round, GQA groups of 2, sinks and a window, near-ties away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from a2ats_spec import oracle

from a2ats_conformance.catalogue import MECHANISMS
from a2ats_conformance.diagnosis.repro import TMP_PLACEHOLDER

__all__ = ["Probe", "PROBES"]

D, NQ, NKV = 8, 4, 2


@dataclass(frozen=True)
class Probe:
    id: str
    calls: list
    clause: str                        # the clause whose tolerance judges the calls
    needs: tuple = ()
    cache_ops: tuple = ()
    max_position: float | None = None
    mechanisms: tuple = field(default=())
    # mechanisms whose catch-all variant (a lossy rule of the port's own, which no model predicts) also decides
    # this probe's output: when one of them read so, an output no variant explains is not evidence against this
    # probe's mechanisms
    confounded_by: tuple = ()


def _inv(d=D, base=10000.0):
    return oracle.rope_inv_freqs(d, base)


def _rope_probe(rng):
    x = rng.standard_normal((6, D))
    pos = np.array([0, 1, 7, 300, 2049, 3001])
    calls = [("rope_apply", (x, pos, _inv()), {"traditional": t}) for t in (True, False)]
    calls.append(("rope_invert", (x, pos, _inv()), {"traditional": True}))
    return dict(calls=calls, clause="ROPE-APPLY", needs=("rope_apply", "rope_invert"), max_position=3001.0)


def _freqs_probe(rng):
    l3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    calls = [("rope_inv_freqs", (64, 500000.0), {"scaling": s}) for s in (
        None,
        {"rope_type": "llama3", "factor": 8.0},                   # llama3 with its keys left out: the defaults
        {"type": "linear", "rope_type": "llama3", **l3},          # the two spellings disagree: 'type' names it
        {"rope_type": "linear", "factor": 2.0},
        {"type": "linear", "factor": 2.0})]
    return dict(calls=calls, clause="ROPE-FREQ", needs=("rope_inv_freqs",))


def _far_probe(rng):
    q, k = rng.standard_normal((2, D)), rng.standard_normal((7, D))
    kw = dict(w=3, b=3001, inv_freqs=_inv(), traditional=True)
    pq, pk = np.array([40, 45]), np.array([0, 5, 37, 38, 42, 44, 49])   # i − j: 3 (edge), −4
    q_post = oracle.rope_apply(rng.standard_normal((NQ, D)), np.full(NQ, 40.0), _inv(), traditional=True)
    calls = [("wrope_scores", (q, k), dict(kw, q_positions=pq, k_positions=pk)),
             ("far_query", (q_post,), dict(b=3001, inv_freqs=_inv(), traditional=True, positions=40)),
             ("far_query", (q,), dict(b=3001, inv_freqs=_inv(), traditional=True))]
    return dict(calls=calls, clause="EQ-11", needs=("wrope_scores", "far_query"), max_position=3050.0)


def _moment_probe(rng):
    q = rng.standard_normal((NQ, 3, D)) * np.linspace(0.5, 2.0, D)   # N = 3 < d: H is singular without the ridge
    calls = [("query_moment", (q,), dict(n_kv_heads=NKV, b=3001, inv_freqs=_inv(), traditional=True, ridge=0.5))]
    return dict(calls=calls, clause="EQ-10", needs=("query_moment",), max_position=3001.0)


def _metric(rng):
    A = rng.standard_normal((D, D)) * np.geomspace(0.1, 3.0, D)
    H = A @ A.T / D + 0.05 * np.eye(D)
    return H, oracle.cholesky(H)


def _assign_probe(rng):
    H, L = _metric(rng)
    k, C = rng.standard_normal((12, D)) + 0.5, rng.standard_normal((6, D))
    Cz = rng.standard_normal((6, D))
    small = rng.standard_normal((12, D)) * 0.15, rng.standard_normal((6, D)) * 0.15   # ‖k − c‖² ~ 1: the blend's "1 +" shows
    calls = [("assign", (k, C, H), {}), ("assign", (*small, H), {}), ("z_transform", (k, L), {}),
             ("assign_z", (k, Cz, L), {})]
    return dict(calls=calls, clause="EQ-14", needs=("assign", "z_transform", "assign_z"))


def _far_keys_probe(rng):
    pos = np.array([3, 9, 300, 1500, 2047])
    k_post = oracle.rope_apply(rng.standard_normal((NKV, 5, D)), pos, _inv(), traditional=True)
    calls = [("far_keys", (k_post, pos, _inv()), {"traditional": True})]
    return dict(calls=calls, clause="EQ-12", needs=("far_keys",), max_position=2047.0)


def _topk_probe(rng):
    calls = [("topk_count", (T, f), {}) for T, f in ((100, 0.29), (10, 0.25), (900, 0.13), (20, 3))]
    return dict(calls=calls, clause="RET-TOPK", needs=("topk_count",))


def _select_probe(rng):
    T = 12
    s = rng.permutation(NQ * T).reshape(NQ, T).astype(np.float64) / 4.0   # distinct scores, no ties
    s[:, 0] = -50.0                                                   # the sink scores lowest: forced, never picked
    kw = dict(n_kv_heads=NKV, query_pos=9)
    calls = [("select_tokens", (s,), dict(kw, w=2, sinks=1, topk=0.25)),      # counts 2 (i + 1), 3 (T), 1 (cands)
             ("select_tokens", (s,), dict(kw, w=0, sinks=0, topk=0.05)),      # count 0, nothing forced
             ("select_tokens", (s,), dict(kw, w=0, sinks=2, topk=0.05))]      # count 0 beside sinks
    return dict(calls=calls, clause="RET-SELECT", needs=("select_tokens",))


def _signs(rng, shape):
    """Values exact in float16, bfloat16 and 8-bit absmax: ±2^e per token, some zeros."""
    v = rng.choice([-1.0, 0.0, 1.0], size=shape)
    v[..., 0] = 1.0
    return v * 2.0 ** rng.integers(-2, 3, size=shape[:-1] + (1,))


#: the values of every decode probe but the values probe's first call: exact in float16, bfloat16 and 8-bit
#: absmax, and each measured on its own by the values probe, so a port's own value rule can be replayed
POOL = _signs(np.random.default_rng(5), (NKV, 24, D))


def _decode_inputs(rng, T, K, inv):
    q_pre = rng.standard_normal((NQ, D)) * 1.5
    k_post = oracle.rope_apply(rng.standard_normal((NKV, T, D)) * 1.5, np.arange(T), inv, traditional=True)
    C = rng.standard_normal((NKV, K, D))
    codes = rng.integers(0, K, (NKV, T)).astype(np.uint8)
    return q_pre, k_post, C, codes


def _decode_attend_probe(rng):
    T, inv = 10, _inv()
    q_pre, k_post, C, codes = _decode_inputs(rng, T, 6, inv)
    v = POOL[:, :T]
    base = dict(b=37, w=T, sinks=0, topk=0.1, inv_freqs=inv, traditional=True, return_mask=True)
    calls = []
    for i, scale in ((T - 1, None), (T - 4, 0.7)):
        q_post = oracle.rope_apply(q_pre, np.full(NQ, float(i)), inv, traditional=True)
        calls.append(("decode_step", (q_post, k_post, v, codes, C), dict(base, query_pos=i, scale=scale)))
    return dict(calls=calls, clause="RET-DECODE", needs=("decode_step",), max_position=64.0)


def _decode_values_probe(rng):
    T = 10
    inv = _inv()
    v = rng.standard_normal((NKV, T, D)) * 3.0
    k_post, C = np.zeros((NKV, T, D)), np.zeros((NKV, 4, D))
    codes = rng.integers(0, 4, (NKV, T)).astype(np.uint8)
    q = rng.standard_normal((NQ, D))
    kw = dict(b=37, sinks=0, topk=0.1, inv_freqs=inv, traditional=True, return_mask=True)
    calls = [("decode_step", (q, k_post, v, codes, C), dict(kw, query_pos=T - 1, w=T))]
    for t in range(POOL.shape[1]):   # one visible token: the output is that token's values as the port reads them
        calls.append(("decode_step", (q, np.zeros((NKV, 1, D)), POOL[:, t:t + 1], np.zeros((NKV, 1), np.uint8),
                                      C), dict(kw, query_pos=0, w=1)))
    return dict(calls=calls, clause="RET-DECODE", needs=("decode_step",))


def _decode_select_probe(rng):
    T, K = 14, 14
    inv = np.zeros(D // 2)        # every rotation the identity: only the signal that scores the tokens decides
    q = rng.standard_normal((NQ, D))
    k_post = rng.standard_normal((NKV, T, D))
    C = rng.standard_normal((NKV, K, D))
    codes = np.tile(rng.permutation(K), (NKV, 1))[:, :T].astype(np.uint8)
    v = POOL[:, :T]
    calls = [("decode_step", (q, k_post, v, codes, C), dict(query_pos=T - 1, b=37, w=1, sinks=0, topk=0.15,
                                                            inv_freqs=inv, traditional=True, return_mask=True))]
    return dict(calls=calls, clause="RET-DECODE", needs=("decode_step",))


def _decode_lut_probe(rng):
    T, K, inv = 16, 16, _inv()
    q_pre, k_post, C, _ = _decode_inputs(rng, T, K, inv)
    codes = np.tile(rng.permutation(K), (NKV, 1)).astype(np.uint8)
    v = POOL[:, :T]
    i = T - 1
    q_post = oracle.rope_apply(q_pre, np.full(NQ, float(i)), inv, traditional=True)
    calls = [("decode_step", (q_post, k_post, v, codes, C), dict(query_pos=i, b=5, w=1, sinks=0, topk=0.13,
                                                                 inv_freqs=inv, traditional=True, return_mask=True))]
    return dict(calls=calls, clause="RET-DECODE", needs=("decode_step",), max_position=64.0)


def _lut_ties_inputs():
    """Per KV group, head A's and head B's LUT rows 1 + eps: gaps above float32's tie margin, inside one float16
    (first pair of rows) or one bfloat16 step (second) of 1.0, with the best code of A and of B different."""
    q = np.zeros((NQ, D))
    q[0::2, 0] = q[1::2, 1] = 1.0
    Cs = []
    for eps_a, eps_b in (([2.2e-4, 4.4e-4, 0.0], [4.4e-4, 0.0, 2.2e-4]),     # float16 rounds all to 1.0
                         ([3.5e-3, 0.0], [0.0, 3.5e-3])):                    # bfloat16 does, float16 does not
        C = np.zeros((NKV, 6, D))
        C[:, :, :2] = 0.25
        n = len(eps_a)
        C[:, :n, 0], C[:, :n, 1] = 1.0 + np.array(eps_a), 1.0 + np.array(eps_b)
        Cs.append(C)
    return q, Cs


def _lut_ties_probe(rng):
    q, Cs = _lut_ties_inputs()
    return dict(calls=[("lut_scores", (q, C), {"scale": 1.0}) for C in Cs], clause="RET-LUT", needs=("lut_scores",))


def _decode_lut_ties_probe(rng):
    """Near ties that only the LUT's precision decides (_lut_ties_inputs), one token per code: a LUT held at that
    precision ties every candidate in both heads alike, so any tie rule picks one token for the group where the
    spec picks two."""
    T = 6
    inv = np.zeros(D // 2)        # identity rotations: q_b is the query, the LUT is q·C
    q, Cs = _lut_ties_inputs()
    k_post, v = rng.standard_normal((NKV, T, D)), POOL[:, :T]
    codes = np.tile(np.arange(T), (NKV, 1)).astype(np.uint8)
    kw = dict(query_pos=T - 1, b=37, w=1, sinks=0, topk=0.2, inv_freqs=inv, traditional=True, scale=1.0,
              return_mask=True)
    return dict(calls=[("decode_step", (q, k_post, v, codes, C), dict(kw)) for C in Cs], clause="RET-DECODE",
                needs=("decode_step",))


def _kmeans_init_probe(rng):
    z = rng.standard_normal((6, 3))
    calls = [("kmeanspp_init", (z, 3, np.array([0.05, 0.0, 0.7])), {})]   # u = 0: the CDF's boundary
    return dict(calls=calls, clause="EQ-17-INIT", needs=("kmeanspp_init",))


def _lloyd_probe(rng):
    z = np.array([[-3.0, 0.0], [3.0, 0.0], [10.0, 1.0], [10.0, -1.0], [10.0, 0.0]])
    C = np.array([[0.0, 0.0], [10.0, 0.0], [100.0, 100.0], [-100.0, 100.0]])   # clusters 2 and 3 empty
    return dict(calls=[("lloyd_step", (z, C), {})], clause="EQ-17-STEP", needs=("lloyd_step",))


def _kmeans_probe(rng):
    z = np.concatenate([rng.standard_normal((10, 2)) + c for c in ((0, 0), (4, 0), (0, 4))]) * 0.01 + 1.0
    return dict(calls=[("kmeans", (z, 3), dict(seed=0, max_iter=50, tol=0.05))], clause="EQ-17-FIT",
                needs=("kmeans",))


def _codes_dtype_probe(rng):
    return dict(calls=[("code_dtype", (K,), {}) for K in (16, 256, 257, 4096, 65536)], clause="CODES-DTYPE",
                needs=("code_dtype",))


def _cache_config(rng, K=8, **over):
    inv = _inv()
    H, L = _metric(rng)
    Ls = np.stack([L, oracle.cholesky(H + np.eye(D))])
    Cz = rng.standard_normal((NKV, K, D))
    cfg = dict(n_kv_heads=NKV, n_q_heads=NQ, head_dim=D, Cz=Cz, L=Ls, C=oracle.back_transform(Cz, Ls), w=3, b=37,
               sinks=1, topk=0.25, scale=None, inv_freqs=inv, traditional=True)
    cfg.update(over)
    return cfg


def _tokens(rng, start, n):
    k = oracle.rope_apply(rng.standard_normal((NKV, n, D)), np.arange(start, start + n), _inv(), traditional=True)
    return k, rng.standard_normal((NKV, n, D))


def _cache_trim_probe(rng):
    cfg = _cache_config(rng)
    calls = [("make_cache", (cfg,), {}), ("cache0.append", _tokens(rng, 0, 12), {}),
             ("cache0.append", _tokens(rng, 12, 5), {}), ("cache0.trim", (5,), {}),
             ("cache0.append", _tokens(rng, 12, 6), {}), ("cache0.codes", (), {})]
    return dict(calls=calls, clause="CACHE-TRIM", needs=("make_cache",), cache_ops=("append", "trim"),
                max_position=32.0)


def _cache_save_probe(rng):
    cfg = _cache_config(rng, w=5, b=300, sinks=2, topk=0.2, scale=0.6)
    path = TMP_PLACEHOLDER + "/profile-cache"
    T = 24
    q = oracle.rope_apply(rng.standard_normal((NQ, D)) * 2.0, np.full(NQ, T - 1.0), _inv(), traditional=True)
    calls = [("make_cache", (cfg,), {}), ("cache0.append", (_tokens(rng, 0, T)[0], POOL[:, :T]), {}),
             ("cache0.decode", (q,), {}),
             ("cache0.save", (path,), {}), ("cache0.load", (path,), {}), ("cache1.decode", (q,), {})]
    return dict(calls=calls, clause="CACHE-SAVE", needs=("make_cache",), cache_ops=("append", "decode", "save_load"),
                max_position=300.0)


def _cache_decode_probe(rng):
    T = 10
    cfg = _cache_config(rng)
    k, v = _tokens(rng, 0, T)
    calls = [("make_cache", (cfg,), {}), ("cache0.append", (k[:, :4], v[:, :4]), {}),   # two chunks: the second
             ("cache0.append", (k[:, 4:], v[:, 4:]), {}), ("cache0.codes", (), {})]     # starts past position 0
    return dict(calls=calls, clause="CACHE-FAR-CODES", needs=("make_cache",), cache_ops=("append",),
                max_position=64.0)


def _cache_values_probe(rng):
    T = 10
    cfg = _cache_config(rng, w=T, sinks=0, topk=0.1)   # every token in the window: the selection is all
    cfg["Cz"] = np.zeros_like(cfg["Cz"])               # and C = 0: exact and quantized keys both score 0
    cfg["C"] = np.zeros_like(cfg["C"])
    k = np.zeros((NKV, T, D))
    v = rng.standard_normal((NKV, T, D)) * 3.0
    calls = [("make_cache", (cfg,), {}), ("cache0.append", (k, v), {}),
             ("cache0.decode", (rng.standard_normal((NQ, D)),), {})]
    return dict(calls=calls, clause="CACHE-DECODE", needs=("make_cache",), cache_ops=("append", "decode"))


def _cache_topk_probe(rng):
    T = 12                                             # a buffer of 256 or more: int(0.25 · 12) = 3 against 64
    cfg = _cache_config(rng, w=1, sinks=0, topk=0.25)
    k, v = _tokens(rng, 0, T)
    q = oracle.rope_apply(rng.standard_normal((NQ, D)) * 2.0, np.full(NQ, T - 1.0), _inv(), traditional=True)
    calls = [("make_cache", (cfg,), {}), ("cache0.append", (k, v * 3.0), {}), ("cache0.decode", (q,), {})]
    return dict(calls=calls, clause="CACHE-DECODE", needs=("make_cache",), cache_ops=("append", "decode"),
                max_position=64.0, confounded_by=("cache-values",))


#: probe id -> builder; probes run in this order, and each later probe's predictions compose the variants
#: found by the earlier ones (a decode probe predicts with the port's own RoPE layout, keys, values, ...)
_BUILDERS = {
    "rope": _rope_probe, "freqs": _freqs_probe, "far": _far_probe, "moment": _moment_probe,
    "assign": _assign_probe, "far-keys": _far_keys_probe, "topk": _topk_probe, "select": _select_probe,
    "decode-values": _decode_values_probe, "decode-attend": _decode_attend_probe, "cache-decode": _cache_decode_probe, "cache-values": _cache_values_probe,
    "decode-select": _decode_select_probe, "decode-lut": _decode_lut_probe,
    "lut-ties": _lut_ties_probe, "decode-lut-ties": _decode_lut_ties_probe, "kmeans-init": _kmeans_init_probe,
    "lloyd": _lloyd_probe, "kmeans": _kmeans_probe, "codes-dtype": _codes_dtype_probe,
    "cache-trim": _cache_trim_probe, "cache-save": _cache_save_probe, "cache-topk": _cache_topk_probe,
}


def build(probe_id: str) -> Probe:
    spec = _BUILDERS[probe_id](np.random.default_rng(sorted(_BUILDERS).index(probe_id) + 11))
    mechs = tuple(m.id for m in MECHANISMS if m.probe == probe_id)
    return Probe(id=probe_id, mechanisms=mechs, **spec)


PROBES = tuple(_BUILDERS)
