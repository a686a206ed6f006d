"""The suite rejects every mutant port, on the clause its bug violates."""

import io
import sys

import pytest

from a2ats_conformance.mutants import MUTANTS
from a2ats_conformance.diagnosis.deviations import by_id
from a2ats_conformance.diagnosis.repro import load_counterexample, replay

def test_every_mutant_has_a_known_cause():
    """Each shipped mutant implements a catalogue record, whose known deviation its failure must name first."""
    for name, cls in MUTANTS.items():
        assert cls.record and cls.expected_cause, name
        by_id(cls.expected_cause)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_rejected_on_its_clause(rejected_on_its_clause, capsys, name):
    verdict = rejected_on_its_clause(name)     # rejected, and the failing assertion names the clause
    cex = verdict["counterexample"]
    # copy-paste: full interpreter path
    assert cex["repro"].startswith(f"{sys.executable} -m a2ats_conformance.diagnosis.repro ")
    meta, calls = load_counterexample(cex["npz"])              # reloads without pickle
    assert calls and meta["dtype"] == "float32" and meta["iut"].endswith(name)
    rows = replay(cex["npz"], meta["iut"], out=io.StringIO())   # the repro command's engine runs
    assert any(r["diffs"] for r in rows), rows                     # and shows where the port leaves the oracle
    assert [r["fn"] for r in rows] == [c[0] for c in calls]
    causes = cex.get("likely_causes")                          # diagnosis names the mutant's own bug first
    assert causes and causes[0]["id"] == MUTANTS[name].expected_cause, (name, causes)
    table = capsys.readouterr().out                            # the terminal table names it too
    assert f"[{MUTANTS[name].expected_cause}]" in table and "likely cause: " in table, table
