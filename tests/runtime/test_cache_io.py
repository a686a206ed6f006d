"""CACHE-SAVE — save_a2ats_cache / load_a2ats_cache round trip and rejection of foreign or corrupt files."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from a2ats_ref.files.cache import load_a2ats_cache, save_a2ats_cache
from a2ats_ref.runtime.hook import enable_a2ats
from test_cache_support import a2ats_caches, kv_caches, quiet_codebook, tiny_llama, tokens


@pytest.fixture(scope="module")
def setup():
    model = enable_a2ats(tiny_llama(traditional=True))
    cb = quiet_codebook(K=300)  # uint16 codes
    return model, cb


@pytest.mark.clause("CACHE-SAVE")
@pytest.mark.parametrize("evaluated", [False, True], ids=["mid-generation", "after-a-prompt-chunk"])
def test_save_load_gives_identical_future_outputs(tmp_path, setup, evaluated):
    """After a prompt chunk mlx-lm evaluates the caches' state, which makes the next token a prompt token
    (runtime.prompt): the file keeps that mark, so the loaded cache gives that token dense attention too."""
    model, cb = setup
    toks = tokens(40, seed=2)
    cache = a2ats_caches(model, codebook=cb, w=4, sinks=2, topk=3)
    model(toks[:, :30], cache=cache)
    if evaluated:
        mx.eval([c.state for c in cache])
    path = tmp_path / "c.safetensors"
    save_a2ats_cache(path, cache, metadata={"note": "hi"})
    loaded, meta = load_a2ats_cache(path, cb, return_metadata=True)
    assert meta == {"note": "hi"}
    for a, b in zip(cache, loaded):
        assert b.offset == a.offset and b.config == a.config and b.traditional == a.traditional
        np.testing.assert_array_equal(np.array(a.codes_view()), np.array(b.codes_view()))
        assert b.codes_view().dtype == mx.uint16
    for t in range(30, 40):
        x = np.array(model(toks[:, t : t + 1], cache=cache))
        y = np.array(model(toks[:, t : t + 1], cache=loaded))
        np.testing.assert_array_equal(x, y, err_msg=f"CACHE-SAVE: step {t} differs after load")


@pytest.mark.clause("CACHE-SAVE")
def test_empty_cache_round_trips(tmp_path, setup):
    model, cb = setup
    path = tmp_path / "e.safetensors"
    save_a2ats_cache(path, a2ats_caches(model, codebook=cb))
    loaded = load_a2ats_cache(path, cb)
    assert all(c.empty() and c.offset == 0 for c in loaded)


def test_rejects_wrong_codebook(tmp_path, setup):
    model, cb = setup
    cache = a2ats_caches(model, codebook=cb)
    model(tokens(5), cache=cache)
    path = tmp_path / "c.safetensors"
    save_a2ats_cache(path, cache)
    with pytest.raises(ValueError, match="different codebook"):
        load_a2ats_cache(path, quiet_codebook(K=300, seed=9))
    with pytest.raises(ValueError, match="layers"):
        load_a2ats_cache(path, quiet_codebook(n_layers=3, K=300))


def test_rejects_foreign_and_corrupt_files(tmp_path, setup):
    model, cb = setup
    kv = kv_caches(model)
    model(tokens(5), cache=kv)
    foreign = tmp_path / "mlx.safetensors"
    save_prompt_cache(str(foreign), kv)
    with pytest.raises(ValueError, match="format"):
        load_a2ats_cache(foreign, cb)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01not a safetensors file" * 10)
    with pytest.raises(ValueError, match="not a valid a2ats-cache"):
        load_a2ats_cache(junk, cb)
    with pytest.raises(ValueError, match=".safetensors"):
        load_a2ats_cache(tmp_path / "x.npz", cb)
    with pytest.raises(ValueError, match="no such file"):
        load_a2ats_cache(tmp_path / "missing.safetensors", cb)
    with pytest.raises(ValueError, match="A2ATSCache"):
        save_a2ats_cache(tmp_path / "k.safetensors", kv)


def test_rejects_tampered_metadata_and_codes(tmp_path, setup):
    model, cb = setup
    cache = a2ats_caches(model, codebook=cb)
    model(tokens(6), cache=cache)
    path = tmp_path / "c.safetensors"
    save_a2ats_cache(path, cache)
    arrays, meta = mx.load(str(path), return_metadata=True)
    bad_meta = dict(meta, layers=json.dumps(json.loads(meta["layers"])[:1] + [{"offset": 6}]))
    p1 = tmp_path / "m.safetensors"
    mx.save_safetensors(str(p1), arrays, bad_meta)
    with pytest.raises(ValueError, match="malformed|codebook"):
        load_a2ats_cache(p1, cb)
    bad = dict(arrays)
    bad["0.codes"] = mx.full(bad["0.codes"].shape, 299 + 1, dtype=mx.uint16)
    p2 = tmp_path / "codes.safetensors"
    mx.save_safetensors(str(p2), bad, meta)
    with pytest.raises(ValueError, match="corrupt"):
        load_a2ats_cache(p2, cb)
    p3 = tmp_path / "v.safetensors"
    mx.save_safetensors(str(p3), arrays, dict(meta, version="99"))
    with pytest.raises(ValueError, match="version"):
        load_a2ats_cache(p3, cb)


def test_mlx_lm_save_prompt_cache_refuses_and_names_save_a2ats_cache(tmp_path, setup):
    # mlx-lm's save would write a file its load_prompt_cache cannot read (KeyError: 'A2ATSCache'): refused first.
    model, cb = setup
    cache = a2ats_caches(model, codebook=cb)
    model(tokens(4), cache=cache)
    path = tmp_path / "p.safetensors"
    with pytest.raises(ValueError, match="save_a2ats_cache"):
        save_prompt_cache(str(path), cache)
    assert not path.exists()
    batch = [cache[0].merge([c]) for c in cache]   # the batch cache of mlx-lm's batch generation, too
    with pytest.raises(ValueError, match="save_a2ats_cache"):
        save_prompt_cache(str(path), batch)
    assert not path.exists()
    save_a2ats_cache(path, cache)   # the supported way round-trips
    assert load_a2ats_cache(path, cb)[0].offset == 4
    kv = kv_caches(model)   # mlx-lm's own caches are not affected
    model(tokens(4), cache=kv)
    save_prompt_cache(str(tmp_path / "kv.safetensors"), kv)
    assert load_prompt_cache(str(tmp_path / "kv.safetensors"))[0].offset == 4


def test_a_header_pointing_two_arrays_at_the_same_bytes_is_refused(tmp_path, setup):
    # without checksums (a file from before them) nothing but the header check sees keys read as values
    model, cb = setup
    cache = a2ats_caches(model, codebook=cb)
    model(tokens(6), cache=cache)
    path = tmp_path / "c.safetensors"
    save_a2ats_cache(path, cache)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    h["__metadata__"].pop("checksums")
    h["0.values"]["data_offsets"] = h["0.keys"]["data_offsets"]
    text = json.dumps(h).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(ValueError, match="share bytes") as e:
        load_a2ats_cache(path, cb)
    assert str(path) in str(e.value)
