"""Runs the conformance suite on a port of tests/suite/ports in a fresh process, as a port author runs the CLI
(`PYTHONPATH=tests/suite/ports a2ats-conformance --iut port_x:Adapter ...`), and returns its JSON report."""

import json
import os
import subprocess
import sys

import pytest
from hang_guard import HANG_S

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)   # the test modules import the port classes by module name


@pytest.fixture
def run_suite(tmp_path):
    """run_suite(iut, *args) -> (exit code, report dict)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]))

    def run(iut, *args):
        out = tmp_path / f"{iut.replace(':', '.')}.json"
        cmd = [sys.executable, "-c", "import sys; from a2ats_conformance.run.cli import main; sys.exit(main())",
               "--iut", iut, "-q", "--report-json", str(out), "--counterexample-dir", str(tmp_path / "cex"), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert out.exists(), f"no report from {' '.join(cmd[3:])}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        print(proc.stdout[-3000:])
        return proc.returncode, json.loads(out.read_text())
    return run
