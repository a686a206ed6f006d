"""CACHE-DECODE and CACHE-SAVE from worker threads: a server decodes and saves on a thread pool.

MLX streams belong to the thread that made them; a stream (or a lazy array on one) kept by the package for every
thread fails in any other thread with 'There is no Stream(cpu, N) in current thread'. Every thread must get the
main thread's results, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref.files.cache import save_a2ats_cache
from a2ats_ref.runtime.hook import enable_a2ats
from test_cache_support import a2ats_caches, quiet_codebook, run, tiny_llama, tokens
from hang_guard import HANG_S

HERE = os.path.dirname(os.path.abspath(__file__))


def _job(model, codebook, toks, method, path):
    caches = a2ats_caches(model, codebook, w=4, sinks=2, topk=0.1)
    for c in caches:
        c.select_method = method
    logits = run(model, toks, caches, prefill=toks.shape[1] - 24)
    save_a2ats_cache(path, caches)
    return logits, {k: np.array(v) for k, v in mx.load(path).items()}


@pytest.mark.clause("CACHE-DECODE")
@pytest.mark.parametrize("method", ["host", "mlx", "sortfree"])
def test_decode_and_save_from_a_thread_pool_equal_the_main_thread(method, tmp_path):
    model = enable_a2ats(tiny_llama())
    codebook = quiet_codebook()
    toks = tokens(120, seed=3)
    want_logits, want_arrays = _job(model, codebook, toks, method, str(tmp_path / "main.safetensors"))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda i: _job(model, codebook, toks, method, str(tmp_path / f"t{i}.safetensors")),
                                range(6)))
    for i, (logits, arrays) in enumerate(results):
        for j, (got, want) in enumerate(zip(logits, want_logits)):
            assert np.array_equal(got, want), f"job {i}: call {j}'s logits differ from the main thread's"
        assert arrays.keys() == want_arrays.keys()
        for k in want_arrays:
            assert np.array_equal(arrays[k], want_arrays[k]), f"job {i}: saved {k} differs from the main thread's"


SCRIPT = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {here!r})
    import a2ats_ref
    from a2ats_ref.files.cache import save_a2ats_cache
    from a2ats_ref.runtime.hook import enable_a2ats
    from test_cache_support import a2ats_caches, quiet_codebook, run, tiny_llama, tokens

    finished = []

    def work():   # the main thread never touches MLX: every stream is the worker's
        model = enable_a2ats(tiny_llama())
        codebook = quiet_codebook()
        caches = a2ats_caches(model, codebook, w=4, sinks=2, topk=0.1)
        run(model, tokens(100, seed=5), caches, prefill=80)
        save_a2ats_cache({path!r}, caches)
        finished.append(True)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    print("done" if finished else "the worker raised")
""")

#: how many times the worker-only process runs: MLX's exit abort after worker-thread use is intermittent (measured:
#: 13 of 16 runs of plain MLX in a worker thread, 3 of 8 of this script without the package's release), so one
#: clean exit proves little
EXIT_RUNS = 5


@pytest.mark.clause("CACHE-DECODE")
def test_a_process_that_uses_a2ats_only_in_a_worker_thread_exits_cleanly(tmp_path):
    """MLX streams a worker thread leaves alive abort the process at exit (SIGABRT, 'terminate called without an
    active exception'), after its work succeeded: a server's exit status would read as a crash."""
    code = SCRIPT.format(here=HERE, path=str(tmp_path / "c.safetensors"))
    for run_ in range(EXIT_RUNS):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
        assert "done" in out.stdout, f"the worker's decode and save did not finish: exit {out.returncode}; " \
                                     f"stderr:\n{out.stderr[-3000:]}"
        assert out.returncode == 0, (f"run {run_ + 1}: exit {out.returncode} (negative: signal {-out.returncode}) "
                                     f"after the worker finished; stderr:\n{out.stderr[-3000:]}")

