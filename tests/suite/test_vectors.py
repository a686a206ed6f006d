"""Golden vectors (format a2ats-golden-vectors/2): every clause covered, deterministic, versioned, and graded
from answer files: the reference, the oracle and the NumPy-only example port grade 100%, a wrong answer set
fails exactly the clauses it was built to fail, malformed answers are a clear error."""

import collections
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from a2ats_conformance.harness.adapter import ORACLE_IUT, load_adapter
from a2ats_conformance.run.cli import main as cli_main
from a2ats_conformance.vectors.grade import AnswersError, grade as _grade, grade_cases
from a2ats_conformance.report.writer import validate_report
from a2ats_conformance.vectors.export import FORMAT, MIN_CASES, check_vectors, load_vectors, write_answers, write_vectors
from a2ats_spec.clauses import SPEC_VERSION, clause_ids

EXAMPLE = os.path.join(os.path.dirname(__import__("a2ats_conformance").__file__), "examples", "answer_vectors.py")
STATELESS = [c for c in clause_ids() if not c.startswith("CACHE-")]
CACHE = [c for c in clause_ids() if c.startswith("CACHE-")]


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    d = tmp_path_factory.mktemp("vectors")
    assert cli_main(["vectors", "--out", str(d)]) == 0
    return str(d)


@pytest.fixture(scope="module")
def numpy_answers(vectors, tmp_path_factory):
    out = tmp_path_factory.mktemp("answers-numpy")
    subprocess.run([sys.executable, EXAMPLE, vectors, str(out)], check=True, capture_output=True)
    return str(out)


def grade(vectors, answers, dtype=None):
    """Every report these tests make is checked against the shipped schema."""
    report = _grade(vectors, answers, dtype)
    validate_report(report)
    return report


def _statuses(report):
    return {cid: c["status"] for cid, c in report["clauses"].items()}


def test_every_clause_is_covered(vectors):
    manifest, _ = load_vectors(vectors)
    assert manifest["format"] == FORMAT and manifest["spec_version"] == SPEC_VERSION
    per = collections.Counter(c["clause"] for c in manifest["calls"])
    assert set(per) == set(STATELESS)
    assert min(per.values()) >= MIN_CASES, per
    assert {t["clause"] for t in manifest["traces"]} == set(CACHE)
    notes = " ".join(c["note"] for c in manifest["calls"] + manifest["traces"])
    for case in ("exact tie", "w >= T", "sinks > T", "w = 0", "growth past 256", "uint8", "uint16", "batch 2",
                 "G = 1", "G = 4", "half-split", "speculative", "chunks", "save/load", "positions up to"):
        assert case in notes, case
    ops = [s["op"] for t in manifest["traces"] for s in t["steps"]]
    assert {"append", "decode", "prefill", "trim", "save_load"} <= set(ops)
    trims = [(t["id"], s) for t in manifest["traces"] for s in t["steps"] if s["op"] == "trim"]
    assert any(e["name"].endswith("offset") and e["value"] == 0 for _, s in trims for e in s["expect"]), "trim to 0"


def test_vectors_are_deterministic(vectors, tmp_path):
    write_vectors(str(tmp_path / "again"), seed=0)
    a, b = (json.loads(open(os.path.join(d, "manifest.json")).read()) for d in (vectors, tmp_path / "again"))
    assert a == b
    for f in sorted(os.listdir(tmp_path / "again" / "arrays"))[::40]:
        assert (tmp_path / "again" / "arrays" / f).read_bytes() == open(os.path.join(vectors, "arrays", f), "rb").read()


def test_reference_and_oracle_grade_100_percent(vectors, tmp_path):
    for iut, dtype in ((None, "float32"), (ORACLE_IUT, "float64")):
        answers = write_answers(vectors, load_adapter(iut), str(tmp_path / dtype), dtype)
        report = grade(vectors, answers)
        assert set(_statuses(report).values()) == {"pass"}, [(c, v) for c, v in report["clauses"].items()
                                                             if v["status"] != "pass"]


def test_numpy_example_port_grades_100_percent(vectors, numpy_answers, tmp_path):
    report_json = tmp_path / "r.json"
    assert cli_main(["grade", vectors, numpy_answers, "--report-json", str(report_json),
                     "--report-md", str(tmp_path / "r.md")]) == 0
    report = json.loads(report_json.read_text())
    validate_report(report)
    assert set(_statuses(report).values()) == {"pass"}
    assert report["implementation"]["name"].startswith("numpy_port")
    assert "| CACHE-TRIM | pass |" in (tmp_path / "r.md").read_text()


def test_example_imports_only_numpy_and_the_standard_library():
    import ast

    tree = ast.parse(open(EXAMPLE, encoding="utf-8").read())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods - set(sys.stdlib_module_names) - {"__future__"} == {"numpy", "numpy_port"}


def _corrupt(vectors, answers, out):
    """A wrong answer set: one wrong answer for each clause in WRONG, no answers at all for EQ-17-FIT."""
    shutil.copytree(answers, out)
    manifest, dec = load_vectors(vectors)
    calls = {c["id"]: c for c in manifest["calls"]}

    def first(clause, pred=lambda c: True):
        return next(c for c in manifest["calls"] if c["clause"] == clause and pred(c))

    # EQ-14: a code outside the allowed set
    c = first("EQ-14")
    allowed = dec(c["outputs"][0]["allowed"])
    codes = np.load(out / f"{c['id']}.out0.npy")
    codes.flat[0] = next(j for j in range(100) if j not in allowed.reshape(-1, allowed.shape[-1])[0])
    np.save(out / f"{c['id']}.out0.npy", codes)
    # RET-SELECT: drop a token that must be selected
    c = first("RET-SELECT")
    must = dec(c["outputs"][0]["must"])
    m = np.load(out / f"{c['id']}.out0.npy")
    m[tuple(np.argwhere(must)[0])] = False
    np.save(out / f"{c['id']}.out0.npy", m)
    # PREFILL: an output off by 1e-2
    c = first("PREFILL")
    np.save(out / f"{c['id']}.out0.npy", np.load(out / f"{c['id']}.out0.npy") + 1e-2)
    # INPUT-ERRORS: a bad input answered instead of rejected
    c = first("INPUT-ERRORS")
    os.remove(out / f"{c['id']}.error")
    np.save(out / f"{c['id']}.out0.npy", np.zeros(3))
    # CODES-DTYPE: uint16 for K = 256
    c = first("CODES-DTYPE", lambda c: c["args"][0]["value"] == 256)
    np.save(out / f"{c['id']}.out0.npy", np.zeros((), np.uint16))
    # EQ-17-FIT: not answered at all
    for f in os.listdir(out):
        if f.startswith("EQ-17-FIT."):
            os.remove(out / f)
    # CACHE-TRIM: trim reports a wrong count
    t = next(t for t in manifest["traces"] if t["clause"] == "CACHE-TRIM")
    n = next(i for i, s in enumerate(t["steps"]) if s["op"] == "trim")
    np.save(out / f"{t['id']}.{n:03d}.trimmed.npy", np.int64(99))
    # CACHE-FAR-CODES: uint16 codes for K = 256
    t = next(t for t in manifest["traces"] if t["clause"] == "CACHE-FAR-CODES" and "K = 256" in t["note"])
    f = f"{t['id']}.000.codes.npy"
    np.save(out / f, np.load(out / f).astype(np.uint16))
    assert calls
    return {"EQ-14", "RET-SELECT", "PREFILL", "INPUT-ERRORS", "CODES-DTYPE", "CACHE-TRIM", "CACHE-FAR-CODES"}


def test_wrong_answers_fail_exactly_their_clauses(vectors, numpy_answers, tmp_path):
    wrong = _corrupt(vectors, numpy_answers, tmp_path / "wrong")
    report = grade(vectors, str(tmp_path / "wrong"))
    st = _statuses(report)
    assert {c for c, s in st.items() if s == "fail"} == wrong
    assert {c for c, s in st.items() if s == "not-implemented"} == {"EQ-17-FIT"}
    assert {c for c, s in st.items() if s not in ("fail", "not-implemented")} == set(clause_ids()) - wrong - {"EQ-17-FIT"}
    assert set(st[c] for c in st if c not in wrong | {"EQ-17-FIT"}) == {"pass"}
    assert report["summary"]["failed_clauses"] == sorted(wrong)
    junit = tmp_path / "junit.xml"
    assert cli_main(["grade", vectors, str(tmp_path / "wrong"), "--junit-xml", str(junit)]) == 1
    suite = ET.parse(junit).getroot()
    cases = {c.get("name").split(" ")[0]: c for c in suite.iter("testcase")}
    assert list(cases) == clause_ids()
    assert {cid for cid, c in cases.items() if c.find("failure") is not None} == wrong
    assert {cid for cid, c in cases.items() if c.find("skipped") is not None} == {"EQ-17-FIT"}
    assert suite.get("failures") == str(len(wrong)) and suite.get("tests") == str(len(clause_ids()))
    msg = report["clauses"]["CACHE-TRIM"]["counterexample"]["message"]
    assert "trimmed" in msg and "step" in msg


def test_missing_and_misnamed_answers(vectors, numpy_answers, tmp_path):
    out = tmp_path / "partial"
    shutil.copytree(numpy_answers, out)
    manifest, _ = load_vectors(vectors)
    victim = next(c for c in manifest["calls"] if c["clause"] == "RET-ATTN")
    os.rename(out / f"{victim['id']}.out0.npy", out / f"{victim['id']}.output0.npy")
    report = grade(vectors, str(out))
    assert _statuses(report)["RET-ATTN"] == "fail"   # other RET-ATTN cases were answered: a gap is a failure
    assert "no answer" in report["clauses"]["RET-ATTN"]["counterexample"]["message"]
    assert any("output0" in w for w in report["xfail_warnings"])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert set(_statuses(grade(vectors, str(empty))).values()) == {"not-implemented"}


def test_capabilities_in_answers_make_cases_not_applicable(vectors, numpy_answers, tmp_path):
    out = tmp_path / "caps"
    shutil.copytree(numpy_answers, out)
    meta = json.loads((out / "answers.json").read_text())
    meta["capabilities"] = {"rope_layouts": ["traditional"], "cache_ops": ["append", "decode", "prefill"]}
    (out / "answers.json").write_text(json.dumps(meta))
    res = grade_cases(vectors, str(out))
    res.pop("__unused__")
    manifest, _ = load_vectors(vectors)
    halves = [t["id"] for t in manifest["traces"] if "half" in t["requires"]["rope_layouts"]]
    assert halves and all(res[i]["outcome"] == "not-applicable" for i in halves)
    assert res[next(t["id"] for t in manifest["traces"] if t["clause"] == "CACHE-SAVE")]["outcome"] == "not-applicable"
    assert all(r["outcome"] in ("passed", "not-applicable") for r in res.values())
    assert _statuses(grade(vectors, str(out)))["CACHE-SAVE"] == "not-applicable"


def test_malformed_answers_are_a_clear_error(vectors, numpy_answers, tmp_path, capsys):
    out = tmp_path / "bad"
    shutil.copytree(numpy_answers, out)
    name = next(f for f in sorted(os.listdir(out)) if f.startswith("EQ-13.") and f.endswith(".npy"))
    (out / name).write_bytes(b"not an npy file")
    with pytest.raises(AnswersError, match=name.replace(".", r"\.")):
        grade(vectors, str(out))
    assert cli_main(["grade", vectors, str(out)]) == 2
    assert name in capsys.readouterr().err
    np.save(out / name, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(AnswersError, match="no pickled objects"):
        grade(vectors, str(out))


def test_v1_and_v2_readers_refuse_each_other(vectors, tmp_path):
    manifest, _ = load_vectors(vectors)
    # A v1 reader checked format == "a2ats-golden-vectors/1" and then read manifest["cases"]: v2 has neither,
    # so even a reader that skips the format check fails at once instead of reading the calls without traces.
    assert manifest["format"] != "a2ats-golden-vectors/1" and "cases" not in manifest
    old = tmp_path / "v1"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"format": "a2ats-golden-vectors/1", "cases": []}))
    with pytest.raises(ValueError, match="a2ats-golden-vectors/1 vectors .*Regenerate"):
        load_vectors(str(old))
    assert cli_main(["grade", str(old), str(tmp_path)]) == 2


def test_check_vectors_catches_a_mutant(vectors):
    problems = check_vectors(vectors, load_adapter("a2ats_conformance.mutants:CompressionOnly"))
    assert problems and {cid.split(".")[0] for cid, _ in problems} == {"RET-DECODE"}


def test_version_prints_package_spec_and_formats(capsys):
    assert cli_main(["--version"]) == 0
    out = capsys.readouterr().out
    assert f"spec {SPEC_VERSION}" in out and FORMAT in out and "a2ats-conformance " in out


def test_report_schema_validator_rejects_what_it_must(vectors, numpy_answers):
    from a2ats_conformance.run.cli import STATUS_ORDER
    from a2ats_conformance.report.writer import SCHEMA, validate

    report = json.loads(json.dumps(grade(vectors, numpy_answers), default=str))
    assert set(STATUS_ORDER) <= set(SCHEMA["$defs"]["verdict"]["properties"]["status"]["enum"])
    for mutate, expect in ((lambda r: r.pop("spec"), "missing required property 'spec'"),
                           (lambda r: r["spec"].update(sha256="abc"), "does not match"),
                           (lambda r: r["clauses"]["EQ-11"].update(status="passed"), "is not one of"),
                           (lambda r: r["platform"]["device"].update(type="tpu"), "is not one of"),
                           (lambda r: r.update(seed="0"), "expected integer or null"),
                           (lambda r: r["implementation"]["capabilities"].update(topk=["most"]), "is not one of")):
        bad = json.loads(json.dumps(report))
        mutate(bad)
        errors = validate(bad, SCHEMA)
        assert any(expect in e for e in errors), (expect, errors)
    assert validate(report, SCHEMA) == []
    with pytest.raises(ValueError, match="outside the supported subset"):
        validate({}, {"oneOf": []})


def test_full_size_has_realistic_cases_and_stays_under_50_mb(tmp_path):
    write_vectors(str(tmp_path), size="full")
    manifest, dec = load_vectors(str(tmp_path))
    per = collections.Counter(c["clause"] for c in manifest["calls"])
    assert set(per) == set(STATELESS) and min(per.values()) >= MIN_CASES
    realistic = collections.Counter(c["clause"] for c in manifest["calls"] if c["note"].startswith("realistic"))
    assert set(realistic) >= set(STATELESS) - {"ROPE-FREQ", "RET-TOPK", "CODES-DTYPE", "INPUT-ERRORS"}, realistic
    notes = " ".join(c["note"] for c in manifest["calls"])
    for what in ("K=4096", "d=128", "d=64", "G=4", "T=2048", "T=4096", "near ties"):
        assert what in notes, what
    assert {t["clause"] for t in manifest["traces"]} == set(CACHE)
    long = next(t for t in manifest["traces"] if "131,072" in t["note"])
    assert sum(dec(s["keys"]).shape[-2] for s in long["steps"] if s["op"] == "append") == 131_073
    size = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert size < 50e6, f"full vectors take {size / 1e6:.1f} MB"


def test_decode_output_is_graded_over_the_ports_own_selection(vectors, numpy_answers, tmp_path):
    """Near ties: another allowed selection with its own exact attention passes; the oracle's output with it fails."""
    from a2ats_spec import oracle

    manifest, dec = load_vectors(vectors)
    case = next(c for c in manifest["calls"] if c["function"] == "decode_step" and not c["outputs"][1]["unique"]
                and (dec(c["outputs"][1]["may"]) & ~np.load(os.path.join(numpy_answers, f"{c['id']}.out1.npy"))).any())
    out = tmp_path / "ties"
    shutil.copytree(numpy_answers, out)
    mask = np.load(out / f"{case['id']}.out1.npy")
    extra = dec(case["outputs"][1]["may"]) & ~mask
    mask[tuple(np.argwhere(extra)[0])] = True            # still must <= M <= may
    np.save(out / f"{case['id']}.out1.npy", mask)
    q, k, v = (dec(a).astype(np.float64) for a in case["args"][:3])
    res = grade_cases(vectors, str(out))
    assert res[case["id"]]["outcome"] == "fail" and "own selection" in res[case["id"]]["message"]
    np.save(out / f"{case['id']}.out0.npy", oracle.retrieval_attention(q, k, v, mask))
    assert grade_cases(vectors, str(out))[case["id"]]["outcome"] == "passed"
