"""Issue 9, "Done when": faithful ports pass the ci profile with 0 fail; each unfaithful port fails the clause
its bug violates and the report names the bug as the likely cause (deviation id of conformance/deviations.py)."""

import importlib.util

import pytest

import port_unfaithful as U   # tests/ports is on sys.path (conftest.py)

FAITHFUL = ["port_fraction_topk:Adapter", "port_own_rng:Adapter", "port_half_layout:Adapter"]
#: Diagnosis (likely causes) ships with conformance/deviations.py; until it does, only the clause is asserted.
DIAGNOSIS = importlib.util.find_spec("a2ats_conformance.deviations") is not None
#: Faithful ports declare capabilities (conformance/capabilities.py); without that plumbing they cannot pass.
CAPABILITIES = importlib.util.find_spec("a2ats_conformance.capabilities") is not None


@pytest.mark.skipif(not CAPABILITIES, reason="waits for conformance/capabilities.py (runner, issue 9 item 1)")
@pytest.mark.parametrize("iut", FAITHFUL)
def test_faithful_port_passes_ci_profile(run_suite, iut):
    code, rep = run_suite(iut, "--profile", "ci", "-n", "2", "--seed", "0")
    verdicts = {c: v["status"] for c, v in rep["clauses"].items()}
    bad = {c: s for c, s in verdicts.items() if s not in ("pass", "not-applicable", "not-implemented")}
    assert not bad and code == 0, f"{iut}: {bad}"
    assert list(verdicts.values()).count("pass") >= 20, verdicts     # it was really tested


@pytest.mark.parametrize("name", sorted(U.UNFAITHFUL))
def test_unfaithful_port_is_named(run_suite, name):
    cls = U.UNFAITHFUL[name]
    args = ["--profile", cls.profile, "--seed", "0", "--clauses", cls.clause]
    code, rep = run_suite(f"port_unfaithful:{name}", *args, *(["-k", cls.test] if cls.test else []))
    assert code == 1 and rep["clauses"][cls.clause]["status"] == "fail", f"{name} ({cls.__doc__}) not rejected"
    failing = {k: v for k, v in rep["tests"].items() if v["outcome"] == "fail" and cls.clause in v["clauses"]}
    if cls.test:
        assert any(cls.test in k for k in failing), sorted(failing)
    if cls.deviation and DIAGNOSIS:
        causes = {c["id"] for v in failing.values() for c in v.get("counterexample", {}).get("likely_causes", [])}
        assert cls.deviation in causes, f"{name}: likely causes {sorted(causes)}, expected {cls.deviation}"
