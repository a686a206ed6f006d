"""The cache's sync-free hot path (append -> codes, decode) equals the checked clause functions, bit for bit.

The cache calls the clause modules' *_unchecked kernels directly; these tests drive the cache itself and
compare with the validated public functions, so a wrong argument mapping in the cache shows up here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref import cache as C
from a2ats_ref.eq12_far_keys import far_keys
from a2ats_ref.eq16_z_transform import assign_z
from a2ats_ref.retrieval import decode_attention_gather, decode_step
from a2ats_ref.rope import rope_inv_freqs
from test_cache_support import quiet_codebook

D, NKV, NQ, K = 16, 2, 4, 40


def _seeded_cache(lc, inv, traditional, T, rng, cfg=None):
    cache = C.A2ATSCache(lc, inv, traditional, cfg)
    k = mx.array(rng.standard_normal((2, NKV, T, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, NKV, T, D)).astype(np.float32))
    cache.state = (k, v, mx.array(rng.integers(0, K, (2, NKV, T)).astype(np.uint8)))
    return cache


@pytest.mark.parametrize("traditional", [False, True])
def test_appended_codes_match_clause_functions(traditional):
    rng = np.random.default_rng(0)
    inv = rope_inv_freqs(D, 10000.0)
    lc = quiet_codebook(1, NKV, D, K=K).layers[0]
    cache = _seeded_cache(lc, inv, traditional, 100, rng)
    x = mx.array(rng.standard_normal((2, NKV, 9, D)).astype(np.float32))
    cache.update_and_fetch(x, x)
    got = cache.codes_view()[..., 100:]
    want = assign_z(far_keys(x, mx.arange(100, 109), inv, traditional=traditional), lc.Cz, lc.L)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("topk", [0.1, 3, 1.0])
def test_decode_matches_retrieval_clause_functions(traditional, topk):
    rng = np.random.default_rng(1)
    inv = rope_inv_freqs(D, 10000.0)
    T = 57
    lc = quiet_codebook(1, NKV, D, K=K).layers[0]
    cfg = C.A2ATSConfig(w=6, b=300, sinks=3, topk=topk)
    cache = _seeded_cache(lc, inv, traditional, T, rng, cfg)
    k, v = cache.keys_and_values()
    codes = cache.codes_view()
    q = mx.array(rng.standard_normal((2, NQ, 1, D)).astype(np.float32))
    out = cache.decode(q, scale=0.3)
    kw = dict(query_pos=T - 1, b=cfg.b, w=cfg.w, sinks=cfg.sinks, topk=cfg.topk, inv_freqs=inv,
              traditional=traditional, scale=0.3)
    ref = decode_attention_gather(q, k, v, codes, lc.C, **kw)
    np.testing.assert_array_equal(np.array(out), np.array(ref))
    _, mask = decode_step(q[:, :, 0, :], k, v, codes, lc.C, return_mask=True, **kw)
    np.testing.assert_array_equal(np.array(cache.last_selection), np.array(mask))
