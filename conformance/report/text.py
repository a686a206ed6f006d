"""The run's verdict as people and CI read it: the clause table, the exit status, the terminal and Markdown
reports and the port profile's table (SPEC, Conformance reports; ``report.schema.json`` is the JSON form).

``a2ats-conformance`` and ``a2ats-conformance grade`` both report through these, so a port reads the same
verdict whichever way it was judged.
"""

from __future__ import annotations

import json
import os

from a2ats_conformance.catalogue.profile import explain
from a2ats_conformance.report.writer import write_junit


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


def port_profile_rows(rows, failed: list[str]):
    """The child's profile rows with ``explains`` (the failing clauses each row's variant accounts for)."""
    if rows is None:
        return None

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
    """A failing clause's likely causes (diagnosis/diagnose.py), one line each, for the terminal table."""
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
    for lc in cex.get("likely_causes") or ():   # diagnosis/diagnose.py: {"id", "cause", "matched", "of"}
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
            f"- counterexamples: `{(report.get('run') or {}).get('counterexample_dir', '-')}`",
            *([] if (report.get("run") or {}).get("diagnosis", True) else
              ["- diagnosis: off (`--no-diagnosis`): failures name no likely cause and no revealing example"]), "",
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
