"""Shared test hooks: every conformance report a test writes must match the report schema the package ships;
`on_cpu` runs a test on MLX's CPU device."""

import json
import os
import sys
from pathlib import Path

# Shared helper modules (hang_guard, test_cache_support, test_calib_tiny, test_codebook_file, gguf_writer) are imported by
# name from every folder, and from the children that tests start with this folder list as PYTHONPATH.
HELPER_DIRS = [str(Path(__file__).parent), *(str(Path(__file__).parent / sub) for sub in ("runtime", "calibration"))]
for _d in HELPER_DIRS:
    if _d not in sys.path:
        sys.path.insert(0, _d)

# Full float32 matmuls on GPUs and a JIT cache of this process's own, before MLX runs (suite_env says why).
from a2ats_conformance.harness.suite_env import exchange, pin_suite_process  # noqa: E402

pin_suite_process()

import pytest

from a2ats_conformance.run.supervisor import share_blas_cores  # noqa: E402


def pytest_configure(config):
    """With ``-n N``, the xdist workers this process starts each get 1/N of the cores for BLAS, as the suite's own
    workers do (unless the user set a count): N workers each spinning BLAS threads over every core oversubscribe
    the machine N-fold. Set here, in the controller, because each worker loads its BLAS at its first import."""
    n = getattr(config.option, "numprocesses", None)
    if isinstance(n, int) and not os.environ.get("PYTEST_XDIST_WORKER"):
        share_blas_cores(os.environ, n)


def pytest_runtest_teardown(item, nextitem):
    exchange()   # share the kernels compiled so far with the other workers and later subprocesses (suite_env)


@pytest.fixture(autouse=True)
def _reports_match_the_shipped_schema(request):
    """After each test that used tmp_path: every JSON report under it validates against report.schema.json."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if tmp is None:
        return
    for path in sorted(tmp.rglob("*.json")):
        if path.is_symlink() or not path.is_file():   # a FIFO a test made would block the read forever
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):   # a hostile file a test wrote, not a report
            continue
        if isinstance(data, dict) and "clauses" in data and "summary" in data:   # a conformance report
            from a2ats_conformance.report.writer import validate_report

            validate_report(data)


@pytest.fixture
def on_cpu():
    """Run the test on MLX's CPU device (on a GPU machine too: CPU-only kernels and tactics), then restore it."""
    import a2ats_ref  # noqa: F401  (before mlx: the BLAS preload)
    import mlx.core as mx

    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture
def rejected_on_its_clause(tmp_path):
    """run(name, diagnose=True) -> the clause verdict of mutant `name` (a2ats_conformance.mutants) run on its expected_clause
    (selftest profile, seed 0), after asserting the run rejected it there: exit 1, the clause failed, and the
    counterexample names the clause. Each mutant set's test adds its own checks on the verdict."""
    from a2ats_conformance import mutants
    from a2ats_conformance.run.cli import main

    def run(name, diagnose=True):
        cls = getattr(mutants, name)
        out = tmp_path / "r.json"
        # A cache mutant's bug shows at float32 unless it is a half-precision branch: running such a mutant over
        # the whole dtype matrix would triple the time of the longest runs for nothing.
        one_dtype = cls.expected_clause == "CACHE-DECODE" and not getattr(cls, "half_precision", False)
        # A gap mutant is run on the property written for it (its catalogue entry's ``prop``), which must reject
        # it: the rest of its clause would add minutes of runs that can only confirm the same verdict.
        only = ["-k", " and ".join(p.removesuffix(".py") for p in cls.gap.split("::"))] if cls.gap else []
        # No port profile: each record's probe is tested on its own (test_profile.py); here only the clause's
        # verdict and its diagnosis count, and the profile's probes would add about a second to every run.
        # diagnose=False where the test reads no likely cause: the diagnosis replays the failure under every
        # deviation, most of a failing run's time, and cannot change the verdict.
        code = main(["--iut", f"a2ats_conformance.mutants:{name}", "--profile", "selftest", "--seed", "0", "-q",
                     "--no-port-profile", *([] if diagnose else ["--no-diagnosis"]),
                     "--clauses", cls.expected_clause, "--report-json", str(out), *only,
                     "--counterexample-dir", str(tmp_path / "cex"), *(["--dtype", "float32"] if one_dtype else [])])
        verdict = json.loads(out.read_text())["clauses"][cls.expected_clause]
        assert code == 1, f"{name} ({getattr(cls, 'coverage_item', '')} {cls.bug}) was not rejected: {verdict}"
        assert verdict["status"] == "fail"
        assert verdict["counterexample"].get("clause") == cls.expected_clause, verdict["counterexample"]
        return verdict
    return run
