"""CACHE-DECODE — an A2ATSCache's decode step: RET-DECODE for its newest token, over its own buffers.

The query is the newest token's post-RoPE query at position offset - 1, appended already (mlx-lm calls
update_and_fetch first). Scores read the codes of tokens j < offset - w only (the window is always attended), so
the pending tokens are coded together once the oldest of them reaches that range: about once every w + 1 tokens.
The step (``dispatch.decode_step_fast``) reads the preallocated buffers directly, ``n_tokens`` marking the valid
prefix, so no sliced copy of keys, values or codes is made per step.

With the model's own RoPE (``cache.fast_rope``), EQ-12's de-rotation of the query undoes the angle mx.fast.rope
gave it on this device (``query_angle``), as the keys' codes undo theirs.

The step goes through the cache's ``_assign_pending`` and ``_query_angle``, so a subclass or a test that replaces
either sees every decode.
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.retrieval import attention_scale, gqa_group
from a2ats_ref.rope import applied_cos_sin
from a2ats_ref.runtime import prompt
from a2ats_ref.runtime.decode.dispatch import decode_step_fast
from a2ats_ref.runtime.threads import ThreadState

__all__ = ["decode", "query_angle"]

#: per thread, (position, d, traditional, rope, device) -> (cos, sin, rope) of the query angle, shared by the layers;
#: per thread, because a lazy array made in one thread fails in another
_QUERY_ANGLES = ThreadState()


def decode(cache, queries: mx.array, scale=None) -> mx.array:
    """Queries (B, n_q, 1, d) -> (B, n_q, 1, dv) in the value dtype; records the selection in cache._last_selection."""
    if cache.keys is None or cache.offset == 0:
        raise ValueError("decode: the cache is empty; append the query's own key/value first (update_and_fetch)")
    cb, cfg = cache.codebook, cache.config
    if not isinstance(queries, mx.array) or queries.dtype not in checks.FLOAT_DTYPES:
        got = queries.dtype if isinstance(queries, mx.array) else type(queries).__name__
        raise ValueError(f"queries: expected a float16, bfloat16 or float32 mx.array, got {got}")
    if (queries.ndim != 4 or queries.shape[2] != 1 or queries.shape[0] != cache.keys.shape[0]
            or queries.shape[3] != cb.head_dim):
        raise ValueError(
            f"queries: expected (B={cache.keys.shape[0]}, n_q, 1, {cb.head_dim}) post-RoPE, "
            f"got {tuple(queries.shape)}"
        )
    gqa_group(queries.shape[1], cb.n_kv_heads)
    # everything else was validated when the cache was built or appended to: no clause-level checks (and their
    # host syncs) here
    cache._assign_pending(cache.offset - cfg.w)
    cache._undecoded = False
    out, cache._last_selection = decode_step_fast(
        queries, cache.keys, cache.values, cache.codes, cb.CT, query_pos=cache.offset - 1, b=cfg.b, w=cfg.w,
        sinks=cfg.sinks, topk=cfg.topk, inv_freqs=cache.inv_freqs, traditional=cache.traditional,
        scale=attention_scale(scale, cb.head_dim), n_tokens=cache.offset, return_selection=True,
        applied_angle=cache._query_angle(), method=cache.select_method,
        code_counts=None if cache._counts is None else (cache._counts_array(), cache._coded),
    )
    prompt.decoded(cache)   # the newest token's query was answered by retrieval: it is not prefilled
    return out


def query_angle(cache):
    """(cos, sin) (d/2,) of the angle mx.fast.rope gave the newest query, when the model's rope is known.

    Every layer of a model decodes the same position with the same rope, so the tables are made once per
    position and shared (_QUERY_ANGLES): rebuilding them cost each layer ~0.25 ms of small MLX ops
    (SmolLM2 shapes at 16K, 30 layers per token)."""
    if cache.fast_rope is None:
        return None
    d, pos, fr = cache.codebook.head_dim, cache.offset - 1, cache.fast_rope
    # freqs by identity: the entry keeps the array alive, so its id cannot name another array meanwhile
    rope = ("freqs", id(fr["freqs"])) if "freqs" in fr else (fr["base"], fr["scale"])
    key = (pos, d, cache.traditional, rope, str(mx.default_device()))
    angles = _QUERY_ANGLES.__dict__
    if key not in angles:
        if next(iter(angles), (None,))[0] != pos:
            angles.clear()   # only the current position's tables are kept
        c, s = applied_cos_sin(mx.array([pos]), d, cache.traditional, fr)
        angles[key] = (c[0], s[0], fr)
    return angles[key][:2]
