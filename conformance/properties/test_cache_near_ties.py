"""CACHE-DECODE at near ties: a cache's decode ranks LUT scores as accurately as RET-LUT's tolerance allows.

The cache computes its LUT itself (from its codebook and the query), so a cache that holds its LUT operand in
float16, or scores in a half dtype, ranks near ties wrongly while every random draw of test_cache.py passes
(random scores are rarely closer than CACHE-DECODE's margin). Here the scores sit on a ladder of levels
GAP_IN_MARGINS RET-LUT tie margins apart (test_retrieval.near_tie_case, through the cache protocol): each
token's pre-RoPE key lies on its codeword (L = I, so z-space is key space and the codes are exact), and each
codeword is moved within the span of its group's rotated queries onto its level.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_conformance.harness.tolerances import tie_margin, tolerance
from a2ats_spec import oracle

from .test_cache import CacheCalls, _oracle_cache
from .test_retrieval import GAP_IN_MARGINS


@st.composite
def cache_near_tie_case(draw, *, dtype):
    d = draw(st.sampled_from([64, 128]), label="head_dim")
    K = draw(st.sampled_from([64, 128]), label="K")
    T = draw(st.integers(200, 400), label="T")
    n_q, n_kv = draw(hh.gqa_heads(max_kv=2, max_group=2), label="heads")
    G = n_q // n_kv
    t = draw(hh.layouts(), label="traditional")
    b = draw(st.sampled_from([64, 2048]), label="b")
    w = draw(st.integers(1, 16), label="w")
    sinks = draw(st.integers(0, 8), label="sinks")
    topk = draw(hh.topk_values(fractions=(0.03, 0.1, 0.25), counts=(8, 32)), label="topk")
    seed = draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    inv = oracle.rope_inv_freqs(d, 10000.0)
    scale = 1.0 / np.sqrt(d)
    gap = GAP_IN_MARGINS * tie_margin(dtype, "RET-LUT")
    q_post = oracle.rope_apply(hh.normal(rng, (n_q, d)), T - 1, inv, traditional=t)
    qb = oracle.far_query(q_post, b=b, inv_freqs=inv, traditional=t, positions=T - 1)
    C = hh.normal(rng, (n_kv, K, d), 2.0)
    for g in range(n_kv):
        Q = qb[g * G:(g + 1) * G]
        levels = np.stack([rng.permutation(K) for _ in range(G)]) - K / 2
        C[g] += np.linalg.solve(Q @ Q.T, gap * levels / scale - Q @ C[g].T).T @ Q
    L = np.broadcast_to(np.eye(d), (n_kv, d, d)).copy()
    codes = rng.integers(0, K, size=(n_kv, T))
    k_pre = np.take_along_axis(C, codes[..., None], axis=1)                  # every key on its codeword
    k_post = oracle.rope_apply(k_pre, np.arange(T), inv, traditional=t)
    v = hh.normal(rng, (n_kv, T, d))
    config = dict(n_kv_heads=n_kv, n_q_heads=n_q, head_dim=d, Cz=C, L=L, C=C, inv_freqs=inv, traditional=t,
                  w=w, b=b, sinks=sinks, topk=topk, scale=None)
    notes = dict(seed=seed, n_q=n_q, n_kv=n_kv, K=K, head_dim=d, T=T, w=w, b=b, sinks=sinks, topk=topk,
                 gap_in_margins=GAP_IN_MARGINS)
    return config, q_post, k_post, v, notes


@pytest.mark.clause("CACHE-DECODE", requires={"cache_ops": "decode"})
@pytest.mark.cost(2)   # a new head shape per example: on a GPU, each one compiles and self-checks the decode kernels
@settings(max_examples=max(5, settings.default.max_examples // 5))   # each example builds a 200-400 token cache
@given(data=st.data())
def test_cache_decode_near_ties(ctx, data):
    """The cache's selection is judged with RET-LUT's margin (the accuracy of the LUT scores it ranks), its
    output with CACHE-DECODE's tolerance."""
    config, q, k, v, notes = data.draw(cache_near_tie_case(dtype=ctx.dtype), label="case")
    ctx.note(**notes)
    c = CacheCalls(ctx, config)
    orc = _oracle_cache(c)
    k, v, q = ctx.cast(k), ctx.cast(v), ctx.cast(q)
    c.append(k, v)
    orc.append(k, v)
    out, mask = c.decode(q)
    codes = np.asarray(c.codes())
    must, may = orc.decode_allowed(q, codes, lambda s: ctx.margin("RET-LUT", s))
    cfg = orc.config
    ctx.assert_mask_allowed(np.asarray(mask), must, may, clause="CACHE-DECODE",
                            what="selected set at near ties (oracle cache, port's codes; RET-LUT's margin)",
                            selection=dict(scores=orc.decode_scores(q, codes), query_pos=orc.offset - 1, w=cfg["w"],
                                           sinks=cfg["sinks"], topk=cfg["topk"]))
    r, a = tolerance(ctx.dtype, "CACHE-DECODE")
    ctx.assert_close(out, orc.attention(q, np.asarray(mask)), clause="CACHE-DECODE", rtol=r, atol=a,
                     what="output vs exact attention over the selected post-RoPE keys")
