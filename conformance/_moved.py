"""Module paths of the suite that moved into subpackages, kept importable for one minor release with a
DeprecationWarning: each old name is an alias of the new module object (a2ats_ref/_moved.py has the mechanism).
"""

from __future__ import annotations

from a2ats_ref._moved import alias_finder  # a2ats_ref's package init loads no MLX, and its BLAS preload needs MLX

#: old module path -> the module it now is (a2ats_ref/CHANGELOG.md records the move)
MOVED = {
    "a2ats_conformance.adapter": "a2ats_conformance.harness.adapter",
    "a2ats_conformance.capabilities": "a2ats_conformance.harness.capabilities",
    "a2ats_conformance.tolerances": "a2ats_conformance.harness.tolerances",
    "a2ats_conformance.hypothesis_helpers": "a2ats_conformance.harness.hypothesis_helpers",
    "a2ats_conformance.pytest_helpers": "a2ats_conformance.harness.pytest_helpers",
    "a2ats_conformance.messages": "a2ats_conformance.harness.messages",
    "a2ats_conformance.decode_checks": "a2ats_conformance.harness.decode_checks",
    "a2ats_conformance.suite_env": "a2ats_conformance.harness.suite_env",
    "a2ats_conformance.grade": "a2ats_conformance.vectors.grade",
    "a2ats_conformance.traces": "a2ats_conformance.vectors.traces",
    "a2ats_conformance.versions": "a2ats_conformance.report.versions",
    "a2ats_conformance.compat": "a2ats_conformance.report.compat",
    "a2ats_conformance.cli": "a2ats_conformance.run.cli",
    "a2ats_conformance.supervisor": "a2ats_conformance.run.supervisor",
    "a2ats_conformance.watchdog": "a2ats_conformance.run.watchdog",
    "a2ats_conformance.plugin": "a2ats_conformance.run.plugin",
    "a2ats_conformance.xfails": "a2ats_conformance.run.xfails",
    "a2ats_conformance.diagnose": "a2ats_conformance.diagnosis.diagnose",
    "a2ats_conformance.deviations": "a2ats_conformance.diagnosis.deviations",
    "a2ats_conformance.reveal": "a2ats_conformance.diagnosis.reveal",
    "a2ats_conformance.repro": "a2ats_conformance.diagnosis.repro",
}

install = alias_finder(MOVED)
