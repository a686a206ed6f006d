"""Mutants of RoPE (ROPE-FREQ, ROPE-APPLY, ROPE-INVERSE, and the INPUT-ERRORS of rope_inv_freqs and the
rotations): scaling defaults and key order, positions taken as an offset, truncated, cut or read from one row."""

from __future__ import annotations

import numpy as np

from a2ats_conformance.mutants.base import Mutant


class Llama3WrongDefaults(Mutant):
    expected_clause = "ROPE-FREQ"
    bug = ("llama3 scaling: a left-out original_max_position_embeddings defaults to 4096 and high_freq_factor to 2 "
           "(spec and mlx-lm: 8192 and 4)")
    gap = "test_rope.py::test_llama3_left_out_keys_take_the_defaults"
    expected_cause = "llama3-defaults"

    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and (scaling.get("type") or scaling.get("rope_type")) == "llama3":
            scaling = {"original_max_position_embeddings": 4096, "high_freq_factor": 2.0, **scaling}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


class RopeScalarAsOffset(Mutant):
    expected_clause = "ROPE-APPLY"
    bug = "a scalar position is taken as mx.fast.rope's offset: token t rotated by p + t instead of p"
    gap = "test_rope.py::test_rope_apply_matches_oracle"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.ndim == 0:
            p = p + np.arange(np.shape(x)[-2], dtype=p.dtype)
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


class RopeTruncatesRealPositions(Mutant):
    expected_clause = "ROPE-APPLY"
    bug = "positions cast to int before the angle (astype(int32)): real positions 2.5 -> 2, -1.5 -> -1"
    gap = "test_rope.py::test_rope_apply_matches_oracle"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.dtype.kind == "f":
            p = np.trunc(p).astype(np.int64)
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)


class RopeInvertFirstRowPositions(Mutant):
    expected_clause = "ROPE-INVERSE"
    bug = "rope_invert takes positions as one (T,) vector: a (B, T) positions array uses row 0's for every row"
    gap = "test_rope.py::test_rope_invert_matches_oracle"

    def rope_invert(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if p.ndim >= 2:
            p = np.broadcast_to(p.reshape(-1, p.shape[-1])[0], p.shape).copy()
        return self._ref.rope_invert(x, p, inv_freqs, traditional=traditional)


class RopeTypeKeyOrder(Mutant):
    expected_clause = "ROPE-FREQ"
    bug = "scaling type read as HF transformers reads it, rope_type before type (spec and mlx-lm: type first)"
    gap = "test_rope.py::test_inv_freqs_type_key_read_first"
    expected_cause = "rope-type-key-order"

    def rope_inv_freqs(self, head_dim, base, scaling=None):
        if isinstance(scaling, dict) and scaling.get("rope_type"):
            scaling = {**scaling, "type": scaling["rope_type"]}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


class RopeUnsupportedAsLinear(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "unsupported scaling types (yarn, dynamic, longrope, ...) built as linear with their factor, not rejected"
    gap = "test_input_errors.py::test_rope_inv_freqs_rejects_unsupported_types"

    def rope_inv_freqs(self, head_dim, base, scaling=None):
        kind = (scaling.get("type") or scaling.get("rope_type")) if isinstance(scaling, dict) else None
        if kind not in (None, "default", "linear", "llama3"):
            scaling = {"type": "linear", "factor": scaling.get("factor", 1.0)}
        return self._ref.rope_inv_freqs(head_dim, base, scaling)


class RopeCutsLongPositions(Mutant):
    expected_clause = "INPUT-ERRORS"
    bug = "positions longer than the T rows silently cut to their last T (positions[-T:], a cache idiom)"
    gap = "test_input_errors.py::test_rotation_rejects_bad_positions_and_inv_freqs"

    def rope_apply(self, x, positions, inv_freqs, *, traditional):
        p = np.asarray(positions)
        if np.ndim(x) >= 2 and p.ndim == 1 and p.shape[0] > np.shape(x)[-2]:
            p = p[-np.shape(x)[-2]:]
        return self._ref.rope_apply(x, p, inv_freqs, traditional=traditional)
