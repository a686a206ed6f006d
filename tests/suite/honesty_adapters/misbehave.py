"""Adapters that hang or exit (tests/suite/test_conformance_honesty.py).  Each is the oracle's topk_count and
rope_inv_freqs, one of which misbehaves; the suite runs RET-TOPK (test_retrieval.py) before ROPE-FREQ
(test_rope.py), so a run that continues after the first shows ROPE-FREQ pass."""

import os
import signal
import sys
import time

from a2ats_spec import oracle


class _Base:
    name, version, dtypes = "misbehaving", "0", ("float64",)
    rope_inv_freqs = staticmethod(oracle.rope_inv_freqs)
    topk_count = staticmethod(oracle.topk_count)


class Hang(_Base):
    """topk_count never returns (a Python-level hang: the alarm interrupts it)."""

    @staticmethod
    def topk_count(*a, **k):
        while True:
            time.sleep(3600)


class NativeHang(_Base):
    """topk_count hangs where no Python signal handler runs (as in a native call): SIGALRM is blocked."""

    @staticmethod
    def topk_count(*a, **k):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            time.sleep(3600)


class ExitInCall(_Base):
    """topk_count ends the process with status 0."""

    @staticmethod
    def topk_count(*a, **k):
        os._exit(0)


class SysExitInCall(_Base):
    @staticmethod
    def topk_count(*a, **k):
        sys.exit(0)


class Slow(_Base):
    """rope_inv_freqs takes a second per call and touches $A2ATS_TEST_MARKER first (for the Ctrl-C test)."""

    @staticmethod
    def rope_inv_freqs(*a, **k):
        open(os.environ["A2ATS_TEST_MARKER"], "a").close()
        time.sleep(1.0)
        return oracle.rope_inv_freqs(*a, **k)


class Stubborn(_Base):
    """rope_inv_freqs ignores SIGINT and never returns (a native call that does not check for signals), after
    touching $A2ATS_TEST_MARKER: on Ctrl-C the supervisor must kill the suite's process."""

    @staticmethod
    def rope_inv_freqs(*a, **k):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        open(os.environ["A2ATS_TEST_MARKER"], "a").close()
        while True:
            time.sleep(3600)
