"""EQ-16 and EQ-18 — Codebook, the one codebook type: per-layer z-space codewords Cz and Cholesky factors L, the
key-space codebook C = Cz L^-1 and the decode operands derived from them, and the file that holds it.

``Codebook.layer(l)`` (or ``codebook.layers[l]``) is a ``CodebookLayer``: what one layer's A2ATSCache reads, all
KV heads of the layer stacked, with its C, CT and z-space operands, which the caches built from it share.
A codebook of stacked arrays is built at once and every make_a2ats_cache call shares its layers; one of per-layer
arrays (a file's) is built again, in the calling thread, by each call (``Codebook.coerce``): a server builds each
request's caches in its own thread, and layers shared across those threads changed a batched server's answers.

The file: one safetensors file, arrays per layer, JSON metadata. No pickle.

Arrays, for every layer l (all KV heads of the layer stacked):
- ``layers.{l}.cz``  (n_kv, K, d) float32: z-space codewords Cz (EQ-17), what new keys are assigned to;
- ``layers.{l}.L``   (n_kv, d, d) float32: lower Cholesky factor of the query moment H (EQ-15).
The key-space codebook C = Cz L^-1 (EQ-18) is derived from them (``CodebookLayer.from_z``), not stored.

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
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from a2ats_ref import checks
from a2ats_ref.calibration.collect import attention_layers, head_counts
from a2ats_ref.checks import check_cholesky_conditioning
from a2ats_ref.eq16_z_transform import z_space_operands
from a2ats_ref.eq18_back_transform import back_transform
from a2ats_ref.files.atomic import (CHECKSUMS_KEY, atomic_save_safetensors, check_writable, checksums, load_json,
                                    verify_checksums)
from a2ats_ref.files.gguf import weights_fingerprint
from a2ats_ref.files.untrusted import load_safetensors
from a2ats_ref.runtime.decode.portable import prepare_codebook

__all__ = ["Codebook", "CodebookLayer", "CodebookError", "random_codebook", "model_identity", "RANDOM_CODEBOOK_WARNING"]

RANDOM_CODEBOOK_WARNING = (
    "A2ATS is using a RANDOM codebook: token selection is meaningless. Use it only to test wiring; "
    "for real use calibrate one (a2ats-calibrate) and pass it to make_a2ats_cache."
)

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


@dataclass(frozen=True)
class CodebookLayer:
    """One layer's codebooks, all KV heads: Cz (n_kv, K, d) z-space, L (n_kv, d, d), C = Cz L^-1 (key space).

    A view of one layer of a Codebook (``Codebook.layer(l)``), built by ``from_z``; what an A2ATSCache holds.
    """

    Cz: mx.array
    L: mx.array
    C: mx.array

    @property
    def n_kv_heads(self) -> int:
        return self.Cz.shape[0]

    @property
    def K(self) -> int:
        return self.Cz.shape[1]

    @property
    def head_dim(self) -> int:
        return self.Cz.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes this layer's codebook holds: Cz, L, C and the derived decode/assignment operands (CT,
        z_operands), which are about as large again; from_z builds them up front."""
        derived = [self.__dict__[k] for k in ("CT", "z_operands") if k in self.__dict__]
        flat = [a for x in derived for a in (x if isinstance(x, tuple) else (x,))]
        c = 0 if self.__dict__.get("_C_views_CT") else self.C.nbytes   # from_z's C is a view of CT's buffer
        return self.Cz.nbytes + self.L.nbytes + c + sum(a.nbytes for a in flat)

    @cached_property
    def CT(self) -> mx.array:
        """C transposed to (n_kv, d, K), contiguous float32: the LUT operand of the decode kernel.

        Kept on the codebook, so every cache of this layer (one per prompt) shares it instead of
        transposing C on each decode step. Counted in nbytes.
        """
        return prepare_codebook(self.C)

    @cached_property
    def z_operands(self) -> mx.array:
        """z_space_operands(Cz, L), built once per codebook: the code assignment reads it."""
        return z_space_operands(self.Cz, self.L)

    @classmethod
    def from_z(cls, Cz, L) -> "CodebookLayer":
        Cz = checks.as_float(Cz, "Cz")
        L = checks.as_float(L, "L")
        if Cz.ndim != 3:
            raise ValueError(f"Cz: expected one layer's z-space codebooks (n_kv, K, d), got shape {tuple(Cz.shape)}")
        n_kv, K, d = Cz.shape
        checks.check_head_dim(d, "Cz.shape[-1] (head_dim)")
        checks.check_codebook_size(K)
        if L.shape != (n_kv, d, d):
            raise ValueError(f"L: expected Cholesky factors of shape ({n_kv}, {d}, {d}) to match Cz, got {tuple(L.shape)}")
        checks.check_lower_triangular(L, "L")
        checks.check_cholesky_conditioning(L, "L")
        C = back_transform(Cz, L)  # EQ-18, batched over KV heads
        mx.eval(C)
        checks.check_finite(C, "C = Cz L^-1 (EQ-18)")
        CT = prepare_codebook(C)
        lc = cls(Cz=Cz, L=L, C=mx.swapaxes(CT, -1, -2))   # one buffer for C and its transpose, counted once
        lc.__dict__.update(CT=CT, _C_views_CT=True)
        lc.z_operands  # noqa: B018 - built now, so nbytes is what the codebook holds in use
        return lc


# eq=False: compared and hashed by identity, as the caches that share one codebook see it
@dataclass(eq=False)
class Codebook:
    """Per-layer z-space codebooks ``cz[l]`` (n_kv, K, d) and Cholesky factors ``L[l]`` (n_kv, d, d) (EQ-15/16).

    cz, Ls: one array per layer (checked as a file's arrays are; the layers are built on first use), or the
    stacked (n_layers, n_kv, K, d) and (n_layers, n_kv, d, d) arrays (each layer checked and built now).
    meta: the calibration metadata a file records. random=True marks a wiring-test codebook (the cache warns).
    """

    cz: list
    Ls: list
    meta: dict = field(default_factory=dict)
    random: bool = field(default=False, kw_only=True)

    def __post_init__(self):
        self.random = bool(self.random)
        self.meta = {} if self.meta is None else self.meta
        if not isinstance(self.cz, (list, tuple)) or not isinstance(self.Ls, (list, tuple)):
            layers = _stacked_layers(self.cz, self.Ls)
            self.cz, self.Ls = [lc.Cz for lc in layers], [lc.L for lc in layers]
            self.__dict__.update(layers=layers, _built=True)
            return
        self.cz = [mx.array(c, dtype=mx.float32) if not isinstance(c, mx.array) else c.astype(mx.float32) for c in self.cz]
        self.Ls = [mx.array(x, dtype=mx.float32) if not isinstance(x, mx.array) else x.astype(mx.float32) for x in self.Ls]
        _check_arrays(self.cz, self.Ls, where="Codebook")

    # ---- shape summary
    n_layers = property(lambda self: len(self.cz))
    n_kv_heads = property(lambda self: self.cz[0].shape[0])
    K = property(lambda self: self.cz[0].shape[1])
    head_dim = property(lambda self: self.cz[0].shape[2])

    @property
    def Cz(self) -> mx.array:
        """(n_layers, n_kv, K, d) stacked z-space codebooks."""
        return mx.stack(self.cz)

    @property
    def L(self) -> mx.array:
        """(n_layers, n_kv, d, d) stacked Cholesky factors."""
        return mx.stack(self.Ls)

    # ---- what the caches read
    @cached_property
    def layers(self) -> list:
        """One CodebookLayer per layer (C = Cz L^-1 and the decode operands), built on first use and kept."""
        return [CodebookLayer.from_z(c, L) for c, L in zip(self.cz, self.Ls)]

    def layer(self, layer: int) -> CodebookLayer:
        """The CodebookLayer an A2ATSCache of this layer holds."""
        if not (isinstance(layer, int) and 0 <= layer < self.n_layers):
            raise IndexError(f"layer: expected an int in [0, {self.n_layers}), got {layer!r}")
        return self.layers[layer]

    def for_layer(self, layer: int) -> tuple[mx.array, mx.array]:
        """(Cz (n_kv, K, d), L (n_kv, d, d)) of one layer."""
        if not (isinstance(layer, int) and 0 <= layer < self.n_layers):
            raise IndexError(f"layer: expected an int in [0, {self.n_layers}), got {layer!r}")
        return self.cz[layer], self.Ls[layer]

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's codebook and derived operands (builds the layers)."""
        return sum(lc.nbytes for lc in self.layers)

    @classmethod
    def from_layers(cls, layers: Sequence[CodebookLayer], *, random: bool = False) -> "Codebook":
        """Wrap already-built CodebookLayers (no recomputation of C)."""
        obj = cls.__new__(cls)
        layers = list(layers)
        obj.cz, obj.Ls, obj.meta, obj.random = [lc.Cz for lc in layers], [lc.L for lc in layers], {}, bool(random)
        obj.__dict__.update(layers=layers, _built=True)
        return obj

    @classmethod
    def coerce(cls, codebook) -> "Codebook":
        """A built Codebook, from a Codebook (itself when built from stacked arrays or layers; a copy built in
        the calling thread when it holds per-layer arrays), any object with .Cz and .L arrays, a (Cz, L) pair,
        or a dict with those keys."""
        if isinstance(codebook, cls) and codebook.__dict__.get("_built"):
            return codebook
        if isinstance(codebook, dict) and "Cz" in codebook and "L" in codebook:
            return cls._from_arrays(codebook["Cz"], codebook["L"])
        if isinstance(codebook, (tuple, list)) and len(codebook) == 2:
            return cls._from_arrays(*codebook)
        if hasattr(codebook, "Cz") and hasattr(codebook, "L"):
            return cls._from_arrays(codebook.Cz, codebook.L, random=bool(getattr(codebook, "random", False)))
        raise ValueError(
            "codebook: expected a Codebook, an object with .Cz (n_layers, n_kv, K, d) and .L "
            f"(n_layers, n_kv, d, d), or a (Cz, L) pair; got {type(codebook).__name__}"
        )

    def to_cache_codebook(self) -> "Codebook":
        """Deprecated: the cache reads this Codebook itself."""
        warnings.warn("Codebook.to_cache_codebook() is deprecated: pass the Codebook itself", DeprecationWarning,
                      stacklevel=2)
        return self

    @classmethod
    def _from_arrays(cls, Cz, L, *, random: bool = False) -> "Codebook":
        """Stacked arrays or per-layer sequences, each layer checked and built now (CodebookLayer.from_z)."""
        return cls.from_layers(_stacked_layers(Cz, L), random=random)

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


def _stacked_layers(Cz, L) -> list:
    """CodebookLayers from stacked (n_layers, ...) arrays or per-layer sequences, each checked by from_z."""
    if isinstance(Cz, (list, tuple)):
        Cz = mx.stack([checks.as_float(c, "Cz[layer]") for c in Cz])
    if isinstance(L, (list, tuple)):
        L = mx.stack([checks.as_float(x, "L[layer]") for x in L])
    Cz = checks.as_float(Cz, "Cz")
    L = checks.as_float(L, "L")
    if Cz.ndim != 4:
        raise ValueError(f"Cz: expected shape (n_layers, n_kv_heads, K, head_dim), got {tuple(Cz.shape)}")
    if L.ndim != 4 or L.shape[:2] != Cz.shape[:2] or L.shape[2:] != (Cz.shape[3], Cz.shape[3]):
        n, h, _, d = Cz.shape
        raise ValueError(f"L: expected shape ({n}, {h}, {d}, {d}) to match Cz {tuple(Cz.shape)}, got {tuple(L.shape)}")
    return [CodebookLayer.from_z(Cz[i], L[i]) for i in range(Cz.shape[0])]


def random_codebook(n_layers: int, n_kv_heads: int, head_dim: int, K: int = 256, *, seed: int = 0) -> Codebook:
    """A random codebook for wiring tests only (warns). Cz ~ N(0, 1); L = Cholesky of a random SPD matrix.

    Drawn and factorised by NumPy in float64, then rounded to float32: the bits depend on the seed only, not on
    which BLAS MLX runs (that depends on whether mlx was imported before a2ats_ref).
    """
    for name, v in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("K", K)):
        checks.check_pos_int(v, name)
    d = checks.check_head_dim(head_dim)
    checks.check_codebook_size(K)
    warnings.warn(RANDOM_CODEBOOK_WARNING, UserWarning, stacklevel=2)
    rng = np.random.default_rng(checks.check_nonneg_int(seed, "seed"))
    Cz = rng.standard_normal((n_layers, n_kv_heads, K, d)).astype(np.float32)
    A = rng.standard_normal((n_layers, n_kv_heads, d, d)) / math.sqrt(d)
    H = A @ np.swapaxes(A, -1, -2) + 0.5 * np.eye(d)
    L = np.tril(np.linalg.cholesky(H)).astype(np.float32)
    return Codebook._from_arrays(mx.array(Cz), mx.array(L), random=True)


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
