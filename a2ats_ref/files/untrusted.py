"""INPUT-ERRORS for safetensors files from others (codebooks, caches, resume state): the header is checked here
before the file reaches ``mx.load``, whose reader trusts what the header says.

The hazards refused, each with a ValueError naming the path: a header length past the file or past
MAX_HEADER_BYTES (it sizes a read); JSON that is not an object of tensor entries, nests deeper than
``load_json`` allows, or repeats a key (two readers could pick different entries); an entry whose dtype MLX does
not read, whose shape is not a list of non-negative ints (MLX narrows each size to 32 bits, so a 2^32 + 8 would
load as 8), or whose byte size differs from its ``data_offsets`` span; spans that run past the data or overlap
(one stored array read as two); ``__metadata__`` that is not an object of strings.

``load_safetensors`` checks and loads through one open file, so the file checked is the file loaded: a path
swapped to another file between the check and the load (a rename over it, a symlink) is never read, and a file
changed in place while it is read (its size or modification time differ after the load) is refused.
"""

from __future__ import annotations

import math
import os
import stat

import mlx.core as mx

from a2ats_ref.files.atomic import load_json

__all__ = ["MAX_HEADER_BYTES", "DTYPE_BYTES", "check_safetensors", "load_safetensors"]

#: Longest header accepted: ours are a few kB (the checksums of every array included).
MAX_HEADER_BYTES = 100_000_000
#: Bytes per element of each safetensors dtype MLX reads.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4,
               "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def _is_size(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _open_regular(path, error):
    """A file object on ``path``, refused unread unless it is a regular file (O_NONBLOCK: a FIFO never blocks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"{path}: cannot be opened ({exc.strerror or exc})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise error(f"{path}: not a regular file; pass a .safetensors file")
    return f


def _read_header(f, path, error) -> tuple[bytes, int]:
    """(header bytes, bytes of data after them) of the open file ``f``, read from its start."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise error(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
    n = int.from_bytes(head, "little")
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise error(f"{path}: not a safetensors file (the header claims {n} bytes; the file has {size - 8} after "
                    f"the length, and at most {MAX_HEADER_BYTES} are read)")
    text = f.read(n)
    if len(text) != n:
        raise error(f"{path}: shorter than its header says (truncated while read)")
    return text, size - 8 - n


def check_safetensors(path, *, error=ValueError) -> dict:
    """The header entries of the safetensors file ``path`` ({name: {"dtype", "shape", "data_offsets"}}), or
    ``error`` naming the path and what is wrong (module docstring). Reads the header only."""
    with _open_regular(path, error) as f:
        return _check_open(f, path, error)


def load_safetensors(path, *, error=ValueError) -> tuple[dict, dict]:
    """(arrays, metadata) of the safetensors file ``path``, its header checked first (check_safetensors) and both
    read through the same open file; ``error`` naming the path if it is refused, unreadable, or changed while read.
    """
    with _open_regular(path, error) as f:
        before = os.fstat(f.fileno())
        header = _check_open(f, path, error)
        f.seek(0)
        try:
            arrays, meta = mx.load(f, format="safetensors", return_metadata=True)
            mx.eval(arrays)
        except Exception as exc:  # noqa: BLE001 - any reader failure means a corrupt or foreign file
            raise error(f"{path}: not a readable safetensors file ({exc})") from None
        after = os.fstat(f.fileno())
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise error(f"{path}: changed while it was read (size or modification time differ); read it again once "
                    f"its writer has finished")
    got = {k: list(v.shape) for k, v in arrays.items()}
    if got != {k: ent["shape"] for k, ent in header.items()}:   # what was loaded is what was checked
        raise error(f"{path}: the arrays read do not match the header checked (changed while read)")
    return arrays, dict(meta)


def _check_open(f, path, error) -> dict:
    raw, data_bytes = _read_header(f, path, error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: safetensors header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    header = load_json(text, f"{path}: safetensors header", error=error)
    if not isinstance(header, dict):
        raise error(f"{path}: safetensors header is a JSON {type(header).__name__}, expected an object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta   # MLX writes null for a file saved without metadata
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise error(f"{path}: safetensors __metadata__ is not a JSON object of strings (corrupt file)")
    spans = []
    for name, ent in header.items():
        where = f"{path}: tensor {name[:80]!r}"
        if not isinstance(ent, dict) or set(ent) != _ENTRY_KEYS:
            raise error(f"{where}: expected an object with exactly {sorted(_ENTRY_KEYS)} (corrupt file)")
        dtype, shape, offsets = ent["dtype"], ent["shape"], ent["data_offsets"]
        if dtype not in DTYPE_BYTES:
            raise error(f"{where}: dtype {str(dtype)[:40]!r} is not one of {sorted(DTYPE_BYTES)}")
        if not isinstance(shape, list) or not all(_is_size(s) and s < 2**31 for s in shape):
            raise error(f"{where}: shape {str(shape)[:80]} is not a list of sizes (ints from 0 to 2^31 - 1)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))
                and offsets[0] <= offsets[1] <= data_bytes):
            raise error(f"{where}: data_offsets {str(offsets)[:80]} are not [begin, end] within the "
                        f"{data_bytes} data bytes (truncated or corrupt file)")
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if want != offsets[1] - offsets[0]:
            raise error(f"{where}: shape {shape} of {dtype} is {want} bytes, its data_offsets span "
                        f"{offsets[1] - offsets[0]} (corrupt file)")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise error(f"{path}: tensors {a[:80]!r} and {b[:80]!r} share bytes (overlapping data_offsets; "
                        f"corrupt or crafted file)")
    return header
