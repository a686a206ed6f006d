"""Calibration end to end on a tiny random mlx-lm Llama (no files, no downloads)."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from a2ats_ref.calibration import calibrate as cal
from a2ats_ref.calibration import collect as col
from a2ats_ref.runtime.codebook import Codebook, CodebookError
from a2ats_ref.eq10_query_moment import query_moment
from a2ats_ref.rope import rope_inv_freqs, rope_invert

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "        self.y = y\n\n# A comment about geometry and vectors.\n"
) * 6


class ByteTokenizer:
    """Bytes as token ids; enough for corpus building."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [1 + (c % 255) for c in text.encode()]


def tiny_model(*, n_kv=2, rope_theta=10000.0, rope_scaling=None, layers=2, seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=n_kv, head_dim=16, rms_norm_eps=1e-5, vocab_size=256, rope_theta=rope_theta,
        rope_traditional=False, rope_scaling=rope_scaling, tie_word_embeddings=True,
    )
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "calib.py"
    p.write_text(TEXT)
    return p


@pytest.fixture(scope="module")
def tiny_codebook(text_file):
    m = tiny_model()
    cb = cal.calibrate(m, ByteTokenizer(), texts=[text_file], tokens=300, codebook_size=16, b=64, seed=3,
                       seq_len=128, packing="packed", chunk=48, quiet=True)
    return m, cb


def test_end_to_end_file_loads_and_validates(tiny_codebook, tmp_path):
    m, cb = tiny_codebook
    assert (cb.n_layers, cb.n_kv_heads, cb.K, cb.head_dim) == (2, 2, 16, 16)
    assert cb.meta["tokens"] == {"text": 300, "uuid": 75, "total": 375}, cb.meta["tokens"]
    path = cb.save(tmp_path / "cb.safetensors")
    back = Codebook.load(path)
    for l in range(2):
        for a, b in zip(back.for_layer(l), cb.for_layer(l)):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    back.validate_against(m)
    assert back.meta["model"]["weights_fingerprint"] == cb.meta["model"]["weights_fingerprint"]
    t = back.meta["timings"]   # each phase's effective rate is recorded
    for key in ("collect_tokens_per_s", "collect_gflops", "kmeans_init_gflops", "kmeans_lloyd_gflops"):
        assert t[key] > 0, (key, t)


@pytest.mark.parametrize(
    "kwargs, named",
    [({"n_kv": 4}, "n_kv_heads"), ({"rope_theta": 5e5}, "rope_base"), ({"layers": 3}, "n_layers"),
     ({"seed": 1}, "weights_fingerprint")],
)
def test_mismatched_model_is_named(tiny_codebook, kwargs, named):
    _, cb = tiny_codebook
    with pytest.raises(CodebookError, match=named):
        cb.validate_against(tiny_model(**kwargs))


def test_config_b_must_match(tiny_codebook):
    from a2ats_ref.runtime.cache import A2ATSConfig

    m, cb = tiny_codebook
    cb.validate_against(m, config=A2ATSConfig(b=64))
    with pytest.raises(CodebookError, match="b=64, config has b=2048"):
        cb.validate_against(m, config=A2ATSConfig())


def test_reproducible(text_file, tiny_codebook):
    m, cb = tiny_codebook
    again = cal.calibrate(m, ByteTokenizer(), texts=[text_file], tokens=300, codebook_size=16, b=64, seed=3,
                          seq_len=128, packing="packed", chunk=48, quiet=True)
    for l in range(cb.n_layers):
        np.testing.assert_array_equal(np.array(again.cz[l]), np.array(cb.cz[l]))


def test_codebook_feeds_the_cache(tiny_codebook):
    from mlx_lm import generate

    from a2ats_ref.runtime.cache import A2ATSConfig, make_a2ats_cache
    from a2ats_ref.runtime.hook import disable_a2ats, enable_a2ats

    m, cb = tiny_codebook

    class Tok(ByteTokenizer):
        pass

    enable_a2ats(m)
    try:
        caches = make_a2ats_cache(m, cb, A2ATSConfig(w=4, sinks=2, topk=2, b=64))  # b: what cb was fitted for
        prompt = mx.array(ByteTokenizer().encode("def add(a, b):\n"))
        out = m(prompt[None], cache=caches)
        for _ in range(3):
            nxt = mx.argmax(out[:, -1], axis=-1)
            out = m(nxt[None], cache=caches)
        mx.eval(out)
        assert caches[0].offset == prompt.size + 3
    finally:
        disable_a2ats(m)


@pytest.mark.clause("EQ-10")
def test_accumulated_moment_equals_query_moment():
    rng = np.random.default_rng(0)
    n_q, n_kv, N, d, b = 4, 2, 37, 16, 100
    q = mx.array(rng.normal(size=(1, n_q, N, d)).astype(np.float32))
    inv = rope_inv_freqs(d, 10000.0)
    sink = col._Sink(1, n_q, n_kv, d, b, [inv], [False])
    for s in range(0, N, 10):  # in chunks, as during prefill
        sink.on_queries(0, q[:, :, s : s + 10])
    raw = sum(np.array(p, dtype=np.float64) for p in sink.q_parts[0])
    H = col.moment_from_sums(sink.rotated_sums(0, raw), sink.qcount[0])
    ref = query_moment(q[0], n_kv_heads=n_kv, b=b, inv_freqs=inv, traditional=False)
    np.testing.assert_allclose(np.array(H), np.array(ref), rtol=1e-4, atol=1e-5)


def test_collected_keys_are_pre_rope():
    m = tiny_model()
    ids = list(range(5, 75))
    got = col.collect(m, [ids], b=16, chunk=32)
    cache = make_prompt_cache(m)
    mx.eval(m(mx.array(ids)[None], cache=cache))
    k_post = cache[1].state[0][0, :, : len(ids)]  # (n_kv, T, d) post-RoPE keys of layer 1
    inv, trad = col.model_rope_params(m)
    k_pre = rope_invert(k_post, mx.arange(len(ids)), inv[1], traditional=trad[1])
    np.testing.assert_allclose(got.keys[1], np.array(k_pre), rtol=1e-4, atol=1e-4)
    assert got.qcount[1] == 4 // 2 * len(ids)  # per KV head: group heads x tokens
    assert all(a.rope.__class__.__name__ != "_Capture" for a in col.attention_layers(m))  # hooks removed


def test_empty_corpus(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("")
    with pytest.raises(ValueError, match="empty"):
        cal.calibrate(tiny_model(), ByteTokenizer(), texts=[p], codebook_size=4, quiet=True)


def test_too_few_tokens_says_how_many(text_file):
    with pytest.raises(ValueError, match=r"K=512 codewords.*at least 512 keys.*gave 125"):
        cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text_file], tokens=100, codebook_size=512, quiet=True)


def test_unsupported_rope_scaling(text_file):
    m = tiny_model(rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="not supported"):
        cal.calibrate(m, ByteTokenizer(), texts=[text_file], tokens=100, codebook_size=4, quiet=True)


def test_model_without_rope(text_file):
    m = tiny_model()
    for layer in m.model.layers:
        del layer.self_attn["rope"]
    with pytest.raises(ValueError, match="RoPE"):
        cal.calibrate(m, ByteTokenizer(), texts=[text_file], tokens=100, codebook_size=4, quiet=True)


def test_missing_text_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cal.calibrate(tiny_model(), ByteTokenizer(), texts=[tmp_path / "nope.txt"], codebook_size=4, quiet=True)


def test_cli_reports_bad_model_path(tmp_path, capsys):
    rc = cal.main([str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "o.safetensors"), "--quiet"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_resume_reuses_finished_layers(text_file, tmp_path):
    m = tiny_model()
    kw = dict(texts=[text_file], tokens=200, codebook_size=8, b=64, seed=0, seq_len=128, packing="packed", quiet=True)
    first = cal.calibrate(m, ByteTokenizer(), partial_dir=tmp_path / "p", **kw)
    files = sorted((tmp_path / "p").glob("layer_*.safetensors"))
    assert len(files) == 2 and list((tmp_path / "p").glob("collect_*.npz"))
    # A resumed run fits no layer again: k-means never runs.
    orig_km, cal.kmeans = cal.kmeans, lambda *a, **k: pytest.fail("a finished layer was fitted again")
    try:
        second = cal.calibrate(m, ByteTokenizer(), partial_dir=tmp_path / "p", **kw)
    finally:
        cal.kmeans = orig_km
    np.testing.assert_array_equal(np.array(second.cz[0]), np.array(first.cz[0]))
    # The collection is reused too: a model that would fail to run is never called.
    def boom(*a, **k):
        raise AssertionError("collect ran again")

    orig, col.collect = col.collect, boom
    try:
        cal.calibrate(m, ByteTokenizer(), partial_dir=tmp_path / "p", **kw)
    finally:
        col.collect = orig
    # Different settings: ignored.
    third = cal.calibrate(m, ByteTokenizer(), partial_dir=tmp_path / "p", **{**kw, "seed": 1})
    assert not np.array_equal(np.array(third.cz[0]), np.array(second.cz[0]))


def _attention64(q, k, v, scale):
    """Float64 causal attention of end-aligned queries, written out (the reference for causal_attention)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    G, Tq, Tk = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = scale * q @ np.swapaxes(k, -1, -2)
    s[..., np.arange(Tk)[None, :] > np.arange(Tk - Tq, Tk)[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p @ v / p.sum(axis=-1, keepdims=True)


@pytest.mark.clause("PREFILL")
@pytest.mark.parametrize("Tq, Tk", [(1, 1), (1, 23), (9, 9), (9, 30), (30, 30)])
def test_host_causal_attention_matches_float64(Tq, Tk):
    # Blocks of 4 rows x 7 keys: the online softmax's rescaling and the causal cut inside a block both run.
    rng = np.random.default_rng(Tq * 100 + Tk)
    q = rng.normal(size=(2, 4, Tq, 8)).astype(np.float32) * 3  # spread scores: the running max changes
    k = rng.normal(size=(2, 2, Tk, 8)).astype(np.float32)
    v = rng.normal(size=(2, 2, Tk, 5)).astype(np.float32)
    got = col.causal_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.35, rows=4, block=7)
    np.testing.assert_allclose(np.array(got), _attention64(q, k, v, 0.35), rtol=1e-5, atol=1e-6)


def test_host_swiglu_matches_mlx_lm():
    from mlx_lm.models.activations import swiglu

    g = mx.array(np.concatenate([np.linspace(-120, 120, 481), np.random.default_rng(0).normal(size=500)]).astype(np.float32))
    x = mx.array(np.random.default_rng(1).normal(size=g.shape).astype(np.float32))
    np.testing.assert_allclose(np.array(col.host_swiglu(g, x)), np.array(swiglu(g, x)), rtol=1e-5, atol=1e-30)


def test_collection_allocates_each_kv_cache_once_per_sequence(monkeypatch):
    # mlx-lm's KVCache grows by 256 tokens, copying the whole cache each time; collect sizes it for the sequence.
    from mlx_lm.models.cache import KVCache

    sizes = []
    real = KVCache.update_and_fetch

    def spy(self, keys, values):
        out = real(self, keys, values)
        sizes.append((id(self), self.keys.shape[2]))
        return out

    monkeypatch.setattr(KVCache, "update_and_fetch", spy)
    m = tiny_model()
    col.collect(m, [list(range(1, 200)) * 3], b=16, chunk=64)  # 597 tokens: 3 growths at mlx-lm's step
    per_cache: dict = {}
    for key, n in sizes:
        per_cache.setdefault(key, set()).add(n)
    assert per_cache and all(len(s) == 1 for s in per_cache.values()), per_cache


@pytest.mark.clause("EQ-17-STEP")
def test_seeding_ahead_gives_the_same_codebook_and_lloyd_takes_all_cores_when_it_is_done(text_file, tiny_codebook,
                                                                                         monkeypatch):
    import contextlib
    import os

    m, cb = tiny_codebook  # SEED_AHEAD heads seeded ahead (all of them here)
    asked = []
    real = cal._blas.mlx_blas_threads
    monkeypatch.setattr(cal._blas, "mlx_blas_threads", lambda n: (asked.append(n), real(n))[1])
    monkeypatch.setattr(cal, "SEED_AHEAD", 0)  # each head seeded when its fit starts
    seq = cal.calibrate(m, ByteTokenizer(), texts=[text_file], tokens=300, codebook_size=16, b=64, seed=3,
                        seq_len=128, packing="packed", chunk=48, quiet=True)
    for l in range(cb.n_layers):
        np.testing.assert_array_equal(np.array(seq.cz[l]), np.array(cb.cz[l]))
    # With nothing seeded ahead the worker is idle during each fit, so the fits run on every core (a CPU-BLAS
    # choice: on a GPU the Lloyd steps run there and no thread count is asked for, as the H200 run showed).
    if mx.default_device().type == mx.cpu:
        assert asked.count(os.cpu_count() or 2) >= cb.n_layers * cb.n_kv_heads, asked
