"""The facts SPEC.md states about the authors' code, recomputed (a2ats_ref.bench.authors_checks)."""

import numpy as np
import pytest

from a2ats_ref.bench import authors_checks as ac
from a2ats_spec import oracle as _o

#: the facts behind SPEC's departures from the authors' code, each on the clause it departs in
pytestmark = pytest.mark.clause("RET-ATTN", "RET-TOPK", "EQ-17-STEP")


def test_zero_vector_collapse_never_raises_the_objective_but_wastes_a_code():
    # EQ-17-STEP's departure: the authors' clamp-to-1 rule sets an empty cluster's centre to 0. Each point's own
    # cluster is non-empty, so its centre moves to the members' mean; the objective cannot rise.
    rng = np.random.default_rng(0)
    rises, empties = 0, 0
    for trial in range(200):
        z = rng.standard_normal((24, 3)) + 4.0                      # data away from the origin, like pre-RoPE keys
        C = np.concatenate([z[rng.choice(24, 5, replace=False)], rng.standard_normal((3, 3)) * 30 + 60])
        f_prev = None
        for _ in range(4):
            C_new, f = ac.authors_lloyd_step(z, C)
            empties += int(np.sum(np.all(C_new == 0.0, axis=1)))
            if f_prev is not None and f > f_prev * (1 + 1e-12):
                rises += 1
            f_prev, C = f, C_new
    assert empties > 0, "the trials must exercise the empty-cluster rule"
    assert rises == 0
    ex = ac.zero_codeword_collapse()
    assert ex["authors"]["objective_after"] <= ex["objective_before"]
    assert ex["authors"]["codewords_used"] < ex["K"] == ex["spec"]["codewords_used"]
    assert ex["spec"]["objective_after"] < ex["authors"]["objective_after"]


def test_authors_lloyd_step_matches_the_oracle_when_no_cluster_is_empty():
    # Guards the reproduction itself: without empty clusters both rules are plain Lloyd.
    rng = np.random.default_rng(1)
    z = rng.standard_normal((40, 4))
    C = z[:5].copy()
    mine, f = ac.authors_lloyd_step(z, C)
    ref, _, f_ref = _o.lloyd_step(z, C)
    np.testing.assert_allclose(mine, ref, rtol=1e-12, atol=1e-12)
    assert abs(f - f_ref) <= 1e-12 * f_ref


def test_float32_topk_count_agrees_at_the_usual_fractions_and_not_at_029():
    res = ac.float32_topk_counts((0.03, 0.05, 0.1, 0.3, 0.29, 0.13), t_max=131072)
    by = {r["topk"]: r for r in res["rows"]}
    for f in (0.03, 0.05, 0.1, 0.3):
        assert by[f]["n_differ"] == 0, by[f]
    assert {"T": 100, "authors": 29, "spec": 28} in by[0.29]["examples"]
    assert by[0.13]["n_lower"] > 0                                    # the other direction exists too


def test_kernel_path_attends_at_b_minus_j():
    res = ac.kernel_attention_gap(positions=(199, 2048), d=32, n_q=2, n_kv=1)
    gap = {r["query_pos"]: r["max_abs_output_diff"] for r in res["rows"]}
    assert gap[2048] < 1e-12          # at i = b the two paths coincide
    assert gap[199] > 0.05
