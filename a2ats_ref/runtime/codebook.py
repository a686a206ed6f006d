"""The calibrated-codebook file: one safetensors file, arrays per layer, JSON metadata. No pickle.

Arrays, for every layer l (all KV heads of the layer stacked):
- ``layers.{l}.cz``  (n_kv, K, d) float32: z-space codewords Cz (EQ-17), what new keys are assigned to;
- ``layers.{l}.L``   (n_kv, d, d) float32: lower Cholesky factor of the query moment H (EQ-15).
The key-space codebook C = Cz L^-1 (EQ-18) is derived on load by the cache, not stored.

Metadata (safetensors string map): ``format`` = "a2ats-codebook", ``format_version`` = "1",
``checksums`` = SHA-256 of every array (a2ats_ref.files.atomic, verified on load), and ``a2ats`` = a JSON
object with the package version, the model identity (architecture, layer and head counts, head_dim,
RoPE base/scaling/layout, weights fingerprint), b, K, the token counts, the corpus description and
the seed.

The checksums cover the arrays only, so the metadata is checked as input on load: the model identity (every
field of ``IDENTITY_KEYS`` and ``weights_fingerprint``) and ``b`` must be present with their types and ranges, and
agree with the arrays. A file lacking one is refused: a missing field would otherwise switch its validation off.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np

from a2ats_ref.calibration.collect import attention_layers, head_counts
from a2ats_ref.checks import check_cholesky_conditioning
from a2ats_ref.files.atomic import (CHECKSUMS_KEY, atomic_save_safetensors, check_writable, checksums, load_json,
                                    verify_checksums)
from a2ats_ref.files.gguf import weights_fingerprint
from a2ats_ref.files.untrusted import load_safetensors
from a2ats_ref.runtime.cache import A2ATSCodebook

FORMAT_NAME = "a2ats-codebook"
FORMAT_VERSION = "1"

# Model identity keys compared by validate_against (fingerprint only when both sides have one).
IDENTITY_KEYS = ("n_layers", "n_heads", "n_kv_heads", "head_dim", "rope_base", "rope_scaling", "rope_traditional")
#: largest b a file may record: positions are float32 in the rotations, exact integers only up to 2^24
MAX_B = 1 << 24


class CodebookError(ValueError):
    """A codebook file that is not ours, is corrupt, or does not fit the model."""


def _package_version() -> str:
    try:
        return version("a2ats-ref")
    except Exception:  # not installed (source tree)
        return "unknown"


@dataclass
class Codebook:
    """Per-layer z-space codebooks ``cz[l]`` (n_kv, K, d) and Cholesky factors ``L[l]`` (n_kv, d, d)."""

    cz: list
    Ls: list
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.cz = [mx.array(c, dtype=mx.float32) if not isinstance(c, mx.array) else c.astype(mx.float32) for c in self.cz]
        self.Ls = [mx.array(x, dtype=mx.float32) if not isinstance(x, mx.array) else x.astype(mx.float32) for x in self.Ls]
        _check_arrays(self.cz, self.Ls, where="Codebook")

    # ---- shape summary
    n_layers = property(lambda self: len(self.cz))
    n_kv_heads = property(lambda self: self.cz[0].shape[0])
    K = property(lambda self: self.cz[0].shape[1])
    head_dim = property(lambda self: self.cz[0].shape[2])

    # ---- what a2ats_ref.runtime.cache.A2ATSCodebook.coerce reads
    @property
    def Cz(self) -> mx.array:
        """(n_layers, n_kv, K, d) stacked z-space codebooks."""
        return mx.stack(self.cz)

    @property
    def L(self) -> mx.array:
        """(n_layers, n_kv, d, d) stacked Cholesky factors."""
        return mx.stack(self.Ls)

    random = False  # a calibrated codebook (the cache warns on random ones)

    def for_layer(self, layer: int) -> tuple[mx.array, mx.array]:
        """(Cz (n_kv, K, d), L (n_kv, d, d)) of one layer."""
        if not (isinstance(layer, int) and 0 <= layer < self.n_layers):
            raise IndexError(f"layer: expected an int in [0, {self.n_layers}), got {layer!r}")
        return self.cz[layer], self.Ls[layer]

    def to_cache_codebook(self):
        """The cache's in-memory form (a2ats_ref.runtime.cache.A2ATSCodebook)."""
        return A2ATSCodebook(self.cz, self.Ls)

    # ---- files
    def save(self, path) -> Path:
        path = Path(path)
        arrays = {}
        for l, (c, L) in enumerate(zip(self.cz, self.Ls)):
            arrays[f"layers.{l}.cz"] = c
            arrays[f"layers.{l}.L"] = L
        meta = dict(self.meta)
        meta.setdefault("package_version", _package_version())
        meta["n_layers"] = self.n_layers
        meta["n_kv_heads"] = self.n_kv_heads
        meta["codebook_size"] = self.K
        meta["head_dim"] = self.head_dim
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"codebook path {path}: cannot create its folder ({exc.strerror}); choose another path") from None
        check_writable(path, "codebook path")
        # a file that load() would refuse is refused here, where the caller can still add what is missing
        _check_identity(meta, path, n_layers=self.n_layers, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)
        md = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "a2ats": json.dumps(meta, sort_keys=True),
              CHECKSUMS_KEY: checksums(arrays)}
        return atomic_save_safetensors(path, arrays, md)  # never a half-written codebook under the final name

    @classmethod
    def load(cls, path) -> "Codebook":
        path = Path(path)
        if path.is_dir():
            raise CodebookError(f"{path}: is a folder; pass the codebook file (.safetensors) a2ats-calibrate wrote")
        if not path.exists():   # a FIFO or device exists: load_safetensors refuses it unopened
            raise FileNotFoundError(f"codebook file not found: {path}")
        arrays, md = load_safetensors(path, error=CodebookError)   # header checked first: mx.load trusts it
        if md.get("format") != FORMAT_NAME:
            raise CodebookError(
                f"{path}: not an a2ats codebook (metadata 'format' is {md.get('format')!r}, expected {FORMAT_NAME!r})"
            )
        if md.get("format_version") != FORMAT_VERSION:
            raise CodebookError(
                f"{path}: codebook format version {md.get('format_version')!r} is not supported "
                f"(this a2ats-ref reads version {FORMAT_VERSION}); recalibrate with a2ats-calibrate"
            )
        verify_checksums(path, arrays, md, error=CodebookError)
        meta = load_json(md.get("a2ats"), f"{path}: codebook metadata 'a2ats'", error=CodebookError)
        if not isinstance(meta, dict):
            raise CodebookError(f"{path}: codebook metadata 'a2ats' is not a JSON object")
        n_layers = meta.get("n_layers")
        if not isinstance(n_layers, int) or n_layers < 1:
            raise CodebookError(f"{path}: metadata n_layers is {n_layers!r}, expected a positive int")
        cz, Ls = [], []
        for l in range(n_layers):
            for name in (f"layers.{l}.cz", f"layers.{l}.L"):
                if name not in arrays:
                    raise CodebookError(f"{path}: array {name!r} is missing (metadata says {n_layers} layers)")
                if arrays[name].dtype != mx.float32:   # a relabelled array would be cast, not refused
                    raise CodebookError(f"{path}: array {name!r} is {arrays[name].dtype}, expected float32 (as "
                                        "a2ats-calibrate writes it; corrupt or foreign file)")
            cz.append(arrays[f"layers.{l}.cz"])
            Ls.append(arrays[f"layers.{l}.L"])
        extra = sorted(set(arrays) - {f"layers.{l}.{s}" for l in range(n_layers) for s in ("cz", "L")})
        if extra:
            raise CodebookError(f"{path}: unexpected arrays {extra[:5]} (metadata says {n_layers} layers)")
        try:
            _check_arrays(cz, Ls, where=str(path))
        except ValueError as exc:
            raise CodebookError(str(exc)) from None
        for key, got in (("codebook_size", cz[0].shape[1]), ("n_kv_heads", cz[0].shape[0]), ("head_dim", cz[0].shape[2])):
            if meta.get(key) != got:
                raise CodebookError(f"{path}: metadata {key}={meta.get(key)!r} disagrees with the arrays ({got})")
        _check_identity(meta, path, n_layers=len(cz), n_kv_heads=cz[0].shape[0], head_dim=cz[0].shape[2])
        return cls(cz, Ls, meta)

    # ---- model check
    def validate_against(self, model, *, check_weights: bool = True, config=None) -> None:
        """Raise CodebookError naming every mismatch between this codebook and ``model``.

        config: an A2ATSConfig (or anything with ``.b``); its b must be the b the codebook was fitted for.

        check_weights: also compare the weights fingerprint (hashes the weights as held, ~0.2 s for 135M at 4 bits).
        """
        mine = self.meta.get("model", {})
        if not isinstance(mine, dict) or not isinstance(mine.get("weights_fingerprint", ""), (str, type(None))):
            raise CodebookError(
                f"codebook metadata 'model' must be a JSON object of model identity fields, got {mine!r}; the file "
                "is damaged or was not written by a2ats-calibrate: recalibrate, or pass validate=False to skip the check"
            )
        fp = None
        if check_weights and mine.get("weights_fingerprint"):
            fp = weights_fingerprint(model)
        ident = model_identity(model, fingerprint=fp)
        problems = []
        for key in IDENTITY_KEYS:
            if key in mine and key in ident and not _same(mine[key], ident[key]):
                problems.append(f"{key}: codebook {mine[key]!r}, model {ident[key]!r}")
        # The arrays themselves must fit, whatever the metadata says.
        for key, got in (("n_layers", self.n_layers), ("n_kv_heads", self.n_kv_heads), ("head_dim", self.head_dim)):
            if ident.get(key) is not None and ident[key] != got and key not in mine:
                problems.append(f"{key}: codebook arrays {got}, model {ident[key]}")
        fp_mine, fp_model = mine.get("weights_fingerprint"), ident.get("weights_fingerprint")
        if fp_mine and fp_model and fp_mine != fp_model:
            problems.append(f"weights_fingerprint: codebook {fp_mine[:16]}..., model {fp_model[:16]}... (different weights)")
        if config is not None and "b" in self.meta and getattr(config, "b", self.meta["b"]) != self.meta["b"]:
            problems.append(f"b: codebook calibrated for b={self.meta['b']}, config has b={config.b}")
        if problems:
            raise CodebookError("codebook does not match the model: " + "; ".join(problems))


def _check_identity(meta: dict, path, **arrays_give) -> None:
    """The model identity and b a codebook file must record, each of its type and range (see the module docstring)."""
    def bad(field, v, want):
        raise CodebookError(f"{path}: codebook metadata {field} is {v!r}; expected {want} (the file is damaged or was "
                            "not written by a2ats-calibrate: recalibrate)")

    for key in ("model", "b"):
        if key not in meta:
            raise CodebookError(f"{path}: codebook metadata lacks {key!r}; without it the codebook cannot be checked "
                                "against a model (a2ats-calibrate records it; recalibrate a damaged file)")
    b = meta["b"]
    if not (_is_int(b) and 0 <= b <= MAX_B):
        bad("b", b, f"an int in [0, {MAX_B}]")
    mine = meta["model"]
    if not isinstance(mine, dict):
        bad("'model'", mine, "a JSON object of model identity fields")
    for key in (*IDENTITY_KEYS, "weights_fingerprint"):
        if key not in mine:
            raise CodebookError(f"{path}: codebook metadata 'model' lacks {key!r}; without it the codebook cannot be "
                                "checked against a model (recalibrate)")
    for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim"):
        if not (_is_int(mine[key]) and mine[key] > 0):
            bad(f"model.{key}", mine[key], "a positive int")
    for key, got in arrays_give.items():
        if mine[key] != got:
            bad(f"model.{key}", mine[key], f"{got}, as the arrays give")
    if mine["n_heads"] % mine["n_kv_heads"]:
        bad("model.n_heads", mine["n_heads"], f"a multiple of n_kv_heads={mine['n_kv_heads']}")
    base = mine["rope_base"]
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not (math.isfinite(base) and base > 0):
        bad("model.rope_base", base, "a finite number > 0")
    if not isinstance(mine["rope_traditional"], bool):
        bad("model.rope_traditional", mine["rope_traditional"], "true or false")
    if mine["rope_scaling"] is not None and not isinstance(mine["rope_scaling"], dict):
        bad("model.rope_scaling", mine["rope_scaling"], "null or a JSON object")
    fp = mine["weights_fingerprint"]
    if not (isinstance(fp, str) and len(fp) == 64 and all(c in "0123456789abcdef" for c in fp)):
        bad("model.weights_fingerprint", fp, "a SHA-256 (64 hex digits)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6)
        except (TypeError, ValueError):
            return False
    return a == b


def _check_arrays(cz, Ls, *, where: str) -> None:
    if not cz or len(cz) != len(Ls):
        raise ValueError(f"{where}: expected one cz and one L per layer, got {len(cz)} cz and {len(Ls)} L")
    ref = tuple(cz[0].shape)
    if len(ref) != 3:
        raise ValueError(f"{where}: layers.0.cz has shape {ref}, expected (n_kv, K, d)")
    n_kv, K, d = ref
    for l, (c, L) in enumerate(zip(cz, Ls)):
        if tuple(c.shape) != ref:
            raise ValueError(f"{where}: layers.{l}.cz has shape {tuple(c.shape)}, expected {ref} like layer 0")
        if tuple(L.shape) != (n_kv, d, d):
            raise ValueError(f"{where}: layers.{l}.L has shape {tuple(L.shape)}, expected {(n_kv, d, d)}")
        for name, a in (("cz", c), ("L", L)):
            if not mx.all(mx.isfinite(a)).item():
                raise ValueError(f"{where}: layers.{l}.{name} holds non-finite values (corrupt codebook)")
        Ln = np.array(L)
        if np.any(np.triu(Ln, 1) != 0) or np.any(np.diagonal(Ln, axis1=-2, axis2=-1) <= 0):
            raise ValueError(f"{where}: layers.{l}.L is not lower triangular with a positive diagonal (corrupt codebook)")
        check_cholesky_conditioning(L, f"{where}: layers.{l}.L")


def model_identity(model, *, fingerprint: str | None = None) -> dict:
    """What a codebook records about the model it was calibrated on."""
    attns = attention_layers(model)
    n_q, n_kv, d = head_counts(attns[0])
    args = getattr(model, "args", None)
    rope = attns[0].rope
    inner = getattr(rope, "inner", rope)
    base = getattr(inner, "base", None)
    if base is None:
        base = getattr(args, "rope_theta", None)
    scaling = getattr(args, "rope_scaling", None)
    ident = {
        "architecture": getattr(args, "model_type", type(model).__module__),
        "n_layers": len(attns),
        "n_heads": n_q,
        "n_kv_heads": n_kv,
        "head_dim": d,
        "rope_base": float(base) if base is not None else None,
        "rope_scaling": json.loads(json.dumps(scaling)) if scaling else None,
        "rope_traditional": bool(getattr(inner, "traditional", getattr(args, "rope_traditional", False))),
    }
    if fingerprint is not None:
        ident["weights_fingerprint"] = fingerprint
    return ident
