"""EQ-11 (windowed RoPE score) and EQ-12 (far side: pre-RoPE key, R_b on the query)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance import hypothesis_helpers as hh
from a2ats_spec import oracle


def _case(draw, max_T=10):
    p = draw(hh.rope_params(max_dim=32), label="rope")
    Tq = draw(st.integers(1, max_T), label="Tq")
    Tk = draw(st.integers(1, max_T), label="Tk")
    w = draw(st.integers(0, Tk + 2), label="w")
    b = draw(st.sampled_from([0, 5, 64, 2048]), label="b")
    seed = draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    q, k = hh.normal(rng, (Tq, p["d"])), hh.normal(rng, (Tk, p["d"]))
    p0 = draw(st.integers(0, 2000), label="p0")
    pq = p0 + np.sort(rng.integers(0, 2 * max_T, size=Tq))
    pk = p0 + np.sort(rng.integers(0, 2 * max_T, size=Tk))
    return p, q, k, pq, pk, w, b, seed


@pytest.mark.clause("EQ-11")
@given(data=st.data())
def test_wrope_scores_match_oracle(ctx, data):
    p, q, k, pq, pk, w, b, seed = _case(data.draw)
    ctx.note(seed=seed, head_dim=p["d"], w=w, b=b, q_positions=pq.tolist(), k_positions=pk.tolist())
    ctx.check("wrope_scores", q, k, w=w, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"],
              q_positions=pq, k_positions=pk, clause="EQ-11")


@pytest.mark.clause("EQ-11")
@given(data=st.data())
def test_window_boundary(ctx, data):
    """i - j = w - 1 is near (exact RoPE, R_(w-1)); i - j = w and w + 1 are far (R_b). The third key tells an
    inclusive window (w + 1 right) from a far side rotated by R_w or R_(i-j) (w + 1 wrong too)."""
    p = data.draw(hh.rope_params(max_dim=32), label="rope")
    w = data.draw(st.integers(1, 70), label="w")
    b = data.draw(st.sampled_from([0, 5, 2048]), label="b")
    i = data.draw(st.integers(w + 1, 3000), label="i")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    q, k = hh.normal(rng, (1, p["d"])), hh.normal(rng, (3, p["d"]))
    pk = np.array([i - (w - 1), i - w, i - w - 1])
    ctx.note(seed=seed, head_dim=p["d"], w=w, b=b, i=i, k_positions=pk.tolist())
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    u = ctx.call("wrope_scores", q, k, w=w, b=b, q_positions=np.array([i]), k_positions=pk, **kw)
    qc, kc, inv = ctx.cast(q).astype(float), ctx.cast(k).astype(float), ctx.cast(p["inv_freqs"], param=True).astype(float)
    t = p["traditional"]
    near = float(np.sum(oracle.rope_apply(qc[0], i, inv, traditional=t) * oracle.rope_apply(kc[0], i - (w - 1), inv, traditional=t)))
    far = [float(np.sum(oracle.rope_apply(qc[0], b, inv, traditional=t) * kc[n])) for n in (1, 2)]
    ctx.assert_close(np.asarray(u).reshape(-1), np.array([near] + far), clause="EQ-11",
                     what="[u at i-j=w-1 (must be exact RoPE), u at i-j=w and w+1 (must be q R_b k)]")


@pytest.mark.clause("EQ-11", "EQ-12", needs=("rope_apply", "far_query", "far_keys", "wrope_scores"))
@given(data=st.data())
def test_eq11_recomposition(ctx, data):
    """Far query R_b x far keys, with exact-RoPE near scores, recomposes u_ij as the oracle computes it;
    the near scores are the standard RoPE attention logits."""
    p, q, k, pq, pk, w, b, seed = _case(data.draw)
    ctx.note(seed=seed, head_dim=p["d"], w=w, b=b, q_positions=pq.tolist(), k_positions=pk.tolist())
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    q_post = ctx.call("rope_apply", q, pq, **kw)
    k_post = ctx.call("rope_apply", k, pk, **kw)
    logits = np.asarray(q_post, np.float64) @ np.asarray(k_post, np.float64).T      # standard RoPE logits
    far = np.asarray(ctx.call("far_query", q_post, b=b, positions=pq, **kw), np.float64) @ \
        np.asarray(ctx.call("far_keys", k_post, pk, **kw), np.float64).T
    near = (pq[:, None] - pk[None, :]) < w
    u = ctx.call("wrope_scores", q, k, w=w, b=b, q_positions=pq, k_positions=pk, **kw)
    expected = ctx.oracle("wrope_scores", q, k, w=w, b=b, q_positions=pq, k_positions=pk, **kw)
    ctx.assert_close(np.where(near, logits, far), expected, clause="EQ-12",
                     what="recomposed u (near: RoPE logits, far: far_query . far_keys) vs oracle EQ-11")
    ctx.assert_close(np.where(near, u, 0.0), np.where(near, logits, 0.0), clause="EQ-11",
                     what="near scores vs standard RoPE attention logits")


@pytest.mark.clause("EQ-12")
@given(data=st.data())
def test_far_keys_match_oracle(ctx, data):
    p, q, k, pq, pk, w, b, seed = _case(data.draw)
    ctx.note(seed=seed, head_dim=p["d"], k_positions=pk.tolist())
    ctx.check("far_keys", k, pk, p["inv_freqs"], traditional=p["traditional"], clause="EQ-12")


@pytest.mark.clause("EQ-12")
@given(data=st.data(), post=st.booleans())
def test_far_query_matches_oracle(ctx, data, post):
    p, q, k, pq, pk, w, b, seed = _case(data.draw)
    ctx.note(seed=seed, head_dim=p["d"], b=b, positions=pq.tolist() if post else None)
    ctx.check("far_query", q, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"],
              positions=pq if post else None, clause="EQ-12")


@pytest.mark.clause("EQ-12", "EQ-16", needs=("far_keys", "assign_z"))
@given(data=st.data())
def test_far_keys_and_codes_are_position_free(ctx, data):
    """A token's far key and its code do not depend on its absolute position: shifting every position
    by s leaves far keys equal (to the pre-RoPE key) and codes identical (up to oracle near-ties)."""
    p = data.draw(hh.rope_params(max_dim=32), label="rope")
    T = data.draw(st.integers(1, 8), label="T")
    K = data.draw(st.integers(1, 16), label="K")
    pos = data.draw(hh.positions(T), label="positions")
    s = data.draw(st.integers(1, 4096 - int(pos.max()) if pos.max() < 4096 else 1), label="shift")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    d = p["d"]
    k_pre, Cz = hh.normal(rng, (T, d)), hh.normal(rng, (K, d))
    L = oracle.cholesky(hh.spd_matrix(rng, d, cond=10.0))
    ctx.note(seed=seed, head_dim=d, T=T, K=K, positions=pos.tolist(), shift=s)
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    inv = ctx.cast(p["inv_freqs"], param=True).astype(np.float64)
    k_pre = ctx.cast(k_pre).astype(np.float64)
    post1 = oracle.rope_apply(k_pre, pos, inv, traditional=p["traditional"])
    post2 = oracle.rope_apply(k_pre, pos + s, inv, traditional=p["traditional"])
    f1 = ctx.call("far_keys", post1, pos, **kw)
    f2 = ctx.call("far_keys", post2, pos + s, **kw)
    ctx.assert_close(f1, k_pre, clause="EQ-12", what="far key at positions p vs the pre-RoPE key")
    ctx.assert_close(f2, k_pre, clause="EQ-12", what="far key at positions p+s vs the pre-RoPE key")
    c1 = ctx.call("assign_z", f1, Cz, L)
    c2 = ctx.call("assign_z", f2, Cz, L)
    dist = oracle.assign_z_distances(k_pre, ctx.cast(Cz).astype(float), ctx.cast(L).astype(float))
    allowed = oracle.argmin_allowed(dist, ctx.margin("EQ-16", dist))
    ctx.assert_in_allowed(c1, allowed, clause="EQ-16", what="codes at positions p", values=dist)
    ctx.assert_in_allowed(c2, allowed, clause="EQ-16", what="codes at positions p+s", values=dist)
    unique = allowed.sum(-1) == 1
    ctx.assert_equal(np.asarray(c1)[unique], np.asarray(c2)[unique], clause="EQ-12",
                     what="codes (no near tie) at p vs p+s")
