"""a2ats_conformance: conformance suite."""
