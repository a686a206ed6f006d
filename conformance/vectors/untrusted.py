"""Untrusted files (VECTORS.md, "Untrusted files"): vectors and answers are read as files from strangers.

A path names a regular file inside its folder (after symlinks are resolved), or it is refused before
anything is read or written; a non-regular file (a FIFO, a device) is never opened, so a read cannot block; a
file of the folder (a manifest, an expected array, an answer) is refused if it has more than one hard link, since
a link made in the folder can alias any file its maker could name, outside the folder too;
a JSON file is bounded in size before it is parsed and in nesting while it is; a ``.npy`` header is checked
against its file's length before an array is allocated, and never unpickled.
"""

from __future__ import annotations

import json
import math
import os
import stat

import numpy as np

__all__ = ["UntrustedFileError", "inside", "regular_file", "read_json", "read_npy", "MAX_JSON_BYTES",
           "safe_name", "check_npy_header"]

#: A manifest of ``--size full`` vectors is a few MB; anything past this is not vectors.
MAX_JSON_BYTES = 256 << 20
#: Bytes of a .npy header (NPY 2.0 allows 4 GiB; numpy's own reader refuses more than 10,000 by default).
MAX_NPY_HEADER = 10_000
#: A file name in an answers folder: no separator, not '.' or '..', printable, bounded.
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class UntrustedFileError(ValueError):
    """A file from someone else cannot be used: the message names the path and what is wrong with it."""


def safe_name(name, what: str) -> str:
    """``name`` if it is usable as one file name inside a folder (letters, digits, '.', '_', '-'; it starts with a
    letter or digit, so it is never '.', '..' or hidden); else UntrustedFileError naming ``what``."""
    if not isinstance(name, str) or not name or len(name) > 200 or not name[0].isalnum() \
            or not set(name) <= _NAME_CHARS:
        raise UntrustedFileError(f"{what} {name!r} is not a plain file name (letters, digits, '.', '_', '-', "
                                 f"starting with a letter or digit, at most 200 characters): a name with a path "
                                 f"separator would read or write outside its folder")
    return name


def inside(folder: str, rel, what: str) -> str:
    """The real path of ``folder/rel`` if ``rel`` is a relative path that stays inside ``folder`` after every
    symlink is resolved; else UntrustedFileError naming ``rel``."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise UntrustedFileError(f"{what} {rel!r} is not a relative file path")
    root = os.path.realpath(folder)
    if os.path.isabs(rel):
        raise UntrustedFileError(f"{what} {rel!r} is an absolute path, outside {folder}: paths in vectors are "
                                 f"relative to their folder")
    real = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([root, real]) != root or real == root:
        raise UntrustedFileError(f"{what} {rel!r} resolves to {real}, outside {folder}: paths in vectors stay "
                                 f"inside their folder")
    return real


def regular_file(path: str, what: str = "", *, follow: bool = False, own: bool = False) -> os.stat_result:
    """lstat (stat if ``follow``) of ``path`` if it is a regular file; else UntrustedFileError saying what it is.
    A FIFO or a device would block or never end a read; a symlink (``follow=False``) could point anywhere; with
    ``own``, a file of several hard links is refused too (one of them may be outside the folder)."""
    label = f"{what} {path}" if what else path
    try:
        s = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        raise UntrustedFileError(f"{label}: no such file") from None
    except OSError as exc:
        raise UntrustedFileError(f"{label}: cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISLNK(s.st_mode):
        raise UntrustedFileError(f"{label}: is a symbolic link; write it as a regular file (links are not "
                                 f"followed: one could point anywhere)")
    if not stat.S_ISREG(s.st_mode):
        kind = ("a directory" if stat.S_ISDIR(s.st_mode) else "a FIFO" if stat.S_ISFIFO(s.st_mode) else
                "a socket" if stat.S_ISSOCK(s.st_mode) else "a device")
        raise UntrustedFileError(f"{label}: not a regular file ({kind}); it is not opened")
    _one_link(s, label, own)
    return s


def _one_link(s: os.stat_result, label: str, own: bool) -> None:
    if own and s.st_nlink > 1:
        raise UntrustedFileError(f"{label}: has {s.st_nlink} hard links, so it may be a file from outside the folder; "
                                 f"write it as a file of its own (copy it, do not link it)")


def _open_regular(path: str, what: str, follow: bool, own: bool = False):
    """A file object on ``path``, checked regular before and after opening (no FIFO open blocks: O_NONBLOCK)."""
    regular_file(path, what, follow=follow, own=own)
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UntrustedFileError(f"{what} {path}: cannot be opened ({exc.strerror or exc})") from None
    f = os.fdopen(fd, "rb")
    s = os.fstat(fd)
    try:
        if not stat.S_ISREG(s.st_mode):   # replaced between the check and the open
            raise UntrustedFileError(f"{what} {path}: not a regular file; it is not read")
        _one_link(s, f"{what} {path}", own)
    except UntrustedFileError:
        f.close()
        raise
    return f


def read_json(path: str, what: str, *, follow: bool = False, own: bool = False, max_bytes: int | None = None):
    """Parse a JSON file of at most ``max_bytes`` (default MAX_JSON_BYTES), whose nesting Python's parser can
    hold; UntrustedFileError naming ``path`` otherwise."""
    limit = MAX_JSON_BYTES if max_bytes is None else max_bytes
    with _open_regular(path, what, follow, own) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise UntrustedFileError(f"{what} {path}: {size} bytes, more than the {limit} a JSON file here may have")
        data = f.read(size + 1)   # bounded by the checked size, not the limit (read(n) allocates n)
    if len(data) > limit:
        raise UntrustedFileError(f"{what} {path}: more than the {limit} bytes a JSON file here may have")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise UntrustedFileError(f"{what} {path}: nested deeper than the JSON parser can hold") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UntrustedFileError(f"{what} {path}: not valid JSON ({exc})") from None


def _npy_header(f, path: str, what: str):
    """(shape, fortran_order, dtype) of the open .npy file ``f``, positioned at its data; the header must account
    for exactly the bytes after it."""
    fmt = np.lib.format
    size = os.fstat(f.fileno()).st_size
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f, max_header_size=MAX_NPY_HEADER)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = fmt.read_array_header_2_0(f, max_header_size=MAX_NPY_HEADER)
        else:
            raise ValueError(f"NPY version {version} is not supported")
    except Exception as exc:  # noqa: BLE001 - a malformed header, whatever numpy raises for it
        raise UntrustedFileError(f"{what} {path}: cannot be read as a .npy file ({type(exc).__name__}: {exc}); "
                                 f"write it with numpy.save or any NPY 1.0/2.0 writer") from None
    if dtype.hasobject:
        raise UntrustedFileError(f"{what} {path}: not a plain .npy array (dtype {dtype} holds Python objects, "
                                 f"which would need pickle); write numeric or bool arrays, no pickled objects")
    if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
        raise UntrustedFileError(f"{what} {path}: expected a numeric or bool array, got dtype {dtype}")
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise UntrustedFileError(f"{what} {path}: header shape {shape} is not a tuple of sizes")
    want = math.prod(shape) * dtype.itemsize
    have = size - f.tell()
    if want != have:
        raise UntrustedFileError(f"{what} {path}: the header claims shape {shape} of {dtype} ({want} bytes), "
                                 f"the file holds {have} bytes after it (truncated or mislabelled)")
    return shape, fortran, dtype


def check_npy_header(path: str, what: str, *, follow: bool = False, own: bool = False) -> None:
    """UntrustedFileError unless ``path`` is a regular .npy file read_npy accepts (its data is not read)."""
    with _open_regular(path, what, follow, own) as f:
        _npy_header(f, path, what)


def read_npy(path: str, what: str, *, follow: bool = False, own: bool = False) -> np.ndarray:
    """A plain numeric or bool array from a .npy file; the header's shape and dtype must account for exactly the
    bytes that follow it, so no header sizes an allocation the file does not hold. Never unpickles."""
    with _open_regular(path, what, follow, own) as f:
        shape, fortran, dtype = _npy_header(f, path, what)
        n = math.prod(shape)
        data = f.read(n * dtype.itemsize)
    if len(data) != n * dtype.itemsize:   # shortened since the header was checked
        raise UntrustedFileError(f"{what} {path}: shorter than its header says (truncated while read)")
    a = np.frombuffer(data, dtype=dtype, count=n)
    a = a.reshape(shape[::-1]).transpose() if fortran else a.reshape(shape)
    return a.copy()
