"""RET-DECODE — the runtime decode step: one A2ATS decode-attention step in mlx-lm's layout.

This is the kernel A2ATSCache.decode runs on every generated token. Same result as the clause function
``retrieval.decode_step`` / ``a2ats_spec.oracle.decode_step`` (same selected set up to near ties, same
output to float tolerance), engineered for speed on MLX's CPU backend:

* the query is moved to R_b by the EQ-12 kernel (``far_query_unchecked``: undo the float32 angle
  mlx-lm applied at ``query_pos``, then apply b), so the LUT sees the same q_b as ``decode_step``;
* no copy of the cache: keys/values are read only by a row gather from the flattened cache buffer
  (``n_tokens`` lets the caller pass its preallocated buffer instead of a sliced, copied view);
* the LUT is one batched matmul against a pre-transposed codebook (``prepare_codebook``);
* token scores are a ``take_along_axis`` of the LUT by codes over the candidate range only;
* per-head top-k is ``argpartition``; the GQA union is the concatenation of the group's top-k index
  lists, with duplicates removed by an "owner" scatter (each token keeps exactly one slot; the others
  are masked to -inf), because an exact softmax over a multiset is not the softmax over the set;
* exact softmax attention (float32) over the gathered post-RoPE keys/values, gathered in the cache's own
  dtype and cast to float32 block by block (no full-cache or full-selection cast: float16/bfloat16 read
  half the bytes and cost no more than float32); on the CPU's host-selection path the softmax itself runs in
  NumPy between two compiled graphs (``softmax_host``: MLX's CPU exp is a scalar loop), and float16 rows
  are converted by integer ops with 2^112 folded into the other operand (``float16_scaled_rows``: MLX's CPU
  float16 cast is a software conversion), bit for bit the same result;
* everything but the host-side parameter work is one ``mx.compile``d graph per static shape, and
  ``b`` and ``query_pos`` enter as data so decoding does not recompile every token;
* the selected set is returned lazily (``Selection``): the cache keeps it and builds the bool mask
  only when someone asks for ``last_selection``.

Three selection methods (``method=``): "host" (NumPy, exact top-k with the oracle's lowest-index tie rule),
"mlx" (in-graph ``argpartition`` over T scores) and "sortfree", which never sorts T tokens and is what
"auto" takes off the CPU (GPUs; ops chosen to be portable MLX, fast on Metal and CUDA alike):

* there are only K distinct scores per head: the kk-th largest candidate score is found by sorting the K
  LUT entries and walking the per-code candidate counts down to kk (``sortfree_threshold``); the cache keeps
  the counts of its coded tokens (``A2ATSCache._counts``), and the step corrects them by the sinks and the
  coded part of the window, reading sinks + w codes;
* every token whose code scores at or above its head's threshold is taken, union over the GQA group, so
  ties at the threshold are taken whole: RET-SELECT's `may` holds every token >= the kk-th score, and
  `must` none of a tie that overflows kk (``sortfree_code_levels``);
* compaction into a fixed slot list without sorting: cumsums over T (must-level tokens and the tied
  tokens each head needs for its own kk first, other ties after) give each selected token its slot and
  one scatter writes it there; the slot count (``sortfree_width``) holds every first-priority token
  (<= G·kk), and extra room for ties, which alone are cut if a bucket is huge;
* the LUT, threshold, compaction, gather and attention are one ``mx.compile``d graph per step, every
  changing number (kk, candidate range, coded count, slot count) entering as data.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from a2ats_ref.eq12_far_keys import far_query_unchecked
from a2ats_ref.rope import rotate_by_tables, rotate_unchecked
from a2ats_ref.retrieval import topk_count
from a2ats_ref.runtime.threads import ThreadState

__all__ = ["prepare_codebook", "Selection", "selection_size", "tune_allocator",
           "allocator_tuning_wanted", "allocator_tuned"]

#: candidate count from which method="auto" selects on the host, CPU only (on a GPU the host path costs a
#: device->host copy of the LUT and is 6-9x slower, H200). Measured on the 2-core Xeon, interleaved with the
#: other methods (a2ats-bench's decode_step_case), float32 host vs in-graph argpartition ("mlx") ms: at 8B
#: shapes (32q/8kv/d128) 11.3 vs 10.4 at 8K candidates; at 16K 19.6 vs 23.4, 17.3 vs 21.5, 18.7 vs 19.0,
#: 19.2 vs 24.0 in four runs; at 64K 38.9-56.3 vs 58.8-83.6. At SmolLM2's (9q/3kv/d64) 3.1 vs 2.9 at 16K,
#: 4.9 vs 6.7 at 32K. 12,288 sits between 8K and 16K (the 2-core EPYC's crossover was 32,768).
HOST_SELECT_MIN = 12288

METHODS = ("auto", "host", "mlx", "sortfree", "cuda")

#: fewest codes per head the host selection partially sorts before falling back to sorting all K (_select_host)
HOST_TOP_CODES = 256


#: set A2ATS_TUNE_ALLOCATOR=0 to keep glibc's malloc thresholds as they are (enable_a2ats then leaves them)
TUNE_ALLOCATOR_ENV = "A2ATS_TUNE_ALLOCATOR"
_allocator_tuned: bool | None = None   # None: not asked yet in this process


def tune_allocator() -> bool:
    """Keep freed large buffers in glibc's heap (no munmap/page-fault churn between decode steps).

    Process-wide and idempotent; returns True when the thresholds are set, False where glibc's mallopt is
    unavailable. ``enable_a2ats`` calls it (unless ``A2ATS_TUNE_ALLOCATOR=0`` or ``tune_allocator=False``),
    so library users get what the benchmark measures. The decode step itself does not need it for its
    gathers (they come in GATHER_BLOCK_BYTES blocks from MLX's buffer cache); it still spares the model's
    own large per-token buffers (logits, MLP activations) the map/unmap cycle on a loaded machine. The cost:
    freed memory below 1 GiB stays in the process's heap instead of going back to the OS at once.
    """
    global _allocator_tuned
    if _allocator_tuned is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
            _allocator_tuned = (bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30))
                                and bool(libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)))
        except (OSError, AttributeError):
            _allocator_tuned = False
    return _allocator_tuned


def allocator_tuning_wanted(arg: bool | None = None) -> bool:
    """The library default for tune_allocator: the argument if given, else $A2ATS_TUNE_ALLOCATOR (default on)."""
    if arg is not None:
        return bool(arg)
    env = os.environ.get(TUNE_ALLOCATOR_ENV, "1").strip().lower()
    if env not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"${TUNE_ALLOCATOR_ENV}: expected 0 or 1, got {env!r}")
    return env not in ("0", "false", "no", "off")


def allocator_tuned() -> bool:
    """True once tune_allocator has set glibc's thresholds in this process."""
    return bool(_allocator_tuned)


def prepare_codebook(C, dtype=mx.float32) -> mx.array:
    """Key-space codebook C (n_kv, K, d) -> contiguous Cᵀ (n_kv, d, K) in the LUT dtype (do this once)."""
    C = mx.array(C) if not isinstance(C, mx.array) else C
    if C.ndim != 3:
        raise ValueError(f"C: expected (n_kv, K, d), got shape {tuple(C.shape)}")
    out = mx.contiguous(C.astype(dtype).swapaxes(-1, -2))
    mx.eval(out)
    return out



@lru_cache(maxsize=16)
def _regions(n: int, w: int, sinks: int):
    """Forced (sinks + window) token indices, a tuple, and the candidate range [c0, c1) for n cached tokens. Kept
    per (n, w, sinks): every layer of a model asks for the same step's regions, and the tuple costs ~2 us."""
    win0 = max(n - w, 0)
    s_end = min(sinks, n)
    forced = tuple(range(s_end)) + tuple(range(max(win0, s_end), n))
    c0, c1 = s_end, max(win0, s_end)
    return forced, c0, c1


def selection_size(T: int, *, n_q: int, n_kv: int, w: int, sinks: int, topk) -> int:
    """Upper bound on tokens gathered per KV head per step (forced + G·k, duplicates included)."""
    forced, c0, c1 = _regions(T, w, sinks)
    return max(1, len(forced) + (n_q // n_kv) * topk_count(T, topk, c1 - c0))  # RET-SELECT: never empty



@lru_cache(maxsize=64)
def _lut_fn(B, n_kv, G, d, K, traditional, tables=False):
    """Compiled: post-RoPE q (B, n_q, 1, d) -> LUT (B·n_kv, G, K) float32 of scale · q R_{b-i} · C.

    tables=True: `pos` is (cos, sin) of the angle the model's mx.fast.rope applied (EQ-12 on the device).
    The scale enters as a float32 array: a Python float would be a constant of the compiled graph, and each
    new scale (every head dim has its own default) would compile its kernels again (seconds each on a GPU).
    """
    BH = B * n_kv

    def lut(q, CT, inv_freqs, b, pos, scale):
        q = q.reshape(B, n_kv, G, d).astype(mx.float32)
        if tables:
            q = rotate_by_tables(q, pos[0], pos[1], traditional, -1.0)
            qb = rotate_unchecked(q, b, inv_freqs, traditional, 1.0) * scale
        else:
            qb = far_query_unchecked(q, b, inv_freqs, traditional=traditional, positions=pos) * scale
        return (qb @ CT).reshape(BH, G, K)

    return mx.compile(lut)


@lru_cache(maxsize=64)
def _select_mlx_fn(BH, G, K, kk, T_codes):
    """Compiled in-graph selection: per-head argpartition top-k, group indices with duplicates masked.

    Scores cover the whole code buffer (static length) with non-candidates at -inf, and the candidate
    range [c0, c1) comes in as data: decoding token after token reuses one compiled graph.
    """

    def select(lut, codes, c0, c1):
        c = codes.reshape(BH, T_codes)
        s = mx.take_along_axis(lut, mx.broadcast_to(c[:, None, :], (BH, G, T_codes)), axis=-1)
        j = mx.arange(T_codes)
        s = mx.where((j >= c0) & (j < c1), s, -mx.inf)
        top = mx.argpartition(s, T_codes - kk, axis=-1)[..., T_codes - kk:].reshape(BH, G * kk).astype(mx.int32)
        slot = mx.broadcast_to(mx.arange(G * kk, dtype=mx.int32)[None], (BH, G * kk))
        owner = mx.put_along_axis(mx.zeros((BH, T_codes), dtype=mx.int32), top, slot, axis=-1)
        return top, mx.take_along_axis(owner, top, axis=-1) == slot

    return mx.compile(select)


def _select_host(lut, codes, *, BH, G, K, kk, c0, c1, bucket):
    """Exact per-head top-k + GQA union on the host (NumPy), without sorting tokens.

    The k-th largest token score of head h is found on the LUT: sort the code scores, walk the code counts (a
    bincount of the candidate codes) down to k. Only the best few hundred codes of each head are sorted (an
    argpartition; about 4x the codes k tokens occupy on average, at least HOST_TOP_CODES), which suffices
    whenever they hold k tokens; otherwise all K are sorted. Tokens strictly above it are selected through a
    per-group bit table indexed by code; the r_h tokens needed at the threshold itself are the lowest-index
    tokens of the tied codes (the oracle's tie rule), found through a second bit table. Returns group index
    lists padded to a bucketed width.
    """
    L = np.asarray(lut)                                                    # (BH, G, K) float32
    cds = np.asarray(codes).reshape(BH, -1)[:, c0:c1]
    n_c = c1 - c0
    counts = np.stack([np.bincount(cds[g], minlength=K) for g in range(BH)])   # (BH, K)
    rows = np.arange(BH)[:, None, None]
    order = None
    m = min(K, max(HOST_TOP_CODES, 4 * -(-kk * K // max(n_c, 1))))
    if m < K:
        top = np.argpartition(-L, m - 1, axis=-1)[..., :m]                 # the m best codes of each head
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(L, top, axis=-1), axis=-1), axis=-1)
        cum = np.cumsum(counts[rows, top], axis=-1)
        if (cum[..., -1] >= kk).all():                                     # else some head needs more codes
            order = top
    if order is None:
        order = np.argsort(-L, axis=-1)                                    # (BH, G, K); tie order irrelevant
        cum = np.cumsum(counts[rows, order], axis=-1)
    first = np.take_along_axis(order, (cum < kk).sum(axis=-1)[..., None], axis=-1)   # code reaching k
    thr = np.take_along_axis(L, first, axis=-1)                            # (BH, G, 1) k-th largest score
    above, tied = L > thr, L == thr
    need = kk - (above * counts[:, None, :]).sum(axis=-1)                  # (BH, G) tied tokens still needed (>= 1)
    head_bit = np.left_shift(np.uint64(1), np.arange(G, dtype=np.uint64))[None, :, None]
    bit_t = np.uint8 if G <= 8 else np.uint16 if G <= 16 else np.uint32 if G <= 32 else np.uint64
    above_bits = (above * head_bit).sum(axis=1).astype(bit_t)             # (BH, K): heads taking the code whole
    tied_bits = (tied * head_bit).sum(axis=1).astype(bit_t)               # (BH, K): heads tied at the code
    idx_rows = []
    for g in range(BH):
        sel = np.take(above_bits[g], cds[g]) != 0
        tb = np.take(tied_bits[g], cds[g])
        nz = np.flatnonzero(tb)                                            # tokens tied for some head, ascending
        for j in range(G):
            sel[nz[((tb[nz] >> j) & 1) != 0][: need[g, j]]] = True
        idx_rows.append(np.flatnonzero(sel))
    width = max(len(r) for r in idx_rows)
    width = min(-(-width // bucket) * bucket, G * kk, n_c)
    idx = np.zeros((BH, width), dtype=np.int32)
    keep = np.zeros((BH, width), dtype=bool)
    for g, r in enumerate(idx_rows):
        idx[g, : len(r)] = r + c0
        keep[g, : len(r)] = True
    return mx.array(idx), mx.array(keep)


def code_counts(codes: mx.array, K: int) -> mx.array:
    """Codes (..., n_kv, t) -> (..., n_kv, K) int32: how many of the t tokens hold each code, per KV head.

    The cache keeps these for its coded tokens (added when a batch is coded, subtracted on trim, recounted on
    load), so the sort-free step never counts T codes. Integer scatter-add: exact on every backend.
    """
    lead, t = codes.shape[:-1], codes.shape[-1]
    if t == 0:   # no tokens: no scatter over an empty index array (MLX CUDA 0.32 mishandles empty arrays)
        return mx.zeros((*lead, K), dtype=mx.int32)
    rows = math.prod(lead)
    flat = codes.reshape(rows, t).astype(mx.int32) + (mx.arange(rows, dtype=mx.int32) * K)[:, None]
    counts = mx.zeros((rows * K,), dtype=mx.int32).at[flat.reshape(-1)].add(mx.array(1, dtype=mx.int32))
    return counts.reshape(*lead, K)


def sortfree_threshold(lut: mx.array, counts: mx.array, kk: mx.array) -> mx.array:
    """The kk-th largest candidate score of each query head, from the K code scores and the code counts.

    lut (BH, G, K) code scores, counts (BH, K) candidate tokens per code, kk (int32 scalar, 1..#candidates)
    -> (BH, G, 1): walk the codes from the highest score down, summing their counts, and stop at the first
    code where the sum reaches kk. Sorts K scores, never T tokens.
    """
    if lut.shape[-1] == 1:   # one code: it is the threshold (and no empty reduction enters a GPU graph)
        return lut
    order = mx.argsort(-lut, axis=-1)
    cum = mx.cumsum(mx.take_along_axis(mx.broadcast_to(counts[:, None, :], lut.shape), order, axis=-1), axis=-1)
    # the last code ends every walk (cum reaches all candidates there): counting over the others keeps
    # pos < K without a shape constant in the fused kernel (each new constant costs a kernel JIT)
    pos = mx.sum(cum[..., :-1] < kk, axis=-1, keepdims=True)
    return mx.take_along_axis(mx.take_along_axis(lut, order, axis=-1), pos, axis=-1)


def sortfree_code_levels(lut: mx.array, counts: mx.array, kk: mx.array):
    """Per KV head and code: 1 = must be gathered, 2 = may be gathered (a tie at a head's threshold), 0 = not.

    A head whose codes at or above its threshold hold exactly kk candidates takes them all (level 1). A head
    whose threshold code holds more ties than it needs takes the codes strictly above (level 1, fewer than
    kk tokens) and the whole tied bucket as level 2: every tied token is in RET-SELECT's `may` (score >= the
    kk-th largest), none is in its `must` (the (kk+1)-th largest has the same score). The GQA union is an
    `any` over the group. Returns (levels (BH, K) uint8, n1 (BH,), n2 (BH,)): n1 level-1 tokens (at most
    G·kk, so a buffer of G·kk slots never drops one), n2 level-2 tokens.
    """
    thr = sortfree_threshold(lut, counts, kk)
    ge = lut >= thr
    n_ge = mx.sum(mx.where(ge, counts[:, None, :], 0), axis=-1, keepdims=True)
    must = (lut > thr) | (ge & (n_ge == kk))
    lvl1 = mx.any(must, axis=1)
    lvl2 = mx.any(ge, axis=1) & ~lvl1
    n1 = mx.sum(mx.where(lvl1, counts, 0), axis=-1)
    n2 = mx.sum(mx.where(lvl2, counts, 0), axis=-1)
    levels = lvl1.astype(mx.uint8) + 2 * lvl2.astype(mx.uint8)
    return levels, n1, n2


def sortfree_tie_quotas(lut: mx.array, counts: mx.array, kk: mx.array, thr: mx.array):
    """Per query head, the tied bucket it must draw from and how many of its tokens: RET-SELECT's per-head
    count (each head holds >= kk of its own top-k) needs kk - (#candidates strictly above) tied tokens of a
    head whose threshold bucket overflows kk. The level-2 tokens of the other heads of the group must not
    take their slots, so these tokens rank with level 1 (``_sortfree_select``).

    Returns (tie (BH, G, K) bool: codes at the head's threshold when its bucket overflows, need (BH, G) int32).
    """
    eq = lut == thr
    n_gt = mx.sum(mx.where(lut > thr, counts[:, None, :], 0), axis=-1)
    n_eq = mx.sum(mx.where(eq, counts[:, None, :], 0), axis=-1)
    need = kk - n_gt
    return eq & (n_gt + n_eq > kk)[..., None], need


#: spare slots (a power of two) that unselected tokens are scattered to, spread so no slot takes many writes
SORTFREE_SPILL = 1024


def sortfree_width(kk: int, G: int, K: int, n_cand: int, step: int = 256) -> int:
    """Static slot count S of the sort-free step's index list (rounded up to `step`, so a compiled step
    serves many tokens): G·kk holds every level-1 token; 2·G·ceil(n_cand/K) more hold typical tie buckets
    (level 2, which may be cut at the end: dropped tokens are only ever optional ones)."""
    want = min(G * kk + 2 * G * -(-n_cand // K), n_cand)
    return max(step, -(-want // step) * step)


def _sortfree_select(lut, codes, counts, kk, c0, c1, n_slots, *, BH, T_codes, S):
    """Compaction: the selected candidates' indices in index order, first-priority tokens first, into S slots.

    First priority: level 1, and of each head's overflowing tie bucket the first (index order) tokens it needs
    for its kk (``sortfree_tie_quotas``): at most G·kk tokens, so S >= G·kk slots never cut one. The other
    level-2 ties come after them and alone are cut at S. Each candidate's slot is a prefix count (cumsums over
    T), then one scatter writes token indices to their slots; unselected and overflowing tokens go to spill
    slots past S. n_slots is S as data (a constant would make every new S a new fused kernel to JIT-compile).
    Returns idx (BH, S) int32 and keep (BH, S) bool (slots past the selection are padding)."""
    levels, n1, n2 = sortfree_code_levels(lut, counts, kk)
    tie, need = sortfree_tie_quotas(lut, counts, kk, sortfree_threshold(lut, counts, kk))
    G = lut.shape[1]
    j = mx.arange(T_codes, dtype=mx.int32)
    cand = (j >= c0) & (j < c1)
    c = codes.reshape(BH, T_codes)
    lv = mx.where(cand, mx.take_along_axis(levels, c, axis=-1), 0)
    tied = mx.take_along_axis(tie, mx.broadcast_to(c[:, None, :], (BH, G, T_codes)), axis=-1) & cand
    needed = mx.any(tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= need[..., None]), axis=1) & (lv == 2)
    first = (lv == 1) | needed
    rest = (lv == 2) & ~needed
    rank = mx.cumsum(mx.stack([first, rest]).astype(mx.int32), axis=-1)
    n_first = mx.sum(first.astype(mx.int32), axis=-1)
    slot = mx.where(first, rank[0] - 1, mx.where(rest, n_first[:, None] + rank[1] - 1, n_slots))
    slot = mx.where(slot < n_slots, slot, n_slots + (j & (SORTFREE_SPILL - 1)))
    buf = mx.zeros((BH, S + SORTFREE_SPILL), dtype=mx.int32)
    idx = mx.put_along_axis(buf, slot, mx.broadcast_to(j[None], (BH, T_codes)), axis=-1)[:, :S]
    keep = mx.arange(S, dtype=mx.int32)[None] < mx.minimum(n1 + n2, n_slots)[:, None]
    return idx, keep


def _candidate_counts(codes, counts, c0, c1, counted, *, BH, K, T_codes, sinks, w):
    """Counts of the candidates [c0, c1) from counts over the coded tokens [0, counted), c1 <= counted <= c1 + w:
    minus the sinks [0, c0) (c0 <= sinks) and the coded window tail [c1, counted). Touches sinks + w codes."""
    # sinks and w are static: only non-empty parts enter the graph (MLX CUDA 0.32 mishandles empty arrays)
    parts = ([(mx.arange(sinks, dtype=mx.int32), mx.arange(sinks) < c0)] if sinks else []) + \
            ([(c1 + mx.arange(w, dtype=mx.int32), mx.arange(w) < counted - c1)] if w else [])
    if not parts:
        return counts.reshape(BH, K)
    p = mx.concatenate([q for q, _ in parts]) if len(parts) > 1 else parts[0][0]
    drop = (mx.concatenate([m for _, m in parts]) if len(parts) > 1 else parts[0][1]).astype(mx.int32)
    at = mx.take(codes.reshape(BH, T_codes), mx.where(drop > 0, p, 0), axis=-1).astype(mx.int32)
    rows = mx.broadcast_to(mx.arange(BH, dtype=mx.int32)[:, None], at.shape)
    return counts.reshape(BH, K).at[rows, at].add(-mx.broadcast_to(drop[None], at.shape))


def _step_counts(codes, counts, c0, c1, counted, *, kept, BH, K, T_codes, sinks, w):
    """The sort-free steps' candidate counts: corrected from the caller's kept counts, else counted here."""
    if kept:
        return _candidate_counts(codes, counts, c0, c1, counted, BH=BH, K=K, T_codes=T_codes, sinks=sinks, w=w)
    return _counts_from_codes(codes, c0, c1, BH=BH, K=K, T_codes=T_codes)


def _counts_from_codes(codes, c0, c1, *, BH, K, T_codes):
    """Candidate counts by one scatter-add over the whole code buffer (callers without kept counts)."""
    j = mx.arange(T_codes, dtype=mx.int32)
    c = codes.reshape(BH, T_codes).astype(mx.int32)
    rows = mx.broadcast_to(mx.arange(BH, dtype=mx.int32)[:, None], c.shape)
    add = mx.broadcast_to(((j >= c0) & (j < c1)).astype(mx.int32)[None], c.shape)
    return mx.zeros((BH, K), dtype=mx.int32).at[rows, c].add(add)


#: bytes of float32 rows gathered per block in the attention step. Blocks this small come back from MLX's
#: own buffer cache (32 MiB by default on CPU) step after step, so the step neither maps nor page-faults
#: fresh memory, whatever glibc's malloc thresholds are, and a block's rows are still in cache when reused.
GATHER_BLOCK_BYTES = 1 << 21


#: fewest selected rows per (batch, KV head) that are split over the CPU lanes even when they fit one block.
#: SmolLM2 shapes (9q/3kv/d64), attention step with host softmax, one block vs split, interleaved: 16K (1,545
#: rows) 1.37 vs 1.26 ms, 32K 2.94 vs 2.31 ms, but 8K (804 rows) 0.77 vs 1.00 ms.
LANE_SPLIT_MIN = 1024


def _gather_blocks(S: int, BH: int, d: int, n_lanes: int = 1) -> list[tuple[int, int]]:
    """Column ranges [s0, s1) of the (BH, S) selection, each gathering at most GATHER_BLOCK_BYTES (float32).

    A selection of LANE_SPLIT_MIN rows or more comes in at least n_lanes blocks, so that every lane gathers
    (MLX's CPU row gather runs at ~1.6 ns per float32 element on one thread, most of a SmolLM2 layer's
    attention step at 16K when one lane gathered it all).
    CPU only: a GPU gathers the whole selection at once (there every block costs kernel launches, and its
    memory is not the CPU's buffer cache)."""
    if mx.default_device().type != mx.cpu:
        return [(0, S)]
    width = max(1, GATHER_BLOCK_BYTES // (4 * BH * d))
    if S >= LANE_SPLIT_MIN:
        width = min(width, -(-S // n_lanes))
    return [(s, min(s + width, S)) for s in range(0, S, width)]


_LANES = ThreadState()   # MLX streams belong to the thread that made them: each thread keeps its own lanes


def _lanes() -> tuple:
    """Streams the attention step spreads its gather blocks over: two on the CPU, the default one elsewhere; the
    calling thread's own (a stream made by another thread fails in this one: 'There is no Stream(cpu, N) in
    current thread').

    MLX runs each CPU op on one thread, and a float16 -> float32 cast costs about 1 ns per element there
    (software conversion): two CPU streams convert (and gather) alternate blocks on both cores. A GPU keeps
    one stream (its ops are parallel already).
    """
    dev = mx.default_device()
    key = str(dev)
    per_thread = _LANES.__dict__
    if key not in per_thread:
        first = mx.default_stream(dev)
        per_thread[key] = (first, mx.new_stream(dev)) if dev.type == mx.cpu else (first,)
    return per_thread[key]


#: 2^(127 - 15), float32's exponent bias over float16's: float16_scaled_rows gives float16 values times 1 / F16_SCALE
F16_SCALE = 2.0 ** 112
#: |query · scale| below which F16_SCALE times the scaled query stays finite in float32 (max ~2^128), with margin
F16_QUERY_BOUND = 2.0 ** 15
_F16_KEEP = np.array(0x8FFFFFFF, dtype=np.uint32).view(np.int32).item()   # sign, exponent and mantissa fields


def float16_scaled_rows(bits16: mx.array, stream) -> mx.array:
    """int16 view of float16 values -> float32 holding each value times 1 / F16_SCALE (2^-112), exactly, on ``stream``.

    MLX's CPU float16 -> float32 ``astype`` is a software conversion (its wheel and its JIT assume no F16C): about
    1.1 ns per element on one thread, what made float16's decode step 1.1-1.25x float32's although it gathers half
    the bytes. Three integer ops do it here: sign-extend to int32, shift left by 13 (exponent and mantissa land in
    float32's fields) and clear bits 28-30 (the sign copies the extension put there). The float32 exponent field
    then holds the float16 one, biased by 15 instead of 127: the float32 value is the float16's times 2^-112, for
    every finite float16 (a subnormal lands as the float32 subnormal of the same bits, ±0 as ±0). The caller
    multiplies the other matmul operand by F16_SCALE (the scaled query, the probabilities), so every product and
    every sum BLAS forms is the one astype's rows give. A non-finite float16 (outside INPUT-ERRORS' precondition)
    would read as a finite number.
    """
    with mx.stream(stream):
        return mx.view((bits16.astype(mx.int32) << 13) & mx.array(_F16_KEEP, mx.int32), mx.float32)


_F16_EXACT: dict = {}


def _f16_scaled_exact(stream) -> bool:
    """Whether float16_scaled_rows times F16_SCALE equals MLX's astype on every finite float16, on this stream's
    thread (checked once per stream: a thread that treats subnormal inputs as zero, x86 DAZ, keeps astype)."""
    key = str(stream)
    if key not in _F16_EXACT:
        bits = np.arange(1 << 16, dtype=np.uint16).view(np.int16)
        bits = bits[np.isfinite(bits.view(np.float16))]
        b = mx.array(bits)
        got = np.array(mx.multiply(float16_scaled_rows(b, stream), F16_SCALE, stream=stream))
        want = np.array(mx.view(b, mx.float16).astype(mx.float32, stream=stream))
        _F16_EXACT[key] = bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))
    return _F16_EXACT[key]


def softmax_host(logits: mx.array) -> mx.array:
    """Exact float32 softmax over the last axis, computed by NumPy: MLX's CPU exp is a scalar loop (about 14 ns
    per element here, 3.7 ms for the (8, 4, 8000) logits of an 8B-shape step at 64K) where NumPy's is
    vectorised (the same softmax in 0.4 ms, host round trip included). -inf entries get probability 0."""
    mx.eval(logits)
    e = np.array(logits, dtype=np.float32)
    e -= e.max(axis=-1, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(axis=-1, keepdims=True)
    return mx.array(e)


@lru_cache(maxsize=64)
def _attend_fn(B, n_q, n_kv, d, dv, T_buf, F, lanes=(None,), host_softmax=False, f16_scaled=False):
    """Gather the selected rows of the cache buffer, exact float32 softmax attention (compiled).

    Rows are gathered in the cache dtype and cast to float32 block by block (_gather_blocks): the logits
    of all blocks are one small (BH, G, S) array, so the softmax is exact over the whole selection, and
    p @ V is summed over the same blocks. No buffer proportional to the selection's K/V bytes is made.
    lanes: the streams (_lanes()) block j runs on is lanes[j % len(lanes)]; each lane keeps its own partial
    sum of p @ V, added at the end. host_softmax (the CPU's host-selection path, which waits for the host
    anyway): the softmax runs in NumPy (softmax_host) between two compiled graphs, logits and p @ V.
    f16_scaled (the caller checked |q · scale| < F16_QUERY_BOUND): float16 rows come from float16_scaled_rows,
    F16_SCALE folded into the scaled query and the probabilities, where _f16_scaled_exact holds on every lane.
    """
    G = n_q // n_kv
    BH = B * n_kv
    row_base = mx.arange(BH, dtype=mx.int32)[:, None] * T_buf   # flat row of token 0 of each (b, kv)
    mx.eval(row_base)   # an input of the graph: left lazy, T_buf became a literal in a kernel JIT-built per T_buf
    n_lanes = len(lanes)
    scaled = f16_scaled and all(_f16_scaled_exact(s) for s in lanes)

    def fold(buf):
        """Whether buf's rows come from float16_scaled_rows (the other matmul operand then takes F16_SCALE)."""
        return scaled and buf.dtype == mx.float16

    def rows_f32(buf, rows, width, s):
        if fold(buf):
            bits = mx.take(mx.view(buf, mx.int16), rows.reshape(-1), axis=0, stream=s)
            return float16_scaled_rows(bits, s).reshape(BH, -1, width)
        return mx.take(buf, rows.reshape(-1), axis=0, stream=s).reshape(BH, -1, width).astype(mx.float32, stream=s)

    def masked_logits(q, keys, idx, keep, forced_idx, scale):
        if F:
            idx = mx.concatenate([mx.broadcast_to(forced_idx[None], (BH, F)), idx], axis=-1)
            keep = mx.concatenate([mx.ones((BH, F), dtype=mx.bool_), keep], axis=-1)
        rows = idx + row_base
        kflat = keys.reshape(-1, d)
        qT = (q.reshape(BH, G, d).astype(mx.float32) * scale).swapaxes(-1, -2)
        qT = qT * F16_SCALE if fold(kflat) else qT
        # mx.depends orders the blocks of a lane: block j is gathered only after block j - n_lanes has been
        # used, so one block per lane is alive at a time (MLX would otherwise be free to gather every block first).
        logits = []
        for j, (s0, s1) in enumerate(_gather_blocks(rows.shape[-1], BH, max(d, dv), n_lanes)):
            r = rows[:, s0:s1] if j < n_lanes else mx.depends(rows[:, s0:s1], logits[j - n_lanes])
            s = lanes[j % n_lanes]
            # (S, d) @ (d, G) then transpose: faster than (G, d) @ (d, S) on CPU BLAS
            logits.append(mx.matmul(rows_f32(kflat, r, d, s), qT, stream=s).swapaxes(-1, -2))
        logits = mx.concatenate(logits, axis=-1) if len(logits) > 1 else logits[0]
        return mx.where(keep[:, None, :], logits, -mx.inf), rows

    def weighted_values(p, values, rows):
        vflat = values.reshape(-1, dv)
        pf = p * F16_SCALE if fold(vflat) else p
        sums = [None] * n_lanes
        for j, (s0, s1) in enumerate(_gather_blocks(rows.shape[-1], BH, max(d, dv), n_lanes)):
            lane, s = j % n_lanes, lanes[j % n_lanes]
            r = mx.depends(rows[:, s0:s1], p if sums[lane] is None else sums[lane])
            part = mx.matmul(pf[..., s0:s1], rows_f32(vflat, r, dv, s), stream=s)
            sums[lane] = part if sums[lane] is None else mx.add(sums[lane], part, stream=s)
        out = sums[0]
        for extra in sums[1:]:
            if extra is not None:
                out = out + extra
        return out.reshape(B, n_q, 1, dv).astype(values.dtype)

    if host_softmax:
        logits_c, values_c = mx.compile(masked_logits), mx.compile(weighted_values)

        def attend(q, keys, values, idx, keep, forced_idx, scale):
            logits, rows = logits_c(q, keys, idx, keep, forced_idx, scale)
            return values_c(softmax_host(logits), values, rows)

        return attend

    def attend(q, keys, values, idx, keep, forced_idx, scale):
        logits, rows = masked_logits(q, keys, idx, keep, forced_idx, scale)
        return weighted_values(mx.softmax(logits, axis=-1, precise=True), values, rows)

    return mx.compile(attend)


@lru_cache(maxsize=64)
def _sortfree_step_fn(B, n_q, n_kv, d, dv, K, T_buf, T_codes, S, F, traditional, tables, kept, sinks, w,
                      lanes=(None,)):
    """Compiled: the whole sort-free decode step, LUT -> threshold -> compaction -> gather -> attention.

    One graph, no host round trip: the token count kk, the candidate range and the coded count enter as
    data; S (slots) and F (forced tokens) are static. kept: counts over the coded tokens [0, counted) come
    from the caller (the cache keeps them), else they are counted here from the codes.
    """
    BH, G = B * n_kv, n_q // n_kv
    lut_fn = _lut_fn(B, n_kv, G, d, K, traditional, tables)
    attend = _attend_fn(B, n_q, n_kv, d, dv, T_buf, F, lanes)

    def step(queries, keys, values, codes, CT, inv, b, pos, counts, kk, c0, c1, counted, n_slots, forced_idx,
             scale_arr):
        lut = lut_fn(queries, CT, inv, b, pos, scale_arr)
        cand = _step_counts(codes, counts, c0, c1, counted, kept=kept, BH=BH, K=K, T_codes=T_codes, sinks=sinks, w=w)
        idx, keep = _sortfree_select(lut, codes, cand, kk, c0, c1, n_slots, BH=BH, T_codes=T_codes, S=S)
        return attend(queries, keys, values, idx, keep, forced_idx, scale_arr), idx, keep

    return mx.compile(step)


class Selection(NamedTuple):
    """The token set one decode step attended to, kept lazily (building the mask costs O(T)).

    idx/keep (B·n_kv, S): candidate token indices and which slots count (False on padding and on
    repeats of a token another head of the GQA group also picked); forced: sink + window indices.
    """

    idx: mx.array
    keep: mx.array
    forced: mx.array
    shape: tuple   # (B, n_kv, n_tokens)

    def mask(self) -> mx.array:
        """Bool (B, n_kv, n_tokens): True on every token the step attended to."""
        B, n_kv, n = self.shape
        BH, F = B * n_kv, self.forced.shape[0]
        idx, keep = self.idx, self.keep
        if F:   # no empty piece enters a GPU graph (MLX CUDA 0.32 crashes on them: SIGFPE on the H200)
            idx = mx.concatenate([mx.broadcast_to(self.forced[None], (BH, F)), idx], axis=-1)
            keep = mx.concatenate([mx.ones((BH, F), dtype=mx.bool_), keep], axis=-1)
        # never empty (a step with nothing to retrieve has one padding slot); dropped slots write into the
        # extra column n, which is cut off
        m = mx.put_along_axis(mx.zeros((BH, n + 1), dtype=mx.bool_), mx.where(keep, idx, n), mx.array(True), axis=-1)
        return m[:, :n].reshape(B, n_kv, n)
