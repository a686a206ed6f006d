"""Issue 9, item 7: each coverage property kills the mutant it was written for, on its clause.

The mutants (a2ats_conformance.mutants.COVERAGE_MUTANTS) are bugs the suite of commit 1cf8c61 never reached:
each passed all 28 of that suite's clauses at the ci profile, seeds 0 and 1, run from a worktree of 1cf8c61
(with its own install) on a copy of this mutants.py whose relative import is made absolute:
    PYTHONPATH=<copy dir> a2ats-conformance --iut cov_mutants:<Mutant> --profile ci -n 2 --seed <0|1>
Here the current suite must reject each one, and its diagnosis must name the mutant's own deviation.
"""


import pytest

from a2ats_conformance.deviations import by_id
from a2ats_conformance.mutants import COVERAGE_MUTANTS, MUTANTS

#: coverage mutant -> the known deviation (conformance/deviations.py) it embodies: its failing clause must name it
COVERAGE_CAUSES = {
    "Float16Lut": "float16-lut",
    "BatchRowsReadRowZero": "batch-rows-share-row-zero-selection",
    "PositionsLowPrecision": "positions-low-precision",
    "HostPathHeadZero": "gqa-one-head",
    "ChunkRerotated": "chunk-keys-rerotated",
}


@pytest.mark.parametrize("name", sorted(COVERAGE_MUTANTS))
def test_coverage_mutant_is_rejected_on_its_clause(rejected_on_its_clause, name):
    verdict = rejected_on_its_clause(name)
    causes = [c["id"] for c in verdict["counterexample"].get("likely_causes") or []]
    assert COVERAGE_CAUSES[name] in causes, (name, causes)    # diagnosis names the mutant's own bug


def test_coverage_mutants_are_their_own_set():
    """A separate dict: tests/suite/test_mutants.py keeps its own list; every coverage mutant names its item."""
    assert not set(COVERAGE_MUTANTS) & set(MUTANTS)
    assert sorted(COVERAGE_CAUSES) == sorted(COVERAGE_MUTANTS)
    for dev in COVERAGE_CAUSES.values():
        by_id(dev)
    items = {cls.coverage_item for cls in COVERAGE_MUTANTS.values()}
    assert items == {"near ties", "CACHE-BATCH", "positions", "host selection", "CACHE-CHUNK"}
