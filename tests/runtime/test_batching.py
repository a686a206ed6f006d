"""A2ATS under mlx-lm's batch generation: BatchGenerator (what batch_generate and mlx_lm.server run) with
requests of different lengths gives each request what it gets alone, and the server's prompt-cache reuse
(LRUPromptCache: deep copies, trimmed to a common prefix) gives identical outputs."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

from a2ats_ref.runtime.batching import A2ATSBatchCache, copy_cache
from a2ats_ref.runtime.prompt import attend_prompt_token
from a2ats_ref.runtime.hook import install_a2ats_cache, uninstall_a2ats_cache
from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig
from a2ats_ref.runtime.hook import enable_a2ats
from test_cache_support import VOCAB, a2ats_caches, quiet_codebook, tiny_llama

CFG = dict(w=4, sinks=2, topk=2)   # a sparse selection: rows that read each other's tokens decode otherwise
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return enable_a2ats(tiny_llama(seed=0))


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def alone(model, toks, max_tokens=MAX_TOKENS, cache=None):
    """Greedy tokens and their log-probabilities, the request run by itself (mlx-lm's generate_step)."""
    cache = a2ats_caches(model, **CFG) if cache is None else cache
    out = list(generate_step(mx.array(toks), model, prompt_cache=cache, max_tokens=max_tokens))
    return [int(t) for t, _ in out], [np.array(lp) for _, lp in out]


def run_batch(model, requests, *, caches=None, all_tokens=None, late=(), prefill_step_size=16, finished=None):
    """Greedy tokens per request through BatchGenerator (4 prompts prefilled together, right padding);
    `late` requests join after two decode steps (continuous batching: extend). Returns {index: (tokens, logprobs)};
    `finished` (a dict) receives {index: (cache, tokens it holds)} as the server stores them."""
    gen = BatchGenerator(model, max_tokens=MAX_TOKENS, prefill_batch_size=4, completion_batch_size=8,
                         prefill_step_size=prefill_step_size)
    order, out = [], {}

    def insert(idx):
        toks = [requests[i][0] for i in idx]
        maxt = [requests[i][1] for i in idx]
        c = [caches[i] for i in idx] if caches else [a2ats_caches(model, **CFG) for _ in idx]
        at = [all_tokens[i] for i in idx] if all_tokens else None
        uids = gen.insert(toks, maxt, caches=c, all_tokens=at)
        order.extend(zip(uids, idx))

    insert([i for i in range(len(requests)) if i not in late])
    uid_to_i = dict(order)
    steps = 0
    while True:
        responses = gen.next_generated()
        if not responses:
            break
        steps += 1
        if steps == 2 and late:
            insert(list(late))
            uid_to_i = dict(order)
        for r in responses:
            toks, lps = out.setdefault(uid_to_i[r.uid], ([], []))
            toks.append(int(r.token))
            lps.append(np.array(r.logprobs))
            if r.finish_reason is not None and finished is not None:
                finished[uid_to_i[r.uid]] = (r.prompt_cache, list(r.all_tokens))
    gen.close()
    return out


def same(batched, single, what):
    tb, lb = batched
    ts, ls = single
    assert tb == ts, f"{what}: batched tokens {tb} != alone {ts}"
    np.testing.assert_allclose(np.stack(lb), np.stack(ls), atol=2e-4, err_msg=what)


@pytest.mark.clause("CACHE-BATCH")
def test_batch_generator_rows_of_different_lengths_match_each_request_alone(model, monkeypatch):
    calls = []
    orig = A2ATSCache.decode
    monkeypatch.setattr(A2ATSCache, "decode", lambda self, q, **k: calls.append(self.offset) or orig(self, q, **k))
    # lengths differ (right padding), one prompt spans three prefill chunks, max_tokens differ (rows leave the
    # batch at different steps: filter), two requests join while the others decode (extend)
    requests = [(prompt(5, 1), 10), (prompt(23, 2), 6), (prompt(40, 3), 10), (prompt(12, 4), 3),
                (prompt(9, 5), 8), (prompt(31, 6), 10)]
    batched = run_batch(model, requests, late=(4, 5))
    assert sorted(batched) == list(range(len(requests)))
    assert calls and max(calls) > 40 + CFG["w"], "decode never went through A2ATS retrieval"
    for i, (toks, n) in enumerate(requests):
        same(batched[i], alone(model, toks, max_tokens=n), f"request {i} ({len(toks)} prompt tokens)")


def test_an_answer_does_not_depend_on_how_its_prompt_was_chunked_or_batched(model):
    """Every prompt token gets dense attention, also in a one-token chunk and as the prompt's last token, which
    mlx-lm runs alone (runtime.prompt). The 42-token prompt's first 41 tokens go in one chunk alone (the
    reference), in chunks of 20 (20, 20, then one token), of 7, or one by one; and in a batch with a longer
    prompt, where this row's one-token chunk is padded to a longer one. The answer is the same every time."""
    toks = prompt(42, 24)
    want = alone(model, toks)
    for step in (20, 7, 1):
        cache = a2ats_caches(model, **CFG)
        out = list(generate_step(mx.array(toks), model, prompt_cache=cache, max_tokens=MAX_TOKENS,
                                 prefill_step_size=step))
        same(([int(t) for t, _ in out], [np.array(lp) for _, lp in out]), want, f"prefill_step_size={step}")
    for step in (16, 20):
        batched = run_batch(model, [(toks, MAX_TOKENS), (prompt(57, 25), MAX_TOKENS)], prefill_step_size=step)
        same(batched[0], want, f"batched with a longer prompt, prefill_step_size={step}")


def test_rows_never_read_each_other(model, monkeypatch):
    """A mutant batch cache whose decode reads row 0's tokens for every row fails the comparison above."""
    requests = [(prompt(20, 9), 6), (prompt(20, 10), 6)]   # equal lengths: row 0's cache fits row 1's query
    monkeypatch.setattr(A2ATSBatchCache, "decode", lambda self, q, scale=None: mx.concatenate(
        [attend_prompt_token(self.rows[0], q[i:i + 1], scale) if r.newest_is_prompt
         else self.rows[0].decode(q[i:i + 1], scale=scale) for i, r in enumerate(self.rows)], axis=0))
    bad = run_batch(model, requests)
    same(bad[0], alone(model, requests[0][0], max_tokens=6), "row 0")
    with pytest.raises(AssertionError):
        same(bad[1], alone(model, requests[1][0], max_tokens=6), "mutant row 1")


def test_server_prompt_cache_reuse_gives_identical_outputs(model):
    """mlx_lm.server's path: finished requests go into an LRUPromptCache; a later request takes the nearest
    cached prefix (a deep copy, trimmed when the cached sequence is longer) and generates the rest."""
    lru = LRUPromptCache(max_size=10)
    key = ("tiny", None, None)
    first = prompt(36, 11)
    finished = {}
    toks = run_batch(model, [(first, MAX_TOKENS), (prompt(7, 17), 4)], finished=finished)[0][0]
    # what the server stores: the request's cache (extracted from the batch) and the tokens it holds
    cache, held = finished[0]
    assert held[:len(first) + len(toks)] == first + toks and cache[0].offset == len(held), (len(held), cache[0])
    assert all(isinstance(c, A2ATSCache) for c in cache)
    lru.insert_cache(key, held, cache)
    before = [np.array(c.keys_and_values()[0]) for c in cache]

    cases = {
        "cached sequence longer, prefix inside the prompt (trimmed copy)": first[:20] + prompt(9, 12),
        "cached sequence longer, prefix inside the generated tokens (trimmed copy)": held[:40] + prompt(4, 18),
        "cached sequence a prefix (copy, then the rest prefilled)": held + prompt(5, 13),
    }
    for what, p in cases.items():
        c, rest = lru.fetch_nearest_cache(key, p)
        n_cached = len(p) - len(rest)
        assert c is not None and 0 < n_cached < len(p), what
        assert all(isinstance(x, A2ATSCache) for x in c) and c[0].offset == n_cached, what
        assert c[0].codebook is cache[0].codebook, "a deep copy must share the codebook"
        reused = run_batch(model, [(rest, MAX_TOKENS)], caches=[c], all_tokens=[p[:n_cached]])[0]
        # the reference: the stored cache rebuilt from its state (no copy_cache), trimmed alike, run alone
        ref = [A2ATSCache.from_state(x.state, x.meta_state, codebook=x.codebook) for x in cache]
        for x in ref:
            x.trim(x.offset - n_cached)
        same(reused, alone(model, rest, cache=ref), what)
        if n_cached <= len(first):   # tokens the first request prefilled: a fresh run gives the same
            same(reused, alone(model, p), what + ", against a fresh run")
    for c, k in zip(cache, before):   # the cached entry itself is untouched by the requests that copied it
        np.testing.assert_array_equal(np.array(c.keys_and_values()[0]), k)


def test_prefilled_ends_at_the_first_token_a_decode_answered(model):
    """A2ATSCache.prefilled, what the server's prompt cache reuses: a prefill's tokens count, a decoded token
    and everything after it do not, whatever the model writes later; trims, copies and batch rows keep it.
    A prompt's last token, which mlx-lm runs alone, counts: it is a prompt token (runtime.prompt)."""
    cache = a2ats_caches(model, **CFG)
    model(mx.array([prompt(12, 19)]), cache=cache)
    assert {c.prefilled for c in cache} == {12}
    model(mx.array([prompt(1, 20)]), cache=cache)    # one token, no evaluation before it: a decode step
    model(mx.array([prompt(4, 21)]), cache=cache)    # a later chunk, attended densely, on top of it
    assert {c.prefilled for c in cache} == {12} and cache[0].offset == 17
    assert {c.prefilled for c in copy.deepcopy(cache)} == {12}
    mx.eval([c.state for c in cache])                # as mlx-lm after a prompt chunk: the next token is a prompt's
    empty = mx.zeros((1, cache[0].codebook.n_kv_heads, 0, cache[0].codebook.head_dim))
    cache[0].update_and_fetch(empty, empty)          # an empty append marks nothing
    assert cache[0]._prompt_next and cache[0].offset == 17
    for c in cache:
        c.trim(6)
    assert {c.prefilled for c in cache} == {11}
    rebuilt = A2ATSCache.from_state(cache[0].state, cache[0].meta_state, codebook=cache[0].codebook)
    assert rebuilt.prefilled == 0, "a state does not say which tokens a decode produced"
    finished = {}
    first = prompt(9, 22)
    run_batch(model, [(first, 3), (prompt(5, 23), 3)], finished=finished)
    row, held = finished[0]
    assert row[0].offset == len(held) and {c.prefilled for c in row} == {len(first)}


def test_copy_is_independent_and_shares_the_codebook(model):
    cache = a2ats_caches(model, **CFG)
    model(mx.array([prompt(12, 14)]), cache=cache)
    dup = copy.deepcopy(cache)
    assert dup[0].codebook is cache[0].codebook and dup[0].offset == cache[0].offset == 12
    model(mx.array([prompt(3, 15)]), cache=dup)
    assert cache[0].offset == 12 and dup[0].offset == 15
    np.testing.assert_array_equal(np.array(dup[0].keys[..., :12, :]), np.array(cache[0].keys[..., :12, :]))
    np.testing.assert_array_equal(np.array(dup[0].codes_view()[..., :12]), np.array(cache[0].codes_view()))
    assert copy_cache(cache[0]).nbytes == cache[0].nbytes


def test_install_makes_make_prompt_cache_build_a2ats_caches(model):
    cb = quiet_codebook()
    install_a2ats_cache(model, cb, A2ATSConfig(**CFG))
    try:
        caches = make_prompt_cache(model)
        assert all(isinstance(c, A2ATSCache) for c in caches) and caches[0].config.w == CFG["w"]
        assert all(hasattr(c, "merge") for c in caches)   # what mlx_lm.server reads as "batchable"
    finally:
        uninstall_a2ats_cache(model)
    assert not any(isinstance(c, A2ATSCache) for c in make_prompt_cache(model))
    with pytest.raises(ValueError, match="layers"):
        install_a2ats_cache(model, quiet_codebook(n_layers=3))
    assert not any(isinstance(c, A2ATSCache) for c in make_prompt_cache(model))


def test_refusals_name_the_cause(model):
    b = A2ATSCache.merge([a2ats_caches(model, **CFG)[0] for _ in range(2)])
    with pytest.raises(ValueError, match="right padding"):
        b.prepare(left_padding=[1, 0])
    with pytest.raises(ValueError, match="sliding-window"):
        b.make_mask(1, window_size=8)
    with pytest.raises(ValueError, match="caches\\[1\\]"):
        A2ATSCache.merge([a2ats_caches(model, **CFG)[0], object()])
    two = a2ats_caches(model, **CFG)
    model(mx.array([prompt(4, 16)] * 2), cache=two)
    with pytest.raises(ValueError, match="batch of 2"):
        A2ATSCache.merge([two[0]])
