"""The README's compatibility table: every implementation the project checks in its own tests, with the
spec version it was checked against, its verdict counts and the command that produced each row.

    python -m a2ats_conformance.report.compat [--size small|full] [--no-suite] [-n N] [--json F] [--results-dir DIR]
    python -m a2ats_conformance.report.compat --page-from DIR/conformance-NAME.json     # the page, from its JSON

runs each row's command (the suite through ``a2ats-conformance``; golden vectors through ``a2ats-conformance
grade``, the example port through ``examples/answer_vectors.py``) in a fresh process, reads the JSON report it
writes and prints the Markdown table. A row's command is printed exactly as it was run, with the temporary
paths shown as VECTORS / ANSWERS / R.json. ``--results-dir DIR`` also writes the table as a results page,
``DIR/conformance-NAME.md`` (with ``.json``), carrying the command, date, commit and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

__all__ = ["rows", "main"]

REFERENCE = "a2ats_conformance.adapters.reference:ReferenceAdapter"
ORACLE = "a2ats_conformance.adapters.oracle:OracleAdapter"
NUMPY = "a2ats_conformance.examples.numpy_port:NumpyPort"
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "answer_vectors.py")


def rows(size: str, suite: bool, n: int) -> list[tuple[str, str, list[list[str]]]]:
    """(implementation, how it is checked, commands); 'R.json', 'VECTORS', 'ANSWERS' are placeholders."""
    cli = ["a2ats-conformance"]
    out = []
    if suite:
        for name, iut, dtype in (("MLX reference (a2ats_ref), CPU", REFERENCE, "float32"),
                                 ("float64 oracle (a2ats_spec.oracle)", ORACLE, "float64"),
                                 ("independent NumPy port (examples/numpy_port.py)", NUMPY, "float32")):
            out.append((name, "Hypothesis suite, profile ci",
                        [cli + ["-n", str(n), "--profile", "ci", "--iut", iut, "--dtype", dtype, "-q",
                                "--report-json", "R.json"]]))
    for name, iut, dtype in (("MLX reference (a2ats_ref), CPU", REFERENCE, "float32"),
                             ("float64 oracle (a2ats_spec.oracle)", ORACLE, "float64")):
        out.append((name, f"golden vectors ({size}), answers via its adapter",
                    [cli + ["grade", "VECTORS", "ANSWERS", "--iut", iut, "--dtype", dtype, "--report-json", "R.json"]]))
    out.append(("independent NumPy port (examples/numpy_port.py)", f"golden vectors ({size}), answer files (no Python adapter)",
                [["python", "conformance/examples/answer_vectors.py", "VECTORS", "ANSWERS"],
                 cli + ["grade", "VECTORS", "ANSWERS", "--report-json", "R.json"]]))
    return out


def _run(cmd: list[str], paths: dict) -> None:
    real = [paths.get(x, x) for x in cmd]
    if real[0] == "a2ats-conformance":
        real = [sys.executable, "-m", "a2ats_conformance.run.cli"] + real[1:]
    elif real[0] == "python":
        real = [sys.executable, EXAMPLE] + real[2:]
    subprocess.run(real, check=False, stdout=subprocess.DEVNULL)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m a2ats_conformance.report.compat", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="full", choices=("small", "full"))
    p.add_argument("--no-suite", action="store_true", help="only the golden-vector rows")
    p.add_argument("-n", type=int, default=2)
    p.add_argument("--json", default=None, metavar="F")
    p.add_argument("--results-dir", default=None, metavar="DIR", help="also write the results page DIR/conformance-NAME.md")
    p.add_argument("--name", default="cpu", help="the page's name after 'conformance-' (default: cpu)")
    p.add_argument("--page-from", default=None, metavar="F",
                   help="render the results page again from its JSON F (DIR/conformance-NAME.json), running nothing")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    if a.page_from:
        try:
            with open(a.page_from, encoding="utf-8") as f:
                res = json.load(f)
            if not isinstance(res, dict) or res.get("benchmark") != "conformance" or not a.page_from.endswith(".json"):
                raise ValueError(f"--page-from: {a.page_from} is not a conformance results page's JSON")
            out = write_page(res, os.path.dirname(os.path.abspath(a.page_from)), os.path.basename(a.page_from)[:-5])
        except (ValueError, OSError) as exc:
            print(f"compat: error: {exc}", file=sys.stderr)
            return 2
        print(f"results page -> {out['md']}", file=sys.stderr)
        return 0
    if a.results_dir:
        # deferred: only a page run needs the bench's machine block, which imports MLX
        from a2ats_ref.bench.cli import machine  # deferred: needs MLX, which the suite runs without
        from a2ats_ref.bench.results_page import check_name, provenance  # deferred: needs MLX, unlike the suite

        try:
            check_name("conformance-" + a.name)
        except ValueError as exc:
            p.error(str(exc))
        if not os.path.isdir(a.results_dir):
            p.error(f"--results-dir: {a.results_dir!r} is not a folder; create it first")

        prov = provenance("python -m a2ats_conformance.report.compat", argv)
        host = machine(False)   # before the rows run: its load average is the one at the start
    t_start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        vectors = os.path.join(tmp, "vectors")
        subprocess.run([sys.executable, "-m", "a2ats_conformance.run.cli", "vectors", "--out", vectors, "--size", a.size],
                       check=True, stdout=subprocess.DEVNULL)
        for i, (name, how, cmds) in enumerate(rows(a.size, not a.no_suite, a.n)):
            paths = {"VECTORS": vectors, "ANSWERS": os.path.join(tmp, f"answers{i}"), "R.json": os.path.join(tmp, f"r{i}.json")}
            t0 = time.perf_counter()
            for cmd in cmds:
                _run(cmd, paths)
            wall = time.perf_counter() - t0
            with open(paths["R.json"], encoding="utf-8") as f:
                r = json.load(f)
            s = r["summary"]
            results.append({"implementation": name, "checked_by": how, "dtype": r["implementation"].get("dtype"),
                            "spec": r.get("spec", {}).get("version"), "pass": s["pass"],
                            "fail": f"{s['fail']} ({', '.join(s['failed_clauses'])})" if s["failed_clauses"] else "0",
                            "other": {k: v for k, v in s.items() if isinstance(v, int) and v and k not in ("pass", "fail", "pytest_exit")},
                            "wall_s": round(wall, 1),
                            "command": " && ".join(shlex.join(c) for c in cmds)})
    table = table_markdown(results)
    print(table, end="")
    if a.results_dir:
        res = {"benchmark": "conformance", "provenance": prov, "machine": host, "rows": results,
               "wall_s": round(time.perf_counter() - t_start, 1)}
        out = write_page(res, a.results_dir, "conformance-" + a.name)
        print(f"results page -> {out['md']}", file=sys.stderr)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


def write_page(res: dict, folder, name: str) -> dict:
    """The conformance results page (a2ats_ref.results_page) for a run's rows."""
    from a2ats_ref.bench import results_page  # deferred: needs MLX, which the suite runs without

    body = ("Every implementation the project checks in its own tests, each row's command run in a fresh process "
            "and its JSON report read (VECTORS, ANSWERS and R.json stand for temporary paths); wall s is the "
            "row's own time.\n\n" + table_markdown(res["rows"]))
    return results_page.write(folder, name, "Conformance: every implementation the project checks", res, body, {})


def table_markdown(results: list[dict]) -> str:
    lines = ["| implementation | checked by | dtype | spec | pass | fail | other | wall s | command |",
             "|---|---|---|---|---:|---:|---|---:|---|"]
    for r in results:
        other = ", ".join(f"{k} {v}" for k, v in r["other"].items()) or "—"
        lines.append(f"| {r['implementation']} | {r['checked_by']} | {r['dtype']} | {r['spec']} | {r['pass']} | "
                     f"{r['fail']} | {other} | {r['wall_s']} | `{r['command']}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
