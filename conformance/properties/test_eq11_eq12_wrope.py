"""EQ-11 (windowed RoPE score) and EQ-12 (far side: pre-RoPE key, R_b on the query)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_spec import oracle


#: b values beyond the tolerance table's bound: float16 overflows past 65504, float32 angles lose ~1e-2 rad.
_LONG_B = (65_536 + 3001, hh.LONG_POSITION - 1)


def far_positions(*, long: bool = True):
    """b: round values configs use, values that float16 (2049, 3001) or bfloat16 (257, 2047, 3001) cannot hold,
    any int up to 4096, and (long) b past float16's range. The round values alone (0, 5, 64, 2048) are exact in
    bfloat16, so a port that rounded b to a half-precision dtype passed every draw."""
    opts = [st.sampled_from([0, 5, 64, 257, 2047, 2048, 2049, 3001]), st.integers(0, hh.MAX_POSITION)]
    return st.one_of(opts + ([st.sampled_from(_LONG_B)] if long else []))


def _case(draw, max_T=10, long_b=True):
    p = draw(hh.rope_params(max_dim=32), label="rope")
    Tq = draw(st.integers(1, max_T), label="Tq")
    Tk = draw(st.integers(1, max_T), label="Tk")
    w = draw(st.integers(0, Tk + 2), label="w")
    b = draw(far_positions(long=long_b), label="b")
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
    ctx.positions_up_to(max(b, pq.max(), pk.max()))
    ctx.check("wrope_scores", q, k, w=w, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"],
              q_positions=pq, k_positions=pk, clause="EQ-11")


@pytest.mark.clause("EQ-11")
@given(data=st.data())
def test_window_boundary(ctx, data):
    """i - j = w - 1 is near (exact RoPE, R_(w-1)); i - j = w and w + 1 are far (R_b). The third key tells an
    inclusive window (w + 1 right) from a far side rotated by R_w or R_(i-j) (w + 1 wrong too)."""
    p = data.draw(hh.rope_params(max_dim=32), label="rope")
    w = data.draw(st.integers(1, 70), label="w")
    b = data.draw(far_positions(), label="b")
    i = data.draw(st.integers(w + 1, 3000), label="i")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    q, k = hh.normal(rng, (1, p["d"])), hh.normal(rng, (3, p["d"]))
    pk = np.array([i - (w - 1), i - w, i - w - 1])
    ctx.note(seed=seed, head_dim=p["d"], w=w, b=b, i=i, k_positions=pk.tolist())
    ctx.positions_up_to(max(b, i))
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
    the near scores are the standard RoPE attention logits. b stays within the tolerance table (4096): the
    recomposition reaches q R_b by two rotations (R_p, then R_(b-p)), so even in float64 its angles round
    differently from the oracle's one rotation, and float64 tolerances do not grow with the position."""
    p, q, k, pq, pk, w, b, seed = _case(data.draw, long_b=False)
    ctx.note(seed=seed, head_dim=p["d"], w=w, b=b, q_positions=pq.tolist(), k_positions=pk.tolist())
    ctx.positions_up_to(max(b, pq.max(), pk.max()))
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
    ctx.positions_up_to(max(b, pq.max()))
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


#: How the far side's positions may come (EQ-12: "positions broadcast against x.shape[:-1]"): an int (decode_step
#: passes query_pos for all n_q heads), one (T,) vector for every leading row, a vector per row, a position per row.
_FAR_POSITION_FORMS = ("scalar", "vector", "per-row", "row-constant")


def _far_positions_of(rng, form: str, lead: tuple, T: int, max_position: int):
    if form == "scalar" or (form in ("per-row", "row-constant") and not lead):
        return int(rng.integers(0, max_position + 1))
    shape = {"vector": (T,), "per-row": lead + (T,), "row-constant": lead + (1,)}[form]
    return rng.integers(0, max_position + 1, size=shape).astype(np.int64)


@pytest.mark.clause("EQ-12")
@given(data=st.data())
def test_far_side_leading_dims_and_position_forms(ctx, data):
    """far_keys and far_query on x (..., T, d) (heads in front, as a cache holds them) with every position form
    EQ-12 allows: an int, a (T,) vector shared by the leading rows, a vector per row, one position per row. Each
    row is de-rotated (far_keys) or moved to b (far_query) at its own position; an int is every row's position,
    not an offset. A fixed case runs in every example: n_q = 3 head rows at one int position (decode's call)."""
    p = data.draw(hh.rope_params(max_dim=32), label="rope")
    lead = data.draw(st.sampled_from([(), (2,), (3,), (2, 3)]), label="lead")
    T = data.draw(st.integers(1, 6), label="T")
    form = data.draw(st.sampled_from(_FAR_POSITION_FORMS), label="position_form")
    b = data.draw(far_positions(long=False), label="b")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    max_position = data.draw(hh.max_positions(), label="max_position")
    pos = _far_positions_of(rng, form, lead, T, max_position)
    x = hh.normal(rng, lead + (T, p["d"]))
    shape = np.shape(pos)
    ctx.note(seed=seed, head_dim=p["d"], traditional=p["traditional"], x_shape=x.shape, position_form=form,
             positions=np.asarray(pos).tolist(), b=b)
    ctx.positions_up_to(max(b, int(np.max(pos))))
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    ctx.check("far_keys", x, pos, clause="EQ-12", **kw,
              what=f"far_keys of k_post {x.shape} at {form} positions of shape {shape} (each row at its own position)")
    ctx.check("far_query", x, b=b, positions=pos, clause="EQ-12", **kw,
              what=f"far_query(positions=...) of q_post {x.shape} at {form} positions of shape {shape}, b={b}")
    ctx.check("far_query", x, b=b, clause="EQ-12", **kw, what=f"far_query of pre-RoPE q {x.shape}, b={b}")
    # The two calls a cache makes, in every example (drawn forms alone miss them in a short run): far_keys of
    # (n_kv, T, d) keys with one (T,) vector of distinct positions, and far_query of the n_q query heads of one
    # token post-RoPE at the int query_pos (every head at it, not query_pos + h).
    i = int(rng.integers(3, 4096))
    pk = np.array([i - 2, i, i - 1])
    k3, q3 = hh.normal(rng, (2, 3, p["d"])), hh.normal(rng, (3, p["d"]))
    ctx.positions_up_to(max(ctx.max_position, i))
    ctx.check("far_keys", k3, pk, clause="EQ-12", **kw,
              what=f"far_keys of k_post (2, 3, d) (2 KV heads) at the (3,) positions {pk.tolist()} shared by both heads")
    ctx.check("far_query", q3, b=b, positions=i, clause="EQ-12", **kw,
              what=f"far_query of 3 query heads (3, d) post-RoPE at the int position {i} (every head at {i}), b={b}")


@pytest.mark.clause("EQ-11")
@given(data=st.data())
def test_wrope_scores_leading_dims_and_default_positions(ctx, data):
    """EQ-11's shapes: q (..., Tq, d) and k (..., Tk, d) with leading dims that broadcast (heads, or one k for every
    q head), output (..., Tq, Tk); and positions left out default to arange(Tq), arange(Tk), the query's too (not
    right-aligned to the keys as in a decode, Tk - Tq + arange(Tq)). Both run in every example."""
    p = data.draw(hh.rope_params(max_dim=32), label="rope")
    lead_q, lead_k = data.draw(st.sampled_from([((2,), (2,)), ((3,), ()), ((), (2,)), ((2, 1), (3,)), ((2, 3), (1, 3))]),
                               label="leads")
    Tq = data.draw(st.integers(1, 6), label="Tq")
    Tk = data.draw(st.integers(1, 8), label="Tk")
    w = data.draw(st.integers(0, 10), label="w")
    b = data.draw(far_positions(long=False), label="b")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    p0 = int(rng.integers(0, 2000))
    pq, pk = p0 + np.sort(rng.integers(0, 12, size=Tq)), p0 + np.sort(rng.integers(0, 12, size=Tk))
    q, k = hh.normal(rng, lead_q + (Tq, p["d"])), hh.normal(rng, lead_k + (Tk, p["d"]))
    ctx.note(seed=seed, head_dim=p["d"], q_shape=q.shape, k_shape=k.shape, w=w, b=b, q_positions=pq.tolist(),
             k_positions=pk.tolist())
    ctx.positions_up_to(max(b, pq.max(), pk.max()))
    kw = dict(w=w, b=b, inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    ctx.check("wrope_scores", q, k, q_positions=pq, k_positions=pk, clause="EQ-11", **kw,
              what=f"wrope_scores of q {q.shape} and k {k.shape} (leading dims broadcast to "
                   f"{np.broadcast_shapes(lead_q, lead_k)}; output (..., Tq, Tk))")
    # defaults: more keys than queries and a window of at least one, so right-aligned query positions change the
    # near scores; b >= 1, since with b = 0 a far score equals the near score at distance 0 and a misplaced window
    # (|i - j| < w, say) would give the same scores as misplaced positions
    q1, k1 = hh.normal(rng, (Tq, p["d"])), hh.normal(rng, (Tq + 1 + Tk, p["d"]))
    kw1 = dict(kw, w=max(w, 1), b=max(b, 1))
    ctx.check("wrope_scores", q1, k1, clause="EQ-11", **kw1,
              what=f"wrope_scores with positions left out, q {q1.shape}, k {k1.shape}, w={kw1['w']}, b={kw1['b']}: queries at "
                   f"arange({Tq}), keys at arange({k1.shape[0]}) (not right-aligned)")
