"""Loads the suite's pytest plugin (a2ats_conformance.run.plugin) when pytest runs this folder."""

from a2ats_conformance.run.plugin import (  # noqa: F401  (pytest finds hooks and fixtures by name)
    ctx,
    pytest_addoption,
    pytest_collection_finish,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_generate_tests,
    pytest_report_header,
    pytest_runtest_call,
    pytest_runtest_logstart,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
    pytest_unconfigure,
)
