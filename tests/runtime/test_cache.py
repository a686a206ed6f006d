"""CACHE-* — A2ATSCache through a tiny random Llama (both RoPE layouts) and against the float64 oracle."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from a2ats_conformance.harness.tolerances import tie_margin, tolerance
from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig, make_a2ats_cache, random_codebook
from a2ats_ref.runtime.codebook import Codebook, CodebookLayer
from a2ats_ref.runtime.hook import enable_a2ats
from a2ats_spec import oracle
from test_cache_support import HEAD_DIM, N_HEADS, N_KV, a2ats_caches, kv_caches, quiet_codebook, run, tiny_llama, tokens

LAYOUTS = [pytest.param(False, id="half-split"), pytest.param(True, id="traditional")]


@pytest.fixture(scope="module", params=LAYOUTS)
def model(request):
    return enable_a2ats(tiny_llama(traditional=request.param))


def _close(a, b, clause, what):
    rtol, atol = tolerance("float32", clause)
    for i, (x, y) in enumerate(zip(a, b)):
        err = float(np.max(np.abs(x - y)))
        assert np.allclose(x, y, rtol=rtol, atol=atol), f"{clause}: {what}: call {i} max |diff| = {err:.3g}"


# ---------------------------------------------------------------- CACHE-DENSE-EQUIV


@pytest.mark.clause("CACHE-DENSE-EQUIV")
@pytest.mark.parametrize("cfg", [dict(w=4, sinks=2, topk=1.0), dict(w=64, sinks=0, topk=1)], ids=["topk-all", "w>=T"])
def test_dense_equivalence_when_everything_is_selected(model, cfg):
    toks = tokens(48)
    ours = run(model, toks, a2ats_caches(model, **cfg), prefill=20)
    ref = run(model, toks, kv_caches(model), prefill=20)
    _close(ours, ref, "CACHE-DENSE", f"A2ATS {cfg} vs mlx-lm KVCache")


@pytest.mark.clause("CACHE-DECODE")
def test_selection_changes_output_when_topk_is_small(model):
    toks = tokens(48)
    ours = run(model, toks, a2ats_caches(model, w=4, sinks=2, topk=1), prefill=20)
    ref = run(model, toks, kv_caches(model), prefill=20)
    np.testing.assert_array_equal(ours[0], ref[0], err_msg="prefill must be mlx-lm's dense attention")
    assert max(np.abs(x - y).max() for x, y in zip(ours[1:], ref[1:])) > 1e-3, "decode never used retrieval"


@pytest.mark.clause("PREFILL")
def test_host_prefill_is_dense_attention(model, monkeypatch, on_cpu):
    """PREFILL through the host kernel (prefill.causal_attention_host; forced here with HOST_PREFILL_MIN = 1):
    one-shot and chunked prefill (queries end-aligned to the keys) equal mlx-lm's KVCache path. The kernel
    is the CPU's (use_host_prefill never picks it on a GPU), so this runs on the CPU device everywhere."""
    import a2ats_ref.prefill as pf

    calls = []
    real = pf.causal_attention_host
    monkeypatch.setattr(pf, "HOST_PREFILL_MIN", 1)
    monkeypatch.setattr(pf, "causal_attention_host", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    toks = tokens(48, seed=9)
    cfg = dict(w=4, sinks=2, topk=1.0)
    _close(run(model, toks, a2ats_caches(model, **cfg), prefill=20), run(model, toks, kv_caches(model), prefill=20),
           "CACHE-DENSE", "host prefill, then decode over everything")
    ours, ref = a2ats_caches(model, **cfg), kv_caches(model)
    for s, e in ((0, 7), (7, 30), (30, 31), (31, 48)):
        _close([np.array(model(toks[:, s:e], cache=ours))], [np.array(model(toks[:, s:e], cache=ref))],
               "PREFILL", f"chunk [{s}, {e}) through the host kernel")
    assert len(calls) >= 2 * len(model.layers) and calls[0][2] == 20, calls


def test_no_bits_attribute():
    model = tiny_llama()
    for c in a2ats_caches(model):
        assert not hasattr(c, "bits"), "mlx-lm routes caches with `bits` to quantized attention"


# ---------------------------------------------------------------- CACHE-TRIM


@pytest.mark.clause("CACHE-TRIM")
def test_trim_rollback_then_reappend_is_identical(model):
    toks = tokens(40, seed=3)
    cfg = dict(w=4, sinks=2, topk=2)
    straight = a2ats_caches(model, **cfg)
    ref = run(model, toks, straight, prefill=16)
    codes_ref = [np.array(c.codes_view()) for c in straight]

    cache = a2ats_caches(model, **cfg)
    run(model, toks[:, :30], cache, prefill=16)
    junk = mx.array([[5, 6, 7, 8, 9]], dtype=mx.int32)
    model(junk, cache=cache)  # speculative tokens that get rejected
    assert [c.trim(5) for c in cache] == [5] * len(cache)
    assert cache[0].offset == 30
    outs = [np.array(model(toks[:, t : t + 1], cache=cache)) for t in range(30, 40)]
    _close(outs, ref[-10:], "CACHE-DECODE", "decode after trim + re-append vs straight run")
    for c, want in zip(cache, codes_ref):
        np.testing.assert_array_equal(np.array(c.codes_view()), want, err_msg="CACHE-TRIM: codes after re-append")


@pytest.mark.clause("CACHE-TRIM")
def test_trim_more_than_offset_clamps():
    model = enable_a2ats(tiny_llama())
    cache = a2ats_caches(model)
    model(tokens(5), cache=cache)
    assert cache[0].trim(99) == 5 and cache[0].offset == 0


@pytest.mark.clause("CACHE-TRIM")
def test_speculative_multi_token_verify_then_trim(model):
    # mlx-lm's speculative path: verify several tokens at once (dense), trim the rejected ones, continue.
    toks = tokens(36, seed=4)
    cfg = dict(w=4, sinks=2, topk=2)
    # The verify block is dense, so the reference prefills through it (chunked dense == one-shot dense).
    ref = run(model, toks, a2ats_caches(model, **cfg), prefill=23)
    cache = a2ats_caches(model, **cfg)
    model(toks[:, :20], cache=cache)
    model(mx.concatenate([toks[:, 20:23], mx.array([[1, 2]], dtype=mx.int32)], axis=1), cache=cache)
    for c in cache:
        c.trim(2)
    outs = [np.array(model(toks[:, t : t + 1], cache=cache)) for t in range(23, 36)]
    _close(outs, ref[-13:], "CACHE-DECODE", "decode after a speculative verify + trim")


# ---------------------------------------------------------------- CACHE-CHUNK


@pytest.mark.clause("CACHE-CHUNK")
def test_chunked_prefill_equals_one_shot(model):
    toks = tokens(60, seed=5)
    cfg = dict(w=4, sinks=2, topk=3)
    one = a2ats_caches(model, **cfg)
    a = run(model, toks, one, prefill=45)
    chunked = a2ats_caches(model, **cfg)
    parts = [model(toks[:, s:e], cache=chunked) for s, e in ((0, 13), (13, 26), (26, 45))]
    b_last = np.array(parts[-1])
    b = [np.array(model(toks[:, t : t + 1], cache=chunked)) for t in range(45, 60)]
    for c1, c2 in zip(one, chunked):
        np.testing.assert_array_equal(np.array(c1.codes_view()), np.array(c2.codes_view()), err_msg="CACHE-CHUNK codes")
    _close([b_last], [a[0][:, 26:45]], "CACHE-DENSE", "last prefill chunk vs one-shot rows")
    _close(b, a[1:], "CACHE-DECODE", "decode after chunked vs one-shot prefill")


# ---------------------------------------------------------------- CACHE-DECODE vs the oracle


@pytest.mark.clause("RET-DECODE")
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("topk", [0.2, 3])
def test_decode_matches_oracle(traditional, topk):
    rng = np.random.default_rng(7)
    cb = quiet_codebook(1, N_KV, HEAD_DIM, K=32, seed=2)
    from a2ats_ref.rope import rope_apply, rope_inv_freqs

    inv = rope_inv_freqs(HEAD_DIM, 10000.0)
    cfg = A2ATSConfig(w=5, b=37, sinks=3, topk=topk)
    cache = A2ATSCache(cb.layers[0], inv, traditional, cfg)
    T, B = 70, 2
    k_pre = rng.standard_normal((B, N_KV, T, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((B, N_KV, T, HEAD_DIM)).astype(np.float32)
    k_post = rope_apply(mx.array(k_pre), mx.arange(T), inv, traditional=traditional)
    cache.update_and_fetch(k_post[:, :, :50], mx.array(v[:, :, :50]))
    for t in range(50, T):
        cache.update_and_fetch(k_post[:, :, t : t + 1], mx.array(v[:, :, t : t + 1]))
    q_pre = rng.standard_normal((B, N_HEADS, 1, HEAD_DIM)).astype(np.float32)
    q_post = rope_apply(mx.array(q_pre), mx.array([T - 1]), inv, traditional=traditional)
    scale = HEAD_DIM**-0.5
    out = np.array(cache.decode(q_post, scale=scale))[:, :, 0]
    sel = np.array(cache.last_selection)

    codes = np.array(cache.codes_view())
    kp, qp, invn = np.array(k_post, dtype=np.float64), np.array(q_post, dtype=np.float64)[:, :, 0], np.array(inv)
    C = np.array(cb.layers[0].C, dtype=np.float64)
    common = dict(query_pos=T - 1, b=cfg.b, inv_freqs=invn, traditional=traditional)
    qb = oracle.far_query(qp, b=cfg.b, inv_freqs=invn, traditional=traditional, positions=T - 1)
    scores = oracle.token_scores(oracle.lut_scores(qb, C, scale=scale), codes)
    must, may = oracle.select_tokens_allowed(
        scores, n_kv_heads=N_KV, query_pos=T - 1, w=cfg.w, sinks=cfg.sinks, topk=cfg.topk,
        margin=tie_margin("float32", "RET-SELECT"),
    )
    assert np.all(sel <= may) and np.all(must <= sel), f"CACHE-DECODE: selection outside the allowed set (topk={topk})"
    want = oracle.retrieval_attention(qp, kp, v.astype(np.float64), sel, scale=scale)
    rtol, atol = tolerance("float32", "CACHE-DECODE")
    np.testing.assert_allclose(out, want, rtol=rtol, atol=atol, err_msg="CACHE-DECODE: attention over the selection")
    # Without near ties the whole oracle decode step agrees too.
    if np.array_equal(must, may):
        full = oracle.decode_step(qp, kp, v, codes, C, w=cfg.w, sinks=cfg.sinks, topk=cfg.topk, scale=scale, **common)
        np.testing.assert_allclose(out, full, rtol=rtol, atol=atol, err_msg="CACHE-DECODE vs oracle.decode_step")


# ---------------------------------------------------------------- CACHE-FAR-CODES


@pytest.mark.clause("CACHE-FAR-CODES")
@pytest.mark.parametrize("traditional", [False, True])
def test_codes_are_position_free_and_match_oracle_assignment(traditional):
    from a2ats_ref.rope import rope_apply, rope_inv_freqs

    rng = np.random.default_rng(11)
    cb = quiet_codebook(1, N_KV, HEAD_DIM, K=48, seed=3).layers[0]
    inv = rope_inv_freqs(HEAD_DIM, 10000.0)
    k_pre = rng.standard_normal((1, N_KV, 24, HEAD_DIM)).astype(np.float32)
    margin = tie_margin("float32", "EQ-16") * 10  # rotation round trip adds angle error (ROPE-INVERSE)
    for shift in (0, 37, 1000):
        cache = A2ATSCache(cb, inv, traditional, A2ATSConfig())
        if shift:
            filler = mx.zeros((1, N_KV, shift, HEAD_DIM))
            cache.update_and_fetch(filler, filler)
        pos = mx.arange(shift, shift + 24)
        cache.update_and_fetch(rope_apply(mx.array(k_pre), pos, inv, traditional=traditional), mx.array(k_pre))
        codes = np.array(cache.codes_view())[..., shift:]
        dist = np.stack([oracle.assign_z_distances(k_pre[0, h].astype(np.float64), np.array(cb.Cz[h]), np.array(cb.L[h]))
                         for h in range(N_KV)])[None]
        allowed = oracle.argmin_allowed(dist, margin)
        ok = np.take_along_axis(allowed, codes[..., None].astype(np.int64), axis=-1)[..., 0]
        assert ok.all(), f"CACHE-FAR-CODES: shift {shift}: codes {codes[~ok]} not nearest (EQ-16) for their pre-RoPE keys"


@pytest.mark.clause("CODES-DTYPE")
def test_codes_dtype_is_smallest_unsigned():
    model = enable_a2ats(tiny_llama())
    for K, dt in ((64, mx.uint8), (300, mx.uint16)):
        cache = a2ats_caches(model, codebook=quiet_codebook(K=K))
        model(tokens(4), cache=cache)
        assert cache[0].codes_view().dtype == dt


# ---------------------------------------------------------------- batches


@pytest.mark.clause("RET-SELECT")
def test_batch_rows_select_independently(model):
    toks = tokens(40, seed=8, batch=2)
    cfg = dict(w=4, sinks=2, topk=2)
    both = run(model, toks, a2ats_caches(model, **cfg), prefill=20)
    for r in range(2):
        alone = run(model, toks[r : r + 1], a2ats_caches(model, **cfg), prefill=20)
        _close([o[r : r + 1] for o in both], alone, "CACHE-DECODE", f"batch row {r} vs alone")


# ---------------------------------------------------------------- protocol details


def test_protocol_state_nbytes_and_mask():
    model = enable_a2ats(tiny_llama())
    cache = a2ats_caches(model)
    c = cache[0]
    assert c.empty() and c.nbytes == 0 and c.size() == 0 and c.is_trimmable() and c.state == ()
    model(tokens(10), cache=cache)
    assert not c.empty() and c.size() == 10 and c.offset == 10
    assert c.nbytes == c.keys.nbytes + c.values.nbytes + c.codes.nbytes
    assert c.keys.shape[2] == 256 and c.codes.shape == (1, N_KV, 256)
    k, v, codes = c.state
    assert k.shape == (1, N_KV, 10, HEAD_DIM) and codes.shape == (1, N_KV, 10)
    np.testing.assert_array_equal(np.array(c.positions), np.arange(10))
    assert c.make_mask(1) is None and c.make_mask(3) == "causal"
    assert c.make_mask(3, return_array=True).shape == (3, 13)
    clone = A2ATSCache.from_state(c.state, c.meta_state, codebook=c.codebook)
    assert clone.offset == 10 and clone.config == c.config and clone.traditional == c.traditional
    np.testing.assert_array_equal(np.array(clone.inv_freqs), np.array(c.inv_freqs))
    with pytest.raises(ValueError, match="load_a2ats_cache"):
        A2ATSCache.from_state(c.state)


def test_buffer_growth_past_one_step():
    model = enable_a2ats(tiny_llama())
    cache = a2ats_caches(model, w=8, sinks=2, topk=4)
    ref = kv_caches(model)
    toks = tokens(262, seed=9)
    model(toks[:, :250], cache=cache)
    model(toks[:, :250], cache=ref)
    outs = [np.array(model(toks[:, t : t + 1], cache=cache)) for t in range(250, 262)]
    assert cache[0].offset == 262 and cache[0].codes.shape[2] == 512
    assert all(np.isfinite(o).all() for o in outs)


# ---------------------------------------------------------------- errors


def test_refuses_to_build_without_codebook():
    model = tiny_llama()
    with pytest.raises(ValueError, match="allow_random_codebook=True"):
        make_a2ats_cache(model)
    with pytest.warns(UserWarning, match="RANDOM codebook"):
        caches = make_a2ats_cache(model, allow_random_codebook=True)
    assert len(caches) == len(model.layers)


def test_random_codebook_warns():
    with pytest.warns(UserWarning, match="wiring"):
        random_codebook(1, 1, 8, 4)


@pytest.mark.parametrize(
    "shape, match",
    [((3, N_KV, HEAD_DIM), "3 layers"), ((2, 1, HEAD_DIM), "n_kv_heads=1"), ((2, N_KV, 8), "head_dim=8")],
)
def test_mismatched_codebook(shape, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        a2ats_caches(model, codebook=quiet_codebook(*shape))


@pytest.mark.parametrize(
    "kw, match",
    [(dict(w=-1), "A2ATSConfig.w"), (dict(b=1.5), "A2ATSConfig.b"), (dict(sinks=True), "A2ATSConfig.sinks"),
     (dict(topk=0.0), "topk"), (dict(topk=1.5), "topk"), (dict(topk=0), "topk"), (dict(topk="3"), "topk")],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        A2ATSConfig(**kw)


def test_codebook_validation():
    with pytest.raises(ValueError, match="Cz"):
        Codebook(mx.zeros((2, 4, 16)), mx.zeros((2, 16, 16)))
    with pytest.raises(ValueError, match="L"):
        Codebook(mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 8, 8)))
    with pytest.raises(ValueError, match="lower-triangular"):
        Codebook(mx.zeros((1, 1, 4, 4)), mx.ones((1, 1, 4, 4)))
    with pytest.raises(ValueError, match="codebook"):
        Codebook.coerce(42)
    with pytest.raises(ValueError, match="CodebookLayer"):
        A2ATSCache("nope", mx.ones(8), False)


def test_cache_rejects_wrong_key_shape():
    cb = quiet_codebook(1)
    from a2ats_ref.rope import rope_inv_freqs

    cache = A2ATSCache(cb.layers[0], rope_inv_freqs(HEAD_DIM, 10000.0), False)
    with pytest.raises(ValueError, match="n_kv_heads"):
        cache.update_and_fetch(mx.zeros((1, 3, 2, HEAD_DIM)), mx.zeros((1, 3, 2, HEAD_DIM)))
    with pytest.raises(ValueError, match="empty"):
        cache.decode(mx.zeros((1, N_HEADS, 1, HEAD_DIM)))


def test_coerce_accepts_plain_pairs_and_objects():
    cb = quiet_codebook(1)
    Cz = mx.stack([lc.Cz for lc in cb.layers])
    L = mx.stack([lc.L for lc in cb.layers])
    for obj in ((Cz, L), {"Cz": Cz, "L": L}, type("CB", (), {"Cz": Cz, "L": L})()):
        got = Codebook.coerce(obj)
        assert isinstance(got.layers[0], CodebookLayer) and got.K == cb.K
        np.testing.assert_allclose(np.array(got.layers[0].C), np.array(cb.layers[0].C))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Codebook.coerce((Cz, L))  # a user-supplied codebook does not warn



def test_from_layers_and_calibration_codebook_objects():
    cb = quiet_codebook(1)
    again = Codebook.from_layers(cb.layers)
    assert again.layers[0] is cb.layers[0] and not again.random
    cal = Codebook([cb.layers[0].Cz], [cb.layers[0].L])
    got = Codebook.coerce(cal)
    assert got is not cal and Codebook.coerce(got) is got and Codebook.coerce(cb) is cb
    np.testing.assert_array_equal(np.array(got.layers[0].C), np.array(cb.layers[0].C))
