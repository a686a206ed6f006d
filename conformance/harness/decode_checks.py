"""RET-DECODE, CACHE-DECODE: the shared check of a decode result. The selection must be an allowed selection
under the oracle's scores (RET-SELECT's must and may sets, and each query head's own top-k count), and the
output exact attention over that selection."""

import numpy as np

from a2ats_spec import oracle


def _f64(ctx, x):
    return ctx.cast(x).astype(np.float64)


def check_head_counts(ctx, mask, scores, *, n_kv_heads, query_pos, w, sinks, topk, margin, clause, what):
    """RET-SELECT's count, per query head: the selection holds at least k of the head's allowed top-k tokens
    (ties resolved by the allowed set). must ⊆ mask ⊆ may alone lets a top-k take one tied token too few (long
    contexts: the k-th score nearly always falls in a code that many tokens share, and `must` then holds none of
    them). No upper bound here: a decode may take a tie at the k-th score whole (the sort-free step does)."""
    m = np.asarray(mask)
    held, _, k = oracle.select_tokens_head_counts(m, scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w,
                                                      sinks=sinks, topk=topk, margin=margin)
    short = np.argwhere(held < k)
    if short.size:
        shown = ", ".join(f"head {tuple(h.tolist()) if h.size > 1 else int(h[0])}: {int(held[tuple(h)])}"
                          for h in short[:6])
        ctx.fail(clause, f"{what}: {len(short)} query head(s) hold fewer than their top-k count k = {k} of their "
                 f"allowed tokens (ties at the k-th score taken short?)", f"{shown} of k = {k}")


def check_decode(ctx, out, mask, inp, clause, *, margin_clause=None):
    """mask must be an allowed selection under the oracle's scores; out = exact attention over that mask.

    margin_clause: whose tie margin judges the selection (default ``clause``); the near-tie property uses
    RET-LUT's, the accuracy of the scores being ranked. ``inp["scale"]`` (absent or None: 1/sqrt(d)) is the
    attention scale the port was given; the expected output uses it, so a port that drops it fails."""
    o = {k: (_f64(ctx, v) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v) for k, v in inp.items()}
    o["inv_freqs"] = ctx.cast(inp["inv_freqs"], param=True).astype(np.float64)
    qb = oracle.far_query(o["q_post"], b=o["b"], inv_freqs=o["inv_freqs"], traditional=o["traditional"],
                          positions=o["query_pos"])
    scale = inp.get("scale")
    scores = oracle.token_scores(oracle.lut_scores(qb, o["C"], scale=scale), o["codes"])
    n_kv = o["k_post"].shape[0]
    must, may = oracle.select_tokens_allowed(scores, n_kv_heads=n_kv, query_pos=o["query_pos"], w=o["w"],
                                             sinks=o["sinks"], topk=o["topk"], margin=ctx.margin(margin_clause or clause, scores))
    ctx.assert_mask_allowed(mask, must, may, clause=clause, what="selected set",
                            selection=dict(scores=scores, query_pos=o["query_pos"], w=o["w"], sinks=o["sinks"],
                                           topk=o["topk"]))
    check_head_counts(ctx, mask, scores, n_kv_heads=n_kv, query_pos=o["query_pos"], w=o["w"], sinks=o["sinks"],
                      topk=o["topk"], margin=ctx.margin(margin_clause or clause, scores), clause=clause,
                      what="selected set")
    exact = oracle.retrieval_attention(o["q_post"], o["k_post"], o["v"], np.asarray(mask), scale=scale)
    shown = "1/sqrt(d)" if scale is None else f"{scale!r}"
    ctx.assert_close(out, exact, clause=clause,
                     what=f"output vs exact attention (scale={shown}) over the selected post-RoPE keys")
