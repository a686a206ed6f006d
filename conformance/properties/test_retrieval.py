"""RET-LUT, RET-TOPK, RET-SELECT, RET-ATTN, RET-DECODE: the decode-time retrieval."""

import math

import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from a2ats_conformance.harness import capabilities
from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_conformance.harness.decode_checks import check_decode
from a2ats_conformance.harness.tolerances import tie_margin
from a2ats_spec import oracle


def _f64(ctx, x):
    return ctx.cast(x).astype(np.float64)


@pytest.mark.clause("RET-LUT")
@given(data=st.data())
def test_lut_scores_match_oracle(ctx, data):
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    d = data.draw(hh.head_dims(), label="head_dim")
    K = data.draw(st.integers(1, 40), label="K")
    scale = data.draw(st.sampled_from([None, 0.5, 1.0]), label="scale")
    lead = data.draw(st.sampled_from([(), (2,)]), label="lead")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, head_dim=d, K=K, scale=scale)
    ctx.check("lut_scores", hh.normal(rng, lead + (n_q, d)), hh.normal(rng, (n_kv, K, d)), scale=scale, clause="RET-LUT",
              what="lut_scores (LUT[h, k] = scale · q_b[h] · C[h // G, k], scale 1/sqrt(d) when None)")


@pytest.mark.clause("RET-LUT")
@given(data=st.data())
def test_token_scores_match_oracle(ctx, data):
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    K = data.draw(st.integers(1, 300), label="K")
    T = data.draw(st.integers(1, 40), label="T")
    lead = data.draw(st.sampled_from([(), (), (2,), (3, 1)]), label="lead")   # lut (..., n_q, K), codes (..., n_kv, T)
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    codes = rng.integers(0, K, size=lead + (n_kv, T)).astype(oracle.code_dtype(K))
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, K=K, T=T, lead=lead)
    ctx.check("token_scores", hh.normal(rng, lead + (n_q, K)), codes, clause="RET-LUT",
              what=f"token_scores with lut {lead + (n_q, K)} and codes {codes.shape} (row r of the leading dims "
                   "gathers its own LUT with its own codes; query head h reads KV head h // G)")


#: RET-TOPK (Departures): the fractions whose count in float32 arithmetic (the authors' PyTorch) is off by one from
#: int(topk · T) for some T <= 131,072, higher or lower; for the others float32 gives the same count for every T.
_FLOAT32_OFF_FRACTIONS = (0.13, 0.21, 0.26, 0.29, 0.35, 0.39, 0.41, 0.42, 0.47, 0.52, 0.53, 0.57, 0.58, 0.59, 0.65,
                          0.69, 0.7, 0.71, 0.78, 0.82, 0.84, 0.94)


@st.composite
def _topk_count_cases(draw):
    """(T, topk, n_candidates). Half the draws (when the IUT takes fractions) put topk · T on an integer: topk =
    p/100 and T a multiple of 100/gcd(p, 100). There the float64 product may fall just below the integer (0.29 · 100
    = 28.999999999999996, count 28), and any other arithmetic (a float32 product, rounding, an epsilon) is off by
    one; the fractions RET-TOPK lists as off in float32 are drawn often."""
    if "fraction" not in capabilities.current().topk or not draw(st.booleans(), label="integer_product"):
        T = draw(st.integers(1, 200_000), label="T")
        topk = draw(hh.topk_values(fractions=st.one_of(st.floats(1e-4, 1.0), st.sampled_from([0.03, 0.1, 0.5, 1.0])),
                                   counts=st.integers(1, 10_000)))
        return T, topk, draw(st.one_of(st.none(), st.integers(0, 5000)), label="n_candidates")
    percent = draw(st.one_of(st.sampled_from([round(100 * f) for f in _FLOAT32_OFF_FRACTIONS]), st.integers(1, 100)),
                   label="percent")
    step = 100 // math.gcd(percent, 100)
    T = step * draw(st.integers(1, 131_072 // step), label="T_over_step")
    topk = percent / 100          # the same float as the literal 0.29 etc.
    return T, topk, draw(st.one_of(st.none(), st.integers(int(topk * T), T)), label="n_candidates")   # no cap below


@pytest.mark.clause("RET-TOPK")
@given(case=_topk_count_cases())
@example(case=(100, 0.29, None))      # RET-TOPK: int(0.29 · 100) = 28; a float32 product gives 29
@example(case=(900, 0.13, None))      # 117; float32 gives 116
@example(case=(90, 0.7, 90))          # int(62.99999999999999) = 62; float32 or rounding gives 63
@example(case=(37, 1, None))          # the int 1 is a count of one token, not the fraction 1.0 (all 37)
@example(case=(37, 1, 20))
def test_topk_count_matches_oracle(ctx, case):
    """float topk -> int(topk * T) (int() of Python's float64 product); int topk -> topk; capped at n_candidates."""
    T, topk, n_candidates = case
    forms = capabilities.current().topk
    assume(("count" if isinstance(topk, int) else "fraction") in forms)   # explicit examples: either form
    ctx.note(T=T, topk=topk, n_candidates=n_candidates)
    args = (T, topk) if n_candidates is None else (T, topk, n_candidates)
    got = ctx.call("topk_count", *args)
    want = oracle.topk_count(*args)
    if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)) or int(got) != want:
        why = ""
        if isinstance(topk, float):
            why = (f": int(topk · T) of the float64 product {topk * T!r} (a float32 product is "
                   f"{float(np.float32(topk) * np.float32(T))!r}; RET-TOPK counts in float64)")
        ctx.fail("RET-TOPK", f"topk_count{args!r} = {got!r}, expected {want}{why}")


def _select_and_check(ctx, case, clause):
    """One select_tokens call on all of the case's scores (..., n_q, T); each row of the leading dims is checked
    against the allowed sets the oracle gives for that row alone (a batch of one), so a port that mixes rows, or
    groups heads differently when scores carry leading dims, is caught."""
    s = case["scores"]
    kw = dict(n_kv_heads=case["n_kv"], query_pos=case["query_pos"], w=case["w"], sinks=case["sinks"], topk=case["topk"])
    mask = ctx.call("select_tokens", s, **kw)
    so = _f64(ctx, s)
    lead = so.shape[:-2]
    m = np.asarray(mask)
    want = lead + (case["n_kv"], case["T"])
    if m.shape != want:
        ctx.fail(clause, f"select_tokens mask: shape {m.shape}, expected {want} (scores {so.shape} → (..., n_kv, T))")
    for r in np.ndindex(*lead):
        row = f"row {r} of leading dims {lead}: " if lead else ""
        must, may = oracle.select_tokens_allowed(so[r], margin=ctx.margin(clause, so[r]), **kw)
        ctx.assert_mask_allowed(m[r], must, may, clause=clause, what=f"{row}select_tokens mask (must ⊆ mask ⊆ may)",
                                selection=dict(scores=so[r], query_pos=kw["query_pos"], w=kw["w"], sinks=kw["sinks"],
                                               topk=kw["topk"]))
    return m


def _batched_groups_case():
    """Scores (2, 4, 10) over n_kv = 2 KV heads (G = 2): in row r query head h's top token is 4r + h, so KV head
    g selects exactly {4r + 2g, 4r + 2g + 1} beside the window (top-1 per head, w = 1, no sinks)."""
    s = hh.normal(hh.rng_from(11), (2, 4, 10))
    for r in range(2):
        for h in range(4):
            s[r, h, 4 * r + h] = 10.0
    return {"n_q": 4, "n_kv": 2, "T": 10, "lead": (2,), "query_pos": 9, "w": 1, "sinks": 0,
            "topk": hh.topk_for_count(1, 10), "seed": 11, "scores": s}


def _count_case(T, query_pos, w, sinks, topk, seed=11):
    """A scores_case for @example: one query head, distinct scores."""
    return {"n_q": 1, "n_kv": 1, "T": T, "lead": (), "query_pos": query_pos, "w": w, "sinks": sinks, "topk": topk,
            "seed": seed, "scores": hh.normal(hh.rng_from(seed), (1, T))}


def _wide_group_case(G=16, T=64, seed=5):
    """A scores_case for @example: one GQA group of G query heads with distinct scores, so each head has its own
    top-k and the union needs every head (groups of 9-16 heads exist; a fixed 8-lane head mask drops some)."""
    return {"n_q": G, "n_kv": 1, "T": T, "lead": (), "query_pos": T - 1, "w": 4, "sinks": 2,
            "topk": hh.topk_for_count(3, T), "seed": seed, "scores": hh.normal(hh.rng_from(seed), (G, T))}


@pytest.mark.clause("RET-SELECT")
@given(case=hh.scores_case(leads=((), (), (2,), (3, 1))))
@example(case=None)   # leading dims with G = 2 and distinct per-head winners, in every run
@example(case="wide group")   # a group of 16 heads in every run (built when run: topk takes a form the port declares)
# RET-SELECT: the count is int(topk · (i + 1)) = 10; over the T = 48 scores it is 12, over the 28 candidates
# (neither sink nor window) 7: a port counting over the wrong length picks the wrong number of tokens
@example(case=_count_case(T=48, query_pos=39, w=8, sinks=4, topk=0.25))
def test_select_tokens_is_an_allowed_selection(ctx, case):
    """Sinks and window always kept; per head a valid top-k of the candidates (near ties from the oracle's
    margin); union over the GQA group; nothing after the query position. Scores with leading dims (..., n_q, T)
    too (RET-SELECT's shape): every row is its own selection, heads grouped h // G as without them."""
    case = {None: _batched_groups_case, "wide group": _wide_group_case}[case]() if not isinstance(case, dict) else case
    form = "count" if isinstance(case["topk"], int) else "fraction"
    assume(form in capabilities.current().topk)   # the @example counts are fixed forms
    ctx.note(**{k: v for k, v in case.items() if k != "scores"})
    mask = _select_and_check(ctx, case, "RET-SELECT")
    G = case["n_q"] // case["n_kv"]
    i, T = case["query_pos"], case["T"]
    j = np.arange(T)
    forced = (j <= i) & ((j < case["sinks"]) | (i - j < case["w"]))
    cand = (j <= i) & ~forced
    probe = oracle.select_tokens(np.arange(T, dtype=float)[None, :], n_kv_heads=1, query_pos=i, w=case["w"],
                                 sinks=case["sinks"], topk=case["topk"])
    count = int((probe[0] & cand).sum())          # the oracle's per-head count (RET-TOPK)
    extra = (mask & cand).sum(axis=-1)
    if np.any(extra < count) or np.any(extra > G * count):
        ctx.fail("RET-SELECT", "per KV head, the union of G per-head top-k sets must hold between k and G*k candidates",
                 f"k={count}, G={G}, got {extra.tolist()}")


@pytest.mark.clause("RET-SELECT", requires={"topk": "fraction"})   # only a fraction can count 0 tokens
@given(data=st.data())
def test_select_tokens_is_never_empty(ctx, data):
    """A top-k count of 0: exactly the sinks and the window are selected, and when both are empty (w = 0,
    sinks = 0) exactly the query's own token (never-empty rule). The own token is added only then: with sinks
    and w = 0 it is not selected unless it is a sink."""
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    T = data.draw(st.integers(1, 40), label="T")
    i = data.draw(st.integers(0, T - 1), label="query_pos")
    w = data.draw(st.sampled_from([0, 0, 1, 3]), label="w")
    sinks = data.draw(st.sampled_from([0, 0, 1, 3]), label="sinks")
    topk = data.draw(st.floats(1e-3, 0.999 / (i + 1)), label="topk")   # int(topk * (i + 1)) == 0
    s = hh.normal(hh.rng_from(data.draw(hh.seeds(), label="seed")), (n_q, T))
    ctx.note(n_q=n_q, n_kv=n_kv, T=T, query_pos=i, w=w, sinks=sinks, topk=topk)
    mask = np.asarray(ctx.call("select_tokens", s, n_kv_heads=n_kv, query_pos=i, w=w, sinks=sinks, topk=topk))
    j = np.arange(T)
    forced = (j <= i) & ((j < sinks) | (i - j < w))
    row = forced if forced.any() else j == i
    want = np.broadcast_to(row, (n_kv, T))
    if mask.shape != want.shape or not np.array_equal(mask, want):
        rule = ("sinks ∪ window only (the never-empty rule adds j = query_pos only when both are empty)"
                if forced.any() else "never-empty rule: with w = 0 and sinks = 0 only j = query_pos")
        ctx.fail("RET-SELECT", f"a top-k count of 0 (int(topk·(i + 1)) = 0) must select {rule}",
                 f"expected {np.flatnonzero(row).tolist()} for every KV head, selected "
                 f"{[np.flatnonzero(r).tolist() for r in mask.reshape(-1, mask.shape[-1])]}")


@pytest.mark.clause("RET-SELECT")
@given(data=st.data())
def test_select_tokens_window_boundary(ctx, data):
    """With topk selecting nothing extra: i - j = w - 1 is kept, i - j = w is not (unless a sink)."""
    w = data.draw(st.integers(1, 10), label="w")
    T = data.draw(st.integers(w + 2, w + 20), label="T")
    i = T - 1
    s = hh.normal(hh.rng_from(data.draw(hh.seeds(), label="seed")), (1, T))
    s[0, i - w] = -1e3            # make sure the far token is never the top-1 candidate
    ctx.note(w=w, T=T)
    mask = np.asarray(ctx.call("select_tokens", s, n_kv_heads=1, query_pos=i, w=w, sinks=0, topk=hh.topk_for_count(1, T)))
    if not mask[0, i - (w - 1)] or mask[0, i - w]:
        ctx.fail("RET-SELECT", "window boundary: i-j = w-1 must be selected, i-j = w must not (it scores lowest)",
                 f"mask[i-(w-1)]={bool(mask[0, i - (w - 1)])}, mask[i-w]={bool(mask[0, i - w])}")


@pytest.mark.clause("RET-SELECT")
@given(data=st.data())
def test_select_tokens_takes_the_gqa_union(ctx, data):
    """Each query head of a group contributes its own top token: distinct winners must all be selected."""
    n_kv = data.draw(st.integers(1, 3), label="n_kv")
    G = data.draw(st.integers(2, 4), label="G")
    T = data.draw(st.integers(G + 1, 30), label="T")
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    s = hh.normal(rng, (n_kv * G, T))
    winners = np.stack([rng.choice(T - 1, G, replace=False) for _ in range(n_kv)])
    for g in range(n_kv):
        for h in range(G):
            s[g * G + h, winners[g, h]] = 10.0
    ctx.note(seed=seed, n_kv=n_kv, G=G, T=T, winners=winners.tolist())
    mask = np.asarray(ctx.call("select_tokens", s, n_kv_heads=n_kv, query_pos=T - 1, w=1, sinks=0,
                               topk=hh.topk_for_count(1, T)))
    for g in range(n_kv):
        if not mask[g, winners[g]].all():
            ctx.fail("RET-SELECT", "GQA union: the top token of every query head of the group must be selected",
                     f"KV head {g}: winners {winners[g].tolist()}, selected {np.flatnonzero(mask[g]).tolist()}")


def _attn_inputs(rng, n_q, n_kv, T, d, dv):
    return hh.normal(rng, (n_q, d)), hh.normal(rng, (n_kv, T, d)), hh.normal(rng, (n_kv, T, dv))


@pytest.mark.clause("RET-ATTN")
@given(data=st.data())
def test_retrieval_attention_matches_oracle(ctx, data):
    n_q, n_kv = data.draw(hh.gqa_heads(), label="heads")
    d = data.draw(hh.head_dims(max_dim=32), label="head_dim")
    dv = data.draw(st.sampled_from([d, 4]), label="dv")
    T = data.draw(st.integers(1, 40), label="T")
    scale = data.draw(st.sampled_from([None, 0.3]), label="scale")
    lead = data.draw(st.sampled_from([(), (), (2,), (3, 1)]), label="lead")   # RET-ATTN's shapes take (...)
    seed = data.draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    q, k, v = hh.normal(rng, lead + (n_q, d)), hh.normal(rng, lead + (n_kv, T, d)), hh.normal(rng, lead + (n_kv, T, dv))
    mask = rng.random(lead + (n_kv, T)) < 0.4
    rows = mask.reshape(-1, T)
    rows[np.arange(rows.shape[0]), rng.integers(0, T, size=rows.shape[0])] = True   # every KV head selects a token
    ctx.note(seed=seed, n_q=n_q, n_kv=n_kv, T=T, head_dim=d, dv=dv, scale=scale, lead=lead)
    ctx.check("retrieval_attention", q, k, v, mask, scale=scale, clause="RET-ATTN",
              what=f"retrieval_attention with q {q.shape}, k {k.shape}, mask {mask.shape} (each row of the leading "
                   "dims attends over its own selection; query head h over KV head h // G)")


#: decode_step's attention scale: None (1/sqrt(d)) and explicit values a model passes (Gemma's
#: query_pre_attn_scalar gives scales other than 1/sqrt(d)); both differ from 1/sqrt(d) at every drawn d.
#: (near_tie_case keeps the default: its levels and RET-LUT's margin are calibrated at 1/sqrt(d).)
DECODE_SCALES = st.sampled_from([None, 0.3, 1.0])


def own_token_on_its_code(k_pre, codes, C, i: int) -> None:
    """RET-DECODE's own-token rule, as the suite draws it: the query's own token i gets the code of its key. Its
    pre-RoPE key is put on its drawn codeword (k_i = C[g, codes[g, i]], in place), so that codeword is the
    nearest to the key under any assignment metric (distance 0; drawn codewords are distinct), and a port that
    codes the new token from its key, as the authors' decode does, reads the code it is handed."""
    for g in range(codes.shape[0]):
        k_pre[g, i] = C[g, codes[g, i]]


def decode_case(draw, *, max_T=60, before_end=False):
    """A decode step over T cached tokens; the query at the last position T - 1, or (before_end) at a drawn
    i < T - 1 with the tokens after it still in the cache (a query replayed after later tokens were appended)."""
    p = draw(hh.rope_params(max_dim=32, scaled=False), label="rope")
    n_q, n_kv = draw(hh.gqa_heads(), label="heads")
    T = draw(st.integers(2 if before_end else 1, max_T), label="T")
    i = draw(st.integers(0, T - 2), label="query_pos") if before_end else T - 1
    K = draw(st.sampled_from([1, 4, 16, 300]), label="K")
    w = draw(st.integers(0, 8), label="w")      # w = 0 with sinks = 0: RET-SELECT's never-empty rule
    sinks = draw(st.integers(0, 4), label="sinks")
    b = draw(st.sampled_from([64, 2048]), label="b")
    topk = draw(hh.topk_values(fractions=(0.03, 0.1, 0.3, 1.0), counts=(2, 5)), label="topk")
    scale = draw(DECODE_SCALES, label="scale")
    seed = draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    d = p["d"]
    q_pre, k_pre, v = _attn_inputs(rng, n_q, n_kv, T, d, d)
    C = hh.normal(rng, (n_kv, K, d))
    codes = rng.integers(0, K, size=(n_kv, T)).astype(oracle.code_dtype(K))
    own_token_on_its_code(k_pre, codes, C, i)
    inv, t = p["inv_freqs"], p["traditional"]
    q_post = oracle.rope_apply(q_pre, np.full(n_q, i), inv, traditional=t)
    k_post = oracle.rope_apply(k_pre, np.arange(T), inv, traditional=t)
    return dict(q_post=q_post, k_post=k_post, v=v, codes=codes, C=C, query_pos=i, b=b, w=w, sinks=sinks,
                topk=topk, inv_freqs=inv, traditional=t, scale=scale), dict(seed=seed, n_q=n_q, n_kv=n_kv, T=T, K=K,
                                                                             head_dim=d, query_pos=i)


@pytest.mark.clause("RET-DECODE")
@given(data=st.data())
def test_decode_step_matches_oracle(ctx, data):
    """RET-DECODE, scale=None or explicit (check_decode's expected output uses the scale passed)."""
    inp, notes = decode_case(data.draw)
    ctx.note(**notes, w=inp["w"], sinks=inp["sinks"], b=inp["b"], topk=inp["topk"], scale=inp["scale"])
    out, mask = ctx.call("decode_step", **inp, return_mask=True)
    check_decode(ctx, out, mask, inp, "RET-DECODE")


@pytest.mark.clause("RET-DECODE")
@given(data=st.data())
def test_decode_step_query_before_the_last_token(ctx, data):
    """RET-DECODE with query_pos = i < T - 1: the query is de-rotated from i (far_query(q_post, positions=i)), the
    top-k count is over the i + 1 tokens it sees, tokens j > i are never selected and the window ends at i. A port
    that takes i = T - 1 from the cache's length is right only when the query is the last token."""
    inp, notes = decode_case(data.draw, before_end=True)
    ctx.note(**notes, w=inp["w"], sinks=inp["sinks"], b=inp["b"], topk=inp["topk"], scale=inp["scale"])
    out, mask = ctx.call("decode_step", **inp, return_mask=True)
    check_decode(ctx, out, mask, inp, "RET-DECODE")


def near_tie_case(draw, *, dtype):
    """A decode at realistic sizes (d 64 or 128, K >= 64, T in the hundreds) whose LUT scores sit on a ladder
    of levels GAP_IN_MARGINS tie margins apart, for every query head at once: each codeword is moved within
    the span of its group's rotated queries q_b until scale · q_b · c hits its level exactly (float64).

    A gap of a few margins is invisible to a port whose score error is within the tolerance table's RET-LUT
    entry, and a flipped pair of levels at the top-k boundary for one whose error is several times larger
    (a float16 LUT: ~2^-11 of |q_b||c|, while the levels span only a few hundredths)."""
    d = draw(st.sampled_from([64, 128]), label="head_dim")
    K = draw(st.sampled_from([64, 128, 256]), label="K")
    T = draw(st.integers(200, 600), label="T")
    n_q, n_kv = draw(hh.gqa_heads(max_kv=2, max_group=2), label="heads")
    G = n_q // n_kv
    t = draw(hh.layouts(), label="traditional")
    b = draw(st.sampled_from([64, 2048]), label="b")
    w = draw(st.integers(1, 16), label="w")
    sinks = draw(st.integers(0, 8), label="sinks")
    topk = draw(hh.topk_values(fractions=(0.03, 0.1, 0.25), counts=(8, 32)), label="topk")
    seed = draw(hh.seeds(), label="seed")
    rng = hh.rng_from(seed)
    inv = oracle.rope_inv_freqs(d, 10000.0)
    scale = 1.0 / np.sqrt(d)
    gap = GAP_IN_MARGINS * tie_margin(dtype, "RET-LUT")
    q_post = oracle.rope_apply(hh.normal(rng, (n_q, d)), T - 1, inv, traditional=t)
    qb = oracle.far_query(q_post, b=b, inv_freqs=inv, traditional=t, positions=T - 1)
    C = hh.normal(rng, (n_kv, K, d), 2.0)   # |c| well above the scores: rounding of q_b or c shows in them
    for g in range(n_kv):
        Q = qb[g * G:(g + 1) * G]                                            # (G, d) the group's rotated queries
        levels = np.stack([rng.permutation(K) for _ in range(G)]) - K / 2   # (G, K) a ladder per head
        want = gap * levels / scale                                          # target q_b · c
        C[g] += np.linalg.solve(Q @ Q.T, want - Q @ C[g].T).T @ Q          # move c within span(Q) onto its level
    k_pre, v = hh.normal(rng, (n_kv, T, d)), hh.normal(rng, (n_kv, T, d))
    codes = rng.integers(0, K, size=(n_kv, T)).astype(oracle.code_dtype(K))
    own_token_on_its_code(k_pre, codes, C, T - 1)
    k_post = oracle.rope_apply(k_pre, np.arange(T), inv, traditional=t)
    return dict(q_post=q_post, k_post=k_post, v=v, codes=codes, C=C, query_pos=T - 1, b=b, w=w, sinks=sinks,
                topk=topk, inv_freqs=inv, traditional=t), dict(seed=seed, n_q=n_q, n_kv=n_kv, T=T, K=K, head_dim=d)


#: Distance between adjacent LUT levels of near_tie_case, in RET-LUT tie margins.
GAP_IN_MARGINS = 3.0


@pytest.mark.clause("RET-DECODE")
@given(data=st.data())
def test_decode_step_near_ties(ctx, data):
    """RET-DECODE on near_tie_case: the selection is judged with RET-LUT's margin (the selection ranks LUT
    scores, so ties are what RET-LUT's accuracy cannot order), the output with RET-DECODE's tolerance."""
    inp, notes = near_tie_case(data.draw, dtype=ctx.dtype)
    ctx.note(**notes, w=inp["w"], sinks=inp["sinks"], b=inp["b"], topk=inp["topk"], gap_in_margins=GAP_IN_MARGINS)
    out, mask = ctx.call("decode_step", **inp, return_mask=True)
    check_decode(ctx, out, mask, inp, "RET-DECODE", margin_clause="RET-LUT")
