"""Pictures of a bench run, written beside its results page when matplotlib is installed (``pip install '.[plot]'``).

- ``recall``: attention-mass recall against the top-k budget, A2ATS with the exact top-K and WRoPE-ceiling curves;
- ``decode``: one decode attention step's time against context length, A2ATS and dense, per dtype;
- ``e2e``: generated tokens per second against context, end to end, dense and A2ATS.

Each function returns the path it wrote, or None where the run holds nothing to draw. ``available()`` says whether
matplotlib can be imported; without it the bench writes its pages and prints one line saying the plots were skipped.
"""

from __future__ import annotations

from pathlib import Path

#: method key in a fidelity run -> (label, line style); the ceilings are dashed
RECALL_CURVES = {
    "exact_topk": ("exact top-K (the model's ceiling)", "--"),
    "oracle": ("exact top-K (the model's ceiling)", "--"),
    "wrope_true_keys": ("WRoPE with the true keys (the ceiling of VQ)", "--"),
    "query_aware_vq": ("query-aware VQ (A2ATS)", "-"),
    "a2ats": ("query-aware VQ (A2ATS)", "-"),
    "plain_vq": ("plain VQ", "-"),
    "window_sinks": ("window + sinks alone", ":"),
}


def available() -> bool:
    try:
        import matplotlib  # noqa: F401  # deferred: matplotlib is the optional [plot] extra
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib  # deferred: matplotlib is the optional [plot] extra

    matplotlib.use("Agg")   # files only: no display, no GUI backend on a headless machine
    import matplotlib.pyplot as plt  # deferred: the optional [plot] extra

    return plt


def _pct(key: str) -> float:
    return float(str(key).rstrip("%"))


def recall_curves(res: dict) -> dict:
    """method -> [(budget %, recall)], from either fidelity layout (default profile: per budget, then method;
    authors' profile: per method, then budget)."""
    rec = res.get("recall", {}).get("attention_mass_recall") if isinstance(res.get("recall"), dict) else None
    curves: dict = {}
    if isinstance(rec, dict):
        for method, by_budget in rec.items():
            if isinstance(by_budget, dict):
                curves[method] = sorted((_pct(k), float(v)) for k, v in by_budget.items())
    else:
        for budget, by_method in (res.get("attention_mass_recall") or {}).items():
            for method, v in (by_method or {}).items():
                if isinstance(v, (int, float)):
                    curves.setdefault(method, []).append((_pct(budget), float(v)))
        curves = {m: sorted(p) for m, p in curves.items()}
    return curves


def recall_plot(res: dict, path) -> Path | None:
    curves = recall_curves(res)
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, pts in curves.items():
        if method.endswith("_bf16"):
            continue   # draws on top of its float32 curve
        label, style = RECALL_CURVES.get(method, (method, "-"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label)
    ax.set_xscale("log")
    budgets = sorted({p[0] for pts in curves.values() for p in pts})
    ax.set_xticks(budgets, [f"{b:g}%" for b in budgets])
    ax.set_xlabel("top-k budget (share of the context)")
    ax.set_ylabel("attention-mass recall")
    ax.set_title(f"Recall against the top-k budget ({res.get('profile', '')})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def decode_plot(res: dict, path) -> Path | None:
    rows = [r for r in res.get("decode_step") or [] if "dense_ms" in r and "a2ats_ms" in r]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for dt in dict.fromkeys(r["dtype"] for r in rows):
        mine = sorted((r for r in rows if r["dtype"] == dt), key=lambda r: r["T"])
        Ts = [r["T"] for r in mine]
        line = ax.plot(Ts, [r["a2ats_ms"] for r in mine], "-", marker="o", label=f"A2ATS, {dt}")[0]
        ax.plot(Ts, [r["dense_ms"] for r in mine], "--", marker="s", color=line.get_color(), label=f"dense, {dt}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel("ms per decode attention step (one layer)")
    ax.set_title(f"Decode step against context, {_device(res)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def e2e_plot(res: dict, path) -> Path | None:
    e2e = res.get("e2e_smollm2") or {}
    rows = sorted(e2e.get("rows") or [], key=lambda r: r["context"])
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ctx = [r["context"] for r in rows]
    ax.plot(ctx, [r["a2ats"]["tokens_per_s"] for r in rows], "-", marker="o", label="A2ATS")
    ax.plot(ctx, [r["dense"]["tokens_per_s"] for r in rows], "--", marker="s", label="dense KVCache")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("generated tokens per second")
    ax.set_title(f"End to end, {e2e.get('model', 'SmolLM2')}, {_device(res)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def _device(res: dict) -> str:
    m = res.get("machine") or {}
    gpu = m.get("gpu")
    return gpu["name"] if gpu and gpu.get("name") else f"{m.get('cpu', 'CPU')}, {m.get('cores', '?')} cores"


def _save(fig, plt, path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
