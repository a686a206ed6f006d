"""Honest runs (README-ADAPTER.md, "Honest runs"): ``a2ats-conformance`` runs pytest in a child process and
reads what the child streams to a file as each test finishes, so that whatever the IUT does -- exit the
process, hang in native code, be interrupted -- the run still ends in a report that says what happened.

The child is ``python -m pytest`` on the installed suite with the plugin's stream options (plugin.py).  If it
dies while a test runs, that test is recorded as ``crash`` (or ``timeout``, when the watchdog's stack dump is
there) and a fresh child runs the remaining tests.  If it dies before the adapter is loaded, the run is an
error.  On Ctrl-C the child is interrupted too, and every test that did not finish reads ``interrupted``, also when the
child has to be killed because it did not stop in time (the supervisor's kill is not a crash of the IUT).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading

from a2ats_conformance.run.watchdog import dump_path

__all__ = ["Outcome", "run_child_suite", "import_prefix", "read_stream"]

#: How many times a run continues after its child died in a test (each restart skips the tests done).
MAX_RESTARTS = 8
#: Seconds a child gets to write its report after Ctrl-C before it is killed.
INTERRUPT_GRACE_S = 15.0


class Outcome(dict):
    """The child results: implementation, tests {nodeid: record}, collected {nodeid: clauses}, plus run facts:
    pytest_exit, complete (every collected test has a verdict), interrupted, error (no test could run), crashes."""


def read_stream(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:   # a line cut short by a killed process
                continue
    return events


#: thread-count variables of the BLAS and OpenMP runtimes a port or the oracle may load
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def worker_threads(workers: int, cpus: int | None = None) -> int:
    """BLAS threads per worker so that ``workers`` processes share the cores instead of each spreading over all
    of them (N workers x all-core BLAS oversubscribes the machine N-fold)."""
    return max(1, (cpus or os.cpu_count() or 1) // max(1, workers))


def share_blas_cores(env, workers: int) -> None:
    """With several ``workers``, set each BLAS thread count in ``env`` to a worker's share of the cores, unless
    the user set one."""
    if workers > 1:
        for var in THREAD_ENV:
            env.setdefault(var, str(worker_threads(workers)))


def _child_env(workers: int = 1) -> dict:
    """The child imports what this process can: its sys.path (cwd for '') goes first on PYTHONPATH. With
    several workers, each gets its share of the cores for BLAS, unless the user set a thread count.

    The child loads only the pytest plugins the suite names (``cli.SUITE_PLUGINS``), never the ones installed
    beside it: a plugin that reorders, reseeds, retries or times tests would change verdicts. Autoloading also
    makes pytest rewrite the asserts of every module in each plugin's distribution (all of Hypothesis), work
    that is repeated at every start where bytecode is not cached."""
    env = dict(os.environ)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    share_blas_cores(env, workers)
    paths = [os.getcwd() if p == "" else p for p in sys.path if p == "" or os.path.isdir(p)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def import_prefix(iut_spec: str) -> str:
    """``PYTHONPATH=<root>`` when the IUT's top-level module is not importable from a plain shell in the
    current folder (e.g. found through this run's PYTHONPATH or a test's sys.path), else ''.  Finds the module
    without executing it."""
    top = iut_spec.partition(":")[0].split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return ""
    plain_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({top!r}) is None)"
    try:
        plain = subprocess.run([sys.executable, "-c", probe], env=plain_env, cwd=os.getcwd(), timeout=60,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        plain = False
    if plain:
        return ""
    if spec.submodule_search_locations:          # a package: its parent folder goes on the path
        root = os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
    else:
        root = os.path.dirname(os.path.abspath(spec.origin))
    return f"PYTHONPATH={shlex.quote(root)}"


def _kill_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(proc: subprocess.Popen) -> tuple[int, bool]:
    """Wait for the child; on Ctrl-C interrupt it (and its xdist workers) and wait for its report."""
    try:
        return proc.wait(), False
    except KeyboardInterrupt:
        _kill_group(proc, signal.SIGINT)
        try:
            code = proc.wait(timeout=INTERRUPT_GRACE_S)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            _kill_group(proc, signal.SIGKILL)
            code = proc.wait()
        return code, True
    finally:
        _kill_group(proc, signal.SIGKILL)   # orphaned xdist workers of a dead controller


def _default_sigint() -> None:
    """In the child, before it runs: SIGINT at its default. A process started with SIGINT ignored (nohup, a shell's
    background job, some CI runners) passes that on, Python then installs no KeyboardInterrupt handler, and the
    SIGINT this supervisor sends on Ctrl-C or SIGTERM would not stop the child: it would run to the end and its
    verdicts would stand for a run the user had stopped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _term_as_interrupt(signum, frame):
    raise KeyboardInterrupt   # SIGTERM (a CI job cancelled) is handled like Ctrl-C: reports still written


def run_child_suite(pytest_args: list[str], *, quiet: bool, workers: int = 1) -> Outcome:
    """Run ``python -m pytest *pytest_args`` in a supervised child (see the module docstring); ``workers``: the
    xdist worker count the arguments ask for."""

    if threading.current_thread() is not threading.main_thread():
        return _run_child_suite(pytest_args, quiet=quiet, workers=workers)
    old = signal.signal(signal.SIGTERM, _term_as_interrupt)
    try:
        return _run_child_suite(pytest_args, quiet=quiet, workers=workers)
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_child_suite(pytest_args: list[str], *, quiet: bool, workers: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="a2ats-run-") as run_dir:
        stream = os.path.join(run_dir, "stream.jsonl")
        skip = os.path.join(run_dir, "done.txt")
        args = [*pytest_args, f"--a2ats-stream={stream}", f"--a2ats-run-dir={run_dir}", f"--a2ats-skip={skip}"]
        out = Outcome(tests={}, collected={}, done=set(), implementation=None, crashes=[], interrupted=False,
                      error=None, xfail_warnings=[], pytest_exit=None, complete=False, port_profile=None)
        seen = 0
        for _ in range(MAX_RESTARTS + 1):
            with open(skip, "w", encoding="utf-8") as f:
                f.write("".join(n + "\n" for n in out["done"]))
            proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], env=_child_env(workers), start_new_session=True,
                                    stdout=subprocess.DEVNULL if quiet else None, preexec_fn=_default_sigint)
            code, interrupted = _wait(proc)
            events = read_stream(stream)
            finished = _absorb(out, events[seen:], run_dir, code, interrupted)   # this child's events only
            seen = len(events)
            out["pytest_exit"] = code
            if interrupted:
                out["interrupted"] = True
                break
            if finished or out["error"] or out["implementation"] is None:
                break
            if not set(out["collected"]) - out["done"]:
                break
        if out["implementation"] is None and not out["error"]:
            out["error"] = (f"the suite's process exited with status {out['pytest_exit']} before the IUT was loaded "
                            f"(the adapter exited or crashed while being imported?)")
        left = [n for n in out["collected"] if n not in out["done"]]
        why = "the run was interrupted (Ctrl-C or SIGTERM)" if out["interrupted"] else "the run stopped before this test finished"
        for nid in left:   # a test cut short keeps no verdict, whatever its setup reported
            out["tests"][nid] = {"clauses": out["collected"][nid], "examples": 0, "duration": 0.0,
                                 "outcome": "interrupted", "reason": why}
        out["complete"] = bool(out["collected"]) and not left and not out["error"]
        out["done"] = sorted(out["done"])
        return out


def _absorb(out: Outcome, events: list[dict], run_dir: str, code: int, interrupted: bool = False) -> bool:
    """Fold the stream into ``out``; a test that started but has no final report is the one the child died
    in, unless the run was ``interrupted``: then the child may have been killed by this supervisor (it did not
    stop within INTERRUPT_GRACE_S), which is no crash of the IUT, and the test reads ``interrupted``.
    Returns whether the child finished its session."""
    started, done, finished = [], out["done"], False
    for ev in events:
        kind = ev.get("event")
        if kind == "configured":
            out["implementation"] = ev["implementation"]
        elif kind == "error":
            out["error"] = ev["message"]
        elif kind == "collected":
            for nid, cl in ev["tests"].items():
                out["collected"].setdefault(nid, cl)
        elif kind == "start":
            started.append(ev["nodeid"])
        elif kind == "test":
            out["tests"][ev["nodeid"]] = ev["record"]
            if ev.get("when") != "setup" or ev["record"].get("outcome") != "passed":
                done.add(ev["nodeid"])
        elif kind == "profile":
            out["port_profile"] = ev.get("rows")
        elif kind == "finish":
            finished = True
            out["xfail_warnings"] = ev.get("xfail_warnings", [])
    if finished or interrupted:
        return finished
    for nid in dict.fromkeys(started):
        if nid in done or out["tests"].get(nid, {}).get("outcome") in ("crash", "timeout"):
            continue
        dump = dump_path(run_dir, nid)
        hung = bool(dump) and os.path.exists(dump) and os.path.getsize(dump) > 0
        msg = ("a call into the IUT hung in native code past --example-timeout; the suite's process was ended"
               if hung else f"the suite's process exited with status {code} while running this test "
                            "(the IUT called sys.exit/os._exit, or crashed)")
        rec = dict(out["tests"].get(nid) or {"clauses": out["collected"].get(nid, []), "examples": 0, "duration": 0.0})
        rec.update(outcome="timeout" if hung else "crash", counterexample={"clause": None, "message": msg})
        out["tests"][nid] = rec
        out["crashes"].append({"test": nid, "outcome": rec["outcome"], "exit": code})
        done.add(nid)
    return False
