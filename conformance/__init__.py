"""a2ats_conformance: the A2ATS conformance suite.

Run it with ``a2ats-conformance`` (cli.py). An implementation under test is wrapped in an
adapter (adapter.py, README-ADAPTER.md); properties live in test_*.py, each citing its spec
clauses with ``@pytest.mark.clause``; tolerances.py is the one tolerance table of the project;
mutants.py holds the mutant ports the suite must reject; vectors.py writes golden vectors.

The suite checks float32 arithmetic (SPEC, Conventions: Precision on GPUs), so importing it asks MLX for full
float32 matmuls (MLX_ENABLE_TF32=0) unless the variable is set: MLX reads it once, at the process's first
float32 GEMM, which the suite's own plugin import precedes. Its worker processes each get a JIT cache of their
own (a2ats_conformance.suite_env says why).
"""

from a2ats_conformance.suite_env import pin_suite_process

pin_suite_process()
