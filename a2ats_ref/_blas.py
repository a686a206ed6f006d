"""Load a fast BLAS for MLX's Linux CPU backend before ``mlx.core`` is imported.

MLX's Linux CPU wheel links a reference BLAS (``mlx_cpu.libs/libblas-*.so``): a float32
matmul of 1024x576x1536 runs at about 5 GFLOP/s on the project's machines. If an OpenBLAS
is loaded into the process with ``RTLD_GLOBAL`` *before* ``mlx.core`` is first imported,
MLX's ``cblas_*`` calls bind to it instead (measured 100-190 GFLOP/s). Loaded afterwards it
has no effect, so ``a2ats_ref/__init__.py`` calls :func:`preload` as its first statement.

Sources, in order: Debian's ``libopenblas0-pthread`` (system), then the ``cmeel-openblas``
PyPI wheel (``site-packages/cmeel.prefix/lib/libopenblas.so.0``).
Opt out with the environment variable ``A2ATS_NO_FAST_BLAS=1``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import resource
import site
import sys
import sysconfig
import time
import warnings
from pathlib import Path

OPT_OUT_ENV = "A2ATS_NO_FAST_BLAS"

_SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

_state: dict = {
    "platform": sys.platform,
    "attempted": False,
    "opted_out": False,
    "loaded": None,  # path of the library we loaded
    "source": None,  # "system" | "cmeel-openblas"
    "mlx_imported_before": None,
    "effective": False,
    "error": None,
    "config": None,  # openblas_get_config() of the loaded library
}
_handle = None


def _site_dirs() -> list[Path]:
    dirs = []
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            dirs.append(Path(p))
    try:
        dirs.extend(Path(p) for p in site.getsitepackages())
    except AttributeError:  # some virtualenv builds lack it
        pass
    for p in sys.path:
        if p.endswith("site-packages"):
            dirs.append(Path(p))
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def candidate_libraries() -> list[tuple[str, Path]]:
    """Every OpenBLAS we would try, best first, as (source, path); existing files only."""
    found = [("system", Path(p)) for p in _SYSTEM_CANDIDATES if Path(p).is_file()]
    for d in _site_dirs():
        for name in ("libopenblas.so.0", "libopenblas.so"):
            p = d / "cmeel.prefix" / "lib" / name
            if p.is_file():
                found.append(("cmeel-openblas", p))
                break
    return found


_CORE_ISA = {  # OpenBLAS core names built without DYNAMIC_ARCH -> CPU flags their kernels need
    "SKYLAKEX": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "COOPERLAKE": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "SAPPHIRERAPIDS": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "HASWELL": ("avx2", "fma"),
    "ZEN": ("avx2", "fma"),
    "SANDYBRIDGE": ("avx",),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _memfd_copy(data: bytes, name: str) -> int:
    """An in-memory file (memfd) holding exactly ``data``; returns its descriptor. Raises OSError naming ``name``.

    dlopen maps the file: a copy cut short (a file-size limit, RLIMIT_FSIZE / ``ulimit -f``; a full tmpfs) would
    map pages past its end, and the first call into them kills the process with SIGBUS. So the limit is checked
    before writing (writing past it raises SIGXFSZ, which kills a process that does not ignore it), every write
    is checked, and the file's final size must equal len(data).
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and len(data) > soft:
        raise OSError(f"the file-size limit (RLIMIT_FSIZE, ulimit -f) of {soft} bytes is below the "
                      f"{len(data)} bytes of the in-memory copy of {name}")
    fd = os.memfd_create(name)
    try:
        view, done = memoryview(data), 0
        while done < len(data):
            n = os.write(fd, view[done:])
            if n <= 0:
                break
            done += n
        size = os.fstat(fd).st_size
        if done != len(data) or size != len(data):
            raise OSError(f"short write: {size} of {len(data)} bytes of the in-memory copy of {name} were stored")
    except OSError as exc:
        os.close(fd)
        raise OSError(f"could not copy {name} into memory: {exc}") from None
    return fd


def _gfortran_shim() -> None:
    """Make ``libgfortran.so.5`` resolvable when the system lacks it.

    ``cmeel-openblas`` needs ``libgfortran.so.5`` but no wheel ships one under that name: the
    copies inside ``mlx_cpu.libs``/``numpy.libs`` were renamed by auditwheel. The dynamic loader
    matches a NEEDED name against the SONAME of objects already loaded, so load an in-memory copy
    (memfd, nothing written to disk) whose SONAME reads ``libgfortran.so.5``.
    """
    try:
        ctypes.CDLL("libgfortran.so.5", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for d in _site_dirs():
        for libdir in sorted(d.glob("*.libs")):
            for g in sorted(libdir.glob("libgfortran-*.so.5*")):
                for qm in sorted(libdir.glob("libquadmath-*.so*")):
                    ctypes.CDLL(str(qm), mode=ctypes.RTLD_GLOBAL)  # satisfies the copy's own NEEDED
                data = g.read_bytes()
                old = g.name.encode() + b"\0"
                if old not in data or len(old) < len(b"libgfortran.so.5\0"):
                    continue
                new = b"libgfortran.so.5".ljust(len(old), b"\0")
                fd = _memfd_copy(data.replace(old, new), "libgfortran.so.5")
                ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_GLOBAL)
                return
    raise OSError("libgfortran.so.5 not found (apt-get install libgfortran5)")


def _load_checked(path: Path):
    """dlopen ``path`` privately, check its kernels can run on this CPU, then make it global."""
    try:
        probe = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        if "libgfortran" not in str(exc):
            raise
        _gfortran_shim()
        probe = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    try:
        probe.openblas_get_config.restype = ctypes.c_char_p
        config = probe.openblas_get_config().decode()
    except AttributeError:
        config = ""
    _state["config"] = config
    if "DYNAMIC_ARCH" not in config:
        words = config.split()
        flags = _cpu_flags()
        for core, needed in _CORE_ISA.items():
            if core in words and flags and not set(needed) <= flags:
                # Calling its kernels would kill the process with SIGILL.
                raise OSError(f"built for {core} only ({config!r}); this CPU lacks {sorted(set(needed) - flags)}")
    # dlopen of an already-loaded object with RTLD_GLOBAL promotes it to the global scope.
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def mlx_installed() -> bool:
    """Whether ``mlx`` can be imported, found without importing it (so the preload can still precede it)."""
    try:
        return importlib.util.find_spec("mlx") is not None
    except (ImportError, ValueError):
        return False


def preload() -> dict:
    """Load OpenBLAS globally (Linux only, once). Returns :func:`blas_status`.

    Never raises: a failure is recorded in the status (and warned about when it matters).
    """
    global _handle
    if _state["attempted"]:
        return blas_status()
    _state["attempted"] = True
    if not sys.platform.startswith("linux"):
        return blas_status()  # macOS uses Accelerate; nothing to do
    if os.environ.get(OPT_OUT_ENV, "").strip() not in ("", "0"):
        _state["opted_out"] = True
        return blas_status()
    if not mlx_installed():
        # The preload serves MLX only; without it, a global BLAS would only shadow the one a port's framework links.
        _state["error"] = "MLX is not installed; no BLAS was loaded (nothing here needs one)"
        return blas_status()
    _state["mlx_imported_before"] = "mlx.core" in sys.modules
    if _state["mlx_imported_before"]:
        # Too late: MLX already bound its BLAS. Loading now would only add a second BLAS to the process.
        _state["error"] = "mlx.core was imported before a2ats_ref; the fast BLAS was not loaded"
        warnings.warn(
            "a2ats_ref: mlx.core was imported before a2ats_ref, so the fast BLAS cannot take effect "
            "(MLX keeps its slow reference BLAS). Import a2ats_ref before mlx (or mlx_lm) to fix this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return blas_status()
    candidates = candidate_libraries()
    if not candidates:
        _state["error"] = (
            "no OpenBLAS found; install it with `pip install cmeel-openblas` (or apt-get install "
            "libopenblas0-pthread) for much faster MLX matmuls on Linux"
        )
        warnings.warn(f"a2ats_ref: {_state['error']}", RuntimeWarning, stacklevel=2)
        return blas_status()
    errors = []
    for source, path in candidates:
        try:
            _handle = _load_checked(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        _state["loaded"] = str(path)
        _state["source"] = source
        break
    if _state["loaded"] is None:
        _state["error"] = "; ".join(errors)
        warnings.warn(f"a2ats_ref: could not load OpenBLAS ({_state['error']}); MLX keeps its reference BLAS "
                      "(correct, but its matmuls are much slower)", RuntimeWarning, stacklevel=2)
        return blas_status()
    _state["effective"] = True
    return blas_status()


def _symbol_origin(symbol: str = "cblas_sgemm") -> str | None:
    """Path of the shared object that provides ``symbol`` in the process's global scope."""

    class _DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    try:
        proc = ctypes.CDLL(None)
        addr = ctypes.cast(getattr(proc, symbol), ctypes.c_void_p).value
        libdl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
        dladdr = libdl.dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        info = _DlInfo()
        if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError, ValueError):
        return None


_numpy_blas_fns: tuple | None | bool = None  # (set, get) of NumPy's own OpenBLAS; False: not found


def _find_numpy_blas():
    """set/get_num_threads of the OpenBLAS that NumPy's wheels bundle (its own library and thread pool, loaded
    privately, so not in the global scope): found among the process's mapped files. None where there is none
    apart from the one MLX uses (a NumPy linked to the system OpenBLAS) or it cannot be read."""
    global _numpy_blas_fns
    if _numpy_blas_fns is None:
        _numpy_blas_fns = False
        import numpy  # noqa: F401  # deferred: maps its BLAS, which must come after the preload
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6
                                and "openblas" in ln.rsplit("/", 1)[-1].lower()})
        except OSError:
            paths = []
        mlx_blas = os.path.realpath(_state["loaded"]) if _state["loaded"] else None
        for path in paths:
            if not os.path.isfile(path) or os.path.realpath(path) in (mlx_blas, _symbol_origin()):
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix in ("scipy_openblas", "openblas"):
                for suffix in ("64_", ""):
                    set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                    get_ = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                    if set_ is not None and get_ is not None:
                        _numpy_blas_fns = (set_, get_)
                        return _numpy_blas_fns
    return _numpy_blas_fns or None


@contextlib.contextmanager
def _threads(set_, get_, n: int):
    """set_(n) inside the block, get_()'s value restored after."""
    old = int(get_())
    set_(int(n))
    try:
        yield
    finally:
        set_(old)


def numpy_blas_threads(n: int):
    """Run NumPy's own BLAS on ``n`` threads inside the block (restored after): for code that calls NumPy's
    matmul from several Python threads at once, where each call spreading over every core oversubscribes
    them (measured: 2 threads x 2 BLAS threads on 2 cores, host attention 1.7x slower than with 1 each).
    A no-op where NumPy's BLAS cannot be found."""
    fns = _find_numpy_blas()
    return contextlib.nullcontext() if fns is None else _threads(*fns, n)


def mlx_blas_threads(n: int):
    """Run the OpenBLAS that MLX uses (the one preload loaded) on ``n`` threads inside the block, restored after.
    A no-op where none was loaded."""
    if _handle is None or not _state["effective"]:
        return contextlib.nullcontext()
    return _threads(_handle.openblas_set_num_threads, _handle.openblas_get_num_threads, n)


def blas_status() -> dict:
    """What was loaded, from where, and whether it can have taken effect.

    Keys: platform, attempted, opted_out, loaded (path or None), source, mlx_imported_before,
    effective (loaded globally before mlx.core), cblas_sgemm_from (the library the process's global
    scope resolves ``cblas_sgemm`` to, via dladdr), error.
    """
    status = dict(_state)
    status["cblas_sgemm_from"] = _symbol_origin() if sys.platform.startswith("linux") else None
    return status


def matmul_gflops(m: int = 1024, k: int = 576, n: int = 1536, *, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 matmul throughput of MLX on the CPU, in GFLOP/s."""
    import mlx.core as mx  # deferred: MLX loads only after the BLAS preload this module does

    a = mx.random.normal((m, k), key=mx.random.key(0))
    b = mx.random.normal((k, n), key=mx.random.key(1))
    mx.eval(a @ b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9


def gflops(flop: float, seconds: float) -> float | None:
    """Effective GFLOP/s to 3 significant figures (None without a time). Fixed decimals would round a
    tiny model's rate on a fast device to 0.0, which reads as "nothing ran"."""
    return float(f"{flop / seconds / 1e9:.3g}") if seconds > 0 else None


if __name__ == "__main__":  # python -m a2ats_ref._blas : print status and a throughput figure
    import json

    from a2ats_ref import _blas as _pkg_blas  # the package's copy holds the state

    _pkg_blas.preload()
    st = _pkg_blas.blas_status()
    st["matmul_gflops_1024x576x1536_f32"] = round(_pkg_blas.matmul_gflops(), 1)
    print(json.dumps(st, indent=2))
