"""Shared helpers for the cache/hook tests (no tests here): a tiny random Llama and quiet cache builders."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from a2ats_ref.runtime.cache import A2ATSConfig, make_a2ats_cache, random_codebook
from a2ats_ref.runtime.codebook import Codebook

N_LAYERS, N_HEADS, N_KV, HEAD_DIM, VOCAB = 2, 4, 2, 16, 64


def tiny_llama(traditional: bool = False, seed: int = 0, layers: int = N_LAYERS):
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
        vocab_size=VOCAB, rope_traditional=traditional, rope_theta=10000.0, tie_word_embeddings=False,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def quiet_codebook(n_layers=N_LAYERS, n_kv=N_KV, d=HEAD_DIM, K=64, seed=0) -> Codebook:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return random_codebook(n_layers, n_kv, d, K, seed=seed)


def a2ats_caches(model, codebook=None, **cfg):
    codebook = quiet_codebook(len(model.layers)) if codebook is None else codebook
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_a2ats_cache(model, codebook, A2ATSConfig(**cfg))


def kv_caches(model):
    return [KVCache() for _ in model.layers]


def tokens(n: int, seed: int = 1, batch: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, size=(batch, n)), dtype=mx.int32)


def run(model, toks: mx.array, cache, prefill: int) -> list[np.ndarray]:
    """Prefill `prefill` tokens at once, then decode the rest one by one; returns logits per call."""
    outs = [model(toks[:, :prefill], cache=cache)]
    for t in range(prefill, toks.shape[1]):
        outs.append(model(toks[:, t : t + 1], cache=cache))
    mx.eval(outs)
    return [np.array(o.astype(mx.float32)) if o.dtype == mx.bfloat16 else np.array(o) for o in outs]
