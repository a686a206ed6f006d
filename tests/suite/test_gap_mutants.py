"""Each gap mutant (a2ats_conformance.mutants.GAP_MUTANTS) is rejected on its clause, by the property written
for it, and where it embodies a known deviation the failure names it.

The gap mutants are bugs a port writer makes that pass a suite drawing only the easy cases, with every clause
run."""


import pytest

from a2ats_conformance.diagnosis.deviations import by_id
from a2ats_conformance.mutants import COVERAGE_MUTANTS, GAP_MUTANTS, MUTANTS


@pytest.mark.parametrize("name", sorted(GAP_MUTANTS))
def test_gap_mutant_is_rejected_on_its_clause(rejected_on_its_clause, name):
    cls = GAP_MUTANTS[name]
    verdict = rejected_on_its_clause(name, diagnose=bool(cls.expected_cause))
    cex = verdict["counterexample"]
    assert any(t.split("[")[0] == cls.gap for t in verdict["failed_tests"]), (cls.gap, verdict["failed_tests"])
    cause = cls.expected_cause
    if cause:
        assert cause in [c["id"] for c in cex.get("likely_causes") or []], (name, cex.get("likely_causes"))


def test_gap_mutants_are_their_own_set():
    assert len(GAP_MUTANTS) >= 1
    assert not set(GAP_MUTANTS) & (set(MUTANTS) | set(COVERAGE_MUTANTS))
    for cls in GAP_MUTANTS.values():
        assert cls.expected_clause and cls.bug and "::" in cls.gap, cls
        if cls.expected_cause:
            by_id(cls.expected_cause)
