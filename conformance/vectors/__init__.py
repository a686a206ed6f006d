"""Golden vectors: export (``a2ats-conformance vectors``), traces of cache calls, and grading a port's answers
(``a2ats-conformance grade``). VECTORS.md has the format."""

from a2ats_conformance.vectors.export import (  # noqa: F401  (the documented names, one import away)
    FORMAT, SIZES, check_vectors, generate, load_vectors, main, write_answers, write_vectors)
