"""EQ-10, EQ-13, EQ-15..18, RET-LUT, RET-TOPK, RET-SELECT — the fidelity bench's numbers are the clause functions'.

The bench's codebooks, score errors and attention-mass recalls are recomputed here, at the tiny profile's K and
Lloyd cap, directly through the clause functions (EQ-10's query_moment on the queries themselves, EQ-15
cholesky, EQ-16 z_transform/assign_z, EQ-17 kmeans from its own k-means++ seeding, EQ-18 back_transform, EQ-13
score_error, RET-SELECT select_tokens on gathered codeword scores), on synthetic queries and keys. The hazard:
a bench that measures a private copy of an equation reports findings about code no property checks and that
a2ats-calibrate does not run. Each check is shown to fail on a planted deviation (a uniform-draw Lloyd
k-means, a selection without the GQA union).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from a2ats_conformance.harness.tolerances import tolerance
from a2ats_ref.bench import fidelity as bf
from a2ats_ref.calibration import calibrate as cal
from a2ats_ref.calibration.calibrate import head_seed
from a2ats_ref.calibration.collect import Collected, collect
from a2ats_ref.calibration.corpus import build_corpus
from a2ats_ref.eq10_query_moment import query_moment
from a2ats_ref.eq12_far_keys import far_keys, far_query
from a2ats_ref.eq13_score_error import score_error
from a2ats_ref.eq15_cholesky import cholesky
from a2ats_ref.eq16_z_transform import assign_z, z_transform
from a2ats_ref.eq17_kmeans import kmeans
from a2ats_ref.eq18_back_transform import back_transform
from a2ats_ref.retrieval import select_tokens
from a2ats_ref.rope import rope_inv_freqs
from test_calib_tiny import TEXT, ByteTokenizer, tiny_model

TINY = bf.PROFILES["tiny"]
N_Q, N_KV, D, B, W, SINKS = 6, 2, 16, 2048, 16, 2
T_CAL, T_EVAL, LAYER = 256, 96, 1


def _meta():
    inv = np.asarray(rope_inv_freqs(D, 10000.0), np.float64)
    return dict(n_layers=2, n_q=N_Q, n_kv=N_KV, d=D, scale=D ** -0.5, inv=inv, traditional=False)


def _calibration(rng):
    """A Collected as collect() gives it (qsum of R_b-rotated pre-RoPE queries per KV head) and the queries."""
    meta = _meta()
    q = rng.standard_normal((N_Q, T_CAL, D)).astype(np.float32) * np.linspace(0.3, 3.0, D, dtype=np.float32)
    k = rng.standard_normal((N_KV, T_CAL, D)).astype(np.float32)
    qb = np.asarray(far_query(mx.array(q), b=B, inv_freqs=meta["inv"], traditional=False), np.float64)
    qb = qb.reshape(N_KV, (N_Q // N_KV) * T_CAL, D)
    qsum = np.einsum("hnd,hne->hde", qb, qb)
    col = Collected(keys=[k, k], qsum=[qsum, qsum], qcount=[qb.shape[1]] * 2, n_tokens=T_CAL, b=B,
                    meta={"n_layers": 2, "n_q": N_Q, "n_kv": N_KV, "head_dim": D})
    return col, q, k


def _fit(col):
    return bf.fit_layer_books(col, [LAYER], TINY["K"], TINY["iters"], plain_layers=[LAYER])[LAYER]


def check_codebooks(books_l, q, k):
    """The bench's books are EQ-10 -> EQ-15 -> EQ-16 -> EQ-17 (a2ats-calibrate's seeds) -> EQ-18, bit for bit."""
    rtol, atol = tolerance("float32", "EQ-10")
    H = query_moment(mx.array(q), n_kv_heads=N_KV, b=B, inv_freqs=_meta()["inv"], traditional=False)
    np.testing.assert_allclose(np.asarray(books_l["H"]), np.asarray(H), rtol=rtol, atol=atol)
    L = cholesky(books_l["H"])
    eye = mx.broadcast_to(mx.eye(D), (N_KV, D, D))
    for kind, Lk in (("query_aware", L), ("plain", eye)):
        book = books_l[kind]
        assert np.array_equal(np.asarray(book.L), np.asarray(Lk)), kind
        Cz = mx.stack([kmeans(z_transform(mx.array(k[h]), Lk[h]), TINY["K"], seed=head_seed(0, LAYER, h),
                              max_iter=TINY["iters"], assign=False)[0] for h in range(N_KV)])
        assert np.array_equal(np.asarray(book.Cz), np.asarray(Cz)), f"{kind}: Cz is not a2ats-calibrate's fit"
        assert np.array_equal(np.asarray(book.C), np.asarray(back_transform(Cz, Lk))), f"{kind}: C is not EQ-18's"


def _direct_measures(books_l, q, k, probes):
    """Score-error sums by EQ-13 (with H the probe queries' own second moment) and recalls by RET-SELECT on
    codeword scores gathered per token."""
    meta = _meta()
    G = N_Q // N_KV
    T = q.shape[1]
    kpre = far_keys(mx.array(k), mx.arange(T), meta["inv"], traditional=False)
    codes = {kind: assign_z(kpre, books_l[kind].Cz, books_l[kind].L) for kind in ("query_aware", "plain")}
    num, den = {kind: 0.0 for kind in codes}, 0.0
    rec = {f: {"a2ats": [], "oracle": [], "plain_vq": []} for f in bf.RECALL_BUDGETS}
    for i in probes:
        n, nf = i + 1, max(i + 1 - W, 0)
        qb = np.asarray(far_query(mx.array(q[:, i]), b=B, inv_freqs=meta["inv"], traditional=False,
                                  positions=mx.full((N_Q,), i)), np.float64).reshape(N_KV, G, D)
        Q = mx.array(np.einsum("hgd,hge->hde", qb, qb).astype(np.float32))[:, None]              # (n_kv, 1, d, d)
        den += float(mx.sum(score_error(kpre[:, :nf], mx.zeros((N_KV, nf, D)), Q)))
        scores = {}
        for kind, c in codes.items():
            ck = np.asarray(books_l[kind].C, np.float64)[np.arange(N_KV)[:, None], np.asarray(c)[:, :n]]
            num[kind] += float(mx.sum(score_error(kpre[:, :nf], mx.array(ck[:, :nf].astype(np.float32)), Q)))
            scores[kind] = np.einsum("hgd,hnd->hgn", qb, ck)
        logits = np.einsum("hgd,hnd->hgn", q[:, i].reshape(N_KV, G, D), k[:, :n]) * meta["scale"]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        for f in bf.RECALL_BUDGETS:
            for name, sc in (("a2ats", scores["query_aware"]), ("plain_vq", scores["plain"]), ("oracle", logits)):
                m = np.asarray(select_tokens(mx.array(sc.reshape(N_Q, n).astype(np.float32)), n_kv_heads=N_KV,
                                             query_pos=i, w=W, sinks=SINKS, topk=f))
                rec[f][name].append(float((p * m[:, None, :]).sum(-1).mean()))
    return num, den, rec


def check_measures(books_l, q, k):
    probes = [int(x) for x in np.linspace(T_EVAL // 2, T_EVAL - 1, TINY["probes"] + 2).astype(int)]
    num, den, rec = bf.layer_measures(mx.array(q), mx.array(k), books_l, _meta(), probes, B, W, SINKS)
    dnum, dden, drec = _direct_measures(books_l, q, k, probes)
    rtol, _ = tolerance("float32", "EQ-13")
    assert den > 0 and dden > 0
    for kind in num:
        np.testing.assert_allclose(num[kind] / den, dnum[kind] / dden, rtol=rtol, err_msg=f"score error, {kind}")
    for f in rec:
        for name in rec[f]:
            np.testing.assert_allclose(rec[f][name], drec[f][name], rtol=1e-6, err_msg=f"recall {name} at {f}")


def _eval_qk(rng):
    """Post-RoPE evaluation queries and keys at positions 0..T_EVAL-1."""
    meta = _meta()
    pos = mx.arange(T_EVAL)
    q = rng.standard_normal((N_Q, T_EVAL, D)).astype(np.float32) * np.linspace(0.3, 3.0, D, dtype=np.float32)
    k = rng.standard_normal((N_KV, T_EVAL, D)).astype(np.float32)
    rot = bf._rot
    return np.asarray(rot(mx.array(q), np.asarray(pos), meta)), np.asarray(rot(mx.array(k), np.asarray(pos), meta))


@pytest.mark.clause("EQ-10", "EQ-15", "EQ-16", "EQ-17-INIT", "EQ-17-FIT", "EQ-18")
def test_bench_codebooks_are_a2ats_calibrates_fit():
    col, q, k = _calibration(np.random.default_rng(0))
    check_codebooks(_fit(col), q, k)


@pytest.mark.clause("EQ-13", "RET-LUT", "RET-TOPK", "RET-SELECT")
def test_bench_score_error_and_recall_are_the_clause_functions():
    rng = np.random.default_rng(1)
    col, _, _ = _calibration(rng)
    check_measures(_fit(col), *_eval_qk(rng))


def _calibrate_both(tmp_path, max_iter=cal.DEFAULTS["max_iter"]):
    """a2ats-calibrate's codebook and the bench's query-aware books for the same model, corpus, K and seed."""
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    m, tok = tiny_model(), ByteTokenizer()
    corpus_kw = dict(tokens=300, uuid_fraction=0.25, seq_len=128, seed=3, packing="packed")
    cb = cal.calibrate(m, tok, texts=[text], codebook_size=16, b=64, chunk=48, quiet=True, **corpus_kw)
    corpus = build_corpus(tok, paths=[text], **corpus_kw)
    col = collect(m, corpus.sequences, b=64, chunk=48)
    books = bf.fit_layer_books(col, range(len(col.keys)), 16, max_iter, seed=3)
    return cb, books


def check_equal_codebooks(cb, books):
    for li, (Cz, L) in enumerate(zip(cb.cz, cb.Ls)):
        assert np.array_equal(np.asarray(books[li]["query_aware"].L), np.asarray(L)), f"layer {li}: L"
        assert np.array_equal(np.asarray(books[li]["query_aware"].Cz), np.asarray(Cz)), f"layer {li}: Cz"


@pytest.mark.clause("EQ-10", "EQ-15", "EQ-16", "EQ-17-FIT", "EQ-18")
def test_bench_codebooks_equal_a2ats_calibrates_codebook(tmp_path):
    check_equal_codebooks(*_calibrate_both(tmp_path))


@pytest.mark.clause("EQ-17-FIT")
def test_calibrate_check_catches_a_step_cap(tmp_path):
    # the bench's Lloyd cap is a departure: below a2ats-calibrate's steps the books differ, and the check says so
    with pytest.raises(AssertionError, match="Cz"):
        check_equal_codebooks(*_calibrate_both(tmp_path, max_iter=1))


def _uniform_lloyd(keys, L, K, *, seed, layer, max_iter, tol):
    """Planted deviation: Lloyd k-means seeded with K distinct uniform draws instead of k-means++."""
    out = []
    for h in range(keys.shape[0]):
        z = np.asarray(z_transform(mx.array(keys[h]), L[h]), np.float64)
        C = z[np.random.default_rng(seed).choice(len(z), K, replace=False)]
        for _ in range(max_iter):
            c = np.argmin(((z[:, None] - C[None]) ** 2).sum(-1), axis=1)
            C = np.stack([z[c == j].mean(0) if np.any(c == j) else C[j] for j in range(K)])
        out.append(C.astype(np.float32))
    return mx.array(np.stack(out))


@pytest.mark.clause("EQ-17-INIT")
def test_codebook_checks_catch_a_uniform_init_kmeans(monkeypatch, tmp_path):
    col, q, k = _calibration(np.random.default_rng(0))
    monkeypatch.setattr(bf, "fit_layer", _uniform_lloyd)
    with pytest.raises(AssertionError, match="Cz is not a2ats-calibrate's fit"):
        check_codebooks(_fit(col), q, k)
    with pytest.raises(AssertionError, match="Cz"):
        check_equal_codebooks(*_calibrate_both(tmp_path))


@pytest.mark.clause("RET-SELECT")
def test_measure_check_catches_a_selection_without_the_gqa_union(monkeypatch):
    rng = np.random.default_rng(1)
    col, _, _ = _calibration(rng)
    books_l = _fit(col)
    real = bf.select_tokens

    def first_head_only(scores, *, n_kv_heads, **kw):          # each KV head keeps only its first query head's top-k
        G = scores.shape[-2] // n_kv_heads
        s = mx.repeat(scores.reshape(n_kv_heads, G, -1)[:, :1], G, axis=1).reshape(scores.shape)
        return real(s, n_kv_heads=n_kv_heads, **kw)

    monkeypatch.setattr(bf, "select_tokens", first_head_only)
    with pytest.raises(AssertionError, match="recall"):
        check_measures(books_l, *_eval_qk(rng))
