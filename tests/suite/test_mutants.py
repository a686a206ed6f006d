"""The suite rejects every mutant port, on the clause its bug violates."""

import io
import sys

import pytest

from a2ats_conformance.mutants import MUTANTS
from a2ats_conformance.diagnosis.deviations import by_id
from a2ats_conformance.diagnosis.repro import load_counterexample, replay

#: mutant -> the known deviation (conformance/diagnosis/deviations.py) it embodies: its failing clause must name it
MUTANT_CAUSES = {
    "DerotateScalarOffset": "derotate-scalar-position",
    "WindowOffByOne": "window-inclusive",
    "BTiedToW": "b-tied-to-w",
    "FarKeysRotated": "codes-from-post-rope-keys",
    "LTransposed": "l-transposed",
    "HNotPooled": "h-one-head",
    "CosineBlend": "cosine-blend",
    "TopkCeil": "topk-rounded-up",
    "UnionMissing": "gqa-one-head",
    "CompressionOnly": "quantized-keys-in-attention",
    "FarQueryInAttention": "far-query-in-attention",
    "TrimForgetsPositions": "trim-keeps-position-counter",
}


def test_every_mutant_has_a_known_cause():
    assert sorted(MUTANT_CAUSES) == sorted(MUTANTS)
    for dev in MUTANT_CAUSES.values():
        by_id(dev)


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
    assert causes and causes[0]["id"] == MUTANT_CAUSES[name], (name, causes)
    table = capsys.readouterr().out                            # the terminal table names it too
    assert f"[{MUTANT_CAUSES[name]}]" in table and "likely cause: " in table, table
