"""EQ-17-INIT (k-means++ seeding), EQ-17-STEP (one Lloyd step), EQ-17-FIT (full fit), in z-space."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from a2ats_conformance import capabilities
from a2ats_conformance import hypothesis_helpers as hh
from a2ats_spec import oracle


def _distinct(z, K):
    return np.unique(z, axis=0).shape[0] >= K


def _stable_init(z, K, u, eps=1e-6):
    """The oracle's seeding is insensitive to nudging the uniforms (no draw sits on a CDF boundary)."""
    ref = oracle.kmeanspp_init(z, K, u)
    for s in (-eps, eps):
        if not np.array_equal(oracle.kmeanspp_init(z, K, np.clip(u + s, 0, 1 - 1e-12)), ref):
            return False
    return True


@pytest.mark.clause("EQ-17-INIT", requires={"randomness": "explicit"})
@given(case=hh.kmeans_points(), useed=hh.seeds())
def test_kmeanspp_init_matches_oracle(ctx, case, useed):
    z = ctx.cast(case["z"]).astype(np.float64)
    K = case["K"]
    assume(_distinct(z, K))
    u = hh.rng_from(useed).random(K)
    assume(_stable_init(z, K, ctx.cast(u, param=True).astype(np.float64)))
    ctx.note(seed=case["seed"], uniforms_seed=useed, N=case["N"], K=K, d=case["d"])
    ctx.check("kmeanspp_init", case["z"], K, uniforms=u, clause="EQ-17-INIT")


def _lloyd_case(draw):
    case = draw(hh.kmeans_points(), label="points")
    K = case["K"]
    kind = draw(st.sampled_from(["from_points", "random", "with_far_centres"]), label="C_kind")
    rng = hh.rng_from(case["seed"] + 7)
    z = case["z"]
    if kind == "from_points":
        C = z[rng.choice(z.shape[0], K, replace=False)]
    else:
        C = hh.normal(rng, (K, z.shape[1]))
        if kind == "with_far_centres":
            C[K // 2:] += 100.0          # far centres end up empty: exercises the empty-cluster rule
    return case, C, kind


def _unambiguous(z, C, margin):
    """No point is near-tied between two centres, and errors are distinct (the empty-cluster rule ranks them)."""
    dist = np.sum((z[:, None, :] - C[None, :, :]) ** 2, axis=-1)
    srt = np.sort(dist, axis=1)
    if C.shape[0] > 1 and np.any(srt[:, 1] - srt[:, 0] <= margin):
        return False
    err = np.sort(srt[:, 0])
    return not np.any(np.diff(err) <= margin)


@pytest.mark.clause("EQ-17-STEP")
@given(data=st.data())
def test_lloyd_step_matches_oracle(ctx, data):
    case, C, kind = _lloyd_case(data.draw)
    z64, C64 = ctx.cast(case["z"]).astype(float), ctx.cast(C).astype(float)
    assume(_unambiguous(z64, C64, ctx.margin("EQ-17-STEP", z64 @ z64.T)))
    ctx.note(seed=case["seed"], N=case["N"], K=case["K"], d=case["d"], C_kind=kind)
    ctx.check("lloyd_step", case["z"], C, clause="EQ-17-STEP")


@pytest.mark.clause("EQ-17-STEP", needs=("lloyd_step",))
@given(data=st.data())
def test_lloyd_objective_never_increases(ctx, data):
    case, C, kind = _lloyd_case(data.draw)
    ctx.note(seed=case["seed"], N=case["N"], K=case["K"], d=case["d"], C_kind=kind)
    C1, codes, f0 = ctx.call("lloyd_step", case["z"], C)
    _, _, f1 = ctx.call("lloyd_step", case["z"], np.asarray(C1, np.float64))
    r, a = ctx.tol("EQ-17-STEP")
    if not float(f1) <= float(f0) * (1 + r) + a:
        ctx.fail("EQ-17-STEP", "k-means objective increased after a Lloyd step", f"f0={float(f0)!r}, f1={float(f1)!r}")
    counts = np.bincount(np.asarray(codes).astype(np.int64), minlength=case["K"])
    ctx.assert_equal(counts.shape, (case["K"],), clause="EQ-17-STEP", what="codes index the K input centres")


@pytest.mark.clause("EQ-17-FIT")
@given(case=hh.kmeans_points(max_N=30))
def test_kmeans_fit(ctx, case):
    """History never increases; codes are nearest rows of the returned C; on well-separated data the
    fit reaches the oracle's objective."""
    z = ctx.cast(case["z"]).astype(np.float64)
    K = case["K"]
    assume(_distinct(z, K))
    seed = case["seed"] % 1000
    ctx.note(seed=case["seed"], fit_seed=seed, N=case["N"], K=K, d=case["d"], clustered=case["clustered"])
    C, codes, hist = ctx.call("kmeans", case["z"], K, seed=seed)
    explicit = capabilities.current().randomness == "explicit"   # "own": the oracle's stream says nothing
    hist = np.asarray(hist, np.float64)
    r, a = ctx.tol("EQ-17-FIT")
    if np.any(np.diff(hist) > r * np.abs(hist[:-1]) + a):
        ctx.fail("EQ-17-FIT", "objective history increases", f"history {hist.tolist()}")
    dist = np.sum((z[:, None, :] - np.asarray(C, np.float64)[None, :, :]) ** 2, axis=-1)
    ctx.assert_in_allowed(codes, oracle.argmin_allowed(dist, ctx.margin("EQ-17-FIT", dist)), clause="EQ-17-FIT",
                          what="kmeans codes vs nearest row of the returned C", values=dist)
    if explicit and case["clustered"] and _stable_init(z, K, np.random.default_rng(seed).random(K)):
        _, _, ohist = ctx.oracle("kmeans", case["z"], K, seed=seed)
        ctx.assert_close(hist[0], ohist[0], clause="EQ-17-FIT", what="objective of the first step (seeded init)")
