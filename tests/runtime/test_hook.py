"""The attention hook: A2ATS caches get A2ATS attention, every other cache stays on mlx-lm's path."""

from __future__ import annotations

import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base as mlx_base
from mlx_lm.models import gpt2, llama, phi3, qwen2

from a2ats_ref.runtime.hook import SUPPORTED_MODULES, a2ats_enabled, disable_a2ats, enable_a2ats
from test_cache_support import a2ats_caches, kv_caches, run, tiny_llama, tokens


def test_plain_kvcache_is_bit_identical_to_unpatched_mlx_lm():
    model = tiny_llama(seed=3)
    disable_a2ats(model)
    assert llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    toks = tokens(30, seed=6)
    before = run(model, toks, kv_caches(model), prefill=12)
    no_cache_before = np.array(model(toks))
    assert enable_a2ats(model) is model
    assert a2ats_enabled(model)
    after = run(model, toks, kv_caches(model), prefill=12)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(no_cache_before, np.array(model(toks)))


def test_enable_is_idempotent_and_disable_restores():
    model = tiny_llama()
    enable_a2ats(model)
    fn = llama.scaled_dot_product_attention
    enable_a2ats(model)
    assert llama.scaled_dot_product_attention is fn and fn._a2ats_original is mlx_base.scaled_dot_product_attention
    disable_a2ats(model)
    assert llama.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    assert not a2ats_enabled(model)
    enable_a2ats(model)


def test_without_hook_a2ats_cache_would_be_dense():
    # Documents why the hook is needed: the cache alone does not change attention.
    model = tiny_llama()
    disable_a2ats(model)
    try:
        toks = tokens(30)
        a = run(model, toks, a2ats_caches(model, w=2, sinks=1, topk=1), prefill=20)
        b = run(model, toks, kv_caches(model), prefill=20)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    finally:
        enable_a2ats(model)


def test_second_supported_module_qwen2():
    args = qwen2.ModelArgs(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64)
    mx.random.seed(0)
    model = enable_a2ats(qwen2.Model(args))
    assert a2ats_enabled(model) and qwen2.scaled_dot_product_attention._a2ats_dispatcher
    toks = tokens(30)
    a = run(model, toks, a2ats_caches(model, w=4, sinks=2, topk=1.0), prefill=20)
    b = run(model, toks, kv_caches(model), prefill=20)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def _phi3(**kw):
    args = phi3.ModelArgs(model_type="phi3", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                          num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, **kw)
    return phi3.Model(args)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _phi3(partial_rotary_factor=0.5), "partial rotary"),
        (lambda: _phi3(rope_scaling={"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}),
         "SuScaledRoPE is not supported"),
        (lambda: tiny_llama().__class__(llama.ModelArgs(
            model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64, num_attention_heads=4,
            rms_norm_eps=1e-5, vocab_size=64, rope_scaling={"type": "yarn", "factor": 2.0})), "YarnRoPE"),
        (lambda: gpt2.Model(gpt2.ModelArgs(model_type="gpt2", n_ctx=32, n_embd=32, n_head=2, n_layer=1,
                                           n_positions=32, layer_norm_epsilon=1e-5, vocab_size=64)), "rope"),
    ],
    ids=["partial-rotary", "longrope", "yarn", "no-rope"],
)
def test_refuses_models_it_cannot_handle(make, match):
    model = make()
    with pytest.raises(ValueError, match=match):
        enable_a2ats(model)
    with pytest.raises(ValueError):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from a2ats_ref.runtime.cache import make_a2ats_cache

            make_a2ats_cache(model, allow_random_codebook=True)


def test_refuses_unlisted_module(monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr("a2ats_ref.runtime.hook.SUPPORTED_MODULES", ("mlx_lm.models.qwen2",))
    with pytest.raises(ValueError, match="does not cover"):
        enable_a2ats(model)


def test_refuses_sliding_window_layers():
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                           sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="RotatingKVCache"):
        a2ats_caches(llama.Model(args))


def test_supported_modules_all_import_and_bind_the_name():
    import importlib

    for name in SUPPORTED_MODULES:
        mod = importlib.import_module(name)
        assert callable(getattr(mod, "scaled_dot_product_attention")), name
    assert "mlx_lm.models.llama" in sys.modules


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_low_precision_model_keeps_value_dtype(dtype):
    model = enable_a2ats(tiny_llama())
    model.set_dtype(dtype)
    cache = a2ats_caches(model, w=4, sinks=2, topk=2)
    outs = run(model, tokens(30), cache, prefill=20)
    assert cache[0].keys.dtype == dtype and all(np.isfinite(o).all() for o in outs)
    q = mx.zeros((1, 4, 1, 16), dtype=dtype)
    assert cache[0].decode(q, scale=0.25).dtype == dtype


def test_decode_with_explicit_mask_is_refused():
    model = enable_a2ats(tiny_llama())
    cache = a2ats_caches(model)
    model(tokens(5), cache=cache)
    q = mx.zeros((1, 4, 1, 16))
    k, v = cache[0].update_and_fetch(mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 1, 16)))
    with pytest.raises(ValueError, match="padding"):
        llama.scaled_dot_product_attention(q, k, v, cache=cache[0], scale=0.25, mask=mx.ones((1, 6), dtype=mx.bool_))


def test_enable_applies_the_allocator_setting_unless_turned_off(monkeypatch):
    """Library speed = benchmark speed: enable_a2ats applies fast_decode.tune_allocator by default;
    A2ATS_TUNE_ALLOCATOR=0 or tune_allocator=False leaves malloc alone; a bad value names the variable."""
    from a2ats_ref.runtime.decode import portable as fast_decode

    calls = []
    monkeypatch.setattr(fast_decode, "tune_allocator", lambda: calls.append(1) or True)
    model = tiny_llama()
    monkeypatch.delenv("A2ATS_TUNE_ALLOCATOR", raising=False)
    enable_a2ats(model)
    assert calls == [1]
    enable_a2ats(model, tune_allocator=False)
    monkeypatch.setenv("A2ATS_TUNE_ALLOCATOR", "0")
    enable_a2ats(model)
    assert calls == [1]
    enable_a2ats(model, tune_allocator=True)
    assert calls == [1, 1]
    monkeypatch.setenv("A2ATS_TUNE_ALLOCATOR", "maybe")
    with pytest.raises(ValueError, match="A2ATS_TUNE_ALLOCATOR"):
        enable_a2ats(model)
