"""RET-LUT, RET-TOPK, RET-SELECT, RET-ATTN, RET-DECODE — decode-time token retrieval.

One decode step: rotate the post-RoPE query to R_b (EQ-12), score every codeword
once (LUT), read each token's score through its code, keep the top-k candidates
per query head, take the union over the GQA group, add sinks and the recent
window, and run exact softmax attention (true RoPE positions) over that set.
Query head h reads KV head h // G (contiguous groups, as in mlx-lm).

decode_step is the clause function: readable, validated, a dense boolean mask over
all T tokens. The runtime path (gather only the selected rows, so attention costs
O(selected) instead of O(T)) is a2ats_ref.runtime.decode.portable.decode_step_fast, which the
cache calls on every decode step; tests pin it to decode_step and the oracle.
"""

from __future__ import annotations

import math
import numbers

import mlx.core as mx

from a2ats_ref import checks
from a2ats_ref.eq12_far_keys import far_query
from a2ats_ref.precision import mm


def gqa_group(n_q: int, n_kv: int) -> int:
    """Query heads per KV head, G = n_q / n_kv (ValueError unless n_kv divides n_q)."""
    if n_kv <= 0 or n_q % n_kv:
        raise ValueError(f"n_kv_heads: {n_kv} KV heads must divide the {n_q} query heads")
    return n_q // n_kv


def attention_scale(scale, d: int) -> float:
    """The softmax scale as a float: 1/sqrt(d) for None, else a validated positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if not (isinstance(scale, numbers.Real) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number (default 1/sqrt(d)), got {scale!r}")
    return float(scale)


def lut_scores(q_b, C, *, scale=None) -> mx.array:
    """RET-LUT: LUT[..., h, k] = scale * q_b[..., h] . C[h // G, k]; (..., n_q, d), (n_kv, K, d) -> (..., n_q, K)."""
    q = checks.as_float(q_b, "q_b")
    C = checks.as_float(C, "C")
    checks.check_ndim(q, "q_b", 2, "(..., n_q, d)")
    d = checks.check_head_dim(q.shape[-1], "q_b.shape[-1] (head_dim)")
    if C.ndim != 3:
        raise ValueError(f"C: expected codebooks of shape (n_kv, K, {d}), got shape {tuple(C.shape)}")
    checks.check_codebook(C, d)
    n_q, n_kv, K = q.shape[-2], C.shape[0], C.shape[1]
    G = gqa_group(n_q, n_kv)
    s = attention_scale(scale, d)
    qg = q.reshape(q.shape[:-2] + (n_kv, G, d))
    lut = mm(s * qg, mx.swapaxes(C, -1, -2))
    return lut.reshape(q.shape[:-2] + (n_q, K))


def token_scores(lut, codes) -> mx.array:
    """RET-LUT: s[..., h, t] = lut[..., h, codes[..., h // G, t]]; -> (..., n_q, T)."""
    lut = checks.as_float(lut, "lut")
    c = checks.as_codes(codes)
    checks.check_ndim(lut, "lut", 2, "(..., n_q, K)")
    checks.check_ndim(c, "codes", 2, "(..., n_kv, T)")
    n_q, K = lut.shape[-2:]
    n_kv, T = c.shape[-2:]
    G = gqa_group(n_q, n_kv)
    checks.check_codes_range(c, K)
    lead = checks.check_broadcast(lut.shape[:-2], c.shape[:-2], "lut[..., :-2]", "codes[..., :-2]")
    idx = mx.broadcast_to(c.astype(mx.int32)[..., :, None, :], lead + (n_kv, G, T)).reshape(lead + (n_q, T))
    return mx.take_along_axis(mx.broadcast_to(lut, lead + (n_q, K)), idx, axis=-1)


def topk_count(T: int, topk, n_candidates: int | None = None) -> int:
    """RET-TOPK: float topk in (0, 1] -> int(topk * T) (floor, the authors' int()); int topk >= 1 -> topk;
    then at most n_candidates when given."""
    T = checks.check_pos_int(T, "T")
    count = int(topk) if checks.check_topk(topk) else int(float(topk) * T)
    if n_candidates is not None:
        count = min(count, checks.check_nonneg_int(n_candidates, "n_candidates"))
    return count


def _fixed_sets(T: int, i: int, w: int, sinks: int):
    """Boolean (T,) masks: sink, window, candidate (all restricted to j <= i)."""
    j = mx.arange(T)
    causal = j <= i
    sink = (j < sinks) & causal
    window = (i - j < w) & causal
    return sink, window, causal & ~sink & ~window


def check_select_args(T, n_q, n_kv_heads, query_pos, w, sinks, topk):
    """RET-SELECT preconditions (pure Python, no host sync); returns (G, i, w, sinks, n_candidates)."""
    checks.check_pos_int(n_kv_heads, "n_kv_heads")
    G = gqa_group(n_q, n_kv_heads)
    i = checks.check_nonneg_int(query_pos, "query_pos")
    if i >= T:
        raise ValueError(f"query_pos: expected a position in [0, {T - 1}] for {T} scored tokens, got {i}")
    w = checks.check_nonneg_int(w, "w")
    sinks = checks.check_nonneg_int(sinks, "sinks")
    checks.check_topk(topk)
    return G, i, w, sinks, _n_candidates(i, w, sinks)


def _n_candidates(i: int, w: int, sinks: int) -> int:
    # j in [0, i] minus the sinks [0, sinks) and the window (i - w, i]; the two may overlap.
    lo = min(sinks, i + 1)
    hi = max(lo, i + 1 - w)
    return hi - lo


def own_token_only(k: int, w: int, sinks: int) -> bool:
    """RET-SELECT never-empty rule: no sinks, no window and a top-k count of 0 would select nothing;
    the query's own token i is selected then (and only then)."""
    return k == 0 and w == 0 and sinks == 0


def _topk_indices(scores: mx.array, cand: mx.array, k: int) -> mx.array:
    masked = mx.where(cand, scores, -mx.inf)
    return mx.argpartition(-masked, kth=k - 1, axis=-1)[..., :k]


def select_tokens(scores, *, n_kv_heads: int, query_pos: int, w: int, sinks: int, topk) -> mx.array:
    """RET-SELECT: bool mask (..., n_kv, T) = union over the GQA group of per-head top-k, plus sinks and window."""
    s = checks.as_float(scores, "scores")
    checks.check_ndim(s, "scores", 2, "(..., n_q, T)")
    n_q, T = s.shape[-2:]
    G, i, w, sinks, _ = check_select_args(T, n_q, n_kv_heads, query_pos, w, sinks, topk)
    k = topk_count(i + 1, topk, _n_candidates(i, w, sinks))
    sink, window, cand = _fixed_sets(T, i, w, sinks)
    if own_token_only(k, w, sinks):
        window = mx.arange(T) == i
    lead = s.shape[:-2]
    keep = mx.broadcast_to(sink | window, lead + (n_kv_heads, T))
    if k == 0:
        return keep
    idx = _topk_indices(s, cand, k)
    picked = mx.put_along_axis(mx.zeros(s.shape, dtype=mx.bool_), idx, mx.array(True), axis=-1)
    picked = mx.any(picked.reshape(lead + (n_kv_heads, G, T)), axis=-2)
    return keep | picked


def attend(q, k, v, bias, scale: float, out_dtype) -> mx.array:
    """Grouped softmax attention (RET-ATTN, PREFILL); q (..., n_kv, G, d), k/v (..., n_kv, S, *), bias (..., n_kv, 1 or G, S)."""
    logits = mm(scale * q, mx.swapaxes(k, -1, -2)) + bias
    p = mx.softmax(logits, axis=-1, precise=True)
    return mm(p, v).astype(out_dtype)


def retrieval_attention(q, k, v, mask, *, scale=None) -> mx.array:
    """RET-ATTN: exact softmax attention of post-RoPE q over the selected keys of its KV head; -> (..., n_q, dv)."""
    q = checks.as_float(q, "q")
    k = checks.as_float(k, "k")
    v, vdt = checks.as_value_float(v, "v")
    m = checks.as_array(mask, "mask")
    if m.dtype != mx.bool_:
        raise ValueError(f"mask: expected a bool array (..., n_kv, T), got dtype {m.dtype}")
    checks.check_ndim(q, "q", 2, "(..., n_q, d)")
    checks.check_ndim(k, "k", 3, "(..., n_kv, T, d)")
    checks.check_ndim(v, "v", 3, "(..., n_kv, T, dv)")
    d = q.shape[-1]
    n_q = q.shape[-2]
    n_kv, T = k.shape[-3], k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"k: expected head_dim {d} (from q) on the last axis, got shape {tuple(k.shape)}")
    if v.shape[-3:-1] != (n_kv, T):
        raise ValueError(f"v: expected shape (..., {n_kv}, {T}, dv) to match k, got {tuple(v.shape)}")
    if m.shape[-2:] != (n_kv, T):
        raise ValueError(f"mask: expected shape (..., {n_kv}, {T}) to match k, got {tuple(m.shape)}")
    G = gqa_group(n_q, n_kv)
    if not mx.all(mx.any(m, axis=-1)).item():
        raise ValueError("mask: every KV head needs at least one selected token (found an empty row)")
    lead = checks.check_broadcast(q.shape[:-2], k.shape[:-3], "q[..., :-2]", "k[..., :-3]")
    lead = checks.check_broadcast(lead, m.shape[:-2], "q/k leading dims", "mask[..., :-2]")
    qg = q.reshape(q.shape[:-2] + (n_kv, G, d))
    bias = mx.where(m, 0.0, -mx.inf)[..., :, None, :]
    out = attend(qg, k, v, bias, attention_scale(scale, d), vdt)
    checks.check_no_overflow(out, "retrieval_attention output (RET-ATTN)", "q . k logits (q, k or scale) or v")
    return out.reshape(out.shape[:-3] + (n_q, v.shape[-1]))


def decode_step(
    q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional, scale=None,
    return_mask: bool = False,
):
    """RET-DECODE: q_b = far_query(q_post, positions=query_pos), LUT, token scores, select, exact attention.

    q_post (..., n_q, d), k_post (..., n_kv, T, d), v (..., n_kv, T, dv), codes (..., n_kv, T),
    C (n_kv, K, d) key-space codebooks -> (..., n_q, dv) [, mask (..., n_kv, T)].
    """
    q = checks.as_float(q_post, "q_post")
    checks.check_ndim(q, "q_post", 2, "(..., n_q, d)")
    kk = checks.as_array(k_post, "k_post")
    checks.check_ndim(kk, "k_post", 3, "(..., n_kv, T, d)")
    qb = far_query(q, b=b, inv_freqs=inv_freqs, traditional=traditional, positions=query_pos)
    lut = lut_scores(qb, C, scale=scale)
    c = checks.as_codes(codes)
    if c.shape[-2:] != kk.shape[-3:-1]:
        raise ValueError(f"codes: expected shape (..., n_kv, T) = (..., {kk.shape[-3]}, {kk.shape[-2]}), got {tuple(c.shape)}")
    s = token_scores(lut, c)
    mask = select_tokens(s, n_kv_heads=kk.shape[-3], query_pos=query_pos, w=w, sinks=sinks, topk=topk)
    out = retrieval_attention(q, kk, v, mask, scale=scale)
    return (out, mask) if return_mask else out
