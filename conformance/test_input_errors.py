"""INPUT-ERRORS: every precondition failure is a ValueError (checked per callable)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance import capabilities
from a2ats_conformance import hypothesis_helpers as hh
from a2ats_spec import oracle

_INV8 = oracle.rope_inv_freqs(8, 10000.0)


def _layout() -> bool:
    """A RoPE layout the IUT declares (capabilities): an error must come from the bad input, not the layout."""
    return capabilities.current().traditional_values[0]


def _bad_value():
    return st.sampled_from([np.nan, np.inf, -np.inf])


@pytest.mark.clause("INPUT-ERRORS", needs=("rope_apply",))
@given(d=st.sampled_from([1, 3, 5, 7, 63]), seed=hh.seeds())
def test_odd_head_dim(ctx, d, seed):
    ctx.note(head_dim=d, seed=seed)
    x = hh.normal(hh.rng_from(seed), (3, d))
    ctx.expect_value_error("rope_apply", x, np.arange(3), np.ones(d // 2 + 1), traditional=_layout(),
                           what=f"odd head_dim {d}")


@pytest.mark.clause("INPUT-ERRORS", needs=("rope_inv_freqs",))
@given(d=st.sampled_from([1, 3, 9, 0, -2]))
def test_odd_head_dim_inv_freqs(ctx, d):
    ctx.note(head_dim=d)
    ctx.expect_value_error("rope_inv_freqs", d, 10000.0, None, what=f"head_dim {d}")


@pytest.mark.clause("INPUT-ERRORS", needs=("rope_apply",))
@given(bad=_bad_value(), seed=hh.seeds())
def test_non_finite_rope_input(ctx, bad, seed):
    x = hh.normal(hh.rng_from(seed), (4, 8))
    x[1, 3] = bad
    ctx.note(bad=str(bad), seed=seed)
    ctx.expect_value_error("rope_apply", x, np.arange(4), _INV8, traditional=_layout(), what=f"x containing {bad}")


@pytest.mark.clause("INPUT-ERRORS", needs=("assign",))
@given(bad=_bad_value(), seed=hh.seeds(), where=st.sampled_from(["k", "C", "H"]))
def test_non_finite_assign_input(ctx, bad, seed, where):
    rng = hh.rng_from(seed)
    a = {"k": hh.normal(rng, (2, 8)), "C": hh.normal(rng, (5, 8)), "H": np.eye(8)}
    a[where][0, 0] = bad
    ctx.note(bad=str(bad), seed=seed, where=where)
    ctx.expect_value_error("assign", a["k"], a["C"], a["H"], what=f"{where} containing {bad}")


@pytest.mark.clause("INPUT-ERRORS", needs=("cholesky",))
@given(seed=hh.seeds(), d=st.sampled_from([2, 4, 8]), kind=st.sampled_from(["negative", "zero", "asymmetric"]))
def test_non_pd_H(ctx, seed, d, kind):
    rng = hh.rng_from(seed)
    H = hh.spd_matrix(rng, d, cond=10.0)
    if kind == "negative":
        Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
        ev = np.abs(rng.standard_normal(d)) + 0.5
        ev[0] = -1.0
        H = (Q * ev) @ Q.T
        H = (H + H.T) / 2
    elif kind == "zero":
        H = np.zeros((d, d))
    else:
        H[0, 1] += 1.0
    ctx.note(seed=seed, head_dim=d, kind=kind)
    ctx.expect_value_error("cholesky", H, what=f"{kind} H (not symmetric positive definite)")


@pytest.mark.clause("INPUT-ERRORS", needs=("assign",))
@given(seed=hh.seeds(), extra=st.sampled_from([-2, 2, 4]))
def test_codebook_width_mismatch(ctx, seed, extra):
    rng = hh.rng_from(seed)
    ctx.note(seed=seed, codebook_width=8 + extra)
    ctx.expect_value_error("assign", hh.normal(rng, (2, 8)), hh.normal(rng, (4, 8 + extra)), np.eye(8),
                           what=f"codebook width {8 + extra} != head_dim 8")


@pytest.mark.clause("INPUT-ERRORS", needs=("wrope_scores",))
@given(seed=hh.seeds(), which=st.sampled_from(["w", "b"]), value=st.integers(-100, -1))
def test_negative_w_or_b(ctx, seed, which, value):
    rng = hh.rng_from(seed)
    kw = {"w": 4, "b": 64, which: value}
    ctx.note(seed=seed, **kw)
    ctx.expect_value_error("wrope_scores", hh.normal(rng, (3, 8)), hh.normal(rng, (5, 8)), inv_freqs=_INV8,
                           traditional=_layout(), what=f"negative {which}={value}", **kw)
