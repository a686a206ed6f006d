"""EQ-10: H = pooled second moment of R_b-rotated pre-RoPE queries, RMS-normalised, plus ridge."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance import hypothesis_helpers as hh


def _case(draw):
    p = draw(hh.rope_params(max_dim=32), label="rope")
    n_q, n_kv = draw(hh.gqa_heads(), label="heads")
    N = draw(st.integers(1, 16), label="N")
    b = draw(st.sampled_from([0, 1, 64, 2048, 4096]), label="b")
    seed = draw(hh.seeds(), label="seed")
    q = hh.normal(hh.rng_from(seed), (n_q, N, p["d"]))
    return p, n_q, n_kv, N, b, seed, q


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_matches_oracle(ctx, data):
    p, n_q, n_kv, N, b, seed, q = _case(data.draw)
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=p["d"], traditional=p["traditional"])
    H, _ = ctx.check("query_moment", q, n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"],
                     traditional=p["traditional"], clause="EQ-10")
    ctx.assert_close(H, np.swapaxes(H, -1, -2), clause="EQ-10", what="H symmetric")


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_pools_the_gqa_group(ctx, data):
    """H of a KV head is a pooled mean over its group: permuting the group's heads leaves it unchanged."""
    p, n_q, n_kv, N, b, seed, q = _case(data.draw)
    G = n_q // n_kv
    perm = np.concatenate([g * G + hh.rng_from(seed + 1).permutation(G) for g in range(n_kv)])
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=p["d"], permutation=perm.tolist())
    kw = dict(n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    H1 = ctx.call("query_moment", q, **kw)
    H2 = ctx.call("query_moment", q[perm], **kw)
    ctx.assert_close(H2, H1, clause="EQ-10", what="H after permuting query heads within each GQA group")
    ctx.assert_close(ctx.call("query_moment", q[:G], **{**kw, "n_kv_heads": 1})[0], H1[0],
                     clause="EQ-10", what="H[0] vs H of group 0's heads alone")


@pytest.mark.clause("EQ-10")
@given(data=st.data())
def test_query_moment_is_rms_normalised(ctx, data):
    p, n_q, n_kv, N, b, seed, q = _case(data.draw)
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, N=N, b=b, head_dim=p["d"])
    H = ctx.call("query_moment", q * 37.0, n_kv_heads=n_kv, b=b, inv_freqs=p["inv_freqs"],
                 traditional=p["traditional"], ridge=0.0)
    rms = np.sqrt(np.mean(np.asarray(H, np.float64) ** 2, axis=(-2, -1)))
    ctx.assert_close(rms, np.ones(n_kv), clause="EQ-10", what="sqrt(mean(H**2)) with ridge=0")
