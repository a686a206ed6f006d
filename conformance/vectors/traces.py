"""Golden traces for the CACHE-* clauses: operation sequences on one cache, with what each step must return.

A trace creates a cache (config and codebook as in README-ADAPTER.md's cache protocol), then runs steps:
``append`` (post-RoPE keys and values of the next tokens), ``decode`` (one query at position offset - 1),
``prefill`` (queries of the last t tokens), ``trim`` (n tokens) and ``save_load`` (save, load, continue on the
loaded cache). After each step the vectors say what it must return: the codes (allowed sets, near ties
included), the offset, the number trimmed, the selection (must ⊆ M ⊆ may) and the attention output (tolerance
per dtype). Expected values come from ``a2ats_spec.oracle.OracleCache``; the grader replays the trace on it to
check a decode output against exact attention over the selection the port actually made.

``build_traces`` writes them (vectors.py), ``run_trace`` answers one with a Python cache, ``grade_trace`` grades
the answers (grade.py). VECTORS.md documents the format.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from a2ats_spec import oracle as O
from a2ats_spec.clauses import clause_ids

from a2ats_conformance.harness.hypothesis_helpers import spd_matrix
from a2ats_conformance.harness.tolerances import DTYPES, tie_margin, tolerance

__all__ = ["build_traces", "run_trace", "grade_trace"]


def _f32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


class _Trace:
    """Builds one trace: runs every step on an OracleCache and records the step with its expectations."""

    def __init__(self, B, clause: str, note: str, *, n_kv=2, G=2, d=8, K=16, w=4, b=2048, sinks=2, topk=0.25,
                 traditional=True, batch=None, max_position=0, codebook=None, dup=0):
        self.B, self.r = B, B.rng
        self.clause, self.note = clause, note
        self.id = f"{clause}.trace.{sum(1 for t in B.traces if t['clause'] == clause):03d}"
        self.max_position = max_position   # margins and tolerances grow past the table's bound (tolerances.py)
        if codebook is None:
            Cz = _f32(self.r.standard_normal((n_kv, K, d)))
            if dup:   # exact ties: the last `dup` codewords repeat the first ones
                Cz[:, K - dup:] = Cz[:, :dup]
            L = np.stack([np.tril(_f32(O.cholesky(spd_matrix(self.r, d, cond=10.0)))) for _ in range(n_kv)])
        else:
            Cz, L = codebook
        inv = _f32(O.rope_inv_freqs(d, 10000.0))
        self.config = dict(n_kv_heads=n_kv, n_q_heads=n_kv * G, head_dim=d, Cz=Cz, L=L,
                           C=_f32(O.back_transform(Cz, L)), inv_freqs=inv, traditional=traditional, w=w, b=b,
                           sinks=sinks, topk=topk, scale=None)
        if batch is not None:
            self.config["batch"] = batch
        self.lead = () if batch is None else (batch,)
        self.cache = O.OracleCache(self.config)
        self.steps: list[dict] = []
        self.ops: set[str] = set()

    # -- expectations
    def _name(self, what):
        return f"{len(self.steps):03d}.{what}"

    def _expect_state(self, exp):
        dist = self.cache.code_distances()
        margin = tie_margin("float32", "CACHE-FAR-CODES", self.max_position) * max(1.0, float(np.abs(dist).max()) if dist.size else 1.0)
        allowed = O.argmin_allowed(dist, margin) if dist.size else np.zeros(dist.shape, bool)
        ent = self.B.output(self.id, self._name("codes"), self.cache.codes(), ("allowed", allowed))
        ent["code_dtype"] = O.code_dtype(self.config["Cz"].shape[1]).name
        exp.append(ent)
        exp.append(self.B.output(self.id, self._name("offset"), int(self.cache.offset), "exact"))

    def _record(self, op, fields, exp):
        step = {"op": op, **{k: (self.B.array(f"{self.id}.{len(self.steps):03d}.{k}", v) if isinstance(v, np.ndarray)
                                 else {"value": v}) for k, v in fields.items()}, "expect": exp}
        self.steps.append(step)

    # -- operations
    def _keys(self, t, k_pre=None):
        """Post-RoPE keys of the next t tokens, redrawn where a code would be a near tie between distinct codewords."""
        n_kv, d = self.config["n_kv_heads"], self.config["head_dim"]
        k_pre = _f32(self.r.standard_normal(self.lead + (n_kv, t, d))) if k_pre is None else k_pre
        pos = np.arange(self.cache.offset, self.cache.offset + t)
        Cz, L = self.config["Cz"], self.config["L"]
        for _ in range(50):
            k_post = _f32(O.rope_apply(k_pre, pos, self.config["inv_freqs"], traditional=self.config["traditional"]))
            far = O.far_keys(k_post, pos, self.config["inv_freqs"], traditional=self.config["traditional"])
            bad = np.zeros(k_pre.shape[:-1], bool)
            for g in range(n_kv):
                dist = O.assign_z_distances(far[..., g, :, :], Cz[g], L[g])
                # twice the grading margin: no key is drawn near a tie between distinct codewords
                m = tie_margin("float32", "CACHE-FAR-CODES", self.max_position) * 2 * max(1.0, float(np.abs(dist).max()))
                allowed = O.argmin_allowed(dist, m)
                zc = Cz[g]
                for idx in zip(*np.nonzero(allowed.sum(-1) > 1)):
                    js = np.flatnonzero(allowed[idx])
                    if not all(np.array_equal(zc[js[0]], zc[j]) for j in js):
                        bad[idx[:-1] + (g, idx[-1])] = True
            if not bad.any():
                return k_post
            k_pre = k_pre.copy()
            k_pre[bad] = _f32(self.r.standard_normal((int(bad.sum()), d)))
        raise RuntimeError(f"{self.id}: could not draw keys away from near ties")

    def append(self, t, k_pre=None, values=None):
        k_post = self._keys(t, k_pre)
        n_kv, d = self.config["n_kv_heads"], self.config["head_dim"]
        v = _f32(self.r.standard_normal(self.lead + (n_kv, t, d))) if values is None else values
        self.cache.append(k_post, v)
        exp = []
        self._expect_state(exp)
        self._record("append", {"keys": k_post, "values": v}, exp)

    def decode(self):
        self.ops.add("decode")
        n_q, d, i = self.config["n_q_heads"], self.config["head_dim"], self.cache.offset - 1
        q = _f32(O.rope_apply(self.r.standard_normal(self.lead + (n_q, d)), i, self.config["inv_freqs"],
                              traditional=self.config["traditional"]))
        out, mask = self.cache.decode(q)
        s = self.cache.decode_scores(q, self.cache.codes())
        margin = tie_margin("float32", "CACHE-DECODE", self.max_position) * max(1.0, float(np.abs(s).max()))
        must, may = self.cache.decode_allowed(q, self.cache.codes(), margin)
        ent_mask = self.B.output(self.id, self._name("mask"), mask, ("mask", must, may))
        ent_out = self.B.output(self.id, self._name("out"), out, "close")
        ent_out["over_mask"] = ent_mask["name"]
        self._record("decode", {"q": q}, [ent_mask, ent_out])

    def prefill(self, t):
        self.ops.add("prefill")
        n_q, d = self.config["n_q_heads"], self.config["head_dim"]
        pos = np.arange(self.cache.offset - t, self.cache.offset)
        q = _f32(O.rope_apply(self.r.standard_normal(self.lead + (n_q, t, d)), pos, self.config["inv_freqs"],
                              traditional=self.config["traditional"]))
        out = self.cache.prefill(q)
        self._record("prefill", {"q": q}, [self.B.output(self.id, self._name("out"), out, "close")])

    def trim(self, n):
        self.ops.add("trim")
        got = self.cache.trim(n)
        exp = [self.B.output(self.id, self._name("trimmed"), int(got), "exact")]
        self._expect_state(exp)
        self._record("trim", {"n": int(n)}, exp)

    def save_load(self):
        self.ops.add("save_load")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "cache")
            self.cache.save(path)
            self.cache = self.cache.load(path)
        exp = []
        self._expect_state(exp)
        self._record("save_load", {}, exp)

    def done(self):
        cfg = {k: self.B.enc(self.id, f"config_{k}", v) for k, v in self.config.items()}
        requires = {"cache_ops": sorted(self.ops | {"append"} | ({"batch"} if "batch" in self.config else set()))}
        requires["rope_layouts"] = ["traditional" if self.config["traditional"] else "half"]
        if isinstance(self.config["topk"], float):
            requires["topk"] = ["fraction"]
        else:
            requires["topk"] = ["count"]
        self.B.traces.append({"id": self.id, "clause": self.clause, "note": self.note, "requires": requires,
                              "config": cfg, "max_position": self.max_position,
                              "tolerance": {dt: list(tolerance(dt, self.clause, self.max_position)) for dt in DTYPES},
                              "steps": self.steps})


def build_traces(B, size: str) -> None:
    """Every CACHE-* clause gets traces; ``size`` 'full' adds larger ones."""
    r = B.rng
    full = size == "full"
    batch_clause = "CACHE-BATCH" if "CACHE-BATCH" in clause_ids() else "CACHE-DECODE"

    # CACHE-CHUNK: the same prompt one-shot and in chunks, prefill after each chunk
    for chunks, trad in (((13,), True), ((3, 1, 5, 4), True), ((13,), False), ((1,) * 5 + (8,), False)):
        state = np.random.default_rng(int(r.integers(2**31)))
        t = _Trace(B, "CACHE-CHUNK", f"prefill in chunks {list(chunks)}" + ("" if trad else ", half-split RoPE"),
                   traditional=trad)
        k_all = _f32(state.standard_normal((2, sum(chunks), 8)))
        v_all = _f32(state.standard_normal((2, sum(chunks), 8)))
        at = 0
        for c in chunks:
            t.append(c, k_all[:, at:at + c], v_all[:, at:at + c])
            at += c
            t.prefill(c)
        t.decode()
        t.done()
    # CACHE-TRIM: speculative verify-then-trim, trim to 0, trim(n > offset)
    for G, trad, topk in ((1, True, 0.25), (4, False, 3)):
        t = _Trace(B, "CACHE-TRIM", f"speculative decoding: verify 4 drafts, reject 3, re-append; G={G}", G=G,
                   traditional=trad, topk=topk)
        t.append(10)
        t.decode()
        for _ in range(2):
            t.append(4)         # draft tokens
            t.prefill(4)        # verify them
            t.trim(3)           # reject three
            t.decode()
            t.append(1)         # the accepted continuation
            t.decode()
        t.trim(t.cache.offset)  # trim to 0
        t.append(5)
        t.decode()
        t.trim(100)             # n > offset: trims what there is
        t.append(2)
        t.decode()
        t.done()
    # CACHE-DECODE: growth past 256, w = 0, GQA 1 and > 1, both layouts, exact ties
    for G, trad, w, sinks, topk, K, dup, note in (
            (1, True, 0, 0, 0.1, 16, 0, "growth past 256 one token at a time, w = 0, no sinks, G = 1"),
            (4, False, 8, 3, 0.05, 16, 4, "growth past 256, G = 4, half-split RoPE, duplicate codewords (exact ties)"),
            (2, True, 4, 2, 2, 2, 0, "K = 2: exact score ties among tokens sharing a code, int topk")):
        t = _Trace(B, "CACHE-DECODE", note, G=G, traditional=trad, w=w, sinks=sinks, topk=topk, K=K, dup=dup)
        t.append(int(r.integers(1, 9)))
        while t.cache.offset < (300 if K > 2 else 40):
            t.append(1 if t.cache.offset > 240 else int(r.integers(1, 40)))
            t.decode()
        t.done()
    # positions up to 131,072 (keys near well-separated codewords, so codes stay unambiguous at large angles)
    T_long = 131_073 if full else 8_193
    d = 4
    Cz = _f32(3.0 * np.eye(d)[None].repeat(1, 0))[:, :, :]
    Cz = _f32(np.concatenate([Cz, -Cz], axis=1))          # (1, 8, 4): ±3 e_i
    L = _f32(np.eye(d)[None])
    t = _Trace(B, "CACHE-DECODE", f"positions up to {T_long - 1:,}: one long append, then single tokens",
               n_kv=1, G=2, d=d, K=8, w=64, sinks=8, topk=0.03, max_position=T_long - 1, codebook=(Cz, L))
    n0 = T_long - 3

    def near(n):
        return _f32(Cz[0][r.integers(0, 8, n)][None] + 0.05 * r.standard_normal((1, n, d)))
    t.append(n0, near(n0))
    t.decode()
    t.append(2, near(2))
    t.decode()
    t.append(1, near(1))
    t.decode()
    t.done()
    # CACHE-FAR-CODES: the same pre-RoPE keys written after pads of different lengths; K at the uint8/uint16 edge
    for K in (256, 257):
        keys = _f32(r.standard_normal((2, 6, 8)))
        for pad in (0, 37):
            t = _Trace(B, "CACHE-FAR-CODES", f"K = {K} ({O.code_dtype(K).name} codes); same pre-RoPE keys after {pad} pad tokens",
                       K=K)
            if pad:
                t.append(pad)
            t.append(6, keys)
            t.append(3)
            t.decode()
            t.done()
    # CACHE-DENSE-EQUIV: w >= T, sinks > T, topk covering everything
    for note, kw in (("w >= T", dict(w=64)), ("sinks > T", dict(w=0, sinks=40)), ("topk = 1.0", dict(topk=1.0))):
        t = _Trace(B, "CACHE-DENSE-EQUIV", f"everything selected: {note}", **kw)
        t.append(20)
        t.decode()
        t.append(5)
        t.prefill(5)
        t.decode()
        t.done()
    # CACHE-SAVE: save/load at 0 tokens and mid-stream, then continue
    t = _Trace(B, "CACHE-SAVE", "save/load empty, then mid-stream; continue on the loaded cache")
    t.save_load()
    t.append(12)
    t.decode()
    t.save_load()
    t.append(3)
    t.decode()
    t.trim(2)
    t.save_load()
    t.append(1)
    t.decode()
    t.done()
    # batch 2
    t = _Trace(B, batch_clause, "batch 2: equal-length rows, each selects its own tokens", batch=2, G=2)
    t.append(7)
    t.decode()
    t.append(3)
    t.decode()
    if full:
        t.append(250)
        t.decode()
    t.done()


# --------------------------------------------------------------------------- answering and grading

def _decoded_config(trace, dec, cast):
    cfg = {k: dec(v) for k, v in trace["config"].items()}
    return {k: cast(v) if k != "inv_freqs" else v for k, v in cfg.items()}


def run_trace(trace, dec, make_cache, cast):
    """Run one trace on ``make_cache`` (a Python cache of the protocol); yields (answer name, value)."""
    cache = make_cache(_decoded_config(trace, dec, cast))
    tmp = tempfile.TemporaryDirectory()
    try:
        for n, step in enumerate(trace["steps"]):
            op, res = step["op"], {}
            try:
                if op == "append":
                    cache.append(cast(dec(step["keys"])), cast(dec(step["values"])))
                elif op == "decode":
                    res["out"], res["mask"] = cache.decode(cast(dec(step["q"])))
                elif op == "prefill":
                    res["out"] = cache.prefill(cast(dec(step["q"])))
                elif op == "trim":
                    res["trimmed"] = int(cache.trim(step["n"]["value"]))
                elif op == "save_load":
                    path = os.path.join(tmp.name, f"cache{n}")
                    cache.save(path)
                    cache = cache.load(path)
                if op in ("append", "trim", "save_load"):
                    res["codes"], res["offset"] = cache.codes(), int(cache.offset)
            except Exception:  # noqa: BLE001 - a failing step ends the answers; the grader reports what is missing
                return
            for what, value in res.items():
                yield f"{n:03d}.{what}", value
    finally:
        tmp.cleanup()


def grade_trace(trace, g) -> dict:
    """Grade one trace's answers (grade._Grader ``g``); the outcome of the first step that fails."""
    rec = {"clauses": [trace["clause"]], "examples": 1}
    names = [f"{trace['id']}.{e['name']}.npy" for s in trace["steps"] for e in s["expect"]]
    if not any(g.has(n) for n in names):
        return dict(rec, outcome="missing")
    cfg = {k: g.dec(v) for k, v in trace["config"].items()}
    cache = O.OracleCache({k: (v.astype(np.float64) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v)
                           for k, v in cfg.items()})
    tol = trace["tolerance"][g.dtype]
    for n, step in enumerate(trace["steps"]):
        op = step["op"]
        if op == "append":
            cache.append(g.dec(step["keys"]).astype(np.float64), g.dec(step["values"]).astype(np.float64))
        elif op == "trim":
            cache.trim(step["n"]["value"])
        answers = {}
        for ent in step["expect"]:
            fname = f"{trace['id']}.{ent['name']}.npy"
            where = f"{trace['id']} ({trace['note']}), step {n} ({op})"
            if not g.has(fname):
                return dict(rec, outcome="fail", message=f"{where}: answer {fname} is missing")
            got = answers[ent["name"]] = g.load(fname)
            if "over_mask" in ent:   # decode output: exact attention over the selection the port made
                q = g.dec(step["q"]).astype(np.float64)
                exp = cache.attention(q, answers[ent["over_mask"]])
                if got.shape != exp.shape or not np.allclose(got.astype(np.float64), exp, rtol=tol[0], atol=tol[1]):
                    err = np.max(np.abs(got.astype(np.float64) - exp)) if got.shape == exp.shape else None
                    return dict(rec, outcome="fail", message=f"{where}: {ent['name']}: output is not exact attention "
                                f"over the port's selection (shape {got.shape} vs {exp.shape}, max error {err}, "
                                f"rtol={tol[0]}, atol={tol[1]})")
                continue
            problem = g.check_output(ent, got, tol)
            if problem:
                return dict(rec, outcome="fail", message=f"{where}: {problem}")
    return dict(rec, outcome="passed")
