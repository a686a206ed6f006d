"""EQ-10: H = pooled second moment of R_b-rotated pre-RoPE queries, RMS-normalised, plus ridge."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_conformance.harness.tolerances import query_moment_atol

#: The spec's default ridge (EQ-10, Symbols).
DEFAULT_RIDGE = 1e-6
#: Ridges the properties pass: None = the argument left out (the default 1e-6); 0.1 and 1.0 are far above
#: EQ-10's float32 tolerance, so a ridge that is ignored, scaled or added before the normalisation shows.
RIDGES = (None, 0.0, 1e-6, 0.1, 1.0)


def _ridge_kw(ridge):
    return {} if ridge is None else {"ridge": ridge}


def far_positions():
    """b: round values configs use, values that float16 (2049, 3001, 4095) or bfloat16 (257, 2047, 3001) cannot hold,
    or any int up to the tolerance table's bound 4096. The round values alone (0, 1, 64, 2048, 4096) are exact in
    bfloat16, so a port that rounded b to a half-precision dtype passed every draw."""
    return st.one_of(st.sampled_from([0, 1, 64, 257, 2047, 2048, 2049, 3001, 4095, 4096]),
                     st.integers(0, hh.MAX_POSITION))


def _case(draw, *, ridges=RIDGES, max_N=16):
    p = draw(hh.rope_params(max_dim=32), label="rope")
    n_q, n_kv = draw(hh.gqa_heads(), label="heads")
    N = draw(st.integers(1, max_N), label="N")
    b = draw(far_positions(), label="b")
    ridge = draw(st.sampled_from(ridges), label="ridge")
    seed = draw(hh.seeds(), label="seed")
    q = hh.normal(hh.rng_from(seed), (n_q, N, p["d"]))
    return p, n_q, n_kv, N, b, ridge, seed, q


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_matches_oracle(ctx, data):
    p, n_q, n_kv, N, b, ridge, seed, q = _case(data.draw)
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=p["d"], traditional=p["traditional"],
             ridge="default (1e-6)" if ridge is None else ridge)
    kw = dict(n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"], **_ridge_kw(ridge))
    H = ctx.call("query_moment", q, **kw)
    expected = ctx.oracle("query_moment", q, **kw)
    r, a = ctx.tol("EQ-10")
    # the float32 rotation by R_b: its error grows with b and with H's entries (tolerances.query_moment_atol)
    rot = query_moment_atol(expected, b=b, inv_freqs=ctx.cast(p["inv_freqs"], param=True),
                            traditional=p["traditional"], ridge=DEFAULT_RIDGE if ridge is None else ridge)
    ctx.assert_close(H, expected, clause="EQ-10", atol=a + (0.0 if ctx.dtype == "float64" else rot),
                     what=f"query_moment with ridge={'default' if ridge is None else ridge!r}")
    ctx.assert_close(H, np.swapaxes(H, -1, -2), clause="EQ-10", what="H symmetric")


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_pools_the_gqa_group(ctx, data):
    """H of a KV head is a pooled mean over its group: permuting the group's heads leaves it unchanged."""
    p, n_q, n_kv, N, b, ridge, seed, q = _case(data.draw)
    G = n_q // n_kv
    perm = np.concatenate([g * G + hh.rng_from(seed + 1).permutation(G) for g in range(n_kv)])
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=p["d"], permutation=perm.tolist(), ridge=ridge)
    kw = dict(n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"], **_ridge_kw(ridge))
    H1 = ctx.call("query_moment", q, **kw)
    H2 = ctx.call("query_moment", q[perm], **kw)
    ctx.assert_close(H2, H1, clause="EQ-10", what="H after permuting query heads within each GQA group")
    ctx.assert_close(ctx.call("query_moment", q[:G], **{**kw, "n_kv_heads": 1})[0], H1[0],
                     clause="EQ-10", what="H[0] vs H of group 0's heads alone")


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_is_rms_normalised(ctx, data):
    """EQ-10 normalises first and adds ridge·I after: H − ridge·I has RMS 1, whatever the queries' scale."""
    p, n_q, n_kv, N, b, ridge, seed, q = _case(data.draw)
    r = DEFAULT_RIDGE if ridge is None else ridge
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=p["d"], ridge=ridge, queries_scaled_by=37.0)
    H = ctx.call("query_moment", q * 37.0, n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"],
                 traditional=p["traditional"], **_ridge_kw(ridge))
    H0 = np.asarray(H, np.float64) - r * np.eye(p["d"])
    rms = np.sqrt(np.mean(H0 ** 2, axis=(-2, -1)))
    ctx.assert_close(rms, np.ones(n_kv), clause="EQ-10",
                     what=f"sqrt(mean((H - ridge*I)**2)) with ridge={'default 1e-6' if ridge is None else ridge!r} "
                          "(the ridge is added after the RMS normalisation)")


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_ridge_makes_h_positive_definite(ctx, data):
    """EQ-10: H is positive definite whenever ridge > 0. With fewer pooled queries (G·N) than dimensions, the
    normalised moment is singular, so the smallest eigenvalue of H is the ridge itself."""
    p, n_q, n_kv, N, b, ridge, seed, q = _case(data.draw, ridges=(0.1, 1.0), max_N=4)
    d, G = p["d"], n_q // n_kv
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=d, ridge=ridge, pooled_queries=G * N)
    H = np.asarray(ctx.call("query_moment", q, n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"],
                            traditional=p["traditional"], ridge=ridge), np.float64)
    lam = np.linalg.eigvalsh((H + np.swapaxes(H, -1, -2)) / 2)[..., 0]
    r, a = ctx.tol("EQ-10")
    # Weyl: an eigenvalue moves by at most ||E||_2 <= ||E||_F <= d * max|E_ij|, E within EQ-10's entry tolerance
    tol = d * (a + r * float(np.max(np.abs(H))))
    g = int(np.argmin(lam - ridge))
    if lam[g] < ridge - tol:
        ctx.fail("EQ-10", f"with ridge={ridge!r}, H's smallest eigenvalue is below the ridge: H must be the "
                 "RMS-normalised moment (positive semidefinite) plus ridge*I, positive definite",
                 f"KV head {g}: smallest eigenvalue {lam[g]!r} < ridge - {tol:.3g} (head_dim {d}, "
                 f"{G * N} pooled queries)")
    if G * N < d:    # singular moment: the smallest eigenvalue is exactly the ridge
        g = int(np.argmax(np.abs(lam - ridge)))
        if abs(lam[g] - ridge) > tol:
            ctx.fail("EQ-10", f"with ridge={ridge!r} and {G * N} pooled queries < head_dim {d}, H's smallest "
                     "eigenvalue must equal the ridge (the normalised moment is singular; ridge*I is added to it)",
                     f"KV head {g}: smallest eigenvalue {lam[g]!r}, |diff| > {tol:.3g}")
