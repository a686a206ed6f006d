"""The README's quick-start code block (the fenced block after '## Quick start') runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_block(text: str) -> str | None:
    """The first ```python (or plain ```) block after the '## Quick start' heading, before the next '## '."""
    m = re.search(r"^## Quick start[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if not m:
        return None
    for block in re.finditer(r"^```([^\n]*)\n(.*?)^```[ \t]*$", m.group(1), flags=re.M | re.S):
        if block.group(1).strip() in ("python", "py", ""):
            return block.group(2)
    return None


def test_quickstart_block_runs(tmp_path, monkeypatch):
    code = quickstart_block(README.read_text(encoding="utf-8"))
    assert code is not None, "README.md must have a fenced python block under a '## Quick start' heading"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md:quick-start", "exec"), {"__name__": "__quickstart__"})


def test_block_extraction():
    text = "# x\n\n## Quick start\n\nInstall.\n\n```bash\npip x\n```\n\n```python\nprint(1)\n```\n## Next\n```python\nbad\n```\n"
    # A shell block first: fences pair up, and only python/plain blocks count.
    assert quickstart_block(text) == "print(1)\n"
    assert quickstart_block("## Other\n```python\nx\n```\n") is None
