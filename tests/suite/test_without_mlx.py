"""The suite, the oracle, ``vectors`` and ``grade`` install and run in a virtual environment that has no MLX and no
mlx-lm: a port written in another framework installs the core package beside its own dependencies, without the
``[mlx]`` extra.

The environment is real and built offline: a fresh ``venv`` into which the package is installed from a wheel
(``pip install --no-deps``, console scripts included), beside exactly the distributions its core requirements
resolve to, read from their metadata and linked from this environment. ``pip check`` then proves that those
requirements are met there, so a core dependency on MLX, or on anything only the ``[mlx]`` extra brings, fails
here rather than in a port author's resolver.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]
ORACLE = "a2ats_conformance.adapters.oracle:OracleAdapter"
#: a few clauses that reach the oracle's stateless and cache paths, the report writer and the run's metadata
CLAUSES = "ROPE-APPLY,EQ-10,CACHE-TRIM"
#: what the [mlx] extra brings; none of it may be importable in the core environment
MLX_ONLY = ("mlx", "mlx_lm", "transformers")


def _name(req: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")


def _closure(requirements: list[str]) -> list[metadata.Distribution]:
    """The installed distributions ``requirements`` resolve to, following each one's own requirements (markers
    evaluated here, extras not taken)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = _name(req.name)
        if key in seen:
            continue
        dist = metadata.distribution(req.name)
        seen[key] = dist
        todo.extend(Requirement(r) for r in dist.requires or ())
    return list(seen.values())


def _top_level(dist: metadata.Distribution) -> set[str]:
    """The entries the distribution put directly in site-packages (packages, modules, .libs, its dist-info)."""
    names = set()
    for f in dist.files or ():
        first = Path(f).parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            names.add(first)
    return names


def _pip(*args: str, cwd=None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                       capture_output=True, text=True, timeout=HANG_S, cwd=cwd)
    assert r.returncode == 0, f"pip {' '.join(args)} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _offline_build() -> tuple[str, ...]:
    """pip's flags to build the wheel with this environment's backend when it meets build-system.requires (no index
    needed), else nothing: pip then fetches the backend from the index, as the install of the package did."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]["requires"]
    for r in map(Requirement, requires):
        try:
            if metadata.version(r.name) not in r.specifier:
                return ()
        except metadata.PackageNotFoundError:
            return ()
    return ("--no-build-isolation", "--no-index")


@pytest.fixture(scope="module")
def core_env(tmp_path_factory):
    """(python, bin) of a fresh venv holding the package without extras and its core requirements only."""
    work = tmp_path_factory.mktemp("core-env")
    src = work / "src"                      # a copy, so that the build leaves nothing in the checkout
    src.mkdir()
    for entry in ("pyproject.toml", "README.md", "LICENSE", "a2ats_ref", "spec", "conformance"):
        p = ROOT / entry
        if p.is_dir():
            shutil.copytree(p, src / entry, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
        else:
            shutil.copy2(p, src / entry)
    _pip("wheel", "--no-deps", "-q", *_offline_build(), "-w", str(work / "wheel"), str(src))
    wheel = next((work / "wheel").glob("a2ats_ref-*.whl"))

    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=HANG_S)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for dist in _closure(project["dependencies"]):
        base = Path(dist.locate_file(""))
        for entry in _top_level(dist):
            target = base / entry
            if target.exists() and not (site / entry).exists():
                (site / entry).symlink_to(target, target_is_directory=target.is_dir())
    assert not any((site / m).exists() for m in MLX_ONLY), "a core requirement brought MLX into the core venv"
    _pip("--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))
    _pip("--python", str(python), "check")      # every installed distribution's requirements are met
    return python, venv / "bin"


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("A2ATS_IUT", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(cmd, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=_env(), capture_output=True, text=True, timeout=HANG_S,
                          cwd=cwd)


def test_the_core_venv_has_no_mlx_and_imports_the_suite_from_its_own_install(core_env, tmp_path):
    python, _ = core_env
    for mod in MLX_ONLY:
        r = _run([python, "-c", f"import {mod}"], tmp_path)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, (mod, r.stderr)
    r = _run([python, "-c", "import a2ats_conformance, a2ats_spec; print(a2ats_conformance.__file__)"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve().is_relative_to(python.parent.parent.resolve()), r.stdout


def test_oracle_suite_runs_without_mlx_and_the_report_says_mlx_is_absent(core_env, tmp_path):
    _, bin_ = core_env
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    r = _run([bin_ / "a2ats-conformance", "--iut", ORACLE, "--profile", "quick", "--no-port-profile", "-q",
              "--clauses", CLAUSES, "--seed", "0", "--report-md", md, "--report-json", js], tmp_path)
    assert r.returncode == 0, f"oracle run without MLX failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    report = json.loads(js.read_text(encoding="utf-8"))
    assert report["platform"]["mlx"] is None
    assert {c for c, v in report["clauses"].items() if v["status"] == "pass"} == set(CLAUSES.split(","))
    text = md.read_text(encoding="utf-8")
    assert "MLX not installed" in text and "a2ats_spec.oracle" in text, text[:1200]


def test_vectors_and_grade_run_without_mlx(core_env, tmp_path):
    _, bin_ = core_env
    vec, ans = tmp_path / "vectors", tmp_path / "answers"
    r = _run([bin_ / "a2ats-conformance", "vectors", "--out", vec], tmp_path)
    assert r.returncode == 0, f"vectors without MLX failed (exit {r.returncode}):\n{r.stderr[-3000:]}"
    r = _run([bin_ / "a2ats-conformance", "grade", "--iut", ORACLE, vec, ans, "--report-json", tmp_path / "g.json"],
             tmp_path)
    assert r.returncode == 0, f"grade without MLX failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    graded = json.loads((tmp_path / "g.json").read_text(encoding="utf-8"))
    assert graded["platform"]["mlx"] is None


def test_default_iut_without_mlx_names_the_extra_and_how_to_name_another_iut(core_env, tmp_path):
    _, bin_ = core_env
    r = _run([bin_ / "a2ats-conformance", "--profile", "quick"], tmp_path)
    assert r.returncode == 2, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "[mlx]" in lines[0] and "--iut" in lines[0] and ORACLE in lines[0], lines[0]


def test_core_install_has_no_mlx_and_the_mlx_extra_carries_it():
    """A port's resolver sees the core dependencies only: MLX or mlx-lm there (mlx-lm pins a transformers range)
    would make the suite uninstallable beside a port's own framework."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert core == {"numpy", "scipy", "hypothesis", "pytest", "pytest-xdist"}, core
    assert {_name(r) for r in project["optional-dependencies"]["mlx"]} == {"mlx", "mlx-lm", "cmeel-openblas"}
    assert '".[mlx,test]"' in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), ".ci/run must install the [mlx] extra"


def test_importing_the_suite_without_mlx_loads_no_global_blas(core_env, tmp_path):
    """The preload serves MLX only: without it, a process-wide OpenBLAS would only shadow the BLAS a port's
    framework links."""
    python, _ = core_env
    code = "import a2ats_conformance, a2ats_ref._blas as b; s = b.blas_status(); print(s['loaded'], s['error'])"
    r = _run([python, "-c", code], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("None MLX is not installed"), r.stdout
    assert "OpenBLAS" not in r.stderr, r.stderr
