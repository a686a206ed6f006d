"""Tests of the float64 oracle (a2ats_spec.oracle) against independent definitions, and of the clause registry."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from a2ats_spec import clauses
from a2ats_spec import oracle as o

FAST = settings(deadline=None, max_examples=25, derandomize=True)


def rng(seed=0):
    return np.random.default_rng(seed)


def R_explicit(m, omega, traditional):
    """Independent block-diagonal rotation matrix: permute to pair-blocks, rotate each 2x2 block, permute back."""
    d = 2 * len(omega)
    perm = np.arange(d) if traditional else np.stack([np.arange(d // 2), np.arange(d // 2, d)], 1).ravel()
    P = np.eye(d)[perm]  # row r of P selects coordinate perm[r]
    B = np.zeros((d, d))
    for i, w in enumerate(omega):
        c, s = math.cos(m * w), math.sin(m * w)
        B[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, s], [-s, c]]  # row-vector form of a counter-clockwise rotation
    return P.T @ B @ P


# --------------------------------------------------------------------------- clauses

PLAN_IDS = ["ROPE-FREQ", "ROPE-APPLY", "ROPE-INVERSE", "EQ-10", "EQ-11", "EQ-12", "EQ-13", "EQ-14", "EQ-15",
            "EQ-16", "EQ-17-INIT", "EQ-17-STEP", "EQ-17-FIT", "EQ-18", "RET-LUT", "RET-TOPK", "RET-SELECT",
            "RET-ATTN", "RET-DECODE", "PREFILL", "CODES-DTYPE", "INPUT-ERRORS", "CACHE-TRIM", "CACHE-CHUNK",
            "CACHE-DENSE-EQUIV", "CACHE-DECODE", "CACHE-FAR-CODES", "CACHE-SAVE", "CACHE-BATCH"]


def test_clause_registry_has_every_planned_id():
    ids = clauses.clause_ids()
    assert set(PLAN_IDS) <= set(ids), sorted(set(PLAN_IDS) - set(ids))
    assert len(ids) == len(set(ids))
    for cid in ids:
        c = clauses.get(cid)
        assert c.id == cid and c.title and c.text, cid
        assert c.anchor.startswith(cid.lower() + "--"), c.anchor


def test_clause_get_unknown_is_helpful():
    with pytest.raises(KeyError, match="EQ-1"):
        clauses.get("EQ-1O")


def test_clause_parse_rejects_malformed_and_duplicates():
    with pytest.raises(ValueError, match="defined twice"):
        clauses.parse("### EQ-1 \u2014 a\n\n### EQ-1 \u2014 b\n")
    with pytest.raises(ValueError, match="must read"):
        clauses.parse("### EQ-1 - hyphen instead of em dash\n")


def test_every_oracle_function_docstring_opens_with_a_clause():
    ids = set(clauses.clause_ids())
    for name in o.__all__:
        fn = getattr(o, name)
        if callable(fn):
            head = fn.__doc__.split(".")[0]
            assert head in ids, (name, head)


# --------------------------------------------------------------------------- ROPE-*

@pytest.mark.clause("ROPE-APPLY")
@FAST
@given(d2=st.integers(1, 6), trad=st.booleans(), m=st.integers(-50, 3000), seed=st.integers(0, 99))
def test_rope_apply_matches_explicit_rotation_matrix(d2, trad, m, seed):
    om = o.rope_inv_freqs(2 * d2, 500.0)
    x = rng(seed).normal(size=(3, 2 * d2))
    R = R_explicit(m, om, trad)
    np.testing.assert_allclose(o.rope_apply(x, m, om, traditional=trad), x @ R, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(o.rope_matrix(m, om, traditional=trad), R, atol=1e-15)
    np.testing.assert_allclose(R @ R.T, np.eye(2 * d2), atol=1e-12)


@pytest.mark.clause("ROPE-APPLY")
@FAST
@given(trad=st.booleans(), i=st.integers(0, 5000), j=st.integers(0, 5000), seed=st.integers(0, 99))
def test_rope_relative_identity(trad, i, j, seed):
    om = o.rope_inv_freqs(8, 1e4)
    q, k = rng(seed).normal(size=(2, 8))
    lhs = o.rope_apply(q, i, om, traditional=trad) @ o.rope_apply(k, j, om, traditional=trad)
    rhs = o.rope_apply(q, i - j, om, traditional=trad) @ k
    assert abs(lhs - rhs) < 1e-9 * (1 + abs(lhs))


@pytest.mark.clause("ROPE-APPLY", "ROPE-INVERSE")
def test_rope_per_token_positions_and_inverse():
    om = o.rope_inv_freqs(16, 1e4)
    x = rng(1).normal(size=(2, 5, 16))
    p = np.array([7, 8, 9, 10, 11])
    for trad in (True, False):
        y = o.rope_apply(x, p, om, traditional=trad)
        for t in range(5):
            np.testing.assert_allclose(y[:, t], x[:, t] @ R_explicit(p[t], om, trad), atol=1e-12)
        np.testing.assert_allclose(o.rope_invert(y, p, om, traditional=trad), x, atol=1e-12)
        np.testing.assert_allclose(o.far_keys(y, p, om, traditional=trad), x, atol=1e-12)
        # a block rotation by -p0 (token t at -p0 + t) is NOT the inverse
        block = o.rope_apply(y, -p[0] + np.arange(5), om, traditional=trad)
        assert np.abs(block[:, 1:] - x[:, 1:]).max() > 1e-3


def _mlx_rope(x, module_or_none, offset, **fast_kw):
    import mlx.core as mx
    xa = mx.array(x.astype(np.float32))
    y = module_or_none(xa, offset=offset) if module_or_none is not None else mx.fast.rope(xa, offset=offset, **fast_kw)
    return np.array(y, dtype=np.float64)


@pytest.mark.clause("ROPE-APPLY")
@pytest.mark.parametrize("trad", [True, False])
@pytest.mark.parametrize("scaling", [None, {"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 0.5},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0,
                                      "high_freq_factor": 8.0, "original_max_position_embeddings": 256}])
def test_rope_matches_mlx_lm_modules(trad, scaling):
    from mlx_lm.models.rope_utils import initialize_rope
    d, base = 64, 10000.0
    mod = initialize_rope(d, base, trad, scaling, max_position_embeddings=4096)
    om = o.rope_inv_freqs(d, base, scaling)
    if scaling is not None and scaling.get("rope_type") == "llama3":
        np.testing.assert_allclose(1.0 / np.array(mod._freqs, dtype=np.float64), om, rtol=1e-5)  # periods -> ω
    x = rng(2).normal(size=(1, 1, 6, d))
    for offset in (0, 37, 1500):
        got = _mlx_rope(x, mod, offset)
        want = o.rope_apply(x, offset + np.arange(6), om, traditional=trad)
        np.testing.assert_allclose(got, want, atol=2e-4 * (1 + offset / 100))


@pytest.mark.clause("ROPE-FREQ")
def test_rope_llama3_bands_hit_all_three_cases():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    om0, om = o.rope_inv_freqs(64, 1e4), o.rope_inv_freqs(64, 1e4, scaling)
    ratio = om / om0
    assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, 1 / 8))
    assert np.any((ratio > 1 / 8 + 1e-9) & (ratio < 1 - 1e-9))


@pytest.mark.clause("ROPE-FREQ")
@pytest.mark.parametrize("kind", ["yarn", "longrope", "su", "dynamic", "proportional", "mrope", "bogus"])
def test_rope_unsupported_types_raise(kind):
    with pytest.raises(ValueError, match="supported types: default, linear, llama3"):
        o.rope_inv_freqs(64, 1e4, {"rope_type": kind, "factor": 2.0})


@pytest.mark.clause("ROPE-APPLY")
def test_rope_matches_mx_fast_rope_direct():
    d = 8
    om = o.rope_inv_freqs(d, 1e4)
    x = rng(3).normal(size=(1, 1, 4, d))
    for trad in (True, False):
        got = _mlx_rope(x, None, 11, dims=d, traditional=trad, base=1e4, scale=1.0)
        np.testing.assert_allclose(got, o.rope_apply(x, 11 + np.arange(4), om, traditional=trad), atol=1e-5)


# --------------------------------------------------------------------------- EQ-10 .. EQ-12

@pytest.mark.clause("EQ-10")
@pytest.mark.parametrize("n_q,n_kv", [(2, 2), (6, 2), (4, 1)])
def test_query_moment_pools_groups_normalises_and_adds_ridge(n_q, n_kv):
    d, N, b = 8, 30, 2048
    om = o.rope_inv_freqs(d, 1e4)
    q = rng(4).normal(size=(n_q, N, d)) * np.arange(1, d + 1)
    H = o.query_moment(q, n_kv_heads=n_kv, b=b, inv_freqs=om, traditional=False, ridge=1e-3)
    G = n_q // n_kv
    Rb = R_explicit(b, om, False)
    for g in range(n_kv):
        qt = np.concatenate([q[h] @ Rb for h in range(g * G, (g + 1) * G)])
        M = sum(np.outer(r, r) for r in qt) / len(qt)
        M = M / np.sqrt(np.mean(M ** 2))
        np.testing.assert_allclose(H[g], M + 1e-3 * np.eye(d), atol=1e-12)
        np.testing.assert_allclose(np.mean((H[g] - 1e-3 * np.eye(d)) ** 2), 1.0)


@pytest.mark.clause("EQ-11")
def test_wrope_window_boundary_and_far_side():
    d, w, b = 8, 4, 100
    om = o.rope_inv_freqs(d, 1e4)
    q = rng(5).normal(size=(12, d))
    k = rng(6).normal(size=(12, d))
    u = o.wrope_scores(q, k, w=w, b=b, inv_freqs=om, traditional=True)
    for i in range(12):
        for j in range(12):
            rel = i - j
            R = R_explicit(rel if rel < w else b, om, True)
            assert abs(u[i, j] - q[i] @ R @ k[j]) < 1e-12
    i = 9
    assert abs(u[i, i - (w - 1)] - q[i] @ R_explicit(w - 1, om, True) @ k[i - (w - 1)]) < 1e-12  # near
    assert abs(u[i, i - w] - q[i] @ R_explicit(b, om, True) @ k[i - w]) < 1e-12                # far
    # w = 0: everything far; w >= length: plain RoPE scores on the causal part
    u0 = o.wrope_scores(q, k, w=0, b=b, inv_freqs=om, traditional=True)
    np.testing.assert_allclose(np.tril(u0), np.tril((q @ R_explicit(b, om, True)) @ k.T), atol=1e-12)
    np.testing.assert_allclose(u0[0, 1], q[0] @ R_explicit(-1, om, True) @ k[1], atol=1e-12)  # j > i is near
    ub = o.wrope_scores(q, k, w=12, b=b, inv_freqs=om, traditional=True)
    dense = o.rope_apply(q, np.arange(12), om, traditional=True) @ o.rope_apply(k, np.arange(12), om, traditional=True).T
    np.testing.assert_allclose(np.tril(ub), np.tril(dense), atol=1e-10)


@pytest.mark.clause("ROPE-APPLY", "EQ-11")
@FAST
@given(trad=st.booleans(), w=st.integers(0, 6), b=st.integers(0, 5000), seed=st.integers(0, 999),
       pq=st.lists(st.integers(0, 3000), min_size=1, max_size=4), pk=st.lists(st.integers(0, 3000), min_size=1, max_size=5))
def test_wrope_matches_per_pair_definition(trad, w, b, seed, pq, pk):
    om = o.rope_inv_freqs(6, 1e4)
    q = rng(seed).normal(size=(len(pq), 6))
    k = rng(seed + 1).normal(size=(len(pk), 6))
    u = o.wrope_scores(q, k, w=w, b=b, inv_freqs=om, traditional=trad, q_positions=pq, k_positions=pk)
    for a, i in enumerate(pq):
        for c, j in enumerate(pk):
            want = q[a] @ R_explicit(i - j if i - j < w else b, om, trad) @ k[c]
            assert abs(u[a, c] - want) < 1e-9 * (1 + abs(want)), (i, j, w, b)


@pytest.mark.clause("EQ-11")
def test_wrope_positions_and_batch():
    d = 8
    om = o.rope_inv_freqs(d, 1e4)
    q = rng(7).normal(size=(3, 1, d))
    k = rng(8).normal(size=(3, 20, d))
    u = o.wrope_scores(q, k, w=5, b=64, inv_freqs=om, traditional=False, q_positions=[19])
    full = o.wrope_scores(np.repeat(q, 20, axis=1), k, w=5, b=64, inv_freqs=om, traditional=False)
    np.testing.assert_allclose(u[:, 0], full[:, 19], atol=1e-12)


@pytest.mark.clause("EQ-12")
def test_far_query_post_rope_equals_pre_rope():
    d = 16
    om = o.rope_inv_freqs(d, 1e5)
    q = rng(9).normal(size=(4, d))
    for trad in (True, False):
        qpost = o.rope_apply(q, 777, om, traditional=trad)
        a = o.far_query(qpost, b=2048, inv_freqs=om, traditional=trad, positions=777)
        np.testing.assert_allclose(a, o.far_query(q, b=2048, inv_freqs=om, traditional=trad), atol=1e-10)
        np.testing.assert_allclose(a, q @ R_explicit(2048, om, trad), atol=1e-10)


# --------------------------------------------------------------------------- EQ-13 .. EQ-16, EQ-18

@pytest.mark.clause("EQ-13")
def test_score_error_equals_empirical_mean_over_queries():
    d, M = 8, 500
    Q = rng(10).normal(size=(M, d)) @ rng(11).normal(size=(d, d))
    H = Q.T @ Q / M
    k, c = rng(12).normal(size=(2, d))
    emp = np.mean((Q @ k - Q @ c) ** 2)
    assert abs(o.score_error(k, c, H) - emp) < 1e-9 * emp


def _spd(d, seed):
    A = rng(seed).normal(size=(d, d))
    return A @ A.T / d + 0.1 * np.eye(d)


@pytest.mark.clause("EQ-14", "EQ-16")
@FAST
@given(d2=st.integers(1, 4), K=st.integers(1, 12), seed=st.integers(0, 999))
def test_z_space_identity_and_assign_equivalence(d2, K, seed):
    d = 2 * d2
    H = _spd(d, seed)
    L = o.cholesky(H)
    np.testing.assert_allclose(L @ L.T, H, atol=1e-12)
    assert np.all(np.triu(L, 1) == 0) and np.all(np.diag(L) > 0)
    C = rng(seed + 1).normal(size=(K, d))
    k = rng(seed + 2).normal(size=(7, d))
    brute = o.assign_distances(k, C, H)
    np.testing.assert_allclose(o.assign_z_distances(k, C @ L, L), brute, rtol=1e-9, atol=1e-9)
    for n in range(7):
        for j in range(K):
            e = k[n] - C[j]
            assert abs(brute[n, j] - e @ H @ e) < 1e-10 * (1 + brute[n, j])
    codes, codes_z = o.assign(k, C, H), o.assign_z(k, C @ L, L)
    allowed = o.argmin_allowed(brute, 1e-9)
    assert np.all(allowed[np.arange(7), codes]) and np.all(allowed[np.arange(7), codes_z])
    np.testing.assert_allclose(o.back_transform(C @ L, L), C, atol=1e-10)
    np.testing.assert_allclose(o.z_transform(k, L), k @ L)


def _near_tie_case(kind, rng_, d, K, N):
    """Keys and z-space codebooks where the nearest codeword is hard to tell: exact integer ties, codewords a few
    ulps apart, keys a rounding error from a codeword, scales near overflow and in the subnormal range."""
    scale = {"normal": 1.0, "huge": 1e154, "tiny": 1e-160, "subnormal": 3e-155}.get(kind, 1.0)
    if kind == "integer":
        return rng_.integers(-2, 3, (N, d)).astype(float), rng_.integers(-2, 3, (K, d)).astype(float), np.eye(d)
    Cz = rng_.normal(size=(K, d)) * scale
    if kind in ("duplicated", "huge", "subnormal"):   # each codeword twice, the copy a few ulps away; keys near and far
        Cz = np.concatenate([Cz, Cz[::-1] * (1 + 2e-16 * rng_.integers(-3, 4, (K, d)))])
        k = Cz[rng_.integers(0, len(Cz), N)] * (1 + 1e-13 * rng_.normal(size=(N, d)))
        k += scale * rng_.normal(size=(N, d)) * rng_.choice([0.0, 1e-3, 1.0], size=(N, 1))
    else:
        k = rng_.normal(size=(N, d)) * scale
    return k, Cz, np.eye(d) if kind != "normal" else o.cholesky(_spd(d, int(rng_.integers(0, 999))))


@pytest.mark.clause("EQ-16")
@pytest.mark.parametrize("kind", ["normal", "integer", "duplicated", "huge", "tiny", "subnormal"])
@pytest.mark.parametrize("seed", range(4))
def test_assign_z_is_the_argmin_of_its_distances_to_the_bit(kind, seed):
    """assign_z rules codewords out by a bound before it evaluates distances: its codes must be exactly the
    lowest-index argmin of assign_z_distances, ties and extreme scales included."""
    r = rng(seed)
    k, Cz, L = _near_tie_case(kind, r, (1, 3, 4, 12)[seed], int(r.integers(1, 100)), 200)
    with np.errstate(over="ignore"):   # at the huge scale, far codewords' squared distances overflow to inf
        want = np.argmin(o.assign_z_distances(k, Cz, L), axis=-1)
        np.testing.assert_array_equal(o.assign_z(k, Cz, L), want)


@pytest.mark.clause("EQ-14")
def test_identity_H_reduces_to_euclidean_nearest():
    C = rng(13).normal(size=(9, 4))
    k = rng(14).normal(size=(20, 4))
    eu = np.argmin(((k[:, None] - C[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(o.assign(k, C, 3.0 * np.eye(4)), eu)
    np.testing.assert_array_equal(o.assign_z(k, C * math.sqrt(3), math.sqrt(3) * np.eye(4)), eu)


@pytest.mark.clause("EQ-14")
def test_assign_ties_go_to_lowest_index():
    C = np.array([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])
    assert o.assign(np.zeros(2), C, np.eye(2)) == 0
    assert o.assign(np.array([1.0, 0.0]), C, np.eye(2)) == 0


@pytest.mark.clause("EQ-18")
def test_back_transform_batched_matches_inverse():
    L = o.cholesky(np.stack([_spd(6, 1), _spd(6, 2)]))
    Cz = rng(15).normal(size=(2, 5, 6))
    C = o.back_transform(Cz, L)
    for g in range(2):
        np.testing.assert_allclose(C[g], Cz[g] @ np.linalg.inv(L[g]), atol=1e-10)


# --------------------------------------------------------------------------- EQ-17

@pytest.mark.clause("EQ-17-INIT")
def test_kmeanspp_inverse_cdf_by_hand():
    z = np.array([[0.0], [1.0], [3.0], [10.0]])
    # u0 = 0.5 -> index 2 (z=3). D2 = [9, 4, 0, 49], cumsum [9, 13, 13, 62].
    C = o.kmeanspp_init(z, 2, np.array([0.5, 0.0]))
    np.testing.assert_array_equal(C, [[3.0], [0.0]])          # 0 * 62 = 0 < 9 -> index 0
    C = o.kmeanspp_init(z, 2, np.array([0.5, 9 / 62]))
    np.testing.assert_array_equal(C, [[3.0], [1.0]])          # threshold 9: first cumsum > 9 is index 1
    C = o.kmeanspp_init(z, 2, np.array([0.5, 13 / 62]))
    np.testing.assert_array_equal(C, [[3.0], [10.0]])         # index 2 has D2 = 0, never chosen
    C = o.kmeanspp_init(z, 3, np.array([0.999, 0.0, 0.0]))
    assert len(np.unique(C)) == 3


@pytest.mark.clause("EQ-17-INIT")
def test_kmeanspp_needs_distinct_points():
    with pytest.raises(ValueError, match="distinct"):
        o.kmeanspp_init(np.zeros((5, 2)), 2, np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="at least K"):
        o.kmeanspp_init(np.eye(2), 3, np.array([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        o.kmeanspp_init(np.eye(3), 2, np.array([0.1, 1.0]))


@pytest.mark.clause("EQ-17-STEP")
def test_lloyd_empty_cluster_reseeded_with_largest_error_point():
    z = np.array([[0.0, 0.0], [0.1, 0.0], [5.0, 0.0], [5.2, 0.0], [9.0, 0.0]])
    C = np.array([[0.0, 0.0], [5.0, 0.0], [100.0, 100.0]])  # cluster 2 gets nobody
    C_new, codes, f = o.lloyd_step(z, C)
    np.testing.assert_array_equal(codes, [0, 0, 1, 1, 1])
    assert f == pytest.approx(0.01 + 0.04 + 16.0)
    # point 4 (error 16) is the largest-error point of a cluster with >= 2 members
    np.testing.assert_allclose(C_new, [[0.05, 0.0], [5.1, 0.0], [9.0, 0.0]])
    # two empty clusters, a singleton cluster must not be robbed
    C = np.array([[9.0, 0.0], [0.0, 0.0], [-50.0, 0.0], [50.0, 50.0]])
    C_new, codes, _ = o.lloyd_step(z, C)
    np.testing.assert_array_equal(codes, [1, 1, 0, 0, 0])
    assert len({tuple(r) for r in C_new}) == 4
    np.testing.assert_allclose(C_new[2], [5.0, 0.0])   # cluster 0 (9.0) has largest error at z=5.0 (16)
    np.testing.assert_allclose(C_new[3], [5.2, 0.0])   # next largest (3.8^2) among remaining eligible


@pytest.mark.clause("EQ-17-FIT")
@FAST
@given(N=st.integers(6, 60), K=st.integers(1, 6), seed=st.integers(0, 999))
def test_kmeans_objective_non_increasing_and_all_codewords_used(N, K, seed):
    z = rng(seed).normal(size=(N, 3))
    C, codes, hist = o.kmeans(z, K, seed=seed, max_iter=50)
    assert np.all(np.diff(hist) <= 1e-12 * (1 + hist[:-1]))
    C1, _, f1 = o.lloyd_step(z, C)
    assert f1 <= hist[-1] + 1e-12 * (1 + hist[-1])
    np.testing.assert_array_equal(codes, np.argmin(((z[:, None] - C[None]) ** 2).sum(-1), axis=1))
    assert C.shape == (K, 3) and len(hist) <= 50


@pytest.mark.clause("EQ-17-FIT")
def test_kmeans_deterministic_and_stops():
    z = np.concatenate([rng(16).normal(size=(40, 2)) + c for c in ([0, 0], [10, 0], [0, 10])])
    a = o.kmeans(z, 3, seed=3)
    b = o.kmeans(z, 3, seed=3)
    np.testing.assert_array_equal(a[0], b[0])
    assert 2 <= len(a[2]) < 300
    assert sorted(np.bincount(a[1])) == [40, 40, 40]
    assert len(o.kmeans(z, 3, seed=3, max_iter=1)[2]) == 1


# --------------------------------------------------------------------------- RET-*

@pytest.mark.clause("RET-TOPK")
def test_topk_count_rounding():
    assert o.topk_count(100, 0.03) == 3
    assert o.topk_count(100, 0.29) == 28          # 0.29 * 100 = 28.999999999999996 -> floor
    assert o.topk_count(33, 0.03) == 0
    assert o.topk_count(10, 1.0) == 10
    assert o.topk_count(10, 7) == 7
    assert o.topk_count(10, 7, n_candidates=4) == 4
    for bad in (0.0, -0.1, 1.5, 0, -3, True, "x"):
        with pytest.raises(ValueError, match="topk"):
            o.topk_count(10, bad)


def brute_select(scores, G, i, w, sinks, count):
    n_q, T = scores.shape
    mask = np.zeros((n_q // G, T), dtype=bool)
    for h in range(n_q):
        cands = [j for j in range(T) if j <= i and j >= sinks and not (0 <= i - j < w)]
        cands.sort(key=lambda j: (-scores[h, j], j))
        for j in cands[:count]:
            mask[h // G, j] = True
    for j in range(T):
        if j <= i and (j < sinks or 0 <= i - j < w):
            mask[:, j] = True
    if not mask.any(axis=-1).all():   # RET-SELECT never-empty rule: the query's own token
        assert count == 0 and w == 0 and sinks == 0
        mask[:, i] = True
    return mask


@pytest.mark.clause("RET-SELECT")
@FAST
@given(n_kv=st.integers(1, 3), G=st.integers(1, 3), T=st.integers(1, 40), w=st.integers(0, 8),
       sinks=st.integers(0, 5), topk=st.one_of(st.floats(0.01, 1.0), st.integers(1, 10)), seed=st.integers(0, 999))
def test_select_tokens_matches_brute_force(n_kv, G, T, w, sinks, topk, seed):
    s = np.round(rng(seed).normal(size=(n_kv * G, T)), 1)  # rounding creates ties
    i = T - 1
    mask = o.select_tokens(s, n_kv_heads=n_kv, query_pos=i, w=w, sinks=sinks, topk=topk)
    n_cand = sum(1 for j in range(T) if j >= sinks and i - j >= w)
    expect = brute_select(s, G, i, w, sinks, o.topk_count(T, topk, n_cand))
    np.testing.assert_array_equal(mask, expect)
    must, may = o.select_tokens_allowed(s, n_kv_heads=n_kv, query_pos=i, w=w, sinks=sinks, topk=topk, margin=0.0)
    assert np.all(must <= mask) and np.all(mask <= may)


@pytest.mark.clause("RET-SELECT")
def test_select_tokens_edges():
    s = rng(17).normal(size=(4, 50))
    # w >= length: all selected; w = 0: current token becomes a candidate
    assert o.select_tokens(s, n_kv_heads=2, query_pos=49, w=50, sinks=0, topk=0.01).all()
    m = o.select_tokens(s, n_kv_heads=4, query_pos=49, w=0, sinks=0, topk=1)
    np.testing.assert_array_equal(m[:, :].sum(-1), [1, 1, 1, 1])
    np.testing.assert_array_equal(np.argmax(m, -1), np.argmax(s, -1))
    # single token
    assert o.select_tokens(s[:, :1], n_kv_heads=2, query_pos=0, w=0, sinks=0, topk=1.0).all()
    # the count comes from the i + 1 tokens the query sees (= T at decode); tokens after query_pos never count
    m = o.select_tokens(s[:1], n_kv_heads=1, query_pos=29, w=0, sinks=0, topk=0.1)
    assert m[0].sum() == o.topk_count(30, 0.1) == 3 and not m[0, 30:].any()
    # tokens after query_pos are never selected
    m = o.select_tokens(s, n_kv_heads=1, query_pos=20, w=3, sinks=2, topk=1.0)
    assert m[0, :21].all() and not m[0, 21:].any()
    # union over the group: G=2 heads with disjoint top-1 -> 2 picks (+ window + sinks)
    s2 = np.zeros((2, 30)); s2[0, 10] = 5; s2[1, 12] = 5
    m = o.select_tokens(s2, n_kv_heads=1, query_pos=29, w=4, sinks=2, topk=1)
    assert set(np.flatnonzero(m[0])) == {0, 1, 10, 12, 26, 27, 28, 29}
    m = o.select_tokens(s2, n_kv_heads=2, query_pos=29, w=4, sinks=2, topk=1)
    assert 10 in np.flatnonzero(m[0]) and 12 not in np.flatnonzero(m[0]) and 12 in np.flatnonzero(m[1])


@pytest.mark.clause("RET-SELECT")
def test_head_counts_see_a_tie_taken_one_token_short():
    """A tie at the k-th score: must ⊆ M ⊆ may holds for a selection one tied token short, the per-head count
    does not; the exact top-k, a whole tie and the never-empty rule's own token all count right."""
    s = np.array([[9.0, 5.0, 5.0, 5.0, 5.0, 1.0, 0.0, 0.0]])   # k = 3: one token above, a tie of 4 for 2 places
    kw = dict(n_kv_heads=1, query_pos=7, w=0, sinks=0, topk=3)
    exact = o.select_tokens(s, **kw)
    short = exact.copy()
    short[0, np.flatnonzero(exact[0])[-1]] = False
    must, may = o.select_tokens_allowed(s, margin=0.0, **kw)
    assert not (must & ~short).any() and not (short & ~may).any()           # the sets alone accept it
    held = lambda m: o.select_tokens_head_counts(m, s, margin=0.0, **kw)      # noqa: E731
    assert held(exact)[0].tolist() == [3] and held(exact)[2] == 3
    assert held(short)[0].tolist() == [2]
    assert held(may)[0].tolist() == [5] and held(may)[1].tolist() == [5]      # the whole tie: 5 held, 5 taken
    own = o.select_tokens(s, n_kv_heads=1, query_pos=7, w=0, sinks=0, topk=0.01)   # count 0: only j = 7
    assert o.select_tokens_head_counts(own, s, n_kv_heads=1, query_pos=7, w=0, sinks=0, topk=0.01,
                                       margin=0.0)[1:] == (np.array([0]), 0)
    with pytest.raises(ValueError, match="mask"):
        o.select_tokens_head_counts(exact.astype(int), s, margin=0.0, **kw)


@pytest.mark.clause("RET-TOPK")
def test_topk_allowed_and_argmin_allowed():
    s = np.array([5.0, 3.0, 3.0, 1.0])
    must, may = o.topk_allowed(s, 2, 0.0)
    np.testing.assert_array_equal(must, [True, False, False, False])
    np.testing.assert_array_equal(may, [True, True, True, False])
    must, may = o.topk_allowed(s, 2, 2.5)
    np.testing.assert_array_equal(must, [False, False, False, False])
    np.testing.assert_array_equal(may, [True, True, True, True])
    assert o.topk_allowed(s, 4, 0.0)[0].all() and not o.topk_allowed(s, 0, 1.0)[1].any()
    np.testing.assert_array_equal(o.argmin_allowed([1.0, 1.05, 2.0], 0.1), [True, True, False])


def dense_softmax_attention(q, k, v, scale):
    logits = scale * (k @ q)
    p = np.exp(logits - logits.max())
    return (p / p.sum()) @ v


@pytest.mark.clause("RET-ATTN")
@pytest.mark.parametrize("n_q,n_kv", [(3, 3), (6, 2), (4, 1)])
def test_retrieval_attention_full_mask_is_dense_softmax(n_q, n_kv):
    d, T, dv = 8, 17, 5
    r = rng(18)
    q, k, v = r.normal(size=(n_q, d)), r.normal(size=(n_kv, T, d)), r.normal(size=(n_kv, T, dv))
    out = o.retrieval_attention(q, k, v, np.ones((n_kv, T), bool))
    G = n_q // n_kv
    for h in range(n_q):
        np.testing.assert_allclose(out[h], dense_softmax_attention(q[h], k[h // G], v[h // G], 1 / math.sqrt(d)),
                                   atol=1e-12)
    np.testing.assert_allclose(o.prefill_attention(q[:, None], k, v)[:, 0], out, atol=1e-12)
    mask = np.zeros((n_kv, T), bool); mask[:, [0, 5, 16]] = True
    part = o.retrieval_attention(q, k, v, mask, scale=0.3)
    for h in range(n_q):
        g = h // G
        np.testing.assert_allclose(part[h], dense_softmax_attention(q[h], k[g, [0, 5, 16]], v[g, [0, 5, 16]], 0.3),
                                   atol=1e-12)


@pytest.mark.clause("PREFILL")
def test_prefill_is_end_aligned_causal():
    d, Tq, Tk = 4, 3, 7
    r = rng(19)
    q, k, v = r.normal(size=(2, Tq, d)), r.normal(size=(1, Tk, d)), r.normal(size=(1, Tk, 3))
    out = o.prefill_attention(q, k, v)
    for h in range(2):
        for t in range(Tq):
            n = Tk - Tq + t + 1
            np.testing.assert_allclose(out[h, t], dense_softmax_attention(q[h, t], k[0, :n], v[0, :n], 0.5), atol=1e-12)


@pytest.mark.clause("RET-DECODE", "CACHE-DENSE-EQUIV")
def test_decode_step_pipeline_and_dense_equivalence():
    d, n_q, n_kv, T, K = 8, 4, 2, 40, 6
    om = o.rope_inv_freqs(d, 1e4)
    r = rng(20)
    k_pre = r.normal(size=(n_kv, T, d))
    k_post = o.rope_apply(k_pre, np.arange(T), om, traditional=True)
    v = r.normal(size=(n_kv, T, d))
    q_pre = r.normal(size=(n_q, d))
    q_post = o.rope_apply(q_pre, T - 1, om, traditional=True)
    C = r.normal(size=(n_kv, K, d))
    codes = np.stack([o.assign(k_pre[g], C[g], np.eye(d)) for g in range(n_kv)])
    kw = dict(query_pos=T - 1, b=64, w=4, sinks=2, inv_freqs=om, traditional=True)
    out, mask = o.decode_step(q_post, k_post, v, codes, C, topk=0.1, return_mask=True, **kw)
    scores = o.token_scores(o.lut_scores(q_pre @ R_explicit(64, om, True), C), codes)
    np.testing.assert_array_equal(mask, o.select_tokens(scores, n_kv_heads=n_kv, query_pos=T - 1, w=4, sinks=2,
                                                        topk=0.1))
    np.testing.assert_allclose(out, o.retrieval_attention(q_post, k_post, v, mask), atol=1e-12)
    full = o.decode_step(q_post, k_post, v, codes, C, topk=1.0, **kw)
    np.testing.assert_allclose(full, o.prefill_attention(q_post[:, None], k_post, v)[:, 0], atol=1e-12)


@pytest.mark.clause("RET-LUT")
def test_lut_and_token_scores_by_hand():
    q_b = rng(21).normal(size=(4, 6))
    C = rng(22).normal(size=(2, 5, 6))
    lut = o.lut_scores(q_b, C)
    for h in range(4):
        for c in range(5):
            assert abs(lut[h, c] - q_b[h] @ C[h // 2, c] / math.sqrt(6)) < 1e-12
    codes = np.array([[0, 4, 4, 1], [2, 2, 3, 0]], dtype=np.uint16)
    s = o.token_scores(lut, codes)
    for h in range(4):
        for t in range(4):
            assert s[h, t] == lut[h, codes[h // 2, t]]


@pytest.mark.clause("CODES-DTYPE")
def test_code_dtype():
    assert o.code_dtype(1) == np.uint8 and o.code_dtype(256) == np.uint8
    assert o.code_dtype(257) == np.uint16 and o.code_dtype(4096) == np.uint16 and o.code_dtype(65536) == np.uint16
    with pytest.raises(ValueError, match="16-bit"):
        o.code_dtype(65537)


# --------------------------------------------------------------------------- INPUT-ERRORS

OM8 = o.rope_inv_freqs(8, 1e4)


@pytest.mark.parametrize("call,match", [
    (lambda: o.rope_inv_freqs(7, 1e4), "even"),
    (lambda: o.rope_apply(np.ones((2, 7)), 0, OM8, traditional=True), "even"),
    (lambda: o.rope_apply(np.ones((2, 8)), 0, OM8[:3], traditional=True), "inv_freqs"),
    (lambda: o.rope_apply(np.full((2, 8), np.nan), 0, OM8, traditional=True), "non-finite"),
    (lambda: o.rope_apply(np.ones((2, 8)), [1, 2, 3], OM8, traditional=True), "positions"),
    (lambda: o.wrope_scores(np.ones((2, 8)), np.ones((3, 8)), w=-1, b=0, inv_freqs=OM8, traditional=True), "w"),
    (lambda: o.wrope_scores(np.ones((2, 8)), np.ones((3, 8)), w=1, b=-5, inv_freqs=OM8, traditional=True), "b"),
    (lambda: o.wrope_scores(np.ones((2, 8)), np.ones((3, 6)), w=1, b=5, inv_freqs=OM8, traditional=True), "k"),
    (lambda: o.query_moment(np.ones((3, 4, 8)), n_kv_heads=2, b=1, inv_freqs=OM8, traditional=True), "multiple"),
    (lambda: o.query_moment(np.zeros((2, 4, 8)), n_kv_heads=1, b=1, inv_freqs=OM8, traditional=True), "zero"),
    (lambda: o.cholesky(np.array([[1.0, 2.0], [0.0, 1.0]])), "symmetric"),
    (lambda: o.cholesky(np.array([[1.0, 2.0], [2.0, 1.0]])), "positive definite"),
    (lambda: o.assign(np.ones(8), np.ones((4, 2)), np.eye(8)), "head dim"),
    (lambda: o.assign(np.ones(8), np.ones((4, 8)), np.eye(4)), "H"),
    (lambda: o.z_transform(np.ones(2), np.array([[1.0, 1.0], [0.0, 1.0]])), "lower triangular"),
    (lambda: o.back_transform(np.ones((3, 2)), np.array([[1.0, 0.0], [0.0, -1.0]])), "positive"),
    (lambda: o.lut_scores(np.ones((3, 8)), np.ones((2, 4, 8))), "multiple"),
    (lambda: o.token_scores(np.ones((2, 4)), np.array([[0, 4]])), r"\[0, K=4\)"),
    (lambda: o.token_scores(np.ones((2, 4)), np.array([[0.0, 1.0]])), "integer"),
    (lambda: o.select_tokens(np.ones((2, 5)), n_kv_heads=1, query_pos=5, w=1, sinks=0, topk=1), "query_pos"),
    (lambda: o.select_tokens(np.ones((2, 5)), n_kv_heads=1, query_pos=4, w=1, sinks=-1, topk=1), "sinks"),
    (lambda: o.select_tokens(np.ones((2, 5)), n_kv_heads=1, query_pos=4, w=1, sinks=0, topk=1.2), "topk"),
    (lambda: o.retrieval_attention(np.ones((2, 8)), np.ones((1, 3, 8)), np.ones((1, 3, 2)),
                                   np.zeros((1, 3), bool)), "at least one"),
    (lambda: o.retrieval_attention(np.ones((2, 8)), np.ones((1, 3, 8)), np.ones((1, 4, 2)),
                                   np.ones((1, 3), bool)), "v"),
    (lambda: o.prefill_attention(np.ones((1, 4, 8)), np.ones((1, 3, 8)), np.ones((1, 3, 8))), "Tq"),
    (lambda: o.lloyd_step(np.ones((2, 2)), np.ones((3, 2))), "at least K"),
    (lambda: o.kmeans(np.eye(3), 2, seed=0, max_iter=0), "max_iter"),
    (lambda: o.code_dtype(0), "K"),
    (lambda: o.rope_inv_freqs(8, 1e4, {"type": "linear"}), "factor"),
])
@pytest.mark.clause("INPUT-ERRORS")
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- CACHE-* (OracleCache)

def _cache_config(seed=0, *, n_kv=2, G=2, d=8, K=16, batch=None, w=3, sinks=1, topk=0.25, b=64):
    r = rng(seed)
    Cz = r.standard_normal((n_kv, K, d))
    L = np.stack([o.cholesky(np.cov(r.standard_normal((4 * d, d)), rowvar=False) + 0.5 * np.eye(d))
                  for _ in range(n_kv)])
    cfg = dict(n_kv_heads=n_kv, n_q_heads=n_kv * G, head_dim=d, Cz=Cz, L=L, C=o.back_transform(Cz, L),
               inv_freqs=o.rope_inv_freqs(d, 1e4), traditional=False, w=w, b=b, sinks=sinks, topk=topk, scale=None)
    if batch is not None:
        cfg["batch"] = batch
    return cfg


def _post_keys(cfg, r, start, n, lead=()):
    k_pre = r.standard_normal(lead + (cfg["n_kv_heads"], n, cfg["head_dim"]))
    k = o.rope_apply(k_pre, np.arange(start, start + n), cfg["inv_freqs"], traditional=cfg["traditional"])
    return k_pre, k, r.standard_normal(lead + (cfg["n_kv_heads"], n, cfg["head_dim"]))


def test_oracle_cache_is_built_from_the_clause_functions():
    cfg = _cache_config(1)
    r = rng(2)
    c = o.OracleCache(cfg)
    k_pre, k, v = _post_keys(cfg, r, 0, 9)
    c.append(k[:, :4], v[:, :4])
    c.append(k[:, 4:], v[:, 4:])
    assert c.offset == 9 and c.positions().tolist() == list(range(9))
    want = np.stack([o.assign_z(k_pre[g], cfg["Cz"][g], cfg["L"][g]) for g in range(2)])
    assert np.array_equal(c.codes(), want) and c.codes().dtype == np.uint8
    kk, vv = c.keys_values()
    assert np.array_equal(kk, k) and np.array_equal(vv, v)
    q = r.standard_normal((4, 8))
    out, mask = c.decode(q)
    o2, m2 = o.decode_step(q, k, v, want, cfg["C"], query_pos=8, b=64, w=3, sinks=1, topk=0.25,
                           inv_freqs=cfg["inv_freqs"], traditional=False, return_mask=True)
    assert np.array_equal(mask, m2) and np.allclose(out, o2, rtol=0, atol=0)
    must, may = c.decode_allowed(q, c.codes(), 0.0)
    assert np.all(must <= mask) and np.all(mask <= may)
    assert np.array_equal(c.attention(q, mask), out)
    allowed = c.code_allowed(lambda dist: 1e-9 * np.max(dist))
    assert allowed.shape == (2, 9, 16) and np.all(np.take_along_axis(allowed, want[..., None], -1))
    qp = r.standard_normal((4, 5, 8))
    assert np.allclose(c.prefill(qp), o.prefill_attention(qp, k, v))
    assert c.trim(4) == 4 and c.offset == 5 and np.array_equal(c.codes(), want[:, :5])
    assert c.trim(99) == 5 and c.offset == 0 and c.codes().shape == (2, 0)


@pytest.mark.clause("CACHE-SAVE")
def test_oracle_cache_save_load_copy_and_errors(tmp_path):
    cfg = _cache_config(3)
    r = rng(4)
    c = o.OracleCache(cfg)
    _, k, v = _post_keys(cfg, r, 0, 5)
    c.append(k, v)
    c.save(tmp_path / "c")
    back = c.load(tmp_path / "c")
    cp = c.copy()
    for other in (back, cp):
        assert np.array_equal(other.codes(), c.codes()) and np.array_equal(other.keys_values()[0], k)
    cp.trim(2)
    assert c.offset == 5                                     # a copy is independent
    with pytest.raises(ValueError, match="parameters"):
        o.OracleCache(dict(cfg, w=7)).load(tmp_path / "c")
    with pytest.raises(ValueError, match="missing key"):
        o.OracleCache({k: v for k, v in cfg.items() if k != "Cz"})
    with pytest.raises(ValueError, match="no batch axis"):
        c.append(k[None], v[None])
    with pytest.raises(ValueError, match="empty"):
        o.OracleCache(cfg).decode(np.zeros((4, 8)))


@pytest.mark.clause("CACHE-BATCH")
def test_oracle_cache_batch_rows_equal_batch_one_caches():
    cfg = _cache_config(5, batch=3)
    r = rng(6)
    big = o.OracleCache(cfg)
    _, k, v = _post_keys(cfg, r, 0, 12, lead=(3,))
    big.append(k, v)
    q = r.standard_normal((3, 4, 8))
    out, mask = big.decode(q)
    assert out.shape == (3, 4, 8) and mask.shape == (3, 2, 12) and big.codes().shape == (3, 2, 12)
    one = {key: val for key, val in cfg.items() if key != "batch"}
    for row in range(3):
        c = o.OracleCache(one)
        c.append(k[row], v[row])
        o1, m1 = c.decode(q[row])
        assert np.array_equal(m1, mask[row]) and np.array_equal(o1, out[row])
        assert np.array_equal(c.codes(), big.codes()[row])


def test_oracle_cache_agrees_with_the_mlx_cache():
    """The model and a2ats_ref's A2ATSCache (through the reference adapter) hold the same state and
    decode to the same selection (allowed sets) and output, batched and not, across buffer growth."""
    from a2ats_conformance.adapters.reference import ReferenceAdapter

    for batch in (None, 2):
        cfg = _cache_config(7, batch=batch, K=64, topk=0.05)
        lead = () if batch is None else (batch,)
        r = rng(8)
        ref = ReferenceAdapter().make_cache({k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v)
                                             for k, v in cfg.items()})
        orc = o.OracleCache(cfg)
        start = 0
        for n in (200, 100, 1):                              # past the 256-token preallocation
            _, k, v = _post_keys(cfg, r, start, n, lead)
            k, v = k.astype(np.float32), v.astype(np.float32)
            ref.append(k, v)
            orc.append(k, v)
            start += n
        allowed = orc.code_allowed(lambda dist: 1e-4 * np.max(dist))
        assert np.all(np.take_along_axis(allowed, ref.codes()[..., None].astype(np.int64), -1))
        assert np.array_equal(ref.positions(), orc.positions())
        assert np.array_equal(ref.keys_values()[0], orc.keys_values()[0])
        q = o.rope_apply(r.standard_normal(lead + (4, 8)), start - 1, cfg["inv_freqs"], traditional=False)
        q = q.astype(np.float32)
        out, mask = ref.decode(q)
        must, may = orc.decode_allowed(q, ref.codes(), lambda s: 1e-4 * max(1.0, np.max(np.abs(s))))
        assert np.all(must <= mask) and np.all(mask <= may)
        assert np.allclose(out, orc.attention(q, mask), rtol=1e-4, atol=1e-4)
        qp = r.standard_normal(lead + (4, 3, 8)).astype(np.float32)
        assert np.allclose(ref.prefill(qp), orc.prefill(qp), rtol=1e-4, atol=1e-4)


@pytest.mark.clause("RET-SELECT", "RET-TOPK")
@pytest.mark.parametrize("seed", range(6))
def test_highest_and_topk_allowed_rank_as_a_stable_descending_sort(seed):
    """highest and topk_allowed find order statistics by partition: the picks must be a stable descending sort's
    first k (ties to the lowest index, -0.0 equal to 0.0, NaN last), and the allowed sets the sort's."""
    r = rng(seed)
    for _ in range(300):
        n = int(r.integers(1, 40))
        x = r.integers(-2, 3, n).astype(float) if seed % 2 else r.normal(size=n)
        x[r.integers(0, n)] = -0.0
        if seed >= 4:
            x[r.integers(0, n)] = np.nan
        for k in (0, 1, int(r.integers(0, n + 1)), n - 1, n, n + 2):
            np.testing.assert_array_equal(o.highest(x, k), np.sort(np.argsort(-x, kind="stable")[:max(k, 0)]))
        if seed < 4 and n >= 2:
            k, margin = int(r.integers(1, n)), float(r.choice([0.0, 0.5]))
            desc = -np.sort(-x)
            must, may = o.topk_allowed(x, k, margin)
            np.testing.assert_array_equal(must, x > desc[k] + margin)
            np.testing.assert_array_equal(may, x >= desc[k - 1] - margin)
