"""CACHE-SAVE — save and load a list of A2ATSCache (one per layer) as a .safetensors file.

Arrays: per layer i, `{i}.keys`, `{i}.values` (post-RoPE, as cached), `{i}.codes`,
`{i}.inv_freqs`. JSON metadata (safetensors string metadata, never pickle):
format name and version, a SHA-256 of every array (verified on load), and per layer
the config, RoPE layout, offset, shapes, dtypes and a SHA-256 fingerprint of the
codebook the codes were computed with. Saving is atomic (a2ats_ref.files.atomic). Loading needs that same codebook; a different one is rejected, because the codes
would not mean anything under it.

The checksums cover the arrays only, so every metadata field is checked as input on load: its presence, type and
range (offset a non-negative int equal to the cached token count, with data present exactly when it is > 0;
traditional a JSON bool; no NaN or Infinity; nesting bounded before parsing), keys and values finite floats of the
shapes the codebook gives, codes of its integer type, and inv_freqs those of the RoPE the file records.

mlx-lm's save_prompt_cache/load_prompt_cache cannot round-trip an A2ATSCache:
load_prompt_cache rebuilds caches by looking the class name up in
mlx_lm.models.cache, and it has no way to pass the codebook. Use these two
functions instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Optional

import mlx.core as mx
import numpy as np

from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig
from a2ats_ref.runtime.codebook import Codebook, CodebookLayer
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.files.atomic import (CHECKSUMS_KEY, atomic_save_safetensors, check_writable, checksums, load_json,
                                    verify_checksums)
from a2ats_ref.files.untrusted import load_safetensors
from a2ats_ref.runtime import prompt
from a2ats_ref.runtime.threads import mark_thread
from a2ats_ref.rope import _base_inv_freqs, fast_rope_from_json, fast_rope_to_json

__all__ = ["save_a2ats_cache", "load_a2ats_cache", "FORMAT", "VERSION", "codebook_fingerprint"]

FORMAT = "a2ats-cache"
VERSION = 1


def codebook_fingerprint(codebook: CodebookLayer) -> str:
    """SHA-256 of one layer's Cz and L (float32 bytes, C order) and their shapes."""
    h = hashlib.sha256()
    for a in (codebook.Cz, codebook.L):
        x = np.ascontiguousarray(np.array(a.astype(mx.float32)))
        h.update(repr(x.shape).encode())
        h.update(x.tobytes())
    return h.hexdigest()


def _check_path(path) -> str:
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise ValueError(f"path: expected a file name ending in .safetensors, got {path!r}")
    return path


def save_a2ats_cache(path, caches, metadata: Optional[dict] = None) -> None:
    """Save A2ATS caches (one per layer, as from make_a2ats_cache) to `path` (.safetensors).

    metadata: optional dict of str -> str stored alongside (returned by load_a2ats_cache(..., return_metadata=True)).
    Atomic (a2ats_ref.files.atomic): an interrupted save leaves the previous file intact. Every array's
    SHA-256 is stored and verified on load.
    """
    mark_thread()
    path = _check_path(path)
    check_writable(path, "path")
    if isinstance(caches, A2ATSCache) or not hasattr(caches, "__iter__"):
        raise ValueError(f"caches: expected a list of A2ATSCache (one per layer), got {type(caches).__name__}; "
                         "pass the list make_a2ats_cache returned")
    caches = list(caches)
    if not caches:
        raise ValueError("caches: expected a non-empty list of A2ATSCache (one per layer)")
    for i, c in enumerate(caches):
        if not isinstance(c, A2ATSCache):
            raise ValueError(f"caches[{i}]: expected an A2ATSCache, got {type(c).__name__}; use mlx-lm's "
                             "save_prompt_cache for mlx-lm caches")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"metadata: expected a dict of str -> str, got {type(metadata).__name__}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("metadata: expected a dict of str -> str")
    arrays, layers = {}, []
    for i, c in enumerate(caches):
        info = {
            "offset": int(c.offset),
            "config": json.loads(c.config.to_json()),
            "traditional": c.traditional,
            "n_kv_heads": c.codebook.n_kv_heads,
            "head_dim": c.codebook.head_dim,
            "K": c.codebook.K,
            "codebook_sha256": codebook_fingerprint(c.codebook),
            "fast_rope": fast_rope_to_json(c.fast_rope),   # the model's rope call (EQ-12 on the device)
            # which tokens are prompt tokens and which a decode produced: a load continues as the saved cache
            # would, trims included (runtime.prompt)
            **prompt.marks(c),
        }
        arrays[f"{i}.inv_freqs"] = c.inv_freqs
        if c.offset:
            k, v = c.keys_and_values()
            codes = c.codes_view()
            arrays[f"{i}.keys"], arrays[f"{i}.values"], arrays[f"{i}.codes"] = k, v, codes
            info["shapes"] = {"keys": list(k.shape), "values": list(v.shape), "codes": list(codes.shape)}
            info["dtypes"] = {"keys": str(k.dtype), "values": str(v.dtype), "codes": str(codes.dtype)}
        layers.append(info)
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "layers": json.dumps(layers),
        "user_metadata": json.dumps(metadata or {}),
        CHECKSUMS_KEY: checksums(arrays),
    }
    atomic_save_safetensors(path, arrays, meta)


def _bad(path, what) -> ValueError:
    return ValueError(f"{path}: not a valid {FORMAT} v{VERSION} file ({what})")


#: relative difference allowed between a file's inv_freqs and those its recorded RoPE gives (float32 exp on another
#: machine may differ in the last bits; a wrong RoPE differs by orders more)
INV_FREQS_RTOL = 1e-5
_FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_LAYER_KEYS = {"offset", "config", "traditional", "n_kv_heads", "head_dim", "K", "codebook_sha256", "fast_rope"}
#: runtime.prompt's marks, which a file may leave out, and what a load then takes (those of a restored state)
_OPTIONAL_LAYER_KEYS = {"prefilled": 0, "prompt_next": False, "prompt_starts": []}


def load_a2ats_cache(path, codebook, *, return_metadata: bool = False):
    """Load caches saved by save_a2ats_cache; `codebook` must be the one the codes were computed with.

    Returns a list of A2ATSCache (and the user metadata dict if return_metadata=True). A file that is not one, is
    corrupt, or does not fit the codebook raises ValueError naming the path and the field.
    """
    mark_thread()
    path = _check_path(path)
    if not os.path.exists(path):   # a FIFO or device exists: load_safetensors refuses it unopened
        raise ValueError(f"path: no such file {path!r}")
    codebook = Codebook.coerce(codebook)
    # the header is checked first (mx.load trusts it), through the same open file the arrays are read from
    arrays, meta = load_safetensors(path, error=lambda msg: _bad(path, msg.replace(f"{path}: ", "", 1)))
    if meta.get("format") != FORMAT:
        raise _bad(path, f"format is {meta.get('format')!r}; was it written by mlx-lm's save_prompt_cache?")
    if meta.get("version") != str(VERSION):
        raise _bad(path, f"version {meta.get('version')!r} is not supported")
    verify_checksums(path, arrays, meta)

    def err(what):
        return _bad(path, what)

    layers = load_json(meta.get("layers"), f"{path}: metadata 'layers'")
    user = load_json(meta.get("user_metadata", "{}"), f"{path}: metadata 'user_metadata'")
    if not (isinstance(user, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in user.items())):
        raise err("user_metadata is not a JSON object of strings")
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise err("metadata 'layers' is not a list of JSON objects")
    if len(layers) != codebook.n_layers:
        raise ValueError(f"codebook: the file {path} holds {len(layers)} layers, the codebook has "
                         f"{codebook.n_layers}; use the model's codebook")
    expected = set()
    for i, info in enumerate(layers):
        expected |= {f"{i}.inv_freqs"} | ({f"{i}.keys", f"{i}.values", f"{i}.codes"} if info.get("offset") else set())
    if set(arrays) != expected:
        raise err(f"arrays {sorted(set(arrays) ^ expected)[:6]} do not match the layers' offsets (an array is "
                  "missing for a layer with cached tokens, or present for one without)")
    caches = [_load_layer(path, i, info, arrays, codebook.layers[i], err) for i, info in enumerate(layers)]
    return (caches, user) if return_metadata else caches


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fast_rope(obj, err):
    """fast_rope_from_json on untrusted data: a {"base", "scale"} of finite positive hex floats, or {"freqs"}."""
    if obj is None:
        return None

    def num(x, name):
        try:
            v = float.fromhex(x)
        except (TypeError, ValueError):
            raise err(f"fast_rope {name} is {x!r}, not a hex float") from None
        if not (math.isfinite(v) and v > 0):
            raise err(f"fast_rope {name} is {v}, expected a finite number > 0")
        return v

    if isinstance(obj, dict) and set(obj) == {"base", "scale"}:
        num(obj["base"], "base"), num(obj["scale"], "scale")
    elif isinstance(obj, dict) and set(obj) == {"freqs"} and isinstance(obj["freqs"], list) and obj["freqs"]:
        for x in obj["freqs"]:
            num(x, "freqs")
    else:
        raise err(f"fast_rope is {obj!r}, expected null, {{base, scale}} or {{freqs}}")
    return fast_rope_from_json(obj)


def _check_inv_freqs(inv, d, fast_rope, where, err) -> None:
    """inv_freqs float32 (d/2,), finite and positive, and those the recorded mx.fast.rope arguments give."""
    if inv.dtype != mx.float32 or tuple(inv.shape) != (d // 2,):
        raise err(f"{where}.inv_freqs is {inv.dtype} {tuple(inv.shape)}, expected float32 ({d // 2},)")
    got = np.array(inv, dtype=np.float64)
    if not (np.all(np.isfinite(got)) and np.all(got > 0)):
        raise err(f"{where}.inv_freqs holds values that are not finite and positive")
    if fast_rope is None:
        return
    if "freqs" in fast_rope:
        want = 1.0 / np.array(fast_rope["freqs"], dtype=np.float64)
    else:
        want = np.array(_base_inv_freqs(d, fast_rope["base"]) * fast_rope["scale"], dtype=np.float64)
    if want.shape != got.shape or not np.allclose(got, want, rtol=INV_FREQS_RTOL, atol=0):
        raise err(f"{where}.inv_freqs are not those of the RoPE the file records ({fast_rope_to_json(fast_rope)}); "
                  "the keys could not be un-rotated")


def _load_layer(path, i: int, info: dict, arrays: dict, lc: CodebookLayer, err) -> A2ATSCache:
    where = f"layer {i}"
    required = _LAYER_KEYS | ({"shapes", "dtypes"} if info.get("offset") else set())
    given = set(info) - set(_OPTIONAL_LAYER_KEYS)
    if given != required:
        raise err(f"{where}: metadata fields {sorted(given ^ required)} are missing or unexpected")
    for key in ("n_kv_heads", "head_dim", "K"):
        if not _is_int(info[key]):
            raise err(f"{where}: {key} is {info[key]!r}, expected an int")
    if (info["n_kv_heads"], info["head_dim"], info["K"]) != (lc.n_kv_heads, lc.head_dim, lc.K):
        raise ValueError(
            f"codebook: layer {i} of {path} has n_kv_heads={info['n_kv_heads']}, head_dim={info['head_dim']}, "
            f"K={info['K']}; the codebook has {lc.n_kv_heads}, {lc.head_dim}, {lc.K}"
        )
    if info["codebook_sha256"] != codebook_fingerprint(lc):
        raise ValueError(f"codebook: layer {i} of {path} was coded with a different codebook (SHA-256 mismatch); "
                         "pass the codebook the cache was made with")
    if not isinstance(info["traditional"], bool):
        raise err(f"{where}: traditional is {info['traditional']!r}, expected true or false (a JSON bool)")
    off = info["offset"]
    if not (_is_int(off) and 0 <= off < 2**31):
        raise err(f"{where}: offset is {off!r}, expected an int in [0, 2^31)")
    if not isinstance(info["config"], dict):
        raise err(f"{where}: config is {info['config']!r}, expected a JSON object")
    try:
        config = A2ATSConfig(**info["config"])
    except (TypeError, ValueError) as exc:
        raise err(f"{where}: config {info['config']!r} is not a valid A2ATSConfig ({exc})") from None
    fast_rope = _fast_rope(info["fast_rope"], lambda m: err(f"{where}: {m}"))
    d = lc.head_dim
    inv = arrays[f"{i}.inv_freqs"]
    _check_inv_freqs(inv, d, fast_rope, f"{i}", lambda m: err(f"{where}: {m}"))
    cache = A2ATSCache(lc, inv, info["traditional"], config, fast_rope=fast_rope)
    if off:
        _restore(cache, off, info, arrays, lc, d, i, where, err)
    prompt.set_marks(cache, *_marks(info, off, lambda m: err(f"{where}: {m}")))
    return cache


def _marks(info: dict, off: int, err) -> tuple:
    """runtime.prompt's marks of an untrusted layer entry: prefilled in [0, offset], prompt_next a bool,
    prompt_starts increasing ints in [0, offset)."""
    prefilled, prompt_next, starts = (info.get(k, v) for k, v in _OPTIONAL_LAYER_KEYS.items())
    if not (_is_int(prefilled) and 0 <= prefilled <= off):
        raise err(f"prefilled is {prefilled!r}, expected an int in [0, offset={off}]")
    if not isinstance(prompt_next, bool):
        raise err(f"prompt_next is {prompt_next!r}, expected true or false (a JSON bool)")
    if not (isinstance(starts, list) and all(_is_int(s) and 0 <= s < off for s in starts)
            and all(a < b for a, b in zip(starts, starts[1:]))):
        raise err(f"prompt_starts is {str(starts)[:80]}, expected increasing ints in [0, offset={off})")
    return prefilled, prompt_next, starts


def _restore(cache, off, info, arrays, lc, d, i, where, err) -> None:
    k, v, codes = arrays[f"{i}.keys"], arrays[f"{i}.values"], arrays[f"{i}.codes"]
    shapes, dtypes = info["shapes"], info["dtypes"]
    got = {"keys": list(k.shape), "values": list(v.shape), "codes": list(codes.shape)}
    if shapes != got or dtypes != {"keys": str(k.dtype), "values": str(v.dtype), "codes": str(codes.dtype)}:
        raise err(f"{where}: array shapes or dtypes {got} disagree with the file's metadata")
    if k.ndim != 4 or v.ndim != 4 or k.shape[1] != lc.n_kv_heads or k.shape[3] != d or k.shape[2] != off \
            or v.shape[:3] != k.shape[:3] or codes.shape != k.shape[:3]:
        raise err(f"{where}: keys {tuple(k.shape)}, values {tuple(v.shape)}, codes {tuple(codes.shape)} do not fit "
                  f"offset {off} and the codebook's (n_kv_heads={lc.n_kv_heads}, head_dim={d})")
    for name, a in (("keys", k), ("values", v)):
        if a.dtype not in _FLOAT_DTYPES:
            raise err(f"{where}: {name} are {a.dtype}; a cache holds float32, float16 or bfloat16")
        if not mx.all(mx.isfinite(a)).item():
            raise err(f"{where}: {name} hold NaN or infinite values")
    if codes.dtype != mx_code_dtype(lc.K) or (codes.size and mx.max(codes).item() >= lc.K):
        raise err(f"{where}: codes are not valid {mx_code_dtype(lc.K)} indices below K={lc.K}")
    cache.state = (k, v, codes)
