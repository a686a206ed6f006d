"""Throwaway adapters for tests/suite/test_conformance_honesty.py: each is the float64 oracle with one way of
misbehaving (declared capabilities, a missing cache member, a hang, an exit).  Not ports: do not reuse."""
