"""PREFILL (dense causal attention for query length > 1, calibration's collection attention included) and
CODES-DTYPE."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_spec import oracle


@pytest.mark.clause("PREFILL", needs=("prefill_attention",))
@given(data=st.data())
def test_prefill_attention_matches_oracle(ctx, data):
    """Dense causal attention with the queries end-aligned to the keys (query t at Tk - Tq + t), against the
    oracle; inputs with and without leading batch axes (q (..., n_q, Tq, d)): Tq and Tk are the axes -2 of q and
    k whatever leads them, and each batch row attends only its own keys."""
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    d = data.draw(hh.head_dims(max_dim=32), label="head_dim")
    Tk = data.draw(st.integers(1, 24), label="Tk")
    Tq = data.draw(st.integers(1, Tk), label="Tq")
    dv = data.draw(st.sampled_from([d, 6]), label="dv")
    scale = data.draw(st.sampled_from([None, 0.25]), label="scale")
    seed = data.draw(hh.seeds(), label="seed")
    lead = data.draw(st.sampled_from([(), (), (2,), (2, 1)]), label="lead")   # batch axes before the heads
    rng = hh.rng_from(seed)
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, Tq=Tq, Tk=Tk, head_dim=d, dv=dv, scale=scale, lead=lead)
    ctx.check("prefill_attention", hh.normal(rng, lead + (n_q, Tq, d)), hh.normal(rng, lead + (n_kv, Tk, d)),
              hh.normal(rng, lead + (n_kv, Tk, dv)), scale=scale, clause="PREFILL")


@pytest.mark.clause("PREFILL", needs=("collection_attention",))
@given(data=st.data())
def test_collection_attention_matches_oracle(ctx, data):
    """Calibration's collection attention (mlx-lm's layout, B leading) is PREFILL's dense causal attention:
    queries end-aligned to the keys (a later chunk's queries see the earlier chunks), query head h reading KV
    head h // G. Long rows too (hundreds of keys, a kernel may split them into blocks and parts)."""
    long = data.draw(st.booleans(), label="long")
    n_q, n_kv = data.draw(st.sampled_from([(2, 1), (4, 2), (6, 3), (3, 3)]) if long else hh.gqa_heads(), label="heads")
    d = data.draw(hh.head_dims(max_dim=16), label="head_dim")
    Tk = data.draw(st.integers(513, 1100) if long else st.integers(1, 40), label="Tk")
    Tq = data.draw(st.one_of(st.integers(1, min(Tk, 8)), st.integers(1, min(Tk, 400 if long else Tk))), label="Tq")
    B = data.draw(st.integers(1, 2), label="B")
    scale = data.draw(st.sampled_from([None, 0.25]), label="scale")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    ctx.note(seed=seed, B=B, n_q=n_q, n_kv=n_kv, Tq=Tq, Tk=Tk, head_dim=d, scale=scale)
    ctx.check("collection_attention", hh.normal(rng, (B, n_q, Tq, d)), hh.normal(rng, (B, n_kv, Tk, d)),
              hh.normal(rng, (B, n_kv, Tk, d)), scale=scale, clause="PREFILL",
              what="collection attention (B, n_q, Tq, dv) vs dense causal attention, keys end-aligned")


@pytest.mark.clause("CODES-DTYPE")
@given(K=st.one_of(st.sampled_from([1, 2, 255, 256, 257, 4096, 65535, 65536]), st.integers(1, 65536)))
def test_code_dtype(ctx, K):
    ctx.note(K=K)
    got = ctx.call("code_dtype", K)
    want = oracle.code_dtype(K)
    try:
        ok = np.dtype(got) == want
    except TypeError:
        ok = False
    if not ok:
        ctx.fail("CODES-DTYPE", f"code_dtype({K}) = {got!r}, expected {want} (smallest unsigned dtype holding K-1)")


@pytest.mark.clause("CODES-DTYPE", "INPUT-ERRORS", needs=("code_dtype",))
@given(K=st.one_of(st.just(65537), st.integers(65537, 2**40)))
def test_code_dtype_rejects_more_than_16_bits(ctx, K):
    ctx.note(K=K)
    ctx.expect_value_error("code_dtype", K, what=f"K={K} > 65536")
