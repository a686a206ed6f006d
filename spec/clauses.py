"""Clause registry parsed from SPEC.md, the only place where clause IDs are defined.

A clause is a level-3 heading ``### <ID> — <title>`` of SPEC.md (package data of ``a2ats_spec``).
``CLAUSES`` keeps the document order.  ``SPEC_VERSION`` is the document's semver ("Spec version: X.Y.Z"),
each clause's ``version`` the one its "**Version.** X.Y.Z, introduced|changed." line names (None when the
line is missing; a meta-test requires it), and ``spec_sha256()`` identifies the exact text a report was
checked against.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import unicodedata
from dataclasses import dataclass
from importlib import resources

__all__ = ["Clause", "CLAUSES", "SPEC_VERSION", "clause_ids", "get", "parse", "parse_version", "spec_sha256",
           "spec_text"]

_HEADING = re.compile(r"^### (?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*) \u2014 (?P<title>\S.*?)\s*$")
_ID_ONLY = re.compile(r"^### (?P<id>[A-Z][A-Z0-9]*(?:-[A-Z0-9]+)*)\b")
_SEMVER = r"(?P<v>(?:0|[1-9]\d*)\.(?:0|[1-9]\d*)\.(?:0|[1-9]\d*))"
_SPEC_VERSION = re.compile(r"\*\*Spec version: " + _SEMVER + r"\*\*")
_CLAUSE_VERSION = re.compile(r"^\*\*Version\.\*\* " + _SEMVER + r", (?P<how>introduced|changed)\b", re.M)


@dataclass(frozen=True)
class Clause:
    """One normative clause: its stable ID, heading title, GitHub-style anchor, 1-based line, and body text."""

    id: str
    title: str
    anchor: str
    line: int
    text: str
    version: str | None = None       # spec version the clause was introduced or last changed in
    version_change: str | None = None  # "introduced" | "changed"

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
        text_ = "\n".join(body).strip()
        v = _CLAUSE_VERSION.search(text_)
        clauses[cid] = Clause(cid, title, _anchor(f"{cid} \u2014 {title}"), n + 1, text_,
                              v["v"] if v else None, v["how"] if v else None)
    return clauses


def parse_version(text: str) -> str:
    """The document's "**Spec version: X.Y.Z**"; ValueError when it is missing or given twice."""
    found = _SPEC_VERSION.findall(text)
    if len(found) != 1:
        raise ValueError(f"SPEC.md must state its version exactly once as '**Spec version: X.Y.Z**' (semver); "
                         f"found {found or 'none'}")
    return found[0]


def spec_sha256() -> str:
    """SHA-256 (hex) of SPEC.md's bytes as shipped: which exact text a report was checked against."""
    return hashlib.sha256(resources.files("a2ats_spec").joinpath("SPEC.md").read_bytes()).hexdigest()


CLAUSES: dict[str, Clause] = parse(spec_text())
SPEC_VERSION: str = parse_version(spec_text())


def clause_ids() -> list[str]:
    """All clause IDs in document order."""
    return list(CLAUSES)


def get(clause_id: str) -> Clause:
    """The clause with this ID; KeyError naming close matches and where to define new clauses."""
    try:
        return CLAUSES[clause_id]
    except KeyError:
        pass
    close = difflib.get_close_matches(str(clause_id), CLAUSES, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise KeyError(f"unknown clause ID {clause_id!r}.{hint} Clause IDs are defined only as "
                   f"'### <ID> \u2014 <title>' headings in spec/SPEC.md; known: {', '.join(CLAUSES)}") from None
