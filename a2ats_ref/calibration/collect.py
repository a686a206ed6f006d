"""Collect calibration statistics from a running mlx-lm model.

For every (layer, KV head) we need (EQ-10, EQ-17):
- the pre-RoPE keys of all calibration tokens (k-means runs on them, so they are kept, float32);
- the second moment of the R_b-rotated pre-RoPE queries, pooled over the GQA group. Queries are not
  kept: ``sum q~^T q~`` (float64) and the number of (head, token) rows are accumulated on the fly.

Capture point: each attention module calls ``self.rope(queries, offset=...)`` and then
``self.rope(keys, offset=...)`` on the projected (and, where the model has them, q/k-normed)
heads. Replacing the module's ``rope`` by a pass-through that records its input sees exactly
the pre-RoPE q and k, for any architecture that follows that pattern (the ones
``a2ats_ref.runtime.hook.SUPPORTED_MODULES`` lists). The first call of a forward pass is the queries,
the second the keys; the head counts are checked against the module's.

Sequences are prefilled in chunks through an mlx-lm KVCache, so every chunk sees its full causal
context; each sequence starts from an empty cache. Only what the captured q and k depend on is computed:
no LM head, no final norm, no attention output or MLP in the last layer, and attention itself as
``causal_attention`` (BLAS score blocks, NumPy's exp) instead of MLX's CPU kernel (see there).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from a2ats_ref import _blas
from a2ats_ref.rope import rope_apply, rope_params_from_module


def attention_layers(model) -> list:
    """Each layer's attention module (the child that owns ``rope``), in layer order."""
    body = getattr(model, "model", model)
    layers = getattr(model, "layers", None) or getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"model: {type(model).__name__} has no .layers; expected an mlx-lm decoder model")
    out = []
    for i, layer in enumerate(layers):
        attn = next(
            (getattr(layer, n) for n in ("self_attn", "attention", "attn") if hasattr(getattr(layer, n, None), "rope")),
            None,
        )
        if attn is None:
            raise ValueError(
                f"model: layer {i} ({type(layer).__name__}) has no attention module with a RoPE (`rope`); "
                "A2ATS calibrates models that use rotary position embeddings"
            )
        out.append(attn)
    return out


def head_counts(attn) -> tuple[int, int, int]:
    """(n_q, n_kv, head_dim) of an mlx-lm attention module."""
    n_q = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) or getattr(attn, "num_attention_heads", None)
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None) or n_q
    d = getattr(attn, "head_dim", None)
    if d is None and n_q:
        w = attn.q_proj.weight
        out_features = w.shape[0]
        d = out_features // n_q
    if not (n_q and n_kv and d):
        raise ValueError(f"model: cannot read the head counts of {type(attn).__name__}")
    return int(n_q), int(n_kv), int(d)


@dataclass
class Collected:
    """What calibration needs, per layer l: keys[l] (n_kv, N, d) float32 pre-RoPE keys, qsum[l] (n_kv, d, d)
    float64 (sum over group heads and tokens of q~^T q~, q~ = q R_b), qcount[l] rows summed per KV head."""

    keys: list
    qsum: list
    qcount: list
    n_tokens: int
    b: int
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)


class _Capture(nn.Module):
    """Stands in for an attention module's ``rope``: records the pre-RoPE q (1st call) and k (2nd)."""

    def __init__(self, rope, layer: int, sink: "_Sink"):
        super().__init__()
        self.inner = rope
        self._layer = layer
        self._sink = sink
        self._calls = 0

    def __call__(self, x, *args, **kwargs):
        if self._sink.active:
            (self._sink.on_queries if self._calls % 2 == 0 else self._sink.on_keys)(self._layer, x)
            self._calls += 1
        return self.inner(x, *args, **kwargs)


class _Sink:
    def __init__(self, n_layers, n_q, n_kv, d, b, inv_freqs, traditional):
        self.active = False
        self.n_q, self.n_kv, self.d, self.b = n_q, n_kv, d, b
        self.inv_freqs, self.traditional = inv_freqs, traditional
        self.q_parts: list[list] = [[] for _ in range(n_layers)]  # per chunk, (n_kv, d, d) float32
        self.k_parts: list[list] = [[] for _ in range(n_layers)]
        self.qcount = [0] * n_layers
        self.n_layers, self.layer = n_layers, -1

    def on_queries(self, layer: int, q: mx.array):
        B, H, T, d = q.shape
        if H != self.n_q or d != self.d:
            raise ValueError(f"layer {layer}: expected queries with {self.n_q} heads of dim {self.d}, got {q.shape}")
        G = self.n_q // self.n_kv
        # Raw second moment sum q^T q per KV head; R_b is applied once at the end (rotated_sums), since
        # sum (q R_b)^T (q R_b) = R_b^T (sum q^T q) R_b. Keeps the per-chunk work to one small matmul.
        qf = q.astype(mx.float32).reshape(B, self.n_kv, G, T, d).transpose(1, 0, 2, 3, 4).reshape(self.n_kv, B * G * T, d)
        self.q_parts[layer].append(mx.swapaxes(qf, -1, -2) @ qf)
        self.qcount[layer] += B * G * T

    def rotated_sums(self, layer: int, raw: np.ndarray) -> np.ndarray:
        """sum over rows of q~^T q~ (q~ = q R_b) from the raw sum of q^T q, float64."""
        R = np.array(
            rope_apply(mx.eye(self.d, dtype=mx.float32), self.b, self.inv_freqs[layer], traditional=self.traditional[layer])
        ).astype(np.float64)  # x R_b == rope_apply(x, b) for row vectors x
        return R.T @ raw @ R

    def on_keys(self, layer: int, k: mx.array):
        self.layer = layer  # the attention call that follows is this layer's (see _host_attention)
        B, H, T, d = k.shape
        if H != self.n_kv or d != self.d:
            raise ValueError(f"layer {layer}: expected keys with {self.n_kv} heads of dim {self.d}, got {k.shape}")
        self.k_parts[layer].append(k.astype(mx.float32).transpose(1, 0, 2, 3).reshape(self.n_kv, B * T, d))


#: Host attention blocks: ATTN_ROWS query rows x ATTN_KEYS keys of float32 scores (1.5 MiB) stay in a core's
#: L2 while NumPy exponentiates them (1,024-key blocks, 3 MiB: 97 vs 87 ms per 16K-key layer call)
ATTN_ROWS, ATTN_KEYS = 768, 512
#: threads that share one attention call's key blocks (each runs NumPy's BLAS on one thread)
ATTN_WORKERS = max(1, min(4, os.cpu_count() or 1))
_attn_pool: ThreadPoolExecutor | None = None


def causal_attention(queries: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                     rows: int = ATTN_ROWS, block: int = ATTN_KEYS) -> mx.array:
    """Causal softmax attention of end-aligned queries (as mlx-lm's prefill with mask="causal"), float32.

    Why not mx.fast.scaled_dot_product_attention: on MLX's Linux CPU backend its softmax calls a scalar
    exp (~80M/s measured, against ~2G/s for NumPy's SIMD exp), so a 16K-token calibration document spent
    most of its collection time in exp. Here NumPy does it all, block by block: scores S^T = K Q^T for
    ``block`` keys x ``rows`` query rows, exp in place, and an online softmax (running max, rescaled per key
    block) whose weighted values come from [V, 1]^T P^T (the last row is the softmax's denominator).
    The key blocks of each (batch, KV head, row block) are split into ATTN_WORKERS contiguous parts run by
    as many threads, each with NumPy's BLAS on one thread, and the parts' (max, sums) merged as the online
    softmax merges blocks. Measured against the previous form (MLX's GEMMs on its stream thread beside NumPy
    on this one, one part), on 9 query heads x 256 queries against 16,384 keys on the 2-core Xeon: 134-139
    -> 87-95 ms. Same value as the fused kernel up to float32 rounding.
    queries (B, n_q, Tq, d), keys (B, n_kv, Tk, d), values (B, n_kv, Tk, dv), Tq <= Tk.
    """
    global _attn_pool
    B, n_q, Tq, d = queries.shape
    n_kv, Tk, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    G = n_q // n_kv
    qs = (queries * scale).reshape(B, n_kv, G * Tq, d)  # GQA: a group shares one GEMM
    # NumPy has no bfloat16: such inputs are widened first (exactly) instead of failing the buffer conversion
    qs, keys, values = (a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in (qs, keys, values))
    mx.eval(qs, keys, values)
    Q, K, V = np.asarray(qs), np.asarray(keys), np.asarray(values)
    last = np.tile(np.arange(Tk - Tq, Tk), G)  # last key each row (group head g, query t) may see
    # Part starts at block boundaries that every row sees (<= Tk - Tq), so each part's running max is finite.
    n_blocks = -(-(Tk - Tq + 1) // block)
    per = -(-n_blocks // ATTN_WORKERS)
    starts = list(range(0, n_blocks * block, per * block)) + [Tk]
    if _attn_pool is None:
        _attn_pool = ThreadPoolExecutor(ATTN_WORKERS, thread_name_prefix="attention")
    out = np.empty((B, n_kv, G * Tq, dv), np.float32)
    with _blas.numpy_blas_threads(1):
        jobs = []
        for b in range(B):
            for h in range(n_kv):
                vt = np.concatenate([V[b, h].T, np.ones((1, Tk), np.float32)])
                for r in range(0, G * Tq, rows):
                    qt = np.ascontiguousarray(Q[b, h, r : r + rows].T)
                    lim = last[r : r + rows]
                    parts = [_attn_pool.submit(_attention_part, qt, K[b, h], vt, lim, s0, s1, block)
                             for s0, s1 in zip(starts[:-1], starts[1:])]
                    jobs.append((b, h, r, parts))
        for b, h, r, parts in jobs:
            res = [f.result() for f in parts]
            top = res[0][0]
            for m, _ in res[1:]:
                top = np.maximum(top, m)
            acc = res[0][1] * np.exp(res[0][0] - top)
            for m, a in res[1:]:
                acc += a * np.exp(m - top)
            out[b, h, r : r + rows] = (acc[:dv] / acc[dv:]).T
    return mx.array(out).reshape(B, n_q, Tq, dv).astype(queries.dtype)


def _attention_part(qt: np.ndarray, k: np.ndarray, vt: np.ndarray, lim: np.ndarray, s0: int, s1: int,
                    block: int) -> tuple[np.ndarray, np.ndarray]:
    """Online softmax of query rows qt (d, rows) over keys [s0, s1) of k: (running max, [sum p v; sum p])."""
    run_max = np.full(lim.size, -np.inf, np.float32)
    acc = np.zeros((vt.shape[0], lim.size), np.float32)  # [sum_j p_j v_j ; sum_j p_j], one column per row
    buf = np.empty((block, lim.size), np.float32)
    for s in range(s0, min(s1, int(lim.max()) + 1), block):
        e = min(s + block, s1)
        p = np.matmul(k[s:e], qt, out=buf[: e - s])
        if e - 1 > lim.min():
            p[np.arange(s, e)[:, None] > lim[None, :]] = -np.inf
        new_max = np.maximum(run_max, p.max(axis=0))  # finite: key s0 is seen by every row
        np.subtract(p, new_max, out=p)
        np.exp(p, out=p)
        acc *= np.exp(run_max - new_max)
        acc += vt[:, s:e] @ p
        run_max = new_max
    return run_max, acc


_SDPA = "scaled_dot_product_attention"  # the name mlx-lm's model modules bind (see a2ats_ref.runtime.hook)


def _host_attention(previous, sink: "_Sink"):
    """A stand-in for a model module's ``scaled_dot_product_attention`` during collection.

    Causal float32 attention on the CPU goes to causal_attention. The last layer's attention output feeds
    nothing collection keeps (its keys and queries are captured before it), so it is handed back lazily
    from ``previous`` and never evaluated, nor are that layer's MLP and the final norm. Anything else
    (another mask, attention sinks, other dtypes, a GPU) goes to ``previous``, the binding it replaces.
    """

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        causal = isinstance(mask, str) and mask == "causal" or (mask is None and queries.shape[2] == 1)
        if (sink.layer == sink.n_layers - 1 or sinks is not None or not causal or queries.dtype != mx.float32
                or mx.default_device().type != mx.cpu):
            kw = {} if sinks is None else {"sinks": sinks}
            return previous(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        return causal_attention(queries, keys, values, scale=scale)

    return scaled_dot_product_attention


def host_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x = gate * x / (1 + exp(-gate)), float32, with NumPy's exp (MLX's CPU sigmoid is scalar:
    it took about 40% of a SmolLM2 layer's time on 256-token chunks). Same value up to float32 rounding."""
    mx.eval(gate, x)
    g = np.array(gate, copy=False)
    with np.errstate(over="ignore"):  # exp(-gate) is inf for gate < -88: the quotient is then -0.0, silu's limit
        t = np.exp(-g)
    t += 1.0
    np.divide(g, t, out=t)
    t *= np.array(x, copy=False)
    return mx.array(t)


def _host_swiglu(previous):
    def swiglu(gate, x):
        if gate.dtype != mx.float32 or x.dtype != mx.float32 or mx.default_device().type != mx.cpu:
            return previous(gate, x)
        return host_swiglu(gate, x)

    return swiglu


@contextlib.contextmanager
def _collection_kernels(attns, sink: "_Sink"):
    """While collecting, bind _host_attention (and _host_swiglu where the module uses mlx-lm's ``swiglu``) in
    each attention module's Python module, as a2ats_ref.runtime.hook does for decoding; restored on exit."""
    from mlx_lm.models import activations  # deferred: mlx-lm loads transformers (~1 s); only a model needs it

    saved = []
    for m in (sys.modules[n] for n in dict.fromkeys(type(a).__module__ for a in attns)):
        if callable(getattr(m, _SDPA, None)):
            saved.append((m, _SDPA, getattr(m, _SDPA), _host_attention(getattr(m, _SDPA), sink)))
        if getattr(m, "swiglu", None) is activations.swiglu:
            saved.append((m, "swiglu", m.swiglu, _host_swiglu(m.swiglu)))
    try:
        for m, name, _, fn in saved:
            setattr(m, name, fn)
        yield
    finally:
        for m, name, fn, _ in saved:
            setattr(m, name, fn)


def model_rope_params(model) -> tuple[list, list[bool]]:
    """Per layer (inv_freqs, traditional); ValueError for a model without a supported RoPE."""
    attns = attention_layers(model)
    invs, trads = [], []
    for attn in attns:
        _, _, d = head_counts(attn)
        inv, trad = rope_params_from_module(attn.rope, d)
        invs.append(inv)
        trads.append(trad)
    return invs, trads


def collect(
    model,
    sequences: Iterable[Sequence[int]],
    *,
    b: int,
    chunk: int = 512,
    progress: Callable[[int, int], None] | None = None,
    total_tokens: int | None = None,
) -> Collected:
    """Run ``model`` over token ``sequences`` (each from an empty cache) and gather EQ-10/EQ-17 inputs."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache  # deferred: mlx-lm loads transformers (~1 s); only a model needs it

    if chunk < 1:
        raise ValueError(f"chunk: expected a positive number of tokens per prefill step, got {chunk}")
    attns = attention_layers(model)
    n_layers = len(attns)
    counts = {head_counts(a) for a in attns}
    if len(counts) != 1:
        raise ValueError(f"model: layers differ in head counts {sorted(counts)}; not supported")
    n_q, n_kv, d = counts.pop()
    if n_q % n_kv:
        raise ValueError(f"model: {n_kv} KV heads do not divide {n_q} query heads")
    invs, trads = model_rope_params(model)
    sink = _Sink(n_layers, n_q, n_kv, d, b, invs, trads)
    body = getattr(model, "model", model)
    originals = [a.rope for a in attns]
    for i, a in enumerate(attns):
        a.rope = _Capture(originals[i], i, sink)
    t0 = time.perf_counter()
    done = 0
    qsum = [np.zeros((n_kv, d, d), np.float64) for _ in range(n_layers)]
    keys_np: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
    try:
        sink.active = True
        with _collection_kernels(attns, sink):
            for seq in sequences:
                seq = list(seq)
                if not seq:
                    continue
                cache = make_prompt_cache(model)
                for c in cache:
                    if type(c) is KVCache:
                        # mlx-lm's KVCache grows by `step` tokens, copying the whole cache each time (at 16K
                        # tokens ~0.75 GB per 256-token chunk for SmolLM2): sized for the sequence at once.
                        c.step = max(c.step, -(-len(seq) // 256) * 256)
                for s in range(0, len(seq), chunk):
                    ids = mx.array(seq[s : s + chunk])[None]
                    body(ids, cache=cache)  # not evaluated: what follows the last layer's keys is never needed
                    mx.eval([sink.q_parts, sink.k_parts], [c.state for c in cache])
                    for l in range(n_layers):
                        for part in sink.q_parts[l]:
                            qsum[l] += np.array(part, dtype=np.float64)
                        for part in sink.k_parts[l]:
                            keys_np[l].append(np.array(part))
                        sink.q_parts[l].clear()
                        sink.k_parts[l].clear()
                    done += ids.shape[1]
                    if progress is not None:
                        progress(done, total_tokens or done)
    finally:
        sink.active = False
        for a, r in zip(attns, originals):
            a.rope = r
    keys = [np.concatenate(parts, axis=1) if parts else np.zeros((n_kv, 0, d), np.float32) for parts in keys_np]
    qsum = [sink.rotated_sums(l, qsum[l]) for l in range(n_layers)]
    return Collected(
        keys=keys,
        qsum=qsum,
        qcount=list(sink.qcount),
        n_tokens=done,
        b=b,
        seconds=time.perf_counter() - t0,
        meta={"n_layers": n_layers, "n_q": n_q, "n_kv": n_kv, "head_dim": d},
    )


def token_flops(model, sequences) -> np.ndarray:
    """Nominal FLOPs of each calibration token, in collection order: 2 per layer weight plus the causal
    attention (q k^T and p v: 4 d FLOPs per query head and key the token sees). Rates from these are
    effective rates: collection skips part of this work (the last layer's attention output and MLP)."""
    attns = attention_layers(model)
    n_q, _, d = head_counts(attns[0])
    n_weights = sum(v.size for k, v in tree_flatten(model.parameters()) if ".layers." in f".{k}" and "layers" in k)
    per_key = 4.0 * d * n_q * len(attns)
    parts = [2.0 * n_weights + per_key * np.arange(1, len(s) + 1, dtype=np.float64) for s in sequences]
    return np.concatenate(parts) if parts else np.zeros(0)


def collect_rates(model, sequences, seconds: float) -> dict:
    """Tokens/s and effective GFLOP/s (token_flops over wall seconds) of a collection."""
    n_tok = sum(len(s) for s in sequences)
    flop = float(token_flops(model, sequences).sum())
    ok = seconds > 0
    return {"collect_tokens_per_s": round(n_tok / seconds, 1) if ok else None,
            "collect_gflops": _blas.gflops(flop, seconds)}


def moment_from_sums(qsum: np.ndarray, count: int, *, ridge: float = 1e-6) -> mx.array:
    """EQ-10 from accumulated sums: H = qsum / count, then H / sqrt(mean(H**2)) + ridge*I (float32).

    Same formula as ``eq10_query_moment.query_moment`` (which takes the queries themselves);
    sums are accumulated in float64 so 80K-token calibrations do not lose precision.
    """
    if count < 1:
        raise ValueError("no calibration queries were collected (count = 0)")
    if not (np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge: expected a finite non-negative number (default 1e-6), got {ridge!r}")
    H = np.asarray(qsum, dtype=np.float64) / count
    rms = np.sqrt(np.mean(H * H, axis=(-2, -1), keepdims=True))
    if np.any(rms <= 0) or not np.all(np.isfinite(H)):
        raise ValueError("calibration queries of a KV head are all zero or non-finite; H cannot be normalised")
    d = H.shape[-1]
    return mx.array((H / rms + ridge * np.eye(d)).astype(np.float32))


def text_progress(label: str, *, stream=sys.stderr, every: float = 1.0,
                  flops: np.ndarray | None = None) -> Callable[[int, int], None]:
    """A plain-text progress printer: ``label  done/total  pct  elapsed  eta``, at most once per ``every`` s.
    flops: cumulative nominal FLOPs after each item (cumsum of token_flops), to print the effective GFLOP/s."""
    t0 = time.perf_counter()
    last = [-1e9]

    def report(done: int, total: int):
        now = time.perf_counter()
        if now - last[0] < every and done < total:
            return
        last[0] = now
        el = now - t0
        frac = done / total if total else 1.0
        eta = el / frac - el if frac > 0 else float("nan")
        rate = f", {flops[done - 1] / el / 1e9:.1f} GFLOP/s" if flops is not None and 0 < done <= flops.size and el > 0 else ""
        stream.write(f"\r{label}: {done}/{total} ({100 * frac:5.1f}%) {el:6.0f}s elapsed, ~{eta:5.0f}s left{rate} ")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return report
