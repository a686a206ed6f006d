"""ROPE-FREQ, ROPE-APPLY, ROPE-INVERSE."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_spec import oracle


def _llama3_example(d, base, type_key, **given):
    """Llama-3.1's rope_scaling with only ``given`` of the optional keys (the rest read from the spec's defaults)."""
    scaling = dict(hh.rope_scaling_dict("llama3", type_key), factor=8.0, **given)
    return {"d": d, "base": base, "scaling": scaling, "traditional": False,
            "inv_freqs": oracle.rope_inv_freqs(d, base, scaling)}


@pytest.mark.clause("ROPE-FREQ")
@given(p=hh.rope_params())
def test_inv_freqs_match_oracle(ctx, p):
    """Every scaling type, the type under either key, llama3 dicts with all four keys (as released configs carry)."""
    ctx.note(head_dim=p["d"], base=p["base"], scaling=p["scaling"])
    ctx.check("rope_inv_freqs", p["d"], p["base"], p["scaling"], clause="ROPE-FREQ")


@pytest.mark.clause("ROPE-FREQ", requires={"rope_scaling": "mlx_lm"})
@settings(report_multiple_bugs=False)   # one failure with its reason, not a group of the explicit examples
@given(p=hh.rope_params(leave_out=True))
@example(p=_llama3_example(64, 500000.0, "rope_type"))   # every optional key left to its default (1, 4, 8192)
@example(p=_llama3_example(64, 10000.0, "type", low_freq_factor=1.0, high_freq_factor=4.0))   # L0 = 8192
@example(p=_llama3_example(32, 500000.0, "both", original_max_position_embeddings=8192))      # 1 and 4
def test_llama3_left_out_keys_take_the_defaults(ctx, p):
    """ROPE-FREQ's defaults of left-out llama3 keys (low_freq_factor 1, high_freq_factor 4,
    original_max_position_embeddings 8192), as mlx-lm fills them. A port that reads complete dicts only declares
    capabilities {"rope_scaling": ("complete",)} and this test does not apply to it."""
    ctx.note(head_dim=p["d"], base=p["base"], scaling=p["scaling"])
    try:
        ctx.check("rope_inv_freqs", p["d"], p["base"], p["scaling"], clause="ROPE-FREQ")
    except KeyError as exc:
        left_out = sorted(set(hh.LLAMA3_OPTIONAL) - set(p["scaling"] or {}))
        ctx.fail("ROPE-FREQ", f"rope_inv_freqs raised KeyError({exc.args[0]!r}) on a llama3 rope_scaling that leaves "
                 f"out {left_out}: ROPE-FREQ fills them with mlx-lm's defaults (low_freq_factor 1, high_freq_factor 4, "
                 "original_max_position_embeddings 8192). A port that reads complete dicts only (transformers' llama3 "
                 "rule indexes every key) declares capabilities = {'rope_scaling': ('complete',)}: the suite then "
                 "draws complete dicts everywhere and reports this test not-applicable")


#: Position forms ROPE-APPLY allows ("a scalar, a (T,) vector or any shape broadcasting against x.shape[:-1];
#: real positions are allowed (negative ones too)"); ROPE-INVERSE takes the same.
POSITION_FORMS = ("vector", "scalar", "per-row", "row-constant", "real", "negative")
#: Real positions travel in the dtype under test (float16 overflows past 65504), so they stay below this.
_MAX_REAL_POSITION = 32_768


@st.composite
def rope_positions(draw, lead: tuple, T: int):
    """(form, positions) for x of shape lead + (T, d): one of POSITION_FORMS.

    vector: (T,) non-negative ints (hh.positions); scalar: a Python int, every token at that position (not an
    offset); per-row: lead + (T,) ints, a different vector per row; row-constant: lead + (1,), one position per
    row broadcast over its tokens; real: (T,) or lead + (T,) non-integer reals, either sign; negative: (T,) ints
    of either sign."""
    max_position = draw(hh.max_positions(), label="max_position")
    form = draw(st.sampled_from(POSITION_FORMS), label="position_form")
    if form in ("per-row", "row-constant") and not lead:
        form = "vector"
    rng = hh.rng_from(draw(hh.seeds(), label="positions_seed"))
    if form == "vector":
        return form, draw(hh.positions(T, max_position=max_position), label="positions")
    if form == "scalar":
        return form, draw(st.integers(0, max_position), label="positions")
    if form == "per-row":
        return form, rng.integers(0, max_position + 1, size=lead + (T,)).astype(np.int64)
    if form == "row-constant":
        return form, rng.integers(0, max_position + 1, size=lead + (1,)).astype(np.int64)
    if form == "negative":
        return form, rng.integers(-max_position, max_position + 1, size=(T,)).astype(np.int64)
    m = min(max_position, _MAX_REAL_POSITION)
    shape = draw(st.sampled_from([(T,), lead + (T,)]), label="real_shape")
    # A fraction in [0.1, 0.9] on every position: far from an integer, so rounding or truncating shows.
    whole = rng.integers(-m + 1, m, size=shape).astype(np.float64)
    frac = rng.uniform(0.1, 0.9, size=shape)
    return form, whole + np.where(whole < 0, -frac, frac)


def _rope_case(draw, max_T=12):
    p = draw(hh.rope_params(), label="rope")
    T = draw(st.integers(1, max_T), label="T")
    lead = draw(st.sampled_from([(), (2,), (2, 3)]), label="lead")
    form, pos = draw(rope_positions(lead, T), label="positions")
    seed = draw(hh.seeds(), label="seed")
    x = hh.normal(hh.rng_from(seed), lead + (T, p["d"]))
    return p, form, pos, x, seed


def _position_form(form, pos) -> str:
    a = np.asarray(pos)
    return f"{form} positions ({'real' if a.dtype.kind == 'f' else 'integer'}, shape {a.shape})"


def _note_rope_case(ctx, p, form, pos, x, seed):
    a = np.asarray(pos)
    ctx.note(seed=seed, head_dim=p["d"], traditional=p["traditional"], x_shape=x.shape, position_form=form,
             positions=a.tolist())
    ctx.positions_up_to(np.ceil(np.abs(a).max()))


@pytest.mark.clause("ROPE-APPLY")
@given(data=st.data())
def test_rope_apply_matches_oracle(ctx, data):
    """Every position form ROPE-APPLY allows: a scalar (every token at it, not an offset), a (T,) vector,
    positions broadcasting against x.shape[:-1] (one vector or one position per row), real and negative."""
    p, form, pos, x, seed = _rope_case(data.draw)
    _note_rope_case(ctx, p, form, pos, x, seed)
    ctx.check("rope_apply", x, pos, p["inv_freqs"], traditional=p["traditional"], clause="ROPE-APPLY",
              what=f"rope_apply with {_position_form(form, pos)}, x {x.shape}")
    # A scalar in every example, on three tokens: a port that takes it as an offset (token t at s + t, as
    # mx.fast.rope's offset= does) differs from the second token on. Drawn forms alone left the scalar out of a
    # whole selftest run (12 examples).
    s = data.draw(st.integers(0, 4096), label="scalar_position")
    x3 = hh.normal(hh.rng_from(seed + 1), (3, p["d"]))
    ctx.positions_up_to(max(ctx.max_position, s + 2))
    ctx.check("rope_apply", x3, s, p["inv_freqs"], traditional=p["traditional"], clause="ROPE-APPLY",
              what=f"rope_apply with the scalar position {s} (every token at {s}, not an offset), x {x3.shape}")
    # and real positions of either sign, a fraction away from any integer: rounding or truncating them shows
    real = np.array([s + 0.25, s + 1.5, -(s + 0.75)])
    ctx.check("rope_apply", x3, real, p["inv_freqs"], traditional=p["traditional"], clause="ROPE-APPLY",
              what=f"rope_apply with the real positions {real.tolist()}, x {x3.shape}")


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
    """The position forms of ROPE-APPLY (ROPE-INVERSE: "as ROPE-APPLY"); each row its own position."""
    p, form, pos, x, seed = _rope_case(data.draw)
    _note_rope_case(ctx, p, form, pos, x, seed)
    ctx.check("rope_invert", x, pos, p["inv_freqs"], traditional=p["traditional"], clause="ROPE-INVERSE",
              what=f"rope_invert with {_position_form(form, pos)}, x {x.shape}")


@pytest.mark.clause("ROPE-INVERSE", needs=("rope_apply", "rope_invert"))
@given(data=st.data())
def test_rope_invert_is_apply_at_negated(ctx, data):
    """rope_invert(x, p) = x R_{-p} = rope_apply(x, -p), for every position form."""
    p, form, pos, x, seed = _rope_case(data.draw)
    _note_rope_case(ctx, p, form, pos, x, seed)
    kw = dict(inv_freqs=p["inv_freqs"], traditional=p["traditional"])
    neg = -pos if isinstance(pos, np.ndarray) else -int(pos)
    ctx.assert_close(ctx.call("rope_invert", x, pos, **kw), ctx.call("rope_apply", x, neg, **kw), clause="ROPE-INVERSE",
                     what=f"rope_invert(x, p) vs rope_apply(x, -p) with {_position_form(form, pos)}, x {x.shape}")


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


#: Supported scaling types, each as a complete config (so either spelling can name it without a missing key).
_SCALING_CONFIGS = {"default": {}, "linear": {"factor": 4.0},
                    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}


@pytest.mark.clause("ROPE-FREQ", requires={"rope_scaling": "mlx_lm"})
@given(d=hh.head_dims(), base=st.sampled_from(hh.BASES),
       kinds=st.permutations(sorted(_SCALING_CONFIGS)).map(lambda p: p[:2]))
@example(d=64, base=500000.0, kinds=("linear", "llama3"))
def test_inv_freqs_type_key_read_first(ctx, d, base, kinds):
    """ROPE-FREQ reads the type as mlx-lm does, ``scaling.get("type") or scaling.get("rope_type", "default")``:
    when the two spellings disagree, "type" wins (HF transformers reads "rope_type" first; a port that copies it
    builds the other type's frequencies). No released config spells two types, so a port that reads complete,
    unambiguous dicts only may declare capabilities {"rope_scaling": ("complete",)}."""
    by_type, by_rope_type = kinds
    params = {**_SCALING_CONFIGS["linear"], **_SCALING_CONFIGS["llama3"]}
    scaling = {**params, "type": by_type, "rope_type": by_rope_type}
    ctx.note(head_dim=d, base=base, scaling=scaling)
    ctx.check("rope_inv_freqs", d, base, scaling, clause="ROPE-FREQ",
              what=f"rope_inv_freqs with scaling {scaling} (type {by_type!r} wins over rope_type {by_rope_type!r}: "
                   "mlx-lm reads scaling.get('type') first; transformers reads 'rope_type' first: a port that "
                   "reads complete, unambiguous dicts only declares capabilities {'rope_scaling': ('complete',)})")
