"""The fast-BLAS preload: automatic on Linux, opt-out by environment variable, verified by dladdr."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hang_guard import HANG_S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the BLAS preload is Linux-only")

PROBE = (
    "import json, a2ats_ref, mlx.core, a2ats_ref._blas as b; "
    "print(json.dumps(b.blas_status()))"
)


def run(code, **env):
    e = {k: v for k, v in os.environ.items() if k != "A2ATS_NO_FAST_BLAS"}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_importing_the_package_loads_openblas():
    from a2ats_ref import _blas

    if not _blas.candidate_libraries():
        pytest.skip("no OpenBLAS on this machine (pip install cmeel-openblas, or apt-get install libopenblas0-pthread)")
    st, err = run(PROBE)
    if st["loaded"] is None and st["error"] and "lacks" in st["error"]:
        pytest.skip(f"the only OpenBLAS cannot run on this CPU: {st['error']}")
    assert st["attempted"], "a2ats_ref/__init__.py must call _blas.preload() first thing"
    assert st["effective"], st
    assert st["loaded"] and "openblas" in st["cblas_sgemm_from"].lower(), st


def test_opt_out():
    st, _ = run(PROBE, A2ATS_NO_FAST_BLAS="1")
    assert st["attempted"], "a2ats_ref/__init__.py must call _blas.preload() first thing"
    assert st["opted_out"] and st["loaded"] is None and not st["effective"], st


def test_status_reports_the_library_cblas_resolves_to():
    st, _ = run("import json, a2ats_ref._blas as b; b.preload(); import mlx.core; print(json.dumps(b.blas_status()))")
    if st["loaded"] is None:
        pytest.skip(f"no usable OpenBLAS here: {st['error']}")
    assert st["effective"] and "openblas" in (st["cblas_sgemm_from"] or "").lower(), st
    assert st["config"] and "OpenBLAS" in st["config"]


def test_too_late_warns_and_does_not_load():
    st, err = run("import json, mlx.core; import a2ats_ref._blas as b; b.preload(); print(json.dumps(b.blas_status()))")
    assert not st["effective"] and st["loaded"] is None, st
    assert "imported before a2ats_ref" in err


def test_numpy_blas_threads_sets_and_restores():
    # The host attention runs NumPy matmuls from several threads inside numpy_blas_threads(1).
    from a2ats_ref import _blas

    fns = _blas._find_numpy_blas()
    if fns is None:
        pytest.skip("NumPy's own OpenBLAS was not found in this process (a NumPy on the system BLAS?)")
    set_, get_ = fns
    before = int(get_())
    set_(2)
    try:
        with _blas.numpy_blas_threads(1):
            assert int(get_()) == 1
        assert int(get_()) == 2
    finally:
        set_(before)


def test_mlx_blas_threads_sets_and_restores():
    # a2ats-calibrate runs the Lloyd GEMMs inside mlx_blas_threads(cores - seeding workers).
    from a2ats_ref import _blas

    if _blas._handle is None or not _blas.blas_status()["effective"]:
        pytest.skip("no OpenBLAS loaded for MLX in this process")
    h = _blas._handle
    before = int(h.openblas_get_num_threads())
    h.openblas_set_num_threads(2)
    try:
        with _blas.mlx_blas_threads(1):
            assert int(h.openblas_get_num_threads()) == 1
        assert int(h.openblas_get_num_threads()) == 2
    finally:
        h.openblas_set_num_threads(before)


def test_recorded_rates_keep_three_significant_figures():
    # A tiny model's collection on the H200 ran at under 0.005 GFLOP/s; two fixed decimals wrote 0.0.
    from a2ats_ref._blas import gflops

    assert gflops(3.14159e6, 1.0) == 0.00314
    assert gflops(2.5e12, 2.0) == 1250.0
    assert gflops(1.0, 0.0) is None


# ---------------------------------------------------------------- a file-size limit (RLIMIT_FSIZE, ulimit -f)

def _limited(code: str, limit: int):
    """Run ``code`` in a fresh interpreter whose file-size limit is ``limit`` bytes (RLIMIT_FSIZE, as ulimit -f)."""
    import resource

    def lower():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    e = {k: v for k, v in os.environ.items() if k != "A2ATS_NO_FAST_BLAS"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=HANG_S,
                          preexec_fn=lower)


def test_import_under_a_file_size_limit_does_not_crash():
    """ulimit -f 500: an in-memory copy of a library larger than the limit (the libgfortran shim) is cut short,
    and mapping a truncated library kills the process with SIGBUS. The import must go on, on the reference BLAS
    if need be, with a warning that says why."""
    out = _limited(PROBE, 500 * 1024)
    assert out.returncode == 0, f"exit {out.returncode} (negative: killed by signal {-out.returncode}): {out.stderr}"
    st = json.loads(out.stdout.strip().splitlines()[-1])
    if not st["effective"]:
        assert st["error"] and "RLIMIT_FSIZE" in st["error"], st
        assert "reference BLAS" in out.stderr and "RLIMIT_FSIZE" in out.stderr, out.stderr


def test_memfd_copy_refuses_a_copy_beyond_the_file_size_limit():
    code = (
        "import os, a2ats_ref._blas as b\n"
        "fd = b._memfd_copy(b'ok' * 1000, 'small')\n"
        "assert os.pread(fd, 2000, 0) == b'ok' * 1000\n"
        "try:\n"
        "    b._memfd_copy(b'x' * 300_000, 'libbig.so')\n"
        "except OSError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('no error for a copy over the limit')\n"
    )
    out = _limited(code, 100_000)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr}"
    assert "RLIMIT_FSIZE" in out.stdout and "libbig.so" in out.stdout, out.stdout


def test_memfd_copy_detects_a_short_write(monkeypatch):
    """A write that stores fewer bytes than asked (a full tmpfs, a limit set by other means) is an error, never a
    truncated library handed to dlopen."""
    from a2ats_ref import _blas

    import errno

    real, room = os.write, [4000]

    def write(fd, data):   # stores up to 4000 bytes in all, then fails as a write past RLIMIT_FSIZE does
        if not room[0]:
            raise OSError(errno.EFBIG, "File too large")
        n = real(fd, bytes(data[: room[0]]))
        room[0] -= n
        return n

    monkeypatch.setattr(_blas.os, "write", write)
    with pytest.raises(OSError, match="libshort.so"):
        _blas._memfd_copy(b"y" * 10_000, "libshort.so")
    room[0] = 4000
    monkeypatch.setattr(_blas.os, "write", lambda fd, data: 0 if room[0] == 0 else write(fd, data))
    with pytest.raises(OSError, match="short write.*libshort.so"):
        _blas._memfd_copy(b"y" * 10_000, "libshort.so")
