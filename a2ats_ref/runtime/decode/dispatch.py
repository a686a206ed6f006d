"""RET-DECODE's entry point: one decode step, dispatched to the host, in-graph, sort-free or CUDA method.

``decode_step_fast`` checks shapes in pure Python (no host sync), applies RET-TOPK and RET-SELECT's
never-empty rule, and hands the step to the method ``auto_method`` picks: the portable parts
(``runtime.decode.portable``) on every device, or the two CUDA kernels (``runtime.decode.cuda``) where their
self-check (``runtime.decode.selfcheck``) passed.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from a2ats_ref.retrieval import own_token_only, topk_count
from a2ats_ref.runtime.decode import cuda as cuda_decode
from a2ats_ref.runtime.decode import portable, precompiled
from a2ats_ref.runtime.decode.portable import (  # noqa: F401  (the step's public helpers, one import away)
    TUNE_ALLOCATOR_ENV, allocator_tuned, allocator_tuning_wanted, code_counts, prepare_codebook, selection_size,
    tune_allocator)
from a2ats_ref.runtime.decode.selfcheck import usable


def auto_method(n_candidates: int, *, G: int | None = None, d: int | None = None, dv: int | None = None,
                K: int | None = None, n_kv: int | None = None, dtype=None) -> str:
    """method="auto": on the CPU, host selection from portable.HOST_SELECT_MIN candidates, else in-graph argpartition
    (both tuned there); on MLX CUDA the two-kernel step (cuda_decode) when its self-check passed and the head
    shape (G, d, dv, K, when given) fits it; on any other device the portable sort-free step (no CPU-tuned
    number decides a GPU path)."""
    if mx.default_device().type != mx.cpu:
        fits = None in (G, d, dv, K) or cuda_decode.shapes_supported(G, d, dv, K)
        return "cuda" if fits and usable(dtype=dtype, G=G, n_kv=n_kv, d=d, K=K) else "sortfree"
    return "host" if n_candidates >= portable.HOST_SELECT_MIN else "mlx"




def decode_step_fast(queries, keys, values, codes, CT, *, query_pos: int, b: int, w: int, sinks: int, topk,
                     inv_freqs, traditional: bool, scale: float | None = None, n_tokens: int | None = None,
                     return_mask: bool = False, return_selection: bool = False, method: str = "auto",
                     bucket: int = 256, applied_angle=None, code_counts=None):
    """One A2ATS decode-attention step (RET-DECODE), mlx-lm layout.

    queries (B, n_q, 1, d) post-RoPE at position ``query_pos``; keys/values (B, n_kv, T_buf, d|dv) post-RoPE
    (only the first ``n_tokens`` are valid, default T_buf; pass the cache's contiguous buffer, not a slice);
    codes (B, n_kv, T_buf) unsigned ints; CT = prepare_codebook(C) (n_kv, d, K); inv_freqs (d/2,).
    Tokens j <= query_pos are visible (query_pos must be n_tokens - 1 or less).
    Returns (B, n_q, 1, dv) in the values' dtype, plus the bool selection mask (B, n_kv, n_tokens)
    when ``return_mask``, or the lazy ``portable.Selection`` when ``return_selection``.
    Shapes and parameters are checked in pure Python (no host sync).
    applied_angle: optional (cos, sin) (d/2,) of the angle the model's mx.fast.rope gave the query (the cache
    passes it, from rope.applied_cos_sin); without it the query is de-rotated by query_pos * inv_freqs.
    method: "host" (NumPy top-k), "mlx" (in-graph argpartition), "sortfree" (in-graph threshold from code
    counts, one compiled graph per step) or "auto" (auto_method). code_counts: optional (counts (B, n_kv, K)
    int32 = code_counts(codes[..., :counted]), counted) kept by the caller; "sortfree" then reads only the
    sinks + w codes it corrects them by instead of counting all codes (used when counted lies in
    [n - w, n], as in the cache after its pending codes are assigned).
    """
    if queries.ndim != 4 or queries.shape[2] != 1:
        raise ValueError(f"queries: expected (B, n_q, 1, d), got shape {tuple(queries.shape)}")
    B, n_q, _, d = queries.shape
    if keys.ndim != 4 or keys.shape[0] != B or keys.shape[-1] != d:
        raise ValueError(f"keys: expected (B={B}, n_kv, T, d={d}), got shape {tuple(keys.shape)}")
    _, n_kv, T_buf, _ = keys.shape
    if values.ndim != 4 or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values: expected ({B}, {n_kv}, {T_buf}, dv), got shape {tuple(values.shape)}")
    if codes.ndim != 3 or codes.shape[:2] != (B, n_kv):
        raise ValueError(f"codes: expected ({B}, {n_kv}, {T_buf}), got shape {tuple(codes.shape)}")
    if n_q % n_kv:
        raise ValueError(f"queries: n_q={n_q} must be a multiple of n_kv={n_kv}")
    if d % 2:
        raise ValueError(f"queries: head dim d must be even, got {d}")
    if CT.ndim != 3 or CT.shape[0] != n_kv or CT.shape[1] != d:
        raise ValueError(f"CT: expected prepare_codebook(C) of shape ({n_kv}, {d}, K), got {tuple(CT.shape)}")
    inv = inv_freqs if isinstance(inv_freqs, mx.array) else mx.array(np.asarray(inv_freqs, np.float32))
    if inv.shape != (d // 2,):
        raise ValueError(f"inv_freqs: expected shape ({d // 2},), got {tuple(inv.shape)}")
    n_tokens = T_buf if n_tokens is None else int(n_tokens)
    if not 1 <= n_tokens <= min(T_buf, codes.shape[-1]):
        raise ValueError(f"n_tokens: expected 1..{min(T_buf, codes.shape[-1])}, got {n_tokens}")
    i = int(query_pos)
    if not 0 <= i < n_tokens:
        raise ValueError(f"query_pos: expected 0..n_tokens-1={n_tokens - 1}, got {i}")
    n = i + 1
    forced, c0, c1 = portable._regions(n, int(w), int(sinks))
    kk = topk_count(n, topk, c1 - c0)   # RET-TOPK counts the tokens the query sees, i + 1 (= T at decode)
    if own_token_only(kk, int(w), int(sinks)):
        forced = [i]                     # RET-SELECT: never an empty selection
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    BH, G, K = B * n_kv, n_q // n_kv, CT.shape[-1]
    if method == "auto":
        method = auto_method(c1 - c0, G=G, d=d, dv=values.shape[-1], K=K, n_kv=n_kv, dtype=values.dtype)
    if method not in portable.METHODS:
        raise ValueError(f"method: expected one of {', '.join(portable.METHODS)}, got {method!r}")
    if method == "cuda":
        if not (cuda_decode.on_cuda() and cuda_decode.shapes_supported(G, d, values.shape[-1], K)):
            raise ValueError("method='cuda' needs MLX's CUDA backend as the default device and d == dv, one of "
                             f"{cuda_decode.RUN_HEAD_DIMS}, and a head shape whose counts fit a block (got "
                             f"d={d}, dv={values.shape[-1]}, G={G}, K={K}: cuda_decode.shapes_supported); "
                             "use method='sortfree' elsewhere")
    if method in ("sortfree", "cuda") and kk > 0:
        return _decode_sortfree(queries, keys, values, codes, CT, inv, cuda=method == "cuda", i=i, b=b, kk=kk, c0=c0,
                                c1=c1, forced=forced, w=int(w), sinks=int(sinks), scale=scale,
                                traditional=bool(traditional), n_tokens=n_tokens, applied_angle=applied_angle,
                                code_counts=code_counts, return_mask=return_mask, return_selection=return_selection)
    if kk > 0:
        f32 = mx.float32
        tables = applied_angle is not None
        pos = mx.stack(list(applied_angle)) if tables else mx.array(float(i), f32)
        lut = portable._lut_fn(B, n_kv, G, d, K, bool(traditional), tables)(
            queries, CT, inv.astype(f32), mx.array(float(b), f32), pos, mx.array(scale, f32))
        if method == "host":
            # a float16 cache's portable.F16_QUERY_BOUND check rides on the LUT's sync (float32 caches skip it)
            q_abs = [mx.abs(queries).max()] if mx.float16 in (keys.dtype, values.dtype) else []
            mx.eval(lut, *q_abs)
            idx, keep = portable._select_host(lut, codes, BH=BH, G=G, K=K, kk=kk, c0=c0, c1=c1, bucket=bucket)
        else:
            idx, keep = portable._select_mlx_fn(BH, G, K, kk, codes.shape[-1])(lut, codes, mx.array(c0), mx.array(c1))
    else:
        # nothing to retrieve: one padding slot (keep False), not an empty array (MLX CUDA 0.32 crashes on those)
        idx, keep = mx.zeros((BH, 1), dtype=mx.int32), mx.zeros((BH, 1), dtype=mx.bool_)
    forced_idx = mx.array(np.asarray(forced, dtype=np.int32))
    host_softmax = method == "host" and mx.default_device().type == mx.cpu
    f16_scaled = (host_softmax and kk > 0 and mx.float16 in (keys.dtype, values.dtype)
                  and float(q_abs[0].item()) * scale < portable.F16_QUERY_BOUND)
    fn = portable._attend_fn(B, n_q, n_kv, d, values.shape[-1], T_buf, len(forced), portable._lanes(), host_softmax, f16_scaled)
    out = fn(queries, keys, values, idx, keep, forced_idx, mx.array(scale, dtype=mx.float32))
    if not (return_mask or return_selection):
        return out
    sel = portable.Selection(idx, keep, forced_idx, (B, n_kv, n_tokens))
    return out, (sel if return_selection else sel.mask())


def _decode_sortfree(queries, keys, values, codes, CT, inv, *, cuda=False, i, b, kk, c0, c1, forced, w, sinks, scale,
                     traditional, n_tokens, applied_angle, code_counts, return_mask, return_selection):
    """decode_step_fast's method="sortfree" (one compiled call) or "cuda" (two kernels, cuda_decode), kk > 0."""
    B, n_q, _, d = queries.shape
    _, n_kv, T_buf, _ = keys.shape
    K, T_codes, n = CT.shape[-1], codes.shape[-1], i + 1
    kept = False
    if code_counts is not None:
        counts, counted = code_counts
        if not isinstance(counts, mx.array) or counts.shape != (B, n_kv, K):
            got = tuple(counts.shape) if isinstance(counts, mx.array) else type(counts).__name__
            raise ValueError(f"code_counts: expected (counts ({B}, {n_kv}, {K}) int32, counted), got {got}")
        counted = int(counted)
        kept = c1 <= counted <= c1 + w and counted <= n   # else the correction would touch more than w codes
    if not kept:
        counts, counted = mx.zeros((B, n_kv, K), dtype=mx.int32), 0
    f32, i32 = mx.float32, mx.int32
    S = portable.sortfree_width(kk, n_q // n_kv, K, c1 - c0)
    wants_selection = return_mask or return_selection
    if cuda:
        out, sel, _ = cuda_decode.decode(
            queries, keys, values, codes, CT, inv.astype(f32), counts=counts.astype(i32), kept=kept, kk=kk, c0=c0,
            c1=c1, counted=counted, S=S, n=n, sinks=sinks, w=w, b=float(b), query_pos=float(i),
            scale=scale, traditional=traditional, applied_angle=applied_angle, n_tokens=n_tokens,
            launch=precompiled.default_launch())
        if not wants_selection:
            return out
        return out, (sel if return_selection else sel.mask())   # the mask kernel runs only if mask() is asked for
    forced_idx = mx.array(np.asarray(forced, dtype=np.int32))
    tables = applied_angle is not None
    pos = mx.stack(list(applied_angle)) if tables else mx.array(float(i), f32)
    fn = portable._sortfree_step_fn(B, n_q, n_kv, d, values.shape[-1], K, T_buf, T_codes, S, len(forced), traditional,
                                    tables, kept, sinks, w, portable._lanes())
    # no empty array enters the GPU graph (MLX CUDA 0.32 mishandles them); with F = 0 the step ignores it
    forced_in = forced_idx if len(forced) else mx.zeros((1,), dtype=i32)
    out, idx, keep = fn(queries, keys, values, codes, CT, inv.astype(f32), mx.array(float(b), f32), pos,
                        counts.astype(i32), mx.array(kk, i32), mx.array(c0, i32), mx.array(c1, i32),
                        mx.array(counted, i32), mx.array(S, i32), forced_in, mx.array(scale, dtype=f32))
    if not wants_selection:
        return out
    sel = portable.Selection(idx, keep, forced_idx, (B, n_kv, n_tokens))
    return out, (sel if return_selection else sel.mask())
