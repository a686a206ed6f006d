"""Failure messages that name the behaviour: the parameters that selected the code
path, and, for RET-SELECT / RET-DECODE / CACHE-DECODE, each wrong token with its role.

A failure reads like a compiler diagnostic: ``error[CLAUSE]: what failed``, then ``note:`` the RoPE
layout, b, w, sinks, the positions and the dtype of the failing call (``not an input`` where the
check has none), then ``help:`` the likely cause (diagnosis/diagnose.py).
"""

from __future__ import annotations

import numpy as np

from a2ats_spec import oracle

__all__ = ["parameter_note", "layout_name", "explain_selection"]

#: keyword arguments / notes / cache-config keys that carry positions
_POSITION_KEYS = ("positions", "q_positions", "k_positions", "query_pos", "i", "p0", "shift")


def layout_name(traditional) -> str:
    return ("traditional, pairs (x[2i], x[2i+1])" if bool(traditional)
            else "half-split, pairs (x[i], x[i+d/2])")


def _short(v) -> str:
    a = np.asarray(v)
    if a.ndim == 0:
        return f"{a.item():g}" if a.dtype.kind == "f" else str(a.item())
    flat = a.reshape(-1)
    if flat.size <= 6:
        return "[" + ", ".join(str(x) for x in flat.tolist()) + "]"
    return f"[{flat.min()}..{flat.max()}] ({flat.size} values)"


def _parameters(ctx) -> dict:
    """The selecting parameters of the failing example: call kwargs (latest wins), cache config, notes."""
    found: dict = {}
    sources = [ctx.notes]
    for name, args, kw in reversed(ctx.calls):
        sources.append(kw)
        if name == "make_cache" and args and isinstance(args[0], dict):
            sources.append(args[0])
            found.setdefault("positions", "the cache's 0..offset-1")
        if name in ("rope_apply", "rope_invert", "far_keys") and len(args) > 1:
            found.setdefault("positions", _short(args[1]))
    for src in sources:
        for key in ("traditional", "b", "w", "sinks", "topk"):
            if key in src and src[key] is not None and key not in found:
                found[key] = src[key]
        for key in _POSITION_KEYS:
            if key in src and src[key] is not None and f"pos:{key}" not in found:
                found[f"pos:{key}"] = _short(src[key])
    return found


def parameter_note(ctx) -> str:
    """One line: RoPE layout, b, w, sinks, topk, positions and dtype of the failing example."""
    p = _parameters(ctx)
    parts, absent = [], []
    if "traditional" in p:
        parts.append(f"RoPE layout {layout_name(p['traditional'])}")
    else:
        absent.append("RoPE layout")
    for key in ("b", "w", "sinks"):
        (parts.append(f"{key}={p[key]}") if key in p else absent.append(key))
    if "topk" in p:
        parts.append(f"topk={p['topk']}")
    pos = [f"{k[4:]}={v}" for k, v in p.items() if k.startswith("pos:")]
    if "positions" in p and not any(x.startswith("positions=") for x in pos):
        pos.insert(0, str(p["positions"]) if p["positions"].startswith("the cache") else f"positions={p['positions']}")
    (parts.append("positions: " + ", ".join(pos)) if pos else absent.append("positions"))
    parts.append(f"dtype {ctx.dtype}")
    if absent:
        parts.append(f"not inputs of this check: {', '.join(absent)}")
    return "; ".join(parts)


def _roles(T: int, i: int, w: int, sinks: int) -> list[str]:
    roles = []
    for j in range(T):
        if j > i:
            roles.append(f"after the query (j > i = {i})")
        elif j < sinks:
            roles.append(f"sink (j < sinks = {sinks}), always kept")
        elif i - j < w:
            roles.append(f"window (i - j = {i - j} < w = {w}), always kept")
        else:
            roles.append(f"candidate (i - j = {i - j} >= w = {w})")
    return roles


def _inferred_k(mask_g: np.ndarray, scores_g: np.ndarray, cand: np.ndarray) -> int | None:
    """Smallest k' whose per-head top-k' union over the group holds every selected candidate."""
    chosen = mask_g & cand
    idx = np.flatnonzero(cand)
    if not chosen.any():
        return 0
    orders = [idx[np.argsort(-s[idx], kind="stable")] for s in scores_g]
    for k in range(1, idx.size + 1):
        union = np.zeros_like(cand)
        for o in orders:
            union[o[:k]] = True
        if not (chosen & ~union).any():
            return k
    return None


def explain_selection(mask, must, may, *, scores, query_pos: int, w: int, sinks: int, topk, limit: int = 8) -> str:
    """Each wrong token (missing or extra) with its role, KV head, score and margin to the top-k cut,
    and the expected against the actual per-head k. ``scores`` (n_q, T) are the oracle's."""
    m = np.asarray(mask, bool)
    s = np.asarray(scores, np.float64)
    while s.ndim > 2:                 # leading dims: explain the first row that is wrong
        bad = np.flatnonzero([((must[n] & ~m[n]) | (m[n] & ~may[n])).any() for n in range(s.shape[0])])
        n = int(bad[0]) if bad.size else 0
        s, m, must, may = s[n], m[n], must[n], may[n]
    n_kv, T = m.shape
    G = s.shape[0] // n_kv
    i = int(query_pos)
    j = np.arange(T)
    forced = (j <= i) & ((j < sinks) | (i - j < w))
    cand = (j <= i) & ~forced
    k = oracle.topk_count(i + 1, topk, int(cand.sum()))
    roles = _roles(T, i, w, sinks)
    cut_hi, cut_lo = [], []   # per query head: k-th and (k+1)-th best candidate score
    for h in range(s.shape[0]):
        desc = np.sort(s[h, cand])[::-1]
        cut_hi.append(desc[k - 1] if 0 < k <= desc.size else np.inf)
        cut_lo.append(desc[k] if k < desc.size else -np.inf)
    lines = []
    for kind, wrong in (("missing", must & ~m), ("extra", m & ~may)):
        for g, t in np.argwhere(wrong)[:limit].tolist():
            heads = range(g * G, (g + 1) * G)
            h = max(heads, key=lambda x: s[x, t])
            line = f"{kind} token {t} (KV head {g}): {roles[t]}, score {s[h, t]:.6g} (query head {h})"
            if cand[t] and kind == "missing":
                line += f", {s[h, t] - cut_lo[h]:+.3g} above the (k+1)-th best {cut_lo[h]:.6g}: in every valid top-{k}"
            elif cand[t]:
                line += f", {s[h, t] - cut_hi[h]:+.3g} against the k-th best {cut_hi[h]:.6g}: in no valid top-{k}"
            lines.append(line)
    got = (m & cand).sum(axis=-1)
    if G == 1:
        lines.append(f"per-head k: expected {k} (topk={topk} of i + 1 = {i + 1} visible tokens, "
                     f"{int(cand.sum())} candidates), got {got.tolist()}")
    else:
        inferred = [_inferred_k(m[g], s[g * G:(g + 1) * G], cand) for g in range(n_kv)]
        lines.append(f"per-head k: expected {k} (topk={topk} of i + 1 = {i + 1} visible tokens, {int(cand.sum())} "
                     f"candidates; union over G={G} heads holds {k}..{G * k}), got {got.tolist()} selected "
                     f"candidates per KV head, i.e. per-head k = {inferred} (None: not a union of per-head top-k)")
    return "\n  ".join(lines)
