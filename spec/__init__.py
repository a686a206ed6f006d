"""a2ats_spec: normative clauses and float64 oracle."""
