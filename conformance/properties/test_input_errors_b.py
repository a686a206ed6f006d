"""INPUT-ERRORS of the callables of EQ-15..18 and RET-* (k-means, z-space, LUT, selection, attention): each bad
input below must raise ValueError naming the argument to fix. Fixed inputs, one call per case: a port that
silently repairs the input (casts a mask, replaces NaN, averages over an empty selection, re-picks a point) returns
a result instead, and the case says which precondition it skipped."""

import numpy as np
import pytest

from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_spec import oracle

EXPLICIT = {"randomness": "explicit"}

_rng = np.random.default_rng(2024)
_Q = _rng.standard_normal((4, 8))             # n_q = 4 query heads, d = 8
_K = _rng.standard_normal((2, 6, 8))          # n_kv = 2 KV heads, T = 6 tokens
_V = _rng.standard_normal((2, 6, 8))
_CB = _rng.standard_normal((2, 5, 8))         # per-head codebooks, K = 5
_L = oracle.cholesky(np.eye(8) + 0.3 * np.ones((8, 8)))
_Z = np.array([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [2.0, 0.0]])   # 3 distinct rows of 5


def _with(x, index, value):
    y = np.array(x, dtype=np.float64, copy=True)
    y[index] = value
    return y


def _mask(empty_head=None):
    m = np.zeros((2, 6), bool)
    m[:, [0, 5]] = True
    if empty_head is not None:
        m[empty_head] = False
    return m


#: id -> (callable, args, kwargs, argument names any of which the message must contain, what is wrong)
CASES = {
    "attention_empty_kv_head": ("retrieval_attention", (_Q, _K, _V, _mask(empty_head=1)), {}, ("mask",),
                                "a mask whose KV head 1 selects no token (a softmax over nothing: every KV head must "
                                "select at least one token; filling with -1e9 averages every value instead)"),
    "attention_empty_row_of_batch": ("retrieval_attention", (np.stack([_Q, _Q]), np.stack([_K, _K]), np.stack([_V, _V]),
                                                            np.stack([_mask(), _mask(empty_head=0)])), {}, ("mask",),
                                     "a batched mask whose row 1, KV head 0 selects no token"),
    "attention_int_mask": ("retrieval_attention", (_Q, _K, _V, _mask().astype(np.int64)), {}, ("mask",),
                           "an int64 0/1 mask (mask must be bool: no silent cast)"),
    "select_nan_score": ("select_tokens", (_with(_rng.standard_normal((4, 6)), (1, 2), np.nan),),
                         dict(n_kv_heads=2, query_pos=5, w=1, sinks=1), ("scores",),
                         "scores holding NaN (a sort puts NaN anywhere; scores must be finite)"),
    "select_inf_score": ("select_tokens", (_with(_rng.standard_normal((4, 6)), (0, 3), np.inf),),
                         dict(n_kv_heads=2, query_pos=5, w=1, sinks=1), ("scores",), "scores holding +inf"),
    "token_scores_nan_lut": ("token_scores", (_with(_rng.standard_normal((4, 5)), (2, 1), np.nan),
                                              _rng.integers(0, 5, (2, 6)).astype(np.uint8)), {}, ("lut",),
                             "a LUT holding NaN"),
    "lut_inf_query": ("lut_scores", (_with(_Q, (0, 0), -np.inf), _CB), {}, ("q_b",), "q_b holding -inf"),
    "lut_nan_codebook": ("lut_scores", (_Q, _with(_CB, (1, 2, 3), np.nan)), {}, ("C",), "a codebook C holding NaN"),
    "z_transform_upper_L": ("z_transform", (_K[0], _L.T), {}, ("L",),
                            "L upper triangular (Lᵀ: EQ-16 needs the lower Cholesky factor, exact zeros above the diagonal)"),
    "assign_z_upper_L": ("assign_z", (_K[0], _CB[0], _L.T), {}, ("L",), "L upper triangular (Lᵀ)"),
    "back_transform_upper_L": ("back_transform", (_CB[0], _L.T), {}, ("L",), "L upper triangular (Lᵀ)"),
    "back_transform_negative_diagonal": ("back_transform", (_CB[0], _L * np.where(np.arange(8) == 3, -1.0, 1.0)), {},
                                         ("L",), "L with a negative diagonal entry (column 3 negated)"),
    "lloyd_fewer_points_than_centres": ("lloyd_step", (_Z[:2], _Z[:3] + 0.5), {}, ("z", "C", "K"),
                                        "N = 2 points for K = 3 centres (EQ-17-STEP needs N >= K)"),
    "kmeans_too_few_distinct_points": ("kmeans", (_Z, 4), dict(seed=0), ("z", "K"),
                                       "K = 4 with only 3 distinct rows of z (k-means++ would re-pick a point)"),
    "kmeans_max_iter_zero": ("kmeans", (_Z, 2), dict(seed=0, max_iter=0), ("max_iter",), "max_iter = 0 (need >= 1)"),
    "kmeans_negative_tol": ("kmeans", (_Z, 2), dict(seed=0, tol=-1e-4), ("tol",), "tol = -1e-4 (need >= 0)"),
    "topk_zero_fraction": ("topk_count", (10, 0.0), {}, ("topk",), "topk = 0.0 (a fraction must be in (0, 1])"),
    "topk_fraction_above_one": ("topk_count", (10, 1.5), {}, ("topk",), "topk = 1.5 (a fraction must be in (0, 1])"),
    "topk_bool": ("topk_count", (10, True), {}, ("topk",), "topk = True (bools are rejected, not read as 1)"),
    "topk_zero_count": ("topk_count", (10, 0), {}, ("topk",), "topk = 0 (an int count must be >= 1)"),
    "topk_no_tokens": ("topk_count", (0, 0.5), {}, ("T",), "T = 0 (need T >= 1)"),
}

#: EQ-17-INIT cases: kmeanspp_init(z, K, uniforms) is the explicit-randomness convention.
INIT_CASES = {
    "kmeanspp_too_few_distinct_points": ((_Z, 4, np.array([0.1, 0.2, 0.3, 0.4])), ("z", "K"),
                                         "K = 4 with only 3 distinct rows of z (a 4th centre would repeat a point)"),
    "kmeanspp_uniform_one": ((_Z, 2, np.array([0.3, 1.0])), ("uniforms",), "a uniform equal to 1.0 (need [0, 1))"),
    "kmeanspp_negative_uniform": ((_Z, 2, np.array([-0.1, 0.5])), ("uniforms",), "a uniform of -0.1 (need [0, 1))"),
    "kmeanspp_uniforms_shape": ((_Z, 2, np.array([0.1, 0.5, 0.7])), ("uniforms",), "3 uniforms for K = 2 (need (K,))"),
}


@pytest.mark.clause("INPUT-ERRORS")   # each case's own mark adds the callable it needs
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.clause("INPUT-ERRORS", needs=(CASES[c][0],)))
                                  for c in CASES])
def test_retrieval_and_codebook_inputs_are_checked(ctx, case):
    """EQ-16..18, EQ-17-STEP/FIT, RET-LUT/TOPK/SELECT/ATTN preconditions: ValueError naming the argument."""
    fn, args, kwargs, names, what = CASES[case]
    if fn == "select_tokens":            # a valid top-2 in the form the IUT takes: only the scores are wrong
        kwargs = dict(kwargs, topk=hh.topk_for_count(2, 6))
    if case == "topk_no_tokens":         # a valid topk in the form the IUT takes: only T is wrong
        args = (0, hh.topk_for_count(1, 2))
    ctx.note(case=case)
    ctx.expect_value_error(fn, *args, what=what, names=names, **kwargs)


@pytest.mark.clause("INPUT-ERRORS", needs=("kmeanspp_init",), requires=EXPLICIT)
@pytest.mark.parametrize("case", list(INIT_CASES))
def test_kmeanspp_init_inputs_are_checked(ctx, case):
    """EQ-17-INIT preconditions (at least K distinct rows; uniforms (K,) in [0, 1)): ValueError naming the argument."""
    (z, K, uniforms), names, what = INIT_CASES[case]
    ctx.note(case=case)
    ctx.expect_value_error("kmeanspp_init", z, K, uniforms=uniforms, what=what, names=names)   # uniforms by keyword
