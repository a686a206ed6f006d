"""Faithful ports pass the ci profile with 0 fail; each unfaithful port fails the clause
its bug violates and the report names the bug as the likely cause (deviation id of
conformance/diagnosis/deviations.py)."""

import numpy as np
import pytest

import port_unfaithful as U   # tests/suite/ports is on sys.path (conftest.py)
from a2ats_spec.clauses import clause_ids

_CACHE = [c for c in clause_ids() if c.startswith("CACHE-")]
#: port -> (the clauses its trait touches, the clauses it must read as not-applicable). The other clauses run
#: the NumPy port's own callables unchanged, which test_numpy_port_passes_ci_profile checks.
FAITHFUL = {
    "port_fraction_topk:Adapter": (["RET-TOPK", "RET-SELECT", "RET-DECODE", "CODES-DTYPE", *_CACHE],
                                   {"CACHE-TRIM", "CACHE-SAVE"} | ({"CACHE-BATCH"} & set(_CACHE))),
    "port_own_rng:Adapter": (["EQ-17-INIT", "EQ-17-FIT"], set()),
    "port_own_token_from_key:Adapter": (["RET-DECODE"], set()),
    "port_hf_rope:Adapter": (["ROPE-FREQ"], set()),
    "port_half_layout:Adapter": (["INPUT-ERRORS", "ROPE-APPLY", "ROPE-INVERSE", "EQ-10", "EQ-11", "EQ-12",
                                  "RET-DECODE", *_CACHE], set()),
}
NUMPY_PORT = "a2ats_conformance.examples.numpy_port:NumpyPort"


def test_numpy_port_passes_ci_profile(run_suite):
    """The independent NumPy port passes every clause at float64 and float32."""
    code, rep = run_suite(NUMPY_PORT, "--profile", "ci", "-n", "2", "--seed", "0", "--dtype", "float64,float32")
    verdicts = {c: v["status"] for c, v in rep["clauses"].items()}
    assert code == 0 and set(verdicts.values()) == {"pass"} and set(verdicts) == set(clause_ids()), verdicts


@pytest.mark.parametrize("iut", sorted(FAITHFUL))
def test_faithful_port_passes_ci_profile(run_suite, iut):
    clauses, not_applicable = FAITHFUL[iut]
    # one process: xdist's workers would each start and collect the suite for a handful of clauses
    code, rep = run_suite(iut, "--profile", "ci", "--seed", "0", "--clauses", ",".join(clauses))
    verdicts = {c: v["status"] for c, v in rep["clauses"].items()}
    assert code == 0 and set(verdicts) == set(clauses), verdicts
    assert {c for c, s in verdicts.items() if s == "not-applicable"} == not_applicable, verdicts
    assert all(s == "pass" for c, s in verdicts.items() if c not in not_applicable), verdicts
    if iut.startswith("port_own_rng"):   # only the stream-independent k-means properties ran
        ran = {k.split("[")[0].split("::")[-1] for k, v in rep["tests"].items() if v["outcome"] == "passed"}
        assert "test_seeding_frequencies_are_d2_weighted" in ran and "test_kmeanspp_init_matches_oracle" not in ran


def test_hf_rope_port_without_its_declaration_is_told_why(run_suite):
    """transformers' llama3 rule raises KeyError on a left-out key: undeclared, the port fails ROPE-FREQ with a
    message that names the left-out keys, the defaults and the capability to declare."""
    code, rep = run_suite("port_hf_rope:Undeclared", "--profile", "ci", "--seed", "0", "--clauses", "ROPE-FREQ")
    assert code == 1 and rep["clauses"]["ROPE-FREQ"]["status"] == "fail"
    msg = next(v["counterexample"]["message"] for k, v in rep["tests"].items()
               if "test_llama3_left_out_keys_take_the_defaults" in k and v["outcome"] == "fail")
    assert "KeyError" in msg and "leaves out" in msg and "'rope_scaling': ('complete',)" in msg, msg


@pytest.mark.parametrize("name", sorted(U.UNFAITHFUL))
def test_unfaithful_port_is_named(run_suite, name):
    cls = U.UNFAITHFUL[name]
    args = ["--profile", cls.profile, "--seed", "0", "--clauses", cls.clause, *([] if cls.deviation else ["--no-diagnosis"])]
    code, rep = run_suite(f"port_unfaithful:{name}", *args, *(["-k", cls.test] if cls.test else []))
    assert code == 1 and rep["clauses"][cls.clause]["status"] == "fail", f"{name} ({cls.__doc__}) not rejected"
    failing = {k: v for k, v in rep["tests"].items() if v["outcome"] == "fail" and cls.clause in v["clauses"]}
    if cls.test:
        assert any(cls.test in k for k in failing), sorted(failing)
    if cls.deviation:
        causes = {c["id"] for v in failing.values() for c in v.get("counterexample", {}).get("likely_causes", [])}
        assert cls.deviation in causes, f"{name}: likely causes {sorted(causes)}, expected {cls.deviation}"


def test_decode_scaffold_without_a_bug_is_the_numpy_port():
    """The unfaithful decode ports differ from the NumPy port by their one bug only: with no part replaced,
    their decode scaffold gives the NumPy port's output and selection (batched inputs included)."""
    P = U.P
    rng = np.random.default_rng(1)
    n_kv, n_q, d, K, T = 2, 4, 8, 5, 12
    q, k, v = rng.standard_normal((3, n_q, d)), rng.standard_normal((3, n_kv, T, d)), rng.standard_normal((3, n_kv, T, d))
    codes, C = rng.integers(0, K, (3, n_kv, T)), rng.standard_normal((n_kv, K, d))
    kw = dict(query_pos=T - 3, b=64, w=2, sinks=1, topk=0.3, inv_freqs=P.rope_inv_freqs(d, 1e4), traditional=False,
              return_mask=True)
    o1, m1 = U._decode_with()(q, k, v, codes, C, **kw)
    o2, m2 = P.decode_step(q, k, v, codes, C, **kw)
    assert (m1 == m2).all() and abs(o1 - o2).max() < 1e-12


import port_multi as M   # noqa: E402


def test_authors_port_exits_0_with_its_xfails_and_each_choice_named(run_suite, tmp_path):
    """A port on the authors' documented choices: with the xfails those choices need the run exits 0, and the
    profile names each choice (and nothing else departs)."""
    xf = tmp_path / "authors-xfails.txt"
    xf.write_text("".join(f"{c}  # {why}\n" for c, why in M.AuthorsPort.xfails.items()))
    # the choices are named by the port profile; the xfailed clauses' diagnosis would only add minutes
    code, rep = run_suite("port_multi:AuthorsPort", "--profile", "quick", "-n", "2", "--seed", "0", "--xfails", str(xf),
                          "--no-diagnosis")
    verdicts = {c: v["status"] for c, v in rep["clauses"].items()}
    assert code == 0, verdicts
    found = {r["mechanism"]: r["variant"] for r in rep["port_profile"] if r["status"] != "spec"}
    assert found == M.AuthorsPort.named, found
    assert all(r["kind"] == "authors" for r in rep["port_profile"] if r["status"] == "variant")
