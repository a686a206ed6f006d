"""Per-example time limit of the conformance suite (README-ADAPTER.md, "Honest runs").

A call that does not return within the limit fails its test as ``timeout``: a Python-level hang is
interrupted by SIGALRM in the test's process (``ExampleTimeout``, a BaseException so that Hypothesis
neither catches nor shrinks it); a hang in native code, where no Python signal handler can run, is ended
by faulthandler's watchdog thread, which writes the stack to ``dump_path`` and exits the process a few
seconds later.  The supervising ``a2ats-conformance`` process reads that file, records the test as a
timeout and carries on with the remaining tests.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import signal
import threading

__all__ = ["ExampleTimeout", "time_limit", "dump_path", "DEFAULT_EXAMPLE_TIMEOUT_S", "NATIVE_GRACE_S"]

#: Default --example-timeout: far above any example of the suite, far below "hung".  The heaviest example
#: (a 35,000-token cache decode, test_host_selection_path) took 16 s in the pure NumPy port on this project's
#: 2-core machine at load average 19, and a 60 s limit timed out once in a ci run of that port there.
DEFAULT_EXAMPLE_TIMEOUT_S = 300.0

#: Seconds after the Python-level limit before a native hang kills the process.
NATIVE_GRACE_S = 5.0


class ExampleTimeout(BaseException):
    """One example ran past --example-timeout."""


def dump_path(run_dir: str | None, nodeid: str) -> str | None:
    """Where a native hang of test ``nodeid`` leaves its stack (the supervisor looks there)."""

    if not run_dir:
        return None
    return os.path.join(run_dir, "timeout-" + hashlib.sha1(nodeid.encode()).hexdigest()[:16] + ".txt")


def _raise_timeout(signum, frame):
    raise ExampleTimeout("the example ran past --example-timeout (a call into the IUT did not return)")


@contextlib.contextmanager
def time_limit(seconds: float | None, dump_path: str | None = None):
    """Limit the enclosed block to ``seconds`` (None or <= 0: no limit)."""
    if not seconds or seconds <= 0:
        yield
        return
    use_alarm = threading.current_thread() is threading.main_thread()
    dump = open(dump_path, "w", encoding="utf-8") if dump_path else None  # noqa: SIM115 - closed below
    old = None
    try:
        if dump is not None:
            faulthandler.dump_traceback_later(seconds + NATIVE_GRACE_S, exit=True, file=dump)
        if use_alarm:
            old = signal.signal(signal.SIGALRM, _raise_timeout)
            signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)
        if dump is not None:
            faulthandler.cancel_dump_traceback_later()
            dump.close()
