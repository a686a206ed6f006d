"""Benchmarks of fidelity and speed (``a2ats-bench``), device fact checks and the authors' checks."""
