"""The codebook file format: round trip, and foreign/corrupt files rejected with clear errors."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import json

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref.runtime.codebook import FORMAT_NAME, FORMAT_VERSION, Codebook, CodebookError


def make_codebook(n_layers=2, n_kv=2, K=8, d=4, seed=0):
    rng = np.random.default_rng(seed)
    cz = [rng.normal(size=(n_kv, K, d)).astype(np.float32) for _ in range(n_layers)]
    Ls = []
    for _ in range(n_layers):
        A = rng.normal(size=(n_kv, d, d))
        H = A @ np.swapaxes(A, -1, -2) + np.eye(d)
        Ls.append(np.linalg.cholesky(H).astype(np.float32))
    return Codebook(cz, Ls, {"b": 2048, "model": identity(n_layers, n_kv, d)})


def identity(n_layers, n_kv, d) -> dict:
    """A complete model identity, as a codebook file must record it."""
    return {"architecture": "llama", "n_layers": n_layers, "n_heads": 2 * n_kv, "n_kv_heads": n_kv, "head_dim": d,
            "rope_base": 10000.0, "rope_scaling": None, "rope_traditional": False, "weights_fingerprint": "0" * 64}


def write(path, arrays, meta=None, fmt=FORMAT_NAME, version=FORMAT_VERSION):
    md = {}
    if fmt is not None:
        md["format"] = fmt
    if version is not None:
        md["format_version"] = version
    if meta is not None:
        md["a2ats"] = json.dumps(meta)
    mx.save_safetensors(str(path), {k: mx.array(v) for k, v in arrays.items()}, metadata=md)
    return path


def good_arrays_meta(cb):
    arrays = {}
    for l in range(cb.n_layers):
        arrays[f"layers.{l}.cz"] = np.array(cb.cz[l])
        arrays[f"layers.{l}.L"] = np.array(cb.Ls[l])
    meta = {"n_layers": cb.n_layers, "n_kv_heads": cb.n_kv_heads, "codebook_size": cb.K, "head_dim": cb.head_dim}
    return arrays, meta


def test_round_trip(tmp_path):
    cb = make_codebook()
    back = Codebook.load(cb.save(tmp_path / "c.safetensors"))
    assert back.meta["b"] == 2048 and back.meta["codebook_size"] == 8 and back.meta["package_version"]
    for l in range(2):
        np.testing.assert_array_equal(np.array(back.cz[l]), np.array(cb.cz[l]))
        np.testing.assert_array_equal(np.array(back.Ls[l]), np.array(cb.Ls[l]))
    assert back.Cz.shape == (2, 2, 8, 4) and back.L.shape == (2, 2, 4, 4)
    cz, L = back.for_layer(1)
    assert cz.shape == (2, 8, 4) and L.shape == (2, 4, 4)
    with pytest.raises(IndexError, match="layer"):
        back.for_layer(2)
    assert not list(tmp_path.glob("*.tmp*")), "no temporary file left behind"


def test_cache_accepts_it():
    cb = make_codebook()
    cc = Codebook.coerce(cb)
    assert (cc.n_layers, cc.n_kv_heads, cc.K, cc.head_dim) == (2, 2, 8, 4) and not cc.random


def test_not_safetensors(tmp_path):
    p = tmp_path / "junk.safetensors"
    p.write_bytes(b"\x00" * 3 + b"hello, I am not a codebook" * 10)
    with pytest.raises(CodebookError, match="not a safetensors file|not a readable safetensors"):
        Codebook.load(p)


def test_pickle_is_not_read(tmp_path):
    import pickle

    p = tmp_path / "cb.pkl"
    p.write_bytes(pickle.dumps({"cz": [1, 2, 3]}))
    with pytest.raises(CodebookError):
        Codebook.load(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Codebook.load(tmp_path / "nope.safetensors")


def test_a_fifo_is_refused_unopened(tmp_path):
    import os

    from a2ats_ref.files.cache import load_a2ats_cache

    p = tmp_path / "c.safetensors"
    os.mkfifo(p)   # opening it to read would block until a writer came
    with pytest.raises(CodebookError, match="not a regular file") as e:
        Codebook.load(p)
    assert str(p) in str(e.value)
    with pytest.raises(ValueError, match="not a regular file"):
        load_a2ats_cache(p, make_codebook())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a, m, kw: kw.update(fmt=None), "not an a2ats codebook"),
        (lambda a, m, kw: kw.update(fmt="gguf"), "not an a2ats codebook"),
        (lambda a, m, kw: kw.update(version="99"), "format version '99' is not supported"),
        (lambda a, m, kw: kw.update(meta=None), "'a2ats' is missing"),
        (lambda a, m, kw: a.pop("layers.1.L"), "'layers.1.L' is missing"),
        (lambda a, m, kw: a.update({"layers.0.cz": np.full((2, 8, 4), np.nan, np.float32)}), "non-finite"),
        (lambda a, m, kw: a.update({"layers.1.cz": np.zeros((2, 7, 4), np.float32)}), r"layers.1.cz has shape \(2, 7, 4\)"),
        (lambda a, m, kw: a.update({"layers.0.L": np.zeros((2, 4, 5), np.float32)}), r"layers.0.L has shape"),
        (lambda a, m, kw: a.update({"layers.0.L": np.ones((2, 4, 4), np.float32)}), "lower triangular"),
        (lambda a, m, kw: m.update(codebook_size=9), "codebook_size=9 disagrees"),
        (lambda a, m, kw: m.update(n_layers=3), "'layers.2.cz' is missing"),
        (lambda a, m, kw: a.update({"extra": np.zeros(3, np.float32)}), "unexpected arrays"),
    ],
)
def test_corrupt_or_foreign_rejected(tmp_path, mutate, message):
    arrays, meta = good_arrays_meta(make_codebook())
    kw = {"meta": meta}
    mutate(arrays, meta, kw)
    p = write(tmp_path / "bad.safetensors", arrays, **kw)
    with pytest.raises(CodebookError, match=message):
        Codebook.load(p)


def test_truncated_file(tmp_path):
    p = make_codebook().save(tmp_path / "c.safetensors")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(CodebookError):
        Codebook.load(p)


def _with_header(path, edit, keep_checksums=False):
    """``path`` rewritten with its safetensors header text passed through ``edit`` (the JSON dict in, the text
    out), the length prefix fitted; without ``keep_checksums`` the array checksums go too (a file from before
    them), so only the header check stands between the crafted entry and arrays other than those written."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    if not keep_checksums:
        h["__metadata__"].pop("checksums")
    text = edit(h).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return path


def _set(name, **fields):
    def edit(h):
        h[name].update(fields)
        return json.dumps(h)
    return edit


def _alias(h):   # layers.0.cz pointed at layers.1.cz's bytes
    h["layers.0.cz"]["data_offsets"] = h["layers.1.cz"]["data_offsets"]
    return json.dumps(h)


def _wrapped_shape(h):   # a size past 32 bits: MLX narrows it to the written 2
    h["layers.0.cz"]["shape"][0] += 2**32
    return json.dumps(h)


def _repeated_key(h):   # a second layers.0.cz entry, on layers.1.cz's bytes: which one counts depends on the reader
    dup = json.dumps({"layers.0.cz": dict(h["layers.0.cz"], data_offsets=h["layers.1.cz"]["data_offsets"])})
    return json.dumps(h)[:-1] + ", " + dup[1:]


@pytest.mark.parametrize("edit, message", [
    (_alias, "share bytes"),
    (_wrapped_shape, "not a list of sizes"),
    (_repeated_key, "appears twice"),
    (_set("layers.1.L", dtype="I32"), "'layers.1.L' is mlx.core.int32, expected float32"),
    (_set("layers.0.L", dtype="F8_E4M3"), "dtype 'F8_E4M3' is not one of"),
])
def test_a_crafted_header_is_refused_before_its_arrays_are_used(tmp_path, edit, message):
    p = _with_header(make_codebook().save(tmp_path / "c.safetensors"), edit)
    with pytest.raises(CodebookError, match=message) as e:
        Codebook.load(p)
    assert str(p) in str(e.value)


def _after_the_header_check(monkeypatch, act):
    """Run ``act()`` once, right after the header of the file being loaded has been checked: the moment another
    process would pick to swap or rewrite it."""
    from a2ats_ref.files import untrusted

    checked = untrusted._check_open

    def check_then_act(f, path, error):
        header = checked(f, path, error)
        act()
        return header
    monkeypatch.setattr(untrusted, "_check_open", check_then_act)


def test_a_file_swapped_in_after_the_check_is_never_read(tmp_path, monkeypatch):
    """A crafted file renamed over the checked one between the check and the load must not reach mx.load."""
    cb = make_codebook()
    p = cb.save(tmp_path / "c.safetensors")
    crafted = _with_header(make_codebook(seed=1).save(tmp_path / "crafted.safetensors"), _alias)
    _after_the_header_check(monkeypatch, lambda: crafted.replace(p))
    back = Codebook.load(p)   # the file that was checked: the one open when the swap happened
    for l in range(cb.n_layers):
        np.testing.assert_array_equal(np.array(back.cz[l]), np.array(cb.cz[l]))


def test_a_file_rewritten_while_it_is_read_is_refused(tmp_path, monkeypatch):
    p = make_codebook().save(tmp_path / "c.safetensors")

    def grow():
        with open(p, "ab") as f:
            f.write(b"\0" * 64)
    _after_the_header_check(monkeypatch, grow)
    with pytest.raises(CodebookError, match="changed while it was read") as e:
        Codebook.load(p)
    assert str(p) in str(e.value)
