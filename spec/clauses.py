"""Clause registry parsed from SPEC.md, the only place where clause IDs are defined.

A clause is a level-3 heading ``### <ID> — <title>`` of SPEC.md (package data of ``a2ats_spec``).
``CLAUSES`` keeps the document order.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from importlib import resources

__all__ = ["Clause", "CLAUSES", "clause_ids", "get", "parse", "spec_text"]

_HEADING = re.compile(r"^### (?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*) \u2014 (?P<title>\S.*?)\s*$")
_ID_ONLY = re.compile(r"^### (?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*)\b")


@dataclass(frozen=True)
class Clause:
    """One normative clause: its stable ID, heading title, GitHub-style anchor, 1-based line, and body text."""

    id: str
    title: str
    anchor: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.id} \u2014 {self.title}"


def _anchor(heading: str) -> str:
    """GitHub's heading slug: lowercase, drop punctuation other than '-' and '_', spaces -> '-'."""
    out = []
    for ch in heading.strip().lower():
        if ch == " ":
            out.append("-")
        elif ch in "-_" or unicodedata.category(ch)[0] in "LN":
            out.append(ch)
    return "".join(out)


def spec_text() -> str:
    """The text of SPEC.md as shipped with the package."""
    return resources.files("a2ats_spec").joinpath("SPEC.md").read_text(encoding="utf-8")


def parse(text: str) -> dict[str, Clause]:
    """Parse clause headings from SPEC.md text; ValueError on a malformed or duplicated clause heading."""
    lines = text.splitlines()
    heads: list[tuple[int, str, str]] = []
    for n, line in enumerate(lines):
        m = _HEADING.match(line)
        if m:
            heads.append((n, m["id"], m["title"]))
        elif _ID_ONLY.match(line):
            raise ValueError(f"SPEC.md line {n + 1}: clause heading must read '### <ID> \u2014 <title>', got {line!r}")
    clauses: dict[str, Clause] = {}
    for k, (n, cid, title) in enumerate(heads):
        if cid in clauses:
            raise ValueError(f"SPEC.md line {n + 1}: clause {cid} is defined twice (first at line {clauses[cid].line})")
        end = heads[k + 1][0] if k + 1 < len(heads) else len(lines)
        body = lines[n + 1:end]
        for j, line in enumerate(body):  # a clause's body stops at the next heading of any level <= 3
            if re.match(r"^#{1,3} ", line):
                body = body[:j]
                break
        clauses[cid] = Clause(cid, title, _anchor(f"{cid} \u2014 {title}"), n + 1, "\n".join(body).strip())
    return clauses


CLAUSES: dict[str, Clause] = parse(spec_text())


def clause_ids() -> list[str]:
    """All clause IDs in document order."""
    return list(CLAUSES)


def get(clause_id: str) -> Clause:
    """The clause with this ID; KeyError naming close matches and where to define new clauses."""
    try:
        return CLAUSES[clause_id]
    except KeyError:
        pass
    import difflib
    close = difflib.get_close_matches(str(clause_id), CLAUSES, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise KeyError(f"unknown clause ID {clause_id!r}.{hint} Clause IDs are defined only as "
                   f"'### <ID> \u2014 <title>' headings in spec/SPEC.md; known: {', '.join(CLAUSES)}") from None
