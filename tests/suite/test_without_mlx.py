"""The suite, the oracle, ``vectors`` and ``grade`` run where MLX and mlx-lm cannot be imported: a port written in
another framework installs the core package beside its own dependencies, without the ``[mlx]`` extra.

Each command runs in a subprocess whose import system refuses ``mlx``, ``mlx_lm`` and ``a2ats_ref.runtime`` (a
``sys.meta_path`` finder installed by a ``sitecustomize`` on PYTHONPATH, so the suite's child process inherits it).
A fresh virtual environment would need the network or a wheel cache to install into; the blocker needs neither
and fails the same way on any import of the reference's framework on these paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hang_guard import HANG_S

ORACLE = "a2ats_conformance.adapters.oracle:OracleAdapter"
#: a few clauses that reach the oracle's stateless and cache paths, the report writer and the run's metadata
CLAUSES = "ROPE-APPLY,EQ-10,CACHE-TRIM"

BLOCKER = '''
import sys

BLOCKED = ("mlx", "mlx_lm")


class _NoMLX:
    """Refuses the reference's framework: what an environment without the [mlx] extra does."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or name == "a2ats_ref.runtime" or name.startswith("a2ats_ref.runtime."):
            raise ImportError(f"No module named {name!r} (blocked: this environment has no MLX)")
        return None


sys.meta_path.insert(0, _NoMLX())
'''


@pytest.fixture(scope="module")
def no_mlx(tmp_path_factory):
    site = tmp_path_factory.mktemp("no-mlx-site")
    (site / "sitecustomize.py").write_text(BLOCKER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("A2ATS_IUT", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "a2ats_conformance.run.cli", *args], env=env,
                              capture_output=True, text=True, timeout=HANG_S)

    probe = subprocess.run([sys.executable, "-c", "import mlx.core"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "blocked" in probe.stderr, "the import blocker did not take effect"
    cli.env = env
    return cli


def test_oracle_suite_runs_without_mlx_and_the_report_says_mlx_is_absent(no_mlx, tmp_path):
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    r = no_mlx("--iut", ORACLE, "--profile", "quick", "--no-port-profile", "-q", "--clauses", CLAUSES,
               "--seed", "0", "--report-md", str(md), "--report-json", str(js))
    assert r.returncode == 0, f"oracle run without MLX failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    report = json.loads(js.read_text(encoding="utf-8"))
    assert report["platform"]["mlx"] is None
    assert {c for c, v in report["clauses"].items() if v["status"] == "pass"} == set(CLAUSES.split(","))
    text = md.read_text(encoding="utf-8")
    assert "MLX not installed" in text and "a2ats_spec.oracle" in text, text[:1200]


def test_vectors_and_grade_run_without_mlx(no_mlx, tmp_path):
    vec, ans = tmp_path / "vectors", tmp_path / "answers"
    r = no_mlx("vectors", "--out", str(vec))
    assert r.returncode == 0, f"vectors without MLX failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
    r = no_mlx("grade", "--iut", ORACLE, str(vec), str(ans), "--report-json", str(tmp_path / "g.json"))
    assert r.returncode == 0, f"grade without MLX failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    graded = json.loads((tmp_path / "g.json").read_text(encoding="utf-8"))
    assert graded["platform"]["mlx"] is None


def test_default_iut_without_mlx_names_the_extra_and_how_to_name_another_iut(no_mlx):
    r = no_mlx("--profile", "quick")
    assert r.returncode == 2, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "[mlx]" in lines[0] and "--iut" in lines[0] and ORACLE in lines[0], lines[0]


def test_core_install_has_no_mlx_and_the_mlx_extra_carries_it():
    """A port's resolver sees the core dependencies only: MLX or mlx-lm there (mlx-lm pins a transformers range)
    would make the suite uninstallable beside a port's own framework."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()  # noqa: E731
    core = {name(r) for r in project["dependencies"]}
    assert core == {"numpy", "scipy", "hypothesis", "pytest", "pytest-xdist"}, core
    assert {name(r) for r in project["optional-dependencies"]["mlx"]} == {"mlx", "mlx-lm", "cmeel-openblas"}
    assert '".[mlx,test]"' in (root / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run must install the [mlx] extra"


def test_importing_the_suite_without_mlx_loads_no_global_blas(no_mlx):
    """The preload serves MLX only: without it, a process-wide OpenBLAS would only shadow the BLAS a port's
    framework links."""
    code = "import a2ats_conformance, a2ats_ref._blas as b; s = b.blas_status(); print(s['loaded'], s['error'])"
    r = subprocess.run([sys.executable, "-c", code], env=no_mlx.env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("None MLX is not installed"), r.stdout
    assert "OpenBLAS" not in r.stderr, r.stderr
