"""RET-DECODE under a kernel profiler: one decode step, bracketed so a profiler sees that step alone.

    ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \\
        python -m a2ats_ref.bench.decode_profile --method cuda --T 262144 --dtype float16 > step.csv
    python -m a2ats_ref.bench.decode_profile --summarize step.csv

The step runs at Llama-3.1-8B shapes on a2ats-bench's inputs (bench_speed.decode_step_inputs), warmed up (every
kernel compiled) before cudaProfilerStart; `--method dense` profiles mlx-lm's attention instead. It also prints
the host time to build the step's graph (no eval), the part of a step a GPU waits on when kernels are short.
No timing claims come from a profiled run: ratios come from a2ats-bench.

    python -m a2ats_ref.bench.decode_profile --parts --T 262144 --dtype float16     # MLX CUDA only

times, interleaved in one loop, dense, the CUDA step as decode_step_fast runs it, the same with its per-step
parameter array reused (what a fresh host array costs), and each of its kernels alone on fixed inputs (what a
launch costs), with the scan alone (the mask kernel): the breakdown README's GPU section quotes.

    python -m a2ats_ref.bench.decode_profile --pipelined --T 262144 --dtype float16

times dense and the step (--method, default auto) as a generation loop runs them: mlx-lm's generate_step builds
the next token's graph while the device computes the current one (mx.async_eval), so a step's host work hides
behind the previous step's device work. Each loop keeps one step in flight; the loops alternate in blocks. This
is throughput, not latency: a2ats-bench's decode rows time each step alone, host graph building included.

    python -m a2ats_ref.bench.decode_profile --host-build --T 8192 --dtype float16     # any machine

times the host side of a model's CUDA decode on any machine: per layer, an A2ATS cache's update_and_fetch and
decode on the CUDA path at SmolLM2-135M shapes, with every kernel launch answered from preallocated outputs, for
each launcher (MLX's JIT and the kept cubins), alternating. MLX's own per-launch work is left out with the
launch: what remains is this package's Python and the MLX ops it builds, the part of the fixed cost per layer
that no kernel change removes.

    python -m a2ats_ref.bench.decode_profile --resources --T 262144 --dtype float16   # needs NVRTC, no GPU

compiles the step's select and attend kernels for sm_90 (the H100's and H200's architecture) or this machine's
GPU, as the decode step launches them at Llama-3.1-8B shapes, and prints what ptxas reports (registers per thread,
shared memory, spills) and what that allows: resident blocks per SM, and the waves the step's grid takes on --sms
SMs. A kernel whose blocks wait on memory in turns runs in as many rounds as it has waves.

    python -m a2ats_ref.bench.decode_profile --first-use --dtype float16

times the CUDA step's first call for each of a few head shapes (FIRST_USE_SHAPES) in this process: compiling the
kernel instances of that shape and dtype (or loading their kept cubins, runtime.decode.precompiled), loading and
running them; then a second call. It names the launcher and counts the kept cubins and the files of these
kernels in MLX's JIT folder (MLX_PTX_CACHE_DIR): what a model pays at its first token, and a test run per head
shape it draws. Run it twice to see a second process's first call.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import glob
import os
import sys
import time
import warnings
from unittest import mock

from a2ats_ref import _blas

_blas.preload()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention

from a2ats_ref.bench import speed as bench_speed  # noqa: E402
from a2ats_ref.runtime.decode import dispatch  # noqa: E402
from a2ats_ref.runtime.decode import portable as fast_decode  # noqa: E402
from a2ats_ref.retrieval import topk_count
from a2ats_ref.runtime.decode import cuda as cd
from a2ats_ref.runtime.decode import precompiled
from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig  # noqa: E402
from a2ats_ref.runtime.codebook import random_codebook  # noqa: E402
from a2ats_ref.rope import rope_inv_freqs  # noqa: E402


def _cudart():
    """libcudart next to MLX's CUDA libraries (None on other backends: the brackets are then no-ops)."""
    roots = [p for p in sys.path if p.endswith("site-packages")]
    for root in roots:
        for lib in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"), recursive=True)):
            return ctypes.CDLL(lib)
    try:   # MLX may link the runtime statically: the system's then (profiler start/stop act on the shared context)
        return ctypes.CDLL("libcudart.so") if mx.default_device().type != mx.cpu else None
    except OSError:
        return None


def _case(T: int, dtype_name: str):
    """a2ats-bench's decode-step inputs at Llama-3.1-8B shapes, their decode_step_fast keywords, and dense."""
    x = bench_speed.decode_step_inputs(T, bench_speed.DTYPES[dtype_name], **bench_speed.LLAMA31_8B)
    kw = bench_speed.decode_step_kwargs(x, T, d=bench_speed.LLAMA31_8B["d"])
    dense = lambda: scaled_dot_product_attention(x["q"], x["k"], x["v"], x["cache"], scale=kw["scale"], mask=None)
    return x, kw, dense


def profile_step(method: str, T: int, dtype_name: str) -> dict:
    x, kw, dense = _case(T, dtype_name)
    step = dense if method == "dense" else (
        lambda: dispatch.decode_step_fast(x["q"], x["k"], x["v"], x["codes"], x["CT"], method=method, **kw))
    for _ in range(3):
        mx.eval(step())
    builds = []
    for _ in range(20):
        t0 = time.perf_counter()
        out = step()
        builds.append((time.perf_counter() - t0) * 1e3)
        mx.eval(out)
    mx.synchronize()
    rt = _cudart()
    if rt is not None:
        rt.cudaProfilerStart()
    mx.eval(step())
    mx.synchronize()
    if rt is not None:
        rt.cudaProfilerStop()
    return {"method": method, "T": T, "dtype": dtype_name, "device": str(mx.default_device()),
            "graph_build_ms_median": round(float(np.median(builds)), 4), "profiler_bracketed": rt is not None}


def parts(T: int, dtype_name: str, reps: int = 40) -> dict:
    """Median ms of the step and of its parts (see the module docstring); needs MLX's CUDA backend."""
    if not cd.on_cuda():
        raise SystemExit("--parts times the CUDA kernels: run it on MLX's CUDA backend")
    shape, K = bench_speed.LLAMA31_8B, 4096
    x, kw, dense = _case(T, dtype_name)
    inv, scale, (counts, _) = kw["inv_freqs"], kw["scale"], kw["code_counts"]
    _, c0, c1 = fast_decode._regions(T, kw["w"], kw["sinks"])
    kk = topk_count(T, kw["topk"], c1 - c0)
    S = fast_decode.sortfree_width(kk, shape["n_q"] // shape["n_kv"], K, c1 - c0)
    chunk = cd.chunk_for(T, shape["n_kv"])
    ip = cd.step_params(kk=kk, c0=c0, c1=c1, counted=T, S=S, kept=True, n=T, sinks=kw["sinks"], w=kw["w"],
                        b=float(kw["b"]), query_pos=float(T - 1), scale=scale, chunk=chunk)
    tab, lv, nsel = cd.select(x["q"], x["CT"], inv, counts, x["codes"], ip, traditional=False)
    mx.eval(ip, tab, lv, nsel)
    step = lambda: dispatch.decode_step_fast(x["q"], x["k"], x["v"], x["codes"], x["CT"], method="cuda", **kw)
    real_params = cd.step_params

    def step_reused_params():
        cd.step_params = lambda **_: ip
        try:
            return step()
        finally:
            cd.step_params = real_params

    fns = {
        "dense": dense,
        "cuda step": step, "cuda step, parameter array reused": step_reused_params,
        "empty eval": lambda: mx.array(1.0) + 1,
        "select (LUT, levels)": lambda: cd.select(x["q"], x["CT"], inv, counts, x["codes"], ip, traditional=False),
        "attend (scan, attention, merge)": lambda: cd.attend(x["q"], x["k"], x["v"], x["codes"], lv, nsel, ip, n=T,
                                                             chunk=chunk),
        "mask (the scan alone)": lambda: cd.selection_mask(x["codes"], lv, nsel, ip, n=T, chunk=chunk),
    }
    res = bench_speed.interleaved(fns, reps=reps, warmup=3)
    return {"T": T, "dtype": dtype_name, "median_ms": {k: round(v["median_ms"], 4) for k, v in res.items()}}


def _stand_in_outputs(spec: dict) -> list:
    """Zeros of a kernel launch's output shapes and dtypes: what a launcher that runs no kernel hands back."""
    return [mx.zeros(s, dtype=t) for s, t in zip(spec["output_shapes"], spec["output_dtypes"])]


#: per-SM limits of compute capability 9.0 (H100, H200), from the CUDA C++ Programming Guide's table of technical
#: specifications: 32-bit registers (allocated per warp in units of 256), resident threads and blocks, shared memory
#: bytes, and the shared memory the system reserves per block
SM90 = {"registers": 65536, "register_unit": 256, "threads": 2048, "blocks": 32, "smem": 233472, "smem_reserved": 1024}


def blocks_per_sm(registers: int, smem: int, threads: int, limits: dict = SM90) -> dict:
    """Resident blocks per SM of a kernel using ``registers`` per thread and ``smem`` bytes per block of
    ``threads`` threads, by each limit and overall (the smallest)."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // limits["register_unit"]) * limits["register_unit"]
    by = {"registers": limits["registers"] // max(1, per_warp * warps),
          "smem": limits["smem"] // (smem + limits["smem_reserved"]),
          "threads": limits["threads"] // threads, "blocks": limits["blocks"]}
    return {"blocks_per_sm": min(by.values()), "limited_by": min(by, key=by.get)}


def kernel_resources(T: int, dtype_name: str, *, batch: int = 1, sms: int = 132) -> list[dict]:
    """ptxas's report and the resulting residency of the step's kernels at Llama-3.1-8B shapes (see the module
    docstring); needs NVRTC and the CUDA headers (runtime.decode.precompiled finds them), not a GPU."""
    shape, K, dtype = bench_speed.LLAMA31_8B, 4096, bench_speed.DTYPES[dtype_name]
    G, n_kv, d = shape["n_q"] // shape["n_kv"], shape["n_kv"], shape["d"]
    try:
        arch = precompiled.compute_capability()
    except (RuntimeError, OSError):
        arch = (9, 0)
    specs = []

    def capture(name, **spec):
        specs.append((name, spec))
        return _stand_in_outputs(spec)
    capture.shapes_by_value = True
    # the launch specs only: the kernels never run, so small buffers stand in for T tokens
    cfg = A2ATSConfig()   # the cache's defaults, as the bench's step uses them
    q, kv = mx.zeros((batch, G * n_kv, 1, d), dtype=dtype), mx.zeros((batch, n_kv, 16, d), dtype=dtype)
    _, c0, c1 = fast_decode._regions(T, cfg.w, cfg.sinks)
    kk = topk_count(T, cfg.topk, c1 - c0)
    cd.decode(q, kv, kv, mx.zeros((batch, n_kv, 16), dtype=mx.uint16), mx.zeros((n_kv, d, K)), mx.zeros((d // 2,)),
              counts=mx.zeros((batch, n_kv, K), mx.int32), kept=True, kk=kk, c0=c0, c1=c1, counted=T,
              S=fast_decode.sortfree_width(kk, G, K, c1 - c0), n=T, sinks=cfg.sinks, w=cfg.w, b=float(cfg.b),
              query_pos=float(T - 1), scale=d ** -0.5, traditional=False, launch=capture)
    rows = []
    with mock.patch.object(precompiled, "compute_capability", lambda: arch):
        precompiled._instance.cache_clear()
        try:
            for name, spec in specs:
                symbol, source, _, _ = precompiled.source_for(name, spec)
                used = precompiled.resources(source, symbol, arch, precompiled.cuda_include())
                threads, grid = spec["threadgroup"][0], spec["grid"]
                blocks = (grid[0] // threads) * grid[1] * grid[2]
                res = blocks_per_sm(used["registers"], used["smem"], threads)
                rows.append({"kernel": name, "arch": f"sm_{arch[0]}{arch[1]}", "threads": threads, "blocks": blocks,
                             **used, **res, "waves": round(blocks / (res["blocks_per_sm"] * sms), 2)})
        finally:
            precompiled._instance.cache_clear()
    return rows


#: (G, n_kv, d, K) --first-use compiles for: shapes the conformance suite's cache properties draw, and Llama-3.1-8B's
FIRST_USE_SHAPES = ((1, 1, 64, 64), (2, 1, 128, 128), (2, 2, 64, 128), (4, 8, 128, 4096))


def _kernel_files() -> int | None:
    """Files of this package's kernels (named a2ats_...) in MLX's JIT folder, or None where no folder is set."""
    root = os.environ.get("MLX_PTX_CACHE_DIR")
    if not root:
        return None
    return sum(1 for _, _, files in os.walk(root) for f in files if "a2ats" in f)


def first_use(dtype_name: str, shapes=FIRST_USE_SHAPES, T: int = 4096) -> dict:
    """Seconds of the CUDA step's first and second call per head shape (see the module docstring)."""
    if not cd.on_cuda():
        raise SystemExit("--first-use times the CUDA kernels' compilation: run it on MLX's CUDA backend")
    dtype, rows = bench_speed.DTYPES[dtype_name], []
    for G, n_kv, d, K in shapes:
        x = bench_speed.decode_step_inputs(T, dtype, n_q=G * n_kv, n_kv=n_kv, d=d, K=K)
        kw = bench_speed.decode_step_kwargs(x, T, d=d, K=K)
        step = lambda: dispatch.decode_step_fast(x["q"], x["k"], x["v"], x["codes"], x["CT"], method="cuda", **kw)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            mx.eval(step())
            times.append(time.perf_counter() - t0)
        rows.append({"G": G, "n_kv": n_kv, "d": d, "K": K, "first_s": round(times[0], 3),
                     "second_s": round(times[1], 4)})
    kept = precompiled.cache_dir()
    return {"dtype": dtype_name, "T": T, "device": str(mx.default_device()), "shapes": rows,
            "launcher": precompiled.launcher(),
            "kept_cubins": len(list(kept.glob("*.cubin"))) if kept.is_dir() else 0,
            "mlx_jit_files_of_these_kernels": _kernel_files()}


#: SmolLM2-135M's attention (n_q, n_kv, d) and layer count; K as the authors calibrate
HOST_BUILD_SHAPE = dict(n_q=9, n_kv=3, d=64, K=4096, layers=30)


@contextlib.contextmanager
def _answered_launches():
    """The CUDA decode path with each kernel launch returning preallocated outputs (no GPU, no compiler); yields
    the launches answered per launcher."""
    outs, counts = {}, {precompiled.JIT: 0, precompiled.KEPT: 0}

    def answer(via, **spec):
        counts[via] += 1
        key = (tuple(map(tuple, spec["output_shapes"])), tuple(spec["output_dtypes"]))
        if key not in outs:
            outs[key] = _stand_in_outputs(spec)
            mx.eval(*outs[key])
        return outs[key]

    with mock.patch.object(cd, "on_cuda", lambda: True), \
            mock.patch.object(cd, "mlx_launch", lambda name, template=None, **spec: answer(precompiled.JIT, **spec)), \
            mock.patch.object(precompiled, "cubin", lambda symbol, source: b""), \
            mock.patch.object(precompiled, "compute_capability", lambda: (9, 0)), \
            mock.patch.object(precompiled, "nvrtc_version", lambda: "none"), \
            mock.patch.object(precompiled, "_CUBINS", {}), \
            mock.patch.object(mx.fast, "precompiled_cuda_kernel", lambda **spec: answer(precompiled.KEPT, **spec)):
        precompiled._instance.cache_clear()
        try:
            yield counts
        finally:
            precompiled._instance.cache_clear()


def host_build(T: int, dtype_name: str, *, steps: int = 40, rounds: int = 3, shape=HOST_BUILD_SHAPE) -> dict:
    """Median host microseconds per layer of a cache decode step on the CUDA path, kernels answered from
    preallocated outputs (see the module docstring), per launcher, in alternating rounds of `steps` steps."""
    n_q, n_kv, d, K, layers = (shape[k] for k in ("n_q", "n_kv", "d", "K", "layers"))
    dtype = bench_speed.DTYPES[dtype_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the random codebook's warning: selection quality is not timed here
        cb = random_codebook(layers, n_kv, d, K)
    inv = rope_inv_freqs(d, 10000.0)
    rng = np.random.default_rng(0)
    kv = mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype)
    k1 = mx.array(rng.standard_normal((1, n_kv, 1, d)).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((1, n_q, 1, d)).astype(np.float32)).astype(dtype)
    caches = [A2ATSCache(cb.layer(layer), inv, False, A2ATSConfig()) for layer in range(layers)]
    for c in caches:
        c.select_method = "cuda"
        c.update_and_fetch(kv, kv)
        mx.eval(c.keys, c.values, c.codes)
    launchers = {precompiled.JIT: "0", precompiled.KEPT: "1"}
    per = {name: [] for name in launchers}
    with _answered_launches() as launches, mock.patch.dict(os.environ):
        for r in range(rounds):
            for name in (list(launchers) if r % 2 == 0 else list(launchers)[::-1]):
                os.environ[precompiled.ENV] = launchers[name]
                for s in range(steps + 2):
                    t0 = time.perf_counter()
                    outs = []
                    for c in caches:
                        c.update_and_fetch(k1, k1)
                        outs.append(c.decode(q))
                    t1 = time.perf_counter()
                    mx.eval(outs, *[c.keys for c in caches], *[c.codes for c in caches])
                    if s >= 2:   # the first steps of a round build each instance once
                        per[name].append((t1 - t0) / layers * 1e6)
    return {"T": T, "dtype": dtype_name, "shape": dict(shape), "steps": steps * rounds,
            "host_us_per_layer": {name: round(float(np.median(v)), 1) for name, v in per.items()},
            "launches": dict(launches)}


def _pipelined_ms(fn, steps: int) -> float:
    """ms per step of `steps` calls of fn with one step in flight: build step k + 1, hand it to the device
    (async_eval), then wait for step k (as mlx-lm's generate_step yields the previous token)."""
    out = fn()
    mx.async_eval(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = fn()
        mx.async_eval(nxt)
        mx.eval(out)
        out = nxt
    mx.eval(out)
    return (time.perf_counter() - t0) * 1e3 / steps


def pipelined(T: int, dtype_name: str, method: str = "auto", *, steps: int = 50, blocks: int = 7) -> dict:
    """Dense and the A2ATS step in generation-loop order (_pipelined_ms), alternating blocks of `steps` steps:
    median ms per step and the median of the per-block ratios (dense / A2ATS)."""
    x, kw, dense = _case(T, dtype_name)
    step = lambda: dispatch.decode_step_fast(x["q"], x["k"], x["v"], x["codes"], x["CT"], method=method, **kw)
    for f in (dense, step):   # compile every kernel and graph first
        _pipelined_ms(f, 3)
    d, a = [], []
    for b in range(blocks):
        for name in (("dense", "a2ats") if b % 2 == 0 else ("a2ats", "dense")):
            (d if name == "dense" else a).append(_pipelined_ms(dense if name == "dense" else step, steps))
    return {"T": T, "dtype": dtype_name, "method": method, "device": str(mx.default_device()), "steps": steps,
            "blocks": blocks, "dense_ms": round(float(np.median(d)), 4), "a2ats_ms": round(float(np.median(a)), 4),
            "speedup": round(float(np.median([p / q for p, q in zip(d, a)])), 3)}


def summarize(path: str) -> str:
    """Kernel names and durations (us) from ncu's --csv output (metric gpu__time_duration.sum), and the total."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        raise ValueError(f"{path}: no ncu CSV rows (run ncu with --csv --metrics gpu__time_duration.sum)")
    head = rows[0]
    name, val, unit = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    lines, total = [], 0.0
    for r in rows[1:]:
        v = float(r[val].replace(",", ""))
        us = v / 1000.0 if r[unit] in ("ns", "nsecond") else v * 1000.0 if r[unit] in ("ms", "msecond") else v
        total += us
        lines.append(f"{us:9.1f} us  {r[name][:120]}")
    lines.append(f"total {total:.1f} us over {len(rows) - 1} kernels")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m a2ats_ref.bench.decode_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="auto", choices=("dense",) + fast_decode.METHODS)
    ap.add_argument("--T", type=int, default=262144)
    ap.add_argument("--dtype", default="float16", choices=tuple(bench_speed.DTYPES))
    ap.add_argument("--summarize", metavar="CSV", help="print the kernels of an ncu CSV instead of profiling")
    ap.add_argument("--parts", action="store_true", help="time the CUDA step's parts (MLX CUDA only), no profiler")
    ap.add_argument("--pipelined", action="store_true",
                    help="dense vs the step as a generation loop runs them (one step in flight), no profiler")
    ap.add_argument("--host-build", action="store_true",
                    help="host us per layer of a cache's CUDA decode step, kernels answered (any machine)")
    ap.add_argument("--first-use", action="store_true",
                    help="seconds of the CUDA step's first call per head shape (kernel compilation), no profiler")
    ap.add_argument("--resources", action="store_true",
                    help="registers, shared memory and resident blocks per SM of the step's kernels (NVRTC, no GPU)")
    ap.add_argument("--batch", type=int, default=1, help="--resources: sequences per step")
    ap.add_argument("--sms", type=int, default=132, help="--resources: SMs of the GPU (132 on an H100 or H200)")
    a = ap.parse_args(argv)
    if a.summarize:
        print(summarize(a.summarize))
        return 0
    if a.T < 256 or a.T % 256:
        ap.error("--T: a multiple of 256 (the bench's KVCache hands back its own buffer then)")
    if a.parts:
        print(parts(a.T, a.dtype))
        return 0
    if a.first_use:
        print(first_use(a.dtype))
        return 0
    if a.resources:
        if a.batch < 1 or a.sms < 1:
            ap.error("--batch and --sms: at least 1")
        try:
            rows = kernel_resources(a.T, a.dtype, batch=a.batch, sms=a.sms)
        except RuntimeError as e:
            ap.exit(2, f"--resources needs NVRTC and the CUDA headers: {e}\n")
        for row in rows:
            print(row)
        return 0
    if a.host_build:
        print(host_build(a.T, a.dtype))
        return 0
    if a.pipelined:
        if a.method == "dense":
            ap.error("--pipelined times dense beside --method: give an A2ATS method (default auto)")
        print(pipelined(a.T, a.dtype, a.method))
        return 0
    print(profile_step(a.method, a.T, a.dtype), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
