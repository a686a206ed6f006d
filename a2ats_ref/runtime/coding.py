"""CACHE-FAR-CODES — an A2ATSCache's codes: one z-space code per token and KV head, assigned once, and their counts.

A token's code is the nearest z-space codeword of its position-free key: EQ-12 de-rotation of the cached post-RoPE
key at the token's own position, then EQ-16 assignment z = k L -> nearest row of Cz (the EQ-14 query-aware
assignment, in z-space). Nothing already coded is re-rotated.

Coding is deferred: tokens [0, cache._coded) have their code in ``cache.codes``, the rest are pending. A code
does not depend on when it is computed, so every clause sees the same codes as with eager assignment; the cache
chooses when (a prefill chunk as it is appended, decode tokens in batches as they leave the window).

``cache._counts`` (B, n_kv, K) int32 NumPy holds how many coded tokens carry each code (what RET-DECODE's sort-free
step walks instead of sorting T tokens); ``cache._counts_mx`` is its mx copy, made when a decode reads it.

The functions take the cache and go through its ``_count_codes`` for every change of the counts, so a subclass or
a test that replaces that method sees each one.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import numpy as np

from a2ats_ref.eq12_far_keys import far_keys_unchecked
from a2ats_ref.eq16_z_transform import assign_z_unchecked
from a2ats_ref.rope import applied_cos_sin, rotate_by_tables

__all__ = ["assign_codes", "assign_pending", "count_codes", "count_rows", "counts_array", "forget_trimmed",
           "recount"]


def count_rows(codes: np.ndarray, K: int) -> np.ndarray:
    """(..., n) codes -> (..., K) int32: how many of each row's n codes equal each of 0..K-1 (fast_decode.code_counts
    on the host: one bincount for all rows, each row offset by row * K)."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    rows = math.prod(lead)
    flat = codes.reshape(rows, n).astype(np.intp) + (np.arange(rows, dtype=np.intp) * K)[:, None]
    return np.bincount(flat.reshape(-1), minlength=rows * K).astype(np.int32).reshape(lead + (K,))


def assign_codes(k_post: mx.array, positions: mx.array, codebook, inv_freqs, *, traditional: bool,
                 fast_rope: Optional[dict] = None, host: bool = False):
    """CACHE codes: EQ-12 de-rotation of post-RoPE keys at their own positions, then EQ-16 assignment.

    k_post (B, n_kv, t, d) post-RoPE keys, positions (t,) or a range, codebook a CodebookLayer -> codes
    (B, n_kv, t) in the CODES-DTYPE dtype. Work is O(t): only the given tokens are touched. Same result as
    assign_z(far_keys(k_post, positions, ...), Cz, L); it calls their unchecked kernels because the
    checks cost host syncs on every token and the cache has validated its inputs already.
    fast_rope (rope.fast_rope_args of the model's rope module): undo the angles mx.fast.rope applied on this
    device (rope.applied_cos_sin) instead of m * inv_freqs; they differ on MLX CUDA at long positions.
    host=True: the codes come back as a NumPy array (assign_z_unchecked).
    """
    f32 = mx.float32
    if fast_rope is not None:
        c, s = applied_cos_sin(positions, k_post.shape[-1], traditional, fast_rope)
        k_pre = rotate_by_tables(k_post.astype(f32), c, s, traditional, -1.0)
    else:
        if isinstance(positions, range):
            positions = mx.arange(positions.start, positions.stop)
        k_pre = far_keys_unchecked(k_post.astype(f32), positions.astype(f32), inv_freqs, traditional=traditional)
    return assign_z_unchecked(k_pre, codebook.Cz, codebook.L, codebook.z_operands, host=host)  # per-head (n_kv, K, d)


def assign_pending(cache, upto: int) -> None:
    """Make sure tokens [0, upto) have codes: if any is pending, code every pending token (one batch per
    cache.CODE_BATCH_MAX tokens).

    Codes read the cached post-RoPE keys at their own positions (EQ-12, EQ-16), exactly as on append.
    The per-code counts gain the new batch's codes, counted on the host from the codes as they come
    back from the argmin (no MLX scatter, no extra sync).
    """
    if cache._coded >= min(upto, cache.offset):
        return
    for s in range(cache._coded, cache.offset, cache.CODE_BATCH_MAX):
        e = min(s + cache.CODE_BATCH_MAX, cache.offset)
        codes = assign_codes(cache.keys[..., s:e, :], range(s, e), cache.codebook, cache.inv_freqs,
                             traditional=cache.traditional, fast_rope=cache.fast_rope, host=True)
        cache.codes[..., s:e] = mx.array(codes)
        cache._count_codes(codes, +1)
    cache._coded = cache.offset


def count_codes(cache, codes: np.ndarray, sign: int) -> None:
    """Add (sign +1) or remove (-1) host codes (B, n_kv, n) to the cache's per-code counts."""
    if cache._counts is None:
        cache._counts = np.zeros(cache.codes.shape[:2] + (cache.codebook.K,), dtype=np.int32)
    if codes.shape[-1]:
        cache._counts += sign * count_rows(codes, cache.codebook.K)
        cache._counts_mx = None


def counts_array(cache) -> Optional[mx.array]:
    """The counts as the mx.array decode_step_fast reads (copied once after each change)."""
    if cache._counts is not None and cache._counts_mx is None:
        cache._counts_mx = mx.array(cache._counts)
    return cache._counts_mx


def forget_trimmed(cache) -> None:
    """After a trim to cache.offset: the coded tokens past it leave the counts and become uncoded."""
    if cache._coded > cache.offset:
        cache._count_codes(np.array(cache.codes[..., cache.offset:cache._coded]), -1)
        cache._coded = cache.offset


def recount(cache) -> None:
    """Every token of restored codes (B, n_kv, T) is coded: counts recounted from them, not saved (so the file
    format carries none; an empty host copy is avoided because MLX CUDA 0.32 segfaults on those)."""
    codes = cache.codes
    cache._coded = codes.shape[2]
    cache._counts = (count_rows(np.array(codes), cache.codebook.K) if codes.shape[2]
                     else np.zeros(codes.shape[:2] + (cache.codebook.K,), np.int32))
    cache._counts_mx = None
