"""Adapter for the MLX reference (a2ats_ref): the default implementation under test.

NumPy in, NumPy out: float arrays become mx arrays of the same dtype (float32 arrays become
bfloat16 when the suite sets ``input_dtype = "bfloat16"``), integer and bool arrays keep their
dtype; results come back as NumPy (bfloat16 results as float32).  The cache factory wraps
``a2ats_ref.runtime.cache.A2ATSCache`` in the NumPy cache protocol of README-ADAPTER.md (a batch of one, or
``config["batch"]`` rows with a leading batch axis).

The cache is built the way users get it: ``make_a2ats_cache`` on a one-layer model whose attention holds the
model's own rope module (nn.RoPE, or Llama3RoPE with the config's frequencies), so codes and the decode query
are de-rotated with the angles mx.fast.rope applied (fast_rope, the angle tables). A third form, A2ATSCache
built by hand from inv_freqs alone (no rope module), is supported too; each config draws one of the three
forms from its codebook's bytes (``rope_form``: the same config always builds the same form, so a replay
rebuilds the failing cache). Prefill and decode go through the attention hook (a2ats_ref.runtime.hook), as a model's
attention calls them: long causal prefills take the host kernel there.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
import zlib
from importlib.metadata import version

import a2ats_ref  # noqa: F401  (first: it loads the fast BLAS, which must happen before mlx is imported)
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from a2ats_ref.calibration.collect import causal_attention
from a2ats_ref.codes import code_dtype
from a2ats_ref.rope import rope_inv_freqs
from a2ats_ref.runtime.decode.dispatch import decode_step_fast
from a2ats_ref.runtime.decode.portable import prepare_codebook

from a2ats_conformance.harness.adapter import FUNCTION_NAMES

# Where each reference function lives (a2ats_ref/__init__ may re-export them; the lead owns it).
_MODULES = ("rope", "eq10_query_moment", "eq11_wrope_scores", "eq12_far_keys", "eq13_score_error", "eq14_assign",
            "eq15_cholesky", "eq16_z_transform", "eq17_kmeans", "eq18_back_transform", "retrieval", "prefill", "codes")

#: How a cache is built: the three forms a user can hold (see the module docstring).
ROPE_FORMS = ("nn.RoPE", "Llama3RoPE", "inv_freqs")


def _find(name: str):
    pkg = importlib.import_module("a2ats_ref")
    fn = getattr(pkg, name, None)
    if callable(fn):
        return fn
    for m in _MODULES:
        try:
            mod = importlib.import_module(f"a2ats_ref.{m}")
        except ImportError:
            continue
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def to_mx(x, bf16: bool = False):
    if isinstance(x, np.ndarray):
        a = mx.array(x)
        if bf16 and x.dtype == np.float32:
            a = a.astype(mx.bfloat16)
        return a
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, np.ndarray) for v in x):
        return type(x)(to_mx(v, bf16) for v in x)
    return x


def to_np(x):
    if isinstance(x, tuple):
        return tuple(to_np(v) for v in x)
    if isinstance(x, list):
        return [to_np(v) for v in x]
    if isinstance(x, mx.array):
        if x.dtype == mx.bfloat16:
            x = x.astype(mx.float32)
        return np.array(x)
    if isinstance(x, mx.Dtype):
        return np.dtype(str(x).rsplit(".", 1)[-1])
    return x


def wrap(fn, adapter):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        bf16 = getattr(adapter, "input_dtype", None) == "bfloat16"
        a = [to_mx(v, bf16) for v in args]
        kw = {k: to_mx(v, bf16 and k not in ("inv_freqs", "uniforms")) for k, v in kwargs.items()}
        return to_np(fn(*a, **kw))
    return call


def _version() -> str:
    try:
        return f"{version('a2ats-ref')} (mlx {mx.__version__})"
    except Exception:  # noqa: BLE001 - metadata is optional in a source checkout
        return f"source (mlx {mx.__version__})"


class ReferenceAdapter:
    """a2ats_ref behind the NumPy adapter protocol."""

    name = "a2ats_ref (MLX reference)"
    dtypes = ("float32", "float16", "bfloat16")

    def __init__(self):
        self.version = _version()
        self.input_dtype = None
        for fn_name in FUNCTION_NAMES:
            if callable(getattr(type(self), fn_name, None)):
                continue  # a subclass (e.g. a mutant) defines it
            fn = _find(fn_name)
            if fn is not None:
                setattr(self, fn_name, wrap(fn, self))

    def make_cache(self, config: dict):
        return ReferenceCache(config)

    def collection_attention(self, q, k, v, *, scale=None):
        """PREFILL: calibration's collection attention (a2ats_ref.calibration.collect.causal_attention), (B, n_q, Tq, d)."""

        if np.ndim(q) != 4 or np.ndim(k) != 4 or np.ndim(v) != 4:
            raise ValueError("collection_attention: expected q (B, n_q, Tq, d), k (B, n_kv, Tk, d), v (B, n_kv, Tk, dv), "
                             f"got {np.shape(q)}, {np.shape(k)}, {np.shape(v)}")
        bf16 = self.input_dtype == "bfloat16"
        s = float(np.shape(q)[-1] ** -0.5 if scale is None else scale)
        return to_np(causal_attention(*(to_mx(np.asarray(a), bf16) for a in (q, k, v)), scale=s))


class SortFreeReference(ReferenceAdapter):
    """The reference with its runtime decode path forced to the sort-free selection (fast_decode,
    method="sortfree"): RET-DECODE runs decode_step_fast itself and every cache decodes with it, so the
    suite checks on any backend the path that method="auto" takes on GPUs
    (``--iut a2ats_conformance.adapters.reference:SortFreeReference``)."""

    name = "a2ats_ref (MLX reference, sort-free decode path)"
    method = "sortfree"

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        if np.ndim(q_post) != 2 or np.ndim(k_post) != 3:
            raise ValueError(f"{self.name}: decode_step takes one sequence, q_post (n_q, d) and k_post (n_kv, T, d)")
        bf16 = self.input_dtype == "bfloat16"
        q, k, vv = (to_mx(np.asarray(a), bf16) for a in (q_post, k_post, v))
        out, mask = decode_step_fast(q[None, :, None, :], k[None], vv[None], mx.array(np.asarray(codes))[None],
                                     prepare_codebook(mx.array(np.asarray(C, np.float32))), query_pos=query_pos,
                                     b=b, w=w, sinks=sinks, topk=topk, inv_freqs=np.asarray(inv_freqs, np.float32),
                                     traditional=traditional, scale=scale, method=self.method, return_mask=True)
        out = to_np(out[0, :, 0, :])
        return (out, to_np(mask[0])) if return_mask else out

    def make_cache(self, config: dict):
        cache = ReferenceCache(config)
        cache._c.select_method = self.method
        return cache


def rope_form(config: dict) -> str:
    """The form (ROPE_FORMS) a config's cache is built in: drawn from its codebook's bytes, so it varies from
    example to example and a replay of the same config builds the same form."""
    return ROPE_FORMS[zlib.crc32(np.ascontiguousarray(config["Cz"]).tobytes()) % len(ROPE_FORMS)]


def _rope_module(config: dict):
    """The rope module of a model whose RoPE is the config's: nn.RoPE when inv_freqs are a base's (as every
    default-RoPE model has), else a Llama3RoPE holding the config's frequencies (mx.fast.rope's freqs form)."""
    from mlx_lm.models.rope_utils import Llama3RoPE  # deferred: needs mlx-lm, unlike function calls

    d, trad = int(config["head_dim"]), bool(config["traditional"])
    inv = np.asarray(config["inv_freqs"], np.float64)
    if rope_form(config) == "nn.RoPE":
        base = 10000.0 if d == 2 else float(np.round(inv[1] ** -(d // 2)))
        if base > 1 and np.allclose(np.array(rope_inv_freqs(d, base)), inv, rtol=1e-6, atol=0):
            return nn.RoPE(d, traditional=trad, base=base)
    rope = Llama3RoPE.__new__(Llama3RoPE)   # its angles from the given frequencies, as a llama3 model's rope holds them
    nn.Module.__init__(rope)
    rope.dims, rope.traditional = d, trad
    rope._freqs = mx.array((1.0 / inv).astype(np.float32))
    return rope


class _Attention:
    """The parts of an mlx-lm attention module make_a2ats_cache reads."""

    def __init__(self, config: dict):
        self.rope = _rope_module(config)
        self.n_kv_heads, self.head_dim = int(config["n_kv_heads"]), int(config["head_dim"])


class _Layer:
    def __init__(self, config: dict):
        self.self_attn = _Attention(config)


class _OneLayerModel:
    """The smallest model make_a2ats_cache builds a cache for: one layer whose attention holds the rope module."""

    def __init__(self, config: dict):
        self.layers = [_Layer(config)]


def _build_cache(config: dict):
    # deferred: needs mlx-lm, unlike function calls
    from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig, make_a2ats_cache
    from a2ats_ref.runtime.codebook import CodebookLayer

    Cz, L = (mx.array(np.asarray(config[k], np.float32)) for k in ("Cz", "L"))
    cfg = A2ATSConfig(w=config["w"], b=config["b"], sinks=config["sinks"], topk=config["topk"])
    if rope_form(config) == "inv_freqs":
        return A2ATSCache(CodebookLayer.from_z(Cz, L), mx.array(np.asarray(config["inv_freqs"], np.float32)),
                          bool(config["traditional"]), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a random-codebook or validation warning here would be a wiring bug
        (cache,) = make_a2ats_cache(_OneLayerModel(config), (Cz[None], L[None]), cfg)
    return cache


def _attention_hook():
    """mlx-lm's attention function as a model module binds it once a2ats_ref.runtime.hook.enable_a2ats has run."""
    from mlx_lm.models.base import scaled_dot_product_attention  # deferred: needs mlx-lm, unlike function calls

    from a2ats_ref.runtime.hook import _make_dispatcher  # deferred: needs mlx-lm, unlike function calls

    global _HOOKED
    if _HOOKED is None:
        _HOOKED = _make_dispatcher(scaled_dot_product_attention)
    return _HOOKED


_HOOKED = None


class ReferenceCache:
    """NumPy view of one layer's A2ATSCache; see README-ADAPTER.md, cache protocol (batch included)."""

    def __init__(self, config: dict, _cache=None):
        self.config = dict(config)
        self.batched = config.get("batch") is not None
        self._c = _build_cache(config) if _cache is None else _cache

    def _scale(self, d: int) -> float:
        s = self.config.get("scale")
        return d ** -0.5 if s is None else float(s)   # mlx-lm's attention modules always pass a scale

    def _in(self, x):
        """Protocol array -> mx with the cache's leading batch axis."""
        a = mx.array(x)
        return a if self.batched else a[None]

    def _out(self, x):
        """mx (B, ...) -> NumPy, without the batch axis for an unbatched cache."""
        return to_np(x if self.batched else x[0])

    @property
    def offset(self) -> int:
        return int(self._c.offset)

    def _empty_rows(self):
        return (self.config["batch"],) if self.batched else ()

    def append(self, keys_post, values) -> None:
        self._c.update_and_fetch(self._in(keys_post), self._in(values))

    def decode(self, q_post):
        q = self._in(q_post)[:, :, None, :]
        k, v = self._c.keys_and_values()
        # mlx-lm's mask for one query is None (create_attention_mask)
        out = _attention_hook()(q, k, v, cache=self._c, scale=self._scale(q.shape[-1]), mask=None)
        return self._out(out[:, :, 0, :]), self._out(self._c.last_selection)

    def prefill(self, q_post):
        k, v = self._c.keys_and_values()
        q = self._in(q_post)
        out = _attention_hook()(q, k, v, cache=self._c, scale=self._scale(q.shape[-1]), mask="causal")
        return self._out(out)

    def trim(self, n: int) -> int:
        return int(self._c.trim(n))

    def codes(self):
        if self.offset == 0:
            shape = self._empty_rows() + (self.config["n_kv_heads"], 0)
            return np.zeros(shape, code_dtype(np.asarray(self.config["Cz"]).shape[1]))
        return self._out(self._c.codes_view())

    def positions(self):
        return to_np(self._c.positions)

    def keys_values(self):
        if self._c.keys is None or self.offset == 0:
            shape = self._empty_rows() + (self.config["n_kv_heads"], 0, self.config["head_dim"])
            return np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        k, v = self._c.keys_and_values()
        return self._out(k), self._out(v)

    def save(self, path: str) -> None:
        from a2ats_ref.files.cache import save_a2ats_cache  # deferred: needs mlx-lm, unlike function calls

        save_a2ats_cache(_st(path), [self._c])

    def load(self, path: str) -> "ReferenceCache":
        from a2ats_ref.runtime.codebook import Codebook  # deferred: needs mlx-lm, unlike function calls
        from a2ats_ref.files.cache import load_a2ats_cache  # deferred: needs mlx-lm, unlike function calls

        lc = self._c.codebook
        cb = Codebook(lc.Cz[None], lc.L[None])
        (cache,) = load_a2ats_cache(_st(path), cb)
        cache.select_method = self._c.select_method
        return ReferenceCache(self.config, cache)


def _st(path: str) -> str:
    path = os.fspath(path)
    return path if path.endswith(".safetensors") else path + ".safetensors"
