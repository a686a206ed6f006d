"""CACHE-SAVE — save and load a list of A2ATSCache (one per layer) as a .safetensors file.

Arrays: per layer i, `{i}.keys`, `{i}.values` (post-RoPE, as cached), `{i}.codes`,
`{i}.inv_freqs`. JSON metadata (safetensors string metadata, never pickle):
format name and version, a SHA-256 of every array (verified on load), and per layer
the config, RoPE layout, offset, shapes, dtypes and a SHA-256 fingerprint of the
codebook the codes were computed with. Saving is atomic (a2ats_ref.files.atomic). Loading needs that same codebook; a different one is rejected, because the codes
would not mean anything under it.

mlx-lm's save_prompt_cache/load_prompt_cache cannot round-trip an A2ATSCache:
load_prompt_cache rebuilds caches by looking the class name up in
mlx_lm.models.cache, and it has no way to pass the codebook. Use these two
functions instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import mlx.core as mx
import numpy as np

from a2ats_ref.runtime.cache import A2ATSCache, A2ATSCodebook, A2ATSConfig, LayerCodebook
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.files.atomic import CHECKSUMS_KEY, atomic_save_safetensors, check_writable, checksums, verify_checksums
from a2ats_ref.rope import fast_rope_from_json, fast_rope_to_json

__all__ = ["save_a2ats_cache", "load_a2ats_cache", "FORMAT", "VERSION", "codebook_fingerprint"]

FORMAT = "a2ats-cache"
VERSION = 1


def codebook_fingerprint(codebook: LayerCodebook) -> str:
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


def load_a2ats_cache(path, codebook, *, return_metadata: bool = False):
    """Load caches saved by save_a2ats_cache; `codebook` must be the one the codes were computed with.

    Returns a list of A2ATSCache (and the user metadata dict if return_metadata=True).
    """
    path = _check_path(path)
    if not os.path.isfile(path):
        raise ValueError(f"path: no such file {path!r}")
    codebook = A2ATSCodebook.coerce(codebook)
    try:
        arrays, meta = mx.load(path, return_metadata=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure means a corrupt or foreign file
        raise _bad(path, f"unreadable safetensors: {exc}") from None
    if meta.get("format") != FORMAT:
        raise _bad(path, f"format is {meta.get('format')!r}; was it written by mlx-lm's save_prompt_cache?")
    if meta.get("version") != str(VERSION):
        raise _bad(path, f"version {meta.get('version')!r} is not supported")
    verify_checksums(path, arrays, meta)
    try:
        layers = json.loads(meta["layers"])
        user = json.loads(meta.get("user_metadata", "{}"))
    except (KeyError, json.JSONDecodeError) as exc:
        raise _bad(path, f"metadata is not valid JSON: {exc}") from None
    if not isinstance(layers, list) or len(layers) != codebook.n_layers:
        n = len(layers) if isinstance(layers, list) else "?"
        raise ValueError(f"codebook: the file holds {n} layers, the codebook has {codebook.n_layers}; use the model's codebook")
    caches = []
    for i, info in enumerate(layers):
        try:
            caches.append(_load_layer(i, info, arrays, codebook.layers[i]))
        except (KeyError, TypeError) as exc:
            raise _bad(path, f"layer {i}: missing or malformed entry {exc}") from None
    return (caches, user) if return_metadata else caches


def _load_layer(i: int, info: dict, arrays: dict, lc: LayerCodebook) -> A2ATSCache:
    if (info["n_kv_heads"], info["head_dim"], info["K"]) != (lc.n_kv_heads, lc.head_dim, lc.K):
        raise ValueError(
            f"codebook: layer {i} of the file has n_kv_heads={info['n_kv_heads']}, head_dim={info['head_dim']}, "
            f"K={info['K']}; the codebook has {lc.n_kv_heads}, {lc.head_dim}, {lc.K}"
        )
    if info["codebook_sha256"] != codebook_fingerprint(lc):
        raise ValueError(f"codebook: layer {i} codes were computed with a different codebook (SHA-256 mismatch)")
    inv = arrays[f"{i}.inv_freqs"]
    cache = A2ATSCache(lc, inv, bool(info["traditional"]), A2ATSConfig(**info["config"]),
                       fast_rope=fast_rope_from_json(info.get("fast_rope")))
    off = int(info["offset"])
    if off == 0:
        return cache
    k, v, codes = arrays[f"{i}.keys"], arrays[f"{i}.values"], arrays[f"{i}.codes"]
    shapes = info["shapes"]
    if [list(k.shape), list(v.shape), list(codes.shape)] != [shapes["keys"], shapes["values"], shapes["codes"]] \
            or k.shape[2] != off:
        raise ValueError(f"layer {i}: array shapes disagree with the file's metadata (corrupt file)")
    if codes.dtype != mx_code_dtype(lc.K) or (codes.size and mx.max(codes).item() >= lc.K):
        raise ValueError(f"layer {i}: codes are not valid {mx_code_dtype(lc.K)} indices below K={lc.K} (corrupt file)")
    cache.state = (k, v, codes)
    return cache
