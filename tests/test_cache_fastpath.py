"""The cache's sync-free hot path equals the checked clause functions it stands in for (bit for bit)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref import cache as C
from a2ats_ref.eq12_far_keys import far_keys
from a2ats_ref.eq16_z_transform import assign_z
from a2ats_ref.retrieval import decode_attention_gather
from a2ats_ref.rope import rope_apply, rope_inv_freqs, rope_invert
from test_cache_support import quiet_codebook

D, NKV, NQ = 16, 2, 4


@pytest.mark.parametrize("traditional", [False, True])
def test_rotation_and_codes_match_clause_functions(traditional):
    rng = np.random.default_rng(0)
    inv = rope_inv_freqs(D, 10000.0)
    x = mx.array(rng.standard_normal((2, NKV, 9, D)).astype(np.float32))
    pos = mx.arange(100, 109)
    for sign, ref in ((1.0, rope_apply), (-1.0, rope_invert)):
        np.testing.assert_array_equal(np.array(C._rotate(x, pos, inv, traditional, sign)),
                                      np.array(ref(x, pos, inv, traditional=traditional)))
    lc = quiet_codebook(1, NKV, D, K=40).layers[0]
    got = C.assign_codes(x, pos, lc, inv, traditional=traditional)
    want = assign_z(far_keys(x, pos, inv, traditional=traditional), lc.Cz, lc.L)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("topk", [0.1, 3, 1.0])
def test_decode_gather_matches_retrieval_module(traditional, topk):
    rng = np.random.default_rng(1)
    inv = rope_inv_freqs(D, 10000.0)
    T = 57
    lc = quiet_codebook(1, NKV, D, K=40).layers[0]
    q = mx.array(rng.standard_normal((2, NQ, 1, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((2, NKV, T, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, NKV, T, D)).astype(np.float32))
    codes = mx.array(rng.integers(0, 40, (2, NKV, T)).astype(np.uint8))
    cfg = C.A2ATSConfig(w=6, b=300, sinks=3, topk=topk)
    out, idx = C.decode_gather(q, k, v, codes, lc, query_pos=T - 1, config=cfg, inv_freqs=inv,
                               traditional=traditional, scale=0.3)
    ref, ridx, _ = decode_attention_gather(q, k, v, codes, lc.C, query_pos=T - 1, b=cfg.b, w=cfg.w, sinks=cfg.sinks,
                                           topk=cfg.topk, inv_freqs=inv, traditional=traditional, scale=0.3,
                                           return_indices=True)
    np.testing.assert_array_equal(np.array(out), np.array(ref))
    np.testing.assert_array_equal(np.array(idx), np.array(ridx))
