"""Every unit test of a spec clause carries ``@pytest.mark.clause("ID")``, so one grep (or ``pytest -m clause``)
finds every test of a clause: ``grep -rn 'clause(.*"CACHE-TRIM"' tests``.

Each test file either carries clause markers that name known clauses, or is listed in CLAUSE_FREE with the reason
it checks no clause's rule (the harness, a CLI, file formats, the docs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from a2ats_spec.clauses import clause_ids

TESTS = Path(__file__).resolve().parent

#: test file (relative to tests/) -> why it carries no clause marker
CLAUSE_FREE = {
    "bench/test_bench.py": "the a2ats-bench CLI, its JSON schema and results pages: measurements, not rules",
    "bench/test_torch_peer.py": "a2ats-bench's PyTorch peer column and batched table: measurements, not rules",
    "runtime/test_blas_preload.py": "platform: which BLAS MLX binds to",
    "runtime/test_cli_help.py": "the commands' help texts and flag errors",
    "runtime/test_generate_cli.py": "the a2ats-generate command: flags, model sources, codebook refusals",
    "runtime/test_server.py": "a2ats-server on loopback: batching and prompt-cache reuse end to end (CACHE-BATCH's "
                              "rule is checked in runtime/test_batching.py)",
    "runtime/test_cache_support.py": "helpers shared by the cache tests",
    "runtime/test_cache_layout.py": "the cache's layout: a short class, one codebook type",
    "test_clause_markers.py": "this meta-test",
    "test_no_wall_clock.py": "a meta-test of the suite and the tests: no verdict races the clock",
    "runtime/test_codebook_file.py": "the codebook file format: checksums, pickle refusal, corrupt files",
    "suite/test_profile.py": "the port profile and its catalogue: which variant a port shows, not a clause's rule",
    "suite/test_conformance.py": "the conformance CLI run against the reference: every clause at once, judged by the suite",
    "suite/test_conformance_honesty.py": "the suite's harness: timeouts, crashes, interrupts, partial adapters",
    "suite/test_tolerance_flakes.py": "the suite's tolerance table against many seeds: a meta-test of the suite, "
                                      "whose properties carry the clauses",
    "suite/test_tripwire.py": "which runtime branches a conformance run executes: coverage of the suite, not a rule",
    "suite/test_conformance_cli_errors.py": "the CLI's refusals of bad flags and paths: usage, not a clause",
    "suite/test_vectors_hostile.py": "hostile vectors manifests and answers given to grade: file handling, not a clause",
    "suite/test_without_mlx.py": "the suite, vectors and grade without MLX installed: packaging, not a clause",
    "suite/test_conformance_meta.py": "the suite's own structure: every clause has a property, every property a clause",
    "suite/test_coverage_mutants.py": "the suite against mutant ports; each case's clause is data (expected_clause)",
    "suite/test_diagnosis.py": "the diagnosis of failures: which deviation a report names",
    "test_import_graph.py": "the package's import layering",
    "test_faults.py": "fault injection in files and CLIs: kills, bit flips, concurrent runs",
    "suite/test_gap_mutants.py": "the suite against mutant ports; each case's clause is data (expected_clause)",
    "calibration/test_gguf_hostile.py": "the GGUF reader against hostile files (a file format, not a clause)",
    "calibration/test_resume_state.py": "calibration's resume files: checksums, corruption, recomputation",
    "runtime/test_file_metadata.py": "codebook and cache file metadata, checked as untrusted input",
    "runtime/test_hostile_files.py": "hostile codebook and cache files, loaded in a child under a memory limit",
    "calibration/test_gguf_smollm2.py": "the GGUF reader and the real model's loading",
    "gpu/test_gpu_hazards.py": "MLX CUDA's crash hazards (empty arrays, rope offsets) on the paths a GPU runs",
    "runtime/test_hook.py": "mlx-lm wiring: which models enable_a2ats patches and refuses",
    "suite/test_mutants.py": "the suite against mutant ports; each case's clause is data (expected_clause)",
    "test_no_history.py": "the repository's text",
    "test_quickstart.py": "the README's quick start",
    "test_readme.py": "the README",
    "bench/test_results_pages.py": "the results-page writer and its plots",
    "suite/test_report.py": "the report writer and its schema",
    "oracle/test_spec_version.py": "SPEC.md's version, hash and changelog",
    "suite/test_vectors.py": "the golden-vector files and the grader, over every clause at once",
    "suite/ports/test_ports.py": "independent ports judged by the suite; each bug's clause is data",
}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py"))


def cited_clauses(path: Path) -> list[str]:
    """The IDs of every ``pytest.mark.clause(...)`` in the file (decorators and module-level pytestmark)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "clause"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "mark"):
            out += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: str(p.relative_to(TESTS)))
def test_each_file_marks_its_clauses_or_says_why_it_has_none(path):
    rel = str(path.relative_to(TESTS))
    cited = cited_clauses(path)
    if rel in CLAUSE_FREE:
        assert not cited, f"{rel} is listed as clause-free ({CLAUSE_FREE[rel]}) but cites {sorted(set(cited))}"
        return
    assert cited, (f"tests/{rel} carries no @pytest.mark.clause(...): mark each test that checks a clause, or list "
                   "the file in CLAUSE_FREE with the reason it checks none")
    unknown = sorted(set(cited) - set(clause_ids()))
    assert not unknown, f"tests/{rel} cites unknown clause IDs {unknown}; the IDs are in spec/SPEC.md"


def test_clause_free_list_names_existing_files():
    stale = sorted(rel for rel in CLAUSE_FREE if not (TESTS / rel).is_file())
    assert not stale, f"CLAUSE_FREE lists files that do not exist: {stale}"


def test_the_marker_reader_sees_both_forms(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text('import pytest\npytestmark = pytest.mark.clause("EQ-11")\n\n'
                 '@pytest.mark.clause("RET-TOPK", "EQ-14")\ndef test_a():\n    pass\n')
    assert sorted(cited_clauses(f)) == ["EQ-11", "EQ-14", "RET-TOPK"]
