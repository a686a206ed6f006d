"""INPUT-ERRORS: every precondition failure is a ValueError (checked per callable)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from a2ats_conformance.harness import capabilities
from a2ats_conformance.harness import hypothesis_helpers as hh
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


# EQ-13, EQ-14 and EQ-15 take a symmetric H (EQ-13: max|H − Hᵀ| > 1e-5 · max|H| must be rejected; EQ-14 and
# EQ-15 refer to it). test_non_pd_H's asymmetry is gross (+1.0); a port that symmetrises anything np.allclose calls
# symmetric, or checks only cholesky's input, passes it. Here the asymmetry is small relative to max|H| (1e-4,
# 1e-2: above the spec's 1e-5), on a pair of off-diagonal entries that H has as
# zeros, so it survives float16/bfloat16 rounding, and H stays positive definite: asymmetry is its only fault.

def _slightly_asymmetric_H(rng, d, rel, scale):
    H = scale * hh.spd_matrix(rng, d, cond=10.0)
    i, j = sorted(rng.choice(d, size=2, replace=False).tolist())
    a = H[i, j]
    H[i, j] = H[j, i] = 0.0
    H[i, i] += abs(a)                        # -a(e_i e_jᵀ + e_j e_iᵀ) + |a|(e_i e_iᵀ + e_j e_jᵀ) is PSD: H stays PD
    H[j, j] += abs(a)
    H[i, j] = rel * float(np.abs(H).max())   # H[j, i] stays 0
    return H, (i, j)


# One parametrised test per callable, each needing it: a port without one of them reads not-implemented for that
# case, never a pass that called nothing.
@pytest.mark.clause("INPUT-ERRORS")   # each case's own mark adds the callable it needs
@pytest.mark.parametrize("fn", [
    pytest.param(f, marks=pytest.mark.clause("INPUT-ERRORS", needs=(f.split("_batched")[0],)))
    for f in ("cholesky", "cholesky_batched", "assign", "score_error")])
@given(seed=hh.seeds(), d=st.sampled_from([2, 4, 8]), rel=st.sampled_from([1e-4, 1e-2]),
       scale=st.sampled_from([0.01, 1.0, 30.0]))
def test_slightly_asymmetric_H(ctx, seed, d, rel, scale, fn):
    rng = hh.rng_from(seed)
    H, (i, j) = _slightly_asymmetric_H(rng, d, rel, scale)
    ctx.note(seed=seed, head_dim=d, relative_asymmetry=rel, H_scale=scale, entry=(i, j), fn=fn)
    what = (f"H with H[{i},{j}] - H[{j},{i}] = {rel:g} * max|H| (max|H| ~ {float(np.abs(H).max()):.3g}; an H with "
            f"max|H - Hᵀ| > 1e-5 * max|H| must be rejected, EQ-13)")
    k, C = hh.normal(rng, (3, d)), hh.normal(rng, (4, d))
    if fn == "cholesky":
        msg = ctx.expect_value_error("cholesky", H, what=what)
    elif fn == "cholesky_batched":    # the asymmetric matrix second in the stack: every matrix is checked
        Hs = np.stack([scale * hh.spd_matrix(rng, d, cond=10.0), H])
        msg = ctx.expect_value_error("cholesky", Hs, what=f"a stack (2, {d}, {d}) whose matrix 1 is {what}")
    elif fn == "assign":
        msg = ctx.expect_value_error("assign", k, C, H, what=what)
    else:
        msg = ctx.expect_value_error("score_error", k, C[:3], H, what=what)
    ctx.require_named(msg, "H", f"{fn} with {what}")


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


# --------------------------------------------------------------------------- query_pos and codes out of range
# INPUT-ERRORS: `0 ≤ query_pos ≤ T − 1` (RET-SELECT, RET-DECODE) and codes are integers in `[0, K)` (RET-LUT,
# RET-DECODE); the message names the argument. A port that clamps query_pos, or gathers with clipped or wrapped
# indices (mx.take and torch.gather on some devices do no bounds check), answers instead of raising.

def _bad_query_pos(T: int):
    return st.sampled_from([T, T + 5, -1])


@st.composite
def _decode_inputs(draw):
    """A valid decode_step input (query at T − 1) and its head counts; codes in [0, K) of code_dtype(K)."""
    n_q, n_kv = draw(hh.gqa_heads(max_kv=2, max_group=2), label="heads")
    T = draw(st.integers(1, 10), label="T")
    K = draw(st.sampled_from([1, 3, 16, 255, 256, 300]), label="K")
    seed = draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    d = 8
    kw = dict(query_pos=T - 1, b=64, w=draw(st.integers(0, 3), label="w"), sinks=draw(st.integers(0, 2), label="sinks"),
              topk=draw(hh.topk_values()), inv_freqs=_INV8, traditional=_layout())
    args = (hh.normal(rng, (n_q, d)), hh.normal(rng, (n_kv, T, d)), hh.normal(rng, (n_kv, T, d)),
            rng.integers(0, K, size=(n_kv, T)).astype(oracle.code_dtype(K)), hh.normal(rng, (n_kv, K, d)))
    return args, kw, dict(seed=seed, n_q=n_q, n_kv=n_kv, T=T, K=K)


@pytest.mark.clause("INPUT-ERRORS", needs=("select_tokens",))
@given(data=st.data())
def test_select_tokens_rejects_query_pos_out_of_range(ctx, data):
    """query_pos = T, T + 5 or −1 for T scored tokens: ValueError naming query_pos (not clamped to T − 1 or 0)."""
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    T = data.draw(st.integers(1, 12), label="T")
    query_pos = data.draw(_bad_query_pos(T), label="query_pos")
    seed = data.draw(hh.seeds(), label="seed")
    kw = dict(n_kv_heads=n_kv, query_pos=query_pos, w=data.draw(st.integers(0, 3), label="w"),
              sinks=data.draw(st.integers(0, 2), label="sinks"), topk=data.draw(hh.topk_values()))
    ctx.note(seed=seed, n_q=n_q, T=T, **kw)
    what = f"query_pos={query_pos} for T={T} scored tokens (need 0 <= query_pos <= T - 1)"
    msg = ctx.expect_value_error("select_tokens", hh.normal(hh.rng_from(seed), (n_q, T)), what=what, **kw)
    ctx.require_named(msg, "query_pos", f"select_tokens: {what}")


@pytest.mark.clause("INPUT-ERRORS", needs=("decode_step",))
@given(case=_decode_inputs(), data=st.data())
def test_decode_step_rejects_query_pos_out_of_range(ctx, case, data):
    """decode_step with query_pos = T, T + 5 or −1 for T cached tokens: ValueError naming query_pos."""
    args, kw, notes = case
    T = notes["T"]
    kw["query_pos"] = data.draw(_bad_query_pos(T), label="query_pos")
    ctx.note(**notes, query_pos=kw["query_pos"], w=kw["w"], sinks=kw["sinks"], topk=kw["topk"])
    what = f"query_pos={kw['query_pos']} for T={T} cached tokens (need 0 <= query_pos <= T - 1)"
    msg = ctx.expect_value_error("decode_step", *args, what=what, **kw)
    ctx.require_named(msg, "query_pos", f"decode_step: {what}")


def _bad_codes(data, codes, K: int):
    """``codes`` with one entry out of [0, K): K itself, K + 3, 255 in uint8 (K < 255), or −1 in a signed array."""
    options = [("K", K), ("K+3", K + 3), ("-1", -1)] + ([("255 in uint8", 255)] if K < 255 else [])
    label, bad = data.draw(st.sampled_from(options), label="bad_code")
    dtype = np.int32 if bad < 0 else (np.uint8 if bad < 256 else np.uint16)
    out = np.array(codes, dtype=dtype)
    flat = out.reshape(-1)
    flat[data.draw(st.integers(0, flat.size - 1), label="bad_index")] = bad
    return out, f"codes holding {bad} ({label}, dtype {out.dtype.name}) for K={K} codewords (need 0 <= code < K)"


@pytest.mark.clause("INPUT-ERRORS", needs=("token_scores",))
@given(data=st.data())
def test_token_scores_rejects_codes_out_of_range(ctx, data):
    """token_scores with a code outside [0, K): ValueError naming codes (no clipped or wrapped gather)."""
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    K = data.draw(st.sampled_from([1, 3, 16, 255, 256, 300]), label="K")
    T = data.draw(st.integers(1, 12), label="T")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    codes, what = _bad_codes(data, rng.integers(0, K, size=(n_kv, T)), K)
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, K=K, T=T, codes=codes.tolist())
    msg = ctx.expect_value_error("token_scores", hh.normal(rng, (n_q, K)), codes, what=what)
    ctx.require_named(msg, "codes", f"token_scores: {what}")


@pytest.mark.clause("INPUT-ERRORS", needs=("decode_step",))
@given(case=_decode_inputs(), data=st.data())
def test_decode_step_rejects_codes_out_of_range(ctx, case, data):
    """decode_step with a code outside [0, K) of its codebook C: ValueError naming codes."""
    (q, k, v, codes, C), kw, notes = case
    codes, what = _bad_codes(data, codes, notes["K"])
    ctx.note(**notes, codes=codes.tolist(), w=kw["w"], sinks=kw["sinks"], topk=kw["topk"])
    msg = ctx.expect_value_error("decode_step", q, k, v, codes, C, what=what, **kw)
    ctx.require_named(msg, "codes", f"decode_step: {what}")


# --------------------------------------------------------------------------- RoPE, EQ-10, EQ-11, EQ-12 preconditions
# ROPE-FREQ: any type other than default/linear/llama3 raises, listing them; factor > 0; 0 < low_freq_factor <
# high_freq_factor. ROPE-APPLY (and ROPE-INVERSE, EQ-12 "as ROPE-APPLY"): positions broadcast against
# x.shape[:-1], inv_freqs (d/2,), finite inputs. EQ-10: n_q % n_kv == 0, ridge >= 0, an all-zero group cannot be
# normalised. INPUT-ERRORS: w, b are ints, not bools. Each case is a silent fix a port is likely to make instead.

#: Scaling types mlx-lm or HF know that ROPE-FREQ does not support, and configs of supported types that are invalid.
_UNSUPPORTED_TYPES = ("yarn", "deepseek_yarn", "longrope", "su", "dynamic", "proportional", "mrope", "ntk")
_BAD_SCALINGS = {
    "linear factor 0": {"type": "linear", "factor": 0.0},
    "linear factor -2": {"type": "linear", "factor": -2.0},
    "linear factor inf": {"type": "linear", "factor": np.inf},
    "linear factor missing": {"type": "linear"},
    "llama3 factor missing": {"rope_type": "llama3", "low_freq_factor": 1.0},
    "llama3 factor nan": {"rope_type": "llama3", "factor": np.nan},
    "llama3 low_freq_factor == high_freq_factor": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                   "high_freq_factor": 4.0},
    "llama3 low_freq_factor > high_freq_factor": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                  "high_freq_factor": 1.0},
    "llama3 low_freq_factor 0": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0},
    "llama3 low_freq_factor -1": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": -1.0},
}


@pytest.mark.clause("INPUT-ERRORS", needs=("rope_inv_freqs",))
@given(key=st.sampled_from(hh.ROPE_TYPE_KEYS), d=st.sampled_from([8, 64]), base=st.sampled_from(hh.BASES))
def test_rope_inv_freqs_rejects_unsupported_types(ctx, key, d, base):
    """ROPE-FREQ: any scaling type but default, linear and llama3 raises ValueError listing the supported types
    (never a fallback to linear or default frequencies: yarn and longrope scale the input, dynamic depends on the
    sequence length, proportional leaves dims unrotated, mrope has multi-axis positions). Every type in every
    example: a drawn one would leave most of them out of a short run."""
    for kind in _UNSUPPORTED_TYPES:
        scaling = dict(hh.rope_scaling_dict(kind, key), factor=4.0, original_max_position_embeddings=8192)
        ctx.note(head_dim=d, base=base, scaling=scaling)
        what = f"unsupported RoPE scaling type {kind!r} ({scaling})"
        msg = ctx.expect_value_error("rope_inv_freqs", d, base, scaling, what=what)
        missing = [t for t in ("linear", "llama3") if t not in msg]
        if missing:
            ctx.fail("INPUT-ERRORS", f"rope_inv_freqs: {what}: the ValueError must list the supported types "
                     f"(default, linear, llama3); {missing} not named in: {msg!r}")


@pytest.mark.clause("INPUT-ERRORS", needs=("rope_inv_freqs",))
@given(d=st.sampled_from([8, 64]), base=st.sampled_from(hh.BASES))
def test_rope_inv_freqs_rejects_bad_scaling_parameters(ctx, d, base):
    """ROPE-FREQ preconditions: factor > 0 and finite (and given), 0 < low_freq_factor < high_freq_factor; every
    case in every example."""
    for case, scaling in _BAD_SCALINGS.items():
        ctx.note(head_dim=d, base=base, case=case, scaling=scaling)
        ctx.expect_value_error("rope_inv_freqs", d, base, scaling, what=f"{case} ({scaling})")


def _rope_callables():
    """(name, call(ctx, x, positions, inv, *, what)) for every callable that rotates at given positions."""
    t = _layout()
    return {
        "rope_apply": lambda ctx, x, p, inv, what: ctx.expect_value_error("rope_apply", x, p, inv, traditional=t, what=what),
        "rope_invert": lambda ctx, x, p, inv, what: ctx.expect_value_error("rope_invert", x, p, inv, traditional=t, what=what),
        "far_keys": lambda ctx, x, p, inv, what: ctx.expect_value_error("far_keys", x, p, inv, traditional=t, what=what),
        "far_query": lambda ctx, x, p, inv, what: ctx.expect_value_error("far_query", x, b=64, inv_freqs=inv,
                                                                           traditional=t, positions=p, what=what),
    }


_BAD_ROTATIONS = ("positions one longer", "positions one shorter", "positions transposed", "positions nan",
                  "positions inf", "inv_freqs (d,)", "inv_freqs (d/2 + 1,)", "inv_freqs (1, d/2)")


def _bad_rotation(rng, case: str, T: int, d: int):
    """(x, positions, inv_freqs) valid but for ``case`` (x (2, T, d) or (2, T + 1, d), T >= 3)."""
    x = hh.normal(rng, (2, T, d))
    pos = np.arange(100, 100 + T)
    inv = oracle.rope_inv_freqs(d, 10000.0)
    if case == "positions one longer":
        pos = np.arange(100, 101 + T)
    elif case == "positions one shorter":
        pos = np.arange(100, 99 + T)
    elif case == "positions transposed":      # (T + 1, 2) for x (2, T + 1, d): T + 1 >= 4, so no broadcast
        x = hh.normal(rng, (2, T + 1, d))
        pos = np.arange(100, 100 + 2 * (T + 1)).reshape(T + 1, 2)
    elif case in ("positions nan", "positions inf"):
        pos = pos.astype(np.float64)
        pos[T // 2] = np.nan if case == "positions nan" else np.inf
    elif case == "inv_freqs (d,)":
        inv = np.concatenate([inv, inv])
    elif case == "inv_freqs (d/2 + 1,)":
        inv = oracle.rope_inv_freqs(d + 2, 10000.0)
    else:
        inv = inv[None, :]
    return x, pos, inv


@pytest.mark.clause("INPUT-ERRORS")   # each case's own mark adds the callable it needs
@pytest.mark.parametrize("fn", [pytest.param(f, marks=pytest.mark.clause("INPUT-ERRORS", needs=(f,)))
                                for f in ("rope_apply", "rope_invert", "far_keys", "far_query")])
@given(seed=hh.seeds(), T=st.integers(3, 6), d=st.sampled_from([4, 8]))
def test_rotation_rejects_bad_positions_and_inv_freqs(ctx, fn, seed, T, d):
    """ROPE-APPLY preconditions (ROPE-INVERSE and EQ-12 take them "as ROPE-APPLY"): positions must broadcast
    against x.shape[:-1] (no positions[-T:] or [:T] cut, no reshape), be finite, and inv_freqs must have shape
    (d/2,) (not HF's (d,) cat(freqs, freqs), not truncated). Every case in every example."""
    rng = hh.rng_from(seed)
    for case in _BAD_ROTATIONS:
        x, pos, inv = _bad_rotation(rng, case, T, d)
        ctx.note(seed=seed, case=case, x_shape=x.shape, positions_shape=pos.shape, inv_freqs_shape=inv.shape)
        _rope_callables()[fn](ctx, x, pos, inv,
                              f"{case}: x {x.shape}, positions {pos.shape}, inv_freqs {inv.shape} (head_dim {d})")


@pytest.mark.clause("INPUT-ERRORS")   # each case's own mark adds the callable it needs
@pytest.mark.parametrize("fn", [pytest.param(f, marks=pytest.mark.clause("INPUT-ERRORS", needs=(f,)))
                                for f in ("wrope_scores", "far_query", "query_moment")])
@given(seed=hh.seeds(), which=st.sampled_from(["w", "b"]))
def test_w_and_b_must_be_ints(ctx, fn, seed, which):
    """INPUT-ERRORS: w and b are ints, not bools (isinstance(True, int) holds in Python), floats or strings: no
    silent int() of them. Every value in every example."""
    if fn != "wrope_scores" and which == "w":
        which = "b"                        # far_query and query_moment take b only
    for value in (True, False, 2.0, 64.5, "64"):
        _w_or_b_rejected(ctx, fn, hh.rng_from(seed), which, value)


def _w_or_b_rejected(ctx, fn, rng, which, value):
    kw = dict(inv_freqs=_INV8, traditional=_layout(), **{which: value})
    ctx.note(fn=fn, **{which: repr(value)})
    what = f"{which}={value!r} ({type(value).__name__}; must be an int, not a bool)"
    if fn == "wrope_scores":
        msg = ctx.expect_value_error("wrope_scores", hh.normal(rng, (3, 8)), hh.normal(rng, (4, 8)),
                                     what=what, **{"w": 2, "b": 64, **kw})
    elif fn == "far_query":
        msg = ctx.expect_value_error("far_query", hh.normal(rng, (3, 8)), what=what, **kw)
    else:
        msg = ctx.expect_value_error("query_moment", hh.normal(rng, (4, 3, 8)), n_kv_heads=2, what=what, **kw)
    ctx.require_named(msg, which, f"{fn}: {what}")


_BAD_MOMENTS = ("group of zeros", "n_q not a multiple of n_kv", "negative ridge", "non-finite ridge", "no tokens")


@pytest.mark.clause("INPUT-ERRORS", needs=("query_moment",))
@given(seed=hh.seeds(), n_kv=st.integers(1, 3), G=st.integers(1, 3))
def test_query_moment_rejects_bad_input(ctx, seed, n_kv, G):
    """EQ-10 preconditions: a group whose queries are all zero cannot be normalised (no H / (rms + eps) returning
    ridge*I); n_q % n_kv == 0 (no dropped heads); ridge >= 0 and finite (no clamping); N >= 1. Every case in
    every example."""
    for case in _BAD_MOMENTS:
        _bad_moment_rejected(ctx, hh.rng_from(seed), seed, case, n_kv, G)


def _bad_moment_rejected(ctx, rng, seed, case, n_kv, G):
    n_q, N, ridge = n_kv * G, 3, 1e-6
    q = hh.normal(rng, (n_q, N, 8))
    if case == "group of zeros":
        g = int(rng.integers(n_kv))
        q[g * G:(g + 1) * G] = 0.0
        what = f"the queries of KV group {g} (heads {g * G}..{g * G + G - 1}) all zero"
    elif case == "n_q not a multiple of n_kv":
        n_kv = max(n_kv, 2)                # every n_q is a multiple of 1
        q = hh.normal(rng, (n_kv * G + 1, N, 8))
        what = f"n_q={q.shape[0]} query heads, n_kv_heads={n_kv}"
    elif case == "negative ridge":
        ridge = -1e-3
        what = "ridge=-1e-3"
    elif case == "non-finite ridge":
        ridge = float("nan")
        what = "ridge=nan"
    else:
        q = q[:, :0]
        what = f"queries {q.shape} (N = 0 tokens)"
    ctx.note(seed=seed, case=case, queries_shape=q.shape, n_kv=n_kv, ridge=ridge)
    ctx.expect_value_error("query_moment", q, n_kv_heads=n_kv, b=64, inv_freqs=_INV8, traditional=_layout(),
                           ridge=ridge, what=what)
