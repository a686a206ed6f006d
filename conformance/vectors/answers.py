"""Answers to golden vectors (VECTORS.md, "Answers"): ``write_answers`` runs an adapter on every case of a
manifest and writes one ``.npy`` per output into the answers folder (VECTORS.md, "Untrusted files"): every name
is checked to stay inside the folder, and no link, folder or FIFO sits under one, before anything is written;
answers an earlier run left under those names are removed first, so none is graded as this run's; each file
is written whole or not at all (a temporary file in the folder, renamed over the name).
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

from a2ats_conformance.harness import capabilities
from a2ats_conformance.harness.adapter import has_function
from a2ats_conformance.harness.pytest_helpers import to_numpy
from a2ats_conformance.vectors.manifest import GRADED_DTYPES, answer_names, load_vectors
from a2ats_conformance.vectors.traces import run_trace
from a2ats_conformance.vectors.untrusted import UntrustedFileError, inside, regular_file, safe_name


def _make_folder(path: str, what: str) -> None:
    """Create ``path`` (and its parents); UntrustedFileError naming it when that fails (read-only, a file)."""
    if not path:
        raise UntrustedFileError(f"{what}: the path is empty; name a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UntrustedFileError(f"{what} {path!r}: cannot be created ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UntrustedFileError(f"{what} {path!r}: not writable")


def _save_answer(path: str, value) -> None:
    if isinstance(value, np.dtype) or isinstance(value, type):
        value = np.zeros((), np.dtype(value))
    a = np.asarray(value)
    if a.dtype.kind == "f" and a.dtype.itemsize < 4:
        a = a.astype(np.float32)  # .npy has no bfloat16; float16 answers are widened losslessly
    with _writing(path) as f:
        np.save(f, a, allow_pickle=False)


class _writing:
    """A file written whole or not at all: the bytes go to a fresh temporary file beside ``path`` (created
    exclusively, so no link left in the folder is followed) and are renamed over ``path`` once all are written
    (a link there is replaced, never written through); on failure the temporary file is removed and ``path`` is
    untouched. OSError becomes UntrustedFileError naming ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        folder, name = os.path.split(self.path)
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=folder or ".")
        except OSError as exc:
            raise UntrustedFileError(f"{self.path}: cannot be written ({exc.strerror or exc})") from None
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)   # mkstemp's 0600 would hide the answers from other users
        self.f = os.fdopen(fd, "wb")
        return self.f

    def __exit__(self, kind, exc, tb):
        try:
            self.f.close()
            if exc is None:
                os.replace(self.tmp, self.path)
        except OSError as e:
            exc = exc or e
        if exc is not None:
            try:
                os.remove(self.tmp)
            except OSError:
                pass
        if isinstance(exc, OSError) and not isinstance(exc, UntrustedFileError):
            raise UntrustedFileError(f"{self.path}: cannot be written ({exc.strerror or exc})") from None
        return False


def _claim_names(answers_dir: str, names: set[str]) -> None:
    """Check that every answer name is a plain name inside ``answers_dir`` and that none is there as anything but
    a regular file (a link could carry a later write elsewhere, a FIFO block it); then remove the regular files
    under those names, an earlier run's answers, so that only this run's are graded. Nothing is removed unless
    every name passes."""
    stale = []
    for name in sorted(names):
        path = os.path.join(answers_dir, safe_name(name, "answer name"))
        if os.path.lexists(path):
            regular_file(path, "answers folder holds")
            stale.append(path)
        inside(answers_dir, name, "answer name")
    for path in stale:
        try:
            os.remove(path)
        except OSError as exc:
            raise UntrustedFileError(f"{path}: an earlier answer cannot be removed ({exc.strerror or exc})") from None


def write_answers(vectors_dir: str, adapter, answers_dir: str, dtype: str | None = None) -> str:
    """Run ``adapter`` on every case and write its answers in the layout of VECTORS.md; -> answers_dir.

    Errors a call raises are written as ``<case>.error`` (ValueError) and otherwise left out, so the grader
    sees them as wrong answers, not as crashes of this writer.
    """

    manifest, dec = load_vectors(vectors_dir)
    dtype = dtype or adapter.dtypes[0]
    if dtype not in GRADED_DTYPES:
        raise ValueError(f"dtype: golden vectors are graded in {GRADED_DTYPES}, got {dtype!r}")
    try:
        adapter.input_dtype = dtype
    except AttributeError:
        pass

    caps = capabilities.read(adapter)
    owned = answer_names(manifest)
    _make_folder(answers_dir, "answers folder")
    _claim_names(answers_dir, owned)
    with _writing(os.path.join(answers_dir, "answers.json")) as f:
        f.write(json.dumps({"name": adapter.name, "version": adapter.version, "dtype": dtype,
                            "capabilities": caps.as_dict()}, indent=1).encode())
    np_dtype = np.float64 if dtype == "float64" else np.float32
    cast = lambda x: x.astype(np_dtype) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x  # noqa: E731
    for case in manifest["calls"]:
        if not has_function(adapter, case["function"]) or capabilities.unmet(caps, case.get("requires", {})):
            continue
        fn = getattr(adapter, case["function"])
        args = [cast(dec(a)) for a in case["args"]]
        kwargs = {k: cast(dec(v)) for k, v in case["kwargs"].items()}
        try:
            got = to_numpy(fn(*args, **kwargs))
        except ValueError as exc:
            with _writing(os.path.join(answers_dir, f"{case['id']}.error")) as f:
                f.write(f"ValueError: {exc}\n".encode("utf-8", "replace"))
            continue
        except Exception:  # noqa: BLE001 - a crash is a missing answer; the grader says which
            continue
        outs = list(got) if isinstance(got, tuple) else [got]
        for ent, o in zip(case["outputs"], outs):
            _save_answer(os.path.join(answers_dir, f"{case['id']}.{ent['name']}.npy"), o)
    if has_function(adapter, "make_cache"):
        for trace in manifest["traces"]:
            if capabilities.unmet(caps, trace["requires"]):
                continue
            for name, value in run_trace(trace, dec, adapter.make_cache, cast):
                if f"{trace['id']}.{name}.npy" in owned:   # only names checked above are written
                    _save_answer(os.path.join(answers_dir, f"{trace['id']}.{name}.npy"), value)
    return answers_dir
