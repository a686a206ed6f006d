"""``a2ats-conformance``: run the conformance suite against an implementation and report per clause.

    a2ats-conformance [--iut module:object] [--profile quick|ci|thorough] [--dtype D|all]
                      [--report-json F] [--report-md F] [--junit-xml F] [--xfails F] [-n N] [--clauses ID,...]
                      [--seed S] [--counterexample-dir DIR] [--example-timeout S] [-k EXPR] [-v]
    a2ats-conformance vectors --out DIR [--size small|full] [--seed S]
    a2ats-conformance grade VECTORS_DIR ANSWERS_DIR [--report-json F] [--report-md F] [--iut module:object]
    a2ats-conformance --version

The suite runs under pytest (pytest-xdist when -n > 1) in a child process that this one supervises
(supervisor.py), so an IUT that exits, hangs or is interrupted still yields a report that says so.
Exit status: 0 when the run completed and no clause fails (xfail, not-implemented, not-applicable
do not count), 1 when a clause fails (fail, timeout, crash), 2 on a usage error or an IUT that could
not be loaded, 3 when the run did not complete (interrupted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

from a2ats_conformance.run.watchdog import DEFAULT_EXAMPLE_TIMEOUT_S

__all__ = ["main", "run_suite", "clause_table", "SUITE_DIR"]

SUITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "properties")
STATUS_ORDER = ("fail", "timeout", "crash", "interrupted", "xfail", "not-implemented", "not-applicable", "pass",
                "untested")
#: Statuses that make the run exit 1.
FAILING = ("fail", "timeout", "crash")


def clause_table(tests: dict, clause_ids: list[str]) -> dict:
    """Aggregate per-test results into per-clause verdicts.

    A clause fails if any test citing it fails (xpass counts as pass), or reads "timeout" / "crash" if a test
    ran past --example-timeout / took the process down; "interrupted" if a test citing it never finished
    because the run stopped (Ctrl-C, or a crash the run could not continue after); it is "xfail" if its only
    failures are known deviations; "not-implemented" if every test citing it was skipped for a
    missing callable; "not-applicable" if every test citing it needs a capability the IUT does not
    declare; "untested" if no test citing it ran (e.g. deselected by --clauses) or no example ran. A "pass"
    whose clause has tests that were not-implemented or not-applicable carries ``not_run`` and a "partial:" reason.
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
        bad = next((s for s in FAILING if s in outcomes), None)
        if bad:
            entry["status"] = bad
            nid, r = next((nid, r) for nid, r in recs if r["outcome"] == bad)
            entry["counterexample"] = dict(r.get("counterexample") or {}, test=nid)
            entry["failed_tests"] = [nid for nid, r in recs if r["outcome"] in FAILING]
        elif "interrupted" in outcomes:   # part of it never ran: whatever passed does not make it pass
            entry["status"] = "interrupted"
            entry["reason"] = next(r.get("reason", "") for _, r in recs if r["outcome"] == "interrupted")
        elif any(o == "xfail" for o in outcomes):
            entry["status"] = "xfail"
            entry["reason"] = next(r.get("reason", "") for _, r in recs if r["outcome"] == "xfail")
        elif outcomes and all(o in ("not-implemented", "not-applicable", "skip") for o in outcomes) \
                and not {"not-implemented", "not-applicable"}.isdisjoint(outcomes):
            entry["status"] = "not-implemented" if "not-implemented" in outcomes else "not-applicable"
            entry["reason"] = next(r.get("reason", "") for _, r in recs if r["outcome"] == entry["status"])
        elif any(o in ("passed", "xpass", "passed-other") for o in outcomes) and examples > 0:
            entry["status"] = "pass"
            # a pass earned by part of the clause says so: the rest needs a callable or capability it lacks
            not_run = [r for _, r in recs if r["outcome"] in ("not-implemented", "not-applicable")]
            if not_run:
                entry["not_run"] = len(not_run)
                entry["reason"] = (f"partial: {len(not_run)} of {len(recs)} tests not run "
                                   f"({not_run[0].get('reason', '') or not_run[0]['outcome']})")
        else:
            entry["status"] = "untested"
        entry["counterexample"] = entry.get("counterexample")
        out[cid] = entry
    return out


def _pytest_args(a, ini_path: str, cex_dir: str, repro_prefix: str) -> list[str]:
    # Our own empty ini file: a project's pytest configuration must not leak into the suite.
    args = [SUITE_DIR, "-c", ini_path, "--rootdir", SUITE_DIR, "-p", "no:cacheprovider",
            f"--hypothesis-profile={a.profile}", "-q" if not a.verbose else "-v",
            # without -v the child prints no tracebacks: the verdict and profile come first, the evidence after
            *(["--tb=short"] if a.verbose else ["--tb=no", "-rN"]), "-W", "ignore::pytest.PytestAssertRewriteWarning",
            f"--counterexample-dir={cex_dir}", f"--a2ats-example-timeout={a.example_timeout}"]
    if a.iut is not None:
        args.append(f"--iut={a.iut}")
    if repro_prefix:
        args.append(f"--a2ats-repro-prefix={repro_prefix}")
    if a.dtype:
        args.append(f"--a2ats-dtype={a.dtype}")
    if a.xfails:
        args.append(f"--xfails={a.xfails}")
    if a.clauses:
        args.append(f"--clauses={a.clauses}")
    if a.seed is not None:
        args.append(f"--hypothesis-seed={a.seed}")
    if a.k:
        args += ["-k", a.k]
    if getattr(a, "no_port_profile", False):
        args.append("--a2ats-no-port-profile")
    if a.n and a.n > 1:
        args += ["-n", str(a.n), "-p", "xdist"]
    else:
        args += ["-p", "no:xdist"]
    return args


def run_id() -> str:
    """Unique per run (time, process, random): names the run's counterexample folder."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"


def run_suite(a) -> dict:
    """Run the suite in a supervised child process (supervisor.py); returns the report dict."""
    from a2ats_spec.clauses import clause_ids

    from a2ats_conformance.harness.adapter import resolve_iut_spec
    from a2ats_conformance.harness.pytest_helpers import default_counterexample_dir
    from a2ats_conformance.run.supervisor import import_prefix, run_child_suite

    t0 = time.time()
    spec = resolve_iut_spec(a.iut)
    cex_dir = os.path.join(os.path.abspath(a.counterexample_dir or default_counterexample_dir()), run_id())
    prefix = import_prefix(spec)
    with tempfile.TemporaryDirectory(prefix="a2ats-ini-") as tmp:
        ini_path = os.path.join(tmp, "pytest.ini")
        with open(ini_path, "w", encoding="utf-8") as f:
            f.write("[pytest]\n")
        raw = run_child_suite(_pytest_args(a, ini_path, cex_dir, prefix), quiet=a.quiet)
    ids = clause_ids()
    if a.clauses:
        only = {c.strip() for c in a.clauses.split(",")}
        ids = [c for c in ids if c in only]
    clauses = clause_table(raw["tests"], ids)
    summary = {s: sum(1 for c in clauses.values() if c["status"] == s) for s in STATUS_ORDER}
    failed = sorted(c for c, v in clauses.items() if v["status"] in FAILING)
    from a2ats_conformance.report.writer import metadata

    impl = raw["implementation"] or {"iut": spec}
    return {
        **metadata(dtype=impl.get("dtype") or a.dtype or "?", profile=a.profile, seed=a.seed, started_at=t0),
        "implementation": impl,
        "profile": a.profile,
        "seed": a.seed,
        "run": {"complete": raw["complete"], "interrupted": raw["interrupted"], "error": raw["error"],
                "crashes": raw["crashes"], "example_timeout_s": a.example_timeout, "counterexample_dir": cex_dir,
                "repro_prefix": prefix, "tests_collected": len(raw["collected"])},
        "clauses": clauses,
        "tests": raw["tests"],
        "summary": dict(summary, failed_clauses=failed, pytest_exit=raw["pytest_exit"]),
        "xfail_warnings": raw["xfail_warnings"],
        "port_profile": port_profile_rows(raw.get("port_profile"), failed),
        "wall_s": round(time.time() - t0, 2),
    }


def port_profile_rows(rows, failed: list[str]):
    """The child's profile rows with ``explains`` (the failing clauses each row's variant accounts for)."""
    if rows is None:
        return None
    from a2ats_conformance.catalogue.profile import explain

    return explain(rows, failed)


def exit_status(report: dict) -> int:
    """0: complete and nothing failed; 1: a clause failed (fail, timeout, crash); 2: usage error or the IUT
    could not be loaded (nothing ran); 3: the run did not complete (interrupted, or stopped early)."""
    run = report.get("run") or {"error": None, "complete": True}   # grade.py's reports: no supervised run
    if run["error"] or not report["tests"]:
        return 2
    if report["summary"]["failed_clauses"]:
        return 1
    return 0 if run["complete"] else 3


def run_line(report: dict) -> str:
    """One line on how the run went: '' when it completed normally."""
    run = report.get("run")
    if not run:          # a report not made by a suite run (grade.py)
        return ""
    if run["error"]:
        return f"RUN ERROR: {run['error']}; no verdict below was earned"
    parts = []
    if run["interrupted"]:
        parts.append("interrupted (Ctrl-C or SIGTERM): clauses whose tests did not finish read 'interrupted'")
    elif not run["complete"]:
        parts.append("incomplete: the run stopped before every test finished")
    for c in run["crashes"]:
        parts.append(f"{c['outcome']} in {c['test']} (the suite's process exited with status {c['exit']}; "
                     "the remaining tests ran in a fresh process)")
    return "RUN " + "; ".join(parts) if parts else ""


def _note(c: dict, width: int | None = 90) -> str:
    cex = c.get("counterexample") or {}
    if c["status"] in FAILING:
        note = (cex.get("message") or "").splitlines()[0] if cex.get("message") else ""
    else:
        note = c.get("reason") or ""
    return note[:width] if width else note


def verdict_line(report: dict) -> str:
    """The run's verdict in one line: what a port author reads first."""
    failed = report["summary"]["failed_clauses"]
    if exit_status(report) == 2:
        return "verdict: NO VERDICT (the run could not start; see the error below)"
    if failed:
        return f"verdict: FAIL, {len(failed)} clause(s) fail: {', '.join(failed)}"
    if exit_status(report) == 3:
        return "verdict: INCOMPLETE, no clause failed among those that ran"
    return "verdict: PASS, no clause fails"


def profile_lines(report: dict, width: int | None = 110) -> list[str]:
    """The port profile as a table: mechanism, variant found, the failing clauses it explains, evidence."""
    rows = report.get("port_profile")
    if not rows:
        return []
    spec = sum(1 for r in rows if r["status"] == "spec")
    out = [f"port profile ({spec} of {len(rows)} mechanisms as the spec; catalogue/profile.py):",
           f"  {'mechanism':<32} {'variant found':<34} explains"]
    for r in rows:
        mark = "" if r["status"] == "spec" else "*"
        variant = f"{mark}{r['variant']}" + (f" ({r['kind']})" if r.get("kind") == "authors" else "")
        out.append(f"  {r['title'][:32]:<32} {variant[:34]:<34} {', '.join(r.get('explains') or []) or '-'}")
        if r["status"] not in ("spec", "not-implemented", "not-applicable"):
            ev = f"{r['description']}; {r['evidence']}" if r.get("description") else r["evidence"]
            out.append(f"  {'':<32}   {ev[:width] if width else ev}")
    return out


def format_table(report: dict) -> str:
    impl = report["implementation"]
    lines = [f"A2ATS conformance: {impl.get('name', '?')} {impl.get('version', '')} "
             f"[{impl.get('iut', '')}] dtype {impl.get('dtype', '?')}, profile {report['profile']}",
             verdict_line(report), *profile_lines(report),
             f"{'clause':<20} {'status':<16} {'tests':>5} {'examples':>8}  note"]
    for cid, c in report["clauses"].items():
        lines.append(f"{cid:<20} {c['status']:<16} {c['tests']:>5} {c['examples']:>8}  {_note(c)}")
        lines.extend(f"{'':<20} {line}" for line in _cause_lines(c))
    s = report["summary"]
    lines.append(", ".join(f"{k} {s[k]}" for k in STATUS_ORDER if s[k] or k in ("pass", "fail"))
                 + f"; wall {report['wall_s']} s")
    if run_line(report):
        lines.append(run_line(report))
    for w in report.get("xfail_warnings", []):
        lines.append(f"warning (xfails file): {w}")
    return "\n".join(lines)


def evidence_text(report: dict) -> str:
    """After the table: each failing clause's full message, its diagnosis and its replay command."""
    out = []
    for cid, c in report["clauses"].items():
        if c["status"] not in FAILING:
            continue
        cex = c.get("counterexample") or {}
        out.append(f"--- {cid}: {c['status']} ({cex.get('test', '?')})")
        msg = (cex.get("message") or "").rstrip()
        if msg:
            out.append(msg)
        if cex.get("help") and cex["help"] not in msg:
            out.append("\n".join("  " + ln for ln in cex["help"].splitlines()))
        if cex.get("repro") and cex["repro"] not in msg:
            out.append(f"  replay: {cex['repro']}")
    return ("evidence (failing clauses, in SPEC order):\n" + "\n".join(out)) if out else ""


def _cause_lines(c: dict) -> list[str]:
    """A failing clause's likely causes (diagnose.py), one line each, for the terminal table."""
    cex = c.get("counterexample") or {}
    if c["status"] != "fail" or "likely_causes" not in cex:
        return []
    causes = [lc for lc in cex["likely_causes"] if isinstance(lc, dict)]
    if not causes:
        return ["likely cause: no known cause matched"]
    return [f"{'likely cause' if lc.get('likely', True) else 'also consistent'}: {lc.get('cause')} "
            f"({lc.get('matched')}/{lc.get('of')} failing examples) [{lc.get('id')}]" for lc in causes]


def write_reports(report: dict, a) -> None:
    """The reports asked for on the command line (--report-json, --report-md, --junit-xml); OSError naming the
    flag and the path when one cannot be written (a full disk)."""
    from a2ats_conformance.report.writer import write_junit

    writers = (("--report-json", a.report_json, lambda p: _write_text(p, json.dumps(report, indent=1, default=str))),
               ("--report-md", a.report_md, lambda p: _write_text(p, format_markdown(report))),
               ("--junit-xml", getattr(a, "junit_xml", None), lambda p: write_junit(report, p)))
    for flag, path, write in writers:
        if not path:
            continue
        try:
            write(path)
        except OSError as exc:
            raise OSError(f"{flag} {path!r} cannot be written ({exc.strerror or exc})") from None


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _caps_line(caps) -> str:
    if not caps:
        return "full support"
    return "; ".join(f"{k}: {v if isinstance(v, str) else ', '.join(v)}" for k, v in caps.items())


def _md_failure(cid: str, c: dict) -> list[str]:
    """A failing clause's section: the message, actual/expected excerpt, likely causes, the repro line."""
    cex = c.get("counterexample") or {}
    out = [f"### {cid}: {c['status']}", "", f"- test: `{cex.get('test', '?')}`"]
    if cex.get("message"):
        out.append(f"- what: {cex['message'].splitlines()[0]}")
    if cex.get("case"):
        out.append(f"- case: `{json.dumps(cex['case'], default=str)[:400]}`")
    for lc in cex.get("likely_causes") or ():   # diagnose.py: {"id", "cause", "matched", "of"}
        label = "likely cause" if not isinstance(lc, dict) or lc.get("likely", True) else "also consistent"
        out.append(f"- {label}: {lc.get('cause')}, matches {lc.get('matched')}/{lc.get('of')} failing examples "
                   f"[`{lc.get('id')}`]" if isinstance(lc, dict) else f"- likely cause: {lc}")
    if "likely_causes" in cex and not cex["likely_causes"]:
        out.append("- likely cause: no known cause matched")
    if cex.get("repro"):
        out.append(f"- replay: `{cex['repro']}`")
    rev = cex.get("revealing")
    if rev:
        out.append(f"- revealing example ({rev.get('region')}): {rev.get('message')}; replay: `{rev.get('repro')}`")
    excerpt = cex.get("details") or ("\n".join(cex["message"].splitlines()[1:]) if cex.get("message") else "")
    if excerpt.strip():
        out += ["", "```text", excerpt.strip()[:1500], "```"]
    return out + [""]


def versions_line(report: dict) -> str:
    """Suite, spec, Python and MLX versions; a port's environment need not have MLX, and the line says so."""
    plat = report.get("platform") or {}
    mlx = f"MLX {plat['mlx']}" if plat.get("mlx") else "MLX not installed"
    return (f"suite {report.get('suite_version', '?')}, spec {(report.get('spec') or {}).get('version', '?')}, "
            f"Python {plat.get('python', '?')}, {mlx}")


def format_markdown(report: dict) -> str:
    impl = report["implementation"]
    out = ["# A2ATS conformance report", ""]
    if run_line(report):
        out += [f"> **{run_line(report)}**", ""]
    out += [f"- implementation: **{impl.get('name', '?')}** {impl.get('version', '')} (`{impl.get('iut', '')}`)",
            f"- dtype: {impl.get('dtype', '?')}; Hypothesis profile: {report['profile']}; wall: {report['wall_s']} s",
            f"- versions: {versions_line(report)}",
            f"- missing callables: {', '.join(impl.get('missing', [])) or 'none'}",
            f"- declared capabilities: {_caps_line(impl.get('capabilities'))}",
            f"- counterexamples: `{(report.get('run') or {}).get('counterexample_dir', '-')}`", "",
            f"**{verdict_line(report)}**", ""]
    if report.get("port_profile"):
        out += ["## Port profile", "", "Each mechanism measured on its own probe and classified among the "
                "catalogue's variants (`*`: not the spec's).", "",
                "| mechanism | variant found | source | explains failing | evidence |", "|---|---|---|---|---|"]
        for r in report["port_profile"]:
            cell = lambda x: str(x).replace("|", chr(92) + "|")  # noqa: E731
            mark = "" if r["status"] == "spec" else "*"
            ev = "" if r["status"] == "spec" else f"{r.get('description', '')}; {r['evidence']}".strip("; ")
            out.append(f"| {cell(r['title'])} | {mark}{cell(r['variant'])} | {cell(r.get('source', ''))} | "
                       f"{', '.join(r.get('explains') or []) or '-'} | {cell(ev)} |")
        out.append("")
    out += ["## Clauses", "", "| clause | status | tests | examples | counterexample / note |", "|---|---|---:|---:|---|"]
    for cid, c in report["clauses"].items():
        note = _note(c, None).splitlines()[0] if _note(c, None) else ""
        out.append(f"| {cid} | {c['status']} | {c['tests']} | {c['examples']} | {note.replace('|', chr(92) + '|')} |")
    failing = [(cid, c) for cid, c in report["clauses"].items() if c["status"] in FAILING]
    if failing:
        out += ["", "## Failures", ""]
        for cid, c in failing:
            out += _md_failure(cid, c)
    for w in report.get("xfail_warnings", []):
        out.append(f"\n> warning (xfails file): {w}")
    return "\n".join(out) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="a2ats-conformance", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A2ATS conformance suite: run the Hypothesis properties against an implementation (an adapter) "
                    "and report per-clause verdicts.",
        epilog="subcommands:\n"
               "  a2ats-conformance vectors --out DIR [--size small|full] [--seed S] [--check IUT]\n"
               "                        write oracle golden vectors for ports in any language (VECTORS.md)\n"
               "  a2ats-conformance grade VECTORS_DIR ANSWERS_DIR [--report-json F] [--report-md F] [--iut IUT]\n"
               "                        grade a port's answer files per clause (exit 4: nothing answered)\n"
               "  (a2ats-conformance vectors --help, a2ats-conformance grade --help: their flags)\n\n"
               "exit status: 0 when the run completed and no clause fails; 1 when a clause fails (fail, timeout, "
               "crash);\n2 on a usage error or an IUT that could not be loaded; 3 when the run did not complete "
               "(interrupted).")
    p.add_argument("--iut", default=None, help="adapter 'module:object' (default: $A2ATS_IUT, else the MLX reference)")
    p.add_argument("--profile", default="ci", choices=["quick", "ci", "thorough", "selftest"],
                   help="Hypothesis profile: quick (8 examples), ci (default, 50), thorough (500); selftest = 12, no shrinking")
    p.add_argument("--dtype", default=None, help="input dtype to test, comma list, or 'all' (default: the adapter's first)")
    p.add_argument("--report-json", default=None, metavar="F", help="the report as JSON (report.schema.json)")
    p.add_argument("--report-md", default=None, metavar="F", help="the report as Markdown (clause table, failures)")
    p.add_argument("--junit-xml", default=None, metavar="F", help="JUnit XML for CI: one testcase per clause")
    p.add_argument("--version", action="store_true", help="print the package, spec and vectors-format versions")
    p.add_argument("--xfails", default=None, metavar="F", help="known deviations: '<clause-or-test-id-prefix>  # reason'")
    p.add_argument("-n", type=int, default=1, help="worker processes (pytest-xdist) when > 1")
    p.add_argument("--clauses", default=None, help="comma-separated clause IDs to run (default: all)")
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random)")
    p.add_argument("--counterexample-dir", default=None, metavar="DIR",
                   help="each run writes its counterexamples to its own new folder DIR/<run-id> "
                        "(default DIR: $A2ATS_COUNTEREXAMPLES, else <tmp>/a2ats-counterexamples)")
    p.add_argument("--example-timeout", type=float, default=DEFAULT_EXAMPLE_TIMEOUT_S, metavar="S",
                   help=f"seconds one example may take before its test fails as 'timeout' "
                        f"(default {DEFAULT_EXAMPLE_TIMEOUT_S:g}; 0: no limit)")
    p.add_argument("--no-port-profile", action="store_true",
                   help="skip the port profile (each mechanism's variant, measured on its own probe)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("-v", "--verbose", action="store_true", help="pytest's verbose output (one line per test)")
    p.add_argument("-q", "--quiet", action="store_true", help="no pytest output, only the table")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "vectors":
        from a2ats_conformance.vectors.export import main as vectors_main

        return vectors_main(argv[1:])
    if argv and argv[0] == "grade":
        from a2ats_conformance.vectors.grade import main as grade_main

        return grade_main(argv[1:])
    if "--version" in argv:
        from a2ats_conformance.report.versions import version_text

        print(version_text())
        return 0
    a = _parser().parse_args(argv)
    if a.xfails:
        from a2ats_conformance.run.xfails import read_xfails

        try:
            read_xfails(a.xfails)
        except ValueError as exc:
            print(f"a2ats-conformance: {exc}", file=sys.stderr)
            return 2
    problem = check_clauses(a.clauses) or same_report_paths(a) or check_iut(a.iut) or check_report_paths(a)
    if problem:
        print(f"a2ats-conformance: {problem}", file=sys.stderr)
        return 2
    report = run_suite(a)
    from a2ats_conformance.run.xfails import XfailWarning

    for w in report["xfail_warnings"]:
        warnings.warn(f"known-deviations file {a.xfails}: {w}", XfailWarning, stacklevel=1)
    print(format_table(report))
    evidence = evidence_text(report)
    if evidence:
        print(evidence)
    try:
        write_reports(report, a)
    except OSError as exc:
        print(f"a2ats-conformance: {exc}", file=sys.stderr)
        return 2
    if report["run"]["error"]:
        print(f"a2ats-conformance: {report['run']['error']}", file=sys.stderr)
    return exit_status(report)


def check_clauses(clauses) -> str:
    """'' or which --clauses entries are not clause IDs of the spec (a typo would run nothing and exit 0)."""
    if clauses is None:
        return ""
    from a2ats_spec.clauses import clause_ids

    asked = [c.strip() for c in clauses.split(",")]
    unknown = [c for c in asked if c not in clause_ids()]
    if unknown or not asked:
        return (f"--clauses {clauses!r}: {', '.join(repr(c) for c in unknown)} "
                f"{'is not a clause ID' if len(unknown) == 1 else 'are not clause IDs'}; known: {', '.join(clause_ids())}")
    return ""


def check_iut(iut) -> str:
    """'' or why the IUT cannot be run; finds its module without importing it (the child process does that:
    an adapter that exits or hangs on import must not take this process with it)."""
    import importlib.util

    from a2ats_conformance.harness.adapter import DEFAULT_IUT, AdapterError, resolve_iut_spec

    try:
        spec = resolve_iut_spec(iut)
    except AdapterError as exc:
        return str(exc)
    if spec == DEFAULT_IUT:
        missing = [m for m in ("mlx", "mlx_lm") if not _importable(m)]
        if missing:
            return (f"IUT {spec!r} is the MLX reference, which needs the [mlx] extra (pip install 'a2ats-ref[mlx]'; "
                    f"{' and '.join(missing)} not installed); to test another implementation give --iut "
                    "package.module:Adapter or $A2ATS_IUT, e.g. --iut a2ats_conformance.adapters.oracle:OracleAdapter")
    top = spec.partition(":")[0].split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (f"IUT {spec!r}: cannot import module {top!r} (not on the import path). Give an importable module, "
                f"e.g. --iut mypkg.a2ats_adapter:Adapter, and put its folder on PYTHONPATH if it is not installed")
    return ""


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def same_report_paths(a) -> str:
    """'' or which two report flags name the same file (one report would overwrite the other)."""
    seen: dict[str, str] = {}
    for flag in ("--report-json", "--report-md", "--junit-xml"):
        path = getattr(a, flag[2:].replace("-", "_"), None)
        if not path:
            continue
        key = os.path.realpath(path)
        if key in seen:
            return (f"{seen[key]} and {flag} name the same file {path!r}: one report would overwrite the other; "
                    f"give each its own path")
        seen[key] = flag
    return ""


def check_report_paths(a) -> str:
    """'' or which report path cannot be written: checked before the run, not discovered after it."""
    for flag, path in (("--report-json", a.report_json), ("--report-md", a.report_md),
                       ("--junit-xml", getattr(a, "junit_xml", None))):
        if not path:
            continue
        if os.path.isdir(path):
            return f"{flag} {path!r} is a folder; give a file path"
        existed = os.path.exists(path)
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return f"{flag} {path!r} cannot be written ({exc.strerror or exc}); fix the path before the run"
        if not existed:
            os.remove(path)
    return ""


if __name__ == "__main__":
    sys.exit(main())
