"""SPEC.md is versioned: a semver spec version, one Version line per clause, a changelog that matches them."""

import re

import pytest

from a2ats_spec import clauses as C


def _semver(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _changelog() -> dict[str, str]:
    """version -> text of its changelog entry ('### X.Y.Z' headings under '## Changelog')."""
    text = C.spec_text()
    assert "\n## Changelog\n" in text, "SPEC.md needs a '## Changelog' section"
    log = text.split("\n## Changelog\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### (\d+\.\d+\.\d+)\s*$", log, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_spec_has_a_semver_version_and_a_hash():
    assert re.fullmatch(r"\d+\.\d+\.\d+", C.SPEC_VERSION)
    assert re.fullmatch(r"[0-9a-f]{64}", C.spec_sha256())


def test_every_clause_records_its_version():
    missing = [cid for cid, c in C.CLAUSES.items() if c.version is None]
    assert not missing, (f"clauses without a '**Version.** X.Y.Z, introduced|changed.' line after their heading: "
                         f"{missing}")
    newer = [(cid, c.version) for cid, c in C.CLAUSES.items() if _semver(c.version) > _semver(C.SPEC_VERSION)]
    assert not newer, f"clauses newer than the spec version {C.SPEC_VERSION}: {newer}"


def test_changelog_matches_the_clause_versions():
    log = _changelog()
    assert C.SPEC_VERSION in log, f"the changelog has no entry for the spec version {C.SPEC_VERSION}"
    assert list(log) == sorted(log, key=_semver, reverse=True), "changelog entries must run newest first"
    unlisted = [(cid, c.version) for cid, c in C.CLAUSES.items()
                if c.version in log and not re.search(rf"(?<![A-Z0-9-]){re.escape(cid)}(?![A-Z0-9-])", log[c.version])]
    unknown = [(cid, c.version) for cid, c in C.CLAUSES.items() if c.version not in log]
    assert not unknown, f"clause versions with no changelog entry: {unknown}"
    # 1.0.0 lists EQ-10 … EQ-18 as a range; every later entry names its clauses one by one.
    unlisted = [(cid, v) for cid, v in unlisted if not (v == "1.0.0" and cid.startswith("EQ-"))]
    assert not unlisted, f"clauses whose changelog entry does not name them: {unlisted}"


def test_parse_version_rejects_missing_or_repeated():
    with pytest.raises(ValueError, match="exactly once"):
        C.parse_version("no version here")
    with pytest.raises(ValueError, match="exactly once"):
        C.parse_version("**Spec version: 1.0.0** and **Spec version: 1.1.0**")


def test_a_clause_without_a_version_line_parses_as_none():
    got = C.parse("### X-ONE \u2014 a\n\n**Version.** 2.3.4, changed.\n\n### X-TWO \u2014 b\n\ntext\n")
    assert (got["X-ONE"].version, got["X-ONE"].version_change) == ("2.3.4", "changed")
    assert got["X-TWO"].version is None
