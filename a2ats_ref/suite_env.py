"""SPEC, Conventions: Precision on GPUs — the MLX settings a test or conformance process pins before MLX runs.

- ``MLX_ENABLE_TF32=0`` unless set: the suite checks float32 arithmetic, and MLX reads the variable once, at the
  process's first float32 GEMM.
- ``MLX_PTX_CACHE_DIR``: a directory of this process's own, unless the user set one. MLX CUDA's JIT keeps
  compiled kernels in one directory that every process shares (``/tmp/mlx/<version>/ptx``). It writes them with
  plain file streams and reads a cached file without a lock (mlx ``backend/cuda/jit_module.cpp``,
  ``write_cached_ptx``/``read_cached_ptx``), so a process can load a kernel that another one is still writing.
  That happened in the H200 test run at 24c1996, where 15 pytest workers compiled at once. A worker's self-check
  failed with "Failed to load compiled custom_kernel_a2ats_attend_… kernel: ." (an empty loader log). The
  exception, thrown in the middle of an evaluation, left MLX's command encoder broken, and the worker's next GPU
  call failed with "an illegal memory access". One directory per process removes the shared file. Each process
  then compiles its own kernels.

Child processes (pytest-xdist workers, the conformance CLI's workers) inherit the parent's environment, so the
directory is tagged with the pid that made it, and a process that is not that pid makes its own.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

#: names the pid whose private directory MLX_PTX_CACHE_DIR is (absent: the user chose the directory)
OWNER = "A2ATS_PTX_CACHE_OWNER"


def pin_suite_process() -> None:
    """Set this process's MLX variables for a test or conformance run (before MLX compiles or multiplies)."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    ours = OWNER in os.environ
    if "MLX_PTX_CACHE_DIR" in os.environ and not ours:
        return   # the user's choice
    if ours and os.environ[OWNER] == str(os.getpid()):
        return   # already made in this process
    path = tempfile.mkdtemp(prefix=f"mlx-ptx-{os.getpid()}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["MLX_PTX_CACHE_DIR"] = path
    os.environ[OWNER] = str(os.getpid())
