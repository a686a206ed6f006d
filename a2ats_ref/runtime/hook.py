"""Attention hook: make an mlx-lm model use A2ATS attention for A2ATSCache layers.

mlx-lm model modules bind the attention function by name
(`from .base import scaled_dot_product_attention`), so replacing it in
mlx_lm.models.base changes nothing for them. `enable_a2ats(model)` replaces the
name `scaled_dot_product_attention` in the module that defines each attention
class with a dispatcher:

- cache is an A2ATSCache and the query length is 1 -> RET-DECODE (cache.decode):
  the real post-RoPE query is right there, one line after update_and_fetch; unless the token is a
  prompt token (a one-token prompt chunk, the prompt's last token: runtime.prompt), which gets PREFILL's
  dense attention like the rest of its prompt (prompt.attend_newest);
- cache is an A2ATSCache and the query length is > 1 -> PREFILL: mlx-lm's own
  dense causal attention with the mask mlx-lm passed; on the CPU, a causal
  prefill of at least prefill.HOST_PREFILL_MIN query x key pairs runs
  prefill.causal_attention_host instead (same attention, NumPy's exp: MLX's CPU
  exp made long prefills exp-bound). Codes are assigned later, in batches;
- cache is an a2ats_ref.runtime.batching.A2ATSBatchCache (mlx-lm's batch generation): the same, row by row;
  its decode ignores the padding mask mlx-lm passes, because each row holds only its own tokens;
- any other cache (or none) -> the function the module had before, untouched.

The replacement is per model module and process-wide (other models of the same
architecture also see the dispatcher), which is harmless: for them it is a
pass-through. `disable_a2ats(model)` restores the original binding.

Covered mlx-lm modules (each one checked by source: rope(q/k, offset=cache.offset)
-> cache.update_and_fetch -> scaled_dot_product_attention(q, k, v, cache=cache,
scale=..., mask=...)): see SUPPORTED_MODULES. Any other module, a RoPE that A2ATS
cannot invert exactly (yarn, longrope/SuScaled, dynamic NTK, proportional) and
partial rotary embeddings are refused with a ValueError.
"""

from __future__ import annotations

import importlib
import sys
import threading

from mlx_lm.models.cache import KVCache

from a2ats_ref import prefill
from a2ats_ref.runtime import prompt
from a2ats_ref.runtime.decode import portable as fast_decode
from a2ats_ref.runtime.batching import A2ATSBatchCache
from a2ats_ref.runtime.cache import A2ATSCache, attention_modules, make_a2ats_cache, _head_dims
from a2ats_ref.rope import rope_params_from_module

__all__ = ["enable_a2ats", "disable_a2ats", "a2ats_enabled", "install_a2ats_cache", "uninstall_a2ats_cache",
           "SUPPORTED_MODULES"]

#: mlx-lm model modules whose attention follows the pattern above (mistral maps to llama in mlx-lm).
SUPPORTED_MODULES = tuple(
    "mlx_lm.models." + m
    for m in (
        "llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmo2", "granite",
        "starcoder2", "internlm2", "gemma", "cohere", "phi3", "minicpm", "helium",
    )
)

_NAME = "scaled_dot_product_attention"
_ORIGINALS: dict[str, object] = {}  # module name -> the function it bound before enable_a2ats


def _make_dispatcher(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        batch = isinstance(cache, A2ATSBatchCache)
        if not (batch or isinstance(cache, A2ATSCache)):
            if sinks is None:
                return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            raise ValueError("A2ATS: models with learned attention sinks (sinks=...) are not supported")
        if queries.shape[2] > 1:  # PREFILL: mlx-lm's dense path (the cache has no `bits`, so mx.fast SDPA)
            if isinstance(mask, str) and mask == "causal" and prefill.use_host_prefill(queries, keys):
                return prefill.causal_attention_host(queries, keys, values, scale=scale)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
        if mask is not None and not isinstance(mask, str) and not batch:
            raise ValueError(
                "A2ATS decode got an explicit attention mask (padding or a sliding window); A2ATS supports "
                "equal-length batches without padding on full-attention layers"
            )
        if batch:
            return cache.decode(queries, scale=scale)   # row by row, each through prompt.attend_newest
        return prompt.attend_newest(cache, queries, scale)   # RET-DECODE, or dense for a prompt token

    scaled_dot_product_attention._a2ats_dispatcher = True
    scaled_dot_product_attention._a2ats_original = original
    scaled_dot_product_attention.__doc__ = "A2ATS dispatcher (a2ats_ref.runtime.hook); non-A2ATS caches go to mlx-lm."
    return scaled_dot_product_attention


def _modules_of(model) -> list[str]:
    attns = attention_modules(model)
    names = []
    for i, attn in enumerate(attns):
        mod = type(attn).__module__
        if mod not in SUPPORTED_MODULES:
            raise ValueError(
                f"model: layer {i} attention {type(attn).__name__} comes from {mod}, which A2ATS does not cover; "
                f"supported modules: {', '.join(m.rsplit('.', 1)[1] for m in SUPPORTED_MODULES)}"
            )
        _, d = _head_dims(model, attn)
        rope_params_from_module(attn.rope, head_dim=d)  # ValueError for non-invertible or partial RoPE
        if mod not in names:
            names.append(mod)
    return names


def enable_a2ats(model, *, tune_allocator: bool | None = None):
    """Route attention of A2ATSCache layers through A2ATS; returns model. Idempotent.

    Raises ValueError for models A2ATS cannot handle (unsupported module, RoPE variant
    that cannot be inverted exactly, partial rotary).

    tune_allocator: apply fast_decode.tune_allocator() (glibc keeps freed large buffers instead of
    unmapping them: process-wide, once). Default: on, unless the environment sets
    A2ATS_TUNE_ALLOCATOR=0; pass False to leave malloc alone. It is what the benchmark runs with, so a
    library user gets the benchmark's speed without flipping a switch.
    """
    want_tuning = fast_decode.allocator_tuning_wanted(tune_allocator)
    for name in _modules_of(model):
        mod = sys.modules.get(name) or importlib.import_module(name)
        fn = getattr(mod, _NAME, None)
        if fn is None:
            raise ValueError(f"model: {name} has no `{_NAME}` binding to hook; this mlx-lm version is not supported")
        if getattr(fn, "_a2ats_dispatcher", False):
            continue
        _ORIGINALS[name] = fn
        setattr(mod, _NAME, _make_dispatcher(fn))
    if want_tuning:
        fast_decode.tune_allocator()
    return model


def disable_a2ats(model):
    """Undo enable_a2ats for the modules of this model; returns model."""
    for name in {type(a).__module__ for a in attention_modules(model)}:
        mod = sys.modules.get(name)
        fn = getattr(mod, _NAME, None) if mod else None
        if fn is not None and getattr(fn, "_a2ats_dispatcher", False):
            setattr(mod, _NAME, fn._a2ats_original)
            _ORIGINALS.pop(name, None)
    return model


def a2ats_enabled(model) -> bool:
    """True if every attention module of `model` dispatches A2ATS caches."""
    try:
        names = {type(a).__module__ for a in attention_modules(model)}
    except ValueError:
        return False
    return all(getattr(sys.modules.get(n), _NAME, None) is not None
               and getattr(getattr(sys.modules[n], _NAME), "_a2ats_dispatcher", False) for n in names)


# --------------------------------------------------------------------------- mlx-lm's make_prompt_cache

_BUILDING = threading.local()


def install_a2ats_cache(model, codebook=None, config=None, **kwargs):
    """Make mlx-lm's `make_prompt_cache(model)` return A2ATS caches (make_a2ats_cache(model, codebook, config,
    **kwargs)) and enable the attention hook; returns model.

    BatchGenerator, batch_generate and mlx_lm.server build each request's cache with make_prompt_cache,
    which calls `model.make_cache()`; this sets that method on the model object. The codebook is checked
    against the model now (a CodebookError or ValueError names every mismatch), not at the first request.
    """
    enable_a2ats(model)
    uninstall_a2ats_cache(model)
    original = getattr(model, "make_cache", None)

    def make_cache():
        if getattr(_BUILDING, "active", False):   # make_a2ats_cache asks the model's own make_cache
            return original() if original is not None else [KVCache() for _ in model.layers]
        _BUILDING.active = True
        try:
            return make_a2ats_cache(model, codebook, config, **kwargs)
        finally:
            _BUILDING.active = False

    make_cache._a2ats_original = original
    make_cache()   # every check now, before a server starts
    object.__setattr__(model, "make_cache", make_cache)
    return model


def uninstall_a2ats_cache(model):
    """Undo install_a2ats_cache: make_prompt_cache(model) builds the model's own caches again."""
    own = getattr(model, "__dict__", {})
    if hasattr(own.get("make_cache"), "_a2ats_original"):
        del own["make_cache"]
    return model
