"""RET-DECODE: the fast decode path (a2ats_ref.runtime.decode.portable) against the float64 oracle.

The selection is checked against the oracle's allowed-result sets (must ⊆ M ⊆ may, RET-SELECT) and the
output against the oracle's exact attention over the selection the fast path actually made (RET-ATTN),
plus the end-to-end decode_step on inputs without near ties.
"""

import mlx.core as mx
import numpy as np
import pytest

from a2ats_conformance.harness.tolerances import tie_margin, tolerance
import a2ats_ref.runtime.decode.portable as fd
from a2ats_ref.runtime.decode import dispatch
from a2ats_ref.runtime.decode.portable import prepare_codebook, selection_size
from a2ats_ref.runtime.decode.dispatch import decode_step_fast
from a2ats_spec import oracle

MX = {"float32": mx.float32, "float16": mx.float16}


def _case(seed, *, B=1, n_q=8, n_kv=2, d=16, T=300, K=64, dtype="float32"):
    rng = np.random.default_rng(seed)
    to = lambda a: np.asarray(mx.array(a.astype(np.float32)).astype(MX[dtype]).astype(mx.float32), np.float64)
    q = to(rng.standard_normal((B, n_q, 1, d)))
    k = to(rng.standard_normal((B, n_kv, T, d)))
    v = to(rng.standard_normal((B, n_kv, T, d)))
    codes = rng.integers(0, K, (B, n_kv, T)).astype(np.uint16)
    C = rng.standard_normal((n_kv, K, d)).astype(np.float32).astype(np.float64)
    return q, k, v, codes, C


def _run(q, k, v, codes, C, dtype, **kw):
    m = lambda a: mx.array(a.astype(np.float32)).astype(MX[dtype])
    out, mask = decode_step_fast(m(q), m(k), m(v), mx.array(codes), prepare_codebook(mx.array(C.astype(np.float32))),
                                 return_mask=True, **kw)
    return np.asarray(out.astype(mx.float32), np.float64), np.asarray(mask)


@pytest.mark.clause("RET-SELECT")
@pytest.mark.parametrize("method", ["host", "mlx", "sortfree"])
@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("query_pos,topk", [(299, 0.1), (150, 0.05), (299, 7), (40, 0.5), (5, 0.1)])
def test_selection_allowed_and_output_exact(method, traditional, query_pos, topk):
    dtype = "float32"
    q, k, v, codes, C = _case(query_pos, dtype=dtype)
    inv = oracle.rope_inv_freqs(16, 10000.0)
    kw = dict(query_pos=query_pos, b=2048, w=16, sinks=4, topk=topk, inv_freqs=inv, traditional=traditional)
    out, mask = _run(q, k, v, codes, C, dtype, method=method, **kw)
    scores = oracle.token_scores(oracle.lut_scores(
        oracle.far_query(q[:, :, 0], b=2048, inv_freqs=inv, traditional=traditional, positions=query_pos), C), codes)
    must, may = oracle.select_tokens_allowed(scores, n_kv_heads=2, query_pos=query_pos, w=16, sinks=4, topk=topk,
                                             margin=tie_margin(dtype, "RET-SELECT"))
    assert mask.shape == must.shape, (mask.shape, must.shape)
    assert not (must & ~mask).any(), f"missed must-select tokens {np.argwhere(must & ~mask)[:5]}"
    assert not (mask & ~may).any(), f"selected disallowed tokens {np.argwhere(mask & ~may)[:5]}"
    expect = oracle.retrieval_attention(q[:, :, 0], k, v, mask, scale=None)
    rtol, atol = tolerance(dtype, "RET-ATTN")
    np.testing.assert_allclose(out[:, :, 0], expect, rtol=rtol, atol=atol)


@pytest.mark.clause("RET-SELECT", "RET-DECODE")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_host_selection_equals_oracle_decode_step(dtype):
    """The host selector applies the oracle's own tie rule (lowest index), so even with heavy code ties
    (K=32 codes for 300 tokens) the mask is identical and the output matches decode_step."""
    q, k, v, codes, C = _case(7, K=32, dtype=dtype)
    inv = oracle.rope_inv_freqs(16, 10000.0)
    kw = dict(query_pos=299, b=2048, w=16, sinks=4, topk=0.1, inv_freqs=inv, traditional=True)
    out, mask = _run(q, k, v, codes, C, dtype, method="host", **kw)
    expect, emask = oracle.decode_step(q[:, :, 0], k, v, codes, C, return_mask=True, **kw)
    np.testing.assert_array_equal(mask, emask)
    rtol, atol = tolerance(dtype, "RET-DECODE")
    np.testing.assert_allclose(out[:, :, 0], expect, rtol=rtol, atol=atol)


@pytest.mark.clause("RET-TOPK")
@pytest.mark.parametrize("case", ["spread", "low_codes_only", "tied_levels"])
def test_host_select_equals_oracle_top_k(case):
    """_select_host against RET-SELECT's exact selection (lowest-index ties) at K = 4096, where it sorts only
    the best few hundred codes of each head. "low_codes_only": every token holds one of each head's worst
    codes, so the partially sorted codes hold none of them and the full sort must take over; "tied_levels":
    the LUT has 8 distinct values, so hundreds of codes tie at the threshold."""
    rng = np.random.default_rng(5)
    BH, G, K, T, topk = 3, 3, 4096, 3000, 0.03
    lut = rng.standard_normal((BH, G, K)).astype(np.float32)
    if case == "tied_levels":
        lut = np.round(lut * 2).astype(np.float32)
    codes = rng.integers(0, K, (BH, T))
    if case == "low_codes_only":
        worst = np.argsort(lut.max(axis=1), axis=-1)[:, :300]        # codes no head of the group ranks high
        codes = np.take_along_axis(worst, rng.integers(0, 300, (BH, T)), axis=-1)
    kk = oracle.topk_count(T, topk, T)
    idx, keep = fd._select_host(mx.array(lut), mx.array(codes.astype(np.uint16)), BH=BH, G=G, K=K, kk=kk, c0=0,
                                c1=T, bucket=256)
    got = np.zeros((BH, T), dtype=bool)
    for g in range(BH):
        got[g, np.asarray(idx)[g][np.asarray(keep)[g]]] = True
    scores = oracle.token_scores(lut.reshape(1, BH * G, K).astype(np.float64), codes[None])
    expect = oracle.select_tokens(scores, n_kv_heads=BH, query_pos=T - 1, w=0, sinks=0, topk=topk)[0]
    np.testing.assert_array_equal(got, expect)


@pytest.mark.clause("RET-ATTN")
def test_softmax_host_is_exact_softmax():
    """The host path's NumPy softmax: float32 to a few ulp of the float64 softmax, masked (-inf) entries get 0,
    and logits in the hundreds do not overflow (the row maximum is taken out first)."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 4, 50)) * 300).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[..., 0] = 500.0   # every row keeps a finite entry
    got = np.asarray(fd.softmax_host(mx.array(x)))
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert (got[np.isneginf(x)] == 0).all() and got.dtype == np.float32


@pytest.mark.clause("CACHE-BATCH")
def test_batch_gqa_and_preallocated_buffer():
    """B=2, G=3, a cache buffer longer than n_tokens: only the first n_tokens rows may be read."""
    q, k, v, codes, C = _case(3, B=2, n_q=6, n_kv=2, T=256)
    n = 200
    k[:, :, n:] = 1e3   # garbage past n_tokens would dominate the softmax if read
    inv = oracle.rope_inv_freqs(16, 10000.0)
    kw = dict(query_pos=n - 1, b=512, w=8, sinks=2, topk=0.1, inv_freqs=inv, traditional=False)
    for method in ("host", "mlx", "sortfree"):
        out, mask = _run(q, k, v, codes, C, "float32", n_tokens=n, method=method, **kw)
        expect = oracle.retrieval_attention(q[:, :, 0], k[:, :, :n], v[:, :, :n], mask, scale=None)
        np.testing.assert_allclose(out[:, :, 0], expect, rtol=1e-5, atol=1e-5)
        assert mask.shape == (2, 2, n)


@pytest.mark.clause("RET-SELECT")
def test_tiny_context_only_forced_tokens():
    q, k, v, codes, C = _case(1, T=10)
    inv = oracle.rope_inv_freqs(16, 10000.0)
    out, mask = _run(q, k, v, codes, C, "float32", query_pos=9, b=64, w=16, sinks=4, topk=0.5,
                     inv_freqs=inv, traditional=True)
    assert mask.all()
    np.testing.assert_allclose(out[:, :, 0], oracle.retrieval_attention(q[:, :, 0], k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.clause("RET-SELECT")
def test_selection_size_bound():
    assert selection_size(65536, n_q=32, n_kv=8, w=64, sinks=8, topk=0.03) == 72 + 4 * 1966


@pytest.mark.clause("INPUT-ERRORS")
def test_errors_name_the_argument():
    q, k, v, codes, C = _case(0)
    CT = prepare_codebook(mx.array(C.astype(np.float32)))
    m = lambda a: mx.array(a.astype(np.float32))
    kw = dict(query_pos=299, b=2048, w=16, sinks=4, topk=0.1, inv_freqs=oracle.rope_inv_freqs(16, 1e4),
              traditional=True)
    with pytest.raises(ValueError, match="queries"):
        decode_step_fast(m(q[:, :, 0]), m(k), m(v), mx.array(codes), CT, **kw)
    with pytest.raises(ValueError, match="query_pos"):
        decode_step_fast(m(q), m(k), m(v), mx.array(codes), CT, **{**kw, "query_pos": 300})
    with pytest.raises(ValueError, match="topk"):
        decode_step_fast(m(q), m(k), m(v), mx.array(codes), CT, **{**kw, "topk": 1.5})
    with pytest.raises(ValueError, match="method"):
        decode_step_fast(m(q), m(k), m(v), mx.array(codes), CT, method="gpu", **kw)


@pytest.mark.clause("RET-ATTN")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_blocked_gather_equals_one_block(monkeypatch, dtype, on_cpu):
    """The attention step gathers the selection in blocks (GATHER_BLOCK_BYTES) and sums p @ V over them;
    with 8-row blocks (many blocks, a ragged last one) the result is the oracle's exact attention."""
    import a2ats_ref.runtime.decode.portable as fd

    q, k, v, codes, C = _case(11, B=2, n_q=6, n_kv=2, dtype=dtype)
    inv = oracle.rope_inv_freqs(16, 10000.0)
    kw = dict(query_pos=299, b=2048, w=16, sinks=4, topk=0.1, inv_freqs=inv, traditional=False)
    monkeypatch.setattr(fd, "GATHER_BLOCK_BYTES", 4 * 4 * 16 * 8)   # BH = 4, d = 16: 8 rows per block
    fd._attend_fn.cache_clear()
    try:
        assert len(fd._gather_blocks(107, 4, 16)) == 14
        out, mask = _run(q, k, v, codes, C, dtype, method="host", **kw)
    finally:
        fd._attend_fn.cache_clear()
    rtol, atol = tolerance(dtype, "RET-ATTN")
    np.testing.assert_allclose(out[:, :, 0], oracle.retrieval_attention(q[:, :, 0], k, v, mask), rtol=rtol, atol=atol)


def test_selection_in_one_block_is_split_over_the_lanes(on_cpu):
    """A selection of LANE_SPLIT_MIN rows or more that fits one block still gives each CPU lane a part."""
    S = 2 * fd.LANE_SPLIT_MIN
    assert fd._gather_blocks(S, 3, 64, 2) == [(0, S // 2), (S // 2, S)]
    assert fd._gather_blocks(fd.LANE_SPLIT_MIN - 1, 3, 64, 2) == [(0, fd.LANE_SPLIT_MIN - 1)]
    assert fd._gather_blocks(S, 3, 64) == [(0, S)]


@pytest.mark.clause("RET-ATTN")
def test_float16_scaled_rows_are_exact_on_every_finite_float16(on_cpu):
    """float16_scaled_rows times F16_SCALE is MLX's astype, bit for bit, on all 63,490 finite float16 patterns
    (subnormals and -0 included), on both CPU lanes; _f16_scaled_exact says so."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.int16)
    bits = bits[np.isfinite(bits.view(np.float16))]
    want = bits.view(np.float16).astype(np.float32).view(np.uint32)
    for lane in fd._lanes():
        got = np.array(mx.multiply(fd.float16_scaled_rows(mx.array(bits), lane), fd.F16_SCALE, stream=lane))
        assert np.array_equal(got.view(np.uint32), want)
        fd._F16_EXACT.pop(str(lane), None)
        assert fd._f16_scaled_exact(lane)


@pytest.mark.clause("RET-ATTN")
def test_float16_host_step_is_bit_identical_to_casting_the_rows(monkeypatch, on_cpu):
    """The host step's float16 rows through float16_scaled_rows (F16_SCALE folded into the query and the
    probabilities) give the output of casting them with astype, bit for bit, over many blocks on both lanes, with
    subnormal and signed-zero keys/values; a (float32) query with |q · scale| >= F16_QUERY_BOUND casts instead (its
    folded query would overflow; a float16 query never gets there)."""
    q, k, v, codes, C = _case(21, B=2, n_q=6, n_kv=2, dtype="float16")
    k[..., 3], v[..., 5] = 2.0 ** -20, -(2.0 ** -24)     # float16 subnormals
    k[..., 4], v[..., 6] = -0.0, 0.0
    inv = oracle.rope_inv_freqs(16, 10000.0)
    kw = dict(query_pos=299, b=2048, w=16, sinks=4, topk=0.1, inv_freqs=inv, traditional=False, method="host")
    monkeypatch.setattr(fd, "GATHER_BLOCK_BYTES", 4 * 4 * 16 * 8)   # 8 rows per block: 14 blocks, both lanes
    calls = []
    scaled_rows = fd.float16_scaled_rows
    monkeypatch.setattr(fd, "float16_scaled_rows", lambda b, s: calls.append(s) or scaled_rows(b, s))

    def step(q, exact, q_dtype):
        fd._attend_fn.cache_clear()
        for lane in fd._lanes():
            monkeypatch.setitem(fd._F16_EXACT, str(lane), exact)
        m = lambda a: mx.array(a.astype(np.float32)).astype(mx.float16)
        out = decode_step_fast(mx.array(q.astype(np.float32)).astype(q_dtype), m(k), m(v), mx.array(codes), prepare_codebook(mx.array(C.astype(np.float32))), **kw)
        return np.array(out.astype(mx.float32))

    try:
        for qq, q_dtype, folded in ((q, mx.float16, True), (q * 2.0 ** 18, mx.float32, False)):   # scale = 1/4
            cast = step(qq, False, q_dtype)
            calls.clear()
            got = step(qq, True, q_dtype)
            assert bool(calls) == folded and len(set(map(str, calls))) == (2 if folded else 0)
            assert np.isfinite(cast).all() and np.array_equal(got.view(np.uint32), cast.view(np.uint32))
    finally:
        fd._attend_fn.cache_clear()


# --------------------------------------------------------------------------- the sort-free step

def _allowed(q, codes, C, *, query_pos, topk, traditional, n_kv=2, w=16, sinks=4, b=2048, dtype="float32"):
    inv = oracle.rope_inv_freqs(q.shape[-1], 10000.0)
    scores = oracle.token_scores(oracle.lut_scores(
        oracle.far_query(q[:, :, 0], b=b, inv_freqs=inv, traditional=traditional, positions=query_pos), C), codes)
    return oracle.select_tokens_allowed(scores, n_kv_heads=n_kv, query_pos=query_pos, w=w, sinks=sinks, topk=topk,
                                        margin=tie_margin(dtype, "RET-SELECT"))


#: heavy code ties (K = 6 codes for 300 tokens), light ones (K = 64) and almost none (K = 1000: a threshold
#: bucket one token wide, the only case where a threshold one code too high leaves out a must-token), GQA
#: groups of 4, fractions and counts
SORTFREE_CASES = [(seed, K, topk) for seed in range(2) for K in (6, 64, 1000) for topk in (0.1, 0.03, 9)]


def _sortfree_violations(**kw):
    """(missing must-tokens, forbidden tokens) of method="sortfree" summed over SORTFREE_CASES."""
    missing = extra = 0
    for seed, K, topk in SORTFREE_CASES:
        q, k, v, codes, C = _case(seed, K=K)
        run = dict(query_pos=299, b=2048, w=16, sinks=4, topk=topk, traditional=seed % 2 == 0)
        _, mask = _run(q, k, v, codes, C, "float32", method="sortfree", inv_freqs=oracle.rope_inv_freqs(16, 1e4),
                       **run, **kw)
        must, may = _allowed(q, codes, C, query_pos=299, topk=topk, traditional=run["traditional"])
        missing += int((must & ~mask).sum())
        extra += int((mask & ~may).sum())
    return missing, extra


@pytest.mark.clause("RET-SELECT")
def test_sortfree_takes_whole_tie_buckets_inside_may():
    """The sort-free step keeps RET-SELECT's allowed sets under heavy ties, and takes the whole bucket at
    each head's threshold: with K = 6 codes its selection is `may` itself (every token >= the k-th score)."""
    assert _sortfree_violations() == (0, 0)
    q, k, v, codes, C = _case(5, K=6)
    _, mask = _run(q, k, v, codes, C, "float32", method="sortfree", query_pos=299, b=2048, w=16, sinks=4, topk=0.1,
                   inv_freqs=oracle.rope_inv_freqs(16, 1e4), traditional=True)
    must, may = _allowed(q, codes, C, query_pos=299, topk=0.1, traditional=True)
    assert (must != may).any()   # the case has ties to take
    np.testing.assert_array_equal(mask, may)


def _skewed_case(seed, *, T=3000, K=64, n_q=4, d=8):
    """One KV head, a GQA group of n_q; a few codes hold most tokens, so the heads' threshold buckets are
    large, different, and together overflow the slots the step keeps for ties."""
    rng = np.random.default_rng(seed)
    f32 = lambda a: a.astype(np.float32).astype(np.float64)
    q, k = f32(rng.standard_normal((1, n_q, 1, d))), f32(rng.standard_normal((1, 1, T, d)))
    codes = rng.choice(K, size=(1, 1, T), p=rng.dirichlet(np.full(K, 0.2))).astype(np.uint16)
    return q, k, k, codes, f32(rng.standard_normal((1, K, d)))


@pytest.mark.clause("RET-SELECT")
def test_sortfree_each_head_holds_its_top_k_count_when_ties_overflow():
    """RET-SELECT's per-head count: each query head holds >= k of its own allowed top-k. With large, different
    tie buckets per head, the other heads' ties must not take the slots of the tied tokens a head needs."""
    inv, short = oracle.rope_inv_freqs(8, 1e4), []
    for seed in range(16):
        q, k, v, codes, C = _skewed_case(seed)
        pos = codes.shape[-1] - 1
        run = dict(query_pos=pos, b=2048, w=16, sinks=4, topk=0.05, traditional=False)
        _, mask = _run(q, k, v, codes, C, "float32", method="sortfree", inv_freqs=inv, **run)
        scores = oracle.token_scores(oracle.lut_scores(
            oracle.far_query(q[:, :, 0], b=2048, inv_freqs=inv, traditional=False, positions=pos), C), codes)
        held, _, kk = oracle.select_tokens_head_counts(mask, scores, n_kv_heads=1, query_pos=pos, w=16, sinks=4,
                                                       topk=0.05, margin=tie_margin("float32", "RET-SELECT"))
        short += [(seed, held.tolist(), kk)] if (held < kk).any() else []
        must, may = _allowed(q, codes, C, query_pos=pos, topk=0.05, traditional=False, n_kv=1)
        assert not (must & ~mask).any() and not (mask & ~may).any(), seed
    assert not short, short


def _mutate(monkeypatch, name, fn):
    monkeypatch.setattr(fd, name, fn)
    fd._sortfree_step_fn.cache_clear()


@pytest.fixture
def fresh_sortfree():
    fd._sortfree_step_fn.cache_clear()
    yield
    fd._sortfree_step_fn.cache_clear()


def test_sortfree_threshold_mutants_are_caught(monkeypatch, fresh_sortfree):
    """The allowed-set check above catches a threshold one code off either way, and a lost GQA union."""
    real_thr, real_levels = fd.sortfree_threshold, fd.sortfree_code_levels

    def thr_shift(by):
        def thr(lut, counts, kk):
            return real_thr(lut, counts, kk + by)   # the walk stops one token early / late
        return thr

    def first_head_only(lut, counts, kk):
        return real_levels(mx.broadcast_to(lut[:, :1], lut.shape), counts, kk)

    found = {}
    for name, fn in [("low", ("sortfree_threshold", thr_shift(-1))), ("high", ("sortfree_threshold", thr_shift(1))),
                     ("one-head", ("sortfree_code_levels", first_head_only))]:
        _mutate(monkeypatch, *fn)
        found[name] = _sortfree_violations()
        monkeypatch.undo()
        fd._sortfree_step_fn.cache_clear()
    assert found["low"][0] > 0 and found["one-head"][0] > 0 and found["high"][1] > 0, found


@pytest.mark.clause("RET-SELECT")
def test_sortfree_overflow_never_drops_a_must_token(monkeypatch, fresh_sortfree):
    """With only G·k slots (no room for tie buckets), the optional tied tokens are the ones cut: the
    selection stays inside the allowed sets. A single prefix count (ties ranked with the rest) is caught."""
    monkeypatch.setattr(fd, "sortfree_width", lambda kk, G, K, n_cand, step=256: G * kk)
    assert _sortfree_violations() == (0, 0)
    real = fd.sortfree_code_levels

    def one_level(lut, counts, kk):   # mutant: tied tokens compete with must-tokens for the slots
        levels, n1, n2 = real(lut, counts, kk)
        return mx.where(levels > 0, 1, 0).astype(mx.uint8), n1 + n2, mx.zeros_like(n2)

    _mutate(monkeypatch, "sortfree_code_levels", one_level)
    assert _sortfree_violations()[0] > 0


def test_sortfree_kept_counts_equal_counting_codes():
    """Counts kept by the caller (over the coded tokens, up to w past the candidates) give the same step as
    counting the candidates' codes in the graph; counts outside that range fall back to counting."""
    q, k, v, codes, C = _case(2, K=8)
    kw = dict(query_pos=299, b=2048, w=16, sinks=4, topk=0.1, inv_freqs=oracle.rope_inv_freqs(16, 1e4),
              traditional=False)
    base_out, base = _run(q, k, v, codes, C, "float32", method="sortfree", **kw)
    for counted in (300 - 16, 290, 300, 100):
        counts = fd.code_counts(mx.array(codes[..., :counted]), 8)
        out, mask = _run(q, k, v, codes, C, "float32", method="sortfree", code_counts=(counts, counted), **kw)
        np.testing.assert_array_equal(mask, base)
        np.testing.assert_array_equal(out, base_out)
    with pytest.raises(ValueError, match="code_counts"):
        _run(q, k, v, codes, C, "float32", method="sortfree", code_counts=(mx.zeros((1, 2, 7), mx.int32), 300), **kw)


def test_code_counts_match_bincount():
    codes = np.random.default_rng(0).integers(0, 37, (2, 3, 500)).astype(np.uint16)
    got = np.array(fd.code_counts(mx.array(codes), 37))
    want = np.stack([[np.bincount(codes[b, h], minlength=37) for h in range(3)] for b in range(2)])
    np.testing.assert_array_equal(got, want)


def test_auto_picks_sortfree_off_the_cpu(monkeypatch):
    """No CPU-tuned threshold decides a GPU path: off the CPU, auto is the sort-free step at every length, or the
    CUDA step at every length where its self-check passed (stood in for here, so this runs the same on a CPU, on
    Metal and on MLX CUDA, where the real check passes)."""
    from a2ats_ref.runtime.decode import cuda as cuda_decode

    monkeypatch.setattr(fd.mx, "default_device", lambda: mx.Device(mx.cpu))
    assert dispatch.auto_method(10) == "mlx" and dispatch.auto_method(fd.HOST_SELECT_MIN) == "host"
    monkeypatch.setattr(fd.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(dispatch, "usable", lambda **_: False)
    assert dispatch.auto_method(10) == dispatch.auto_method(10 ** 6) == "sortfree"
    monkeypatch.setattr(dispatch, "usable", lambda **_: True)
    assert dispatch.auto_method(10) == dispatch.auto_method(10 ** 6) == "cuda"
    assert dispatch.auto_method(10 ** 6, G=4, d=80, dv=80, K=4096) == "sortfree"   # shapes the kernels do not take
    assert fd._gather_blocks(10 ** 5, 8, 128) == [(0, 10 ** 5)]   # one gather: blocks are a CPU cache tactic


def test_conformance_checks_the_sortfree_path(tmp_path):
    """The suite's own RET-DECODE, CACHE-DECODE and CACHE-TRIM checks run the sort-free path on this backend (on
    a GPU the default adapter's caches take it through method="auto" already; here it is forced), every test
    passing: CACHE-DECODE's 32K-token host-path case holds each head's top-k count under long tie buckets, and
    CACHE-TRIM decodes before trimming, so the per-code counts that path walks must be rolled back."""
    import json

    from a2ats_conformance.run.cli import main

    out = tmp_path / "r.json"
    code = main(["--iut", "a2ats_conformance.adapters.reference:SortFreeReference", "--profile", "selftest",
                 "--seed", "0", "-q", "--clauses", "RET-DECODE,CACHE-DECODE,CACHE-TRIM", "--report-json", str(out)])
    rep = json.loads(out.read_text())
    assert code == 0 and {c: v["status"] for c, v in rep["clauses"].items()} == dict.fromkeys(
        ("RET-DECODE", "CACHE-DECODE", "CACHE-TRIM"), "pass")
    bad = {k: v["outcome"] for k, v in rep["tests"].items() if v["outcome"] != "passed"}
    assert not bad, bad


@pytest.mark.clause("RET-DECODE", "RET-LUT")
@pytest.mark.parametrize("method", ["host", "mlx", "sortfree"])
def test_a_new_scale_reuses_the_compiled_graphs(method):
    """The scale is data to the compiled LUT and step graphs, not part of their key: a constant baked into a graph
    would compile its kernels again for every scale (each head dim has its own default), seconds a kernel on a
    GPU. The output still follows the scale."""
    q, k, v, codes, C = _case(5)
    run = dict(query_pos=299, b=2048, w=16, sinks=4, topk=0.1, traditional=False, method=method,
               inv_freqs=oracle.rope_inv_freqs(16, 1e4))
    fns = (fd._lut_fn, fd._sortfree_step_fn)
    first, _ = _run(q, k, v, codes, C, "float32", scale=0.25, **run)
    misses = [f.cache_info().misses for f in fns]
    second, _ = _run(q, k, v, codes, C, "float32", scale=0.125, **run)
    assert [f.cache_info().misses for f in fns] == misses
    assert not np.allclose(first, second)
