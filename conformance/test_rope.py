"""ROPE-FREQ, ROPE-APPLY, ROPE-INVERSE."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from a2ats_conformance import hypothesis_helpers as hh
from a2ats_spec import oracle


def _llama3_example(d, base, type_key, **given):
    """Llama-3.1's rope_scaling with only ``given`` of the optional keys (the rest read from the spec's defaults)."""
    scaling = dict(hh.rope_scaling_dict("llama3", type_key), factor=8.0, **given)
    return {"d": d, "base": base, "scaling": scaling, "traditional": False,
            "inv_freqs": oracle.rope_inv_freqs(d, base, scaling)}


@pytest.mark.clause("ROPE-FREQ")
@given(p=hh.rope_params())
@example(p=_llama3_example(64, 500000.0, "rope_type"))   # every optional key left to its default (1, 4, 8192)
@example(p=_llama3_example(64, 10000.0, "type", low_freq_factor=1.0, high_freq_factor=4.0))   # L0 = 8192
@example(p=_llama3_example(32, 500000.0, "both", original_max_position_embeddings=8192))      # 1 and 4
def test_inv_freqs_match_oracle(ctx, p):
    """Defaults of left-out llama3 keys (ROPE-FREQ: low_freq_factor 1, high_freq_factor 4,
    original_max_position_embeddings 8192) and the type under either key, as mlx-lm reads them."""
    ctx.note(head_dim=p["d"], base=p["base"], scaling=p["scaling"])
    ctx.check("rope_inv_freqs", p["d"], p["base"], p["scaling"], clause="ROPE-FREQ")


def _rope_case(draw, max_T=12):
    p = draw(hh.rope_params(), label="rope")
    T = draw(st.integers(1, max_T), label="T")
    lead = draw(st.sampled_from([(), (2,), (2, 3)]), label="lead")
    pos = draw(hh.positions(T, max_position=draw(hh.max_positions(), label="max_position")), label="positions")
    seed = draw(hh.seeds(), label="seed")
    x = hh.normal(hh.rng_from(seed), lead + (T, p["d"]))
    return p, pos, x, seed


@pytest.mark.clause("ROPE-APPLY")
@given(data=st.data())
def test_rope_apply_matches_oracle(ctx, data):
    p, pos, x, seed = _rope_case(data.draw)
    ctx.note(seed=seed, head_dim=p["d"], traditional=p["traditional"], positions=pos.tolist())
    ctx.positions_up_to(pos.max())
    ctx.check("rope_apply", x, pos, p["inv_freqs"], traditional=p["traditional"], clause="ROPE-APPLY")


@pytest.mark.clause("ROPE-APPLY")
@given(data=st.data())
def test_rope_apply_relative(ctx, data):
    """<q R_i, k R_j> depends on i - j only: shifting both positions changes nothing."""
    p = data.draw(hh.rope_params(), label="rope")
    i = data.draw(st.integers(0, 2048), label="i")
    j = data.draw(st.integers(0, 2048), label="j")
    s = data.draw(st.integers(0, 2048), label="shift")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    q, k = hh.normal(rng, (1, p["d"])), hh.normal(rng, (1, p["d"]))
    ctx.note(seed=seed, i=i, j=j, shift=s, head_dim=p["d"])
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    a = np.sum(ctx.call("rope_apply", q, np.array([i]), **kw) * ctx.call("rope_apply", k, np.array([j]), **kw))
    b = np.sum(ctx.call("rope_apply", q, np.array([i + s]), **kw) * ctx.call("rope_apply", k, np.array([j + s]), **kw))
    ctx.assert_close(a, b, clause="ROPE-APPLY", what="<q R_i, k R_j> vs <q R_(i+s), k R_(j+s)>")


@pytest.mark.clause("ROPE-INVERSE")
@given(data=st.data())
def test_rope_invert_matches_oracle(ctx, data):
    p, pos, x, seed = _rope_case(data.draw)
    ctx.note(seed=seed, head_dim=p["d"], traditional=p["traditional"], positions=pos.tolist())
    ctx.positions_up_to(pos.max())
    ctx.check("rope_invert", x, pos, p["inv_freqs"], traditional=p["traditional"], clause="ROPE-INVERSE")


@pytest.mark.clause("ROPE-INVERSE", needs=("rope_apply", "rope_invert"))
@given(data=st.data())
def test_rope_invert_is_per_token(ctx, data):
    """Per-token inverse: a block of tokens at p0 + t is undone token by token (not a rotation by -p0)."""
    p = data.draw(hh.rope_params(), label="rope")
    T = data.draw(st.integers(2, 12), label="T")
    pos = data.draw(hh.positions(T, contiguous=True, max_position=data.draw(hh.max_positions(), label="max_position")),
                    label="positions")
    seed = data.draw(hh.seeds(), label="seed")
    x = hh.normal(hh.rng_from(seed), (T, p["d"]))
    ctx.note(seed=seed, head_dim=p["d"], traditional=p["traditional"], p0=int(pos[0]), T=T)
    ctx.positions_up_to(pos.max())
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    y = ctx.call("rope_apply", x, pos, **kw)
    back = ctx.call("rope_invert", y, pos, **kw)
    ctx.assert_close(back, ctx.cast(x), clause="ROPE-INVERSE", what="rope_invert(rope_apply(x, p), p) vs x")
