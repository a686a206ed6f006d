"""pytest plugin of the conformance suite (loaded by the suite's conftest.py).

- options ``--iut``, ``--a2ats-dtype``, ``--xfails``, ``--a2ats-results``, ``--counterexample-dir``,
  ``--clauses``; the IUT defaults to $A2ATS_IUT, then to the MLX reference adapter;
- the ``clause(*ids, needs=(...), requires={...})`` marker, the ``dtype`` parametrisation and the ``ctx`` fixture;
  ``requires`` names capabilities (capabilities.py) the test needs as a whole: without them it reads
  "not-applicable";
- Hypothesis profiles ``quick``, ``ci`` (default) and ``thorough``;
- "not-implemented" skips when the adapter lacks a callable a test needs;
- known deviations (xfails file) applied at collection;
- per-test results (clauses cited, outcome, number of examples, counterexample) written as JSON by
  the controlling process (works under pytest-xdist).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import time

import pytest
from a2ats_conformance.harness.suite_env import exchange as _exchange_jit_modules
from hypothesis import HealthCheck, Phase, settings

from a2ats_spec.clauses import clause_ids

from a2ats_conformance.harness import capabilities as _caps
from a2ats_conformance.run import xfails as _xf
from a2ats_conformance.harness.adapter import (CACHE_FUNCTIONS, CLAUSE_FUNCTIONS, AdapterError, NotImplementedByIUT, describe,
                      has_function, load_adapter, resolve_iut_spec)
from a2ats_conformance.harness.pytest_helpers import Context, ConformanceFailure
from a2ats_conformance.run.watchdog import DEFAULT_EXAMPLE_TIMEOUT_S, ExampleTimeout, dump_path, time_limit

__all__ = ["PROFILES", "known_clauses", "item_clauses", "current_profile", "DTYPE_MATRIX_CLAUSES", "dtypes_for",
           "dtype_summary"]

_HC = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
       HealthCheck.filter_too_much, HealthCheck.large_base_example]
PROFILES = {"quick": 8, "ci": 50, "thorough": 500, "selftest": 12}
# No explain phase: once an example fails, Hypothesis traces every later run of the test (sys.settrace) to
# explain it, which made a failing port's run take about 1.5 times as long, and its comments reach no report:
# the suite's own diagnosis says what the port does differently.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
for _name, _n in PROFILES.items():
    settings.register_profile(_name, max_examples=_n, deadline=None, database=None, print_blob=False,
                              suppress_health_check=_HC,
                              # selftest (mutant runs): a failure is all we need, so skip shrinking
                              phases=_PHASES[:3] if _name == "selftest" else _PHASES)



def current_profile() -> str:
    get = getattr(settings, "get_current_profile_name", None)
    return get() if get else getattr(settings, "_current_profile", "?")


_STATE = pytest.StashKey[dict]()
_ACTIVE: list = []  # configs of the running sessions (a stack: the suite can be run in-process)


def known_clauses() -> list[str]:
    return clause_ids()


def item_clauses(item) -> tuple[str, ...]:
    ids: list[str] = []
    for m in item.iter_markers("clause"):
        ids.extend(m.args)
    return tuple(dict.fromkeys(ids))


def _item_needs(item) -> tuple[str, ...]:
    for m in item.iter_markers("clause"):
        if "needs" in m.kwargs:
            return tuple(m.kwargs["needs"])
    needs: list[str] = []
    for c in item_clauses(item):
        needs.extend(CLAUSE_FUNCTIONS.get(c, CACHE_FUNCTIONS if c.startswith("CACHE-") else ()))
    return tuple(dict.fromkeys(needs))


def _item_requires(item) -> dict:
    req: dict = {}
    for m in item.iter_markers("clause"):
        for k, v in (m.kwargs.get("requires") or {}).items():
            req.setdefault(k, set()).update((v,) if isinstance(v, str) else v)
    return req


def _not_implemented(exc) -> NotImplementedByIUT | None:
    """The NotImplementedByIUT in ``exc``, also when Hypothesis bundles it with other errors (ExceptionGroup)."""
    if isinstance(exc, NotImplementedByIUT):
        return exc
    for sub in getattr(exc, "exceptions", None) or ():
        found = _not_implemented(sub)
        if found is not None:
            return found
    return None


def pytest_addoption(parser):
    g = parser.getgroup("a2ats", "A2ATS conformance suite")
    g.addoption("--iut", default=None, help="adapter of the implementation under test, 'module:object' "
                "(default: $A2ATS_IUT, else the MLX reference)")
    g.addoption("--a2ats-dtype", default=None, help="input dtype to test, or 'all' (default: the adapter's first dtype)")
    g.addoption("--xfails", default=None, help="known-deviations file: '<clause-or-test-id-prefix>  # reason' per line")
    g.addoption("--a2ats-results", default=None, help="write per-test results as JSON to this file")
    g.addoption("--counterexample-dir", default=None, help="where failing examples are saved as .npz")
    g.addoption("--clauses", default=None, help="comma-separated clause IDs: run only tests citing one of them")
    g.addoption("--a2ats-no-port-profile", action="store_true", default=False,
                help="skip the port profile (each mechanism's variant, measured on its own probe)")
    g.addoption("--a2ats-no-diagnosis", action="store_true", default=False,
                help="no revealing search and no likely causes after a failure")
    g.addoption("--a2ats-example-timeout", type=float, default=DEFAULT_EXAMPLE_TIMEOUT_S,
                help="seconds per example before the test fails as 'timeout' (0: no limit)")
    # Set by the supervising a2ats-conformance process (supervisor.py):
    g.addoption("--a2ats-stream", default=None, help="append one JSON line per event (configured, start, test, finish)")
    g.addoption("--a2ats-run-dir", default=None, help="this run's scratch folder (native-hang stack dumps)")
    g.addoption("--a2ats-skip", default=None, help="file of test ids already run (a restarted run skips them)")
    g.addoption("--a2ats-repro-prefix", default="", help="environment the repro command needs (PYTHONPATH=...)")


def _emit(config, event: str, **data) -> None:
    """Append one event to the stream the supervisor reads (one write: lines of parallel writers never mix)."""
    path = config.getoption("a2ats_stream", None)
    if not path:
        return
    line = json.dumps(dict(data, event=event), default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _load_iut(config, spec):
    """Load the adapter; an exit, a hang or an error while importing it is reported, not run past."""

    limit = max(120.0, 4 * (config.getoption("a2ats_example_timeout") or 0))
    faulthandler.dump_traceback_later(limit, exit=True)
    try:
        return load_adapter(spec)
    except AdapterError as exc:
        msg = str(exc)
    except SystemExit as exc:
        msg = f"IUT {spec!r}: the adapter called sys.exit({exc.code!r}) while being imported or instantiated"
    finally:
        faulthandler.cancel_dump_traceback_later()
    _usage_error(config, msg)


def _usage_error(config, msg: str):
    """Stop the session with ``msg``, which the supervisor puts in the report (run.error)."""
    if not hasattr(config, "workerinput"):
        _emit(config, "error", message=msg)
    raise pytest.UsageError(msg)


def pytest_configure(config):
    config.addinivalue_line("markers", "clause(*ids, needs=(), requires={}): spec clauses this property checks "
                            "(a2ats_spec.clauses), the adapter callables and the capabilities it needs")
    config.addinivalue_line("markers", "cost(rank): how heavy one run of this property is, relative to the rest "
                            "(0 when absent); with workers, the costliest start first (heavy_first)")
    try:
        spec = resolve_iut_spec(config.getoption("iut"))
    except AdapterError as exc:
        _usage_error(config, str(exc))
    adapter = _load_iut(config, spec)
    want = config.getoption("a2ats_dtype")
    if want in (None, ""):
        dtypes = [adapter.dtypes[0]]
    elif want == "all":
        dtypes = list(adapter.dtypes)
    else:
        dtypes = [d.strip() for d in want.split(",")]
        bad = [d for d in dtypes if d not in adapter.dtypes]
        if bad:
            _usage_error(config, f"--a2ats-dtype {want!r}: the IUT declares dtypes {list(adapter.dtypes)}; {bad} not supported")
    devs = []
    if config.getoption("xfails"):
        try:
            devs = _xf.read_xfails(config.getoption("xfails"))
        except ValueError as exc:
            _usage_error(config, str(exc))
    caps = _caps.read(adapter, spec)
    _caps.set_current(caps)   # strategies read it at draw time (also on xdist workers: each runs this hook)
    clauses = config.getoption("clauses")
    config.stash[_STATE] = {
        "adapter": adapter, "spec": spec, "dtypes": dtypes, "dtype_default": want in (None, ""),
        "deviations": devs, "caps": caps,
        "only": {c.strip() for c in clauses.split(",")} if clauses else None,
        "tests": {}, "t0": time.time(), "run_dir": config.getoption("a2ats_run_dir"),
    }
    _ACTIVE.append(config)
    if not hasattr(config, "workerinput"):
        _emit(config, "configured", pid=os.getpid(),
              implementation=describe(adapter, spec) | {"dtype": dtype_summary(config.stash[_STATE])})
    prof = getattr(config.option, "hypothesis_profile", None)
    if not prof:
        settings.load_profile("ci")


def pytest_report_header(config):
    st = config.stash.get(_STATE, None)
    if not st:
        return None
    a = st["adapter"]
    return [f"a2ats IUT: {a.name} {a.version} ({st['spec']}), dtype(s): {dtype_summary(st)}, "
            f"hypothesis profile: {current_profile()}"]


#: Clauses whose properties a default run (no --dtype) also runs at every half-precision dtype the IUT declares:
#: users run float16 and bfloat16 models, and a bug of a half-precision branch (a kernel that drops the
#: attention scale, scores in the input dtype) shows only there. The other clauses run at the first dtype.
DTYPE_MATRIX_CLAUSES = frozenset({"RET-LUT", "RET-ATTN", "RET-DECODE", "PREFILL", "CACHE-DECODE"})
HALF_DTYPES = ("float16", "bfloat16")


def dtype_summary(st: dict) -> str:
    """Every dtype the run tests, for the report header: the run's dtypes, and the half-precision dtypes the
    matrix clauses add in a default run (a reader of "float32" alone would think no float16 path ran)."""
    base = ",".join(st["dtypes"])
    matrix = DTYPE_MATRIX_CLAUSES & st["only"] if st.get("only") else DTYPE_MATRIX_CLAUSES
    extra = [d for d in dtypes_for(st, matrix) if d not in st["dtypes"]]
    if not extra:
        return base
    return f"{base} (+{','.join(extra)} for {', '.join(sorted(matrix))})"


def dtypes_for(st: dict, clauses) -> list[str]:
    """The dtypes a test citing ``clauses`` runs at: the run's dtypes, plus the IUT's half-precision dtypes for
    DTYPE_MATRIX_CLAUSES when the run chose none (--dtype left out)."""
    dtypes = list(st["dtypes"])
    if st.get("dtype_default") and DTYPE_MATRIX_CLAUSES.intersection(clauses):
        dtypes += [d for d in st["adapter"].dtypes if d in HALF_DTYPES and d not in dtypes]
    return dtypes


def pytest_generate_tests(metafunc):
    if "dtype" in metafunc.fixturenames:
        st = metafunc.config.stash[_STATE]
        clauses = [c for m in metafunc.definition.iter_markers("clause") for c in m.args]
        metafunc.parametrize("dtype", dtypes_for(st, clauses))


def pytest_collection_modifyitems(session, config, items):
    st = config.stash[_STATE]
    known = set(known_clauses())
    keep, drop = [], []
    for item in items:
        cl = item_clauses(item)
        unknown = [c for c in cl if c not in known]
        if unknown:
            item.add_marker(pytest.mark.skip(reason=f"cites unknown clause(s) {unknown}"))
        if st["only"] is not None and not (set(cl) & st["only"]):
            drop.append(item)
            continue
        keep.append(item)
        for d in st["deviations"]:
            if _xf.matches(d, item.nodeid, cl):
                item.add_marker(pytest.mark.xfail(reason=f"known deviation: {d.reason}", strict=False))
                break
    done = set()
    if config.getoption("a2ats_skip"):
        with open(config.getoption("a2ats_skip"), encoding="utf-8") as f:
            done = {line.rstrip("\n") for line in f if line.strip()}
    if done:
        drop += [it for it in keep if it.nodeid in done]
        keep = [it for it in keep if it.nodeid not in done]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if hasattr(config, "workerinput"):
        items[:] = heavy_first(items, config.workerinput["workercount"])


def _cost(item) -> int:
    marks = list(item.iter_markers("cost"))
    return max(int(m.args[0]) for m in marks) if marks else 0


def heavy_first(items: list, workers: int) -> list:
    """The order pytest-xdist hands the tests out in: the costliest (the ``cost`` marker) first, each of the
    first ``workers`` paired with one of the lightest.

    The run's wall time is its busiest worker's. xdist's load scheduler (with --maxschedchunk 1, as the CLI runs
    it) gives each worker two consecutive tests and then one more whenever it finishes one, and a worker runs a
    test only once it holds the next. Heavy tests collected side by side (one property in three dtypes) would then
    run back to back on one worker while the others idle at the end: on a GPU, where each new head shape compiles
    the decode kernels (a2ats_ref.runtime.decode.cuda), that nearly doubled the suite's time. Paired this way,
    each worker starts on one heavy test, and the remaining heavy ones go to whichever worker frees first, ahead
    of the light ones. Every worker computes the same order from the same collection."""
    ranked = sorted(items, key=_cost, reverse=True)   # stable: collection order within a cost
    n = min(max(1, workers), len(ranked) // 2)
    heads, rest, tails = ranked[:n], ranked[n:len(ranked) - n], ranked[len(ranked) - n:][::-1]
    return [it for pair in zip(heads, tails) for it in pair] + rest


def pytest_collection_finish(session):
    # After every deselection (-k, --clauses, the skip list): the tests this process will run.
    _emit(session.config, "collected", tests={it.nodeid: list(item_clauses(it)) for it in session.items})


def pytest_runtest_setup(item):
    st = item.config.stash[_STATE]
    missing = [f for f in _item_needs(item) if not has_function(st["adapter"], f)]
    if missing:
        pytest.skip(f"not-implemented: the IUT has no {', '.join(missing)}")
    unmet = _caps.unmet(st["caps"], _item_requires(item))
    if unmet:
        pytest.skip(f"not-applicable: needs capability {'; '.join(unmet)}")


@pytest.fixture
def ctx(request, dtype):
    st = request.config.stash[_STATE]
    c = Context(st["adapter"], iut_spec=st["spec"], dtype=dtype, clauses=item_clauses(request.node),
                nodeid=request.node.nodeid, counterexample_dir=request.config.getoption("counterexample_dir"),
                repro_prefix=request.config.getoption("a2ats_repro_prefix"))
    request.node._a2ats_ctx = c
    return c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    ctx = getattr(item, "_a2ats_ctx", None)
    h = getattr(getattr(item, "obj", None), "hypothesis", None)
    limit = item.config.getoption("a2ats_example_timeout")
    dump = dump_path(item.config.getoption("a2ats_run_dir"), item.nodeid)
    if ctx is None or h is None:
        if ctx is not None:
            ctx.begin_example()
        with time_limit(limit, dump):
            yield
        return
    inner = h.inner_test

    @functools.wraps(inner)
    def counted(*args, **kwargs):
        _exchange_jit_modules()   # between examples no compile is in flight: share what this worker compiled
        ctx.begin_example()
        with time_limit(limit, dump):
            return inner(*args, **kwargs)

    h.inner_test = counted
    try:
        outcome = yield
    finally:
        h.inner_test = inner
    if outcome.excinfo is not None and ctx.failures and not item.config.getoption("a2ats_no_diagnosis"):
        # diagnosis: only ever after a failure
        from a2ats_conformance.diagnosis.diagnose import explain_failure  # deferred: only after a failure

        try:   # diagnosis calls the IUT again (revealing search): each of those examples gets the same hang limit
            explain_failure(item, ctx, outcome.excinfo[1], guard=lambda: time_limit(limit, dump))
        except ExampleTimeout:
            item.add_report_section("call", "a2ats diagnosis", "diagnosis stopped: the IUT did not return in time")
        except Exception as exc:  # noqa: BLE001 - diagnosis must never hide the failure it explains
            item.add_report_section("call", "a2ats diagnosis", f"diagnosis failed: {type(exc).__name__}: {exc}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when not in ("setup", "call"):
        return
    ctx = getattr(item, "_a2ats_ctx", None)
    info = {"clauses": list(item_clauses(item)), "examples": ctx.examples if ctx else 0}
    missing = _not_implemented(call.excinfo.value) if call.excinfo is not None else None
    if missing is not None:
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {missing}")
    elif rep.failed and ctx is not None:
        if _timed_out(call.excinfo.value):
            info["timeout"] = True
        cex = ctx.last_failure
        if cex is None or not call.excinfo.errisinstance(ConformanceFailure):
            path = ctx.save_counterexample()
            cex = {"clause": None, "message": call.excinfo.exconly()[:2000],   # not a named check: blames every cited clause
                   "npz": path, "repro": ctx.repro_command(path)}
            rep.sections.append(("a2ats repro", cex["repro"]))
        info["counterexample"] = cex
    rep.user_properties.append(("a2ats", info))


def _timed_out(exc) -> bool:
    return isinstance(exc, ExampleTimeout) or any(_timed_out(e) for e in getattr(exc, "exceptions", None) or ())


def _record(st, rep):
    info = next((v for k, v in rep.user_properties if k == "a2ats"), None)
    rec = st["tests"].setdefault(rep.nodeid, {"clauses": [], "outcome": "passed", "examples": 0, "duration": 0.0})
    if info:
        rec["clauses"] = info["clauses"] or rec["clauses"]
        rec["examples"] = max(rec["examples"], info.get("examples", 0))
        if "counterexample" in info:
            rec["counterexample"] = info["counterexample"]
    rec["duration"] += getattr(rep, "duration", 0.0)
    if hasattr(rep, "wasxfail"):
        rec["outcome"] = "xfail" if rep.skipped else "xpass"
        rec["reason"] = rep.wasxfail
    elif rep.skipped:
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rec["outcome"] = next((o for o in ("not-implemented", "not-applicable") if f"{o}:" in reason), "skip")
        rec["reason"] = reason
    elif rep.failed:
        rec["outcome"] = "fail"
        text = str(rep.longreprtext)
        if info and info.get("timeout"):
            rec["outcome"] = "timeout"
        elif "crashed while running" in text:   # pytest-xdist: the worker process died in this test
            dump = dump_path(st["run_dir"], rep.nodeid)
            hung = bool(dump) and os.path.exists(dump) and os.path.getsize(dump) > 0
            rec["outcome"] = "timeout" if hung else "crash"
            rec["counterexample"] = {"clause": None, "message": (
                "a call into the IUT hung in native code past --example-timeout; the worker process was ended" if hung
                else "the worker process died while running this test (the IUT called os._exit, or crashed)")
                + "\n" + text[-1000:]}
        if "counterexample" not in rec:
            rec["counterexample"] = {"message": text[-2000:]}


def pytest_runtest_logstart(nodeid, location):
    config = _ACTIVE[-1] if _ACTIVE else None
    if config is not None and not hasattr(config, "workerinput"):
        _emit(config, "start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    config = _ACTIVE[-1] if _ACTIVE else None
    st = config.stash.get(_STATE, None) if config is not None else None
    if st is None or hasattr(config, "workerinput"):
        return
    if report.when in ("setup", "call") or report.failed:
        _record(st, report)
        _emit(config, "test", nodeid=report.nodeid, when=report.when, record=st["tests"][report.nodeid])


def pytest_sessionstart(session):
    session.config.stash[_STATE]["t0"] = time.time()


def pytest_runtest_teardown(item, nextitem):
    _exchange_jit_modules()   # share compiled kernels between this run's workers (a2ats_conformance.harness.suite_env says why)


def pytest_unconfigure(config):
    if config in _ACTIVE:
        _ACTIVE.remove(config)
        _caps.set_current(None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    st = config.stash.get(_STATE, None)
    if not st or hasattr(config, "workerinput") or not st["deviations"]:
        return
    tests = {k: v["clauses"] for k, v in st["tests"].items()}
    for d in _xf.unmatched(st["deviations"], tests, warn=False):
        terminalreporter.write_line(f"a2ats: known-deviations line {d.lineno} ({d.pattern!r}) matches no clause or test",
                                    yellow=True)


#: the most seconds one IUT call of the port profile may take (a hung call ends the profile; the verdicts stand)
PROFILE_LIMIT_S = 60.0


def _port_profile(config, st) -> list | None:
    """The port profile (catalogue/profile.py) of the session's first dtype; None with --no-port-profile.
    A failure or a hang in it becomes one row saying so: the clause verdicts never depend on it."""
    if config.getoption("a2ats_no_port_profile"):
        return None
    from a2ats_conformance.catalogue.profile import profile  # deferred: loads the diagnosis

    # each IUT call gets --a2ats-example-timeout (at most PROFILE_LIMIT_S); a native hang ends the process after
    # it (faulthandler, via the dump file): the tests are done and reported, so only the profile is lost
    limit = min(config.getoption("a2ats_example_timeout") or PROFILE_LIMIT_S, PROFILE_LIMIT_S)
    # this process ran no test: without the modules the workers compiled, its first call would build them all again
    # (on a cold GPU run over a minute, past the limit: the profile, and the run's exit status, would be lost)
    _exchange_jit_modules()
    dump = dump_path(st["run_dir"], "a2ats-port-profile")
    try:
        return profile(st["adapter"], dtype=st["dtypes"][0], caps=st["caps"], guard=lambda: time_limit(limit, dump))
    except ExampleTimeout:
        why = f"an IUT call did not return within {limit:g} s"
    except Exception as exc:  # noqa: BLE001 - the profile must never take the verdicts down
        why = f"{type(exc).__name__}: {exc}"
    return [{"mechanism": "profile", "title": "port profile", "probe": "", "status": "error", "variant": "error",
             "kind": None, "description": "", "source": "", "evidence": f"profile stopped: {why}"[:500],
             "clauses": []}]


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):
        return
    st = config.stash.get(_STATE, None)
    path = config.getoption("a2ats_results")
    if not st:
        return
    stale = _xf.unmatched(st["deviations"], {k: v["clauses"] for k, v in st["tests"].items()}, warn=False)
    st["port_profile"] = None if exitstatus == pytest.ExitCode.INTERRUPTED else _port_profile(config, st)
    _emit(config, "profile", rows=st["port_profile"])
    _emit(config, "finish", exitstatus=int(exitstatus),
          xfail_warnings=[f"line {d.lineno}: {d.pattern!r} matches no clause or test" for d in stale])
    if not path:
        return
    out = {
        "implementation": describe(st["adapter"], st["spec"]) | {"dtype": dtype_summary(st)},
        "hypothesis_profile": current_profile(),
        "tests": st["tests"],
        "xfail_warnings": [f"line {d.lineno}: {d.pattern!r} matches no clause or test" for d in stale],
        "only_clauses": sorted(st["only"]) if st["only"] else None,
        "port_profile": st["port_profile"],
        "exitstatus": int(exitstatus),
        "wall_s": time.time() - st["t0"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, default=str)
