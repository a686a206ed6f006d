"""SPEC, Conventions: Precision on GPUs — the MLX settings a test or conformance process pins before MLX runs.

- ``MLX_ENABLE_TF32=0`` unless set: the suite checks float32 arithmetic, and MLX reads the variable once, at the
  process's first float32 GEMM.
- ``MLX_PTX_CACHE_DIR``: a directory of this process's own, unless the user set one. MLX CUDA's JIT keeps
  compiled kernels in one directory that every process shares (``/tmp/mlx/<version>/ptx``). It writes them with
  plain file streams and reads a cached file without a lock (mlx ``backend/cuda/jit_module.cpp``,
  ``write_cached_ptx``/``read_cached_ptx``), so a process can load a kernel that another one is still writing.
  With many pytest workers compiling at once, a worker's self-check then fails with "Failed to load compiled
  custom_kernel_a2ats_attend_… kernel: ." (an empty loader log); the exception, thrown in the middle of an
  evaluation, leaves MLX's command encoder broken, and the worker's next GPU call fails with "an illegal memory
  access". One directory per process removes the shared file.

A private directory alone would make every process compile every kernel again, which costs minutes of a GPU test
run, most of it in the tests that start conformance or bench subprocesses. So the
process that pins first (pytest's controller, the conformance CLI) also makes a *pool* that its children share
through the environment:

- a process publishes its compiled modules to the pool after each test and when it exits: times when none of
  its compiles is in flight, since MLX compiles in the thread that evaluates. Each
  file is copied under a temporary name and renamed into place, ``.txt`` before ``.ptx``: MLX reads a module only
  when its ``.ptx`` exists, so a module in the pool is always whole;
- a new process copies the pool into its private directory before MLX starts, and a test worker copies what is
  new after each test. MLX looks in its directory on every module it lacks in memory, so a kernel that one
  worker compiled is compiled by no other that starts a test later.

Child processes (pytest-xdist workers, the conformance CLI's workers) inherit the parent's environment, so the
directory and the pool are tagged with the pid that made them, and a process that is not that pid makes its own
directory.

On an NVIDIA GPU the pool outlives the run (``persistent_pool``: a folder per MLX version and GPU model under
the user's cache, ``$XDG_CACHE_HOME`` or ``~/.cache``): a module is machine code for one GPU, built by one MLX,
and nothing else in it changes between runs. The modules MLX builds for the suite on a GPU (gathers,
scatters and fused graphs of the portable decode step, about 60 of them) take each process about a minute to
compile, and a cold run's workers all compile them at once, each for itself, before any has finished a test to
publish them; with the pool kept, a later run on the machine compiles none of them. The kernels a port builds
with ``mx.fast.cuda_kernel`` are not among them: MLX writes no file for those, so every process compiles its own
(a2ats_ref keeps its decode kernels itself, as cubins: a2ats_ref.runtime.decode.precompiled). Elsewhere (no NVIDIA GPU, so
MLX builds no CUDA module) the pool is a temporary folder that its maker removes. A pool named in
``A2ATS_PTX_POOL`` by the user is used as it is and kept.

Sharing is finer than a test: the suite's plugin exchanges before every example, and the controller, which runs
no test, exchanges before the port profile (whose first call would otherwise compile every module again).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import re
import shutil
import tempfile
from pathlib import Path

#: names the pid whose private directory MLX_PTX_CACHE_DIR is (absent: the user chose the directory)
OWNER = "A2ATS_PTX_CACHE_OWNER"
#: the shared pool of whole compiled modules, and the pid that made it (and removes it)
POOL, POOL_OWNER = "A2ATS_PTX_POOL", "A2ATS_PTX_POOL_OWNER"


def _modules(root: Path) -> set[str]:
    """The relative paths of the modules in ``root`` that MLX would read: each ``.ptx`` (MLX may nest them). A walk
    of names only (no stat per file): the plugin asks before every example."""
    found = set()
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        found.update(f if rel == "." else os.path.join(rel, f) for f in files if f.endswith(".ptx"))
    return found


def _place(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` so that ``dst`` appears whole or not at all."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".part-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_modules(src: Path, dst: Path, names: set[str] | None = None) -> int:
    """Copy every whole module of ``src`` that ``dst`` lacks (``names``: those modules, when the caller listed
    both folders already), ``.txt`` first; return how many."""
    copied = 0
    for rel in sorted(_modules(src) - _modules(dst) if names is None else names):
        txt = (src / rel).with_suffix(".txt")
        try:
            if txt.exists():
                _place(txt, (dst / rel).with_suffix(".txt"))
            _place(src / rel, dst / rel)
        except OSError:
            continue   # a module another process is publishing too, or a full disk: MLX compiles it again
        copied += 1
    return copied


def _publish_and_remove(private: str, pool: str | None) -> None:
    if pool and os.path.isdir(pool):
        copy_modules(Path(private), Path(pool))
    shutil.rmtree(private, ignore_errors=True)


def exchange() -> None:
    """Publish this process's compiled modules to the pool and take the ones it lacks; call it between tests.

    Between tests no compile of this process is in flight, and pool files are whole by construction, so MLX,
    which looks in its directory on every miss, then finds what the other workers compiled.
    """
    if os.environ.get(OWNER) == str(os.getpid()) and os.path.isdir(os.environ.get(POOL, "")):
        mine, pool = Path(os.environ["MLX_PTX_CACHE_DIR"]), Path(os.environ[POOL])
        have, shared = _modules(mine), _modules(pool)
        copy_modules(mine, pool, have - shared)
        copy_modules(pool, mine, shared - have)


#: where the driver lists the NVIDIA GPUs of this machine, one folder per GPU with an ``information`` file
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def gpu_models(root: str | None = None) -> list[str]:
    """The models of this machine's NVIDIA GPUs, as the driver names them (read without loading CUDA or MLX);
    root: the driver's folder (default NVIDIA_GPUS)."""
    models = []
    for info in sorted(Path(root or NVIDIA_GPUS).glob("*/information")):
        try:
            text = info.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        models += [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model:")]
    return list(dict.fromkeys(models))


def persistent_pool(root: str | None = None) -> str | None:
    """The pool folder that outlives runs on this machine, made if missing: one per MLX version and GPU model;
    None where there is no NVIDIA GPU, no MLX, or no writable cache folder."""
    models = gpu_models(root)
    try:
        version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not models:
        return None
    tag = re.sub(r"[^A-Za-z0-9.]+", "-", "+".join(models)).strip("-")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "a2ats-ref", "mlx-jit", f"mlx-{version}-{tag}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path


def pin_suite_process() -> None:
    """Set this process's MLX variables for a test or conformance run (before MLX compiles or multiplies)."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")
    ours = OWNER in os.environ
    if "MLX_PTX_CACHE_DIR" in os.environ and not ours:
        return   # the user's choice
    if ours and os.environ[OWNER] == str(os.getpid()):
        return   # already made in this process
    if not os.path.isdir(os.environ.get(POOL, "")):
        kept = persistent_pool()
        if kept:
            os.environ[POOL] = kept
        else:
            pool = tempfile.mkdtemp(prefix=f"mlx-ptx-pool-{os.getpid()}-")
            atexit.register(shutil.rmtree, pool, ignore_errors=True)   # runs after this process publishes (LIFO)
            os.environ[POOL], os.environ[POOL_OWNER] = pool, str(os.getpid())
    pool = os.environ[POOL]
    path = tempfile.mkdtemp(prefix=f"mlx-ptx-{os.getpid()}-")
    copy_modules(Path(pool), Path(path))
    atexit.register(_publish_and_remove, path, pool)
    os.environ["MLX_PTX_CACHE_DIR"] = path
    os.environ[OWNER] = str(os.getpid())
