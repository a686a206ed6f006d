"""EQ-15 (Cholesky), EQ-16 (z-space assignment), EQ-18 (back-transform to key space)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_spec import oracle


def _f64(ctx, x):
    return ctx.cast(x).astype(np.float64)


def _L(ctx, H):
    return oracle.cholesky(_f64(ctx, H))


@pytest.mark.clause("EQ-15")
@given(data=st.data())
def test_cholesky_matches_oracle(ctx, data):
    d = data.draw(hh.head_dims(max_dim=32), label="head_dim")
    batch = data.draw(st.sampled_from([(), (2,)]), label="batch")
    Hs = [data.draw(hh.spd_matrices(d), label=f"H{i}") for i in range(int(np.prod(batch)) if batch else 1)]
    H = np.stack(Hs).reshape(batch + (d, d))
    ctx.note(head_dim=d, batch=batch)
    L, _ = ctx.check("cholesky", H, clause="EQ-15")
    L = np.asarray(L, np.float64)
    ctx.assert_equal(np.triu(L, 1) == 0, np.ones_like(L, bool), clause="EQ-15",
                     what="L lower triangular (zeros above the diagonal; an upper factor U with H = UᵀU, such as "
                          "scipy.linalg.cholesky's default lower=False, is Lᵀ)")
    ctx.assert_equal(np.diagonal(L, axis1=-2, axis2=-1) > 0, np.ones(L.shape[:-1], bool), clause="EQ-15",
                     what="positive diagonal")
    ctx.assert_close(L @ np.swapaxes(L, -1, -2), _f64(ctx, H), clause="EQ-15", what="L Lᵀ vs H",
                     atol=ctx.tol("EQ-15")[1] * max(1.0, float(np.abs(H).max())))


@pytest.mark.clause("EQ-16")
@given(case=hh.codebook_case())
def test_z_transform_matches_oracle(ctx, case):
    ctx.note(seed=case["seed"], head_dim=case["d"])
    ctx.check("z_transform", case["k"], _L(ctx, case["H"]), clause="EQ-16")


@pytest.mark.clause("EQ-16", needs=("z_transform",))
@given(case=hh.codebook_case())
def test_h_weighted_distance_is_z_space_euclidean(ctx, case):
    """Eq. 16-17: (k - c) H (k - c)ᵀ == ‖k L - c L‖², checked against brute force."""
    ctx.note(seed=case["seed"], head_dim=case["d"], edge=case["edge"])
    k, C, H = _f64(ctx, case["k"]), _f64(ctx, case["C"]), _f64(ctx, case["H"])
    L = oracle.cholesky(H)
    zk = np.asarray(ctx.call("z_transform", k, L), np.float64)
    zc = np.asarray(ctx.call("z_transform", C, L), np.float64)
    got = np.sum((zk[:, None, :] - zc[None, :, :]) ** 2, axis=-1)
    diff = k[:, None, :] - C[None, :, :]
    brute = np.einsum("nkd,de,nke->nk", diff, H, diff)
    ctx.assert_close(got, brute, clause="EQ-16", what="‖zk - zc‖² vs (k-c)H(k-c)ᵀ",
                     atol=ctx.tol("EQ-16")[1] * max(1.0, float(brute.max())))


def _check_assign_z(ctx, k, Cz, L, what):
    """assign_z(k, Cz, L) must return an allowed nearest Cz row to k L (near ties: any tied index)."""
    codes = ctx.call("assign_z", k, Cz, L)
    dist = oracle.assign_z_distances(_f64(ctx, k), _f64(ctx, Cz), _f64(ctx, L))
    ctx.assert_in_allowed(codes, oracle.argmin_allowed(dist, ctx.margin("EQ-16", dist)), clause="EQ-16",
                          what=what, values=dist)


@pytest.mark.clause("EQ-16")
@given(case=hh.codebook_case())
def test_assign_z_is_the_eq14_assignment(ctx, case):
    """Runtime assignment (nearest Cz row to k L) is the key-space Eq. 14 assignment with C = Cz L⁻¹."""
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], edge=case["edge"])
    _check_assign_z(ctx, case["k"], case["C"], _L(ctx, case["H"]), "assign_z(k, Cz, L)")


@pytest.mark.clause("EQ-16", needs=("assign_z",))
@given(case=hh.large_codebook_case())
def test_assign_z_large_codebook(ctx, case):
    """K = 256 ... 1000 z-space codewords, keys whose k L sits on codewords of index >= 255: codes come back whole
    (a port that returns uint8 codes, or saturates at 255, is wrong for every K > 256)."""
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], targets=case["targets"].tolist())
    L = _L(ctx, case["H"])
    Cz = case["C"]
    k = oracle.back_transform(case["k"], L)      # k L = the drawn points next to Cz[targets]
    _check_assign_z(ctx, k, Cz, L, f"assign_z(k, Cz, L) with K={case['K']} codewords (codes >= 256 must not wrap "
                    "or saturate)")


@pytest.mark.clause("EQ-18")
@given(case=hh.codebook_case())
def test_back_transform_matches_oracle(ctx, case):
    ctx.note(seed=case["seed"], head_dim=case["d"])
    ctx.check("back_transform", case["C"], _L(ctx, case["H"]), clause="EQ-18")


@pytest.mark.clause("EQ-18", needs=("back_transform",))
@given(case=hh.codebook_case())
def test_back_transform_inverts_z_transform(ctx, case):
    """back_transform(C L, L) == C."""
    ctx.note(seed=case["seed"], head_dim=case["d"])
    L = _L(ctx, case["H"])
    C = _f64(ctx, case["C"])
    got = ctx.call("back_transform", C @ L, L)
    ctx.assert_close(got, C, clause="EQ-18", what="back_transform(C L, L) vs C")


# --------------------------------------------------------------------------- per-head L stacks (n_kv, d, d)
# EQ-16 and EQ-18 take L (..., d, d) as well as one (d, d) matrix: a model calibrates one H, hence one L, per KV
# head. A port that writes the broadcast as L[0], or loops over heads with the wrong index, is right whenever the
# heads share one L, so the heads here get different H's (different spectra and scales).

@st.composite
def _per_head_case(draw):
    """n_kv in {2, 3} different SPD H's -> L (n_kv, d, d); keys (n_kv, T, d) or (B, n_kv, T, d); Cz (n_kv, K, d)."""
    d = draw(hh.head_dims(max_dim=16), label="head_dim")
    n_kv = draw(st.sampled_from([2, 3]), label="n_kv")
    T = draw(st.integers(1, 6), label="T")
    K = draw(st.integers(1, 8), label="K")
    batch = draw(st.sampled_from([(), (2,)]), label="batch")
    seed = draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    scales = (1.0, 4.0, 0.25)
    H = np.stack([scales[h] * hh.spd_matrix(rng, d, cond=float(draw(st.sampled_from([1.0, 10.0, 100.0]),
                                                                      label=f"H{h}_cond")))
                  for h in range(n_kv)])
    return {"d": d, "n_kv": n_kv, "T": T, "K": K, "batch": batch, "seed": seed, "H": H,
            "k": hh.normal(rng, batch + (n_kv, T, d)), "Cz": hh.normal(rng, (n_kv, K, d))}


def _per_head_L(ctx, H):
    return np.stack([_L(ctx, h) for h in H])


@pytest.mark.clause("EQ-16", needs=("z_transform",))
@given(case=_per_head_case())
def test_z_transform_per_head_L(ctx, case):
    """z_transform(k, L) with k (..., n_kv, T, d) and L (n_kv, d, d): head h is k[..., h, :, :] @ L[h]."""
    ctx.note(seed=case["seed"], head_dim=case["d"], n_kv=case["n_kv"], T=case["T"], batch=case["batch"])
    L = _per_head_L(ctx, case["H"])
    ctx.check("z_transform", case["k"], L, clause="EQ-16",
              what=f"z_transform with a per-head L stack {L.shape} and k {case['k'].shape} (head h must use L[h])")


@pytest.mark.clause("EQ-18", needs=("back_transform",))
@given(case=_per_head_case())
def test_back_transform_per_head_L(ctx, case):
    """back_transform(Cz, L) with Cz (n_kv, K, d) and L (n_kv, d, d): head h solves C[h] L[h] = Cz[h]."""
    ctx.note(seed=case["seed"], head_dim=case["d"], n_kv=case["n_kv"], K=case["K"])
    L = _per_head_L(ctx, case["H"])
    ctx.check("back_transform", case["Cz"], L, clause="EQ-18",
              what=f"back_transform with a per-head L stack {L.shape} and Cz {case['Cz'].shape} (head h must use L[h])")


@pytest.mark.clause("EQ-16", needs=("assign_z",))
@given(case=hh.leading_keys_case())
def test_assign_z_leading_dims(ctx, case):
    """assign_z(k, Cz, L) with k (*lead, n, d) (the keys of several heads or sequences at once): codes (*lead, n),
    every row of the leading dims coded on its own. The keys are placed so that k L sits next to Cz[targets]."""
    L = _L(ctx, case["H"])
    Cz = case["C"]
    k = oracle.back_transform(case["k"], L)       # k L = the drawn points next to Cz[targets]
    ctx.note(seed=case["seed"], head_dim=case["d"], K=case["K"], lead=case["lead"], n=case["n"])
    _check_assign_z(ctx, k, Cz, L, f"assign_z(k, Cz, L) with k {k.shape} (codes of shape {k.shape[:-1]}: each row "
                    "of the leading dims codes its own keys)")
