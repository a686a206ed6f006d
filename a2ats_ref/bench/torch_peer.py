"""RET-DECODE's peer: PyTorch's scaled_dot_product_attention over every cached token, the kernel a GPU user runs.

One decode query per sequence against B cached sequences of T tokens, grouped-query (``enable_gqa``), in the
dtype of the A2ATS row it sits beside. On CUDA, SDPA takes its flash / memory-efficient kernel for these
shapes. PyTorch is not a dependency: where it cannot be imported, ``unavailable()`` says why once and the
tables leave the column out rather than fill it with anything else.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time

_STATE: dict = {}


def _torch():
    """(torch module or None, reason it is missing or None); imported once per process."""
    if "torch" not in _STATE:
        try:
            _STATE["torch"], _STATE["why"] = importlib.import_module("torch"), None
        except Exception as exc:  # noqa: BLE001 - any import failure means no peer column, reported once
            _STATE["torch"], _STATE["why"] = None, f"PyTorch is not importable here ({type(exc).__name__}: {exc})"
    return _STATE["torch"], _STATE["why"]


def unavailable() -> str | None:
    """None where the peer can run; else the reason, printed to stderr the first time it is asked."""
    _, why = _torch()
    if why and not _STATE.get("told"):
        _STATE["told"] = True
        print(f"[a2ats-bench] {why}: the PyTorch SDPA column is left out", file=sys.stderr, flush=True)
    return why


def device() -> str | None:
    torch, _ = _torch()
    if torch is None:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


def describe() -> dict | None:
    torch, _ = _torch()
    if torch is None:
        return None
    dev = device()
    return {"torch": torch.__version__, "device": dev,
            "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None,
            "kernel": "torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)"}


def sdpa_decode_ms(*, B: int, n_q: int, n_kv: int, T: int, d: int, dtype_name: str, reps: int = 30,
                   warmup: int = 10) -> dict | None:
    """Median ms of one SDPA decode step (B sequences, one query each, T keys); None where PyTorch is absent.

    On CUDA each step is timed alone between two synchronisations, as the MLX rows are timed with mx.eval,
    so launch and synchronisation costs count on both sides."""
    if unavailable():
        return None
    torch = _STATE["torch"]
    F = torch.nn.functional
    dev = device()
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # the float32 row stays float32, as MLX's is timed
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, n_q, 1, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(B, n_kv, T, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(B, n_kv, T, d, device=dev, dtype=dt, generator=g)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    step = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    q = k = v = None   # freed before empty_cache hands the memory back
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps, "device": dev,
            "bytes_read": 2 * B * n_kv * T * d * torch.empty((), dtype=dt).element_size()}
