"""Each coverage property kills the mutant it was written for, on its clause.

The mutants (the catalogue's coverage group, a2ats_conformance.mutants.COVERAGE_MUTANTS) are bugs in paths a suite can leave unreached (float16
LUTs, batch rows, long positions, the host path's heads, chunked prefill). The suite must reject each one, and its
diagnosis must name the mutant's own deviation.
"""


import pytest

from a2ats_conformance.diagnosis.deviations import by_id
from a2ats_conformance.mutants import COVERAGE_MUTANTS, MUTANTS

@pytest.mark.parametrize("name", sorted(COVERAGE_MUTANTS))
def test_coverage_mutant_is_rejected_on_its_clause(rejected_on_its_clause, name):
    verdict = rejected_on_its_clause(name)
    cls = COVERAGE_MUTANTS[name]
    if cls.gap:    # the coverage property written for its path rejects it
        assert any(t.split("[")[0] == cls.gap for t in verdict["failed_tests"]), (cls.gap, verdict["failed_tests"])
    causes = verdict["counterexample"].get("likely_causes") or []
    likely = [c["id"] for c in causes if c.get("likely")]
    assert cls.expected_cause in likely, (name, causes)    # diagnosis names the mutant's own bug as a likely cause


def test_coverage_mutants_are_their_own_set():
    """A group of its own; every coverage mutant names its item and the known deviation its failure must name."""
    assert not set(COVERAGE_MUTANTS) & set(MUTANTS)
    for cls in COVERAGE_MUTANTS.values():
        by_id(cls.expected_cause)
    items = {cls.coverage_item for cls in COVERAGE_MUTANTS.values()}
    assert items == {"near ties", "CACHE-BATCH", "positions", "host selection", "CACHE-CHUNK"}
