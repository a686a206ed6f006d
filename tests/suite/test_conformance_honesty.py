"""The conformance runner reports only verdicts the run earned: capabilities steer draws and mark what a port
does not support not-applicable / not-implemented (never fail).  Adapters: tests/suite/honesty_adapters/."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from a2ats_conformance.harness.adapter import NotImplementedByIUT
from a2ats_conformance.run.cli import main
from a2ats_conformance.run.plugin import _not_implemented
from a2ats_conformance.diagnosis.repro import TMP_PLACEHOLDER, load_counterexample
from hang_guard import HANG_S


def _run(tmp_path, *args):
    out = tmp_path / "r.json"
    code = main([*args, "-q", "--seed", "0", "--profile", "selftest", "--report-json", str(out)])
    rep = json.loads(out.read_text())
    return code, rep, {c: v["status"] for c, v in rep["clauses"].items()}


def test_fraction_only_port_gets_no_integer_topk(tmp_path):
    code, rep, st = _run(tmp_path, "--iut", "honesty_adapters.fraction_only",
                         "--clauses", "RET-TOPK,RET-SELECT,RET-DECODE,EQ-17-INIT")
    assert st == {"RET-TOPK": "pass", "RET-SELECT": "pass", "RET-DECODE": "pass", "EQ-17-INIT": "pass"}, rep
    assert code == 0
    stream = {n: t for n, t in rep["tests"].items() if "test_kmeanspp_init_matches_oracle" in n}
    assert [t["outcome"] for t in stream.values()] == ["not-applicable"], stream   # the oracle-stream test
    assert "randomness 'explicit'" in next(iter(stream.values()))["reason"]
    assert rep["implementation"]["capabilities"]["topk"] == ["fraction"]


@pytest.mark.parametrize("adapter, status", [("NoTrim", "not-implemented"), ("DeclaredNoTrim", "not-applicable")])
def test_cache_without_trim(tmp_path, adapter, status):
    code, rep, st = _run(tmp_path, "--iut", f"honesty_adapters.partial_cache:{adapter}",
                         "--clauses", "CACHE-TRIM,CACHE-SAVE,CACHE-DECODE")
    assert st == {"CACHE-TRIM": status, "CACHE-SAVE": status, "CACHE-DECODE": "pass"}, rep["clauses"]
    assert code == 0
    assert "trim" in rep["clauses"]["CACHE-TRIM"]["reason"]


def test_count_only_port_gets_no_fraction(tmp_path):
    code, rep, st = _run(tmp_path, "--iut", "honesty_adapters.count_only", "--clauses", "RET-TOPK,RET-SELECT,RET-DECODE")
    assert code == 0 and st == {"RET-TOPK": "pass", "RET-SELECT": "pass", "RET-DECODE": "pass"}, rep["clauses"]
    na = [n for n, t in rep["tests"].items() if t["outcome"] == "not-applicable"]
    assert len(na) == 1 and "test_select_tokens_is_never_empty" in na[0]   # only a fraction selects 0 tokens


def test_clause_of_only_not_applicable_tests_reads_not_applicable():
    from a2ats_conformance.run.cli import clause_table

    tests = {"a": {"clauses": ["EQ-17-INIT"], "outcome": "not-applicable", "reason": "not-applicable: x", "examples": 0},
             "b": {"clauses": ["EQ-17-INIT", "EQ-14"], "outcome": "skip", "examples": 0},
             "c": {"clauses": ["EQ-14"], "outcome": "passed", "examples": 0}}
    t = clause_table(tests, ["EQ-17-INIT", "EQ-14"])
    assert t["EQ-17-INIT"]["status"] == "not-applicable" and t["EQ-17-INIT"]["reason"] == "not-applicable: x"
    assert t["EQ-14"]["status"] == "untested"          # passed with 0 examples is not a pass


def test_not_implemented_inside_an_exception_group():
    err = NotImplementedByIUT("trim", owner="cache")
    group = ExceptionGroup("hypothesis found 2 distinct failures", [ValueError("other"), ExceptionGroup("x", [err])])
    assert _not_implemented(group) is err and _not_implemented(ValueError()) is None


# --------------------------------------------------------------------------- honest runs (subprocesses)

ROOT = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "a2ats_conformance.run.cli"]
FAST = ["--profile", "selftest", "--seed", "0", "-q", "--clauses", "RET-TOPK,ROPE-FREQ"]


def _cli(tmp_path, *args, env=None, name="r"):
    """Run a2ats-conformance in a subprocess (an IUT may take the process down); -> (exit, report, md, stderr)."""
    js, md = tmp_path / f"{name}.json", tmp_path / f"{name}.md"
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    p = subprocess.run([*CLI, *args, "--report-json", str(js), "--report-md", str(md)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=HANG_S)
    rep = json.loads(js.read_text()) if js.exists() else None
    return p.returncode, rep, md.read_text() if md.exists() else "", p.stderr


def _statuses(rep):
    return {c: v["status"] for c, v in rep["clauses"].items()}


def _no_unearned_pass(rep):
    assert not [c for c, v in rep["clauses"].items() if v["status"] == "pass" and v["examples"] == 0], rep["clauses"]


def _sigint(disposition):
    return lambda: signal.signal(signal.SIGINT, disposition)


@pytest.mark.parametrize("sig, sigint", [(signal.SIGINT, signal.SIG_DFL), (signal.SIGTERM, signal.SIG_DFL),
                                         (signal.SIGTERM, signal.SIG_IGN)])
def test_ctrl_c_writes_reports_and_no_unearned_pass(tmp_path, sig, sigint):
    # The CLI starts with SIGINT at its default (a terminal's Ctrl-C) or ignored (nohup, a background job, some CI
    # runners, which then stop a job by SIGTERM): either way the supervised child must stop, and the run must read
    # interrupted. With SIGINT ignored and inherited, a child that is not stopped finishes and the run reads complete.
    marker = tmp_path / "started"
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT), A2ATS_TEST_MARKER=str(marker))
    p = subprocess.Popen([*CLI, "--iut", "honesty_adapters.misbehave:Slow", *FAST, "--report-json", str(js),
                          "--report-md", str(md)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                         preexec_fn=_sigint(sigint))
    deadline = time.time() + HANG_S
    while not marker.exists() and time.time() < deadline:   # ROPE-FREQ (1 s per call) has started
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(sig)
    code = p.wait(timeout=HANG_S)
    rep = json.loads(js.read_text())
    assert code == 3 and rep["run"]["interrupted"] and not rep["run"]["complete"]
    assert _statuses(rep) == {"RET-TOPK": "pass", "ROPE-FREQ": "interrupted"}, rep["clauses"]
    _no_unearned_pass(rep)
    assert "interrupted (Ctrl-C or SIGTERM)" in md.read_text()


def test_ctrl_c_that_the_suite_ignores_is_interrupted_not_a_crash(tmp_path):
    # The child ignores SIGINT inside the IUT's call, so the supervisor kills it after its grace period: that kill
    # is the supervisor's, not a crash of the port. The run reads interrupted (exit 3), the clause not 'crash'.
    marker = tmp_path / "started"
    js = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), A2ATS_TEST_MARKER=str(marker))
    short_grace = ("import sys, a2ats_conformance.run.supervisor as s; s.INTERRUPT_GRACE_S = 1.0; "
                   "from a2ats_conformance.run.cli import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.Popen([sys.executable, "-c", short_grace, "--iut", "honesty_adapters.misbehave:Stubborn", *FAST,
                          "--report-json", str(js)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                         preexec_fn=_sigint(signal.SIG_DFL))   # a terminal's Ctrl-C: not ignored as a background job's
    deadline = time.time() + HANG_S
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    code = p.wait(timeout=HANG_S)
    rep = json.loads(js.read_text())
    assert _statuses(rep) == {"RET-TOPK": "pass", "ROPE-FREQ": "interrupted"}, rep["clauses"]
    assert code == 3 and rep["run"]["interrupted"] and not rep["run"]["crashes"], rep["run"]


def test_empty_iut_is_an_error(tmp_path):
    code, rep, _, err = _cli(tmp_path, "--iut", "", *FAST)
    assert code == 2 and rep is None and "--iut '' is empty" in err
    code, _, _, err = _cli(tmp_path, *FAST, env=dict(os.environ, A2ATS_IUT=" "))
    assert code == 2 and "A2ATS_IUT is set but empty" in err


@pytest.mark.parametrize("module, says", [("exit_on_import", "called sys.exit(0) while being imported"),
                                          ("hard_exit_on_import", "exited with status 0 before the IUT was loaded")])
def test_exit_on_import_is_reported(tmp_path, module, says):
    code, rep, md, _ = _cli(tmp_path, "--iut", f"honesty_adapters.{module}", *FAST)
    assert code == 2 and says in rep["run"]["error"] and says in md
    assert set(_statuses(rep).values()) == {"untested"}


@pytest.mark.parametrize("adapter, n, status", [("ExitInCall", "1", "crash"), ("SysExitInCall", "1", "fail")])
def test_exit_inside_a_call_fails_its_clause_and_the_run_goes_on(tmp_path, adapter, n, status):
    code, rep, _, _ = _cli(tmp_path, "--iut", f"honesty_adapters.misbehave:{adapter}", *FAST, "-n", n)
    assert code == 1 and _statuses(rep) == {"RET-TOPK": status, "ROPE-FREQ": "pass"}, rep["clauses"]
    assert rep["run"]["complete"]


@pytest.mark.parametrize("adapter, n", [("Hang", "1"), ("NativeHang", "1"), ("NativeHang", "2")])
def test_a_hang_is_a_timeout(tmp_path, adapter, n):
    """A native hang ends the process running the test: the supervisor (-n 1) or pytest-xdist (-n 2) goes on."""
    code, rep, _, _ = _cli(tmp_path, "--iut", f"honesty_adapters.misbehave:{adapter}", *FAST, "--example-timeout", "1",
                           "-n", n)
    assert code == 1 and _statuses(rep) == {"RET-TOPK": "timeout", "ROPE-FREQ": "pass"}, rep["clauses"]


def test_concurrent_runs_get_their_own_counterexamples(tmp_path):
    args = ["--iut", "a2ats_conformance.mutants:TopkCeil", "--profile", "selftest", "--seed", "0", "-q",
            "--clauses", "RET-TOPK", "--counterexample-dir", str(tmp_path / "cex")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([*CLI, *args, "--report-json", str(tmp_path / f"{i}.json")], env=env,
                              stdout=subprocess.DEVNULL) for i in range(2)]
    assert [p.wait(timeout=HANG_S) for p in procs] == [1, 1]
    reps = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    dirs = {r["run"]["counterexample_dir"] for r in reps}
    npz = {r["clauses"]["RET-TOPK"]["counterexample"]["npz"] for r in reps}
    assert len(dirs) == 2 and len(npz) == 2
    assert all(Path(p).exists() and Path(p).parent.parent == tmp_path / "cex" for p in npz)


@pytest.mark.parametrize("flag", ["--report-json", "--report-md"])
def test_bad_report_path_is_rejected_before_the_run(tmp_path, flag):
    p = subprocess.run([*CLI, "--profile", "quick", flag, str(tmp_path / "no" / "such" / "dir" / "r.out")],
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 2 and f"{flag} " in p.stderr and "cannot be written" in p.stderr
    assert "conformance:" not in p.stdout and "verdict" not in p.stdout    # no suite ran
    p = subprocess.run([*CLI, "--profile", "quick", flag, str(tmp_path)], capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 2 and "is a folder" in p.stderr


# --------------------------------------------------------------------------- replay

def test_cache_replay_is_self_contained_and_names_the_divergence(tmp_path, capsys):
    code, rep, md, _ = _cli(tmp_path, "--iut", "honesty_adapters.partial_cache:LossyLoad", "--profile", "selftest",
                            "--seed", "0", "-q", "--clauses", "CACHE-SAVE")
    cex = rep["clauses"]["CACHE-SAVE"]["counterexample"]
    assert code == 1 and rep["clauses"]["CACHE-SAVE"]["status"] == "fail"
    # one copy-paste line: this interpreter, the file, the IUT, and the import path it needs
    assert cex["repro"] == (f"PYTHONPATH={ROOT} {sys.executable} -m a2ats_conformance.diagnosis.repro {cex['npz']} "
                            "--iut honesty_adapters.partial_cache:LossyLoad")
    assert cex["repro"] in md
    meta, calls = load_counterexample(cex["npz"])
    paths = [a for _, args, _ in calls for a in args if isinstance(a, str)]
    assert paths and all(p.startswith(TMP_PLACEHOLDER + "/") for p in paths), paths   # no dead temp path
    p = subprocess.run(cex["repro"], shell=True, capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 1 and "<-- first divergence from the oracle" in p.stdout, p.stdout + p.stderr
    assert "mismatched elements" in p.stdout or "shape" in p.stdout


def test_repro_requires_the_iut(tmp_path):
    code, rep, _, _ = _cli(tmp_path, "--iut", "a2ats_conformance.mutants:TopkCeil", "--profile", "selftest", "--seed",
                           "0", "-q", "--clauses", "RET-TOPK")
    npz = rep["clauses"]["RET-TOPK"]["counterexample"]["npz"]
    p = subprocess.run([sys.executable, "-m", "a2ats_conformance.diagnosis.repro", npz], capture_output=True, text=True)
    assert p.returncode == 2 and "--iut is required" in p.stderr and "a2ats_conformance.mutants:TopkCeil" in p.stderr


def test_workers_share_the_cores_for_blas(monkeypatch):
    """N workers each spreading BLAS over every core oversubscribe the machine N-fold: each gets its share, and
    a thread count the user set is kept."""
    from a2ats_conformance.run import supervisor as S

    for var in S.THREAD_ENV:
        monkeypatch.delenv(var, raising=False)
    assert all(v not in S._child_env(1) for v in S.THREAD_ENV)
    env = S._child_env(2)
    assert {env[v] for v in S.THREAD_ENV} == {str(S.worker_threads(2))}
    assert S.worker_threads(15, cpus=16) == 1 and S.worker_threads(2, cpus=16) == 8 and S.worker_threads(4, cpus=2) == 1
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert S._child_env(2)["OPENBLAS_NUM_THREADS"] == "3"


def test_plugins_installed_beside_the_suite_are_not_loaded_in_its_run(tmp_path):
    """A pytest plugin installed in the port's environment (an entry point in the pytest11 group: one that reorders,
    reruns or fails tests, say) must not run inside the suite, or it could change verdicts. The plugin here fails
    every test it sees; plain pytest in the same environment loads it, the suite's run does not."""
    site = tmp_path / "site"
    (site / "failall_plugin-1.0.dist-info").mkdir(parents=True)
    (site / "failall_plugin-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: failall-plugin\nVersion: 1.0\n")
    (site / "failall_plugin-1.0.dist-info" / "entry_points.txt").write_text("[pytest11]\nfailall = failall_plugin\n")
    (site / "failall_plugin.py").write_text(
        "import os, pytest\n"
        "def pytest_configure(config):\n"
        "    open(os.environ['FAILALL_MARK'], 'a').write('loaded\\n')\n"
        "@pytest.hookimpl(tryfirst=True)\n"
        "def pytest_runtest_call(item):\n"
        "    raise AssertionError('failall plugin')\n")
    mark = tmp_path / "mark"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), FAILALL_MARK=str(mark))
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    (tmp_path / "t" / "test_one.py").parent.mkdir()
    (tmp_path / "t" / "test_one.py").write_text("def test_one():\n    pass\n")
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "t")],
                           env=env, capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path)
    assert plain.returncode == 1 and mark.read_text() == "loaded\n", plain.stdout[-2000:]   # the plugin works
    mark.unlink()
    out = tmp_path / "r.json"
    p = subprocess.run([*CLI, "--profile", "quick", "--seed", "0", "-q", "--clauses", "ROPE-FREQ", "--no-port-profile",
                        "--report-json", str(out)], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0 and not mark.exists(), p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads(out.read_text())["clauses"]["ROPE-FREQ"]["status"] == "pass"


def test_no_diagnosis_gives_the_same_verdict_without_causes(tmp_path):
    """--no-diagnosis skips the revealing search and the likely causes, and nothing else: the failing clause, its
    failing tests and its minimal counterexample's message are those of a run with the diagnosis."""
    args = ["--iut", "a2ats_conformance.mutants:TopkCeil", "--profile", "selftest", "--seed", "0", "-q",
            "--no-port-profile", "--clauses", "RET-TOPK"]
    reps = {}
    for mode in ("diagnosed", "undiagnosed"):
        code, reps[mode], md, _ = _cli(tmp_path, *args, *(["--no-diagnosis"] if mode == "undiagnosed" else []), name=mode)
        assert code == 1 and reps[mode]["clauses"]["RET-TOPK"]["status"] == "fail"
        assert reps[mode]["run"]["diagnosis"] == (mode == "diagnosed")     # the report says which it was
        assert ("diagnosis: off" in md) == (mode == "undiagnosed")
    with_, without = (reps[m]["clauses"]["RET-TOPK"] for m in ("diagnosed", "undiagnosed"))
    assert with_["counterexample"].get("likely_causes") and "likely_causes" not in without["counterexample"]
    assert with_["failed_tests"] == without["failed_tests"]
    assert without["counterexample"]["message"] in with_["counterexample"]["message"]
