"""The conformance suite run end to end: the MLX reference and the float64 oracle both conform."""

import json

import pytest

from a2ats_conformance.run.cli import main


def _run(tmp_path, *args):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    code = main([*args, "-q", "--seed", "0", "--report-json", str(out), "--report-md", str(md)])
    return code, json.loads(out.read_text()), md.read_text()


def test_reference_conforms(tmp_path):
    code, rep, md = _run(tmp_path, "--profile", "quick")
    failed = {c: v["counterexample"] for c, v in rep["clauses"].items() if v["status"] == "fail"}
    assert code == 0 and not failed, failed
    from a2ats_spec.clauses import clause_ids

    assert set(rep["clauses"]) == set(clause_ids())
    assert all(v["status"] == "pass" for v in rep["clauses"].values()), {c: v["status"] for c, v in rep["clauses"].items()}
    impl = rep["implementation"]
    assert impl["name"].startswith("a2ats_ref") and impl["version"]
    # the header names every dtype that ran: float32, and the half precisions the matrix clauses add
    assert impl["dtype"] == ("float32 (+float16,bfloat16 for CACHE-DECODE, PREFILL, RET-ATTN, RET-DECODE, "
                             "RET-LUT)"), impl["dtype"]
    assert rep["summary"]["fail"] == 0 and rep["wall_s"] > 0
    assert rep["run"]["complete"] and not rep["run"]["crashes"] and not rep["run"]["error"]
    assert all(v["examples"] > 0 for v in rep["clauses"].values())
    assert not [c for c, v in rep["clauses"].items() if v.get("not_run")]   # every test of every clause ran
    assert "| EQ-14 | pass |" in md


def test_oracle_conforms_at_float64(tmp_path):
    code, rep, _ = _run(tmp_path, "--profile", "selftest", "--iut", "a2ats_conformance.adapters.oracle:OracleAdapter")
    assert code == 0, {c: v for c, v in rep["clauses"].items() if v["status"] == "fail"}
    assert rep["implementation"]["dtype"] == "float64"
    st = {c: v["status"] for c, v in rep["clauses"].items()}
    assert all(s == "pass" for s in st.values()), st      # OracleCache runs the CACHE-* clauses too


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reference_low_precision_smoke(tmp_path, dtype):
    code, rep, _ = _run(tmp_path, "--profile", "selftest", "--dtype", dtype, "--clauses", "ROPE-APPLY,RET-DECODE,PREFILL")
    assert code == 0, {c: v for c, v in rep["clauses"].items() if v["status"] == "fail"}
    assert rep["implementation"]["dtype"] == dtype
