"""Known-deviations file of a port: one deviation per line,

    <clause-ID or test-id prefix>  # reason

e.g. ``EQ-17-FIT  # our k-means uses a different RNG`` or
``test_eq14_assign.py::test_assign_matches_oracle[float16]  # fp16 ties``.  Blank lines and lines
starting with ``#`` are ignored.  The reason is required.  A clause ID matches every test that
cites the clause; anything else is a prefix of the test id (``file.py::test_name[params]``, path
relative to the suite).  A line that matches nothing produces a warning (it is probably stale).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

__all__ = ["Deviation", "XfailWarning", "parse_xfails", "read_xfails", "matches", "short_nodeid", "unmatched"]

_CLAUSE_RE = re.compile(r"^[A-Z][A-Z0-9]*(-[A-Z0-9]+)+$")


class XfailWarning(UserWarning):
    """A line of the known-deviations file is malformed or matches no test."""


@dataclass(frozen=True)
class Deviation:
    pattern: str
    reason: str
    lineno: int

    @property
    def is_clause(self) -> bool:
        return bool(_CLAUSE_RE.match(self.pattern))


def parse_xfails(text: str, source: str = "<xfails>") -> list[Deviation]:
    """Parse the file's text; raises ValueError on a line without a reason."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition("#")
        pattern, reason = pattern.strip(), reason.strip()
        if not sep or not reason:
            raise ValueError(f"{source}:{n}: every deviation needs a reason: '<clause-or-test-id>  # reason', got {raw!r}")
        if not pattern or len(pattern.split()) != 1:
            raise ValueError(f"{source}:{n}: expected one clause ID or test-id prefix before '#', got {pattern!r}")
        out.append(Deviation(pattern, reason, n))
    return out


def read_xfails(path: str) -> list[Deviation]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--xfails {path!r}: cannot read the known-deviations file ({exc})") from exc
    return parse_xfails(text, path)


def short_nodeid(nodeid: str) -> str:
    """'any/path/test_x.py::test_y[p]' -> 'test_x.py::test_y[p]' (independent of where the suite lives)."""
    path, sep, rest = nodeid.partition("::")
    return path.rsplit("/", 1)[-1] + sep + rest


def matches(dev: Deviation, nodeid: str, clauses) -> bool:
    if dev.is_clause:
        return dev.pattern in clauses
    return short_nodeid(nodeid).startswith(dev.pattern) or nodeid.startswith(dev.pattern)


def unmatched(devs: list[Deviation], tests: dict[str, list[str]], *, warn: bool = True, source: str = "<xfails>") -> list[Deviation]:
    """Deviations that match none of ``tests`` ({nodeid: cited clauses}); warns for each."""
    stale = [d for d in devs if not any(matches(d, nid, cl) for nid, cl in tests.items())]
    if warn:
        for d in stale:
            warnings.warn(f"{source}:{d.lineno}: {d.pattern!r} matches no clause or test of the suite (stale line?)",
                          XfailWarning, stacklevel=2)
    return stale
