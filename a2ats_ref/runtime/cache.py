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

Attention itself is chosen by the hook (a2ats_ref.runtime.hook.enable_a2ats):
query length 1 -> `A2ATSCache.decode` (RET-DECODE: LUT scores from the codes,
top-k per query head, GQA union, sinks + window, exact attention over the
selected post-RoPE keys); query length > 1 -> mlx-lm's own dense causal
attention (PREFILL).

The cache deliberately has no `bits` attribute: mlx-lm routes any cache that has
one to its quantized attention.

Batches: every sequence of a batch selects its own tokens, but all sequences must
share the same positions (equal-length batches, no left padding). An empty cache (nothing
appended, or trimmed to 0) takes any batch size: its buffers start afresh.
"""

from __future__ import annotations

import json
import math
import numbers
import warnings
import weakref
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from a2ats_ref import checks
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.eq12_far_keys import far_keys_unchecked
from a2ats_ref.eq16_z_transform import assign_z_unchecked, z_space_operands
from a2ats_ref.eq18_back_transform import back_transform
from a2ats_ref.runtime.decode.portable import prepare_codebook
from a2ats_ref.runtime.decode.dispatch import decode_step_fast
from a2ats_ref.runtime.threads import ThreadState, mark_thread
from a2ats_ref.retrieval import attention_scale, gqa_group
from a2ats_ref.rope import applied_cos_sin, fast_rope_args, fast_rope_from_json, fast_rope_to_json, rope_params_from_module, rotate_by_tables

__all__ = [
    "A2ATSConfig",
    "A2ATSCodebook",
    "LayerCodebook",
    "A2ATSCache",
    "make_a2ats_cache",
    "random_codebook",
    "attention_modules",
    "assign_codes",
]

RANDOM_CODEBOOK_WARNING = (
    "A2ATS is using a RANDOM codebook: token selection is meaningless. Use it only to test wiring; "
    "for real use calibrate one (a2ats-calibrate) and pass it to make_a2ats_cache."
)


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


# --------------------------------------------------------------------------- codebooks


@dataclass(frozen=True)
class LayerCodebook:
    """One layer's codebooks, all KV heads: Cz (n_kv, K, d) z-space, L (n_kv, d, d), C = Cz L^-1 (key space)."""

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
    def from_z(cls, Cz, L) -> "LayerCodebook":
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


class A2ATSCodebook:
    """In-memory codebooks for a whole model: Cz (n_layers, n_kv, K, d) z-space codewords and
    L (n_layers, n_kv, d, d) lower Cholesky factors of the query moments (EQ-15/16).

    Accepts stacked arrays or per-layer sequences. `random=True` marks a wiring-test codebook.
    """

    def __init__(self, Cz, L, *, random: bool = False):
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
        self.layers = [LayerCodebook.from_z(Cz[i], L[i]) for i in range(Cz.shape[0])]
        self.random = bool(random)

    @classmethod
    def from_layers(cls, layers: Sequence[LayerCodebook], *, random: bool = False) -> "A2ATSCodebook":
        """Wrap already-built LayerCodebooks (no recomputation of C)."""
        obj = cls.__new__(cls)
        obj.layers, obj.random = list(layers), bool(random)
        return obj

    n_layers = property(lambda self: len(self.layers))
    n_kv_heads = property(lambda self: self.layers[0].n_kv_heads)
    K = property(lambda self: self.layers[0].K)
    head_dim = property(lambda self: self.layers[0].head_dim)

    @property
    def nbytes(self) -> int:
        return sum(lc.nbytes for lc in self.layers)

    @classmethod
    def coerce(cls, codebook) -> "A2ATSCodebook":
        """A2ATSCodebook, or any object with .Cz and .L arrays, or a (Cz, L) pair, or a dict with those keys."""
        if isinstance(codebook, cls):
            return codebook
        if isinstance(codebook, dict) and "Cz" in codebook and "L" in codebook:
            return cls(codebook["Cz"], codebook["L"])
        if isinstance(codebook, (tuple, list)) and len(codebook) == 2:
            return cls(*codebook)
        if hasattr(codebook, "Cz") and hasattr(codebook, "L"):
            return cls(codebook.Cz, codebook.L, random=bool(getattr(codebook, "random", False)))
        raise ValueError(
            "codebook: expected an A2ATSCodebook, an object with .Cz (n_layers, n_kv, K, d) and .L "
            f"(n_layers, n_kv, d, d), or a (Cz, L) pair; got {type(codebook).__name__}"
        )


def random_codebook(n_layers: int, n_kv_heads: int, head_dim: int, K: int = 256, *, seed: int = 0) -> A2ATSCodebook:
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
    Cz, L = mx.array(Cz), mx.array(L)
    return A2ATSCodebook(Cz, L, random=True)


# --------------------------------------------------------------------------- code assignment


def count_rows(codes: np.ndarray, K: int) -> np.ndarray:
    """(..., n) codes -> (..., K) int32: how many of each row's n codes equal each of 0..K-1 (fast_decode.code_counts
    on the host: one bincount for all rows, each row offset by row * K)."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    rows = math.prod(lead)
    flat = codes.reshape(rows, n).astype(np.intp) + (np.arange(rows, dtype=np.intp) * K)[:, None]
    return np.bincount(flat.reshape(-1), minlength=rows * K).astype(np.int32).reshape(lead + (K,))


def assign_codes(k_post: mx.array, positions: mx.array, codebook: LayerCodebook, inv_freqs, *, traditional: bool,
                 fast_rope: Optional[dict] = None, host: bool = False):
    """CACHE codes: EQ-12 de-rotation of post-RoPE keys at their own positions, then EQ-16 assignment.

    k_post (B, n_kv, t, d) post-RoPE keys, positions (t,) or a range -> codes (B, n_kv, t) in the CODES-DTYPE dtype.
    Work is O(t): only the given tokens are touched. Same result as
    assign_z(far_keys(k_post, positions, ...), Cz, L); it calls their unchecked kernels because the
    checks cost host syncs on every token and the cache has validated its inputs already.
    fast_rope (rope.fast_rope_args of the model's rope module): undo the angles mx.fast.rope applied on this
    device (rope.applied_cos_sin) instead of m * inv_freqs; they differ on MLX CUDA at long positions.
    host=True: the codes come back as a NumPy array (assign_z_unchecked).
    """
    f32 = mx.float32
    if fast_rope is not None:
        c, s = applied_cos_sin(positions, k_post.shape[-1], traditional, fast_rope)
        k_pre = rotate_by_tables(k_post.astype(f32), c, s, traditional, -1.0)
    else:
        if isinstance(positions, range):
            positions = mx.arange(positions.start, positions.stop)
        k_pre = far_keys_unchecked(k_post.astype(f32), positions.astype(f32), inv_freqs, traditional=traditional)
    return assign_z_unchecked(k_pre, codebook.Cz, codebook.L, codebook.z_operands, host=host)  # per-head (n_kv, K, d)


# --------------------------------------------------------------------------- the cache

#: per thread, (position, d, traditional, rope) -> (cos, sin) of the query angle, shared by the layers
#: (A2ATSCache._query_angle); per thread, because a lazy array made in one thread fails in another
_QUERY_ANGLES = ThreadState()


class A2ATSCache(_BaseCache):
    """mlx-lm KV cache with A2ATS codes; see the module docstring.

    Public read-only views for adapters: `keys_and_values()`, `codes_view()` (B, n_kv, T),
    `positions` (T,), `decode(queries, scale=...)`, `last_selection` (B, n_kv, T) bool after a decode.
    """

    step = 256

    def __init__(self, codebook: LayerCodebook, inv_freqs, traditional: bool, config: Optional[A2ATSConfig] = None,
                 *, fast_rope: Optional[dict] = None):
        if not isinstance(codebook, LayerCodebook):
            raise ValueError(
                f"codebook: expected a LayerCodebook (one layer of an A2ATSCodebook), got {type(codebook).__name__}; "
                "build caches with make_a2ats_cache(model, codebook, config)"
            )
        config = A2ATSConfig() if config is None else config
        if not isinstance(config, A2ATSConfig):
            raise ValueError(f"config: expected an A2ATSConfig, got {type(config).__name__}")
        self.codebook = codebook
        self.inv_freqs = checks.check_inv_freqs(inv_freqs, codebook.head_dim)
        self.traditional = checks.check_bool(traditional, "traditional")
        # EQ-12 on the device: the mx.fast.rope arguments the model used (None: keys were rotated by m * inv_freqs)
        self.fast_rope = fast_rope
        self.config = config
        self.keys = None
        self.values = None
        self.codes = None
        self.offset = 0
        self._coded = 0   # tokens [0, _coded) have their code in self.codes; the rest are pending
        # (B, n_kv, K) int32 NumPy: how many of the coded tokens [0, _coded) hold each code (RET-DECODE's counts),
        # kept on the host from the host codes of each batch; _counts_mx is its mx copy, made when a decode needs it
        self._counts = self._counts_mx = None
        self._last_selection = None
        self._undecoded = False   # the last append was one token and no decode has read it (no hook)

    #: decode_step_fast's selection method ("auto": chosen per device; "host", "mlx", "sortfree" force one)
    select_method = "auto"

    #: most tokens coded in one batch (bounds the (n_kv, batch, K) distance block of a long prefill)
    CODE_BATCH_MAX = 2048

    # ---- mlx-lm protocol
    def update_and_fetch(self, keys, values):
        mark_thread()
        self._check_kv(keys, values)
        prev, t = self.offset, keys.shape[2]
        if self._undecoded and t == 1 and not _warned_no_hook[0]:
            # two decode steps in a row without decode(): the attention is not A2ATS's, and nothing else would say so
            _warned_no_hook[0] = True
            warnings.warn(NO_HOOK_WARNING, UserWarning, stacklevel=2)
        self._undecoded = t == 1
        if self.keys is not None and prev == 0 and keys.shape[0] != self.keys.shape[0]:
            # Empty (e.g. trimmed to 0) with another batch size: start fresh buffers rather than let
            # the old ones broadcast the new batch into the wrong shape. Nothing cached is lost.
            self.keys = self.values = self.codes = self._counts = self._counts_mx = None
            self._coded = 0
        if self.keys is None or prev + t > self.keys.shape[2]:
            self._grow(keys, values, prev, t)
        if t == 0:  # mlx-lm's KVCache accepts an empty append; so do we (nothing to assign)
            return self.keys_and_values()
        self.offset += t
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        if t > 1:
            # A prefill chunk is coded with it: left pending, a long prefill's tokens would all be coded by the
            # first decode (a 32K prompt: seconds in one step, no progress). Decode appends stay pending, coded
            # in batches of about w + 1 (_assign_pending).
            self._assign_pending(self.offset)
        return self.keys_and_values()

    def _assign_pending(self, upto: int) -> None:
        """Make sure tokens [0, upto) have codes: if any is pending, code every pending token (one batch).

        Codes read the cached post-RoPE keys at their own positions (EQ-12, EQ-16), exactly as on append.
        The per-code counts gain the new batch's codes, counted on the host from the codes as they come
        back from the argmin (no MLX scatter, no extra sync).
        """
        if self._coded >= min(upto, self.offset):
            return
        for s in range(self._coded, self.offset, self.CODE_BATCH_MAX):
            e = min(s + self.CODE_BATCH_MAX, self.offset)
            codes = assign_codes(self.keys[..., s:e, :], range(s, e), self.codebook, self.inv_freqs,
                                 traditional=self.traditional, fast_rope=self.fast_rope, host=True)
            self.codes[..., s:e] = mx.array(codes)
            self._count_codes(codes, +1)
        self._coded = self.offset

    def _count_codes(self, codes, sign: int) -> None:
        """Add (sign +1) or remove (-1) host codes (B, n_kv, n) to the per-code counts."""
        if self._counts is None:
            self._counts = np.zeros(self.codes.shape[:2] + (self.codebook.K,), dtype=np.int32)
        if codes.shape[-1]:
            self._counts += sign * count_rows(codes, self.codebook.K)
            self._counts_mx = None

    def _counts_array(self) -> Optional[mx.array]:
        """The counts as the mx.array decode_step_fast reads (copied once after each change)."""
        if self._counts is not None and self._counts_mx is None:
            self._counts_mx = mx.array(self._counts)
        return self._counts_mx

    def _grow(self, keys, values, prev, t):
        B, n_kv, _, dk = keys.shape
        n = (self.step + t - 1) // self.step * self.step
        new_k = mx.zeros((B, n_kv, n, dk), keys.dtype)
        new_v = mx.zeros((B, n_kv, n, values.shape[3]), values.dtype)
        new_c = mx.zeros((B, n_kv, n), mx_code_dtype(self.codebook.K))
        if self.keys is None:
            self.keys, self.values, self.codes = new_k, new_v, new_c
            return
        if prev % self.step != 0:
            self.keys, self.values, self.codes = self.keys[..., :prev, :], self.values[..., :prev, :], self.codes[..., :prev]
        self.keys = mx.concatenate([self.keys, new_k], axis=2)
        self.values = mx.concatenate([self.values, new_v], axis=2)
        self.codes = mx.concatenate([self.codes, new_c], axis=2)

    def _check_kv(self, keys, values):
        cb = self.codebook
        for name, a in (("keys", keys), ("values", values)):
            if not isinstance(a, mx.array) or a.dtype not in checks.FLOAT_DTYPES:
                got = a.dtype if isinstance(a, mx.array) else type(a).__name__
                raise ValueError(f"{name}: expected a float16, bfloat16 or float32 mx.array (as mlx-lm passes), got {got}")
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys/values: expected (B, n_kv_heads, T, head_dim) arrays with matching leading dims, got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.shape[1] != cb.n_kv_heads or keys.shape[3] != cb.head_dim:
            raise ValueError(
                f"keys: shape {tuple(keys.shape)} does not match the codebook (n_kv_heads={cb.n_kv_heads}, "
                f"head_dim={cb.head_dim}); use the codebook calibrated for this model"
            )
        if self.keys is not None and self.offset and keys.shape[0] != self.keys.shape[0]:
            raise ValueError(f"keys: batch size {keys.shape[0]} differs from the cached batch size {self.keys.shape[0]}")

    def keys_and_values(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values

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
        if self._coded > self.offset:
            self._count_codes(np.array(self.codes[..., self.offset:self._coded]), -1)
            self._coded = self.offset
        self._last_selection = None
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, self.offset, return_array=return_array, window_size=window_size)

    @property
    def nbytes(self):
        """Bytes of the allocated key, value and code buffers (capacity, like KVCache.nbytes).

        The codebook is shared by all caches of a model and is not counted (see codebook.nbytes).
        """
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.codes.nbytes

    @property
    def state(self):
        # deferred: batching builds on A2ATSCache: an import cycle at the top
        from a2ats_ref.runtime.batching import refuse_mlx_lm_save

        refuse_mlx_lm_save()   # mlx-lm's save_prompt_cache would write a file its loader cannot read
        if self.keys is None:
            return ()
        k, v = self.keys_and_values()
        return k, v, self.codes_view()

    @state.setter
    def state(self, v):
        if v is None or len(v) == 0:
            self.keys = self.values = self.codes = self._counts = self._counts_mx = None
            self.offset = self._coded = 0
            return
        keys, values, codes = v
        if codes.shape != keys.shape[:3] or values.shape[:3] != keys.shape[:3]:
            raise ValueError(
                f"state: expected keys (B, n_kv, T, d), values (B, n_kv, T, dv), codes (B, n_kv, T); got "
                f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(codes.shape)}"
            )
        self.keys, self.values, self.codes = keys, values, codes
        self.offset = self._coded = keys.shape[2]
        # recounted, not saved: the file format is unchanged (an empty host copy: MLX CUDA 0.32 segfaults on those)
        self._counts = (count_rows(np.array(codes), self.codebook.K) if codes.shape[2]
                        else np.zeros(codes.shape[:2] + (self.codebook.K,), np.int32))
        self._counts_mx = None
        self._last_selection = None

    @property
    def meta_state(self):
        inv = [float(x).hex() for x in self.inv_freqs.tolist()]
        return (self.config.to_json(), json.dumps({"traditional": self.traditional, "inv_freqs": inv,
                                                   "fast_rope": fast_rope_to_json(self.fast_rope)}))

    @meta_state.setter
    def meta_state(self, v):
        cfg, rope = v
        self.config = A2ATSConfig.from_json(cfg)
        r = json.loads(rope)
        self.traditional = checks.check_bool(r.get("traditional"), "meta_state: traditional")
        self.inv_freqs = mx.array([float.fromhex(x) for x in r["inv_freqs"]], dtype=mx.float32)
        self.fast_rope = fast_rope_from_json(r.get("fast_rope"))

    @classmethod
    def from_state(cls, state, meta_state=None, *, codebook: Optional[LayerCodebook] = None):
        """Rebuild from `state` and `meta_state`; needs this layer's codebook.

        mlx-lm's load_prompt_cache cannot call this (it only rebuilds its own classes and passes no
        codebook): use a2ats_ref.files.cache.load_a2ats_cache(path, codebook) instead.
        """
        if codebook is None or meta_state is None:
            raise ValueError(
                "A2ATSCache.from_state needs meta_state and codebook=<LayerCodebook>; to load a saved cache "
                "use a2ats_ref.files.cache.load_a2ats_cache(path, codebook) (mlx-lm's load_prompt_cache cannot)"
            )
        cfg_json, rope_json = meta_state
        r = json.loads(rope_json)
        obj = cls(codebook, mx.array([float.fromhex(x) for x in r["inv_freqs"]], dtype=mx.float32),
                  checks.check_bool(r.get("traditional"), "meta_state: traditional"), A2ATSConfig.from_json(cfg_json),
                  fast_rope=fast_rope_from_json(r.get("fast_rope")))
        obj.state = state
        return obj

    # ---- mlx-lm's batching (a2ats_ref.batching) and prompt-cache copies
    @classmethod
    def merge(cls, caches):
        """One batch cache (a2ats_ref.runtime.batching.A2ATSBatchCache) from one cache per sequence, as mlx-lm's
        BatchGenerator merges them; the inputs are copied, not changed."""
        # deferred: batching builds on A2ATSCache: an import cycle at the top
        from a2ats_ref.runtime.batching import merge

        return merge(caches, cls)

    def __deepcopy__(self, memo):
        # deferred: batching builds on A2ATSCache: an import cycle at the top
        from a2ats_ref.runtime.batching import copy_cache

        return copy_cache(self)   # shares the codebook (mlx-lm's prompt-cache LRU deep-copies every cache)

    # ---- A2ATS attention
    def decode(self, queries: mx.array, *, scale: Optional[float] = None) -> mx.array:
        """RET-DECODE for the newest token: queries (B, n_q, 1, d) post-RoPE at position offset-1.

        Call after update_and_fetch appended that token (mlx-lm's order). Returns (B, n_q, 1, dv)
        in the value dtype, and records the selected set in `last_selection` (B, n_kv, T) bool.
        """
        if self.keys is None or self.offset == 0:
            raise ValueError("decode: the cache is empty; append the query's own key/value first (update_and_fetch)")
        cb, cfg = self.codebook, self.config
        if not isinstance(queries, mx.array) or queries.dtype not in checks.FLOAT_DTYPES:
            got = queries.dtype if isinstance(queries, mx.array) else type(queries).__name__
            raise ValueError(f"queries: expected a float16, bfloat16 or float32 mx.array, got {got}")
        if (queries.ndim != 4 or queries.shape[2] != 1 or queries.shape[0] != self.keys.shape[0]
                or queries.shape[3] != cb.head_dim):
            raise ValueError(
                f"queries: expected (B={self.keys.shape[0]}, n_q, 1, {cb.head_dim}) post-RoPE, "
                f"got {tuple(queries.shape)}"
            )
        gqa_group(queries.shape[1], cb.n_kv_heads)
        # Everything else was validated when the cache was built or appended to, so no clause-level checks
        # (and their host syncs) here. The kernel reads the preallocated buffers directly: n_tokens marks
        # the valid prefix, so no sliced copy of keys/values/codes is made per step.
        # Scores read the codes of tokens j < offset - w only (the window is always attended): pending tokens
        # are coded together once the oldest of them reaches that range, i.e. about once every w + 1 tokens.
        self._assign_pending(self.offset - cfg.w)
        self._undecoded = False
        out, self._last_selection = decode_step_fast(
            queries, self.keys, self.values, self.codes, cb.CT, query_pos=self.offset - 1, b=cfg.b, w=cfg.w,
            sinks=cfg.sinks, topk=cfg.topk, inv_freqs=self.inv_freqs, traditional=self.traditional,
            scale=attention_scale(scale, cb.head_dim), n_tokens=self.offset, return_selection=True,
            applied_angle=self._query_angle(), method=self.select_method,
            code_counts=None if self._counts is None else (self._counts_array(), self._coded),
        )
        return out

    def _query_angle(self):
        """(cos, sin) (d/2,) of the angle mx.fast.rope gave the newest query, when the model's rope is known.

        Every layer of a model decodes the same position with the same rope, so the tables are made once per
        position and shared (_QUERY_ANGLES): rebuilding them cost each layer ~0.25 ms of small MLX ops
        (SmolLM2 shapes at 16K, 30 layers per token)."""
        if self.fast_rope is None:
            return None
        d, pos, fr = self.codebook.head_dim, self.offset - 1, self.fast_rope
        # freqs by identity: the entry keeps the array alive, so its id cannot name another array meanwhile
        rope = ("freqs", id(fr["freqs"])) if "freqs" in fr else (fr["base"], fr["scale"])
        key = (pos, d, self.traditional, rope, str(mx.default_device()))
        angles = _QUERY_ANGLES.__dict__
        if key not in angles:
            if next(iter(angles), (None,))[0] != pos:
                angles.clear()   # only the current position's tables are kept
            c, s = applied_cos_sin(mx.array([pos]), d, self.traditional, fr)
            angles[key] = (c[0], s[0], fr)
        return angles[key][:2]

    @property
    def last_selection(self) -> Optional[mx.array]:
        """Bool (B, n_kv, T) mask of the tokens the last decode attended to (None before a decode).

        T is the cache length at that decode. Built on request from the kept index lists, so decoding
        does not pay for it.
        """
        if self._last_selection is None:
            return None
        return self._last_selection.mask()

    def __repr__(self):
        c = self.config
        return (f"A2ATSCache(offset={self.offset}, n_kv_heads={self.codebook.n_kv_heads}, K={self.codebook.K}, "
                f"w={c.w}, b={c.b}, sinks={c.sinks}, topk={c.topk})")


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

    codebook: an A2ATSCodebook (or .Cz/.L object, or (Cz, L)) calibrated for this model; it must
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
    codebook = A2ATSCodebook.coerce(codebook)
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

