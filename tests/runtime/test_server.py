"""mlx_lm.server with A2ATS caches, driven in-process on loopback: concurrent requests of different lengths
are batched (A2ATSBatchCache) and each answer equals the same request run alone; a repeated request reuses
the server's prompt cache and answers the same, and so does a prompt that extends an earlier request's (the
reuse stops where the earlier cache's prefilled tokens end)."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from http.server import ThreadingHTTPServer

import mlx.core as mx
import pytest
from mlx_lm.generate import generate, generate_step
from mlx_lm.models.cache import make_prompt_cache

from a2ats_ref.runtime import server as a2s
from a2ats_ref.runtime.batching import A2ATSBatchCache
from a2ats_ref.runtime.cache import A2ATSCache
from test_generate_cli import WORDS, _model_folder, files  # noqa: F401  (the model folder and its codebook)
from hang_guard import HANG_S

PROMPTS = ["the quick brown fox", WORDS * 2, "a cat", WORDS + "the lazy dog sleeps while the fox"]
MAX_TOKENS = 12


def _provider(monkeypatch, argv):
    """a2ats-server's main up to the point where mlx_lm.server would serve: the provider it built."""
    import mlx_lm.server as mlx_server

    made = []
    monkeypatch.setattr(mlx_server, "run", lambda host, port, provider: made.append(provider)
                        or LRU_SEEN.append(mlx_server.LRUPromptCache))
    rc = a2s.main([str(a) for a in argv])
    return rc, (made[0] if made else None)


LRU_SEEN = []   # the prompt-cache class mlx_lm.server's run would build, each time a2ats-server reached it


@pytest.fixture
def served(files, monkeypatch):
    import mlx_lm.server as mlx_server

    folder, _, cb = files
    rc, provider = _provider(monkeypatch, ["--model", folder, "--codebook", cb, "--window", 4, "--sinks", 2,
                                           "--topk", 3, "--decode-concurrency", 8, "--prompt-concurrency", 4,
                                           "--prefill-step-size", 16])
    assert rc == 0 and provider is not None and provider.is_batchable
    gen = mlx_server.ResponseGenerator(provider, a2s.A2ATSPromptCache(provider.cli_args.prompt_cache_size))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: mlx_server.APIHandler(
        gen, *a, system_fingerprint="test", **k))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield provider, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        gen.stop_and_join()


def complete(url: str, prompt: str, *, usage=None, max_tokens=MAX_TOKENS, stream=False, **extra) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                       **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=HANG_S) as r:
        if stream:   # server-sent events, one text piece each
            events = [json.loads(line[6:]) for line in (x.decode().strip() for x in r)
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return "".join(e["choices"][0].get("text", "") for e in events if e.get("choices"))
        answer = json.loads(r.read())
    if usage is not None:
        usage.update(answer.get("usage", {}))
    return answer["choices"][0]["text"]


def test_concurrent_requests_are_batched_and_each_equals_the_request_alone(served, monkeypatch):
    provider, url = served
    rows = []
    orig = A2ATSBatchCache.decode
    monkeypatch.setattr(A2ATSBatchCache, "decode", lambda self, q, **k: rows.append(len(self.rows)) or orig(self, q, **k))
    answers = [None] * len(PROMPTS)

    def ask(i):
        answers[i] = complete(url, PROMPTS[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_S)
    assert all(a is not None for a in answers), answers
    assert rows and max(rows) > 1, f"the server never batched the A2ATS requests (rows per decode: {set(rows)})"
    usage = {}
    again = complete(url, PROMPTS[1], usage=usage)   # the same prompt: served from the server's prompt cache
    assert usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) > 0, usage
    seeded = complete(url, PROMPTS[3], seed=5)   # a request with a seed: the server runs it alone (not batched)
    assert all(isinstance(c, A2ATSCache) for c in make_prompt_cache(provider.model))
    for p, got in zip(PROMPTS + [PROMPTS[1], PROMPTS[3]], answers + [again, seeded]):
        want = alone(provider, p)
        assert got == want, f"prompt {p[:30]!r}: server {got!r}, alone {want!r}"


def alone(provider, prompt, max_tokens=MAX_TOKENS) -> str:
    model, tok = provider.model, provider.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    return generate(model, tok, ids, max_tokens=max_tokens, prompt_cache=make_prompt_cache(model))


@pytest.mark.parametrize("seed", range(6))
def test_random_request_mixes_answer_as_alone(served, seed):
    """Requests drawn at random (prompts that share starts with each other and with earlier answers, lengths that
    leave one-token prefill chunks, streamed or not, different max_tokens) sent at random moments: how the
    server batches, chunks and reuses caches never changes an answer."""
    provider, url = served
    rng = random.Random(seed)
    pool = PROMPTS + [WORDS[:rng.randrange(3, 80)] for _ in range(3)] + [WORDS * 2 + WORDS[:rng.randrange(1, 40)]]
    jobs = [(rng.choice(pool), rng.randrange(1, MAX_TOKENS + 2), rng.random() < 0.5, rng.uniform(0, 0.3))
            for _ in range(6)]
    answers = [None] * len(jobs)

    def ask(i):
        p, n, stream, delay = jobs[i]
        time.sleep(delay)
        answers[i] = complete(url, p, max_tokens=n, stream=stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_S)
    for (p, n, stream, _), got in zip(jobs, answers):
        assert got == alone(provider, p, n), f"prompt {p[:30]!r} ({len(p)} tokens, max_tokens {n}, stream {stream})"


@pytest.mark.parametrize("later", [PROMPTS[3], PROMPTS[0] + " "], ids=["longer", "one-token-more"])
def test_a_prompt_that_shares_an_earlier_prompts_start_answers_as_alone(served, later):
    """The server hands the later prompt the earlier request's cache trimmed back to their shared start, the
    earlier prompt, and prefills the rest from there: in other chunks than alone, one of them possibly a single
    token. Every prompt token gets dense attention however it is chunked (runtime.prompt), so the answer is
    the one the prompt gets alone; with one token more, that token is the prompt's last, a prompt token too."""
    provider, url = served
    first = PROMPTS[0]
    complete(url, first)
    usage = {}
    got = complete(url, later, usage=usage)
    assert got == alone(provider, later), "the server's answer depends on the request before it"
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached == len(provider.tokenizer.encode(first)), usage


def test_a_chat_turn_after_an_answer_reuses_only_the_prefilled_prompt(served):
    """A next turn extends the earlier prompt and its answer: the nearest cache holds them all, and the server's
    prompt cache hands it out only up to the tokens no retrieval decode produced: the earlier prompt."""
    provider, _ = served
    model, tok = provider.model, provider.tokenizer
    prompt = tok.encode(PROMPTS[0])
    cache = make_prompt_cache(model)
    answer = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS, prompt_cache=cache)]
    held = prompt + answer                 # generate_step has run the model on its last answer token too
    assert cache[0].offset == len(held) and cache[0].prefilled == len(prompt)
    lru = a2s.A2ATSPromptCache(4)
    lru.insert_cache(provider.model_key, held, cache)
    turn = held + tok.encode(" and then")
    got, rest = lru.fetch_nearest_cache(provider.model_key, turn)
    assert got[0].offset == len(prompt) and rest == turn[len(prompt):]
    out = generate(model, tok, rest, max_tokens=MAX_TOKENS, prompt_cache=got)
    assert out == alone(provider, turn)


def test_bad_codebook_and_unsupported_flags_stop_before_serving(files, tmp_path, monkeypatch, capsys):
    folder, other, cb = files
    rc, provider = _provider(monkeypatch, ["--model", folder, "--codebook", tmp_path / "none.safetensors"])
    assert rc == 2 and provider is None and "none.safetensors" in capsys.readouterr().err
    rc, provider = _provider(monkeypatch, ["--model", other, "--codebook", cb])
    err = capsys.readouterr().err
    assert rc == 2 and provider is None and str(cb) in err and "weights_fingerprint" in err, err
    rc, provider = _provider(monkeypatch, ["--model", folder, "--codebook", cb, "--kv-bits", 4])
    assert rc == 2 and "--kv-bits" in capsys.readouterr().err


def test_the_server_runs_with_the_a2ats_prompt_cache(files, monkeypatch):
    import mlx_lm.server as mlx_server

    folder, _, cb = files
    before = mlx_server.LRUPromptCache
    rc, provider = _provider(monkeypatch, ["--model", folder, "--codebook", cb])
    assert rc == 0 and LRU_SEEN[-1] is a2s.A2ATSPromptCache and mlx_server.LRUPromptCache is before


def test_help_lists_both_flag_sets(capsys):
    assert a2s.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--codebook" in out and "--decode-concurrency" in out
