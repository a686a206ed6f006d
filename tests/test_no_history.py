"""The product speaks of the product only: no development history in code, comments, tests or docs.

A line that says which commit, issue, session or audit a rule came from, or what the code "used to" do, stops being
true the day it is read and hides the reason the rule exists. The reason belongs in the text, stated as the hazard
the rule guards against; the history belongs in git and in SPEC.md's changelog.

The patterns (case-insensitive), checked in every tracked text file:

- ``session N`` and ``sessions N``: a development session;
- ``issue N``, ``issues N``, and ``#N`` cited in prose ("fixed in #42", "(#42)"): an issue number;
- ``audit``, ``audits``: a review round;
- ``commit`` followed by a hex id, and any bare 7 to 40 hex digit id with a letter and a digit (a commit hash);
- a date ``20YY-MM-DD``: a dated run anecdote;
- ``used to``, ``no longer``: what the code did before.

Exempt: SPEC.md's changelog (history by design), the results pages under spec/results (each names the date and
commit of the run that wrote it) and CITATION.cff's release date. ``ALLOWED`` lists the few literal strings that
match a pattern without being history, each with its reason.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PATTERNS = {
    "session number": r"\bsessions? [0-9]+",
    "issue number": r"\bissues? [0-9]+|(?:\b(?:in|see|fix|fixes|fixed|closes|closed|from|per|after|PR|pull)\s+|\()#[0-9]+\b",
    "audit": r"\baudits?\b",
    "commit id": r"\bcommit [0-9a-f]{7,40}\b|(?<![0-9A-Za-z_./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])",
    "dated anecdote": r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b",
    "used to": r"\bused to\b",
    "no longer": r"\bno longer\b",
}

#: literal text that matches a pattern but is not our history -> why it stays
ALLOWED = {
    "0123456789abcdef": "the hex digit alphabet, in a check that a fingerprint is hex",
    "71f10b0": "the revision of the authors' released code that SPEC and the code cite by file and line (provenance "
               "of an upstream fact, not a change of ours)",
}

#: files (or folders, ending in /) not scanned -> why
EXEMPT = {
    "spec/results/": "results pages name the date and commit of the run that wrote them",
    "CITATION.cff": "its release date is citation metadata",
    "tests/test_no_history.py": "states the patterns",
}

BINARY = (".npy", ".npz", ".safetensors", ".gguf", ".png", ".jpg", ".pdf", ".gz", ".zip")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [f for f in out.splitlines() if f]
    except (OSError, subprocess.CalledProcessError):   # a source tree without git: every file under the root
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts
                and ".git" not in p.parts and "egg-info" not in str(p)]


def scanned_text(rel: str, text: str) -> str:
    if rel == "spec/SPEC.md":   # the changelog keeps the history; the body must not
        text = re.split(r"^## Changelog", text, maxsplit=1, flags=re.M)[0]
    for literal in ALLOWED:
        text = text.replace(literal, "")
    return text


def offending_lines(rel: str, text: str) -> list[str]:
    found = []
    for n, line in enumerate(scanned_text(rel, text).splitlines(), 1):
        for name, pat in PATTERNS.items():
            m = re.search(pat, line, flags=re.I)
            if m:
                found.append(f"{rel}:{n}: {name} {m.group(0)!r}: {line.strip()[:160]}")
    return found


def test_no_development_history_in_tracked_files():
    bad = []
    for rel in tracked_files():
        if rel.endswith(BINARY) or any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in EXEMPT):
            continue
        path = ROOT / rel
        if not path.is_file():   # deleted in the work tree, not yet in git
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += offending_lines(rel, text)
    assert not bad, ("development history in the product; state the hazard the line guards against instead "
                     "(history belongs in git and SPEC.md's changelog):\n" + "\n".join(bad))


@pytest.mark.parametrize("line", [
    "# added in session 9", "see issue 13", "fixed in #42", "the port writer's bug (#17)", "the third audit's gap", "the suite at 3ce9183 passed",
    "commit 5c0fb1c", "run on 2026-11-30", "the cache used to copy itself", "it no longer spins",
])
def test_each_pattern_catches_history(line):
    assert offending_lines("x.py", line), line


@pytest.mark.parametrize("line", [
    "session.config.stash", "K = 4096 codewords", "sha256 = digest", "float16 and bfloat16", "the e2e rows",
    "github junhuihe-hjh/A2ATS at 71f10b0", 'the GGUF "key #0"', 'all(c in "0123456789abcdef" for c in fp)', "ratio 1.05e-3", "a2ats_ref/eq14_assign.py", "the position counter that codes",
    "## Changelog heading", "colour c0ffee",
])
def test_product_text_passes(line):
    assert not offending_lines("x.py", line), line


def test_spec_changelog_may_keep_history():
    text = "## Rules\nok\n## Changelog\n- 1.2.0: the third audit's cases (session 9, 3ce9183)\n"
    assert not offending_lines("spec/SPEC.md", text)
    assert offending_lines("other.md", text)
