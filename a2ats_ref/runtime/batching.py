"""CACHE-BATCH — A2ATS under mlx-lm's batch generation (BatchGenerator, batch_generate, mlx_lm.server).

mlx-lm batches sequences of different lengths by merging one cache per sequence into a batch cache
(`merge`), right-padding the prompts of one prefill call (`prepare(lengths=, right_padding=)` ...
`finalize()`), dropping finished rows (`filter`), adding new ones (`extend`) and handing a row's cache
back (`extract`). `A2ATSBatchCache` answers that protocol by keeping every row as its own batch-of-one
A2ATSCache: a row's tokens sit at their own positions 0..n-1 and are coded there, the pads of a
right-padded prefill are never stored, and a decode runs RET-DECODE row by row (dense attention for a row whose
newest token is its prompt's last: runtime.prompt). So each row is exactly
the cache the same sequence would have alone (CACHE-BATCH's row rule, for rows of any length).

The model still sees one batch: `offset` is the (B,) array of row lengths (the RoPE offset of the next
token of each row), `update_and_fetch` returns the rows left-padded into one (B, n_kv, T, d) block with
`make_mask` masking the padding, which is what a dense attention reads (prefill, and models without
the hook). The decode hook ignores that block and calls `decode` (a2ats_ref.hook).

Refused, with a ValueError: left padding added by `prepare` (mlx-lm's BatchGenerator right-pads), a
sliding-window mask, and rows that are themselves batches of more than one sequence.

`a2ats_ref.runtime.hook.install_a2ats_cache(model, codebook, config)` makes mlx-lm's `make_prompt_cache(model)`
build A2ATS caches, which is how BatchGenerator and mlx_lm.server create a cache per request.

This module does not import the cache: A2ATSCache calls it (merge, deepcopy, state) with its own class.
"""

from __future__ import annotations

import numbers
import sys
from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache
from mlx_lm.models import cache as mlx_cache

from a2ats_ref.runtime import prompt

__all__ = ["A2ATSBatchCache", "copy_cache", "merge", "refuse_mlx_lm_save", "MLX_LM_SAVE_REFUSAL"]

#: what mlx-lm's save_prompt_cache meets on an A2ATS cache (see refuse_mlx_lm_save)
MLX_LM_SAVE_REFUSAL = (
    "mlx-lm's save_prompt_cache cannot save an A2ATS cache: it stores no codebook, config or RoPE layout, and "
    "its load_prompt_cache cannot rebuild A2ATSCache. Use a2ats_ref.cache_io.save_a2ats_cache(path, caches) "
    "and load_a2ats_cache(path, codebook)"
)

_SAVE_CODE = []   # the code object of mlx-lm's save_prompt_cache, looked up once


def refuse_mlx_lm_save() -> None:
    """Raise ValueError (MLX_LM_SAVE_REFUSAL) when called, through `state`, from mlx-lm's save_prompt_cache.

    That function would write the arrays and succeed, and the file could then never be loaded
    (load_prompt_cache raises KeyError: 'A2ATSCache'). It reads `state` first, before writing anything,
    so refusing there leaves no file behind.
    """
    if not _SAVE_CODE:
        _SAVE_CODE.append(mlx_cache.save_prompt_cache.__code__)
    f = sys._getframe(2)   # 0: here, 1: the state getter; then the caller (a list comprehension on 3.11)
    for _ in range(3):
        if f is None:
            return
        if f.f_code is _SAVE_CODE[0]:
            raise ValueError(MLX_LM_SAVE_REFUSAL)
        f = f.f_back


def copy_cache(cache):
    """An independent copy of an A2ATSCache that shares its codebook, config and RoPE tables.

    copy.deepcopy (mlx-lm's prompt-cache LRU copies every cache it hands out) would otherwise copy the
    layer's codebook too, which is as large as the cache of thousands of tokens. Buffers become new
    array objects: a write to one cache (slice assignment) never shows in the other.
    """
    new = type(cache)(cache.codebook, cache.inv_freqs, cache.traditional, cache.config, fast_rope=cache.fast_rope)
    for k, v in cache.__dict__.items():   # instance settings (select_method, ...) a copy keeps
        if k not in new.__dict__:
            new.__dict__[k] = v
    for k in ("keys", "values", "codes"):
        a = getattr(cache, k)
        setattr(new, k, None if a is None else mx.array(a))
    new.offset, new._coded = cache.offset, cache._coded
    prompt.copy_marks(cache, new)
    new._counts = None if cache._counts is None else cache._counts.copy()
    new._counts_mx = cache._counts_mx          # replaced, never written in place
    new._last_selection = cache._last_selection
    return new


def _rows_of(caches, row_type) -> list:
    rows = []
    for i, c in enumerate(caches):
        if isinstance(c, A2ATSBatchCache):
            rows.extend(copy_cache(r) for r in c.rows)
            continue
        if not isinstance(c, row_type):
            raise ValueError(f"caches[{i}]: expected an {row_type.__name__} (one sequence), got {type(c).__name__}; a batch "
                             "mixes A2ATS and other caches in one layer only if every sequence uses A2ATS there")
        if c.keys is not None and c.offset and c.keys.shape[0] != 1:
            raise ValueError(f"caches[{i}]: holds a batch of {c.keys.shape[0]} sequences; mlx-lm merges one cache "
                             "per sequence (batch size 1)")
        rows.append(copy_cache(c))
    return rows


def merge(caches, row_type=None) -> "A2ATSBatchCache":
    """One A2ATSBatchCache from one cache per sequence (copies: the inputs are left as they were).

    row_type: the class every sequence's cache must be (A2ATSCache passes itself); default: the first's."""
    caches = list(caches)
    if not caches:
        raise ValueError("caches: expected at least one cache to merge")
    if row_type is None:
        first = caches[0]
        row_type = type(first.rows[0]) if isinstance(first, A2ATSBatchCache) and first.rows else type(first)
    return A2ATSBatchCache(_rows_of(caches, row_type))


class A2ATSBatchCache(_BaseCache):
    """A batch of sequences of any lengths, one A2ATSCache per row; see the module docstring."""

    def __init__(self, rows):
        self.rows = list(rows)
        self._real = None   # right padding: real tokens still to come per row in this prefill (prepare)

    # ---- what the model reads
    @property
    def offset(self) -> mx.array:
        """(B,) int32: the RoPE position of each row's next token (its length)."""
        return mx.array([r.offset for r in self.rows], dtype=mx.int32)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """The causal mask over `update_and_fetch`'s left-padded block (None or "causal" when no row is padded)."""
        if window_size is not None:
            raise ValueError("A2ATS: sliding-window attention layers are not supported (window_size given)")
        lengths = [r.offset for r in self.rows]
        longest = max(lengths, default=0)
        if not return_array and self._real is None and all(n == longest for n in lengths):
            return None if N == 1 else "causal"
        return create_causal_mask(N, longest, left_padding=mx.array([longest - n for n in lengths]))

    def update_and_fetch(self, keys, values):
        B, t = keys.shape[0], keys.shape[2]
        if B != len(self.rows):
            raise ValueError(f"keys: batch size {B} differs from the {len(self.rows)} sequences of this batch cache")
        before = [r.offset for r in self.rows]
        longest = max(before)
        ks, vs = [], []
        for i, r in enumerate(self.rows):
            n = t
            if self._real is not None:   # the rest of this row's chunk is right padding: never stored
                n = min(t, self._real[i])
                self._real[i] -= n
            if n:
                r.update_and_fetch(keys[i:i + 1, :, :n], values[i:i + 1, :, :n])
            # the row's tokens after this write, then its pads of this chunk, left-padded to the longest row
            k_row, v_row = r.keys_and_values() if r.offset else (keys[i:i + 1, :, :0], values[i:i + 1, :, :0])
            parts_k, parts_v = [k_row, keys[i:i + 1, :, n:]], [v_row, values[i:i + 1, :, n:]]
            pad = longest - before[i]
            if pad:
                parts_k.insert(0, mx.zeros(k_row.shape[:2] + (pad, k_row.shape[3]), k_row.dtype))
                parts_v.insert(0, mx.zeros(v_row.shape[:2] + (pad, v_row.shape[3]), v_row.dtype))
            ks.append(mx.concatenate(parts_k, axis=2))
            vs.append(mx.concatenate(parts_v, axis=2))
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)

    def decode(self, queries: mx.array, *, scale: Optional[float] = None) -> mx.array:
        """Each row's newest token: RET-DECODE, or PREFILL's dense attention where it is a prompt token (the
        row's newest_is_prompt: a row joins generation with its prompt's last token while the others decode):
        queries (B, n_q, 1, d) -> (B, n_q, 1, dv)."""
        if queries.ndim != 4 or queries.shape[0] != len(self.rows):
            raise ValueError(f"queries: expected (B={len(self.rows)}, n_q, 1, d), got {tuple(queries.shape)}")
        return mx.concatenate([prompt.attend_newest(r, queries[i:i + 1], scale) for i, r in enumerate(self.rows)],
                              axis=0)

    # ---- mlx-lm's batching protocol
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and any(int(p) for p in _as_list(left_padding)):
            raise ValueError("A2ATS batch caches take right padding (mlx-lm's prepare(lengths=, right_padding=)); "
                             "left padding would shift every row's RoPE positions")
        if right_padding is not None and any(int(p) for p in _as_list(right_padding)):
            if lengths is None or len(_as_list(lengths)) != len(self.rows):
                raise ValueError(f"lengths: expected one prompt length per row ({len(self.rows)}) with right_padding")
            self._real = [int(n) for n in _as_list(lengths)]

    def finalize(self):
        if self._real is not None and any(self._real):
            left = self._real
            self._real = None
            raise ValueError(f"finalize: rows still expected {left} prompt tokens; prepare's lengths were longer "
                             "than the tokens processed")
        self._real = None

    def filter(self, batch_indices):
        self.rows = [self.rows[i] for i in _as_list(batch_indices)]

    def extend(self, other):
        if not isinstance(other, A2ATSBatchCache):
            raise ValueError(f"other: expected an A2ATSBatchCache, got {type(other).__name__}")
        self.rows.extend(other.rows)

    def extract(self, idx):
        """A copy of row idx as a batch-of-one A2ATSCache (the row keeps generating here)."""
        return copy_cache(self.rows[int(idx)])

    @classmethod
    def merge(cls, caches) -> "A2ATSBatchCache":
        return merge(caches)

    # ---- cache bookkeeping
    @property
    def state(self):
        refuse_mlx_lm_save()
        return tuple(r.state for r in self.rows)

    @state.setter
    def state(self, v):
        raise ValueError("A2ATSBatchCache: build a batch with A2ATSCache.merge(caches), not from a state")

    @property
    def meta_state(self):
        return tuple(r.meta_state for r in self.rows)

    def size(self):
        return max((r.offset for r in self.rows), default=0)

    def empty(self):
        return all(r.empty() for r in self.rows)

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens of every row; returns the most any row dropped."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"trim: n must be a non-negative int (tokens to drop from the end), got {n!r}")
        return max((r.trim(n) for r in self.rows), default=0)

    @property
    def nbytes(self):
        return sum(r.nbytes for r in self.rows)

    @property
    def last_selection(self):
        """Per row, the bool (1, n_kv, T_row) mask of its last decode (None before one)."""
        return [r.last_selection for r in self.rows]

    def __repr__(self):
        return f"A2ATSBatchCache(rows={len(self.rows)}, lengths={[r.offset for r in self.rows]})"


def _as_list(x) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)
