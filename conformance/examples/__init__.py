"""Example ports of A2ATS for the conformance suite: ``numpy_port`` is an independent NumPy implementation."""
