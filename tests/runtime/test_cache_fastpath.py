"""The cache's sync-free hot path (append -> codes, decode) agrees with the checked clause functions.

Appending calls the clause modules' *_unchecked kernels (codes equal assign_z(far_keys(...)) bit for bit);
decoding runs fast_decode.decode_step_fast on the preallocated buffers. These tests drive the cache itself
and compare with the validated public functions (retrieval.decode_step, retrieval.retrieval_attention) and
the oracle's allowed-result sets, so a wrong argument mapping or a stale buffer row shows up here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import a2ats_spec.oracle as O
from a2ats_conformance.harness.tolerances import tie_margin, tolerance
from a2ats_ref.runtime import cache as C, coding
from a2ats_ref.eq12_far_keys import far_keys
from a2ats_ref.eq16_z_transform import assign_z
from a2ats_ref.retrieval import decode_step, retrieval_attention
from a2ats_ref.rope import rope_inv_freqs
from test_cache_support import quiet_codebook

D, NKV, NQ, K = 16, 2, 4, 40


def _seeded_cache(lc, inv, traditional, T, rng, cfg=None):
    cache = C.A2ATSCache(lc, inv, traditional, cfg)
    k = mx.array(rng.standard_normal((2, NKV, T, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, NKV, T, D)).astype(np.float32))
    cache.state = (k, v, mx.array(rng.integers(0, K, (2, NKV, T)).astype(np.uint8)))
    return cache


@pytest.mark.clause("CACHE-FAR-CODES")
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


def _check_decode(cache, q, scale, traditional):
    """cache.decode(q) against decode_step on the cache's valid prefix, the oracle's allowed sets, and
    exact attention (retrieval_attention) over the selection the cache reports."""
    cfg, lc, T = cache.config, cache.codebook, cache.offset
    k, v = cache.keys_and_values()
    codes = cache.codes_view()
    out = cache.decode(q, scale=scale)
    sel = np.array(cache.last_selection)
    kw = dict(query_pos=T - 1, b=cfg.b, w=cfg.w, sinks=cfg.sinks, topk=cfg.topk, inv_freqs=cache.inv_freqs,
              traditional=traditional, scale=scale)
    ref, mask = decode_step(q[:, :, 0, :], k, v, codes, lc.C, return_mask=True, **kw)
    mask = np.array(mask)
    f64 = lambda a: np.array(a, dtype=np.float64)
    qb = O.far_query(f64(q[:, :, 0, :]), b=cfg.b, inv_freqs=f64(cache.inv_freqs), traditional=traditional,
                     positions=T - 1)
    scores = O.token_scores(O.lut_scores(qb, f64(lc.C), scale=scale), np.array(codes))
    must, may = O.select_tokens_allowed(scores, n_kv_heads=NKV, query_pos=T - 1, w=cfg.w, sinks=cfg.sinks,
                                        topk=cfg.topk, margin=tie_margin("float32", "RET-SELECT"))
    assert sel.shape == mask.shape == (q.shape[0], NKV, T)
    assert not (must & ~sel).any() and not (sel & ~may).any(), "RET-SELECT: selection outside the allowed set"
    # Outside the near-tie band the hot path and the clause function pick exactly the same tokens.
    firm = ~(may & ~must)
    np.testing.assert_array_equal(sel & firm, mask & firm)
    rtol, atol = tolerance("float32", "RET-ATTN")
    want = retrieval_attention(q[:, :, 0, :], k, v, mx.array(sel), scale=scale)
    np.testing.assert_allclose(np.array(out)[:, :, 0], np.array(want), rtol=rtol, atol=atol)
    if (sel == mask).all():
        np.testing.assert_allclose(np.array(out)[:, :, 0], np.array(ref), rtol=rtol, atol=atol)
    return out


@pytest.mark.clause("RET-DECODE")
@pytest.mark.parametrize("method", ["auto", "sortfree"])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("topk", [0.1, 3, 1.0])
def test_decode_matches_retrieval_clause_functions(traditional, topk, method):
    rng = np.random.default_rng(1)
    inv = rope_inv_freqs(D, 10000.0)
    T = 57
    lc = quiet_codebook(1, NKV, D, K=K).layers[0]
    cfg = C.A2ATSConfig(w=6, b=300, sinks=3, topk=topk)
    cache = _seeded_cache(lc, inv, traditional, T, rng, cfg)
    cache.select_method = method
    q = mx.array(rng.standard_normal((2, NQ, 1, D)).astype(np.float32))
    _check_decode(cache, q, 0.3, traditional)


@pytest.mark.clause("RET-DECODE")
@pytest.mark.parametrize("method", ["auto", "sortfree"])
@pytest.mark.parametrize("traditional", [False, True])
def test_decode_reads_only_the_valid_prefix_of_the_buffer(traditional, method):
    """After appends (256-row preallocation) and a trim, rows past offset are stale and must not be read."""
    rng = np.random.default_rng(2)
    inv = rope_inv_freqs(D, 10000.0)
    lc = quiet_codebook(1, NKV, D, K=K).layers[0]
    cache = C.A2ATSCache(lc, inv, traditional, C.A2ATSConfig(w=5, b=200, sinks=2, topk=0.2))
    cache.select_method = method
    x = mx.array(rng.standard_normal((2, NKV, 120, D)).astype(np.float32))
    cache.update_and_fetch(x, x)
    big = mx.full((2, NKV, 10, D), 1e3)
    cache.update_and_fetch(big, big)   # would dominate the softmax if read after the trim
    assert cache.trim(10) == 10 and cache.keys.shape[2] == 256
    q = mx.array(rng.standard_normal((2, NQ, 1, D)).astype(np.float32))
    _check_decode(cache, q, D ** -0.5, traditional)
    assert cache.last_selection.shape == (2, NKV, 120)
    cache.trim(1)
    assert cache.last_selection is None


@pytest.mark.clause("CACHE-FAR-CODES")
def test_codes_are_assigned_in_batches_when_tokens_leave_the_window(monkeypatch):
    """Code assignment: a prefill chunk is coded as it is appended (the first decode after a long prompt must not
    code the whole prompt); token-by-token generation assigns codes once per ~w tokens (one batch),
    every decode still scores far tokens with their true codes (the oracle's allowed sets, from codes
    computed independently with assign_z), and codes_view() gives every token's code on demand."""
    rng = np.random.default_rng(4)
    inv = rope_inv_freqs(D, 10000.0)
    lc = quiet_codebook(1, NKV, D, K=K).layers[0]
    cfg = C.A2ATSConfig(w=8, b=300, sinks=2, topk=0.2)
    cache = C.A2ATSCache(lc, inv, False, cfg)
    calls = []
    real = coding.assign_codes
    monkeypatch.setattr(coding, "assign_codes", lambda k, *a, **kw: calls.append(k.shape[2]) or real(k, *a, **kw))
    ks = rng.standard_normal((1, NKV, 60, D)).astype(np.float32)
    cache.update_and_fetch(mx.array(ks[:, :, :20]), mx.array(ks[:, :, :20]))   # a prefill: coded with it
    assert calls == [20]
    for t in range(20, 60):
        cache.update_and_fetch(mx.array(ks[:, :, t : t + 1]), mx.array(ks[:, :, t : t + 1]))
        q = mx.array(rng.standard_normal((1, NQ, 1, D)).astype(np.float32))
        cache.decode(q, scale=0.3)
    # the prefill in one batch; then one batch per w + 1 decode tokens
    assert calls == [20, 9, 9, 9, 9], f"expected batches [20, 9, 9, 9, 9], got {calls}"
    sel = np.array(cache.last_selection)
    want = np.array(assign_z(far_keys(mx.array(ks), mx.arange(60), inv, traditional=False), lc.Cz, lc.L))
    T = 60
    qb = O.far_query(np.array(q[:, :, 0, :], np.float64), b=cfg.b, inv_freqs=np.array(inv, np.float64),
                     traditional=False, positions=T - 1)
    scores = O.token_scores(O.lut_scores(qb, np.array(lc.C, np.float64), scale=0.3), want)
    must, may = O.select_tokens_allowed(scores, n_kv_heads=NKV, query_pos=T - 1, w=cfg.w, sinks=cfg.sinks,
                                        topk=cfg.topk, margin=tie_margin("float32", "RET-SELECT"))
    assert not (must & ~sel).any() and not (sel & ~may).any(), "decode scored far tokens with stale codes"
    np.testing.assert_array_equal(np.array(cache.codes_view()), want)   # the window's pending codes too
    assert sum(calls) == 60, calls                                     # every token coded exactly once


def _counts_ok(cache):
    """The kept per-code counts, and the mx copy decode reads, are code_counts of the coded tokens [0, _coded)."""
    from a2ats_ref.runtime.decode.portable import code_counts

    if cache._coded == 0:
        return cache._counts is None or not np.array(cache._counts).any()
    want = np.array(code_counts(cache.codes[..., : cache._coded], K))
    return np.array_equal(cache._counts, want) and np.array_equal(np.array(cache._counts_array()), want)


@pytest.mark.clause("CACHE-TRIM", "CACHE-SAVE")
def test_code_counts_follow_coding_trim_and_load(monkeypatch, tmp_path):
    """Per-code counts (what the sort-free step walks instead of sorting T tokens) stay the counts of the
    coded tokens through deferred batch coding, decodes, trims into coded and pending tokens, and a
    save/load (recounted from the codes, not stored). A trim that forgets them is caught."""
    from a2ats_ref.files.cache import load_a2ats_cache, save_a2ats_cache

    rng = np.random.default_rng(5)
    inv = rope_inv_freqs(D, 10000.0)
    cb = quiet_codebook(1, NKV, D, K=K)
    cache = C.A2ATSCache(cb.layers[0], inv, False, C.A2ATSConfig(w=4, b=300, sinks=2, topk=0.2))
    cache.select_method = "sortfree"
    x = mx.array(rng.standard_normal((1, NKV, 70, D)).astype(np.float32))
    cache.update_and_fetch(x[:, :, :30], x[:, :, :30])
    history = []
    for t in range(30, 70):
        cache.update_and_fetch(x[:, :, t : t + 1], x[:, :, t : t + 1])
        cache.decode(mx.array(rng.standard_normal((1, NQ, 1, D)).astype(np.float32)), scale=0.3)
        history.append(_counts_ok(cache))
        if t in (45, 60):
            cache.trim(3 if t == 45 else 9)   # into pending tokens, then into coded ones
            history.append(_counts_ok(cache))
    assert all(history), history
    q = mx.array(rng.standard_normal((1, NQ, 1, D)).astype(np.float32))
    _check_decode(cache, q, 0.3, False)
    save_a2ats_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = load_a2ats_cache(str(tmp_path / "c.safetensors"), cb)
    assert _counts_ok(loaded) and loaded._coded == loaded.offset
    real = C.A2ATSCache._count_codes
    monkeypatch.setattr(C.A2ATSCache, "_count_codes", lambda self, codes, sign: sign < 0 or real(self, codes, sign))
    cache.trim(20)
    assert not _counts_ok(cache)


def test_query_angle_is_shared_only_where_it_is_the_same():
    """The query angle's tables are made once per position and shared by layers with the same rope
    (_query_angle): each cache still gets exactly applied_cos_sin of its own rope and newest position, for
    ropes that differ in base, in scale or in llama3 freqs, caches at different positions, and after the
    position moves on. make_a2ats_cache gives layers with equal rope arguments one shared dict."""
    import mlx.nn as nn
    from mlx_lm.models.rope_utils import Llama3RoPE

    from a2ats_ref.rope import applied_cos_sin, fast_rope_args
    from test_cache_support import tiny_llama

    rng = np.random.default_rng(5)
    lc = quiet_codebook(1, NKV, D, K=K).layers[0]
    inv = rope_inv_freqs(D, 10000.0)
    l3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    ropes = [nn.RoPE(D, base=10000.0), nn.RoPE(D, base=500000.0), nn.RoPE(D, base=10000.0, scale=0.5),
             Llama3RoPE(D, base=10000.0, scaling_config=l3), Llama3RoPE(D, base=80.0, scaling_config=l3)]
    caches = [C.A2ATSCache(lc, inv, False, fast_rope=fast_rope_args(r)) for r in ropes]
    for T in (30, 31):
        for i, c in enumerate(caches):
            n = T + (i == 4)   # the last cache a token ahead of the others
            c.state = tuple(mx.array(rng.standard_normal((1, NKV, n, D)).astype(np.float32)) for _ in range(2)) + (
                mx.array(rng.integers(0, K, (1, NKV, n)).astype(np.uint8)),)
        for c in caches:
            got = c._query_angle()
            want = applied_cos_sin(mx.array([c.offset - 1]), D, False, c.fast_rope)
            for g, w_ in zip(got, want):
                np.testing.assert_array_equal(np.array(g), np.array(w_[0]))
    model_caches = C.make_a2ats_cache(tiny_llama(), quiet_codebook(), allow_random_codebook=True)
    assert len({id(c.fast_rope) for c in model_caches}) == 1
    f3, f3b, f80 = (fast_rope_args(r) for r in (ropes[3], Llama3RoPE(D, base=10000.0, scaling_config=l3), ropes[4]))
    assert C._same_rope(f3, f3b) and not C._same_rope(f3, f80) and not C._same_rope(f3, fast_rope_args(ropes[0]))
