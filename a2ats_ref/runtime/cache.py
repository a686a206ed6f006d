"""CACHE-* — A2ATSCache, an mlx-lm KV cache that also keeps one A2ATS code per token and KV head.

The cache holds the post-RoPE keys and values exactly as mlx-lm hands them (same
256-token preallocation and slice assignment as mlx-lm's KVCache) plus, per token
and KV head, the index of the nearest z-space codeword of the token's
position-free key (EQ-12 de-rotation at the token's own position, then EQ-16
assignment z = k L -> nearest row of Cz). Codes are computed once per token and
nothing already cached is ever re-rotated. A prefill chunk (more than one token)
is coded as it is appended; a decode token's code is first read when it leaves the
recent window (window tokens are always attended), so decode assigns the pending
tokens in one batch when the oldest of them is about to leave it (one codebook read
per ~w tokens instead of one per token), and codes_view()/state assign whatever is
pending on demand. A code does not depend on
when it is computed, so every clause sees the same codes as with eager assignment.

The class reads as mlx-lm's KVCache protocol and hands the A2ATS work to modules by concern: runtime.buffers
(growing buffers, CACHE-CHUNK), runtime.coding (code assignment and per-code counts, CACHE-FAR-CODES),
runtime.decode.step (the decode step and the query's angle, CACHE-DECODE), runtime.batching (merge and copies,
CACHE-BATCH). Its codebook is one layer of a runtime.codebook.Codebook (``codebook.layer(l)``).

Attention itself is chosen by the hook (a2ats_ref.runtime.hook.enable_a2ats):
a generated token's query -> `A2ATSCache.decode` (RET-DECODE: LUT scores from the codes,
top-k per query head, GQA union, sinks + window, exact attention over the
selected post-RoPE keys); prompt tokens -> dense causal attention (PREFILL), a
prompt token that mlx-lm feeds alone included (runtime.prompt).

The cache deliberately has no `bits` attribute: mlx-lm routes any cache that has
one to its quantized attention.

Batches: every sequence of a batch selects its own tokens, but all sequences must
share the same positions (equal-length batches, no left padding). An empty cache (nothing
appended, or trimmed to 0) takes any batch size: its buffers start afresh.
"""

from __future__ import annotations

import json
import numbers
import warnings
import weakref
from dataclasses import asdict, dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from a2ats_ref import checks
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.runtime import buffers, codebook as _codebook, coding, prompt
from a2ats_ref.runtime.batching import copy_cache, merge, refuse_mlx_lm_save
from a2ats_ref.runtime.codebook import RANDOM_CODEBOOK_WARNING, Codebook, CodebookLayer, random_codebook
from a2ats_ref.runtime.coding import assign_codes  # noqa: F401  (re-exported for the cache's importers)
from a2ats_ref.runtime.decode import step as decode_step
from a2ats_ref.runtime.threads import mark_thread
from a2ats_ref.rope import fast_rope_args, fast_rope_from_json, fast_rope_to_json, rope_params_from_module

__all__ = [
    "A2ATSConfig",
    "A2ATSCache",
    "make_a2ats_cache",
    "random_codebook",
    "attention_modules",
    "assign_codes",
]

#: names of the codebook types before they became one: each is still importable from here, with a warning
_DEPRECATED = {"A2ATSCodebook": "Codebook", "LayerCodebook": "CodebookLayer"}


def __getattr__(name):
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(f"a2ats_ref.runtime.cache.{name} is deprecated: use a2ats_ref.runtime.codebook.{new}",
                      DeprecationWarning, stacklevel=2)
        return getattr(_codebook, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


NO_HOOK_WARNING = (
    "A2ATS caches are in use but the model's attention never called A2ATSCache.decode: mlx-lm ran dense attention "
    "over every token. Call a2ats_ref.hook.enable_a2ats(model) once before generating."
)
_warned_no_hook = [False]   # once per process: a server's every request would repeat it


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class A2ATSConfig:
    """Decode-time retrieval parameters (the authors' defaults).

    w: recent window (tokens with i - j < w are always attended), b: the constant
    relative position of far tokens (R_b), sinks: first tokens always attended,
    topk: float fraction in (0, 1] of the sequence length (int(topk * T)) or an
    int count of extra tokens per query head.
    """

    w: int = 64
    b: int = 2048
    sinks: int = 8
    topk: float | int = 0.03

    def __post_init__(self):
        for name in ("w", "b", "sinks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"A2ATSConfig.{name}: expected a non-negative int, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.b >= checks.B_LIMIT:
            raise ValueError(f"A2ATSConfig.b: expected b < 2^24 = {checks.B_LIMIT} (float32 does not hold every "
                             f"integer above; the authors use 2048), got {self.b}")
        checks.check_topk(self.topk)  # ValueError names topk and the accepted forms
        t = self.topk
        object.__setattr__(self, "topk", int(t) if isinstance(t, numbers.Integral) else float(t))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "A2ATSConfig":
        try:
            d = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"A2ATSConfig: expected a JSON object, got {text!r} ({exc})") from None
        if not isinstance(d, dict) or set(d) - {"w", "b", "sinks", "topk"}:
            raise ValueError(f"A2ATSConfig: expected keys w, b, sinks, topk, got {d!r}")
        return cls(**d)


# --------------------------------------------------------------------------- the cache


class A2ATSCache(_BaseCache):
    """mlx-lm KV cache with A2ATS codes; see the module docstring.

    Public read-only views for adapters: `keys_and_values()`, `codes_view()` (B, n_kv, T),
    `positions` (T,), `decode(queries, scale=...)`, `last_selection` (B, n_kv, T) bool after a decode.
    """

    step = 256
    #: decode_step_fast's selection method ("auto": chosen per device; "host", "mlx", "sortfree" force one)
    select_method = "auto"
    #: most tokens coded in one batch (bounds the (n_kv, batch, K) distance block of a long prefill)
    CODE_BATCH_MAX = 2048

    def __init__(self, codebook: CodebookLayer, inv_freqs, traditional: bool, config: Optional[A2ATSConfig] = None,
                 *, fast_rope: Optional[dict] = None):
        self.codebook, self.config = _checked(codebook, config)
        self.inv_freqs = checks.check_inv_freqs(inv_freqs, codebook.head_dim)
        self.traditional = checks.check_bool(traditional, "traditional")
        # EQ-12 on the device: the mx.fast.rope arguments the model used (None: keys were rotated by m * inv_freqs)
        self.fast_rope = fast_rope
        buffers.clear(self)   # keys, values, codes, offset; _coded, _counts, _counts_mx (runtime.coding)
        self._last_selection = None
        self._undecoded = False   # the last append was one token and no decode has read it (no hook)
        prompt.cleared(self)   # which tokens are prompt tokens, how many are prefilled (runtime.prompt)

    # ---- mlx-lm protocol
    def update_and_fetch(self, keys, values):
        mark_thread()
        buffers.check_kv(self, keys, values)
        _note_append(self, keys.shape[2])
        buffers.append(self, keys, values)
        prompt.appended(self, self.offset - keys.shape[2])
        if keys.shape[2] > 1:
            # A prefill chunk is coded with it: left pending, a long prefill's tokens would all be coded by the
            # first decode (a 32K prompt: seconds in one step, no progress). Decode appends stay pending.
            self._assign_pending(self.offset)
        return self.keys_and_values()

    def keys_and_values(self):
        return buffers.valid(self)

    def codes_view(self) -> mx.array:
        """Codes of the cached tokens, (B, n_kv, T) (pending ones are assigned now)."""
        if self.codes is None:
            return mx.zeros((0, self.codebook.n_kv_heads, 0), mx_code_dtype(self.codebook.K))
        self._assign_pending(self.offset)
        return self.codes[..., : self.offset]

    @property
    def positions(self) -> mx.array:
        """RoPE position of every cached token (its index: no left padding)."""
        if self.offset == 0:
            return mx.zeros((0,), mx.int32)  # np.array(mx.arange(0)) segfaults on MLX CUDA 0.32; empty zeros do not
        return mx.arange(self.offset)

    newest_is_prompt = property(lambda self: self._newest_is_prompt, doc="Whether the newest token is a prompt "
                                "token, which the hook gives dense attention (runtime.prompt).")
    prefilled = property(lambda self: self._prefilled, doc="Tokens [0, prefilled) were appended before any "
                         "retrieval decode answered their queries (runtime.prompt).")

    def size(self):
        return self.offset

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last n tokens (all of them when n > offset, as mlx-lm's KVCache); returns how many were dropped."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"trim: n must be a non-negative int (tokens to drop from the end), got {n!r}")
        n = min(self.offset, int(n))
        self.offset -= n
        prompt.trimmed(self)
        coding.forget_trimmed(self)
        self._last_selection = None
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, self.offset, return_array=return_array, window_size=window_size)

    @property
    def nbytes(self):
        """Bytes of the allocated key, value and code buffers (capacity, like KVCache.nbytes); the codebook is
        shared by all caches of a model and is not counted (see Codebook.nbytes)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes + self.codes.nbytes

    @property
    def state(self):
        refuse_mlx_lm_save()   # mlx-lm's save_prompt_cache would write a file its loader cannot read
        prompt.evaluated(self)   # mlx-lm evaluates the state after each prompt chunk
        return () if self.keys is None else (*self.keys_and_values(), self.codes_view())

    @state.setter
    def state(self, v):
        buffers.restore(self, v)   # the per-code counts are recounted from the codes, never saved
        prompt.restored(self)

    meta_state = property(lambda self: _meta_state(self), lambda self, v: _set_meta_state(self, v))

    @classmethod
    def from_state(cls, state, meta_state=None, *, codebook: Optional[CodebookLayer] = None):
        """Rebuild from `state` and `meta_state` and this layer's codebook (mlx-lm's load_prompt_cache passes none:
        load files with a2ats_ref.files.cache.load_a2ats_cache(path, codebook))."""
        if codebook is None or meta_state is None:
            raise ValueError(
                "A2ATSCache.from_state needs meta_state and codebook=<CodebookLayer>; to load a saved cache "
                "use a2ats_ref.files.cache.load_a2ats_cache(path, codebook) (mlx-lm's load_prompt_cache cannot)"
            )
        inv, traditional, config, fast_rope = _from_meta_state(meta_state)
        obj = cls(codebook, inv, traditional, config, fast_rope=fast_rope)
        obj.state = state
        return obj

    @classmethod
    def merge(cls, caches):
        """One batch cache (runtime.batching.A2ATSBatchCache) from one cache per sequence, as mlx-lm's
        BatchGenerator merges them; the inputs are copied, not changed."""
        return merge(caches, cls)

    def __deepcopy__(self, memo):
        return copy_cache(self)   # shares the codebook (mlx-lm's prompt-cache LRU deep-copies every cache)

    # ---- A2ATS attention
    def start_prompt(self) -> None:
        """Take the next token appended as a prompt token, as a server does for a cache it hands to a request."""
        prompt.evaluated(self)

    def decode(self, queries: mx.array, *, scale: Optional[float] = None) -> mx.array:
        """RET-DECODE for the newest token, appended already: queries (B, n_q, 1, d) post-RoPE at position
        offset-1 -> (B, n_q, 1, dv) in the value dtype; the selected set goes to `last_selection`."""
        return decode_step.decode(self, queries, scale)

    @property
    def last_selection(self) -> Optional[mx.array]:
        """Bool (B, n_kv, T) mask of the tokens the last decode attended to (None before a decode); T is the
        cache length at that decode. Built on request from the kept index lists, so decoding does not pay for it."""
        return None if self._last_selection is None else self._last_selection.mask()

    # ---- the A2ATS work, one method each so that a subclass or a test can replace one piece
    def _assign_pending(self, upto: int) -> None:
        coding.assign_pending(self, upto)   # codes for tokens [0, upto), every pending token in one batch

    def _count_codes(self, codes, sign: int) -> None:
        coding.count_codes(self, codes, sign)

    def _counts_array(self) -> Optional[mx.array]:
        return coding.counts_array(self)

    def _query_angle(self):
        return decode_step.query_angle(self)   # (cos, sin) mx.fast.rope gave the newest query, or None

    def __repr__(self):
        c, cb = self.config, self.codebook
        return (f"A2ATSCache(offset={self.offset}, n_kv_heads={cb.n_kv_heads}, K={cb.K}, w={c.w}, b={c.b}, "
                f"sinks={c.sinks}, topk={c.topk})")


def _checked(codebook, config) -> tuple:
    """INPUT-ERRORS for a cache's codebook (one layer of a Codebook) and config (None: the defaults)."""
    if not isinstance(codebook, CodebookLayer):
        raise ValueError(f"codebook: expected a CodebookLayer (one layer of a Codebook, codebook.layer(l)), got "
                         f"{type(codebook).__name__}; build caches with make_a2ats_cache(model, codebook, config)")
    config = A2ATSConfig() if config is None else config
    if not isinstance(config, A2ATSConfig):
        raise ValueError(f"config: expected an A2ATSConfig, got {type(config).__name__}")
    return codebook, config


def _note_append(cache, t: int) -> None:
    """Warn once per process when two single-token appends come without a decode between them: the model's
    attention is not A2ATS's (no enable_a2ats), and nothing else would say so."""
    if cache._undecoded and t == 1 and not _warned_no_hook[0]:
        _warned_no_hook[0] = True
        warnings.warn(NO_HOOK_WARNING, UserWarning, stacklevel=3)
    cache._undecoded = t == 1


def _meta_state(cache) -> tuple[str, str]:
    inv = [float(x).hex() for x in cache.inv_freqs.tolist()]   # hex: the exact float32 bits round-trip
    return (cache.config.to_json(), json.dumps({"traditional": cache.traditional, "inv_freqs": inv,
                                                "fast_rope": fast_rope_to_json(cache.fast_rope)}))


def _set_meta_state(cache, v) -> None:
    cache.inv_freqs, cache.traditional, cache.config, cache.fast_rope = _from_meta_state(v)


def _from_meta_state(meta_state) -> tuple:
    """(inv_freqs, traditional, config, fast_rope) of a meta_state, read in that order."""
    cfg_json, rope_json = meta_state
    r = json.loads(rope_json)
    return (mx.array([float.fromhex(x) for x in r["inv_freqs"]], dtype=mx.float32),
            checks.check_bool(r.get("traditional"), "meta_state: traditional"), A2ATSConfig.from_json(cfg_json),
            fast_rope_from_json(r.get("fast_rope")))


# --------------------------------------------------------------------------- building caches for a model


def attention_modules(model) -> list:
    """The attention module of every layer (the child that owns `rope`), in layer order."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"model: {type(model).__name__} has no .layers; A2ATS supports mlx-lm decoder models")
    out = []
    for i, layer in enumerate(layers):
        attn = None
        for name in ("self_attn", "attention", "attn"):
            m = getattr(layer, name, None)
            if m is not None and hasattr(m, "rope"):
                attn = m
                break
        if attn is None:
            raise ValueError(
                f"model: layer {i} ({type(layer).__name__}) has no attention module with a `rope` "
                "(looked for self_attn/attention/attn); this architecture is not supported"
            )
        out.append(attn)
    return out


def _head_dims(model, attn) -> tuple[int, int]:
    args = getattr(model, "args", None)
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None) \
        or getattr(args, "num_key_value_heads", None)
    d = getattr(attn, "head_dim", None)
    if d is None:
        n_q = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None)
        d = attn.q_proj.weight.shape[0] // n_q if n_q else None
    if n_kv is None or d is None:
        raise ValueError(f"model: cannot read n_kv_heads/head_dim from {type(attn).__name__}")
    return int(n_kv), int(d)


def _validate_once(codebook, model, config) -> None:
    """codebook.validate_against(model, config=config), remembered per (model object, b) on the codebook:
    the weights fingerprint hashes every weight, too slow to repeat for each prompt's cache of a large model.
    (A model whose weights are changed in place later is not hashed again.)"""
    seen = codebook.__dict__.setdefault("_a2ats_validated", {})
    key = (id(model), config.b)
    ref = seen.get(key)
    if ref is not None and ref() is model:
        return
    codebook.validate_against(model, config=config)
    try:
        seen[key] = weakref.ref(model)
    except TypeError:  # not weak-referenceable: validate every time
        pass


def _same_rope(a: dict, b: dict) -> bool:
    """Equal fast_rope_args: same base and scale, or equal freqs arrays."""
    if ("freqs" in a) != ("freqs" in b):
        return False
    if "freqs" in a:
        return a["freqs"].shape == b["freqs"].shape and bool(mx.array_equal(a["freqs"], b["freqs"]))
    return a == b


def make_a2ats_cache(
    model,
    codebook=None,
    config: Optional[A2ATSConfig] = None,
    *,
    allow_random_codebook: bool = False,
    validate: bool = True,
) -> list:
    """One A2ATSCache per layer of an mlx-lm model (use as `prompt_cache=`).

    codebook: a Codebook (or .Cz/.L object, or (Cz, L)) calibrated for this model; it must
    match the layer count, n_kv_heads and head_dim. Without one this raises, unless
    allow_random_codebook=True (wiring tests only: a random codebook is built and a warning issued).
    validate: a codebook that carries calibration metadata (a2ats_ref.runtime.codebook.Codebook) is checked
    against the model and config.b with its validate_against (model identity, weights fingerprint,
    b) and refused with a CodebookError naming every mismatch; validate=False skips that check.
    Call a2ats_ref.runtime.hook.enable_a2ats(model) once so the model's attention uses the caches.
    """
    config = A2ATSConfig() if config is None else config
    if not isinstance(config, A2ATSConfig):
        raise ValueError(f"config: expected an A2ATSConfig (or None for the defaults), got {type(config).__name__}")
    attns = attention_modules(model)
    n_kv, d = _head_dims(model, attns[0])
    if codebook is None:
        if not allow_random_codebook:
            raise ValueError(
                "codebook: A2ATS needs a codebook calibrated for this model (a2ats-calibrate); pass "
                "make_a2ats_cache(model, codebook, config). For wiring tests only, pass allow_random_codebook=True."
            )
        codebook = random_codebook(len(attns), n_kv, d, 256)
    if validate and getattr(codebook, "meta", None) and hasattr(codebook, "validate_against"):
        _validate_once(codebook, model, config)
    codebook = Codebook.coerce(codebook)
    if codebook.random:
        warnings.warn(RANDOM_CODEBOOK_WARNING, UserWarning, stacklevel=2)
    if codebook.n_layers != len(attns):
        raise ValueError(f"codebook: has {codebook.n_layers} layers, the model has {len(attns)}; use this model's codebook")
    if hasattr(model, "make_cache"):
        kinds = {type(c).__name__ for c in model.make_cache() if type(c) is not KVCache}
        if kinds:
            raise ValueError(
                f"model: its own make_cache() uses {sorted(kinds)} for some layers (sliding-window or non-attention "
                "layers); A2ATS supports models whose every layer is full attention with a plain KVCache"
            )
    caches, ropes = [], []
    for i, attn in enumerate(attns):
        n_kv_i, d_i = _head_dims(model, attn)
        lc = codebook.layers[i]
        if (lc.n_kv_heads, lc.head_dim) != (n_kv_i, d_i):
            raise ValueError(
                f"codebook: layer {i} has n_kv_heads={lc.n_kv_heads}, head_dim={lc.head_dim}; the model has "
                f"n_kv_heads={n_kv_i}, head_dim={d_i}; use this model's codebook"
            )
        inv, trad = rope_params_from_module(attn.rope, head_dim=d_i)
        fr = fast_rope_args(attn.rope)
        same = next((f for f in ropes if _same_rope(f, fr)), None)
        if same is None:
            ropes.append(fr)
        else:   # layers with equal rope arguments share one dict, hence one query angle per token (_query_angle)
            fr = same
        caches.append(A2ATSCache(lc, inv, trad, config, fast_rope=fr))
    return caches

