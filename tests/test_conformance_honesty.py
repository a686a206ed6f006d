"""The conformance runner reports only verdicts the run earned: capabilities steer draws and mark what a port
does not support not-applicable / not-implemented (never fail).  Adapters: tests/honesty_adapters/."""

import json

import pytest

from a2ats_conformance.adapter import NotImplementedByIUT
from a2ats_conformance.cli import main
from a2ats_conformance.plugin import _not_implemented


def _run(tmp_path, *args):
    out = tmp_path / "r.json"
    code = main([*args, "-q", "--seed", "0", "--profile", "selftest", "--report-json", str(out)])
    rep = json.loads(out.read_text())
    return code, rep, {c: v["status"] for c, v in rep["clauses"].items()}


def test_fraction_only_port_gets_no_integer_topk(tmp_path):
    code, rep, st = _run(tmp_path, "--iut", "honesty_adapters.fraction_only",
                         "--clauses", "RET-TOPK,RET-SELECT,RET-DECODE,EQ-17-INIT")
    assert st == {"RET-TOPK": "pass", "RET-SELECT": "pass", "RET-DECODE": "pass", "EQ-17-INIT": "not-applicable"}, rep
    assert code == 0
    assert "randomness 'explicit'" in rep["clauses"]["EQ-17-INIT"]["reason"]
    assert rep["implementation"]["capabilities"]["topk"] == ["fraction"]


@pytest.mark.parametrize("adapter, status", [("NoTrim", "not-implemented"), ("DeclaredNoTrim", "not-applicable")])
def test_cache_without_trim(tmp_path, adapter, status):
    code, rep, st = _run(tmp_path, "--iut", f"honesty_adapters.partial_cache:{adapter}",
                         "--clauses", "CACHE-TRIM,CACHE-SAVE,CACHE-DECODE")
    assert st == {"CACHE-TRIM": status, "CACHE-SAVE": status, "CACHE-DECODE": "pass"}, rep["clauses"]
    assert code == 0
    assert "trim" in rep["clauses"]["CACHE-TRIM"]["reason"]


def test_not_implemented_inside_an_exception_group():
    err = NotImplementedByIUT("trim", owner="cache")
    group = ExceptionGroup("hypothesis found 2 distinct failures", [ValueError("other"), ExceptionGroup("x", [err])])
    assert _not_implemented(group) is err and _not_implemented(ValueError()) is None
