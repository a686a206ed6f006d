"""Hostile-input properties for every file format a2ats_ref reads (GGUF, codebook and cache safetensors): mutated
valid files load or give a ValueError naming the path; never a crash, a hang, a write into the folder or an
allocation past the child's memory limit (hostile_files.py runs them in a child process under RLIMIT_AS)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import HANG_S

TESTS = Path(__file__).parent

# Examples per format: enough to reach every kind of mutation, few enough for a few seconds each.
EXAMPLES = {"gguf": 30, "codebook": 60, "cache": 40}


@pytest.mark.parametrize("fmt", sorted(EXAMPLES))
def test_hostile_files_are_refused_by_name_without_a_crash(tmp_path, fmt):
    try:
        r = subprocess.run([sys.executable, str(TESTS / "hostile_files.py"), fmt, str(EXAMPLES[fmt]), str(tmp_path)],
                           capture_output=True, text=True, timeout=HANG_S, cwd=TESTS)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{fmt}: the hostile-file property hung (no result in 600 s)")
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0 and f"ok {fmt}" in r.stdout, (
        f"{fmt}: the child exited {r.returncode} (negative: killed by that signal, a crash in a reader)\n{tail}")
