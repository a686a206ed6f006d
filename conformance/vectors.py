"""Golden vectors: oracle-computed inputs and outputs per clause, for ports that cannot run Python.

    a2ats-conformance vectors --out DIR [--seed S]

writes DIR/manifest.json and DIR/arrays/*.npy (format documented in VECTORS.md; no pickle).
``check_vectors(DIR, adapter)`` replays every case on an adapter and returns the failures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from a2ats_spec import oracle as O

from .hypothesis_helpers import spd_matrix
from .tolerances import DTYPES, tie_margin, tolerance

__all__ = ["FORMAT", "generate", "write_vectors", "load_vectors", "check_vectors", "main"]

FORMAT = "a2ats-golden-vectors/1"


def _f32(x):
    """Float32-representable float64 values (every port sees exactly the oracle's inputs)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.cases: list[dict] = []
        self.arrays: dict[str, np.ndarray] = {}

    def normal(self, *shape):
        return _f32(self.rng.standard_normal(shape))

    def _enc(self, cid: str, name: str, v):
        if isinstance(v, np.ndarray):
            key = f"{cid}.{name}"
            self.arrays[key] = v
            return {"array": f"arrays/{key}.npy"}
        if isinstance(v, np.dtype):
            return {"dtype": v.name}
        if isinstance(v, dict):
            return {"value": {k: (float(x) if isinstance(x, float) else x) for k, x in v.items()}}
        if isinstance(v, (np.integer,)):
            return {"value": int(v)}
        if isinstance(v, (np.floating,)):
            return {"value": float(v)}
        return {"value": v}

    def add(self, clause: str, fn: str, args=(), kwargs=None, *, note: str = "", compare=None, expect_error=False,
            outputs=None):
        """compare: one entry per output: "close" | "exact" | ("allowed", allowed (..., K)) | ("mask", must, may)."""
        kwargs = kwargs or {}
        cid = f"{clause}.{fn}.{sum(1 for c in self.cases if c['clause'] == clause):03d}"
        case = {"id": cid, "clause": clause, "function": fn, "note": note,
                "args": [self._enc(cid, f"arg{i}", a) for i, a in enumerate(args)],
                "kwargs": {k: self._enc(cid, f"kw_{k}", v) for k, v in kwargs.items()},
                "tolerance": {d: list(tolerance(d, clause)) for d in DTYPES}}
        if expect_error:
            case["expect"] = "ValueError"
        else:
            out = outputs if outputs is not None else getattr(O, fn)(*args, **kwargs)
            outs = list(out) if isinstance(out, tuple) else [out]
            compare = compare or ["close"] * len(outs)
            case["outputs"] = []
            for i, (o, c) in enumerate(zip(outs, compare)):
                ent = self._enc(cid, f"out{i}", np.asarray(o) if not isinstance(o, (int, np.dtype)) else o)
                kind = c if isinstance(c, str) else c[0]
                ent["compare"] = kind
                if kind == "allowed":
                    ent["allowed"] = self._enc(cid, f"out{i}_allowed", c[1])
                elif kind == "mask":
                    ent["must"] = self._enc(cid, f"out{i}_must", c[1])
                    ent["may"] = self._enc(cid, f"out{i}_may", c[2])
                case["outputs"].append(ent)
        self.cases.append(case)


def generate(seed: int = 0) -> tuple[dict, dict]:
    """-> (manifest, arrays). Deterministic for a given seed."""
    B = _Builder(seed)
    n, r = B.normal, B.rng
    inv64 = _f32(O.rope_inv_freqs(64, 10000.0))
    inv8 = _f32(O.rope_inv_freqs(8, 10000.0))
    # ROPE-*
    for d, base, sc in ((64, 10000.0, None), (64, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                        (8, 10000.0, {"type": "linear", "factor": 2.0})):
        B.add("ROPE-FREQ", "rope_inv_freqs", (d, base, sc), note="default / llama3 / linear scaling")
    for trad in (True, False):
        x, pos = n(2, 5, 8), np.array([0, 1, 2, 4095, 4096])
        B.add("ROPE-APPLY", "rope_apply", (x, pos, inv8), {"traditional": trad}, note="positions incl. 0 and 4096")
        B.add("ROPE-INVERSE", "rope_invert", (x, pos, inv8), {"traditional": trad})
    B.add("ROPE-INVERSE", "rope_invert", (n(6, 64), np.arange(100, 106), inv64), {"traditional": False},
          note="contiguous block: per-token inverse, not a rotation by -100")
    # EQ-10 .. EQ-12
    B.add("EQ-10", "query_moment", (n(6, 7, 8),), {"n_kv_heads": 2, "b": 2048, "inv_freqs": inv8, "traditional": True},
          note="GQA group of 3 pooled")
    q, k = n(6, 8), n(6, 8)
    for w in (0, 2, 6):
        B.add("EQ-11", "wrope_scores", (q, k), {"w": w, "b": 2048, "inv_freqs": inv8, "traditional": False},
              note="default positions; i-j = w-1 near, i-j = w far")
    B.add("EQ-11", "wrope_scores", (q, k), {"w": 3, "b": 64, "inv_freqs": inv8, "traditional": True,
                                            "q_positions": np.arange(1000, 1006), "k_positions": np.arange(995, 1001)})
    B.add("EQ-12", "far_keys", (n(2, 5, 8), np.arange(10, 15), inv8), {"traditional": True})
    B.add("EQ-12", "far_query", (n(3, 8),), {"b": 2048, "inv_freqs": inv8, "traditional": False})
    B.add("EQ-12", "far_query", (n(3, 8),), {"b": 2048, "inv_freqs": inv8, "traditional": False,
                                             "positions": np.array([7, 7, 7])}, note="post-RoPE query at 7")
    # EQ-13 .. EQ-18
    H = _f32(spd_matrix(r, 8, cond=100.0))
    C = n(16, 8)
    keys = n(10, 8)
    B.add("EQ-13", "score_error", (keys, C[:10], H))
    for name, CC, HH in (("anisotropic H", C, H), ("duplicate codewords (exact tie)", np.concatenate([C, C[:2]]), H),
                         ("H = I: nearest centroid", C, np.eye(8))):
        dist = O.assign_distances(keys, CC, HH)
        B.add("EQ-14", "assign", (keys, CC, HH), note=name,
              compare=[("allowed", O.argmin_allowed(dist, tie_margin("float32", "EQ-14") * max(1.0, np.abs(dist).max())))])
    B.add("EQ-15", "cholesky", (H,))
    L = _f32(O.cholesky(H))
    L = np.tril(L)
    B.add("EQ-16", "z_transform", (keys, L))
    dist = O.assign_z_distances(keys, C, L)
    B.add("EQ-16", "assign_z", (keys, C, L),
          compare=[("allowed", O.argmin_allowed(dist, tie_margin("float32", "EQ-16") * max(1.0, np.abs(dist).max())))])
    B.add("EQ-18", "back_transform", (C, L))
    z = _f32(np.concatenate([r.standard_normal((12, 3)) + 6 * c for c in np.eye(3)]))
    B.add("EQ-17-INIT", "kmeanspp_init", (z, 3, np.array([0.1, 0.5, 0.9])))
    C0 = _f32(np.stack([z[0], z[1], z[2] + 100.0]))
    B.add("EQ-17-STEP", "lloyd_step", (z, C0), note="third centre far away: empty-cluster rule",
          compare=["close", "exact", "close"])
    Cf, codes, hist = O.kmeans(z, 3, seed=1)
    B.add("EQ-17-FIT", "kmeans", (z, 3), {"seed": 1}, outputs=(Cf, codes, hist), compare=["close", "exact", "close"])
    # RET-*
    qb, Ckv = n(4, 8), n(2, 16, 8)
    B.add("RET-LUT", "lut_scores", (qb, Ckv))
    cds = r.integers(0, 16, size=(2, 20)).astype(np.uint8)
    B.add("RET-LUT", "token_scores", (n(4, 16), cds))
    for T, tk, nc in ((100, 0.03, None), (33, 0.1, None), (1000, 0.03, 10), (50, 7, None), (1, 1.0, None)):
        B.add("RET-TOPK", "topk_count", (T, tk) if nc is None else (T, tk, nc), compare=["exact"])
    s = n(4, 40)
    for kw in ({"query_pos": 39, "w": 4, "sinks": 2, "topk": 0.1}, {"query_pos": 20, "w": 0, "sinks": 0, "topk": 3}):
        must, may = O.select_tokens_allowed(s, n_kv_heads=2, margin=1e-4, **kw)
        B.add("RET-SELECT", "select_tokens", (s,), dict(kw, n_kv_heads=2), compare=[("mask", must, may)])
    qp, kp, v = n(4, 8), n(2, 30, 8), n(2, 30, 6)
    mask = r.random((2, 30)) < 0.3
    mask[:, -1] = True
    B.add("RET-ATTN", "retrieval_attention", (qp, kp, v, mask))
    kwd = {"query_pos": 29, "b": 2048, "w": 4, "sinks": 2, "topk": 0.2, "inv_freqs": inv8, "traditional": True,
           "return_mask": True}
    codes30 = r.integers(0, 16, size=(2, 30)).astype(np.uint8)
    out, m = O.decode_step(qp, kp, v, codes30, Ckv, **kwd)
    qbb = O.far_query(qp, b=2048, inv_freqs=inv8, traditional=True, positions=29)
    sc = O.token_scores(O.lut_scores(qbb, Ckv), codes30)
    must, may = O.select_tokens_allowed(sc, n_kv_heads=2, query_pos=29, w=4, sinks=2, topk=0.2, margin=1e-4)
    B.add("RET-DECODE", "decode_step", (qp, kp, v, codes30, Ckv), kwd, outputs=(out, m),
          compare=["close", ("mask", must, may)], note="selection unique up to margin 1e-4" if np.array_equal(must, may) else "")
    B.add("PREFILL", "prefill_attention", (n(4, 5, 8), n(2, 9, 8), n(2, 9, 6)), note="Tq=5 < Tk=9, end-aligned")
    for K in (1, 256, 257, 4096, 65536):
        B.add("CODES-DTYPE", "code_dtype", (K,), compare=["exact"])
    # INPUT-ERRORS
    B.add("INPUT-ERRORS", "rope_apply", (n(2, 7), np.arange(2), np.ones(4)), {"traditional": False}, expect_error=True,
          note="odd head_dim")
    bad = n(2, 8)
    bad[0, 0] = np.nan
    B.add("INPUT-ERRORS", "assign", (bad, C, H), expect_error=True, note="NaN key")
    Hn = H.copy()
    Hn[0, 0] = -1.0
    B.add("INPUT-ERRORS", "cholesky", (Hn,), expect_error=True, note="H not positive definite")
    B.add("INPUT-ERRORS", "assign", (keys, n(4, 10), H), expect_error=True, note="codebook width mismatch")
    B.add("INPUT-ERRORS", "wrope_scores", (q, k), {"w": -1, "b": 64, "inv_freqs": inv8, "traditional": False},
          expect_error=True, note="negative w")
    B.add("INPUT-ERRORS", "code_dtype", (65537,), expect_error=True, note="K > 65536")
    manifest = {"format": FORMAT, "seed": seed, "generator": "a2ats_conformance.vectors",
                "compare": {"close": "|actual - expected| <= atol + rtol*|expected|, (rtol, atol) = tolerance[dtype]",
                            "exact": "equal (ints, dtype names)",
                            "allowed": "integer codes c: allowed[..., c] is True",
                            "mask": "bool mask M: must <= M <= may"},
                "cases": B.cases}
    return manifest, B.arrays


def write_vectors(out_dir: str, seed: int = 0) -> str:
    manifest, arrays = generate(seed)
    os.makedirs(os.path.join(out_dir, "arrays"), exist_ok=True)
    for key, a in arrays.items():
        np.save(os.path.join(out_dir, "arrays", f"{key}.npy"), a, allow_pickle=False)
    path = os.path.join(out_dir, "manifest.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return path


def load_vectors(out_dir: str):
    with open(os.path.join(out_dir, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{out_dir}: not {FORMAT} vectors (format {manifest.get('format')!r})")

    def dec(v):
        if "array" in v:
            return np.load(os.path.join(out_dir, v["array"]), allow_pickle=False)
        if "dtype" in v:
            return np.dtype(v["dtype"])
        return v["value"]

    return manifest, dec


def check_vectors(out_dir: str, adapter, dtype: str = "float32") -> list[tuple[str, str]]:
    """Replay every case on ``adapter`` with inputs cast to ``dtype``; -> [(case id, problem)] (empty: all pass)."""
    from .pytest_helpers import round_to_dtype, to_numpy

    manifest, dec = load_vectors(out_dir)
    try:
        adapter.input_dtype = dtype
    except AttributeError:
        pass
    problems = []
    for case in manifest["cases"]:
        fn = getattr(adapter, case["function"], None)
        if not callable(fn):
            problems.append((case["id"], "not-implemented"))
            continue
        cast = lambda x, k=None: round_to_dtype(x, dtype, param=(k == "inv_freqs"))  # noqa: E731
        args = [cast(dec(a)) for a in case["args"]]
        kwargs = {k: cast(dec(v), k) for k, v in case["kwargs"].items()}
        try:
            got = to_numpy(fn(*args, **kwargs))
        except ValueError as exc:
            if case.get("expect") != "ValueError":
                problems.append((case["id"], f"raised ValueError: {exc}"))
            continue
        except Exception as exc:  # noqa: BLE001 - report any crash as a problem of this case
            problems.append((case["id"], f"raised {type(exc).__name__}: {exc}"))
            continue
        if case.get("expect") == "ValueError":
            problems.append((case["id"], "expected ValueError, the call returned"))
            continue
        outs = list(got) if isinstance(got, tuple) else [got]
        rtol, atol = case["tolerance"][dtype]
        for i, ent in enumerate(case["outputs"]):
            g = outs[i] if i < len(outs) else None
            kind = ent["compare"]
            exp = dec(ent)
            if kind == "close":
                g64 = np.asarray(g, np.float64)
                if g64.shape != np.shape(exp) or not np.allclose(g64, exp, rtol=rtol, atol=atol):
                    problems.append((case["id"], f"output {i} not within (rtol={rtol}, atol={atol})"))
            elif kind == "exact":
                ok = (np.dtype(g) == exp) if isinstance(exp, np.dtype) else np.array_equal(np.asarray(g), exp)
                if not ok:
                    problems.append((case["id"], f"output {i}: {g!r} != {exp!r}"))
            elif kind == "allowed":
                allowed = dec(ent["allowed"])
                c = np.asarray(g).astype(np.int64)
                if c.shape != allowed.shape[:-1] or not np.all(np.take_along_axis(allowed, c[..., None], -1)):
                    problems.append((case["id"], f"output {i}: codes outside the allowed set"))
            elif kind == "mask":
                m = np.asarray(g, bool)
                must, may = dec(ent["must"]), dec(ent["may"])
                if m.shape != must.shape or np.any(must & ~m) or np.any(m & ~may):
                    problems.append((case["id"], f"output {i}: mask outside must <= M <= may"))
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="a2ats-conformance vectors", description="write oracle golden vectors")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", default=None, metavar="IUT", help="also check an adapter 'module:object' against them")
    p.add_argument("--dtype", default=None, help="dtype for --check (default: the adapter's first)")
    a = p.parse_args(argv)
    path = write_vectors(a.out, a.seed)
    manifest, _ = load_vectors(a.out)
    print(f"wrote {len(manifest['cases'])} cases to {path}")
    if a.check:
        from .adapter import load_adapter

        ad = load_adapter(a.check)
        problems = check_vectors(a.out, ad, a.dtype or ad.dtypes[0])
        for cid, msg in problems:
            print(f"FAIL {cid}: {msg}")
        print(f"{len(manifest['cases']) - len(problems)}/{len(manifest['cases'])} cases pass")
        return 1 if any(m != "not-implemented" for _, m in problems) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
