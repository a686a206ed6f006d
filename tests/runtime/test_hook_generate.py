"""mlx-lm's generate, stream_generate and speculative decoding run with A2ATS caches on a tiny model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate, generate_step, stream_generate

from a2ats_ref.runtime.hook import enable_a2ats
from test_cache_support import VOCAB, a2ats_caches, kv_caches, tiny_llama, tokens


@pytest.fixture(scope="module")
def tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    vocab = {chr(97 + i): i for i in range(26)}
    vocab[" "] = 26
    vocab["<eos>"] = 27
    vocab.update({f"<x{i}>": i for i in range(28, VOCAB)})
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    return TokenizerWrapper(hf)


@pytest.fixture(scope="module")
def models():
    return enable_a2ats(tiny_llama(seed=0)), enable_a2ats(tiny_llama(seed=1, layers=1))


PROMPT = "the quick brown fox jumps over the lazy dog " * 2


def test_generate_and_stream_generate(tokenizer, models):
    model, _ = models
    cache = a2ats_caches(model, w=4, sinks=2, topk=2)
    text = generate(model, tokenizer, PROMPT, max_tokens=12, prompt_cache=cache)
    assert isinstance(text, str)
    assert cache[0].offset > len(PROMPT)
    cache = a2ats_caches(model, w=4, sinks=2, topk=2)
    responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens=8, prompt_cache=cache))
    assert 1 <= len(responses) <= 8 and responses[-1].generation_tokens == len(responses)
    assert cache[0].last_selection is not None, "decode never went through A2ATS"


@pytest.mark.clause("CACHE-DENSE-EQUIV")
def test_generate_step_greedy_matches_dense_when_everything_selected(models):
    model, _ = models
    prompt = tokens(30, seed=3)[0]
    a = [t for t, _ in generate_step(prompt, model, prompt_cache=a2ats_caches(model, w=4, topk=1.0), max_tokens=10)]
    b = [t for t, _ in generate_step(prompt, model, prompt_cache=kv_caches(model), max_tokens=10)]
    assert a == b


@pytest.mark.clause("CACHE-TRIM")
@pytest.mark.parametrize("draft_a2ats", [True, False], ids=["draft-a2ats", "draft-kvcache"])
def test_speculative_decoding_with_trim(tokenizer, models, draft_a2ats):
    model, draft = models
    cfg = dict(w=4, sinks=2, topk=2)
    main_cache = a2ats_caches(model, **cfg)
    draft_cache = a2ats_caches(draft, **cfg) if draft_a2ats else kv_caches(draft)
    trims = []
    orig_trim = type(main_cache[0]).trim

    def spy(self, n):
        trims.append(n)
        return orig_trim(self, n)

    type(main_cache[0]).trim = spy
    try:
        responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens=16, draft_model=draft,
                                         num_draft_tokens=3, prompt_cache=main_cache + draft_cache))
    finally:
        type(main_cache[0]).trim = orig_trim
    assert len(responses) >= 1
    n_gen = responses[-1].generation_tokens
    # After the last step the main cache holds the prompt and the generated tokens except the newest.
    assert main_cache[0].offset == len(tokenizer.encode(PROMPT)) + n_gen - 1, (main_cache[0].offset, n_gen)
    assert any(n > 0 for n in trims), f"trims {trims}: speculative decoding never trimmed (random draft should be rejected)"
    assert all(np.isfinite(np.array(c.keys_and_values()[0])).all() for c in main_cache)
