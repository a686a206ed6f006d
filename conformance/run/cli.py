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
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings

from a2ats_spec.clauses import clause_ids

from a2ats_conformance.harness.adapter import DEFAULT_IUT, AdapterError, resolve_iut_spec
from a2ats_conformance.harness.pytest_helpers import default_counterexample_dir
from a2ats_conformance.report.text import (  # noqa: F401  (run_suite and main report through these)
    FAILING, STATUS_ORDER, check_report_paths, clause_table, evidence_text, exit_status, format_markdown, format_table, port_profile_rows, profile_lines, run_line, same_report_paths, verdict_line, write_reports)
from a2ats_conformance.report.versions import version_text
from a2ats_conformance.report.writer import metadata
from a2ats_conformance.run.supervisor import import_prefix, run_child_suite
from a2ats_conformance.run.watchdog import DEFAULT_EXAMPLE_TIMEOUT_S
from a2ats_conformance.run.xfails import XfailWarning, read_xfails

__all__ = ["main", "run_suite", "clause_table", "SUITE_DIR"]

SUITE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "properties")
#: the pytest plugins the suite's child loads (plugin autoloading is off there: supervisor._child_env)
SUITE_PLUGINS = ("_hypothesis_pytestplugin",)
#: the plugin module behind pytest-xdist's "-n", added when the run has workers
XDIST_PLUGIN = "xdist.plugin"


def _pytest_args(a, ini_path: str, cex_dir: str, repro_prefix: str) -> list[str]:
    # Our own empty ini file: a project's pytest configuration must not leak into the suite.
    args = [SUITE_DIR, "-c", ini_path, "--rootdir", SUITE_DIR, "-p", "no:cacheprovider",
            *(a for name in SUITE_PLUGINS for a in ("-p", name)),
            f"--hypothesis-profile={a.profile}", "-q" if not a.verbose else "-v",
            # without -v the child prints no tracebacks: the verdict and profile come first, the evidence after
            *(["--tb=short"] if a.verbose else ["--tb=no", "-rN"]),
            # The properties report through the suite's own messages and hold no bare assert: rewriting asserts
            # would only parse every property module again at each start where bytecode is not cached.
            "--assert=plain",
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
    if getattr(a, "no_diagnosis", False):
        args.append("--a2ats-no-diagnosis")
    if a.n and a.n > 1:
        # one test at a time per worker after the first two (plugin.heavy_first says why)
        args += ["-p", XDIST_PLUGIN, "-n", str(a.n), "--maxschedchunk", "1"]
    return args


def run_id() -> str:
    """Unique per run (time, process, random): names the run's counterexample folder."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"


def run_suite(a) -> dict:
    """Run the suite in a supervised child process (supervisor.py); returns the report dict."""

    t0 = time.time()
    spec = resolve_iut_spec(a.iut)
    cex_dir = os.path.join(os.path.abspath(a.counterexample_dir or default_counterexample_dir()), run_id())
    prefix = import_prefix(spec)
    with tempfile.TemporaryDirectory(prefix="a2ats-ini-") as tmp:
        ini_path = os.path.join(tmp, "pytest.ini")
        with open(ini_path, "w", encoding="utf-8") as f:
            f.write("[pytest]\n")
        raw = run_child_suite(_pytest_args(a, ini_path, cex_dir, prefix), quiet=a.quiet, workers=a.n or 1)
    ids = clause_ids()
    if a.clauses:
        only = {c.strip() for c in a.clauses.split(",")}
        ids = [c for c in ids if c in only]
    clauses = clause_table(raw["tests"], ids)
    summary = {s: sum(1 for c in clauses.values() if c["status"] == s) for s in STATUS_ORDER}
    failed = sorted(c for c, v in clauses.items() if v["status"] in FAILING)

    impl = raw["implementation"] or {"iut": spec}
    return {
        **metadata(dtype=impl.get("dtype") or a.dtype or "?", profile=a.profile, seed=a.seed, started_at=t0),
        "implementation": impl,
        "profile": a.profile,
        "seed": a.seed,
        "run": {"complete": raw["complete"], "interrupted": raw["interrupted"], "error": raw["error"],
                "crashes": raw["crashes"], "example_timeout_s": a.example_timeout, "counterexample_dir": cex_dir,
                "repro_prefix": prefix, "tests_collected": len(raw["collected"]),
                "diagnosis": not getattr(a, "no_diagnosis", False)},
        "clauses": clauses,
        "tests": raw["tests"],
        "summary": dict(summary, failed_clauses=failed, pytest_exit=raw["pytest_exit"]),
        "xfail_warnings": raw["xfail_warnings"],
        "port_profile": port_profile_rows(raw.get("port_profile"), failed),
        "wall_s": round(time.time() - t0, 2),
    }


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
    p.add_argument("--no-diagnosis", action="store_true",
                   help="verdicts and minimal counterexamples only: no revealing search and no likely causes "
                        "after a failure (faster on a failing port; the causes are what tells you why)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("-v", "--verbose", action="store_true", help="pytest's verbose output (one line per test)")
    p.add_argument("-q", "--quiet", action="store_true", help="no pytest output, only the table")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "vectors":
        from a2ats_conformance.vectors.export import main as vectors_main  # deferred: imports hypothesis

        return vectors_main(argv[1:])
    if argv and argv[0] == "grade":
        from a2ats_conformance.vectors.grade import main as grade_main  # deferred: imports hypothesis

        return grade_main(argv[1:])
    if "--version" in argv:
        print(version_text())
        return 0
    a = _parser().parse_args(argv)
    if a.xfails:
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

    asked = [c.strip() for c in clauses.split(",")]
    unknown = [c for c in asked if c not in clause_ids()]
    if unknown or not asked:
        return (f"--clauses {clauses!r}: {', '.join(repr(c) for c in unknown)} "
                f"{'is not a clause ID' if len(unknown) == 1 else 'are not clause IDs'}; known: {', '.join(clause_ids())}")
    return ""


def check_iut(iut) -> str:
    """'' or why the IUT cannot be run; finds its module without importing it (the child process does that:
    an adapter that exits or hangs on import must not take this process with it)."""

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
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
