"""The versions a conformance result depends on: package (suite), spec (SPEC.md), vectors and report formats.

``a2ats-conformance --version`` prints them; the JSON report records them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from a2ats_spec.clauses import SPEC_VERSION, spec_sha256

__all__ = ["REPORT_FORMAT", "suite_version", "versions", "version_text"]

REPORT_FORMAT = "a2ats-conformance-report/1"


def suite_version() -> str:
    """The installed a2ats-ref package's version (the suite ships in it); 'source' in a bare checkout."""

    try:
        return version("a2ats-ref")
    except PackageNotFoundError:
        return "source"


def versions() -> dict:
    from a2ats_conformance.vectors.manifest import FORMAT  # deferred: the vectors package imports hypothesis

    return {"package": suite_version(), "spec": SPEC_VERSION, "spec_sha256": spec_sha256(),
            "vectors_format": FORMAT, "report_format": REPORT_FORMAT}


def version_text() -> str:
    v = versions()
    return (f"a2ats-conformance {v['package']} (package a2ats-ref {v['package']})\n"
            f"spec {v['spec']} (SPEC.md sha256 {v['spec_sha256']})\n"
            f"vectors format {v['vectors_format']}\n"
            f"report format {v['report_format']}")
