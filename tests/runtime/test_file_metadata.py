"""CACHE-SAVE and codebook files: the metadata that the array checksums do not reach is input too. A file whose
checksums match but whose metadata or arrays are wrong in type, range or presence is refused, naming the path and
the field; a save that cannot write names its path."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref.files.cache import load_a2ats_cache, save_a2ats_cache
from a2ats_ref.runtime.codebook import Codebook, CodebookError
from a2ats_ref.files.atomic import CHECKSUMS_KEY, checksums
from a2ats_ref.runtime.hook import enable_a2ats
from test_cache_support import a2ats_caches, quiet_codebook, tiny_llama, tokens
from hang_guard import HANG_S


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = enable_a2ats(tiny_llama(traditional=True))
    cb = quiet_codebook(K=300)
    cache = a2ats_caches(model, codebook=cb, w=4, sinks=2, topk=3)
    model(tokens(12, seed=1), cache=cache)
    path = tmp_path_factory.mktemp("cache") / "c.safetensors"
    save_a2ats_cache(path, cache)
    arrays, meta = mx.load(str(path), return_metadata=True)
    return cb, arrays, dict(meta)


_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "uint16": "U16", "uint8": "U8", "int32": "I32"}


def _write(path: Path, arrays: dict, meta: dict) -> Path:
    """A file whose checksums match its (possibly altered) arrays: only the content checks can refuse it.
    Written byte by byte (MLX's writer refuses float64, which a crafted file may hold)."""
    meta = dict(meta, **{CHECKSUMS_KEY: checksums(arrays)})
    header, data = {"__metadata__": meta}, b""
    for name, a in arrays.items():
        raw = np.array(a)
        header[name] = {"dtype": _ST_DTYPES[str(raw.dtype)], "shape": list(raw.shape),
                        "data_offsets": [len(data), len(data) + raw.nbytes]}
        data += raw.tobytes()
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)
    return path


def _layers(meta) -> list:
    return json.loads(meta["layers"])


def _with_layer0(meta, **change) -> dict:
    layers = _layers(meta)
    for k, v in change.items():
        if v is _DROP:
            layers[0].pop(k)
        else:
            layers[0][k] = v
    return dict(meta, layers=json.dumps(layers))


_DROP = object()


def _refused(path, cb, *fragments):
    with pytest.raises(ValueError) as err:
        load_a2ats_cache(path, cb)
    msg = str(err.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg


def test_valid_file_loads(saved, tmp_path):
    cb, arrays, meta = saved
    loaded = load_a2ats_cache(_write(tmp_path / "ok.safetensors", arrays, meta), cb)
    assert loaded[0].offset == 12 and loaded[0].traditional is True


def test_the_prompt_marks_may_be_absent_and_are_read_back(saved, tmp_path):
    """runtime.prompt's marks: a file without them loads as a restored state does; one with them gives them back."""
    cb, arrays, meta = saved
    bare = _with_layer0(meta, prefilled=_DROP, prompt_next=_DROP, prompt_starts=_DROP)
    c = load_a2ats_cache(_write(tmp_path / "bare.safetensors", arrays, bare), cb)[0]
    assert (c.prefilled, c._prompt_next, c._prompt_starts) == (0, False, [])
    marked = _with_layer0(meta, prefilled=7, prompt_next=True, prompt_starts=[0, 7])
    c = load_a2ats_cache(_write(tmp_path / "marked.safetensors", arrays, marked), cb)[0]
    assert (c.prefilled, c._prompt_next, c._prompt_starts) == (7, True, [0, 7])


@pytest.mark.parametrize("change, fragment", [
    (dict(offset=0), "do not match the layers' offsets"),
    (dict(offset=11), "do not fit offset 11"),
    (dict(offset=-1), "offset is -1"),
    (dict(offset=12.0), "offset is 12.0"),
    (dict(offset="12"), "offset is '12'"),
    (dict(offset=True), "offset is True"),
    (dict(traditional="false"), "traditional is 'false'"),
    (dict(traditional=0), "traditional is 0"),
    (dict(traditional=_DROP), "'traditional'"),
    (dict(config="w=4"), "config is 'w=4'"),
    (dict(config={"w": -4}), "not a valid A2ATSConfig"),
    (dict(config={"w": 4, "x": 1}), "not a valid A2ATSConfig"),
    (dict(K="300"), "K is '300'"),
    (dict(fast_rope={"base": "zz", "scale": "0x1p+0"}), "fast_rope base"),
    (dict(fast_rope={"base": "-0x1p+0", "scale": "0x1p+0"}), "fast_rope base"),
    (dict(fast_rope=[1, 2]), "fast_rope is [1, 2]"),
    (dict(shapes=_DROP), "'shapes'"),
    (dict(extra=1), "'extra'"),
    (dict(prefilled=13), "prefilled is 13"),
    (dict(prefilled=-1), "prefilled is -1"),
    (dict(prefilled="3"), "prefilled is '3'"),
    (dict(prompt_next=1), "prompt_next is 1"),
    (dict(prompt_starts=[0, 12]), "prompt_starts is [0, 12]"),
    (dict(prompt_starts=[5, 2]), "prompt_starts is [5, 2]"),
    (dict(prompt_starts={"0": 1}), "prompt_starts is {'0': 1}"),
])
def test_layer_metadata_is_checked(saved, tmp_path, change, fragment):
    cb, arrays, meta = saved
    _refused(_write(tmp_path / "m.safetensors", arrays, _with_layer0(meta, **change)), cb, fragment)


@pytest.mark.parametrize("text, fragment", [
    ('[{"offset": Infinity}]', "Infinity is not a JSON number"),
    ('[{"offset": NaN}]', "NaN is not a JSON number"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    ('{"a": 1}', "not a list of JSON objects"),
    ("[1, 2]", "not a list of JSON objects"),
])
def test_layers_json_is_strict_and_bounded(saved, tmp_path, text, fragment):
    cb, arrays, meta = saved
    _refused(_write(tmp_path / "j.safetensors", arrays, dict(meta, layers=text)), cb, fragment)


def test_user_metadata_is_checked(saved, tmp_path):
    cb, arrays, meta = saved
    _refused(_write(tmp_path / "u.safetensors", arrays, dict(meta, user_metadata='{"a": [1]}')), cb, "user_metadata")
    _refused(_write(tmp_path / "u.safetensors", arrays, dict(meta, user_metadata="{" * 50_000)), cb, "nested")


@pytest.mark.parametrize("mutate, fragment", [
    (lambda a: a.__setitem__("0.keys", mx.where(mx.arange(a["0.keys"].size).reshape(a["0.keys"].shape) == 5,
                                                 mx.nan, a["0.keys"])), "keys hold NaN"),
    (lambda a: a.__setitem__("1.values", a["1.values"] * mx.inf), "values hold NaN or infinite"),
    (lambda a: a.__setitem__("0.keys", a["0.keys"].astype(mx.int32)), "keys are mlx.core.int32"),
    (lambda a: a.__setitem__("0.keys", a["0.keys"].astype(mx.float64)), "F64"),   # MLX reads no float64 safetensors: refused as unreadable
    (lambda a: a.__setitem__("0.inv_freqs", a["0.inv_freqs"] * 2), "inv_freqs are not those of the RoPE"),
    (lambda a: a.__setitem__("0.inv_freqs", a["0.inv_freqs"].astype(mx.float16)), "expected float32"),
    (lambda a: a.__setitem__("0.codes", a["0.codes"].astype(mx.int32)), "codes are not valid"),
    (lambda a: a.pop("1.codes"), "'1.codes'"),
    (lambda a: a.__setitem__("9.keys", a["0.keys"]), "'9.keys'"),
])
def test_arrays_are_checked_though_their_checksums_match(saved, tmp_path, mutate, fragment):
    cb, arrays, meta = saved
    arrays = dict(arrays)
    mutate(arrays)
    if "0.keys" in arrays and arrays["0.keys"].dtype != _layers(meta)[0]["dtypes"]["keys"]:
        layers = _layers(meta)    # metadata that agrees with the altered dtype: the content check must refuse it
        layers[0]["dtypes"]["keys"] = str(arrays["0.keys"].dtype)
        meta = dict(meta, layers=json.dumps(layers))
    if "0.codes" in arrays and str(arrays["0.codes"].dtype) != _layers(meta)[0]["dtypes"]["codes"]:
        layers = _layers(meta)
        layers[0]["dtypes"]["codes"] = str(arrays["0.codes"].dtype)
        meta = dict(meta, layers=json.dumps(layers))
    _refused(_write(tmp_path / "a.safetensors", arrays, meta), cb, fragment)


# ---------------------------------------------------------------- codebook files


@pytest.fixture(scope="module")
def codebook_file(tmp_path_factory):
    from test_calib_tiny import TEXT, ByteTokenizer, tiny_model

    from a2ats_ref.calibration import calibrate as cal

    folder = tmp_path_factory.mktemp("cb")
    text = folder / "t.py"
    text.write_text(TEXT)
    m = tiny_model()
    cb = cal.calibrate(m, ByteTokenizer(), texts=[text], tokens=200, codebook_size=8, b=64, seed=0, seq_len=128,
                       packing="packed", quiet=True)
    path = cb.save(folder / "cb.safetensors")
    arrays, md = mx.load(str(path), return_metadata=True)
    return m, path, arrays, dict(md)


def _codebook_with(tmp_path, arrays, md, edit) -> Path:
    meta = json.loads(md["a2ats"])
    edit(meta)
    return _write(tmp_path / "cb.safetensors", arrays, dict(md, a2ats=json.dumps(meta)))


@pytest.mark.parametrize("edit, fragment", [
    (lambda m: m.pop("model"), "'model'"),
    (lambda m: m["model"].pop("weights_fingerprint"), "weights_fingerprint"),
    (lambda m: m.pop("b"), "'b'"),
    (lambda m: m.__setitem__("b", "2048"), "b is '2048'"),
    (lambda m: m.__setitem__("b", 2**24 + 1), "b is 16777217"),
    (lambda m: m.__setitem__("b", -1), "b is -1"),
    (lambda m: m["model"].pop("rope_base"), "rope_base"),
    (lambda m: m["model"].__setitem__("rope_traditional", "false"), "rope_traditional"),
    (lambda m: m["model"].__setitem__("n_layers", 3), "n_layers"),
    (lambda m: m["model"].__setitem__("head_dim", 8), "head_dim"),
    (lambda m: m["model"].__setitem__("weights_fingerprint", 7), "weights_fingerprint"),
    (lambda m: m.__setitem__("model", "llama"), "'model'"),
])
def test_codebook_identity_fields_are_required(codebook_file, tmp_path, edit, fragment):
    _, _, arrays, md = codebook_file
    path = _codebook_with(tmp_path, arrays, md, edit)
    with pytest.raises(CodebookError) as err:
        Codebook.load(path)
    assert str(path) in str(err.value) and fragment in str(err.value), str(err.value)


def test_codebook_metadata_json_is_strict_and_bounded(codebook_file, tmp_path):
    _, _, arrays, md = codebook_file
    for text in ("[" * 100_000, '{"b": NaN}'):
        path = _write(tmp_path / "j.safetensors", arrays, dict(md, a2ats=text))
        with pytest.raises(CodebookError, match="a2ats"):
            Codebook.load(path)


def test_valid_codebook_still_validates(codebook_file):
    m, path, _, _ = codebook_file
    Codebook.load(path).validate_against(m)


# ---------------------------------------------------------------- a full disk names the path

FULL_DISK_CHILD = r"""
import resource, signal, sys
import a2ats_ref, mlx.core as mx
from a2ats_ref.runtime.codebook import Codebook
from test_cache_support import quiet_codebook
from test_codebook_file import identity
cb = Codebook([mx.zeros((2, 64, 16)) + mx.arange(64)[:, None], ], [mx.broadcast_to(mx.eye(16), (2, 16, 16))],
              {"b": 64, "model": identity(1, 2, 16)})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    cb.save(sys.argv[1])
except OSError as exc:
    print("OSError", exc.filename, exc.strerror)
except Exception as exc:
    print("other", type(exc).__name__, exc)
"""


def test_a_save_that_cannot_write_names_its_path(tmp_path):
    out = tmp_path / "cb.safetensors"
    r = subprocess.run([sys.executable, "-c", FULL_DISK_CHILD, str(out)], capture_output=True, text=True, timeout=HANG_S,
                       cwd=Path(__file__).parent)
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    assert line.startswith("OSError") and str(out) in line and "is the disk full" in line, line
    assert not out.exists() and not list(tmp_path.glob(".*tmp*")), "a torn or temporary file was left"


def test_a_codebook_without_its_identity_is_not_saved(tmp_path):
    """What load refuses is refused at save, before a file exists that nobody can load."""
    import numpy as np

    cb = Codebook([np.ones((2, 8, 4), np.float32)], [np.stack([np.eye(4, dtype=np.float32)] * 2)], {"b": 64})
    with pytest.raises(CodebookError, match="lacks 'model'"):
        cb.save(tmp_path / "cb.safetensors")
    assert not list(tmp_path.iterdir())
