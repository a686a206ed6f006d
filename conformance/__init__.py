"""a2ats_conformance: the A2ATS conformance suite.

Run it with ``a2ats-conformance`` (cli.py). An implementation under test is wrapped in an
adapter (adapter.py, README-ADAPTER.md); properties live in test_*.py, each citing its spec
clauses with ``@pytest.mark.clause``; tolerances.py is the one tolerance table of the project;
mutants.py holds the mutant ports the suite must reject; vectors.py writes golden vectors.
"""
