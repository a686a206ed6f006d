"""CACHE-SAVE, codebook files — crash-safe writes and per-array checksums, shared by every file we write.

Atomic: the bytes go to a fresh temporary file in the destination's folder, are fsynced, and only
then renamed over the destination (and the folder fsynced), so a crash, a kill or a full disk at
any moment leaves either the old file or the new one under the final name, never a torn one.

Checksums: SHA-256 of every stored array (dtype, shape, raw bytes) in the file's string metadata
under ``checksums``; loaders verify them, so a flipped bit in an array is refused by name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

CHECKSUMS_KEY = "checksums"


def array_sha256(a: mx.array) -> str:
    """SHA-256 of an array's dtype, shape and C-order bytes (any MLX dtype, bfloat16 included)."""
    h = hashlib.sha256(f"{a.dtype}{tuple(a.shape)}".encode())
    h.update(bytes(memoryview(mx.contiguous(a))))
    return h.hexdigest()


def ndarray_sha256(a) -> str:
    """SHA-256 of a NumPy array's dtype, shape and C-order bytes (the resume state of a2ats-calibrate)."""
    a = np.ascontiguousarray(a)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def text_sha256(text: str) -> str:
    """SHA-256 (hex) of a string's UTF-8 bytes: covers metadata that array checksums do not reach."""
    return hashlib.sha256(text.encode()).hexdigest()


def checksums(arrays: dict) -> str:
    """The ``checksums`` metadata value for a dict of named arrays (JSON, sorted)."""
    return json.dumps({k: array_sha256(a) for k, a in arrays.items()}, sort_keys=True)


#: deepest JSON nesting a metadata value may have (ours nest 4 deep); deeper is refused before parsing, since
#: Python's JSON parser recurses once per level and a crafted 10^5-deep value raises RecursionError
MAX_JSON_DEPTH = 16
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs):
    """A JSON object whose keys are all distinct: with a repeated key, which value counts depends on the reader."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        raise ValueError(f"key {next(k for k, _ in pairs if k in seen or seen.add(k))!r} appears twice")
    return obj


def load_json(text, what: str, *, error=ValueError, max_depth: int = MAX_JSON_DEPTH):
    """Strict JSON for untrusted metadata: a string, nested at most ``max_depth`` deep, without NaN or Infinity
    (which Python's parser accepts by default) or a key repeated in an object. Raises ``error`` naming ``what``."""
    if not isinstance(text, str):
        raise error(f"{what} is missing or not a string (corrupt file)")
    depth = deepest = 0
    for c in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > max_depth:
            raise error(f"{what} is nested deeper than {max_depth} levels (corrupt or crafted file)")
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        raise error(f"{what} is not valid JSON ({exc}) (corrupt file)") from None


def verify_checksums(path, arrays: dict, metadata: dict, error=ValueError) -> None:
    """Raise ``error`` naming the first array whose bytes do not match the stored checksum.

    Files from before checksums were written load with a warning (nothing to verify against).
    """
    raw = metadata.get(CHECKSUMS_KEY)
    if raw is None:
        warnings.warn(f"{path}: no array checksums (written by an older a2ats-ref); bit flips cannot be "
                      "detected. Save it again to add them.", UserWarning, stacklevel=3)
        return
    want = load_json(raw, f"{path}: metadata 'checksums'", error=error)
    if not isinstance(want, dict) or not all(isinstance(v, str) for v in want.values()):
        raise error(f"{path}: metadata 'checksums' is not a JSON object of SHA-256 strings (corrupt file)")
    if set(want) != set(arrays):
        missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
        raise error(f"{path}: arrays {missing or extra} do not match the file's checksum list (corrupt file)")
    for name in sorted(arrays):
        if array_sha256(arrays[name]) != want[name]:
            raise error(f"{path}: array {name!r} fails its SHA-256 checksum (corrupt file: restore it from a "
                        "backup or write it again)")


def check_writable(path, what: str = "path") -> Path:
    """Fail before any work when ``path`` cannot be written: a folder, a missing or read-only parent."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what}: {path} is a folder; give a file name (a new file inside it, for example)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{what}: {parent} is not an existing folder; create it first or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: folder {parent} is not writable; choose a folder you can write to")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what}: {path} exists and is read-only; choose another path or make it writable")
    return path


def atomic_save_safetensors(path, arrays: dict, metadata: dict) -> Path:
    """mx.save_safetensors(path, arrays, metadata) with the atomic write described in the module docstring."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.safetensors", dir=path.parent)
    os.close(fd)
    try:
        try:
            mx.save_safetensors(tmp, arrays, metadata)
        except (RuntimeError, ValueError) as exc:  # a full disk or a file-size limit: MLX's message names no path
            raise OSError(errno.EIO, f"cannot write {path}: {exc} (is the disk full?); the previous file, if any, "
                                     "is intact", str(path)) from None
        os.chmod(tmp, _file_mode(path))  # mkstemp's 0600 would otherwise replace the usual permissions
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _file_mode(path: Path) -> int:
    """The replaced file's permissions, else what open() would give a new file under the umask."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds: the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
