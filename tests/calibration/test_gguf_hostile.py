"""Crafted GGUF files: every malformed header, hyperparameter or weight is refused by name before MLX's reader
(which trusts the header and crashes the process on a crafted count) or any allocation it sizes."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import math
import struct

import numpy as np
import pytest

from a2ats_ref.files import gguf
from a2ats_ref.files.gguf import GGUFError

from gguf_writer import (ARR, F32, I32, STR, U32, U64, byte_tokens, gguf_bytes, tiny_metadata, tiny_tensors,
                         write_tiny_gguf)


def _refused(path, *fragments):
    with pytest.raises(GGUFError) as err:
        gguf.load_gguf(path)
    msg = str(err.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


def _patched(raw: bytes, at: int, fmt: str, v) -> bytes:
    b = bytearray(raw)
    b[at:at + struct.calcsize(fmt)] = struct.pack(fmt, v)
    return bytes(b)


def test_tiny_gguf_loads_and_generates(tmp_path):
    from mlx_lm import generate

    model, tok, info = gguf.load_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    assert info.config["num_hidden_layers"] == 2 and info.config["num_key_value_heads"] == 2
    assert isinstance(generate(model, tok, "hi", max_tokens=2), str)


# Header fields at fixed offsets: magic 0, version 4, tensor_count 8, kv_count 16, first key's length 24.
@pytest.mark.parametrize("at, fmt, v, field", [
    (4, "<I", 99, "version"),
    (4, "<I", 1, "version"),
    (8, "<Q", 2**62, "tensor_count"),
    (16, "<Q", 2**62, "metadata_kv_count"),
    (24, "<Q", 2**62, "key #0"),
])
def test_header_counts_and_lengths_are_bounded_by_the_file(tmp_path, at, fmt, v, field):
    p = tmp_path / "h.gguf"
    p.write_bytes(_patched(gguf_bytes(), at, fmt, v))
    _refused(p, f"GGUF {field}")


def test_magic_and_empty_file(tmp_path):
    p = tmp_path / "e.gguf"
    p.write_bytes(b"")
    _refused(p, "empty")
    p.write_bytes(b"GGUX" + gguf_bytes()[4:])
    _refused(p, "magic")


def _tensor_record(raw: bytes, name: str) -> int:
    """Offset of a tensor's n_dims field (just after its name) in a file from gguf_bytes."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return raw.index(key) + len(key)


def test_tensor_with_200_dimensions(tmp_path):
    raw = gguf_bytes()
    p = tmp_path / "d.gguf"
    p.write_bytes(_patched(raw, _tensor_record(raw, "output_norm.weight"), "<I", 200))
    _refused(p, "'output_norm.weight'", "n_dims is 200")


def test_tensor_huge_dimension_and_offset_past_the_end(tmp_path):
    raw = gguf_bytes()
    at = _tensor_record(raw, "output_norm.weight")
    p = tmp_path / "d.gguf"
    p.write_bytes(_patched(raw, at + 4, "<Q", 2**40))   # its only dimension
    _refused(p, "'output_norm.weight'", "runs past the end")
    p.write_bytes(_patched(raw, at + 4 + 8 + 4, "<Q", 2**50))   # its data offset
    _refused(p, "'output_norm.weight'", "runs past the end")
    p.write_bytes(_patched(raw, at + 4 + 8, "<I", 77))   # its ggml type
    _refused(p, "'output_norm.weight'", "ggml type 77")
    p.write_bytes(_patched(raw, at + 4 + 8 + 4, "<Q", 4))   # an unaligned data offset
    _refused(p, "'output_norm.weight'", "not a multiple of the alignment 32")
    p.write_bytes(_patched(raw, at + 4 + 8 + 4, "<Q", 0))   # the data of the tensor before it
    _refused(p, "'output_norm.weight'", "overlaps")


def test_truncated_file(tmp_path):
    raw = gguf_bytes()
    p = tmp_path / "t.gguf"
    for n in (3, 20, 200, len(raw) // 2, len(raw) - 1):
        p.write_bytes(raw[:n])
        _refused(p, "GGUF")


@pytest.mark.parametrize("key, tv, fragment", [
    ("llama.attention.head_count", (U32, 0), "'llama.attention.head_count' is 0"),
    ("llama.attention.head_count_kv", (U32, 3), "does not divide"),
    ("llama.attention.head_count_kv", (U32, 0), "'llama.attention.head_count_kv' is 0"),
    ("llama.embedding_length", (U32, 0), "'llama.embedding_length' is 0"),
    ("llama.embedding_length", (STR, "32"), "'llama.embedding_length' is '32'"),
    ("llama.embedding_length", None, "lacks 'llama.embedding_length'"),
    ("llama.rope.freq_base", (F32, -10000.0), "'llama.rope.freq_base' is -10000.0"),
    ("llama.rope.freq_base", (F32, math.nan), "'llama.rope.freq_base' is nan"),
    ("llama.rope.freq_base", (F32, math.inf), "'llama.rope.freq_base' is inf"),
    ("llama.attention.layer_norm_rms_epsilon", (F32, 0.0), "layer_norm_rms_epsilon"),
    ("llama.block_count", (U32, 10**6), "'llama.block_count' is 1000000"),
    ("llama.block_count", (U32, 3), "block_count is 3, but the file holds tensors of 2 layers"),
    ("llama.block_count", (U32, 1), "block_count is 1, but the file holds tensors of 2 layers"),
    ("llama.feed_forward_length", (U32, 47), "'blk.0.ffn_gate.weight' has shape (48, 32)"),
    ("llama.attention.key_length", (U32, 7), "even head dimension"),
    ("llama.vocab_size", (U32, 300), "'llama.vocab_size' is 300"),
    ("tokenizer.ggml.tokens", (ARR, (STR, byte_tokens()[:200])), "holds 200 tokens; token_embd.weight has 256"),
    ("tokenizer.ggml.tokens", (ARR, (I32, list(range(256)))), "not a list of strings"),
    ("tokenizer.ggml.merges", (ARR, (STR, ["ab"])), "'tokenizer.ggml.merges'"),
    ("tokenizer.ggml.merges", (ARR, (STR, ["a zz"])), "tokenizer metadata does not give a tokenizer"),
    ("tokenizer.ggml.token_type", (ARR, (I32, [1] * 10)), "'tokenizer.ggml.token_type'"),
    ("tokenizer.ggml.eos_token_id", (U32, 256), "'tokenizer.ggml.eos_token_id' is 256"),
    ("tokenizer.ggml.model", (STR, "llama"), "only byte-level BPE"),
    ("general.alignment", (U32, 24), "'general.alignment'"),
    ("general.architecture", (STR, "gpt2"), "architecture 'gpt2' is not supported"),
])
def test_hyperparameters_are_checked_before_any_work(tmp_path, key, tv, fragment):
    p = write_tiny_gguf(tmp_path / "m.gguf", tiny_metadata(**{key: tv}))
    _refused(p, fragment)


def test_huge_layer_count_is_refused_before_any_allocation(tmp_path, monkeypatch):
    """A header claiming more layers than its tensors must not reach the model constructor."""
    from mlx_lm.models import llama

    monkeypatch.setattr(llama, "Model", lambda *a, **k: pytest.fail("a model was built for a crafted header"))
    p = write_tiny_gguf(tmp_path / "m.gguf", tiny_metadata(**{"llama.block_count": (U32, 4096)}))
    _refused(p, "block_count is 4096")


def test_unexpected_and_missing_tensors(tmp_path):
    t = tiny_tensors()
    t["blk.0.rope_freqs.weight"] = np.ones(4, np.float32)
    _refused(write_tiny_gguf(tmp_path / "a.gguf", tensors=t), "'blk.0.rope_freqs.weight'")
    t = tiny_tensors()
    del t["blk.1.ffn_up.weight"]
    _refused(write_tiny_gguf(tmp_path / "b.gguf", tensors=t), "'blk.1.ffn_up.weight' is missing")
    t = tiny_tensors()
    t["blk.7.ffn_up.weight"] = t["blk.1.ffn_up.weight"]
    _refused(write_tiny_gguf(tmp_path / "c.gguf", tensors=t), "block_count is 2")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_weights_are_refused_at_load(tmp_path, bad):
    t = tiny_tensors()
    t["blk.1.attn_k.weight"][3, 5] = bad
    _refused(write_tiny_gguf(tmp_path / "w.gguf", tensors=t), "'blk.1.attn_k.weight'", "NaN or infinite")


def test_calibrate_cli_refuses_a_crafted_gguf_with_exit_2(tmp_path, capsys):
    from a2ats_ref.calibration import calibrate as cal

    p = tmp_path / "m.gguf"
    p.write_bytes(_patched(gguf_bytes(), 16, "<Q", 2**62))
    rc = cal.main([str(p), "--out", str(tmp_path / "cb.safetensors"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and str(p) in err and "metadata_kv_count" in err, err


def test_header_metadata_types_are_python_values(tmp_path):
    h = gguf.read_gguf_header(write_tiny_gguf(tmp_path / "m.gguf",
                                              tiny_metadata(**{"x.big": (U64, 2**63), "x.f": (F32, 0.5)})))
    assert h.metadata["x.big"] == 2**63 and h.metadata["x.f"] == 0.5
    assert h.tensors["blk.0.attn_q.weight"].shape == (32, 32) and h.tensors["blk.0.attn_q.weight"].ggml_type == "F32"
