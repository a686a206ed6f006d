"""The port profile: each mechanism of a port measured on its own probe (probes.py) and classified among the
catalogue's variants (catalogue/__init__.py), whether or not any clause fails.

For one probe, the port's outputs are recorded, then the catalogue's variants of the probe's mechanisms are
tried, fewest departures first: the spec's variant of every mechanism, then one mechanism at a time at each
of its variants, then two at once, and so on. Each try is a ``deviations.Model`` composed of the chosen
variants and of the variants found by the earlier probes (those that change other hooks), replayed on the same
calls (diagnose.replay) and compared as the suite compares (diagnose._same: floats within the probe clause's
tolerance, masks and codes against their allowed sets). The first try that explains every call names the
variant of each mechanism. When none does, the probe's mechanisms read "unknown: no variant explains it",
with each single variant's fit as evidence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
import tempfile

import numpy as np

from a2ats_conformance.diagnosis.deviations import Decoded, Model, _f, _round
from a2ats_conformance.diagnosis.diagnose import _ERR, _SKIP, _same, _tie, replay
from a2ats_conformance.diagnosis.repro import fill_placeholder
from a2ats_conformance.harness.adapter import NotImplementedByIUT, has_function
from a2ats_conformance.harness.capabilities import FULL
from a2ats_conformance.harness.tolerances import tolerance
from a2ats_conformance.catalogue import MECHANISMS, mechanism, record_clauses, records_of
from a2ats_conformance.catalogue.probes import PROBES, build

__all__ = ["profile", "explain", "MAX_DEPARTURES"]

#: at most this many mechanisms of one probe depart at once. The profile is bounded by work, never by time (a
#: fixed set of probes, each call under the example timeout), so it reads the same at any load
MAX_DEPARTURES = 3


def _cast(x, dtype: str):
    """A float array in the dtype under test (bfloat16: float32 holding bfloat16 values, as the suite sends)."""
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        if dtype == "bfloat16":
            return _round(x, "bfloat16").astype(np.float32)
        return x.astype(dtype)
    return x


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _run_port(adapter, calls, tmp: str, guard=contextlib.nullcontext):
    """The port's outputs on ``calls`` (index -> output) and its errors (index -> first line). Each call runs
    under ``guard()`` (the plugin's per-call time limit: a hang ends the profile, not the run's verdicts)."""

    outs, errs, caches = {}, {}, []
    for idx, (name, args, kwargs) in enumerate(calls):
        a = tuple(fill_placeholder(x, tmp) for x in args)
        try:
            with guard():
                if name == "make_cache":
                    caches.append(adapter.make_cache(*a, **kwargs))
                    outs[idx] = _SKIP
                elif name.startswith("cache") and "." in name:
                    ci, meth = name[len("cache"):].split(".", 1)
                    res = getattr(caches[int(ci)], meth)(*a, **kwargs)
                    if meth == "load":
                        caches.append(res)
                    outs[idx] = None if meth in ("load", "save", "append", "trim") else res
                else:
                    res = getattr(adapter, name)(*a, **kwargs)
                    # a list of numbers inside a result (k-means' history) is an array, as the properties read it
                    outs[idx] = tuple(np.asarray(x) if isinstance(x, list) else x for x in res) \
                        if isinstance(res, tuple) else res
        except NotImplementedByIUT:
            raise
        except Exception as exc:  # noqa: BLE001 - what the port raised is evidence
            errs[idx] = _first_line(exc)
            if name == "make_cache" or name.endswith(".load"):
                break   # the later calls need the cache
    return outs, errs


def _hooks(cls) -> set:
    return {k for c in cls.__mro__ if c is not Model and issubclass(c, Model) for k in vars(c) if not k.startswith("__")}


def _base(found, chosen) -> list:
    """The variants found earlier that change no hook the chosen ones change (the chosen ones win)."""
    hooks = set().union(*(_hooks(c) for c in chosen)) if chosen else set()
    return [c for c in found if not (_hooks(c) & hooks)]


def _compose(classes):
    classes = list(dict.fromkeys(c for c in classes if c is not None))
    if not classes:
        return Model()
    if len(classes) == 1:
        return classes[0]()
    return type("Profiled", tuple(classes), {})()


def _gap(port, pred, rtol, atol) -> str:
    """How far the port's output is from one prediction, in words."""
    if pred is _ERR:
        return "raises"
    if isinstance(pred, Decoded) and isinstance(port, (tuple, list)) and len(port) == 2:
        pm, mm = np.asarray(port[1]).astype(bool), np.asarray(pred[1]).astype(bool)
        if pm.shape != mm.shape:
            return f"mask shape {pm.shape} vs {mm.shape}"
        n = int(np.sum(pm != mm))
        if n:
            return f"{n} token(s) selected differently"
        return _gap(port[0], pred[0], rtol, atol)
    if isinstance(port, (np.dtype, type)) or isinstance(pred, (np.dtype, type)):
        try:
            return "equal" if np.dtype(port) == np.dtype(pred) else f"{np.dtype(port)} vs {np.dtype(pred)}"
        except TypeError:
            return f"{port!r} vs {pred!r}"
    if isinstance(port, (tuple, list)) and isinstance(pred, (tuple, list)):
        parts = [_gap(p, q, rtol, atol) for p, q in zip(port, pred)]
        return next((p for p in parts if p != "equal"), "equal")
    try:
        a, b = np.asarray(port), np.asarray(pred)
    except Exception:  # noqa: BLE001
        return "not comparable"
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        n = int(np.sum(a.astype(np.int64) != b.astype(np.int64)))
        return "equal" if n == 0 else f"{n} of {a.size} differ"
    if a.dtype.kind not in "biuf" or b.dtype.kind not in "biuf":
        return "not comparable"
    a, b = a.astype(np.float64), b.astype(np.float64)
    off = ~(np.abs(a - b) <= atol + rtol * np.abs(b))
    return f"max |Δ| {float(np.max(np.abs(a - b)[off])):.3g}" if off.any() else "equal"


class _Probe:
    """One probe run on one port: its outputs, and the fit of any model to them."""

    def __init__(self, probe, port, errs, dtype):
        self.p, self.port, self.errs, self.dtype = probe, port, errs, dtype
        self.tol = tolerance(dtype, probe.clause, probe.max_position)
        self.tie = _tie(dtype, probe.clause)

    def fit(self, model) -> tuple[bool, str]:
        """(explains every call, the first call it does not explain and how far off it is)."""
        outs = replay(model, self.p.calls, self.tie, self.port)
        for i, (name, _, _) in enumerate(self.p.calls):
            if i in self.errs:
                if outs.get(i) is not _ERR:
                    return False, f"{name} raised {self.errs[i]}"
                continue
            if i not in self.port:
                continue
            r = _same(self.port[i], outs.get(i, _SKIP), *self.tol)
            if r is False:
                return False, f"{name}: {_gap(self.port[i], outs.get(i), *self.tol)}"
        return True, "explains every call"


def _classify(probe, run: _Probe, found: dict) -> dict[str, tuple]:
    """mechanism id -> (record or None, evidence text)."""
    mechs = probe.mechanisms
    cands = {m: [r for r in records_of(m)[1:] if not r.catch_all and r.model is not None] for m in mechs}
    own = {r.model for rs in cands.values() for r in rs}
    # the variants found so far, less this probe's own candidates: a port's H is judged by H's variants even
    # when its far probe found the same class
    base_all = [r.model for r in found.values() if r is not None and r.model is not None and r.model not in own]
    # first with the variants found so far; then without them (a port whose bug lives in one callable only,
    # e.g. topk_count, and not in the functions built on it)
    for base in ([base_all, []] if base_all else [[]]):
        for n in range(0, min(len(mechs), MAX_DEPARTURES) + 1):
            for subset in itertools.combinations(mechs, n):
                for choice in itertools.product(*(cands[m] for m in subset)):
                    chosen = [r.model for r in choice]
                    ok, _ = run.fit(_compose(chosen + _base(base, chosen)))
                    if ok:
                        picked = dict(zip(subset, choice))
                        return {m: (picked.get(m, records_of(m)[0]), _evidence(run, m, picked, base)) for m in mechs}
    base = base_all
    if len(mechs) == 1:
        catch = [r for r in records_of(mechs[0]) if r.catch_all]
        if catch:
            return {mechs[0]: (catch[0], _evidence(run, mechs[0], {}, base) + "; no predicting variant explains it, "
                                                                              "and the spec's does not")}
    return {m: (None, _evidence(run, m, {}, base)) for m in mechs}


def _evidence(run: _Probe, mech: str, picked: dict, bases) -> str:
    """Each variant of ``mech`` (the others as picked): what it predicts against what the port gave."""
    parts = []
    for r in records_of(mech):
        if r.catch_all:
            continue
        chosen = ([r.model] if r.model else []) + [x.model for m, x in picked.items() if m != mech]
        ok, why = run.fit(_compose(chosen + _base(bases, chosen)))
        parts.append(f"{r.variant}: {'matches' if ok else why}")
    return f"probe {run.p.id}: " + "; ".join(parts)


def profile(adapter, *, dtype: str, caps: dict | None = None, guard=contextlib.nullcontext) -> list[dict]:
    """One row per mechanism (catalogue order): {mechanism, title, variant, kind, status, description, evidence,
    probe, clauses}. status: spec | variant | unknown | not-implemented | not-applicable | not-run | error."""

    caps = caps or FULL
    found: dict = {}
    rows: dict[str, dict] = {}
    ops = set(caps.cache_ops)
    try:
        adapter.input_dtype = dtype
    except Exception:  # noqa: BLE001 - an adapter that does not take the attribute casts by itself
        pass
    tmp = tempfile.mkdtemp(prefix="a2ats-profile-")
    try:
        for pid in PROBES:
            probe = build(pid)
            status, note = None, ""
            missing = [f for f in probe.needs if not has_function(adapter, f)]
            if missing:
                status, note = "not-implemented", f"the port has no {', '.join(missing)}"
            elif caps.randomness == "own" and pid in _EXPLICIT_RANDOMNESS:
                status, note = "not-applicable", "the port draws its own random stream (randomness: own)"
            elif set(probe.cache_ops) - ops:
                status, note = "not-applicable", f"needs cache_ops {', '.join(sorted(set(probe.cache_ops) - ops))}"
            if status is None:
                calls = [(n, tuple(_cast(x, dtype) for x in a), {k: _cast(v, dtype) for k, v in kw.items()})
                         for n, a, kw in _declared(probe.calls, caps)]
                probe = type(probe)(**{**probe.__dict__, "calls": calls})
                try:
                    port, errs = _run_port(adapter, calls, tmp, guard)
                except NotImplementedByIUT as exc:
                    port, errs, status, note = {}, {}, "not-implemented", str(exc)
                if status is None and errs and len(errs) == len(calls):
                    status, note = "error", f"every probe call raised ({next(iter(errs.values()))})"
            if status is not None:
                for m in probe.mechanisms:
                    rows[m] = _row(m, None, status, note, pid)
                continue
            try:
                result = _classify(probe, _Probe(probe, port, errs, dtype), found)
            except Exception as exc:  # noqa: BLE001 - a profile that cannot classify says so; verdicts stand
                result = {m: (None, f"probe {pid}: classification failed ({_first_line(exc)})") for m in probe.mechanisms}
            confounder = next((c for c in probe.confounded_by if found.get(c) is not None and found[c].catch_all), None)
            for m, (rec, ev) in result.items():
                found[m] = rec
                if rec is not None and rec.catch_all and pid == "decode-values":
                    found[m] = dataclasses.replace(rec, model=_measured_values(probe, port))
                if rec is None and confounder is not None:
                    rows[m] = _row(m, None, "not-run", f"not classified: the port's {confounder} variant "
                                   f"({found[confounder].variant}, a rule no variant predicts) decides this probe's "
                                   f"output too; {ev}", pid)
                    continue
                st = "unknown" if rec is None else ("spec" if rec.kind == "spec" else "variant")
                rows[m] = _row(m, rec, st, ev, pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [rows[m.id] for m in MECHANISMS if m.id in rows]


def _measured_values(probe, port):
    """A Model whose attention reads each probe value row as the port was measured to read it (the values
    probe's one-token calls): a port's own lossy value rule, replayed in the later decode probes."""
    table = {}
    for i, (name, args, kw) in enumerate(probe.calls):
        if kw.get("query_pos") != 0 or i not in port or not isinstance(port[i], (tuple, list)):
            continue
        v, out = np.asarray(args[2]).astype(np.float64), np.asarray(port[i][0], dtype=np.float64)
        G = out.shape[-2] // v.shape[0]
        for g in range(v.shape[0]):
            table[v[g, 0].tobytes()] = out[g * G]

    def attention_values(self, v):
        v = _f(v).copy()
        for idx in np.ndindex(v.shape[:-1]):
            row = table.get(v[idx].tobytes())
            if row is not None:
                v[idx] = row
        return v

    return type("MeasuredValues", (Model,), {"attention_values": attention_values})


#: probes whose answer depends on the random stream the spec fixes: the suite's uniforms (EQ-17-INIT) or
#: EQ-17-FIT's default_rng(seed)
_EXPLICIT_RANDOMNESS = ("kmeans-init", "kmeans")


def _declared(calls, caps) -> list:
    """The probe's calls in what the port declares (capabilities.py): its RoPE layout where it has one only;
    no count top-k where it takes fractions only."""
    flags = caps.traditional_values
    out = []
    for name, args, kw in calls:
        if "traditional" in kw and kw["traditional"] not in flags:
            if any(n == name and k.get("traditional") in flags and k.keys() == kw.keys() for n, _, k in calls):
                continue   # the probe has the declared layout's call too
            kw = dict(kw, traditional=flags[0])
        args = tuple(dict(a, traditional=flags[0]) if isinstance(a, dict) and a.get("traditional") not in
                     (None, *flags) else a for a in args)
        if name == "topk_count" and isinstance(args[1], int) and not caps.has("topk", "count"):
            continue
        out.append((name, args, kw))
    return out


def _row(mech_id, rec, status, evidence, probe_id) -> dict:
    m = mechanism(mech_id)
    variant = {"unknown": "unknown: no variant explains it", "not-implemented": "not-implemented",
               "not-applicable": "not-applicable", "not-run": "not run", "error": "error"}.get(status)
    return {"mechanism": mech_id, "title": m.title, "probe": probe_id, "status": status,
            "variant": rec.variant if rec is not None else variant,
            "kind": rec.kind if rec is not None else None,
            "description": rec.description if rec is not None else "",
            "source": rec.source if rec is not None else "",
            "evidence": evidence,
            "clauses": list(record_clauses(rec) if rec is not None else m.clauses)}


def explain(rows: list[dict], failed: list[str]) -> list[dict]:
    """Each row with ``explains``: the failing clauses its (non-spec) variant accounts for."""
    bad = set(failed)
    return [dict(r, explains=[c for c in r["clauses"] if c in bad] if r["status"] in ("variant", "unknown") else [])
            for r in rows]
