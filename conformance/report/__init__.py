"""Reports of a run: the JSON report (``report.schema.json``) and JUnit XML (``writer``), the suite and
report versions (``versions``), and the compatibility table of the shipped implementations (``compat``)."""

from a2ats_conformance.report.writer import (  # noqa: F401  (the documented names, one import away)
    SCHEMA, junit_xml, metadata, platform_info, validate, validate_report, write_junit)
