"""CACHE-CHUNK — an A2ATSCache's buffers: keys, values and codes, grown and written as mlx-lm's KVCache grows its own.

Appended tokens go to [offset, offset + t) by slice assignment into buffers preallocated in steps of
``cache.step`` (256) tokens, so a chunked prefill leaves exactly the arrays of a one-shot prefill. The code buffer
(CODES-DTYPE's dtype for the codebook's K) grows with the keys; a token's slot in it is written when the token is
coded (runtime.coding). An empty cache (nothing appended, or trimmed to 0) takes any batch size: its buffers
start afresh.
"""

from __future__ import annotations

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.runtime import coding

__all__ = ["append", "check_kv", "clear", "restore", "valid"]


def clear(cache) -> None:
    """No buffers, no tokens, no codes or counts."""
    cache.keys = cache.values = cache.codes = cache._counts = cache._counts_mx = None
    cache.offset = cache._coded = 0


def check_kv(cache, keys, values) -> None:
    """INPUT-ERRORS for an append: float arrays (B, n_kv, t, d) of the codebook's shape and the cached batch size."""
    cb = cache.codebook
    for name, a in (("keys", keys), ("values", values)):
        if not isinstance(a, mx.array) or a.dtype not in checks.FLOAT_DTYPES:
            got = a.dtype if isinstance(a, mx.array) else type(a).__name__
            raise ValueError(f"{name}: expected a float16, bfloat16 or float32 mx.array (as mlx-lm passes), got {got}")
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys/values: expected (B, n_kv_heads, T, head_dim) arrays with matching leading dims, got "
            f"{tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if keys.shape[1] != cb.n_kv_heads or keys.shape[3] != cb.head_dim:
        raise ValueError(
            f"keys: shape {tuple(keys.shape)} does not match the codebook (n_kv_heads={cb.n_kv_heads}, "
            f"head_dim={cb.head_dim}); use the codebook calibrated for this model"
        )
    if cache.keys is not None and cache.offset and keys.shape[0] != cache.keys.shape[0]:
        raise ValueError(f"keys: batch size {keys.shape[0]} differs from the cached batch size {cache.keys.shape[0]}")


def append(cache, keys, values) -> None:
    """Write t checked tokens at [offset, offset + t), growing the buffers first when they are full."""
    prev, t = cache.offset, keys.shape[2]
    if cache.keys is not None and prev == 0 and keys.shape[0] != cache.keys.shape[0]:
        # empty with another batch size: fresh buffers, rather than let the old ones broadcast the new batch into
        # the wrong shape (nothing cached is lost)
        clear(cache)
    if cache.keys is None or prev + t > cache.keys.shape[2]:
        _grow(cache, keys, values, prev, t)
    if t == 0:  # mlx-lm's KVCache accepts an empty append; so do we
        return
    cache.offset += t
    cache.keys[..., prev : cache.offset, :] = keys
    cache.values[..., prev : cache.offset, :] = values


def _grow(cache, keys, values, prev, t) -> None:
    B, n_kv, _, dk = keys.shape
    n = (cache.step + t - 1) // cache.step * cache.step
    new_k = mx.zeros((B, n_kv, n, dk), keys.dtype)
    new_v = mx.zeros((B, n_kv, n, values.shape[3]), values.dtype)
    new_c = mx.zeros((B, n_kv, n), mx_code_dtype(cache.codebook.K))
    if cache.keys is None:
        cache.keys, cache.values, cache.codes = new_k, new_v, new_c
        return
    if prev % cache.step != 0:
        cache.keys, cache.values, cache.codes = cache.keys[..., :prev, :], cache.values[..., :prev, :], cache.codes[..., :prev]
    cache.keys = mx.concatenate([cache.keys, new_k], axis=2)
    cache.values = mx.concatenate([cache.values, new_v], axis=2)
    cache.codes = mx.concatenate([cache.codes, new_c], axis=2)


def valid(cache):
    """The cached keys and values, (B, n_kv, offset, d): the buffers' valid prefix (the buffers themselves when full)."""
    if cache.offset < cache.keys.shape[2]:
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    return cache.keys, cache.values


def restore(cache, state) -> None:
    """Set the buffers from mlx-lm's `state` (keys, values, codes), every token coded; () or None empties them."""
    if state is None or len(state) == 0:
        clear(cache)
        return
    keys, values, codes = state
    if codes.shape != keys.shape[:3] or values.shape[:3] != keys.shape[:3]:
        raise ValueError(
            f"state: expected keys (B, n_kv, T, d), values (B, n_kv, T, dv), codes (B, n_kv, T); got "
            f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(codes.shape)}"
        )
    cache.keys, cache.values, cache.codes = keys, values, codes
    cache.offset = keys.shape[2]
    coding.recount(cache)
    cache._last_selection = None
