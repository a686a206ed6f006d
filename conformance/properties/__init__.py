"""The conformance properties, one file per clause area; each test cites its clauses with
``@pytest.mark.clause``. pytest runs this folder (``run/cli.py``); ``conftest.py`` loads the suite's plugin."""
