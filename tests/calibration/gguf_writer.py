"""A minimal GGUF v3 writer for tests: a tiny float32 Llama with a byte-level BPE vocabulary, and the raw
building blocks (key-value records, tensor records) that the hostile-file tests mutate."""

from __future__ import annotations

import struct

import numpy as np

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
ALIGN = 32

HIDDEN, HEADS, KV_HEADS, FF, VOCAB, LAYERS = 32, 4, 2, 48, 256, 2
HEAD_DIM = HIDDEN // HEADS


def gguf_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
           I64: "<q", F64: "<d"}


def value(vtype: int, v) -> bytes:
    if vtype == STR:
        return gguf_str(v)
    if vtype == ARR:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(value(etype, x) for x in items)
    return struct.pack(_SCALAR[vtype], v)


def kv(key: str, vtype: int, v) -> bytes:
    return gguf_str(key) + struct.pack("<I", vtype) + value(vtype, v)


def byte_tokens() -> list:
    """GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tiny_metadata(**override) -> list:
    """(key, type, value) records of a tiny Llama; ``override`` replaces values by key (None drops the key)."""
    md = [
        ("general.architecture", STR, "llama"),
        ("general.alignment", U32, ALIGN),
        ("llama.embedding_length", U32, HIDDEN),
        ("llama.block_count", U32, LAYERS),
        ("llama.feed_forward_length", U32, FF),
        ("llama.attention.head_count", U32, HEADS),
        ("llama.attention.head_count_kv", U32, KV_HEADS),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.context_length", U32, 256),
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.tokens", ARR, (STR, byte_tokens())),
        ("tokenizer.ggml.merges", ARR, (STR, [])),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
    ]
    out = []
    for k, t, v in md:
        if k in override:
            tv = override.pop(k)
            if tv is None:
                continue
            t, v = tv
        out.append((k, t, v))
    out += [(k, *tv) for k, tv in override.items()]
    return out


def tiny_tensors(seed: int = 0) -> dict:
    """name -> float32 array (NumPy shape: rows, columns) of a tiny Llama in GGUF's tensor names."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    t = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    for l in range(LAYERS):
        p = f"blk.{l}."
        t.update({
            p + "attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN), p + "attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), p + "attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "ffn_gate.weight": w(FF, HIDDEN), p + "ffn_up.weight": w(FF, HIDDEN), p + "ffn_down.weight": w(HIDDEN, FF),
            p + "attn_norm.weight": np.ones(HIDDEN, np.float32), p + "ffn_norm.weight": np.ones(HIDDEN, np.float32),
        })
    return t


def gguf_bytes(metadata=None, tensors=None, *, version: int = 3) -> bytes:
    """A GGUF file: header, key-value records, tensor records (GGUF lists dimensions fastest first), data."""
    metadata = tiny_metadata() if metadata is None else metadata
    tensors = tiny_tensors() if tensors is None else tensors
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata))
    head += b"".join(kv(k, t, v) for k, t, v in metadata)
    data, infos = b"", b""
    for name, a in tensors.items():
        infos += gguf_str(name) + struct.pack("<I", a.ndim) + struct.pack(f"<{a.ndim}Q", *reversed(a.shape))
        infos += struct.pack("<IQ", 0, len(data))   # type F32, offset into the data section
        data += a.tobytes()
        data += b"\0" * (-len(data) % ALIGN)
    head += infos
    head += b"\0" * (-len(head) % ALIGN)
    return head + data


def write_tiny_gguf(path, metadata=None, tensors=None, **kw):
    path.write_bytes(gguf_bytes(metadata, tensors, **kw))
    return path
