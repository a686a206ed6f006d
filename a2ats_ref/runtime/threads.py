"""CACHE-DECODE and CACHE-SAVE from worker threads: per-thread MLX state, released when its thread ends.

MLX keeps its streams per thread. A stream left alive when a worker thread has ended makes the process abort at
interpreter exit ('terminate called without an active exception', SIGABRT), after the work itself succeeded:
MLX's own exit-time cleanup runs too late, and it asks each thread to call ``mx.clear_streams()`` before it ends.
A server calls A2ATS from a pool of threads it never tells us about, so the package arranges that call itself:
``ThreadState`` is a ``threading.local`` whose first use in a thread other than the main one leaves a guard in
that thread's own storage, and CPython drops a thread's storage in that thread as it ends, which runs the guard.
"""

from __future__ import annotations

import threading

import mlx.core as mx


class _ClearStreamsAtExit:
    """Lives in one worker thread's storage; its finaliser runs as that thread ends, in that thread."""

    __slots__ = ()

    def __del__(self):
        try:
            mx.clear_streams()
        except Exception:   # the interpreter may be finalising; nothing to report to and nothing left to free
            pass


class _Guarded(threading.local):
    def __init__(self):   # runs once in each thread that touches it
        super().__init__()
        if threading.current_thread() is not threading.main_thread():
            self.guard = _ClearStreamsAtExit()


_GUARDED = _Guarded()


def mark_thread() -> None:
    """Register the calling thread as one that runs MLX work for A2ATS: a worker thread gets its MLX streams
    cleared as it ends. Cheap after the first call in a thread."""
    _GUARDED.__dict__


class ThreadState(threading.local):
    """Per-thread storage for MLX objects (streams, lazy tables): a stream or lazy array made in one thread fails
    in another ('There is no Stream(cpu, N) in current thread'). A thread that uses it is marked (mark_thread)."""

    def __init__(self):
        super().__init__()
        mark_thread()
