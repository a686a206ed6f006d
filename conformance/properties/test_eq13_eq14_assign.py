"""EQ-13 (score error = H-weighted quadratic form) and EQ-14 (query-aware assignment)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_spec import oracle


def _f64(ctx, x):
    return ctx.cast(x).astype(np.float64)


@pytest.mark.clause("EQ-13")
@given(case=hh.codebook_case())
def test_score_error_matches_oracle(ctx, case):
    ctx.note(seed=case["seed"], head_dim=case["d"], edge=case["edge"])
    k, C, H = case["k"], case["C"], case["H"]
    c = C[np.arange(k.shape[0]) % C.shape[0]]
    ctx.check("score_error", k, c, H, clause="EQ-13")


@pytest.mark.clause("EQ-13")
@given(data=st.data())
def test_score_error_is_expected_squared_score_error(ctx, data):
    """With H = mean over a query set of qᵀq, (k-c)H(k-c)ᵀ = mean_q (q kᵀ - q cᵀ)² (brute force)."""
    d = data.draw(hh.head_dims(max_dim=32), label="head_dim")
    M = data.draw(st.integers(1, 64), label="n_queries")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    Q = hh.normal(rng, (M, d)) * np.exp(rng.uniform(-1, 1, size=d))   # anisotropic queries
    k, c = hh.normal(rng, (3, d)), hh.normal(rng, (3, d))
    ctx.note(seed=seed, head_dim=d, n_queries=M)
    Qc = _f64(ctx, Q)
    H = Qc.T @ Qc / M
    got = ctx.call("score_error", k, c, H)
    diff = _f64(ctx, k) - _f64(ctx, c)
    brute = np.mean((diff @ Qc.T) ** 2, axis=-1)
    # H reaches the IUT rounded to the dtype under test, brute force uses the unrounded queries: the form's error is
    # up to |k - c|² · max|H| times the rounding, however small the form itself is (a rank-1 H cancels)
    terms = float(np.sum(diff ** 2, axis=-1).max() * np.abs(H).max())
    ctx.assert_close(got, brute, clause="EQ-13", what="score_error vs brute-force mean squared score error",
                     atol=ctx.tol("EQ-13")[1] * max(1.0, terms))


def _check_assign(ctx, k, C, H, what):
    """assign(k, C, H) must return an allowed argmin_j (k - c_j) H (k - c_j)ᵀ (near ties: any tied index)."""
    codes = ctx.call("assign", k, C, H)
    dist = oracle.assign_distances(_f64(ctx, k), _f64(ctx, C), _f64(ctx, H))
    ctx.assert_in_allowed(codes, oracle.argmin_allowed(dist, ctx.margin("EQ-14", dist)), clause="EQ-14",
                          what=what, values=dist)


@pytest.mark.clause("EQ-14")
@given(case=hh.codebook_case())
def test_assign_is_an_allowed_argmin(ctx, case):
    """Codes must be argmin_j (k - c_j) H (k - c_j)ᵀ; near ties (oracle margin) allow any tied index."""
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], edge=case["edge"])
    _check_assign(ctx, case["k"], case["C"], case["H"], "assign(k, C, H)")


@pytest.mark.clause("EQ-14")
@given(case=hh.large_codebook_case())
def test_assign_large_codebook(ctx, case):
    """K = 256 ... 1000 (the authors' 4096-entry codebooks need codes past uint8): codes >= 256 come back whole."""
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], targets=case["targets"].tolist())
    _check_assign(ctx, case["k"], case["C"], case["H"],
                  f"assign(k, C, H) with K={case['K']} codewords (codes >= 256 must not wrap or saturate)")


@pytest.mark.clause("EQ-14")
@given(case=hh.codebook_case(), c=st.sampled_from([1e-3, 0.5, 1.0, 7.0, 1e3]))
def test_assign_with_isotropic_H_is_nearest_centroid(ctx, case, c):
    """H = cI (any c > 0) reduces Eq. 14 to plain nearest-centroid assignment."""
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], edge=case["edge"], c=c)
    H = c * np.eye(case["d"])
    codes = ctx.call("assign", case["k"], case["C"], H)
    k, C = _f64(ctx, case["k"]), _f64(ctx, case["C"])
    eucl = np.sum((k[:, None, :] - C[None, :, :]) ** 2, axis=-1)
    ctx.assert_in_allowed(codes, oracle.argmin_allowed(eucl, ctx.margin("EQ-14", eucl)), clause="EQ-14",
                          what="assign with H = cI vs nearest centroid", values=eucl)


@pytest.mark.clause("EQ-14")
@given(d=hh.head_dims(), a=st.floats(0.5, 2.0), ratio=st.floats(1.2, 3.0), aniso=st.floats(4.0, 100.0),
       axes=st.sampled_from([(0, 1), (1, 0)]))
def test_assign_with_anisotropic_H_differs_from_nearest(ctx, d, a, ratio, aniso, axes):
    """Constructed case: k = 0, c_0 = a e_p, c_1 = (ratio a) e_q. Euclidean picks c_0, but with
    H = diag(h) weighting axis p by aniso * ratio² and axis q by 1, Eq. 14 must pick c_1."""
    if d < 2:
        return
    p, q = axes
    k = np.zeros((1, d))
    C = np.zeros((2, d))
    C[0, p], C[1, q] = a, ratio * a
    h = np.ones(d)
    h[p] = aniso * ratio**2
    H = np.diag(h)
    ctx.note(head_dim=d, a=a, ratio=ratio, aniso=aniso, axes=axes)
    codes = ctx.call("assign", k, C, H)
    ctx.assert_equal(np.asarray(codes).astype(np.int64), np.array([1]), clause="EQ-14",
                     what="anisotropic H: assign must pick c_1 (plain nearest-centroid would pick c_0)")


# --------------------------------------------------------------------------- keys with leading dims
# EQ-13 and EQ-14 take k (..., d): a model codes keys (n_kv, T, d) or (B, n_kv, T, d) at once. A port that reshapes
# k to (-1, d) and never restores the shape, or loops over the first row only, is right for every (n, d) input.

@pytest.mark.clause("EQ-13")
@given(case=hh.leading_keys_case(), c_shape=st.sampled_from(["like_k", "one_codeword", "per_key"]))
def test_score_error_leading_dims(ctx, case, c_shape):
    """score_error(k, c, H) with k (*lead, n, d) and c of k's shape, (d,) or (n, d) (broadcasting against k):
    output (*lead, n), each entry (k - c) H (k - c)ᵀ of its own key."""
    k, C = case["k"], case["C"]
    c = {"like_k": C[(case["targets"] + 1) % case["K"]], "one_codeword": C[0], "per_key": C[np.arange(case["n"]) % case["K"]]}[c_shape]
    ctx.note(seed=case["seed"], head_dim=case["d"], lead=case["lead"], n=case["n"], c_shape=c_shape)
    ctx.check("score_error", k, c, case["H"], clause="EQ-13",
              what=f"score_error with k {k.shape} and c {c.shape} (output k.shape[:-1] = {k.shape[:-1]}, one "
                   "error per key of every row)")


@pytest.mark.clause("EQ-14")
@given(case=hh.leading_keys_case())
def test_assign_leading_dims(ctx, case):
    """assign(k, C, H) with k (*lead, n, d): codes (*lead, n), every row of the leading dims coded on its own."""
    k = case["k"]
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], lead=case["lead"], n=case["n"])
    _check_assign(ctx, k, case["C"], case["H"], f"assign(k, C, H) with k {k.shape} (codes of shape {k.shape[:-1]}: "
                  "each row of the leading dims codes its own keys)")
