"""Hostile-file properties, run in a child process (``python hostile_files.py FORMAT EXAMPLES FOLDER``) under a
memory limit, so that a crash, a runaway allocation or a hang in a reader shows as the child's death, not the
test runner's. Each property mutates a valid file (flipped bytes, truncation, huge counts, lengths or dimensions,
metadata of the wrong type) and requires the loader to load it or raise a ValueError naming the path; nothing may
be written in or outside the folder."""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from pathlib import Path

MEMORY_LIMIT = 6 << 30    # address space of the child: far below what the crafted counts would allocate


def _listing(folder: Path) -> set:
    return {p.name for p in folder.iterdir()}


def _settings(n):
    from hypothesis import HealthCheck, settings

    return settings(max_examples=n, deadline=None, database=None, derandomize=True, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _mutations(st, raw: bytes, header_end: int):
    """A strategy of byte strings: mutations of ``raw``, most in its first ``header_end`` bytes."""
    huge = st.sampled_from([2**64 - 1, 2**63, 2**62, 2**40, 2**32 - 1, 2**31, 10**6, 200, 0])
    at_header = st.integers(0, max(0, header_end - 1))
    at_any = st.integers(0, len(raw) - 1)

    def flip(pos_bit):
        b = bytearray(raw)
        for pos, bit in pos_bit:
            b[pos] ^= 1 << bit
        return bytes(b)

    def put(args):
        pos, v, width = args
        b = bytearray(raw)
        b[pos:pos + width] = struct.pack("<Q" if width == 8 else "<I", v % (1 << (8 * width)))[:len(b[pos:pos + width])]
        return bytes(b)

    return st.one_of(
        st.lists(st.tuples(st.one_of(at_header, at_any), st.integers(0, 7)), min_size=1, max_size=4).map(flip),
        st.integers(0, len(raw) - 1).map(lambda n: raw[:n]),
        st.tuples(at_header, huge, st.sampled_from([4, 8])).map(put),
    )


def _check(load, path: Path, folder: Path, errors):
    before = _listing(folder)
    try:
        load(path)
    except errors as exc:
        assert str(path) in str(exc), f"the error does not name the file: {exc!r}"
    assert _listing(folder) == before, f"the loader wrote into the folder: {sorted(_listing(folder) ^ before)}"


def gguf_property(n: int, folder: Path):
    from hypothesis import given
    from hypothesis import strategies as st

    from a2ats_ref.files import gguf
    from gguf_writer import F32, I32, STR, U32, U64, gguf_bytes, tiny_metadata

    raw = gguf_bytes()
    header_end = raw.index(b"\0" * 32, 64) if b"\0" * 32 in raw[64:] else len(raw)
    path = folder / "m.gguf"
    keys = [k for k, _, _ in tiny_metadata()]
    wrong = st.sampled_from([(STR, "x"), (F32, float("nan")), (F32, -1.0), (I32, -5), (U64, 2**63), (U32, 0),
                             (U32, 2**31)])

    @_settings(n)
    @given(data=st.one_of(_mutations(st, raw, header_end),
                          st.tuples(st.sampled_from(keys), wrong).map(
                              lambda kv: gguf_bytes(tiny_metadata(**{kv[0]: kv[1]})))))
    def prop(data):
        path.write_bytes(data)
        _check(gguf.load_gguf, path, folder, ValueError)

    prop()


def _header_edit(raw: bytes, name: str, how: str, v, keep_sums: bool) -> bytes:
    """``raw`` with the safetensors header entry ``name`` changed as ``how`` says and the length prefix rewritten to
    fit; without ``keep_sums`` the array checksums are dropped too (a file from before them), so that only the
    header and content checks stand between a crafted entry and arrays other than those written."""
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    ent = h[name]
    if how == "dtype":
        ent["dtype"] = v
    elif how == "shape":   # a first size moved by v (past 32 bits, negative) or made a float
        ent["shape"][0] = v if isinstance(v, float) else ent["shape"][0] + v
    elif how == "offsets":
        ent["data_offsets"] = [x + v for x in ent["data_offsets"]] if isinstance(v, int) else [0, v]
    elif how == "alias":   # the bytes of the next tensor of the same size and dtype
        names = sorted(k for k in h if k != "__metadata__")
        same = [k for k in names if k != name and (h[k]["shape"], h[k]["dtype"]) == (ent["shape"], ent["dtype"])]
        if same:
            ent["data_offsets"] = h[same[0]]["data_offsets"]
    elif how == "drop":
        del ent["shape"]
    else:
        ent["extra"] = v
    if not keep_sums:
        h["__metadata__"].pop("checksums", None)
    text = json.dumps(h).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def _header_edits(st, raw: bytes):
    """A strategy of files with one safetensors header entry changed (_header_edit)."""
    n = int.from_bytes(raw[:8], "little")
    names = sorted(k for k in json.loads(raw[8:8 + n]) if k != "__metadata__")
    dtype = st.tuples(st.just("dtype"), st.sampled_from(["I32", "U32", "F16", "BF16", "U8", "F8_E4M3", "x", 4, None]))
    other = st.tuples(st.sampled_from(["alias", "shape", "offsets", "drop", "extra"]),
                      st.sampled_from([2**32, -1, 1, 2**31, 2**63, 1.0, 10**6]))
    return st.tuples(st.sampled_from(names), st.one_of(dtype, other), st.booleans()).map(
        lambda a: _header_edit(raw, a[0], a[1][0], a[1][1], a[2]))


def _safetensors_property(n, folder, raw: bytes, load, errors, name, edit_meta, examples=()):
    """``examples``: files every run tries first, before the ``n`` drawn."""
    from hypothesis import example, given
    from hypothesis import strategies as st

    header_end = 8 + int.from_bytes(raw[:8], "little")
    path = folder / name
    wrong = st.sampled_from([None, "x", -1, 1.5, 2**70, True, [], {}, [[[[[[]]]]]]])

    def prop(data):
        path.write_bytes(data)
        _check(load, path, folder, errors)

    for e in examples:
        prop = example(data=e)(prop)
    _settings(n)(given(data=st.one_of(_mutations(st, raw, header_end), st.tuples(st.integers(0, 50), wrong).map(
        edit_meta), _header_edits(st, raw)))(prop))()


def _resaved(arrays, md, path_hint: Path) -> bytes:
    """The bytes of a safetensors file with these arrays and metadata (checksums recomputed: only content checks
    can refuse what changed)."""
    import mlx.core as mx

    from a2ats_ref.files.atomic import CHECKSUMS_KEY, checksums

    tmp = path_hint.with_name("resave.tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, dict(md, **{CHECKSUMS_KEY: checksums(arrays)}))
    data = tmp.read_bytes()
    tmp.unlink()
    return data


def _edit_json_leaf(doc, index: int, value):
    """``doc`` with its index-th field (depth-first over objects and lists, modulo their count) set to ``value``."""
    slots = []

    def walk(x):
        if isinstance(x, dict):
            for k in x:
                slots.append((x, k))
                walk(x[k])
        elif isinstance(x, list):
            for i in range(len(x)):
                slots.append((x, i))
                walk(x[i])

    walk(doc)
    if slots:
        parent, key = slots[index % len(slots)]
        if value is None and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = value
    return doc


def codebook_property(n: int, folder: Path):
    import mlx.core as mx
    import numpy as np

    from a2ats_ref.runtime.codebook import IDENTITY_KEYS, Codebook, CodebookError
    from test_codebook_file import identity

    rng = np.random.default_rng(0)
    Ls = [np.stack([np.linalg.cholesky(np.eye(8) * 2 + 0.1 * (l + 1)).astype(np.float32)] * 2) for l in range(2)]
    cb = Codebook([rng.normal(size=(2, 16, 8)).astype(np.float32) for _ in range(2)], Ls,
                  {"b": 64, "model": identity(2, 2, 8)})
    good = cb.save(folder / "good.safetensors")
    raw = good.read_bytes()
    arrays, md = mx.load(str(good), return_metadata=True)
    good.unlink()

    def edit_meta(iv):
        meta = _edit_json_leaf(json.loads(md["a2ats"]), *iv)
        return _resaved(arrays, dict(md, a2ats=json.dumps(meta)), folder / "x")

    def load(p):
        got = Codebook.load(p)
        # a file that loads can be checked against a model: no identity field is missing
        missing = [k for k in (*IDENTITY_KEYS, "weights_fingerprint") if k not in got.meta.get("model", {})]
        assert "b" in got.meta and not missing, f"a codebook lacking {missing or ['b']} loaded"
        for l in range(2):   # and it holds the arrays written, not others its header pointed at
            for mine, name in ((got.cz[l], f"layers.{l}.cz"), (got.Ls[l], f"layers.{l}.L")):
                want = arrays[name]
                assert mine.dtype == want.dtype and np.array_equal(np.array(mine), np.array(want)), \
                    f"{name} loaded as {mine.dtype} {tuple(mine.shape)}, other than the array written"

    # a file without checksums whose header points one array at another's bytes, or relabels float32 as int32
    crafted = [_header_edit(raw, "layers.0.cz", "alias", None, False), _header_edit(raw, "layers.1.L", "dtype", "I32", False),
               _header_edit(raw, "layers.0.cz", "shape", 2**32, True)]
    _safetensors_property(n, folder, raw, load, (CodebookError, ValueError), "cb.safetensors", edit_meta, crafted)


def cache_property(n: int, folder: Path):
    import mlx.core as mx

    from a2ats_ref.files.cache import load_a2ats_cache, save_a2ats_cache
    from a2ats_ref.runtime.hook import enable_a2ats
    from test_cache_support import a2ats_caches, quiet_codebook, tiny_llama, tokens

    model = enable_a2ats(tiny_llama(traditional=True))
    cb = quiet_codebook(K=300)
    cache = a2ats_caches(model, codebook=cb, w=4, sinks=2, topk=3)
    model(tokens(6, seed=1), cache=cache)
    good = folder / "good.safetensors"
    save_a2ats_cache(good, cache)
    raw = good.read_bytes()
    arrays, md = mx.load(str(good), return_metadata=True)
    good.unlink()

    def edit_meta(iv):
        layers = _edit_json_leaf(json.loads(md["layers"]), *iv)
        return _resaved(arrays, dict(md, layers=json.dumps(layers)), folder / "x")

    def load(p):
        caches = load_a2ats_cache(p, cb)
        held = mx.load(str(p))
        for i, c in enumerate(caches):   # a cache that loads keeps every token the file holds
            n = held[f"{i}.keys"].shape[2] if f"{i}.keys" in held else 0
            assert c.offset == n, f"layer {i} loaded with offset {c.offset}, the file holds {n} tokens"

    _safetensors_property(n, folder, raw, load, ValueError, "c.safetensors", edit_meta)


PROPERTIES = {"gguf": gguf_property, "codebook": codebook_property, "cache": cache_property}

if __name__ == "__main__":
    fmt, n, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(os.path.dirname(here), "calibration")]   # the shared test helpers
    import a2ats_ref  # noqa: F401  (before mlx: the BLAS preload)

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    PROPERTIES[fmt](n, folder)
    print("ok", fmt, n)
