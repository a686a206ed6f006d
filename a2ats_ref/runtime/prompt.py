"""PREFILL and RET-DECODE in mlx-lm's flow: which of an A2ATSCache's tokens are prompt tokens (dense attention)
and which are generated (retrieval), and how many leading tokens hold what a prefill gives them.

In the authors' code the whole prompt is one forward pass, so every prompt token gets dense attention and only
generated tokens are decoded by retrieval (``vqkey/models/llama_masked.py``: retrieval when ``q_len == 1``).
mlx-lm feeds a prompt in chunks (``prefill_step_size``) and evaluates every cache's ``state`` after each; a chunk
may hold a single token, and the prompt's last token always comes alone, in the step that samples the first
answer token. Taken by their length, those tokens would be decoded by retrieval, so an answer would depend on
how its prompt was chunked, batched, or started from a reused cache.

The cache therefore keeps a mark: the first token appended after its state was evaluated, after a trim back to
where a prompt began, or after ``start_prompt`` is a prompt token (``newest_is_prompt``), and the hook gives it
dense attention (``attend_prompt_token``). Tokens appended with no evaluation before them are generated:
RET-DECODE. That includes the first append into an empty or restored cache, so a caller that appends and then
decodes (the conformance suite's protocol) decodes by retrieval; for a one-token first prompt the two agree
anyway (attention over one token is its value). A loop that evaluated ``cache.state`` after every decode step
would make every step a prompt token; mlx-lm evaluates it after prompt chunks only, so a long run of one-token
prompt tokens warns once per process (PROMPT_RUN_WARNING).

``prefilled``: tokens ``[0, prefilled)`` were appended before any retrieval decode answered a query of theirs.
A decoded token attended only to its selection, so at every layer above it its keys and values differ from a
prefill's: a server that reused them for another prompt would answer that prompt differently from a fresh cache.
"""

from __future__ import annotations

import warnings
from typing import Optional

import mlx.core as mx

from a2ats_ref.retrieval import attention_scale

__all__ = ["appended", "attend_newest", "attend_prompt_token", "cleared", "copy_marks", "decoded", "evaluated", "marks",
           "restored", "set_marks", "trimmed", "PROMPT_RUN", "PROMPT_RUN_WARNING"]

#: one-token prompt tokens in a row that warn: mlx-lm's chunked prefill gives at most two (a one-token chunk,
#: then the prompt's last token) unless its prefill_step_size is 1
PROMPT_RUN = 64
PROMPT_RUN_WARNING = (
    f"A2ATS: {PROMPT_RUN} one-token steps in a row were prompt tokens and got dense attention, because the cache's "
    "state was evaluated before each (mlx-lm does that after prompt chunks only). If these are generated tokens, "
    "evaluate the logits, not cache.state, between steps, or A2ATS retrieval never runs; a prompt fed one token "
    "at a time may ignore this."
)
_warned = [False]   # once per process


def cleared(cache) -> None:
    """An empty cache: no mark, nothing prefilled."""
    cache._prompt_next, cache._newest_is_prompt, cache._prompt_starts, cache._prefilled = False, False, [], 0
    cache._prompt_run = 0


def appended(cache, prev: int) -> None:
    """After tokens [prev, offset) were appended: the newest is a prompt token when the mark was set."""
    if cache.offset == prev:   # an empty append (mlx-lm's KVCache takes one): nothing to mark
        return
    if cache._prompt_next:
        cache._prompt_starts.append(prev)   # what a trim back to prev restores
    cache._newest_is_prompt, cache._prompt_next = cache._prompt_next, False
    if cache._prefilled == prev:
        cache._prefilled = cache.offset
    cache._prompt_run = cache._prompt_run + 1 if cache._newest_is_prompt and cache.offset - prev == 1 else 0
    if cache._prompt_run >= PROMPT_RUN and not _warned[0]:
        _warned[0] = True
        warnings.warn(PROMPT_RUN_WARNING, UserWarning, stacklevel=4)


def decoded(cache) -> None:
    """A retrieval decode answered the newest token's query."""
    cache._prefilled = min(cache._prefilled, cache.offset - 1)


def trimmed(cache) -> None:
    """After a trim to offset: the mark as it was before the dropped tokens were appended (a rejected speculative
    token is followed by a decode, a prompt's dropped chunk by the prompt)."""
    cache._prefilled = min(cache._prefilled, cache.offset)
    cache._prompt_next = cache.offset in cache._prompt_starts
    cache._prompt_starts = [s for s in cache._prompt_starts if s < cache.offset]


def evaluated(cache) -> None:
    """mlx-lm evaluated the cache's state, as it does after each prompt chunk: the next token is a prompt's."""
    cache._prompt_next = True


def restored(cache) -> None:
    """Rebuilt from a state, which does not say which tokens a decode produced: as an empty cache (no mark, none
    claimed prefilled). A cache file keeps the marks (``marks``)."""
    cleared(cache)


def copy_marks(src, dst) -> None:
    dst._prompt_next, dst._newest_is_prompt = src._prompt_next, src._newest_is_prompt
    dst._prompt_starts, dst._prefilled, dst._prompt_run = list(src._prompt_starts), src._prefilled, src._prompt_run


def marks(cache) -> dict:
    """The marks as a cache file keeps them (JSON: ints and a bool)."""
    return {"prefilled": int(cache._prefilled), "prompt_next": bool(cache._prompt_next),
            "prompt_starts": [int(s) for s in cache._prompt_starts]}


def set_marks(cache, prefilled: int, prompt_next: bool, prompt_starts: list) -> None:
    """Marks read back from a file (checked by the caller)."""
    cache._prefilled, cache._prompt_next, cache._prompt_starts = prefilled, prompt_next, list(prompt_starts)
    cache._prompt_run = 0


def attend_newest(cache, queries: mx.array, scale: Optional[float]) -> mx.array:
    """The newest token's attention, queries (B, n_q, 1, d) -> (B, n_q, 1, dv): PREFILL's dense attention for a
    prompt token, RET-DECODE (cache.decode) for a generated one. The hook and each row of a batch take it here."""
    if cache.newest_is_prompt:
        return attend_prompt_token(cache, queries, scale)
    return cache.decode(queries, scale=scale)


def attend_prompt_token(cache, queries: mx.array, scale: Optional[float]) -> mx.array:
    """PREFILL for the newest token alone: dense attention of queries (B, n_q, 1, d) over every cached token ->
    (B, n_q, 1, dv), what the hook's mlx-lm path computes for it inside a longer chunk."""
    cache._undecoded = False
    k, v = cache.keys_and_values()
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=attention_scale(scale, k.shape[-1]), mask=None)
