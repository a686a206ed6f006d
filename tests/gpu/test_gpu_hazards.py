"""The paths a GPU runs, driven on the CPU with MLX CUDA's known hazards made loud.

MLX CUDA 0.32 crashes the process (SIGFPE, segfault) when an empty array reaches some kernels, and fails to launch
`mx.fast.rope` with some offset-array lengths (251); a GPU run is rare and costly here, so the decode step and the
cache are driven on the CPU under a guard: `mx` as the package modules see it claims a non-CPU default device (so
every GPU branch is taken: the sort-free step, in-place argmin blocks, fixed-order k-means sums) and records every
zero-size array handed to an `mx` operation and every multi-position rope offset array. Found on the H200, each
once: an empty forced-token piece in a selection mask, an empty reduction for a one-code codebook, an empty slot
list when nothing is retrieved, the cache's code assignment reading 251 positions' angles through one offset
array.
"""

from __future__ import annotations

import functools
import sys
import types

from a2ats_ref.runtime.hook import enable_a2ats  # first: a2ats_ref preloads the BLAS before mlx loads
from a2ats_ref.runtime.decode import dispatch

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_cache_support import a2ats_caches, tiny_llama, tokens  # noqa: E402

#: array constructors may make empty arrays (an empty cache's positions is mx.zeros((0,)), fine on MLX CUDA);
#: handing one to an operation is what crashes
_CONSTRUCTORS = {"array", "zeros", "ones", "full", "arange", "zeros_like", "ones_like", "eval", "async_eval",
                 "default_stream", "new_stream", "stream", "compile", "depends", "synchronize", "clear_cache"}


class _SimulatedGPU:
    type = "simulated-gpu"

    def __str__(self) -> str:
        return "Device(simulated-gpu)"


class _Guard:
    """`mx` for the package's modules: a non-CPU default device, and a record of empty arrays entering an op."""

    def __init__(self, real, found: list, path: str = "mx"):
        self._real, self._found, self._path = real, found, path

    def __getattr__(self, name):
        obj = getattr(self._real, name)
        if name == "default_device":
            return lambda: _SimulatedGPU()
        if name == "default_stream":
            return lambda dev=None: self._real.default_stream(self._real.cpu)
        if isinstance(obj, types.ModuleType):
            return _Guard(obj, self._found, f"{self._path}.{name}")
        if not callable(obj) or isinstance(obj, (type, mx.Dtype)) or name in _CONSTRUCTORS:
            return obj

        @functools.wraps(obj)
        def checked(*args, **kwargs):
            off = kwargs.get("offset")
            if f"{self._path}.{name}" == "mx.fast.rope" and isinstance(off, mx.array) and off.size > 1:
                where = sys._getframe(1)   # a run of positions is one scalar-offset call, as mlx-lm makes it
                self._found.append(f"mx.fast.rope(offset array of {off.size}) at "
                                   f"{where.f_code.co_filename.split('/')[-1]}:{where.f_lineno}")
            for v in list(args) + list(kwargs.values()):
                for a in v if isinstance(v, (list, tuple)) else (v,):
                    if isinstance(a, mx.array) and a.size == 0:
                        where = sys._getframe(1)
                        self._found.append(f"{self._path}.{name}(shape {tuple(a.shape)}) at "
                                           f"{where.f_code.co_filename.split('/')[-1]}:{where.f_lineno}")
            return obj(*args, **kwargs)

        return checked


@pytest.fixture
def gpu_paths(monkeypatch):
    """Install the guard in every a2ats_ref module that imported mlx.core as `mx`; yields the list of findings.
    Compiled graphs cached before are dropped, so each is traced (and checked) again."""
    import a2ats_ref.runtime.decode.portable as fd

    found: list = []
    guard = _Guard(mx, found)
    for name, mod in list(sys.modules.items()):
        if name.startswith("a2ats_ref") and getattr(mod, "mx", None) is mx:
            monkeypatch.setattr(mod, "mx", guard)
    caches = [f for f in vars(fd).values() if hasattr(f, "cache_clear")]
    for f in caches:
        f.cache_clear()
    fd._LANES.__dict__.clear()
    yield found
    for f in caches:
        f.cache_clear()
    fd._LANES.__dict__.clear()


def test_the_guard_sees_an_empty_array_enter_an_op(gpu_paths):
    import a2ats_ref.runtime.decode.portable as fd

    fd.mx.concatenate([fd.mx.zeros((2, 0)), fd.mx.ones((2, 3))], axis=1)
    assert gpu_paths and "mx.concatenate(shape (2, 0))" in gpu_paths[0]
    assert fd.mx.default_device().type != mx.cpu


def _decode_cases():
    for T in (1, 2, 5, 40, 300):
        for w, sinks in ((0, 0), (4, 0), (0, 2), (4, 2)):
            for K in (1, 2, 64):
                for topk in (0.1, 1, 1.0):
                    yield T, w, sinks, K, topk


def test_decode_step_never_hands_an_empty_array_to_an_op(gpu_paths):
    from a2ats_ref.runtime.decode import portable as fd

    rng = np.random.default_rng(0)
    n_q, n_kv, d = 4, 2, 16
    inv = mx.array((1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    seen = 0
    for T, w, sinks, K, topk in _decode_cases():
        q = mx.array(rng.standard_normal((1, n_q, 1, d)).astype(np.float32))
        kv = mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32))
        codes = mx.array(rng.integers(0, K, (1, n_kv, T)).astype(np.uint16))
        CT = fd.prepare_codebook(mx.array(rng.standard_normal((n_kv, K, d)).astype(np.float32)))
        for counts in (None, (fd.code_counts(codes, K), T)):
            out, mask = dispatch.decode_step_fast(q, kv, kv, codes, CT, query_pos=T - 1, b=64, w=w, sinks=sinks, topk=topk,
                                            inv_freqs=inv, traditional=False, code_counts=counts, return_mask=True)
            mx.eval(out, mask)
            seen += 1
    assert seen == 2 * 5 * 4 * 3 * 3
    assert not gpu_paths, "empty arrays reached MLX operations on the GPU paths:\n" + "\n".join(sorted(set(gpu_paths)))


def test_cache_never_hands_an_empty_array_to_an_op(gpu_paths):
    model = tiny_llama()
    enable_a2ats(model)
    for cfg in (dict(w=8, sinks=2, topk=4), dict(w=0, sinks=0, topk=0.5)):
        cache = a2ats_caches(model, **cfg)
        toks = tokens(270, seed=9)
        mx.eval(model(toks[:, :250], cache=cache))
        for t in range(250, 262):                       # past a buffer growth
            mx.eval(model(toks[:, t : t + 1], cache=cache))
        for c in cache:
            mx.eval(c.codes_view(), c.positions)
            c.trim(c.offset)                            # empty again
            mx.eval(c.positions)
        mx.eval(model(toks[:, :3], cache=cache))        # refill from empty
        mx.eval(model(toks[:, 3:4], cache=cache))
        state = [c.state for c in cache]
        for c, s in zip(cache, state):
            c.state = s
        mx.eval(model(toks[:, 4:5], cache=cache))
    assert not gpu_paths, "empty arrays reached MLX operations on the GPU paths:\n" + "\n".join(sorted(set(gpu_paths)))
