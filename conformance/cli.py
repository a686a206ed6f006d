"""``a2ats-conformance``: run the conformance suite against an implementation and report per clause.

    a2ats-conformance [--iut module:object] [--profile quick|ci|thorough] [--dtype D|all]
                      [--report-json F] [--report-md F] [--xfails F] [-n N] [--clauses ID,...]
                      [--seed S] [--counterexample-dir DIR] [-k EXPR] [-v]
    a2ats-conformance vectors --out DIR [--size small|full] [--seed S]
    a2ats-conformance grade VECTORS_DIR ANSWERS_DIR [--report-json F] [--report-md F]
    a2ats-conformance --version

The suite runs in-process under pytest (pytest-xdist when -n > 1).  Exit status: 0 when no
clause fails (xfailed and not-implemented clauses do not count), 1 when a clause fails, 2 on a
usage or collection error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

__all__ = ["main", "run_suite", "clause_table", "SUITE_DIR"]

SUITE_DIR = os.path.dirname(os.path.abspath(__file__))
STATUS_ORDER = ("fail", "xfail", "not-implemented", "not-applicable", "pass", "untested")


def clause_table(tests: dict, clause_ids: list[str]) -> dict:
    """Aggregate per-test results into per-clause verdicts.

    A clause fails if any test citing it fails (xpass counts as pass); it is "xfail" if its only
    failures are known deviations; "not-implemented" if every test citing it was skipped for a
    missing callable; "not-applicable" if every test citing it needs a capability the IUT does not
    declare; "untested" if no test citing it ran (e.g. deselected by --clauses) or no example ran.
    """
    def outcome_for(r, cid):
        # A ConformanceFailure names the clause it checked: the test fails that clause only.
        blamed = (r.get("counterexample") or {}).get("clause")
        if r["outcome"] == "fail" and blamed in r.get("clauses", []) and blamed != cid:
            return "passed-other"
        return r["outcome"]

    out = {}
    for cid in clause_ids:
        recs = [(nid, dict(r, outcome=outcome_for(r, cid))) for nid, r in tests.items() if cid in r.get("clauses", [])]
        outcomes = [r["outcome"] for _, r in recs]
        examples = sum(r.get("examples", 0) for _, r in recs)
        entry: dict = {"tests": len(recs), "examples": examples}
        if any(o == "fail" for o in outcomes):
            entry["status"] = "fail"
            nid, r = next((nid, r) for nid, r in recs if r["outcome"] == "fail")
            entry["counterexample"] = dict(r.get("counterexample") or {}, test=nid)
            entry["failed_tests"] = [nid for nid, r in recs if r["outcome"] == "fail"]
        elif any(o == "xfail" for o in outcomes):
            entry["status"] = "xfail"
            entry["reason"] = next(r.get("reason", "") for _, r in recs if r["outcome"] == "xfail")
        elif outcomes and all(o in ("not-implemented", "not-applicable", "skip") for o in outcomes) \
                and not {"not-implemented", "not-applicable"}.isdisjoint(outcomes):
            entry["status"] = "not-implemented" if "not-implemented" in outcomes else "not-applicable"
            entry["reason"] = next(r.get("reason", "") for _, r in recs if r["outcome"] == entry["status"])
        elif any(o in ("passed", "xpass", "passed-other") for o in outcomes) and examples > 0:
            entry["status"] = "pass"
        else:
            entry["status"] = "untested"
        entry["counterexample"] = entry.get("counterexample")
        out[cid] = entry
    return out


def _pytest_args(a, results_path: str, ini_path: str) -> list[str]:
    # Our own empty ini file: a project's pytest configuration must not leak into the suite.
    args = [SUITE_DIR, "-c", ini_path, "--rootdir", SUITE_DIR, "-p", "no:cacheprovider",
            f"--hypothesis-profile={a.profile}", f"--a2ats-results={results_path}", "-q" if not a.verbose else "-v",
            "--tb=short", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if a.iut:
        args.append(f"--iut={a.iut}")
    if a.dtype:
        args.append(f"--a2ats-dtype={a.dtype}")
    if a.xfails:
        args.append(f"--xfails={a.xfails}")
    if a.clauses:
        args.append(f"--clauses={a.clauses}")
    if a.counterexample_dir:
        args.append(f"--counterexample-dir={a.counterexample_dir}")
    if a.seed is not None:
        args.append(f"--hypothesis-seed={a.seed}")
    if a.k:
        args += ["-k", a.k]
    if a.n and a.n > 1:
        args += ["-n", str(a.n), "-p", "xdist"]
    else:
        args += ["-p", "no:xdist"]
    return args


def run_suite(a) -> dict:
    """Run pytest on the installed suite; returns the report dict (see write_json)."""
    import pytest
    from hypothesis import settings

    from a2ats_spec.clauses import clause_ids

    from .plugin import current_profile

    t0 = time.time()
    before = current_profile()
    with tempfile.TemporaryDirectory() as tmp:
        results_path = os.path.join(tmp, "results.json")
        ini_path = os.path.join(tmp, "pytest.ini")
        with open(ini_path, "w", encoding="utf-8") as f:
            f.write("[pytest]\n")
        stdout = sys.stdout
        if a.quiet:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - restored below
        try:
            code = pytest.main(_pytest_args(a, results_path, ini_path))
        finally:
            if a.quiet:
                sys.stdout.close()
                sys.stdout = stdout
            settings.load_profile(before)
        raw = {}
        if os.path.exists(results_path):
            with open(results_path, encoding="utf-8") as f:
                raw = json.load(f)
    ids = clause_ids()
    if a.clauses:
        only = {c.strip() for c in a.clauses.split(",")}
        ids = [c for c in ids if c in only]
    clauses = clause_table(raw.get("tests", {}), ids)
    summary = {s: sum(1 for c in clauses.values() if c["status"] == s) for s in STATUS_ORDER}
    failed = sorted(c for c, v in clauses.items() if v["status"] == "fail")
    return {
        "implementation": raw.get("implementation", {"iut": a.iut}),
        "profile": a.profile,
        "seed": a.seed,
        "clauses": clauses,
        "tests": raw.get("tests", {}),
        "summary": dict(summary, failed_clauses=failed, pytest_exit=int(code)),
        "xfail_warnings": raw.get("xfail_warnings", []),
        "wall_s": round(time.time() - t0, 2),
    }


def exit_status(report: dict) -> int:
    code = report["summary"]["pytest_exit"]
    if code in (2, 3, 4) or not report["tests"]:   # interrupted, internal error, usage error, nothing ran
        return 2
    return 1 if report["summary"]["failed_clauses"] else 0


def format_table(report: dict) -> str:
    impl = report["implementation"]
    lines = [f"A2ATS conformance: {impl.get('name', '?')} {impl.get('version', '')} "
             f"[{impl.get('iut', '')}] dtype {impl.get('dtype', '?')}, profile {report['profile']}",
             f"{'clause':<20} {'status':<16} {'tests':>5} {'examples':>8}  note"]
    for cid, c in report["clauses"].items():
        note = ""
        if c["status"] == "fail":
            cex = c.get("counterexample") or {}
            note = (cex.get("message") or "").splitlines()[0][:90] if cex.get("message") else ""
        elif c.get("reason"):
            note = c["reason"][:90]
        lines.append(f"{cid:<20} {c['status']:<16} {c['tests']:>5} {c['examples']:>8}  {note}")
    s = report["summary"]
    lines.append(", ".join(f"{k} {s[k]}" for k in STATUS_ORDER) + f"; wall {report['wall_s']} s")
    for w in report.get("xfail_warnings", []):
        lines.append(f"warning (xfails file): {w}")
    return "\n".join(lines)


def _caps_line(caps) -> str:
    if not caps:
        return "full support"
    return "; ".join(f"{k}: {v if isinstance(v, str) else ', '.join(v)}" for k, v in caps.items())


def format_markdown(report: dict) -> str:
    impl = report["implementation"]
    out = [f"# A2ATS conformance report", "",
           f"- implementation: **{impl.get('name', '?')}** {impl.get('version', '')} (`{impl.get('iut', '')}`)",
           f"- dtype: {impl.get('dtype', '?')}; Hypothesis profile: {report['profile']}; wall: {report['wall_s']} s",
           f"- missing callables: {', '.join(impl.get('missing', [])) or 'none'}",
           f"- declared capabilities: {_caps_line(impl.get('capabilities'))}", "",
           "| clause | status | tests | examples | counterexample / note |", "|---|---|---:|---:|---|"]
    for cid, c in report["clauses"].items():
        note = ""
        cex = c.get("counterexample") or {}
        if c["status"] == "fail":
            msg = (cex.get("message") or "").splitlines()[0] if cex.get("message") else ""
            note = f"{msg} — `{cex.get('repro', '')}`".replace("|", "\\|")
        elif c.get("reason"):
            note = c["reason"].replace("|", "\\|")
        out.append(f"| {cid} | {c['status']} | {c['tests']} | {c['examples']} | {note} |")
    for w in report.get("xfail_warnings", []):
        out.append(f"\n> warning (xfails file): {w}")
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a2ats-conformance", description="A2ATS conformance suite (per-clause verdicts).")
    p.add_argument("--iut", default=None, help="adapter 'module:object' (default: $A2ATS_IUT, else the MLX reference)")
    p.add_argument("--profile", default="ci", choices=["quick", "ci", "thorough", "selftest"],
                   help="Hypothesis profile: quick (8 examples), ci (default, 50), thorough (500); selftest = 12, no shrinking")
    p.add_argument("--dtype", default=None, help="input dtype to test, comma list, or 'all' (default: the adapter's first)")
    p.add_argument("--report-json", default=None, metavar="F")
    p.add_argument("--report-md", default=None, metavar="F")
    p.add_argument("--xfails", default=None, metavar="F", help="known deviations: '<clause-or-test-id-prefix>  # reason'")
    p.add_argument("-n", type=int, default=1, help="worker processes (pytest-xdist) when > 1")
    p.add_argument("--clauses", default=None, help="comma-separated clause IDs to run (default: all)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    p.add_argument("--counterexample-dir", default=None, metavar="DIR")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true", help="no pytest output, only the table")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "vectors":
        from .vectors import main as vectors_main

        return vectors_main(argv[1:])
    if argv and argv[0] == "grade":
        from .grade import main as grade_main

        return grade_main(argv[1:])
    if argv[:1] == ["--version"]:
        from .versions import version_text

        print(version_text())
        return 0
    a = _parser().parse_args(argv)
    if a.xfails:
        from .xfails import read_xfails

        try:
            read_xfails(a.xfails)
        except ValueError as exc:
            print(f"a2ats-conformance: {exc}", file=sys.stderr)
            return 2
    from .adapter import AdapterError, load_adapter

    try:
        load_adapter(a.iut)
    except AdapterError as exc:
        print(f"a2ats-conformance: {exc}", file=sys.stderr)
        return 2
    report = run_suite(a)
    from .xfails import XfailWarning

    for w in report["xfail_warnings"]:
        warnings.warn(f"known-deviations file {a.xfails}: {w}", XfailWarning, stacklevel=1)
    print(format_table(report))
    if a.report_json:
        with open(a.report_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, default=str)
    if a.report_md:
        with open(a.report_md, "w", encoding="utf-8") as f:
            f.write(format_markdown(report))
    return exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
