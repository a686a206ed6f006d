"""Golden vectors: oracle-computed cases for every clause (stateless calls and stateful cache traces).

Serves every clause of SPEC.md for ports that cannot run Python: the stateless clauses as single calls,
the CACHE-* clauses as traces (create, append in chunks, decode, trim, save/load, ...).

    a2ats-conformance vectors --out DIR [--size small|full] [--seed S] [--check module:object]

writes DIR/manifest.json and DIR/arrays/*.npy (format ``a2ats-golden-vectors/2``, VECTORS.md; no pickle).
A port answers them with ``.npy`` files (VECTORS.md, "Answers"); ``grade.py`` grades the answers.
``write_answers(DIR, adapter, ANSWERS)`` answers them with a Python adapter (the reference, the oracle).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

import numpy as np

from a2ats_spec import oracle as O
from a2ats_spec.clauses import SPEC_VERSION, spec_sha256

from a2ats_conformance.harness.adapter import load_adapter
from a2ats_conformance.harness.hypothesis_helpers import spd_matrix
from a2ats_conformance.harness.tolerances import DTYPES, tie_margin, tolerance
from a2ats_conformance.vectors.grade import grade_cases
from a2ats_conformance.vectors.manifest import (  # noqa: F401  (the format, one import away)
    _COMPARE, FORMAT, FORMAT_V1, GRADED_DTYPES, ManifestError, load_vectors)
from a2ats_conformance.vectors.answers import _make_folder, _writing, write_answers  # noqa: F401  (write_answers: documented here)
from a2ats_conformance.vectors.traces import build_traces
from a2ats_conformance.vectors.untrusted import (UntrustedFileError, check_npy_header, inside, read_json,
                                                 read_npy, regular_file, safe_name)

__all__ = ["FORMAT", "SIZES", "ManifestError", "generate", "write_vectors", "load_vectors", "write_answers",
           "check_vectors", "main"]

SIZES = ("small", "full")
MIN_CASES = 20            # stateless cases per clause


def _f32(x):
    """Float32-representable float64 values (every port sees exactly the oracle's inputs)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _store(x):
    """How an array is stored: floats as float32 (exact, see _f32), bools and ints as they are."""
    a = np.asarray(x)
    return a.astype(np.float32) if a.dtype.kind == "f" else a


def padded_allowed(allowed: np.ndarray) -> np.ndarray:
    """Bool allowed set (..., K) -> the allowed codes (..., m), ascending, padded with -1 (m = largest count)."""
    allowed = np.asarray(allowed, bool)
    count = allowed.sum(-1)
    m = max(1, int(count.max())) if allowed.size else 1
    dt = np.int16 if allowed.shape[-1] <= 2**15 else np.int32
    first = np.argsort(~allowed, axis=-1, kind="stable")[..., :m]      # allowed codes first, in ascending order
    return np.where(np.arange(m) < count[..., None], first, -1).astype(dt)


class _Builder:
    """Collects cases and their arrays; identical arrays are stored once (codebooks shared by many cases)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.calls: list[dict] = []
        self.traces: list[dict] = []
        self.arrays: dict[str, np.ndarray] = {}
        self._by_hash: dict[str, str] = {}

    def normal(self, *shape, scale=1.0):
        return _f32(scale * self.rng.standard_normal(shape))

    def array(self, key: str, a, *, expected: bool = False) -> dict:
        """Inputs are stored as float32 (exactly their values, see _f32); expected outputs as float64."""
        a = np.asarray(a) if expected else _store(a)
        h = hashlib.sha1(a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()).hexdigest()
        if h not in self._by_hash:
            self._by_hash[h] = key
            self.arrays[key] = a
        return {"array": f"arrays/{self._by_hash[h]}.npy"}

    def enc(self, cid: str, name: str, v):
        if isinstance(v, np.ndarray):
            return self.array(f"{cid}.{name}", v)
        if isinstance(v, np.dtype):
            return {"dtype": v.name}
        if isinstance(v, dict):
            return {"value": {k: (float(x) if isinstance(x, float) else x) for k, x in v.items()}}
        if isinstance(v, np.integer):
            return {"value": int(v)}
        if isinstance(v, np.floating):
            return {"value": float(v)}
        return {"value": v}

    def count(self, clause: str) -> int:
        return sum(1 for c in self.calls if c["clause"] == clause)

    def add(self, clause: str, fn: str, args=(), kwargs=None, *, note: str = "", compare=None, expect_error=False,
            outputs=None):
        """compare: one entry per output: "close" | "exact" | ("allowed", bool (..., K)) | ("mask", must, may)."""
        kwargs = kwargs or {}
        cid = f"{clause}.{fn}.{self.count(clause):03d}"
        case = {"id": cid, "clause": clause, "function": fn, "note": note,
                "args": [self.enc(cid, f"arg{i}", a) for i, a in enumerate(args)],
                "kwargs": {k: self.enc(cid, f"kw_{k}", v) for k, v in kwargs.items()},
                "tolerance": {d: list(tolerance(d, clause)) for d in DTYPES}}
        requires = _requires(fn, args, kwargs)
        if requires:
            case["requires"] = requires
        if expect_error:
            case["expect"] = "ValueError"
            case["outputs"] = []
        else:
            out = outputs if outputs is not None else getattr(O, fn)(*args, **kwargs)
            outs = list(out) if isinstance(out, tuple) else [out]
            compare = compare or ["close"] * len(outs)
            case["outputs"] = [self.output(cid, f"out{i}", o, c) for i, (o, c) in enumerate(zip(outs, compare))]
        self.calls.append(case)

    def output(self, cid: str, name: str, o, c) -> dict:
        kind = c if isinstance(c, str) else c[0]
        if isinstance(o, np.dtype):
            ent = {"name": name, "dtype": o.name}
        elif isinstance(o, (int, np.integer)) and not isinstance(o, bool):
            ent = {"name": name, "value": int(o)}
        else:
            o = np.asarray(o)
            ent = {"name": name, "array": self.array(f"{cid}.{name}", o, expected=True)["array"], "shape": list(o.shape)}
        ent["compare"] = kind
        if kind == "allowed":
            ent["allowed"] = self.array(f"{cid}.{name}_allowed", padded_allowed(c[1]))["array"]
        elif kind == "mask":
            ent["must"] = self.array(f"{cid}.{name}_must", c[1])["array"]
            ent["may"] = self.array(f"{cid}.{name}_may", c[2])["array"]
            ent["unique"] = bool(np.array_equal(c[1], c[2]))
        return ent


def _requires(fn: str, args, kwargs) -> dict:
    """Capabilities a call needs (capabilities.py): a RoPE layout, a topk form; a port without them skips it."""
    req = {}
    if isinstance(kwargs.get("traditional"), bool):
        req["rope_layouts"] = ["traditional" if kwargs["traditional"] else "half"]
    topk = kwargs.get("topk", args[1] if fn == "topk_count" and len(args) > 1 else None)
    if topk is not None and not isinstance(topk, bool):
        req["topk"] = ["count" if isinstance(topk, (int, np.integer)) else "fraction"]
    return req


# --------------------------------------------------------------------------- stateless cases

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
_MAX_POS = 4096   # the float32 tolerances assume positions up to this (hypothesis_helpers.MAX_POSITION)


def _inv(d, base=10000.0, scaling=None):
    return _f32(O.rope_inv_freqs(d, base, scaling))


def _margin(clause, values):
    return tie_margin("float32", clause) * max(1.0, float(np.max(np.abs(values))) if np.size(values) else 1.0)


def _allowed_codes(dist, clause):
    return ("allowed", O.argmin_allowed(dist, _margin(clause, dist)))


def _spd(B, d, cond=100.0):
    H = _f32(spd_matrix(B.rng, d, cond=cond))
    return _f32((H + H.T) / 2)


def _tie_keys(k, C, M):
    """Move each key onto the M-bisector of its two nearest codewords: a near tie after float32 rounding."""
    k = k.copy()
    dist = O.assign_distances(k, C, M)
    order = np.argsort(dist, -1)
    for n in range(k.shape[0]):
        c1, c2 = C[order[n, 0]], C[order[n, 1]]
        g = (c2 - c1) @ M
        # (k - t g')... solve 2 (k - t e) M (c2 - c1) = c2 M c2 - c1 M c1 for t along e = c2 - c1
        e = c2 - c1
        t = (2 * k[n] @ g - (c2 @ M @ c2 - c1 @ M @ c1)) / (2 * e @ g)
        k[n] = k[n] - t * e
    return _f32(k)


def _stateless(B: _Builder, size: str) -> None:
    n, r = B.normal, B.rng
    full = size == "full"
    inv8, inv64, inv128 = _inv(8), _inv(64), _inv(128, 500000.0, _LLAMA3)

    def fill(clause, make):
        i = 0
        while B.count(clause) < MIN_CASES:
            make(i)
            i += 1

    # ROPE-FREQ
    for d, base, sc in ((64, 10000.0, None), (128, 500000.0, _LLAMA3), (8, 10000.0, {"type": "linear", "factor": 2.0}),
                        (2, 10000.0, None), (128, 1e6, {"rope_type": "default"})):
        B.add("ROPE-FREQ", "rope_inv_freqs", (d, base, sc), note="edge: default / llama3 / linear / d=2 / explicit default")
    scalings = [None, {"type": "linear", "factor": 4.0}, dict(_LLAMA3), dict(_LLAMA3, factor=32.0, low_freq_factor=2.0,
                                                                                original_max_position_embeddings=4096)]
    fill("ROPE-FREQ", lambda i: B.add("ROPE-FREQ", "rope_inv_freqs",
                                      (int(2 * r.integers(1, 65)), float(r.choice([1e4, 1e5, 5e5, 1e6])),
                                       scalings[i % len(scalings)]), note="random head dim, base and scaling"))
    # ROPE-APPLY / ROPE-INVERSE
    for trad in (True, False):
        x, pos = n(2, 5, 8), np.array([0, 1, 2, 4095, 4096])
        B.add("ROPE-APPLY", "rope_apply", (x, pos, inv8), {"traditional": trad}, note="edge: positions 0 and 4096")
        B.add("ROPE-INVERSE", "rope_invert", (x, pos, inv8), {"traditional": trad}, note="edge: positions 0 and 4096")
    B.add("ROPE-INVERSE", "rope_invert", (n(6, 64), np.arange(100, 106), inv64), {"traditional": False},
          note="edge: contiguous block: per-token inverse, not a rotation by -100")
    if full:
        for clause, fn in (("ROPE-APPLY", "rope_apply"), ("ROPE-INVERSE", "rope_invert")):
            for trad, (d, inv) in ((True, (64, inv64)), (False, (128, inv128))):
                B.add(clause, fn, (n(1, 1024, d), np.arange(3072, 4096), inv), {"traditional": trad},
                      note=f"realistic: T=1024 at positions 3072..4095, d={d}")
    for clause, fn in (("ROPE-APPLY", "rope_apply"), ("ROPE-INVERSE", "rope_invert")):
        def rope_case(i, clause=clause, fn=fn):
            d = int(2 * r.integers(1, 33))
            T = int(r.integers(1, 9))
            pos = np.sort(r.integers(0, _MAX_POS + 1, T)) if i % 2 else np.arange(p0 := int(r.integers(0, 4000)), p0 + T)
            B.add(clause, fn, (n(int(r.integers(1, 3)), T, d), pos, _inv(d, float(r.choice([1e4, 5e5])))),
                  {"traditional": bool(i % 3)}, note="random")
        fill(clause, rope_case)
    # EQ-10
    B.add("EQ-10", "query_moment", (n(6, 7, 8),), {"n_kv_heads": 2, "b": 2048, "inv_freqs": inv8, "traditional": True},
          note="edge: GQA group of 3 pooled")
    B.add("EQ-10", "query_moment", (n(2, 1, 8),), {"n_kv_heads": 2, "b": 0, "inv_freqs": inv8, "traditional": False},
          note="edge: one token per head, b = 0, G = 1")
    if full:
        B.add("EQ-10", "query_moment", (n(8, 256, 128),), {"n_kv_heads": 2, "b": 2048, "inv_freqs": inv128,
                                                            "traditional": False}, note="realistic: d=128, G=4")
        B.add("EQ-10", "query_moment", (n(4, 512, 64),), {"n_kv_heads": 1, "b": 2048, "inv_freqs": inv64,
                                                           "traditional": True}, note="realistic: d=64, G=4")

    def eq10(i):
        d, nkv, G = int(2 * r.integers(1, 9)), int(r.integers(1, 3)), int(r.integers(1, 4))
        B.add("EQ-10", "query_moment", (n(nkv * G, int(r.integers(1, 20)), d),),
              {"n_kv_heads": nkv, "b": int(r.choice([64, 2048, 4096])), "inv_freqs": _inv(d), "traditional": bool(i % 2)},
              note="random")
    fill("EQ-10", eq10)
    # EQ-11
    q, k = n(6, 8), n(6, 8)
    for w in (0, 2, 6, 100):
        B.add("EQ-11", "wrope_scores", (q, k), {"w": w, "b": 2048, "inv_freqs": inv8, "traditional": False},
              note="edge: default positions; w=0 all far, i-j = w-1 near, i-j = w far, w >= T all near")
    B.add("EQ-11", "wrope_scores", (q, k), {"w": 3, "b": 64, "inv_freqs": inv8, "traditional": True,
                                            "q_positions": np.arange(1000, 1006), "k_positions": np.arange(995, 1001)},
          note="edge: explicit positions, some k after q")
    if full:
        B.add("EQ-11", "wrope_scores", (n(16, 64), n(2048, 64)),
              {"w": 64, "b": 2048, "inv_freqs": inv64, "traditional": True,
               "q_positions": np.arange(2032, 2048), "k_positions": np.arange(2048)}, note="realistic: Tk=2048, w=64")

    def eq11(i):
        d, Tq, Tk = int(2 * r.integers(1, 9)), int(r.integers(1, 6)), int(r.integers(1, 12))
        kw = {"w": int(r.integers(0, 12)), "b": int(r.choice([64, 2048])), "inv_freqs": _inv(d), "traditional": bool(i % 2)}
        if i % 3 == 0:
            kw.update(q_positions=np.sort(r.integers(0, _MAX_POS, Tq)), k_positions=np.sort(r.integers(0, _MAX_POS, Tk)))
        B.add("EQ-11", "wrope_scores", (n(Tq, d), n(Tk, d)), kw, note="random")
    fill("EQ-11", eq11)
    # EQ-12
    B.add("EQ-12", "far_keys", (n(2, 5, 8), np.arange(10, 15), inv8), {"traditional": True})
    B.add("EQ-12", "far_query", (n(3, 8),), {"b": 2048, "inv_freqs": inv8, "traditional": False})
    B.add("EQ-12", "far_query", (n(3, 8),), {"b": 2048, "inv_freqs": inv8, "traditional": False,
                                             "positions": np.array([7, 7, 7])}, note="edge: post-RoPE query at 7")
    B.add("EQ-12", "far_query", (n(3, 8),), {"b": 0, "inv_freqs": inv8, "traditional": True,
                                             "positions": np.array([4000, 4000, 4000])}, note="edge: b = 0, b - p < 0")
    if full:
        B.add("EQ-12", "far_keys", (n(1, 2048, 64), np.arange(2048), inv64), {"traditional": False},
              note="realistic: T=2048, d=64")
        B.add("EQ-12", "far_query", (n(32, 128),), {"b": 2048, "inv_freqs": inv128, "traditional": False,
                                                    "positions": np.full(32, 4095)}, note="realistic: 32 heads, d=128")

    def eq12(i):
        d, T = int(2 * r.integers(1, 17)), int(r.integers(1, 8))
        if i % 2:
            B.add("EQ-12", "far_keys", (n(int(r.integers(1, 3)), T, d), np.sort(r.integers(0, _MAX_POS, T)), _inv(d)),
                  {"traditional": bool(i % 3)}, note="random")
        else:
            kw = {"b": int(r.choice([64, 2048])), "inv_freqs": _inv(d), "traditional": bool(i % 3)}
            if i % 4:
                kw["positions"] = np.full(T, int(r.integers(0, _MAX_POS)))
            B.add("EQ-12", "far_query", (n(T, d),), kw, note="random")
    fill("EQ-12", eq12)
    # EQ-13 .. EQ-16
    H = _spd(B, 8, 100.0)
    C = n(16, 8)
    keys = n(10, 8)
    B.add("EQ-13", "score_error", (keys, C[:10], H))
    B.add("EQ-13", "score_error", (keys[:3], keys[:3], H), note="edge: key equals codeword -> 0")
    B.add("EQ-13", "score_error", (keys, C[:1], np.eye(8)), note="edge: H = I, broadcast codeword")
    Cdup, Cgrid, kgrid = np.concatenate([C, C[:2]]), np.round(C), np.round(keys)
    for name, CC, HH, kk in (("anisotropic H", C, H, keys), ("edge: duplicate codewords (exact tie)", Cdup, H, keys),
                             ("edge: H = I: nearest centroid", C, np.eye(8), keys),
                             ("edge: integer grid (many exact ties)", Cgrid, np.eye(8), kgrid),
                             ("edge: K = 1", C[:1], H, keys)):
        B.add("EQ-14", "assign", (kk, CC, HH), note=name, compare=[_allowed_codes(O.assign_distances(kk, CC, HH), "EQ-14")])
    B.add("EQ-15", "cholesky", (H,))
    B.add("EQ-15", "cholesky", (np.eye(2),), note="edge: identity, d=2")
    L = np.tril(_f32(O.cholesky(H)))
    B.add("EQ-16", "z_transform", (keys, L))
    for CC, kk, note in ((C, keys, ""), (Cdup, keys, "edge: duplicate codewords (exact tie)"), (C[:1], keys, "edge: K = 1")):
        B.add("EQ-16", "assign_z", (kk, CC, L), note=note,
              compare=[_allowed_codes(O.assign_z_distances(kk, CC, L), "EQ-16")])
    B.add("EQ-18", "back_transform", (C, L))
    B.add("EQ-18", "back_transform", (n(2, 16, 8), np.stack([L, L])), note="edge: batched per KV head")
    if full:
        H128 = _spd(B, 128, 1000.0)
        L128 = np.tril(_f32(O.cholesky(H128)))
        Cz4096 = n(4096, 128)
        C4096 = _f32(O.back_transform(Cz4096, L128))
        k1024 = n(1024, 128)
        B.add("EQ-13", "score_error", (k1024, C4096[:1024], H128), note="realistic: d=128, cond(H)=1e3")
        B.add("EQ-14", "assign", (k1024, C4096, H128), note="realistic: K=4096, d=128",
              compare=[_allowed_codes(O.assign_distances(k1024, C4096, H128), "EQ-14")])
        kt = _tie_keys(k1024[:256], C4096, H128)
        B.add("EQ-14", "assign", (kt, C4096, H128), note="realistic near ties: keys on the H-bisector of their two nearest codewords",
              compare=[_allowed_codes(O.assign_distances(kt, C4096, H128), "EQ-14")])
        B.add("EQ-15", "cholesky", (H128,), note="realistic: d=128, cond 1e3")
        B.add("EQ-16", "z_transform", (k1024, L128), note="realistic: d=128")
        B.add("EQ-16", "assign_z", (k1024, Cz4096, L128), note="realistic: K=4096, d=128",
              compare=[_allowed_codes(O.assign_z_distances(k1024, Cz4096, L128), "EQ-16")])
        kz = _f32(np.linalg.solve(L128.T, _tie_keys(_f32(k1024[:256] @ L128), Cz4096, np.eye(128)).T).T)
        B.add("EQ-16", "assign_z", (kz, Cz4096, L128), note="realistic near ties: kL on the bisector of two z-codewords",
              compare=[_allowed_codes(O.assign_z_distances(kz, Cz4096, L128), "EQ-16")])
        L64 = np.tril(_f32(O.cholesky(_spd(B, 64, 1000.0))))
        B.add("EQ-18", "back_transform", (Cz4096[:, :64], L64), note="realistic: K=4096, d=64")

    def codebook(i):
        d, K, N = int(2 * r.integers(1, 17)), int(r.integers(2, 40)), int(r.integers(1, 12))
        HH = _spd(B, d, float(r.choice([1.0, 10.0, 1000.0]))) * float(r.choice([1.0, 0.01, 30.0]))
        return d, _f32(HH), n(K, d), n(N, d)

    def eq13(i):
        d, HH, CC, kk = codebook(i)
        B.add("EQ-13", "score_error", (kk, CC[:1] if i % 2 else n(*kk.shape), HH), note="random")

    def eq14(i):
        d, HH, CC, kk = codebook(i)
        if i % 4 == 1:
            CC[-1] = CC[0]
        if i % 4 == 2:
            kk = _tie_keys(kk, CC, HH) if CC.shape[0] > 1 else kk
        B.add("EQ-14", "assign", (kk, CC, HH), note=["random", "duplicate codeword", "near ties", "random"][i % 4],
              compare=[_allowed_codes(O.assign_distances(kk, CC, HH), "EQ-14")])

    def eq15(i):
        B.add("EQ-15", "cholesky", (codebook(i)[1],), note="random SPD")

    def eq16(i):
        d, HH, CC, kk = codebook(i)
        LL = np.tril(_f32(O.cholesky(HH)))
        if i % 2:
            B.add("EQ-16", "z_transform", (kk, LL), note="random")
        else:
            B.add("EQ-16", "assign_z", (kk, CC, LL), note="random",
                  compare=[_allowed_codes(O.assign_z_distances(kk, CC, LL), "EQ-16")])

    def eq18(i):
        d, HH, CC, _ = codebook(i)
        B.add("EQ-18", "back_transform", (CC, np.tril(_f32(O.cholesky(HH)))), note="random")
    for clause, make in (("EQ-13", eq13), ("EQ-14", eq14), ("EQ-15", eq15), ("EQ-16", eq16), ("EQ-18", eq18)):
        fill(clause, make)
    # EQ-17-*
    z = _f32(np.concatenate([r.standard_normal((12, 3)) + 6 * c for c in np.eye(3)]))
    B.add("EQ-17-INIT", "kmeanspp_init", (z, 3, np.array([0.1, 0.5, 0.9])))
    B.add("EQ-17-INIT", "kmeanspp_init", (z, 1, np.array([0.0])), note="edge: K = 1, u = 0")
    B.add("EQ-17-INIT", "kmeanspp_init", (z[:3], 3, np.array([0.99, 0.0, 0.99])), note="edge: N = K")
    C0 = _f32(np.stack([z[0], z[1], z[2] + 100.0]))
    B.add("EQ-17-STEP", "lloyd_step", (z, C0), note="edge: third centre far away: empty-cluster rule",
          compare=["close", "exact", "close"])
    Cf, codes, hist = O.kmeans(z, 3, seed=1)
    B.add("EQ-17-FIT", "kmeans", (z, 3), {"seed": 1}, outputs=(Cf, codes, hist), compare=["close", "exact", "close"])

    def blobs(N, K, d, spread=6.0):
        centres = spread * r.standard_normal((K, d))
        return _f32(centres[r.integers(K, size=N)] + 0.3 * r.standard_normal((N, d)))
    if full:
        zb = blobs(4096, 256, 64)
        B.add("EQ-17-INIT", "kmeanspp_init", (zb, 256, _f32(r.random(256))), note="realistic: N=4096, K=256, d=64")
        B.add("EQ-17-STEP", "lloyd_step", (zb, _f32(zb[:256])), note="realistic: N=4096, K=256, d=64",
              compare=["close", "exact", "close"])
        zf = blobs(2048, 32, 64, 10.0)
        B.add("EQ-17-FIT", "kmeans", (zf, 32), {"seed": 3, "max_iter": 10}, note="realistic: N=2048, K=32, d=64",
              compare=["close", "exact", "close"])

    def eq17(i, clause):
        N, K, d = int(r.integers(8, 40)), int(r.integers(1, 6)), int(r.integers(1, 8))
        zz = blobs(N, K, d)
        if clause == "EQ-17-INIT":
            B.add(clause, "kmeanspp_init", (zz, K, _f32(r.random(K))), note="random clustered")
        elif clause == "EQ-17-STEP":
            B.add(clause, "lloyd_step", (zz, _f32(zz[r.choice(N, K, replace=False)])), note="random clustered",
                  compare=["close", "exact", "close"])
        else:
            B.add(clause, "kmeans", (zz, K), {"seed": int(r.integers(0, 1000))}, note="random clustered",
                  compare=["close", "exact", "close"])
    for clause in ("EQ-17-INIT", "EQ-17-STEP", "EQ-17-FIT"):
        fill(clause, lambda i, clause=clause: eq17(i, clause))
    # RET-LUT
    qb, Ckv = n(4, 8), n(2, 16, 8)
    B.add("RET-LUT", "lut_scores", (qb, Ckv))
    B.add("RET-LUT", "lut_scores", (qb, Ckv), {"scale": 1.0}, note="edge: explicit scale")
    B.add("RET-LUT", "token_scores", (n(4, 16), r.integers(0, 16, size=(2, 20)).astype(np.uint8)))
    B.add("RET-LUT", "token_scores", (n(4, 16), np.full((2, 5), 15, np.uint8)), note="edge: every code is K - 1")
    if full:
        C4096x2 = n(2, 4096, 64)
        B.add("RET-LUT", "lut_scores", (n(8, 64), C4096x2), note="realistic: K=4096, d=64, G=4")
        B.add("RET-LUT", "token_scores", (n(8, 4096), r.integers(0, 4096, (2, 4096)).astype(np.uint16)),
              note="realistic: K=4096, T=4096, G=4")

    def lut(i):
        d, nkv, G, K = int(2 * r.integers(1, 9)), int(r.integers(1, 3)), int(r.integers(1, 4)), int(r.integers(1, 300))
        if i % 2:
            B.add("RET-LUT", "lut_scores", (n(nkv * G, d), n(nkv, K, d)), note="random")
        else:
            codes = r.integers(0, K, (nkv, int(r.integers(1, 30)))).astype(O.code_dtype(K))
            B.add("RET-LUT", "token_scores", (n(nkv * G, K), codes), note="random")
    fill("RET-LUT", lut)
    # RET-TOPK
    for T, tk, nc, note in ((100, 0.03, None, ""), (33, 0.1, None, ""), (1000, 0.03, 10, "capped"), (50, 7, None, "int"),
                            (1, 1.0, None, "edge: T = 1"), (100, 0.29, None, "edge: 0.29*100 = 28.999... in float64 -> 28"),
                            (100, 0.07, None, "edge: 0.07*100 = 7.000000000000001 -> 7"), (3000, 0.03, None, "edge: authors' 3%"),
                            (131072, 0.03, None, "edge: T = 131072"), (10, 0.05, None, "edge: count 0"),
                            (5, 9, None, "edge: int topk > T"), (8, 1.0, 0, "edge: no candidates")):
        B.add("RET-TOPK", "topk_count", (T, tk) if nc is None else (T, tk, nc), compare=["exact"], note=note)
    fill("RET-TOPK", lambda i: B.add("RET-TOPK", "topk_count",
                                     (int(r.integers(1, 5000)), float(r.choice([0.01, 0.03, 0.1, 0.33, 0.5])) if i % 2 else int(r.integers(1, 50))),
                                     compare=["exact"], note="random"))
    # RET-SELECT

    def select(s, nkv, note, **kw):
        must, may = O.select_tokens_allowed(s, n_kv_heads=nkv, margin=_margin("RET-SELECT", s), **kw)
        B.add("RET-SELECT", "select_tokens", (s,), dict(kw, n_kv_heads=nkv), compare=[("mask", must, may)], note=note)
    s = n(4, 40)
    select(s, 2, "", query_pos=39, w=4, sinks=2, topk=0.1)
    select(s, 2, "edge: query before the end, w = 0", query_pos=20, w=0, sinks=0, topk=3)
    select(s, 2, "edge: w >= T", query_pos=39, w=64, sinks=2, topk=0.1)
    select(s, 2, "edge: sinks > T", query_pos=39, w=0, sinks=50, topk=0.1)
    select(np.round(s * 2) / 2, 2, "edge: exact ties", query_pos=39, w=2, sinks=1, topk=5)
    select(n(4, 1), 4, "edge: T = 1", query_pos=0, w=0, sinks=0, topk=1.0)
    if full:
        sb = n(8, 4096)
        select(sb, 2, "realistic: T=4096, G=4, authors' defaults", query_pos=4095, w=64, sinks=8, topk=0.03)
        select(np.round(sb * 4) / 4, 2, "realistic near ties: scores on a 1/4 grid", query_pos=4095, w=64, sinks=8, topk=0.03)

    def sel(i):
        nkv, G, T = int(r.integers(1, 3)), int(r.integers(1, 4)), int(r.integers(1, 60))
        s_ = n(nkv * G, T)
        if i % 3 == 0:
            s_ = np.round(s_ * 2) / 2
        select(s_, nkv, "random" + (" with ties" if i % 3 == 0 else ""), query_pos=int(r.integers(0, T)),
               w=int(r.integers(0, 8)), sinks=int(r.integers(0, 4)),
               topk=float(r.choice([0.03, 0.1, 0.5, 1.0])) if i % 2 else int(r.integers(1, 10)))
    fill("RET-SELECT", sel)
    # RET-ATTN

    def attn(nq, nkv, T, d, dv, note, p=0.3):
        m = r.random((nkv, T)) < p
        m[:, -1] = True
        B.add("RET-ATTN", "retrieval_attention", (n(nq, d), n(nkv, T, d), n(nkv, T, dv), m), note=note)
    attn(4, 2, 30, 8, 6, "")
    attn(2, 2, 1, 8, 8, "edge: T = 1")
    attn(4, 1, 30, 8, 8, "edge: everything selected", p=1.1)
    if full:
        attn(8, 2, 2048, 64, 64, "realistic: T=2048, d=64, G=4", p=0.05)
    fill("RET-ATTN", lambda i: attn(*(lambda nkv, G: (nkv * G, nkv))(int(r.integers(1, 3)), int(r.integers(1, 4))),
                                    int(r.integers(1, 40)), d := int(2 * r.integers(1, 9)), d, "random", p=float(r.random())))
    # RET-DECODE

    def decode(nq, nkv, T, d, K, note, *, trad=True, w=4, sinks=2, topk=0.2, b=2048, Ckv=None):
        inv = _inv(d)
        qp, kp, v = n(nq, d), n(nkv, T, d), n(nkv, T, d)
        Ckv = n(nkv, K, d) if Ckv is None else Ckv
        codes = r.integers(0, K, size=(nkv, T)).astype(O.code_dtype(K))
        kw = {"query_pos": T - 1, "b": b, "w": w, "sinks": sinks, "topk": topk, "inv_freqs": inv, "traditional": trad,
              "return_mask": True}
        out, m = O.decode_step(qp, kp, v, codes, Ckv, **kw)
        qbb = O.far_query(qp, b=b, inv_freqs=inv, traditional=trad, positions=T - 1)
        sc = O.token_scores(O.lut_scores(qbb, Ckv), codes)
        must, may = O.select_tokens_allowed(sc, n_kv_heads=nkv, query_pos=T - 1, w=w, sinks=sinks, topk=topk,
                                            margin=_margin("RET-DECODE", sc))
        B.add("RET-DECODE", "decode_step", (qp, kp, v, codes, Ckv), kw, outputs=(out, m),
              compare=["close", ("mask", must, may)], note=note)
        B.calls[-1]["outputs"][0]["over_mask"] = "out1"   # graded over the port's own (allowed) selection
    decode(4, 2, 30, 8, 16, "")
    decode(2, 2, 5, 8, 4, "edge: w >= T", w=8)
    decode(2, 1, 10, 8, 4, "edge: sinks > T, w = 0", w=0, sinks=12)
    decode(4, 2, 30, 8, 2, "edge: K = 2 (exact ties among tokens sharing a code)")
    if full:
        decode(8, 2, 2048, 64, 4096, "realistic: T=2048, K=4096, d=64, G=4, authors' defaults", trad=False, w=64, sinks=8,
               topk=0.03, Ckv=C4096x2)

    def dec(i):
        nkv, G, T, d = int(r.integers(1, 3)), int(r.integers(1, 4)), int(r.integers(1, 50)), int(2 * r.integers(1, 9))
        decode(nkv * G, nkv, T, d, int(r.choice([2, 16, 300])), "random", trad=bool(i % 2), w=int(r.integers(0, 8)),
               sinks=int(r.integers(0, 4)), topk=float(r.choice([0.03, 0.1, 0.5])) if i % 2 else int(r.integers(1, 8)),
               b=int(r.choice([64, 2048])))
    fill("RET-DECODE", dec)
    # PREFILL
    B.add("PREFILL", "prefill_attention", (n(4, 5, 8), n(2, 9, 8), n(2, 9, 6)), note="edge: Tq=5 < Tk=9, end-aligned")
    B.add("PREFILL", "prefill_attention", (n(2, 1, 8), n(2, 1, 8), n(2, 1, 8)), note="edge: Tq = Tk = 1")
    if full:
        B.add("PREFILL", "prefill_attention", (n(8, 64, 64), n(2, 2048, 64), n(2, 2048, 64)),
              note="realistic: Tq=64 chunk, Tk=2048, d=64, G=4")

    def pre(i):
        nkv, G, d = int(r.integers(1, 3)), int(r.integers(1, 4)), int(2 * r.integers(1, 9))
        Tk = int(r.integers(1, 30))
        Tq = int(r.integers(1, Tk + 1))
        B.add("PREFILL", "prefill_attention", (n(nkv * G, Tq, d), n(nkv, Tk, d), n(nkv, Tk, d)), note="random")
    fill("PREFILL", pre)
    # CODES-DTYPE
    for K in (1, 2, 255, 256, 257, 4096, 65535, 65536):
        B.add("CODES-DTYPE", "code_dtype", (K,), compare=["exact"], note="edge: uint8/uint16 boundaries")
    fill("CODES-DTYPE", lambda i: B.add("CODES-DTYPE", "code_dtype", (int(r.integers(1, 65537)),), compare=["exact"],
                                        note="random"))
    # INPUT-ERRORS
    H8 = H
    bad = n(2, 8)
    bad[0, 0] = np.nan
    inf = keys.copy()
    inf[1, 2] = np.inf
    errors = [
        ("rope_apply", (n(2, 7), np.arange(2), np.ones(4)), {"traditional": False}, "odd head_dim"),
        ("assign", (bad, C, H8), {}, "NaN key"),
        ("assign", (inf, C, H8), {}, "inf key"),
        ("cholesky", (np.diag([-1.0] + [1.0] * 7),), {}, "H not positive definite"),
        ("cholesky", (n(8, 8) + 10 * np.eye(8),), {}, "H not symmetric"),
        ("assign", (keys, n(4, 10), H8), {}, "codebook width mismatch"),
        ("wrope_scores", (q, k), {"w": -1, "b": 64, "inv_freqs": inv8, "traditional": False}, "negative w"),
        ("wrope_scores", (q, k), {"w": 2, "b": -1, "inv_freqs": inv8, "traditional": False}, "negative b"),
        ("code_dtype", (65537,), {}, "K > 65536"),
        ("code_dtype", (0,), {}, "K = 0"),
        ("rope_inv_freqs", (7, 10000.0, None), {}, "odd head_dim"),
        ("rope_inv_freqs", (8, 10000.0, {"rope_type": "yarn", "factor": 4.0}), {}, "unsupported RoPE scaling yarn"),
        ("rope_apply", (n(2, 8), np.arange(2), np.ones(3)), {"traditional": True}, "inv_freqs length != d/2"),
        ("query_moment", (n(3, 4, 8),), {"n_kv_heads": 2, "b": 2048, "inv_freqs": inv8, "traditional": True},
         "n_q not a multiple of n_kv"),
        ("z_transform", (keys, np.triu(L.T) + np.triu(np.ones((8, 8)), 1)), {}, "L not lower triangular"),
        ("kmeanspp_init", (z[:2], 3, np.array([0.1, 0.2, 0.3])), {}, "N < K"),
        ("kmeanspp_init", (z, 2, np.array([0.1, 1.0])), {}, "uniform outside [0, 1)"),
        ("topk_count", (10, 1.5), {}, "float topk > 1"),
        ("topk_count", (10, 0), {}, "int topk 0"),
        ("select_tokens", (n(4, 10),), {"n_kv_heads": 2, "query_pos": 10, "w": 2, "sinks": 1, "topk": 0.5},
         "query_pos >= T"),
        ("token_scores", (n(2, 16), np.array([[0, 16]])), {}, "code out of range"),
        ("retrieval_attention", (n(2, 8), n(1, 5, 8), n(1, 5, 8), np.zeros((1, 5), bool)), {}, "empty selection"),
        ("prefill_attention", (n(2, 6, 8), n(2, 5, 8), n(2, 5, 8)), {}, "Tq > Tk"),
    ]
    for fn, args, kw, note in errors:
        B.add("INPUT-ERRORS", fn, args, kw, expect_error=True, note=note)


# --------------------------------------------------------------------------- manifest


def generate(seed: int = 0, size: str = "small") -> tuple[dict, dict]:
    """-> (manifest, arrays). Deterministic for a given seed and size."""

    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    B = _Builder(seed)
    _stateless(B, size)

    build_traces(B, size)
    manifest = {"format": FORMAT, "spec_version": SPEC_VERSION, "spec_sha256": spec_sha256(), "seed": seed,
                "size": size, "generator": "a2ats_conformance.vectors.export", "compare": _COMPARE,
                "graded_dtypes": list(GRADED_DTYPES), "calls": B.calls, "traces": B.traces}
    return manifest, B.arrays


def write_vectors(out_dir: str, seed: int = 0, size: str = "small") -> str:
    """Write DIR/manifest.json and DIR/arrays/; UntrustedFileError (a ValueError) naming the path that cannot be
    written (an empty --out, a read-only or full disk); the manifest is written last, so a folder whose writing
    failed has none and is not mistaken for vectors."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
    if not out_dir:
        raise UntrustedFileError("--out: the path is empty; name a folder to write the vectors into")
    manifest, arrays = generate(seed, size)
    _make_folder(os.path.join(out_dir, "arrays"), "vectors folder")
    path = os.path.join(out_dir, "manifest.json")
    if os.path.lexists(path):
        os.remove(path)
    for key, a in arrays.items():
        with _writing(os.path.join(out_dir, "arrays", f"{key}.npy")) as f:
            np.save(f, a, allow_pickle=False)
    with _writing(path) as f:   # a manifest is whole or absent
        f.write(json.dumps(manifest, indent=1).encode())
    return path


# --------------------------------------------------------------------------- answering with a Python adapter


def check_vectors(vectors_dir: str, adapter, dtype: str | None = None) -> list[tuple[str, str]]:
    """Answer with ``adapter`` and grade; -> [(case id, problem)] for every case that is not a pass."""

    with tempfile.TemporaryDirectory() as tmp:
        write_answers(vectors_dir, adapter, tmp, dtype)
        results = grade_cases(vectors_dir, tmp, dtype or adapter.dtypes[0])
        results.pop("__unused__")
    return [(cid, r["message"] if r["outcome"] != "not-implemented" else "not-implemented")
            for cid, r in results.items() if r["outcome"] != "passed"]


def _seed(text: str) -> int:
    """argparse type of --seed (argparse names the flag in its message)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v} (numpy's generator takes no negative seed)")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="a2ats-conformance vectors", description="write oracle golden vectors "
                                "(VECTORS.md) for ports in any language",
                                epilog="exit status: 0 when written (and, with --check, every case passes); 1 when a "
                                       "--check case fails; 2 on a usage error or a folder that cannot be written")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write manifest.json and arrays/ into")
    p.add_argument("--seed", type=_seed, default=0, help="generator seed, an integer >= 0 (default 0)")
    p.add_argument("--size", default="small", choices=SIZES,
                   help="small (default): edge cases and small random cases; full: plus realistic shapes")
    p.add_argument("--check", default=None, metavar="IUT", help="also answer with an adapter 'module:object' and grade it")
    p.add_argument("--dtype", default=None, help="dtype for --check: float32 or float64 (default: the adapter's first)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)

    t0 = time.perf_counter()
    try:
        path = write_vectors(a.out, a.seed, a.size)
    except ValueError as exc:    # an empty, read-only or full --out
        print(f"a2ats-conformance vectors: {exc}", file=sys.stderr)
        return 2
    manifest, _ = load_vectors(a.out)
    print(f"wrote {len(manifest['calls'])} calls and {len(manifest['traces'])} traces ({a.size}) to {path} "
          f"in {time.perf_counter() - t0:.1f} s")
    if a.check:
        t1 = time.perf_counter()
        ad = load_adapter(a.check)
        problems = check_vectors(a.out, ad, a.dtype)
        for cid, msg in problems:
            print(f"FAIL {cid}: {msg}")
        total = len(manifest["calls"]) + len(manifest["traces"])
        print(f"{total - len(problems)}/{total} cases pass; answered and graded in {time.perf_counter() - t1:.1f} s "
              f"(generation + grading {time.perf_counter() - t0:.1f} s)")
        return 1 if any(m != "not-implemented" for _, m in problems) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
