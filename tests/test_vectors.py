"""Golden vectors: written from the oracle, deterministic, and the reference passes them."""

import json

from a2ats_conformance.adapter import load_adapter
from a2ats_conformance.vectors import check_vectors, load_vectors, main, write_vectors


def test_vectors_roundtrip_and_reference_passes(tmp_path):
    assert main(["--out", str(tmp_path / "v")]) == 0
    manifest, _ = load_vectors(str(tmp_path / "v"))
    clauses = {c["clause"] for c in manifest["cases"]}
    from a2ats_spec.clauses import clause_ids

    assert clauses == {c for c in clause_ids() if not c.startswith("CACHE-")}
    assert all(c.get("note") is not None and c["tolerance"]["float32"] for c in manifest["cases"])
    assert check_vectors(str(tmp_path / "v"), load_adapter()) == []
    assert check_vectors(str(tmp_path / "v"), load_adapter("a2ats_conformance.adapters.oracle:OracleAdapter"), "float64") == []


def test_vectors_are_deterministic(tmp_path):
    write_vectors(str(tmp_path / "a"), seed=3)
    write_vectors(str(tmp_path / "b"), seed=3)
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == json.loads((tmp_path / "b" / "manifest.json").read_text())


def test_vectors_catch_a_mutant(tmp_path):
    write_vectors(str(tmp_path))
    problems = check_vectors(str(tmp_path), load_adapter("a2ats_conformance.mutants:CompressionOnly"))
    assert [cid for cid, _ in problems] == ["RET-DECODE.decode_step.000"]
