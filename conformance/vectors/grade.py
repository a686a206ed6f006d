"""Grade a port's answers to the golden vectors (VECTORS.md, "Answers"), per clause, without running the port.

    a2ats-conformance grade VECTORS_DIR ANSWERS_DIR [--dtype float32|float64] [--report-json F] [--report-md F]
                                                    [--junit-xml F] [--iut module:object]

A port in any language reads the vectors (vectors.py) and writes one ``.npy`` per case and output; this module
compares them with the oracle's expected values (tolerances, allowed code sets, must/may masks) and produces
the same per-clause verdicts, reports and exit status as a Hypothesis run (cli.py): 0 when no clause fails,
1 when one does, 2 when the vectors or answers cannot be read (a malformed file is an error that names it, not
a verdict), 4 when no case was answered (a port that wrote nothing must not pass a CI gate). Vectors and
answers are untrusted files (untrusted.py).
A case with no answer file is ``not-implemented`` when the port answered no case of that function (or, for a
cache trace, no trace of that clause); a case missing from a function the port did answer is a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from a2ats_spec import oracle
from a2ats_spec.clauses import clause_ids

from a2ats_conformance.harness.adapter import load_adapter
from a2ats_conformance.harness.capabilities import AdapterError, read, unmet
from a2ats_conformance.report.text import (STATUS_ORDER, clause_table, check_report_paths, exit_status, format_table,
                                           same_report_paths, write_reports)
from a2ats_conformance.report.writer import metadata
from a2ats_conformance.vectors.answers import write_answers
from a2ats_conformance.vectors.manifest import GRADED_DTYPES, answer_names, load_vectors
from a2ats_conformance.vectors.traces import grade_trace
from a2ats_conformance.vectors.untrusted import UntrustedFileError, read_json, read_npy, regular_file

#: Exit status of a grading run in which no case was answered (every clause not-implemented or not-applicable):
#: not 0, so that a port that wrote nothing cannot pass a CI gate.
NOTHING_ANSWERED = 4
#: answers.json holds a name, a version, a dtype and capabilities.
MAX_META_BYTES = 1 << 20
#: The part of a ``.error`` file a report quotes.
_ERROR_QUOTE = 300

__all__ = ["AnswersError", "grade_cases", "grade", "main"]


class AnswersError(ValueError):
    """The answers directory cannot be graded: a file is not a readable .npy, or answers.json is malformed."""


def _read_npy(path: str) -> np.ndarray:
    try:
        return read_npy(path, "answer", own=True)
    except UntrustedFileError as exc:
        raise AnswersError(str(exc)) from None


def read_answers_meta(answers_dir: str) -> dict:
    """answers.json (optional): {"name", "version", "dtype", "capabilities"}; AnswersError if malformed."""
    if not os.path.isdir(answers_dir):
        raise AnswersError(f"{answers_dir}: no such directory of answers")
    path = os.path.join(answers_dir, "answers.json")
    if not os.path.lexists(path):
        return {}
    try:
        meta = read_json(path, "answers", own=True, max_bytes=MAX_META_BYTES)
    except UntrustedFileError as exc:
        raise AnswersError(str(exc)) from None
    if not isinstance(meta, dict):
        raise AnswersError(f"{path}: expected a JSON object with name, version, dtype, got {type(meta).__name__}")
    return meta


class _Grader:
    def __init__(self, answers_dir: str, dec, dtype: str, expected: set[str]):
        self.dir, self.dec, self.dtype = answers_dir, dec, dtype
        self.files = set(os.listdir(answers_dir))
        self.used: set[str] = {"answers.json"}
        for name in sorted(self.files & expected):   # every answer is a plain file before any is read
            try:
                regular_file(os.path.join(answers_dir, name), "answer", own=True)
            except UntrustedFileError as exc:
                raise AnswersError(str(exc)) from None

    def has(self, name: str) -> bool:
        return name in self.files

    def load(self, name: str) -> np.ndarray:
        self.used.add(name)
        return _read_npy(os.path.join(self.dir, name))

    def check_output(self, ent: dict, got: np.ndarray, tol) -> str | None:
        """None if the answer passes ``ent``'s compare rule, else what is wrong."""
        kind, name = ent["compare"], ent["name"]
        if "dtype" in ent and kind == "exact":
            return None if got.dtype == np.dtype(ent["dtype"]) else f"{name}: dtype {got.dtype}, expected {ent['dtype']}"
        if "value" in ent:
            ok = got.ndim == 0 and got.dtype.kind in "iu" and int(got) == ent["value"] if kind == "exact" else None
            return None if ok else f"{name}: {got.tolist() if got.size < 9 else got.shape}, expected {ent['value']}"
        shape = tuple(ent.get("shape", ()))
        if kind in ("close", "exact") and got.shape != shape:
            return f"{name}: shape {got.shape}, expected {shape}"
        if kind == "close":
            exp = self.dec(ent["array"]).astype(np.float64)
            rtol, atol = tol
            g = got.astype(np.float64)
            bad = ~np.isclose(g, exp, rtol=rtol, atol=atol)
            if bad.any():
                i = np.unravel_index(np.argmax(np.abs(g - exp) * bad), g.shape)
                return (f"{name}: {int(bad.sum())} of {g.size} values outside (rtol={rtol}, atol={atol}); "
                        f"worst at {tuple(int(x) for x in i)}: {g[i]!r} vs expected {exp[i]!r}")
            return None
        if kind == "exact":
            exp = self.dec(ent["array"])
            return None if np.array_equal(got, exp) else f"{name}: {got.tolist() if got.size < 9 else 'array'} != expected"
        if kind == "allowed":
            allowed = self.dec(ent["allowed"])
            if got.dtype.kind not in "iu" or got.shape != allowed.shape[:-1]:
                return f"{name}: expected integer codes of shape {allowed.shape[:-1]}, got {got.dtype} {got.shape}"
            if "code_dtype" in ent and got.dtype != np.dtype(ent["code_dtype"]):
                return f"{name}: codes have dtype {got.dtype}, expected {ent['code_dtype']} (CODES-DTYPE)"
            ok = (allowed == got.astype(np.int64)[..., None]).any(-1)
            if not ok.all():
                i = tuple(int(x) for x in np.argwhere(~ok)[0])
                return (f"{name}: {int((~ok).sum())} code(s) outside the allowed (near-optimal) set; first at {i}: "
                        f"{int(got[i])}, allowed {[int(c) for c in allowed[i] if c >= 0]}")
            return None
        if kind == "mask":
            must, may = self.dec(ent["must"]), self.dec(ent["may"])
            if got.dtype != np.bool_ or got.shape != must.shape:
                return f"{name}: expected a bool mask of shape {must.shape}, got {got.dtype} {got.shape}"
            if (must & ~got).any():
                return f"{name}: {int((must & ~got).sum())} token(s) that must be selected are not (must <= M)"
            if (got & ~may).any():
                return f"{name}: {int((got & ~may).sum())} token(s) selected that no allowed selection has (M <= may)"
            return None
        raise ValueError(f"vectors: unknown compare rule {kind!r} in output {name}")

    def grade_call(self, case: dict) -> dict:
        cid, rec = case["id"], {"clauses": [case["clause"]], "examples": 1, "function": case["function"]}
        err = f"{cid}.error"
        if case.get("expect") == "ValueError":
            if self.has(err):
                self.used.add(err)
                return dict(rec, outcome="passed")
            present = [f for f in self.files if f.startswith(cid + ".")]
            if present:
                self.used.update(present)
                return dict(rec, outcome="fail", message=f"{cid} ({case['note']}): expected the call to be rejected "
                            f"(write {err}), the port answered {sorted(present)}")
            return dict(rec, outcome="missing")
        names = [f"{cid}.{ent['name']}.npy" for ent in case["outputs"]]
        if self.has(err):
            self.used.add(err)
            with open(os.path.join(self.dir, err), "rb", opener=_no_follow) as f:
                msg = f.read(4 * _ERROR_QUOTE).decode("utf-8", "replace").strip()[:_ERROR_QUOTE]
            return dict(rec, outcome="fail", message=f"{cid}: the port rejected a valid call: {msg}")
        if not any(self.has(n) for n in names):
            return dict(rec, outcome="missing")
        tol = case["tolerance"][self.dtype]
        got = {}
        # a decode output depends on the selection the port made: masks are checked first
        for ent, n in sorted(zip(case["outputs"], names), key=lambda e: "over_mask" in e[0]):
            if not self.has(n):
                return dict(rec, outcome="fail", message=f"{cid}: answer {n} is missing (the case has outputs "
                            f"{[e['name'] for e in case['outputs']]})")
            got[ent["name"]] = self.load(n)
            if "over_mask" in ent:
                problem = self._over_mask(case, ent, got, tol)
            else:
                problem = self.check_output(ent, got[ent["name"]], tol)
            if problem:
                return dict(rec, outcome="fail", message=f"{cid} ({case['note'] or case['function']}): {problem}")
        return dict(rec, outcome="passed")

    def _over_mask(self, case, ent, got, tol) -> str | None:
        """decode_step's output: exact attention (RET-ATTN) over the mask the port answered, from the call's inputs."""

        args = [self.dec(a) for a in case["args"][:3]]
        q, k, v = (a.astype(np.float64) for a in args)
        scale = case["kwargs"].get("scale", {}).get("value")
        exp = oracle.retrieval_attention(q, k, v, got[ent["over_mask"]], scale=scale)
        out = got[ent["name"]]
        if out.shape != exp.shape:
            return f"{ent['name']}: shape {out.shape}, expected {exp.shape}"
        bad = ~np.isclose(out.astype(np.float64), exp, rtol=tol[0], atol=tol[1])
        if bad.any():
            return (f"{ent['name']}: {int(bad.sum())} of {out.size} values are not exact attention over the port's own "
                    f"selection (rtol={tol[0]}, atol={tol[1]}; max error {np.max(np.abs(out - exp)):.3g})")
        return None


def _no_follow(path, flags):
    """open()'s opener for a file checked regular: a link or FIFO swapped in after the check is not followed,
    and an open cannot block."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


def answers_capabilities(meta: dict):
    """The capabilities answers.json declares (absent: full support), validated like an adapter's."""

    try:
        return read(SimpleNamespace(capabilities=meta.get("capabilities")), "answers.json")
    except AdapterError as exc:
        raise AnswersError(str(exc)) from None


def _not_applicable(case: dict, caps) -> str | None:
    reasons = unmet(caps, case.get("requires", {}))
    return f"not-applicable: needs {', '.join(reasons)}" if reasons else None


def _answers_dtype(dtype, meta: dict) -> str:
    dtype = dtype or meta.get("dtype") or "float32"
    if dtype not in GRADED_DTYPES:
        raise AnswersError(f"dtype: the vectors are graded in {list(GRADED_DTYPES)}, got {str(dtype)[:60]!r}"
                           f"{' (answers.json)' if meta.get('dtype') == dtype else ''}")
    return dtype


def _guarded(what: str, fn, *args):
    """Grade one case; a malformed input the manifest's checks do not reach (an oracle refusing its config) is
    an error naming the case, not a traceback."""
    try:
        return fn(*args)
    except (AnswersError, UntrustedFileError):
        raise
    except (ValueError, TypeError, KeyError, IndexError, ArithmeticError, MemoryError) as exc:
        raise AnswersError(f"{what}: cannot be graded: the vectors' inputs are malformed "
                           f"({type(exc).__name__}: {str(exc)[:200]})") from None


def grade_cases(vectors_dir: str, answers_dir: str, dtype: str | None = None, *, loaded=None) -> dict:
    """-> {case id: {"clauses", "outcome" (passed|fail|not-implemented|not-applicable), "message", ...}}."""

    manifest, dec = loaded or load_vectors(vectors_dir)
    meta = read_answers_meta(answers_dir)
    dtype = _answers_dtype(dtype, meta)
    g = _Grader(answers_dir, dec, dtype, answer_names(manifest))
    caps = answers_capabilities(meta)
    results = {}
    for c in manifest["calls"]:
        why = _not_applicable(c, caps)
        results[c["id"]] = (dict(clauses=[c["clause"]], examples=1, function=c["function"], outcome="not-applicable",
                                 reason=why) if why else _guarded(c["id"], g.grade_call, c))
    _settle_missing(results, {cid: r["function"] for cid, r in results.items()},
                    "{id}: no answer, though the port answered other {group} cases (VECTORS.md names every file)",
                    "not-implemented: no answers for {group}")
    traces = {}
    for t in manifest["traces"]:
        why = _not_applicable(t, caps)
        traces[t["id"]] = (dict(clauses=[t["clause"]], examples=1, outcome="not-applicable", reason=why) if why
                           else _guarded(t["id"], grade_trace, t, g))
    _settle_missing(traces, {t["id"]: t["clause"] for t in manifest["traces"]},
                    "{id}: no answers, though the port answered other {group} traces",
                    "not-implemented: no answers to {group} traces")
    results.update(traces)
    results["__unused__"] = sorted(g.files - g.used)
    return results


def _settle_missing(results: dict, group: dict, fail_msg: str, not_impl: str) -> None:
    """A missing answer fails when the port answered other cases of its group (a function, or a trace's
    clause), else the whole group reads not-implemented."""
    answered = {group[i] for i, r in results.items() if r["outcome"] != "missing"}
    for i, r in results.items():
        if r["outcome"] == "missing":
            if group[i] in answered:
                r.update(outcome="fail", message=fail_msg.format(id=i, group=group[i]))
            else:
                r.update(outcome="not-implemented", reason=not_impl.format(group=group[i]))


def grade(vectors_dir: str, answers_dir: str, dtype: str | None = None) -> dict:
    """The report of a grading run: the same shape as a Hypothesis run's (cli.run_suite)."""

    t0 = time.time()
    loaded = load_vectors(vectors_dir)
    meta = read_answers_meta(answers_dir)
    dtype = _answers_dtype(dtype, meta)
    results = grade_cases(vectors_dir, answers_dir, dtype, loaded=loaded)
    unused = results.pop("__unused__")
    tests = {}
    for cid, r in results.items():
        rec = {"clauses": r["clauses"], "outcome": r["outcome"], "examples": r.get("examples", 1), "duration": 0.0}
        if r["outcome"] == "fail":
            rec["counterexample"] = {"clause": r["clauses"][0], "message": r["message"], "case": cid}
        if r.get("reason"):
            rec["reason"] = r["reason"]
        tests[cid] = rec
    manifest = loaded[0]
    clauses = clause_table(tests, clause_ids())
    summary = {s: sum(1 for c in clauses.values() if c["status"] == s) for s in STATUS_ORDER}
    failed = sorted(c for c, v in clauses.items() if v["status"] == "fail")
    return {
        **metadata(dtype=dtype, profile=f"vectors:{manifest['size']}", seed=manifest["seed"], started_at=t0),
        "implementation": {"iut": f"answers:{answers_dir}", "name": str(meta.get("name", "?")),
                           "version": str(meta.get("version", "")), "dtype": dtype,
                           "capabilities": answers_capabilities(meta).as_dict()},
        "vectors": {"dir": vectors_dir, "format": manifest["format"], "size": manifest["size"],
                    "spec_version": manifest["spec_version"], "spec_sha256": manifest["spec_sha256"]},
        "run": {"complete": True, "interrupted": False, "error": None, "crashes": [], "counterexample_dir": None},
        "clauses": clauses,
        "tests": tests,
        "summary": dict(summary, failed_clauses=failed, pytest_exit=0),
        "xfail_warnings": [f"answer file {f} matches no case of the vectors (misnamed?)" for f in unused],
        "wall_s": round(time.time() - t0, 2),
    }


EXIT_STATUSES = ("exit status: 0 when no clause fails; 1 when a clause fails; 2 when the vectors or answers cannot "
                 "be graded (a malformed manifest, a path outside the vectors folder, an unreadable, pickled or "
                 "non-regular answer file, a malformed answers.json: the message names it; nothing is written); "
                 f"{NOTHING_ANSWERED} when nothing was answered (no answer file for any case: every clause "
                 "not-implemented or not-applicable)")


def nothing_answered(report: dict) -> bool:
    """No case has an answer: a port that wrote nothing (or only answers.json)."""
    return all(t["outcome"] in ("not-implemented", "not-applicable") for t in report["tests"].values())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a2ats-conformance grade", epilog=EXIT_STATUSES,
                                description="grade a port's answers to golden vectors (VECTORS.md), per clause")
    p.add_argument("vectors_dir", metavar="VECTORS_DIR", help="golden vectors (a2ats-conformance vectors --out)")
    p.add_argument("answers_dir", metavar="ANSWERS_DIR", help="the port's answer files (VECTORS.md, \"Answers\")")
    p.add_argument("--dtype", default=None, choices=GRADED_DTYPES, help="tolerances to grade with "
                   "(default: answers.json's dtype, else float32)")
    p.add_argument("--report-json", default=None, metavar="F", help="the report as JSON (report.schema.json)")
    p.add_argument("--report-md", default=None, metavar="F", help="the report as Markdown")
    p.add_argument("--junit-xml", default=None, metavar="F", help="JUnit XML, one testcase per clause")
    p.add_argument("--iut", default=None, metavar="module:object",
                   help="first write ANSWERS_DIR by running this Python adapter on the vectors, then grade. "
                   "ANSWERS_DIR is created if missing; answer files an earlier run left there under the vectors' "
                   "answer names are deleted first, so only this run's answers are graded (other files are kept "
                   "and listed as unused); a link, folder or FIFO under one of those names stops the run before "
                   "anything is written")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)

    problem = same_report_paths(a)
    if problem:
        print(f"a2ats-conformance grade: {problem}", file=sys.stderr)
        return 2
    try:
        load_vectors(a.vectors_dir)    # every path and entry checked before anything is written
        problem = check_report_paths(a)
        if problem:
            raise ValueError(problem)
        if a.iut:
            write_answers(a.vectors_dir, load_adapter(a.iut), a.answers_dir, a.dtype)
        report = grade(a.vectors_dir, a.answers_dir, a.dtype)
    except ValueError as exc:   # AnswersError, ManifestError, vectors of another format
        print(f"a2ats-conformance grade: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    try:
        write_reports(report, a)
    except OSError as exc:
        print(f"a2ats-conformance grade: cannot write a report: {exc}", file=sys.stderr)
        return 2
    status = exit_status(report)
    if status == 0 and nothing_answered(report):
        print(f"a2ats-conformance grade: no case was answered in {a.answers_dir} (no answer file matches a case "
              f"of the vectors; VECTORS.md, \"Answers\", names them): exit {NOTHING_ANSWERED}", file=sys.stderr)
        return NOTHING_ANSWERED
    return status


if __name__ == "__main__":
    sys.exit(main())
