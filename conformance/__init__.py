"""a2ats_conformance: the A2ATS conformance suite.

Run it with ``a2ats-conformance`` (``run/cli.py``). An implementation under test is wrapped in an adapter
(``harness/adapter.py``, README-ADAPTER.md); properties live in ``properties/test_*.py``, each citing its spec
clauses with ``@pytest.mark.clause``; ``harness/tolerances.py`` is the one tolerance table of the project;
``mutants/`` holds the mutant ports the suite must reject, by clause area; ``vectors/`` writes and grades golden
vectors; ``report/`` writes the reports; ``diagnosis/`` (known deviations, diagnosis, revealing examples, repro)
tells a port why it failed.

The suite checks float32 arithmetic (SPEC, Conventions: Precision on GPUs), so importing it asks MLX for full
float32 matmuls (MLX_ENABLE_TF32=0) unless the variable is set: MLX reads it once, at the process's first
float32 GEMM, which the suite's own plugin import precedes. Its worker processes each get a JIT cache of their
own (a2ats_conformance.harness.suite_env says why).
"""

from a2ats_conformance.harness.suite_env import pin_suite_process

pin_suite_process()

from a2ats_conformance import _moved  # noqa: E402

_moved.install()
