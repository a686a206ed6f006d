"""MLX reference (a2ats_ref) against the float64 oracle (a2ats_spec.oracle), clause by clause.

Continuous outputs use the one tolerance table (a2ats_conformance.harness.tolerances). Discrete
outputs (codes, token masks) are checked against the oracle's allowed-result sets: a
result is accepted when it is optimal up to tie_margin, never by a tolerance on indices.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import a2ats_spec.oracle as O
from a2ats_conformance.harness.tolerances import tie_margin, tolerance
from a2ats_ref import checks
from a2ats_ref.codes import code_dtype
from a2ats_ref.eq10_query_moment import query_moment
from a2ats_ref.eq11_wrope_scores import wrope_scores
from a2ats_ref.eq12_far_keys import far_keys, far_query
from a2ats_ref.eq13_score_error import score_error
from a2ats_ref.eq14_assign import assign
from a2ats_ref.eq15_cholesky import cholesky
from a2ats_ref.eq16_z_transform import assign_z, z_transform
from a2ats_ref.eq17_kmeans import kmeans, kmeanspp_init, lloyd_step
from a2ats_ref.eq18_back_transform import back_transform
from a2ats_ref.runtime.decode.portable import prepare_codebook
from a2ats_ref.runtime.decode.dispatch import decode_step_fast
from a2ats_ref.prefill import prefill_attention
from a2ats_ref.retrieval import decode_step, lut_scores, retrieval_attention, select_tokens, token_scores, topk_count
from a2ats_ref.rope import applied_cos_sin, fast_rope_args, rope_apply, rope_inv_freqs, rope_invert, rope_params_from_module, rotate_by_tables

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def rng(seed):
    return np.random.default_rng(seed)


def inp(a, dtype="float32"):
    """(mx input in `dtype`, the same rounded values as float64 for the oracle)."""
    x = mx.array(np.asarray(a, dtype=np.float32)).astype(DTYPES[dtype])
    return x, np.array(x.astype(mx.float32)).astype(np.float64)


def f64(x):
    return np.array(mx.array(x).astype(mx.float32)).astype(np.float64)


def assert_close(actual, expected, dtype, clause, what=""):
    rtol, atol = tolerance(dtype, clause)
    a, e = f64(actual), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{clause} {what}: shape {a.shape} != oracle {e.shape}"
    err = np.abs(a - e) - (atol + rtol * np.abs(e))
    assert np.all(err <= 0), (
        f"{clause} {what} dtype={dtype}: max |diff| {np.max(np.abs(a - e)):.3g} exceeds atol={atol} rtol={rtol}"
    )


def spd(d, seed, n=None, cond=20.0):
    r = rng(seed)
    def one():
        Q, _ = np.linalg.qr(r.standard_normal((d, d)))
        return (Q * np.geomspace(1.0, 1.0 / cond, d)) @ Q.T
    H = one() if n is None else np.stack([one() for _ in range(n)])
    return ((H + np.swapaxes(H, -1, -2)) / 2).astype(np.float32)


# ---------------------------------------------------------------- ROPE-*

ROPE_SCALINGS = [
    None,
    {"type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
]


@pytest.mark.clause("ROPE-FREQ")
@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=["default", "linear", "llama3"])
def test_rope_inv_freqs(scaling):
    got = rope_inv_freqs(64, 500000.0, scaling)
    assert got.dtype == mx.float32 and got.shape == (32,)
    assert_close(got, O.rope_inv_freqs(64, 500000.0, scaling), "float32", "ROPE-FREQ")


@pytest.mark.clause("ROPE-FREQ")
@pytest.mark.parametrize("kind", ["yarn", "longrope", "dynamic", "su", "mrope"])
def test_rope_inv_freqs_rejects_unsupported(kind):
    with pytest.raises(ValueError, match="supported types: default, linear, llama3"):
        rope_inv_freqs(64, 1e4, {"type": kind, "factor": 2.0})


@pytest.mark.clause("ROPE-APPLY", "ROPE-INVERSE")
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_rope_apply_invert(traditional, dtype):
    d, T = 32, 7
    inv = rope_inv_freqs(d, 1e4)
    x, xo = inp(rng(1).standard_normal((2, 3, T, d)), dtype)
    pos = rng(2).integers(0, 4096, T)  # per-token, not contiguous
    y = rope_apply(x, pos, inv, traditional=traditional)
    assert y.dtype == mx.float32
    assert_close(y, O.rope_apply(xo, pos, f64(inv), traditional=traditional), dtype, "ROPE-APPLY")
    back = rope_invert(y, pos, inv, traditional=traditional)
    assert_close(back, xo, dtype, "ROPE-INVERSE", "round trip")
    assert_close(rope_invert(x, pos, inv, traditional=traditional),
                 O.rope_invert(xo, pos, f64(inv), traditional=traditional), dtype, "ROPE-INVERSE")


@pytest.mark.clause("ROPE-APPLY", "ROPE-INVERSE")
@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_mlx_lm_and_inverts_it(scaling, traditional):
    from mlx_lm.models.rope_utils import initialize_rope

    d, T, off = 64, 5, 90000
    module = initialize_rope(d, 1e5, traditional, scaling, 131072)
    inv, trad = rope_params_from_module(module, d)
    assert trad == traditional
    assert np.array_equal(np.array(inv), np.array(rope_inv_freqs(d, 1e5, scaling)))
    x = mx.array(rng(3).standard_normal((1, 2, T, d)).astype(np.float32))
    y = module(x, offset=off)
    pos = np.arange(off, off + T)
    if mx.default_device().type == mx.cpu:
        # Same float32 angles as mx.fast.rope on the CPU, so the rotation matches and inverts to rounding.
        assert np.max(np.abs(np.array(rope_apply(x, pos, inv, traditional=traditional) - y))) < 1e-5
        assert np.max(np.abs(np.array(rope_invert(y, pos, inv, traditional=traditional) - x))) < 1e-5
    # On every device, the angles mx.fast.rope applied there (read back by applied_cos_sin) undo it to
    # rounding: EQ-12's de-rotation in the cache (on MLX CUDA `base=` angles differ from m * inv_freqs).
    c, s = applied_cos_sin(mx.array(pos), d, traditional, fast_rope_args(module))
    assert np.max(np.abs(np.array(rotate_by_tables(y, c, s, traditional, -1.0) - x))) < 1e-5
    # A block rotation by -offset is not the inverse (token t was rotated by offset + t).
    block = mx.fast.rope(y, d, traditional=traditional, base=None, scale=1.0, offset=-off, freqs=1.0 / inv)
    assert np.max(np.abs(np.array(block - x))) > 1e-2


@pytest.mark.clause("ROPE-FREQ")
def test_rope_params_from_module_rejects():
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE, SuScaledRoPE, YarnRoPE

    for mod in (SuScaledRoPE(64), YarnRoPE(64, scaling_factor=4.0), DynamicNTKScalingRoPE(64, 2048, False, 1e4, 2.0)):
        with pytest.raises(ValueError, match="supported: nn.RoPE"):
            rope_params_from_module(mod)
    with pytest.raises(ValueError, match="partial rotary"):
        rope_params_from_module(nn.RoPE(32), head_dim=64)


# ---------------------------------------------------------------- EQ-10 .. EQ-13

@pytest.mark.clause("EQ-10")
@pytest.mark.parametrize("n_q,n_kv", [(3, 3), (6, 2)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_query_moment(n_q, n_kv, dtype):
    inv = rope_inv_freqs(16, 1e4)
    q, qo = inp(rng(4).standard_normal((n_q, 40, 16)), dtype)
    H = query_moment(q, n_kv_heads=n_kv, b=2048, inv_freqs=inv, traditional=True)
    assert H.shape == (n_kv, 16, 16) and H.dtype == mx.float32
    assert_close(H, O.query_moment(qo, n_kv_heads=n_kv, b=2048, inv_freqs=f64(inv), traditional=True), dtype, "EQ-10")


@pytest.mark.clause("EQ-11")
@pytest.mark.parametrize("w", [0, 3, 50])
@pytest.mark.parametrize("Tq,Tk", [(1, 1), (4, 9)])
def test_wrope_scores(w, Tq, Tk):
    inv = rope_inv_freqs(16, 1e4)
    q, qo = inp(rng(5).standard_normal((2, Tq, 16)))
    k, ko = inp(rng(6).standard_normal((2, Tk, 16)))
    qp, kp = np.arange(Tk - Tq, Tk) + 1000, np.arange(Tk) + 1000
    kw = dict(w=w, b=2048, traditional=False, q_positions=qp, k_positions=kp)
    got = wrope_scores(q, k, inv_freqs=inv, **kw)
    assert_close(got, O.wrope_scores(qo, ko, inv_freqs=f64(inv), **kw), "float32", "EQ-11")
    if w >= Tk + Tq:  # every pair is near: plain RoPE scores
        plain = rope_apply(q, qp, inv, traditional=False) @ mx.swapaxes(rope_apply(k, kp, inv, traditional=False), -1, -2)
        assert_close(got, f64(plain), "float32", "EQ-11", "w >= length")


@pytest.mark.clause("EQ-12")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_far_keys_and_query(dtype):
    inv = rope_inv_freqs(16, 1e4)
    k, ko = inp(rng(7).standard_normal((2, 5, 16)), dtype)
    pos = np.array([0, 3, 4, 100, 4000])
    assert_close(far_keys(k, pos, inv, traditional=False),
                 O.far_keys(ko, pos, f64(inv), traditional=False), dtype, "EQ-12")
    q, qo = inp(rng(8).standard_normal((6, 16)), dtype)
    assert_close(far_query(q, b=2048, inv_freqs=inv, traditional=True),
                 O.far_query(qo, b=2048, inv_freqs=f64(inv), traditional=True), dtype, "EQ-12")
    assert_close(far_query(q, b=2048, inv_freqs=inv, traditional=True, positions=3000),
                 O.far_query(qo, b=2048, inv_freqs=f64(inv), traditional=True, positions=3000), dtype, "EQ-12")


@pytest.mark.clause("EQ-13")
def test_score_error():
    H = spd(16, 9)
    k, ko = inp(rng(10).standard_normal((3, 4, 16)))
    c, co = inp(rng(11).standard_normal((4, 16)))
    assert_close(score_error(k, c, H), O.score_error(ko, co, H.astype(np.float64)), "float32", "EQ-13")
    # H = cI: the score error is c times the squared distance.
    got = score_error(k, c, 2.5 * np.eye(16, dtype=np.float32))
    assert_close(got, 2.5 * np.sum((ko - co) ** 2, axis=-1), "float32", "EQ-13", "H = cI")


# ---------------------------------------------------------------- EQ-14 .. EQ-18

def _codes_allowed(codes, dist, dtype, clause):
    """codes must be an argmin of dist up to the tie margin (scaled to the distances' size)."""
    margin = tie_margin(dtype, clause) * max(1.0, float(np.max(np.min(dist, axis=-1))))
    allowed = O.argmin_allowed(dist, margin)
    c = np.asarray(codes).astype(np.int64)
    ok = np.take_along_axis(allowed, c[..., None], axis=-1)[..., 0]
    assert ok.all(), f"{clause}: {int((~ok).sum())} codes are not an allowed argmin (margin {margin:.3g})"


@pytest.mark.clause("EQ-14", "EQ-16")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_assign_and_assign_z(dtype):
    d, K = 16, 300  # K > 256: uint16 codes
    H = spd(d, 12)
    k, ko = inp(rng(13).standard_normal((2, 50, d)), dtype)
    C = rng(14).standard_normal((K, d)).astype(np.float32)
    codes = assign(k, C, H)
    assert codes.dtype == mx.uint16 and codes.shape == (2, 50)
    _codes_allowed(codes, O.assign_distances(ko, C, H.astype(np.float64)), dtype, "EQ-14")
    Lmx = cholesky(H)
    Cz = np.array(mx.array(C) @ Lmx)
    zc = assign_z(k, Cz, Lmx)
    _codes_allowed(zc, O.assign_z_distances(ko, Cz, f64(Lmx)), dtype, "EQ-16")
    # EQ-16 runtime assignment is EQ-14 in disguise.
    _codes_allowed(zc, O.assign_distances(ko, C, H.astype(np.float64)), dtype, "EQ-14")
    assert_close(z_transform(k, Lmx), O.z_transform(ko, f64(Lmx)), dtype, "EQ-16")


@pytest.mark.clause("EQ-14")
def test_assign_identity_is_plain_nearest_and_batched_heads():
    d = 8
    k = rng(15).standard_normal((3, 20, d)).astype(np.float32)
    C = rng(16).standard_normal((3, 10, d)).astype(np.float32)
    H = np.broadcast_to(3.0 * np.eye(d, dtype=np.float32), (3, d, d))
    got = np.array(assign(k, C, H))
    for h in range(3):
        dist = np.sum((k[h][:, None] - C[h][None]) ** 2, axis=-1)
        _codes_allowed(got[h], dist, "float32", "EQ-14")


@pytest.mark.clause("EQ-14")
def test_nearest_rows_blocks_and_head_halves(monkeypatch):
    """The cache's assignment kernel (EQ-16) over a batch axis, 3 KV heads (halves of 1 and 2 pipelined) and
    row blocks (BLOCK_BYTES shrunk to force 3 blocks of 7 rows) gives allowed argmins on every row; and a
    decode batch of w + 1 = 65 tokens at Llama-3.1-8B shapes is one block (each block reads the codebook)."""
    from a2ats_ref import eq14_assign

    assert eq14_assign.row_blocks(65, 4 * 4096 * 8) == [(0, 65)]
    blocks = eq14_assign.row_blocks(1100, 4 * 4096 * 8)   # a long prefill: 3 blocks, none short
    assert blocks[0][0] == 0 and blocks[-1][1] == 1100 and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    sizes = [e - s for s, e in blocks]
    assert max(sizes) - min(sizes) <= 1 and max(sizes) * 4 * 4096 * 8 <= eq14_assign.BLOCK_BYTES, sizes
    d, K, N = 8, 50, 20
    L = np.linalg.cholesky(spd(d, 21, n=3).astype(np.float64)).astype(np.float32)
    Cz = rng(22).standard_normal((3, K, d)).astype(np.float32)
    k = rng(23).standard_normal((2, 3, N, d)).astype(np.float32)
    monkeypatch.setattr(eq14_assign, "BLOCK_BYTES", 4 * K * 6 * 7)   # 7 rows of (2, 3) heads per block
    assert len(eq14_assign.row_blocks(N, 4 * K * 6)) == 3
    codes = np.array(assign_z(mx.array(k), mx.array(Cz), mx.array(L)))
    assert codes.shape == (2, 3, N)
    for h in range(3):
        dist = O.assign_z_distances(k[:, h].astype(np.float64), Cz[h], L[h].astype(np.float64))
        _codes_allowed(codes[:, h], dist, "float32", "EQ-16")


@pytest.mark.clause("EQ-15", "EQ-18")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cholesky_and_back_transform(dtype):
    H, Ho = inp(spd(16, 17, n=3), dtype)
    Ho = (Ho + np.swapaxes(Ho, -1, -2)) / 2
    L = cholesky(H)
    assert_close(L, O.cholesky(Ho), dtype, "EQ-15")
    Cz, Czo = inp(rng(18).standard_normal((3, 20, 16)), dtype)
    assert_close(back_transform(Cz, L), O.back_transform(Czo, f64(L)), dtype, "EQ-18")


@pytest.mark.clause("EQ-15")
def test_cholesky_reports_failing_index():
    H = np.stack([np.eye(4), np.eye(4), -np.eye(4)]).astype(np.float32)
    with pytest.raises(ValueError, match=r"matrix \(2,\)"):
        cholesky(H)
    with pytest.raises(ValueError, match="symmetric"):
        cholesky(np.triu(np.ones((4, 4), np.float32)))


# ---------------------------------------------------------------- EQ-17

def _blobs(N, d, n_blobs, seed, spread=0.05):
    r = rng(seed)
    centres = r.standard_normal((n_blobs, d)) * 4
    return (centres[r.integers(0, n_blobs, N)] + spread * r.standard_normal((N, d))).astype(np.float32)


@pytest.mark.clause("EQ-17-INIT")
def test_kmeanspp_init():
    z = _blobs(200, 8, 12, 19)
    u = rng(20).random(12)
    assert_close(kmeanspp_init(z, 12, u), O.kmeanspp_init(z, 12, u), "float32", "EQ-17-INIT")


@pytest.mark.clause("EQ-17-STEP")
def test_lloyd_step_with_empty_clusters():
    z = rng(21).standard_normal((120, 6)).astype(np.float32)
    C = z[:10].copy()
    C[[2, 5, 6]] = 50.0  # three clusters start empty
    Cn, codes, f = lloyd_step(z, C)
    Co, codes_o, fo = O.lloyd_step(z, C)
    assert_close(Cn, Co, "float32", "EQ-17-STEP")
    assert_close(np.array(f), np.array(fo), "float32", "EQ-17-STEP", "objective")
    _codes_allowed(codes, O.assign_z_distances(z, C, np.eye(6)), "float32", "EQ-17-STEP")
    # Objective is non-increasing and every codeword is used.
    f2 = lloyd_step(z, Cn)[2]
    assert f2 <= f
    assert len(np.unique(np.array(lloyd_step(z, Cn)[1]))) == 10


@pytest.mark.clause("EQ-17-FIT")
@pytest.mark.parametrize("N,K,spread", [(400, 16, 0.3), (3000, 64, 1.0)])
def test_kmeans_fit_matches_oracle(N, K, spread):
    # The fit prunes rows with Hamerly bounds near convergence; it must still follow the oracle's steps.
    z = _blobs(N, 8, K // 2, 22, spread=spread)
    C, codes, hist = kmeans(z, K, seed=7)
    Co, codes_o, hist_o = O.kmeans(z, K, seed=7)
    assert_close(C, Co, "float32", "EQ-17-FIT")
    assert len(hist) == len(hist_o)
    assert_close(hist, hist_o, "float32", "EQ-17-FIT", "history")
    _codes_allowed(codes, O.assign_z_distances(z, Co, np.eye(8)), "float32", "EQ-17-FIT")


@pytest.mark.clause("EQ-17-FIT")
def test_kmeans_fit_is_deterministic():
    z = _blobs(400, 8, 16, 22, spread=0.3)
    C, codes, hist = kmeans(z, 16, seed=7)
    Co, codes_o, hist_o = O.kmeans(z, 16, seed=7)
    assert_close(C, Co, "float32", "EQ-17-FIT")
    assert len(hist) == len(hist_o)
    assert_close(hist, hist_o, "float32", "EQ-17-FIT", "history")
    assert np.all(np.diff(hist) <= 1e-6 * hist[0])
    _codes_allowed(codes, O.assign_z_distances(z, Co, np.eye(8)), "float32", "EQ-17-FIT")
    C2, codes2, _ = kmeans(z, 16, seed=7)
    assert np.array_equal(np.array(C), np.array(C2)) and np.array_equal(np.array(codes), np.array(codes2))
    calls = []
    kmeans(z, 16, seed=7, max_iter=2, progress=lambda s, f: calls.append(s))
    assert calls == [1, 2]


# ---------------------------------------------------------------- RET-*

@pytest.mark.clause("RET-LUT")
@pytest.mark.parametrize("n_q,n_kv", [(2, 2), (6, 2)])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lut_and_token_scores(n_q, n_kv, dtype):
    d, K, T = 16, 40, 30
    q, qo = inp(rng(23).standard_normal((2, n_q, d)), dtype)
    C, Co = inp(rng(24).standard_normal((n_kv, K, d)), dtype)
    lut = lut_scores(q, C)
    assert_close(lut, O.lut_scores(qo, Co), dtype, "RET-LUT")
    codes = rng(25).integers(0, K, (2, n_kv, T)).astype(np.uint8)
    assert_close(token_scores(lut, codes), O.token_scores(f64(lut), codes), "float32", "RET-LUT")


@pytest.mark.clause("RET-TOPK")
def test_topk_count():
    for T, topk, n in [(100, 0.03, None), (10, 0.03, None), (100, 1.0, None), (100, 5, None), (100, 50, 20), (7, 1, 0)]:
        assert topk_count(T, topk, n) == O.topk_count(T, topk, n), (T, topk, n)


def _check_mask(mask, scores, dtype, **kw):
    must, may = O.select_tokens_allowed(scores, margin=tie_margin(dtype, "RET-SELECT"), **kw)
    m = np.array(mask)
    assert m.dtype == np.bool_ and m.shape == must.shape
    assert not np.any(must & ~m), "RET-SELECT: a token every valid top-k keeps is missing"
    assert not np.any(m & ~may), "RET-SELECT: a token no valid top-k keeps was selected"
    # Per-head count: the oracle's own mask has the exact size when there are no ties.
    ref = O.select_tokens(scores, **kw)
    assert np.all(m.sum(-1) <= ref.sum(-1) + np.sum(may & ~must, axis=-1))


SELECT_CASES = [  # (T, query_pos, w, sinks, topk)
    (50, 49, 8, 4, 0.1), (50, 49, 0, 0, 5), (50, 49, 60, 4, 0.5),  # w >= length
    (1, 0, 4, 2, 0.5), (50, 20, 4, 2, 3), (50, 49, 4, 60, 1.0),
]


@pytest.mark.clause("RET-SELECT")
@pytest.mark.parametrize("T,i,w,sinks,topk", SELECT_CASES)
@pytest.mark.parametrize("n_q,n_kv", [(2, 2), (6, 2)])
def test_select_tokens(T, i, w, sinks, topk, n_q, n_kv):
    scores = rng(26).standard_normal((2, n_q, T))
    kw = dict(n_kv_heads=n_kv, query_pos=i, w=w, sinks=sinks, topk=topk)
    _check_mask(select_tokens(scores.astype(np.float32), **kw), scores.astype(np.float32).astype(np.float64),
                "float32", **kw)


@pytest.mark.clause("RET-SELECT")
def test_select_tokens_ties_use_allowed_sets():
    scores = np.zeros((1, 2, 20), np.float32)  # all tied: any 3 candidates are valid
    kw = dict(n_kv_heads=1, query_pos=19, w=2, sinks=1, topk=3)
    m = np.array(select_tokens(scores, **kw))
    _check_mask(m, scores.astype(np.float64), "float32", **kw)
    assert 1 + 2 + 3 <= m.sum() <= 1 + 2 + 6


@pytest.mark.clause("RET-ATTN")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_retrieval_attention(dtype):
    q, qo = inp(rng(27).standard_normal((2, 6, 16)), dtype)
    k, ko = inp(rng(28).standard_normal((2, 2, 30, 16)), dtype)
    v, vo = inp(rng(29).standard_normal((2, 2, 30, 8)), dtype)
    mask = rng(30).random((2, 2, 30)) < 0.3
    mask[..., 0] = True
    out = retrieval_attention(q, k, v, mask)
    assert out.dtype == DTYPES[dtype]
    assert_close(out, O.retrieval_attention(qo, ko, vo, mask), dtype, "RET-ATTN")


def _decode_inputs(dtype, T=80, n_q=6, n_kv=2, d=16, K=24, seed=31):
    r = rng(seed)
    inv = rope_inv_freqs(d, 1e4)
    kpre = r.standard_normal((2, n_kv, T, d)).astype(np.float32)
    k = rope_apply(kpre, np.arange(T), inv, traditional=False).astype(DTYPES[dtype])
    q = rope_apply(r.standard_normal((2, n_q, d)), T - 1, inv, traditional=False).astype(DTYPES[dtype])
    v = mx.array(r.standard_normal((2, n_kv, T, 8)).astype(np.float32)).astype(DTYPES[dtype])
    codes = r.integers(0, K, (2, n_kv, T)).astype(np.uint8)
    C = r.standard_normal((n_kv, K, d)).astype(np.float32)
    return q, k, v, codes, C, inv


@pytest.mark.clause("RET-DECODE")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w,sinks,topk", [(8, 4, 0.1), (0, 0, 3), (100, 4, 0.5)])
def test_decode_step(dtype, w, sinks, topk):
    q, k, v, codes, C, inv = _decode_inputs(dtype)
    T = k.shape[-2]
    kw = dict(query_pos=T - 1, b=2048, w=w, sinks=sinks, topk=topk, traditional=False)
    out, mask = decode_step(q, k, v, codes, C, inv_freqs=inv, return_mask=True, **kw)
    assert out.dtype == DTYPES[dtype]
    qo, ko, vo = f64(q), f64(k), f64(v)
    scores = O.token_scores(O.lut_scores(O.far_query(qo, b=2048, inv_freqs=f64(inv), traditional=False,
                                                     positions=T - 1), C), codes)
    _check_mask(mask, scores, "float32", n_kv_heads=2, query_pos=T - 1, w=w, sinks=sinks, topk=topk)
    # Attention is exact over whatever valid set was chosen.
    assert_close(out, O.retrieval_attention(qo, ko, vo, np.array(mask)), dtype, "RET-DECODE")
    # The runtime kernel (fast_decode, what A2ATSCache.decode runs) also picks a valid set, and its output
    # is exact attention over the set it picked.
    g, m2 = decode_step_fast(q[:, :, None, :], k, v, mx.array(codes), prepare_codebook(mx.array(C)), inv_freqs=inv,
                             return_mask=True, **kw)
    _check_mask(m2, scores, "float32", n_kv_heads=2, query_pos=T - 1, w=w, sinks=sinks, topk=topk)
    assert g.dtype == DTYPES[dtype]
    assert_close(g[:, :, 0, :], O.retrieval_attention(qo, ko, vo, np.array(m2)), dtype, "RET-DECODE", "fast path")


@pytest.mark.clause("PREFILL")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("Tq,Tk", [(1, 1), (5, 9)])
def test_prefill_attention(dtype, Tq, Tk):
    q, qo = inp(rng(32).standard_normal((2, 6, Tq, 16)), dtype)
    k, ko = inp(rng(33).standard_normal((2, 2, Tk, 16)), dtype)
    v, vo = inp(rng(34).standard_normal((2, 2, Tk, 8)), dtype)
    out = prefill_attention(q, k, v)
    assert out.dtype == DTYPES[dtype]
    assert_close(out, O.prefill_attention(qo, ko, vo), dtype, "PREFILL")


@pytest.mark.clause("CODES-DTYPE")
def test_code_dtype():
    for K in (1, 256, 257, 4096, 65536):
        assert code_dtype(K) == O.code_dtype(K)
    with pytest.raises(ValueError, match="at most 16-bit"):
        code_dtype(65537)


# ---------------------------------------------------------------- INPUT-ERRORS

_inv16 = np.asarray(O.rope_inv_freqs(16, 1e4), np.float32)
_x = np.ones((3, 16), np.float32)

ERROR_CASES = [
    ("odd head_dim", lambda: rope_inv_freqs(15, 1e4), "head_dim"),
    ("inv_freqs shape", lambda: rope_apply(_x, 0, _inv16[:4], traditional=False), "inv_freqs"),
    ("nan positions", lambda: rope_apply(_x, np.array([0.5, np.nan, 2]), _inv16, traditional=False), "finite"),
    ("bool positions", lambda: rope_apply(_x, np.array([True, False, True]), _inv16, traditional=False), "real"),
    ("nan input", lambda: rope_apply(np.full((2, 16), np.nan, np.float32), 0, _inv16, traditional=False), "finite"),
    ("int input", lambda: rope_apply(np.ones((2, 16), np.int32), 0, _inv16, traditional=False), "float16"),
    ("GQA", lambda: query_moment(np.ones((3, 4, 16), np.float32), n_kv_heads=2, b=1, inv_freqs=_inv16,
                                 traditional=False), "divide"),
    ("negative b", lambda: far_query(_x, b=-1, inv_freqs=_inv16, traditional=False), "b:"),
    ("codebook width", lambda: assign(_x, np.ones((4, 8), np.float32), np.eye(16, dtype=np.float32)), "head_dim"),
    ("K too big", lambda: kmeans(np.ones((4, 2), np.float32), 70000, seed=0), "16-bit"),
    ("N < K", lambda: kmeanspp_init(np.ones((3, 2), np.float32), 4, np.zeros(4)), "at least K"),
    ("duplicates", lambda: kmeanspp_init(np.ones((6, 2), np.float32), 2, np.zeros(2)), "distinct"),
    ("uniforms range", lambda: kmeanspp_init(np.eye(4, dtype=np.float32), 2, np.array([0.1, 1.0])), "[0, 1)"),
    ("L not lower", lambda: z_transform(_x, np.ones((16, 16), np.float32)), "lower"),
    ("topk zero", lambda: topk_count(10, 0), "topk"),
    ("topk > 1.0", lambda: topk_count(10, 1.5), "topk"),
    ("negative w", lambda: select_tokens(np.zeros((2, 5)), n_kv_heads=1, query_pos=4, w=-1, sinks=0, topk=1), "w:"),
    ("negative sinks", lambda: select_tokens(np.zeros((2, 5)), n_kv_heads=1, query_pos=4, w=1, sinks=-2, topk=1),
     "sinks"),
    ("query_pos", lambda: select_tokens(np.zeros((2, 5)), n_kv_heads=1, query_pos=5, w=1, sinks=0, topk=1),
     "query_pos"),
    ("codes range", lambda: token_scores(np.zeros((2, 4), np.float32), np.full((1, 3), 4, np.uint8)), "codes"),
    ("empty mask", lambda: retrieval_attention(np.ones((1, 16), np.float32), np.ones((1, 3, 16), np.float32),
                                               np.ones((1, 3, 4), np.float32), np.zeros((1, 3), bool)), "mask"),
    ("prefill Tk < Tq", lambda: prefill_attention(np.ones((1, 4, 16), np.float32), np.ones((1, 2, 16), np.float32),
                                                  np.ones((1, 2, 4), np.float32)), "Tq"),
]


@pytest.mark.clause("INPUT-ERRORS")
@pytest.mark.parametrize("name,call,match", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_input_errors(name, call, match):
    with pytest.raises(ValueError, match=None) as info:
        call()
    assert match.lower() in str(info.value).lower(), f"{name}: message {str(info.value)!r} lacks {match!r}"


def test_checks_helpers():
    with pytest.raises(ValueError, match="negative|non-negative"):
        checks.check_nonneg_int(-1, "sinks")
    assert math.isclose(float(np.array(checks.as_float(np.float64(2.0), "x"))), 2.0)
