"""Fault injection: bad inputs, interrupted writes, stale or concurrent runs.

Each test pins one failure mode that would give a silent wrong result, a lost file or a raw traceback.
Sizes are tiny; kills run in subprocesses.
"""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import math
import warnings

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref import checks
from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig, make_a2ats_cache
from a2ats_ref.runtime.codebook import Codebook, CodebookError, model_identity
from a2ats_ref.eq10_query_moment import query_moment
from a2ats_ref.eq14_assign import assign
from a2ats_ref.eq16_z_transform import assign_z
from a2ats_ref.files.gguf import weights_fingerprint
from a2ats_ref.retrieval import decode_step, select_tokens
from a2ats_spec import oracle
from test_cache_support import HEAD_DIM, N_KV, N_LAYERS, quiet_codebook, tiny_llama
from hang_guard import HANG_S


def _cache(codebook=None, **cfg) -> A2ATSCache:
    cb = quiet_codebook() if codebook is None else codebook
    inv = mx.array(oracle.rope_inv_freqs(HEAD_DIM, 10000.0).astype(np.float32))
    return A2ATSCache(cb.layers[0], inv, False, A2ATSConfig(**cfg))


def _kv(rng, B, T, n_kv=N_KV, d=HEAD_DIM):
    return (mx.array(rng.normal(size=(B, n_kv, T, d)).astype(np.float32)),
            mx.array(rng.normal(size=(B, n_kv, T, d)).astype(np.float32)))


# ------------------------------------------------------------------ 1. zero attention (RET-SELECT never-empty)


@pytest.mark.parametrize("T", [1, 5, 33])
def test_zero_attention_attends_the_own_token_everywhere(T):
    """w=0, sinks=0, default topk, T <= 33: cache, fast path, clause function and oracle all attend token T-1."""
    rng = np.random.default_rng(T)
    cache = _cache(w=0, sinks=0)
    k, v = _kv(rng, 1, T)
    cache.update_and_fetch(k, v)
    q = mx.array(rng.normal(size=(1, 2 * N_KV, 1, HEAD_DIM)).astype(np.float32))
    out = np.array(cache.decode(q))
    sel = np.array(cache.last_selection)
    want_sel = np.zeros((1, N_KV, T), bool)
    want_sel[..., T - 1] = True
    np.testing.assert_array_equal(sel, want_sel)
    # attending one token returns its value exactly
    want = np.repeat(np.array(v)[0, :, T - 1], 2, axis=0)[None, :, None, :]
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    lc = cache.codebook
    kw = dict(query_pos=T - 1, b=2048, w=0, sinks=0, topk=0.03, inv_freqs=np.array(cache.inv_freqs), traditional=False)
    codes = np.array(cache.codes_view())[0]
    ref, ref_mask = decode_step(q[0, :, 0], k[0], v[0], codes, lc.C, return_mask=True, **kw)
    orc, orc_mask = oracle.decode_step(np.array(q[0, :, 0], np.float64), np.array(k[0], np.float64),
                                       np.array(v[0], np.float64), codes, np.array(lc.C, np.float64),
                                       return_mask=True, **kw)
    np.testing.assert_array_equal(np.array(ref_mask), want_sel[0])
    np.testing.assert_array_equal(orc_mask, want_sel[0])
    np.testing.assert_allclose(np.array(ref), out[0, :, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(orc, out[0, :, 0], rtol=1e-5, atol=1e-5)


def test_never_empty_rule_only_where_the_selection_was_empty():
    """With a window or sinks, or a count >= 1, the rule adds nothing (the authors' selection is unchanged)."""
    s = np.random.default_rng(0).normal(size=(1, 20))
    for w, sinks, topk in [(1, 0, 0.03), (0, 1, 0.03), (0, 0, 0.1), (0, 0, 1)]:
        m = np.array(select_tokens(s, n_kv_heads=1, query_pos=19, w=w, sinks=sinks, topk=topk))
        o = oracle.select_tokens(s, n_kv_heads=1, query_pos=19, w=w, sinks=sinks, topk=topk)
        np.testing.assert_array_equal(m, o)
        if (w, sinks) == (0, 0):
            assert m.sum() == oracle.topk_count(20, topk)


# ------------------------------------------------------------------ 4. trim


@pytest.mark.parametrize("n", [-5, 2.5, True, "1", None])
def test_trim_rejects_non_integers_and_negatives(n):
    cache = _cache()
    cache.update_and_fetch(*_kv(np.random.default_rng(0), 1, 6))
    with pytest.raises(ValueError, match="trim: n must be a non-negative int"):
        cache.trim(n)
    assert cache.offset == 6 and isinstance(cache.offset, int)


def test_trim_keeps_mlx_lm_contract_beyond_offset():
    cache = _cache()
    cache.update_and_fetch(*_kv(np.random.default_rng(0), 1, 6))
    assert cache.trim(np.int64(2)) == 2 and cache.offset == 4
    assert cache.trim(100) == 4 and cache.offset == 0


# ------------------------------------------------------------------ 5. empty input


def test_appending_zero_tokens_works_like_kvcache():
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(0)
    cache, ref = _cache(), KVCache()
    k0, v0 = _kv(rng, 1, 0)
    ka, va = cache.update_and_fetch(k0, v0)
    kr, vr = ref.update_and_fetch(k0, v0)
    assert ka.shape == kr.shape == (1, N_KV, 0, HEAD_DIM) and cache.offset == ref.offset == 0
    cache.update_and_fetch(*_kv(rng, 1, 3))
    ka, _ = cache.update_and_fetch(k0, v0)
    assert ka.shape[2] == 3 and cache.offset == 3 and cache.codes_view().shape == (1, N_KV, 3)


def test_assign_with_no_keys_gives_empty_codes():
    C, H = mx.random.normal((5, HEAD_DIM)), mx.eye(HEAD_DIM)
    assert assign(mx.zeros((0, HEAD_DIM)), C, H).shape == (0,)
    assert assign_z(mx.zeros((0, HEAD_DIM)), C, H).shape == (0,)
    Cz = mx.random.normal((N_KV, 5, HEAD_DIM))
    L = mx.broadcast_to(mx.eye(HEAD_DIM), (N_KV, HEAD_DIM, HEAD_DIM))
    assert assign_z(mx.zeros((N_KV, 0, HEAD_DIM)), Cz, L).shape == (N_KV, 0)


def test_batch_size_change_after_trim_to_zero_starts_fresh():
    """Documented reset: an emptied cache takes the new batch size; it never broadcasts into old buffers."""
    rng = np.random.default_rng(0)
    cache = _cache(w=4, sinks=1, topk=2)
    cache.update_and_fetch(*_kv(rng, 1, 5))
    cache.trim(5)
    k, v = _kv(rng, 2, 4)
    ka, va = cache.update_and_fetch(k, v)
    assert ka.shape[0] == 2 and cache.codes_view().shape == (2, N_KV, 4)
    fresh = _cache(w=4, sinks=1, topk=2)
    fresh.update_and_fetch(k, v)
    np.testing.assert_array_equal(np.array(ka), np.array(k))
    np.testing.assert_array_equal(np.array(cache.codes_view()), np.array(fresh.codes_view()))
    with pytest.raises(ValueError, match="batch size 1 differs"):
        cache.update_and_fetch(*_kv(rng, 1, 1))


# ------------------------------------------------------------------ 6. make_a2ats_cache validates


def _codebook_for(model, *, b=2048, K=8) -> Codebook:
    cb = quiet_codebook(K=K)
    meta = {"model": model_identity(model, fingerprint=weights_fingerprint(model)), "b": b}
    return Codebook([l.Cz for l in cb.layers], [l.L for l in cb.layers], meta)


def test_make_cache_validates_a_codebook_with_metadata():
    a, other = tiny_llama(seed=0), tiny_llama(seed=1)   # same shapes, different weights
    cb = _codebook_for(a, b=64)
    assert len(make_a2ats_cache(a, cb, A2ATSConfig(b=64))) == N_LAYERS
    with pytest.raises(CodebookError, match="weights_fingerprint"):
        make_a2ats_cache(other, cb, A2ATSConfig(b=64))
    with pytest.raises(CodebookError, match="b: codebook calibrated for b=64"):
        make_a2ats_cache(a, cb, A2ATSConfig(b=2048))
    assert len(make_a2ats_cache(other, cb, A2ATSConfig(b=2048), validate=False)) == N_LAYERS


def test_validation_is_remembered_per_model(monkeypatch):
    """A cache per prompt must not re-hash every weight of a large model each time."""
    import a2ats_ref.runtime.codebook as codebook_module

    a = tiny_llama(seed=0)
    cb = _codebook_for(a)
    calls = []
    orig = codebook_module.weights_fingerprint
    monkeypatch.setattr(codebook_module, "weights_fingerprint", lambda m: (calls.append(1), orig(m))[1])
    for _ in range(3):
        make_a2ats_cache(a, cb, A2ATSConfig())
    assert len(calls) == 1
    with pytest.raises(CodebookError, match="weights_fingerprint"):
        make_a2ats_cache(tiny_llama(seed=1), cb, A2ATSConfig())


@pytest.mark.parametrize("bad", ["llama", 3, ["n_layers"]])
def test_malformed_model_metadata_is_a_clear_error(bad):
    cb = _codebook_for(tiny_llama())
    cb.meta["model"] = bad
    with pytest.raises(CodebookError, match="metadata 'model'"):
        cb.validate_against(tiny_llama())


# ------------------------------------------------------------------ 10. smaller gaps


@pytest.mark.parametrize("p", [np.array([2**63], np.uint64), np.array([-(2**63)], np.int64),
                               mx.array([2**40], mx.int64), np.array([2**32 + 5], np.uint64), 2**24])
def test_huge_positions_are_refused(p):
    with pytest.raises(ValueError, match="2\\*\\*24"):
        checks.as_positions(p)


@pytest.mark.parametrize("ridge", [math.inf, math.nan, -1.0])
def test_ridge_must_be_finite(ridge):
    q = mx.array(np.random.default_rng(0).normal(size=(2, 5, HEAD_DIM)).astype(np.float32))
    inv = oracle.rope_inv_freqs(HEAD_DIM, 10000.0)
    with pytest.raises(ValueError, match="ridge"):
        query_moment(q, n_kv_heads=1, b=64, inv_freqs=inv, traditional=False, ridge=ridge)


# ------------------------------------------------------------------ 3. kills during saves (atomic writes)

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from a2ats_ref.files.cache import load_a2ats_cache, save_a2ats_cache  # noqa: E402

TESTS = str(Path(__file__).parent)
CHILD_PATH = os.pathsep.join([TESTS, *(str(Path(TESTS) / d) for d in ("runtime", "calibration"))])


def _kill_mid_write(script: str, target: Path, timeout: float = HANG_S) -> None:
    """Run `script` in a child; SIGKILL it as soon as it starts writing (target or a temp file beside it changes)."""
    before = target.stat()
    others = set(target.parent.iterdir())
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=TESTS,
                             env={**os.environ, "PYTHONPATH": CHILD_PATH})
    try:
        assert child.stdout.readline().strip() == "go", "child did not start"
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end and child.poll() is None:
            st = target.stat()
            if (st.st_size, st.st_mtime_ns, st.st_ino) != (before.st_size, before.st_mtime_ns, before.st_ino):
                break
            if any(p.stat().st_size > 0 for p in set(target.parent.iterdir()) - others if p.exists()):
                break
            time.sleep(0.0005)
        assert child.poll() is None, "the save finished before it could be interrupted; make the arrays larger"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


CACHE_CHILD = """
import a2ats_ref, numpy as np, mlx.core as mx
from test_cache_support import quiet_codebook
from test_faults import _cache
from a2ats_ref.files.cache import save_a2ats_cache
c = _cache(quiet_codebook(n_layers=1))
T, rng = 200_000, np.random.default_rng(0)
k = mx.array(rng.normal(size=(1, 2, T, 16)).astype(np.float32))
c.state = (k, k + 1, mx.zeros((1, 2, T), mx.uint8))
mx.eval(c.keys, c.values)
print("go", flush=True)
save_a2ats_cache(PATH, [c])
"""


def test_kill_during_cache_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "c.safetensors"
    cb = quiet_codebook(n_layers=1)
    old = _cache(cb)
    old.update_and_fetch(*_kv(np.random.default_rng(1), 1, 5))
    save_a2ats_cache(path, [old])
    _kill_mid_write(CACHE_CHILD.replace("PATH", repr(str(path))), path)
    (back,) = load_a2ats_cache(path, cb)
    assert back.offset in (5, 200_000)
    if back.offset == 5:
        np.testing.assert_array_equal(np.array(back.keys_and_values()[0]), np.array(old.keys_and_values()[0]))


CODEBOOK_CHILD = """
import a2ats_ref, numpy as np, mlx.core as mx
from a2ats_ref.runtime.codebook import Codebook
rng = np.random.default_rng(0)
from test_codebook_file import identity
cb = Codebook([rng.normal(size=(2, 65536, 64)).astype(np.float32)], [np.stack([np.eye(64, dtype=np.float32)] * 2)],
              {"b": 2048, "model": identity(1, 2, 64)})
print("go", flush=True)
cb.save(PATH)
"""


def test_kill_during_codebook_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "cb.safetensors"
    from test_codebook_file import identity

    Codebook([np.ones((2, 8, 64), np.float32)], [np.stack([np.eye(64, dtype=np.float32)] * 2)],
             {"b": 2048, "model": identity(1, 2, 64)}).save(path)
    _kill_mid_write(CODEBOOK_CHILD.replace("PATH", repr(str(path))), path)
    assert Codebook.load(path).K in (8, 65536)


# ------------------------------------------------------------------ 7. integrity of stored arrays


def _flip_byte_in(path: Path, array_name: str) -> None:
    """Flip one bit inside the named array's data (located through the safetensors header)."""
    import json as _json

    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start, end = _json.loads(raw[8 : 8 + n])[array_name]["data_offsets"]
    raw[8 + n + (start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def test_bit_flip_in_a_cache_array_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    cb = quiet_codebook()
    c = _cache(cb)
    c.update_and_fetch(*_kv(np.random.default_rng(0), 1, 7))
    c2 = _cache(cb)
    c2.codebook = cb.layers[1]
    c2.update_and_fetch(*_kv(np.random.default_rng(1), 1, 7))
    save_a2ats_cache(path, [c, c2])
    _flip_byte_in(path, "1.values")
    with pytest.raises(ValueError, match="'1.values' fails its SHA-256 checksum"):
        load_a2ats_cache(path, cb)


def test_bit_flip_in_a_codebook_array_is_refused(tmp_path):
    path = tmp_path / "cb.safetensors"
    cb = quiet_codebook(K=8)
    from test_codebook_file import identity

    Codebook([l.Cz for l in cb.layers], [l.L for l in cb.layers],
             {"b": 2048, "model": identity(cb.n_layers, cb.layers[0].n_kv_heads, cb.layers[0].head_dim)}).save(path)
    _flip_byte_in(path, "layers.1.cz")
    with pytest.raises(CodebookError, match="'layers.1.cz' fails its SHA-256 checksum"):
        Codebook.load(path)


def test_tiny_positive_L_diagonal_is_refused(tmp_path):
    cb = quiet_codebook(K=8)
    L = np.array(cb.layers[0].L)
    L[1, 3, 3] = 1e-30
    with pytest.raises(ValueError, match="ill-conditioned"):
        Codebook(cb.layers[0].Cz[None], mx.array(L)[None])
    with pytest.raises(ValueError, match="ill-conditioned"):
        Codebook([cb.layers[0].Cz], [L])


def test_nonfinite_codebook_arrays_are_refused():
    cb = quiet_codebook(K=8)
    Cz = np.array(cb.layers[0].Cz)
    Cz[0, 2, 1] = 3e38   # finite, but C = Cz L^-1 overflows
    L = np.array(cb.layers[0].L) * 0.5
    with pytest.raises(ValueError, match="C = Cz L\\^-1 .*finite|non-finite|NaN/inf"):
        Codebook(mx.array(Cz)[None], mx.array(L)[None])


# ------------------------------------------------------------------ 2, 8, 9, 10. calibration runs

from a2ats_ref.calibration import calibrate as cal  # noqa: E402
from a2ats_ref.calibration import collect as col  # noqa: E402
from test_calib_tiny import TEXT, ByteTokenizer, tiny_model  # noqa: E402

CAL = dict(tokens=300, codebook_size=8, b=64, seed=0, seq_len=128, packing="packed", chunk=64, quiet=True)


def _same_codebook(a, b) -> bool:
    return all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.cz + a.Ls, b.cz + b.Ls))


def test_resume_after_the_corpus_changed_starts_over(tmp_path, capsys):
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    m = tiny_model()
    cal.calibrate(m, ByteTokenizer(), texts=[text], partial_dir=tmp_path / "p", **CAL)
    text.write_text(TEXT.upper())        # same path, same token count, other tokens
    resumed = cal.calibrate(m, ByteTokenizer(), texts=[text], partial_dir=tmp_path / "p", **{**CAL, "quiet": False})
    fresh = cal.calibrate(m, ByteTokenizer(), texts=[text], **CAL)
    assert _same_codebook(resumed, fresh), "the resumed run used statistics of the old text"
    assert "different corpus" in capsys.readouterr().err


LOCK_CHILD = """
import time, a2ats_ref
from a2ats_ref.calibration import calibrate as cal
from a2ats_ref.calibration import collect as col
from test_calib_tiny import ByteTokenizer, tiny_model
orig = col.collect
def slow(*a, **k):
    print("go", flush=True)
    time.sleep(1.0)
    return orig(*a, **k)
col.collect = slow
cal.calibrate(tiny_model(), ByteTokenizer(), texts=[TEXTFILE], partial_dir=PARTIAL, tokens=300, codebook_size=8, b=64,
              seq_len=128, packing="packed", chunk=64, quiet=True)
"""


def test_two_calibrations_to_one_out(tmp_path, capsys):
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    out = tmp_path / "cb.safetensors"
    partial = out.with_name(out.name + ".partial")
    script = LOCK_CHILD.replace("TEXTFILE", repr(str(text))).replace("PARTIAL", repr(str(partial)))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=TESTS,
                             env={**os.environ, "PYTHONPATH": CHILD_PATH})
    try:
        assert child.stdout.readline().strip() == "go"
        with pytest.raises(ValueError, match="is locked"):
            cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], partial_dir=partial, **CAL)
        # the CLI refuses before loading anything (the model path does not even exist)
        rc = cal.main([str(tmp_path / "no-model.gguf"), "--out", str(out), "--text", str(text), "--quiet"])
        err = capsys.readouterr().err
        assert rc == 2 and "is locked" in err and "Traceback" not in err
    finally:
        assert child.wait(timeout=HANG_S) == 0
    assert not list(partial.glob("*.tmp"))


@pytest.mark.parametrize("case", ["exists", "folder", "no-parent"])
def test_out_paths_are_checked_before_any_work(tmp_path, capsys, case):
    out = {"exists": tmp_path / "cb.safetensors", "folder": tmp_path, "no-parent": tmp_path / "f.txt" / "cb.safetensors"}[case]
    (tmp_path / "cb.safetensors").write_bytes(b"precious")
    (tmp_path / "f.txt").write_text("")
    rc = cal.main([str(tmp_path / "no-model.gguf"), "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--out" in err and "no-model" not in err, err
    assert {"exists": "--force", "folder": "is a folder", "no-parent": "not an existing folder"}[case] in err
    assert (tmp_path / "cb.safetensors").read_bytes() == b"precious"


def test_force_replaces_an_existing_out(tmp_path, capsys):
    (tmp_path / "cb.safetensors").write_bytes(b"old")
    rc = cal.main([str(tmp_path / "no-model.gguf"), "--out", str(tmp_path / "cb.safetensors"), "--force", "--quiet"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err   # got past the --out check to the model


def test_too_few_distinct_tokens_fails_before_collecting(tmp_path, monkeypatch):
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    def boom(*a, **k):
        raise AssertionError("collected before checking K")
    monkeypatch.setattr(col, "collect", boom)
    n_distinct = len(set(ByteTokenizer().encode(TEXT)) | {0}) + 16   # text bytes, eos, UUID hex characters
    with pytest.raises(ValueError, match=r"--codebook-size 128: .* distinct tokens .* use --codebook-size (16|32|64)"):
        cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], **{**CAL, "codebook_size": 128})
    assert n_distinct < 128


def test_rerun_with_smaller_K_does_not_collect_again(tmp_path, monkeypatch):
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    m = tiny_model()
    cal.calibrate(m, ByteTokenizer(), texts=[text], partial_dir=tmp_path / "p", **{**CAL, "codebook_size": 16})
    def boom(*a, **k):
        raise AssertionError("collected again")
    monkeypatch.setattr(col, "collect", boom)
    cb = cal.calibrate(m, ByteTokenizer(), texts=[text], partial_dir=tmp_path / "p", **{**CAL, "codebook_size": 4})
    assert cb.K == 4


def test_collection_is_checkpointed(tmp_path, monkeypatch):
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    m = tiny_model()
    kw = {**CAL, "checkpoint_tokens": 128}
    whole = cal.calibrate(m, ByteTokenizer(), texts=[text], **kw)
    orig, calls = col.collect, []

    def dies_on_second_group(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return orig(*a, **k)

    monkeypatch.setattr(col, "collect", dies_on_second_group)
    with pytest.raises(KeyboardInterrupt):
        cal.calibrate(m, ByteTokenizer(), texts=[text], partial_dir=tmp_path / "p", **kw)
    n_groups = len(cal._groups(cal.build_corpus(ByteTokenizer(), paths=[text], tokens=300, seq_len=128, seed=0, packing="packed").sequences, 128))
    calls.clear()
    monkeypatch.setattr(col, "collect", lambda *a, **k: (calls.append(1), orig(*a, **k))[1])
    resumed = cal.calibrate(m, ByteTokenizer(), texts=[text], partial_dir=tmp_path / "p", **kw)
    assert len(calls) == n_groups - 1 >= 2, "the finished group was collected again"
    assert _same_codebook(resumed, whole)


def test_bench_checks_its_output_paths_first(tmp_path, capsys):
    from a2ats_ref.bench import cli as bench

    rc = bench.main(["speed", "--tiny", "--json", str(tmp_path / "missing" / "r.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--json" in err and "missing" in err and "Traceback" not in err
    rc = bench.main(["speed", "--tiny", "--json", str(tmp_path / "r.json"), "--md", str(tmp_path)])
    assert rc == 2 and "--md" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("opt, val", [("--tokens", "0"), ("--codebook-size", "70000"), ("--tol", "nan"),
                                      ("--chunk", "0"), ("--uuid-fraction", "-1")])
def test_calibrate_cli_numbers_are_checked_first(tmp_path, capsys, opt, val):
    rc = cal.main([str(tmp_path / "no-model.gguf"), "--out", str(tmp_path / "cb.safetensors"), opt, val, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and opt in err and "no-model" not in err, err


def test_library_user_errors_are_value_errors(tmp_path):
    cb = quiet_codebook()
    c = _cache()
    with pytest.raises(ValueError, match="keys: expected a float16"):
        c.update_and_fetch(np.zeros((1, N_KV, 3, HEAD_DIM), np.float32), np.zeros((1, N_KV, 3, HEAD_DIM), np.float32))
    with pytest.raises(ValueError, match="keys: expected a float16"):
        c.update_and_fetch(mx.zeros((1, N_KV, 3, HEAD_DIM), mx.int32), mx.zeros((1, N_KV, 3, HEAD_DIM)))
    c.update_and_fetch(*_kv(np.random.default_rng(0), 1, 3))
    with pytest.raises(ValueError, match="queries: expected a float16"):
        c.decode(mx.zeros((1, 2 * N_KV, 1, HEAD_DIM), mx.int32))
    with pytest.raises(ValueError, match="caches: expected a list"):
        save_a2ats_cache(tmp_path / "c.safetensors", c)
    with pytest.raises(ValueError, match="metadata: expected a dict"):
        save_a2ats_cache(tmp_path / "c.safetensors", [c], metadata=["x"])
    with pytest.raises(ValueError, match="is a folder"):
        Codebook([cb.layers[0].Cz], [cb.layers[0].L]).save(tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="cannot create its folder"):
        Codebook([cb.layers[0].Cz], [cb.layers[0].L]).save(tmp_path / "f" / "cb.safetensors")
    with pytest.raises(CodebookError, match="is a folder"):
        Codebook.load(tmp_path)


def test_text_that_never_ends_is_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for p in (fifo, Path("/dev/zero")):
        with pytest.raises(ValueError, match="not a regular file"):
            cal.build_corpus(ByteTokenizer(), paths=[p], tokens=100)
