"""Likely cause of a failing clause: replay its failing examples through every known
deviation (deviations.py) and report each one that explains them.

A failing example is the IUT's calls and outputs as Context recorded them. For one deviation variant,
each call it applies to is re-run on the deviant model and on the faithful model (the oracle), in
float64 on the same rounded inputs; cache calls replay the whole operation sequence on a model cache.
Outputs are compared as the properties compare them: floats with the clause's tolerance, codes, masks
and counts exactly. The example *matches* the deviation when some call's port output equals the
deviant's and not the oracle's, and every call it applies to equals one of the two. Diagnosis runs
only after a failure; a passing run never imports this module.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np

from a2ats_conformance.diagnosis.deviations import DEVIATIONS, Decoded, Deviation, Model, shared_results
from a2ats_conformance.diagnosis.repro import fill_placeholder, to_float64 as _up
from a2ats_conformance.harness.adapter import CLAUSE_FUNCTIONS
from a2ats_conformance.harness.pytest_helpers import ConformanceFailure, _jsonable
from a2ats_conformance.harness.tolerances import tie_margin, tolerance

__all__ = ["diagnose", "help_lines", "replay"]

_SKIP = object()   # a call whose result is not compared (cache objects, append's None)
_ERR = object()    # the model raised: it cannot explain that call


def replay(model: Model, calls, tie: float | None = None, port: dict | None = None) -> dict[int, object]:
    """Outputs of ``model`` on the recorded calls: index -> result (_SKIP / _ERR where none). With ``tie``
    (a tie margin), selections and codes carry their allowed sets and decodes their attention over any
    selection; with ``port`` (its recorded outputs), a cache adopts the port's codes where they are allowed,
    so that decodes are scored with the codes the port holds (as the suite scores them)."""
    model.tie = tie
    tmp = tempfile.mkdtemp(prefix="a2ats-diagnose-")   # recorded save/load paths are placeholders (repro.py)
    try:
        return _replay(model, calls, tmp, port or {})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replay(model: Model, calls, tmp: str, port: dict) -> dict[int, object]:
    outs: dict[int, object] = {}
    caches: list = []
    for idx, (name, args, kwargs) in enumerate(calls):
        a = tuple(_up(fill_placeholder(x, tmp)) for x in args)
        kw = {k: _up(v) for k, v in kwargs.items()}
        try:
            if name == "make_cache":
                caches.append(model.make_cache(*a, **kw))
                outs[idx] = _SKIP
            elif name.startswith("cache") and "." in name:
                ci, meth = name[len("cache"):].split(".", 1)
                res = getattr(caches[int(ci)], meth)(*a, **kw)
                if meth == "load":   # a loaded cache is the next cache<i> of the recording (test_cache.CacheCalls)
                    caches.append(res)
                if meth == "codes" and idx in port and getattr(res, "allowed", None) is not None \
                        and _allowed_codes(port[idx], res):
                    caches[int(ci)].adopt_codes(port[idx])
                outs[idx] = _SKIP if meth in ("load", "save", "append") else res
            else:
                outs[idx] = getattr(model, name)(*a, **kw)
        except Exception:  # noqa: BLE001 - a deviant that cannot run this call does not explain it
            outs[idx] = _ERR
    return outs


def _allowed_codes(port, model_codes) -> bool:
    """A port's codes against the model's: each in the model's near-optimal set."""
    try:
        c = np.asarray(port)
    except Exception:  # noqa: BLE001
        return False
    allowed = model_codes.allowed
    if c.dtype.kind not in "iu" or c.shape != allowed.shape[:-1]:
        return False
    if c.size and (c.min() < 0 or c.max() >= allowed.shape[-1]):
        return False
    return bool(np.all(np.take_along_axis(allowed, c[..., None].astype(np.int64), axis=-1)))


def _allowed_mask(port, model_mask) -> bool:
    """A port's selection against the model's: must ⊆ mask ⊆ may when the model carries them, else equal."""
    try:
        pm = np.asarray(port)
    except Exception:  # noqa: BLE001
        return False
    if pm.dtype.kind not in "biu" or pm.shape != np.shape(model_mask):
        return False
    pm = pm.astype(bool)
    must, may = getattr(model_mask, "must", None), getattr(model_mask, "may", None)
    if must is None:
        return bool(np.array_equal(pm, np.asarray(model_mask, bool)))
    return not (must & ~pm).any() and not (pm & ~may).any()


def _same(port, other, rtol: float, atol: float):
    """True / False, or None when the result is not comparable (not an output the suite judges).

    A decode (out, mask) is judged as the suite judges it: the mask in the model's allowed set, the output
    the model's attention over the port's own mask."""
    if other is _SKIP or port is None:
        return None
    if isinstance(other, Decoded) and isinstance(port, (tuple, list)) and len(port) == 2:
        if not _allowed_mask(port[1], other[1]):
            return False
        if other.attend is None:
            return _same(port[0], other[0], rtol, atol)
        try:
            want = other.attend(np.asarray(port[1]).astype(bool))
        except Exception:  # noqa: BLE001 - e.g. a head with nothing selected
            return False
        return _same(port[0], want, rtol, atol)
    if getattr(other, "must", None) is not None:
        return _allowed_mask(port, other)
    if getattr(other, "allowed", None) is not None:
        return _allowed_codes(port, other)
    if not isinstance(port, (tuple, list, np.dtype, type, np.ndarray, np.generic, int, float, bool)):
        return None   # e.g. a cache object
    if other is _ERR:
        return False
    if isinstance(port, (tuple, list)):
        if not isinstance(other, (tuple, list)) or len(other) != len(port):
            return False
        parts = [_same(p, o, rtol, atol) for p, o in zip(port, other)]
        parts = [p for p in parts if p is not None]
        return all(parts) if parts else None
    if isinstance(port, (np.dtype, type)):
        try:
            return np.dtype(port) == np.dtype(other)
        except TypeError:
            return False
    try:
        a, b = np.asarray(port), np.asarray(other)
    except Exception:  # noqa: BLE001
        return None
    if a.dtype.kind not in "biuf" or b.dtype.kind not in "biuf":
        return None
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        return bool(np.array_equal(a.astype(np.int64), b.astype(np.int64)))
    a, b = a.astype(np.float64), b.astype(np.float64)
    return bool(np.all(np.isfinite(a)) and np.all(np.abs(a - b) <= atol + rtol * np.abs(b)))


def _call_tolerance(dtype: str, clause: str, name: str) -> tuple[float, float]:
    """The loosest of the failing clause's tolerance and that of the clause defining the call: a port's
    output is compared here with a float64 model, as the call's own clause compares it."""

    method = name.split(".", 1)[1] if name.startswith("cache") and "." in name else None
    own = [c for c, fs in CLAUSE_FUNCTIONS.items() if name in fs]
    own += {"decode": ["CACHE-DECODE"], "prefill": ["PREFILL", "CACHE-DENSE-EQUIV"]}.get(method, [])
    tols = [tolerance(dtype, c) for c in [clause, *own]]
    return max(t[0] for t in tols), max(t[1] for t in tols)


def _tie(dtype: str, clause: str) -> float:
    """Tie margin for selections: the failing clause's (ctx.margin's default) or RET-LUT's, the accuracy
    of the ranked scores, whichever is smaller (the near-tie properties judge with RET-LUT's)."""
    return min(tie_margin(dtype, clause), tie_margin(dtype, "RET-LUT"))


def _applies(dev: Deviation, name: str) -> bool:
    return name in dev.applies or (name.startswith("cache") and "make_cache" in dev.applies)


def _vacuous(pred) -> bool:
    """A selection prediction that admits (nearly) every token it does not require: its model ties every
    candidate (a cache that has coded nothing scores each token as code 0, say), so any selection of a port that
    forces the same tokens agrees with it, whatever the port's bug."""
    m = pred[1] if isinstance(pred, Decoded) else pred
    must, may = getattr(m, "must", None), getattr(m, "may", None)
    if must is None or may is None:
        return False
    must, may = np.asarray(must, bool), np.asarray(may, bool)
    open_ = (may & ~must).sum(axis=-1)
    rows = open_ > 0
    return bool(rows.any()) and bool(np.all(open_[rows] >= 0.9 * (~must).sum(axis=-1)[rows]))


def _matches(dev: Deviation, example: dict, dtype: str, faithful: dict, work: list | None = None):
    """(the first variant of ``dev`` that explains the example (a Model class), whether it explains it only
    through vacuous selections (_vacuous)), else None. ``work``: a one-item list that each replay adds the
    example's size to (diagnose's budget)."""
    calls, port = example["calls"], example["outputs"]
    idx = [i for i, (name, _, _) in enumerate(calls) if i in port and _applies(dev, name)]
    if not idx:
        return None
    tols = {i: _call_tolerance(dtype, example["clause"], calls[i][0]) for i in idx}
    for model in dev.models():
        if work is not None:
            work[0] += _size(example)
        deviant = replay(model, calls, _tie(dtype, example["clause"]), port)
        explained, consistent, specific = False, True, False
        for i in idx:
            if faithful[i] is _ERR:   # the spec rejects this call (INPUT-ERRORS): no computing bug explains an answer
                continue
            rtol, atol = tols[i]
            d = _same(port[i], deviant[i], rtol, atol)
            o = _same(port[i], faithful[i], rtol, atol)
            if d is None:
                continue
            if d and not o:
                explained = True
                specific = specific or not _vacuous(deviant[i])
            elif not d and not o:
                consistent = False
                break
        if explained and consistent:
            return type(model), not specific
    return None


#: bounds of one diagnosis, in work and never in time (a verdict must not depend on the machine's load): at most
#: MAX_EXAMPLES failing examples (the smallest), and at most MAX_REPLAY_ELEMENTS input elements replayed through
#: the deviations' models in all (each replay of an example counts its size). The bound is far above the whole
#: library on the suite's failing examples (a 32K-token cache decode replays through every deviation within it),
#: so it only stops a diagnosis of examples much larger than the suite draws.
MAX_EXAMPLES = 10
MAX_REPLAY_ELEMENTS = 2_000_000_000


def _size(example: dict) -> int:
    return sum(np.size(x) for _, args, kw in example["calls"] for x in (*args, *kw.values())
               if isinstance(x, np.ndarray))


def diagnose(examples: list[dict], dtype: str, deviations=DEVIATIONS,
             max_elements: int = MAX_REPLAY_ELEMENTS) -> list[dict]:
    """[{id, cause, matched, of, likely}] for every deviation matching a failing example, best first; ``likely``
    when it matches at least half of them (the others are "also consistent").

    ``examples``: Context failure snapshots ({clause, calls, outputs, notes}); ``of`` counts those tried
    (with at least one recorded IUT output; the MAX_EXAMPLES smallest). Deviations not reached within
    ``max_elements`` replayed input elements are left out (the last entry then says so, with id None), so the
    same failing examples get the same diagnosis on any machine at any load."""
    with shared_results():
        return _diagnose(examples, dtype, deviations, max_elements)


def _diagnose(examples, dtype, deviations, max_elements) -> list[dict]:
    usable = sorted((e for e in examples if e.get("outputs")), key=_size)[:MAX_EXAMPLES]
    faithful = [replay(Model(), e["calls"], _tie(dtype, e["clause"]), e["outputs"]) for e in usable]
    work = [sum(_size(e) for e in usable)]
    found, skipped = [], []
    for dev in deviations:
        if work[0] > max_elements:
            skipped.append(dev.id)
            continue
        which = [(e, m) for e, f in zip(usable, faithful) if (m := _matches(dev, e, dtype, f, work)) is not None]
        if which:
            found.append({"id": dev.id, "cause": dev.describe([e for e, _ in which], [v for _, (v, _) in which]),
                          "matched": len(which), "of": len(usable),
                          "vacuous": all(vac for _, (_, vac) in which)})
    # stable: ties keep the library's order; a cause whose model only ever admitted any selection comes after
    # every cause that predicted one
    found.sort(key=lambda r: (r["vacuous"], -r["matched"]))
    # a cause that explains under half of the failing examples is not likely: it is listed as "also consistent"
    # (a decode over a few tokens selects them all whatever the rule, so small examples agree with many causes);
    # nor is one whose model ties every candidate, which agrees with any selection
    for r in found:
        r["likely"] = 2 * r["matched"] >= r["of"] and not r["vacuous"]
    if skipped:
        found.append({"id": None, "cause": f"diagnosis stopped after replaying {work[0]:,} input elements "
                      f"(limit {max_elements:,}); not tried: {', '.join(skipped)}", "matched": 0, "of": len(usable)})
    return found


def help_lines(causes: list[dict], n_examples: int, limit: int = 3) -> list[str]:
    named = [c for c in causes if c["id"] is not None]
    notes = [f"help: {c['cause']}" for c in causes if c["id"] is None]
    if not named:
        return [f"help: no known cause matched ({min(n_examples, MAX_EXAMPLES)} failing example(s) replayed "
                f"through {len(DEVIATIONS)} known deviations)"] + notes
    likely = [c for c in named if c.get("likely", True)]
    also = [c for c in named if not c.get("likely", True)]
    lines = [f"help: likely cause: {c['cause']}, matches {c['matched']}/{c['of']} failing examples [{c['id']}]"
             for c in likely[:limit]]
    if not likely:
        lines.append(f"help: no likely cause: none of the known deviations explains half of the "
                     f"{named[0]['of']} failing examples replayed")
    lines += [f"note: also consistent: {c['cause']}, matches {c['matched']}/{c['of']} failing examples [{c['id']}]"
              + (" (its model ties every candidate there, so any selection agrees)" if c.get("vacuous") else "")
              for c in also[:limit]]
    return lines + notes


def _jsonable_notes(notes: dict) -> dict:
    # plain JSON types: the report crosses pytest-xdist workers
    return {k: _jsonable(v.tolist() if isinstance(v, np.ndarray) else v) for k, v in notes.items()}


def explain_failure(item, ctx, exc, guard=None) -> None:
    """After a failed test: search revealing examples, diagnose every failing example, and add the
    ``help:`` lines to the failure message and ``likely_causes`` / ``revealing`` to the counterexample.
    ``guard()``: a context manager around each revealing try that calls the IUT (the per-example hang limit)."""
    from a2ats_conformance.diagnosis import reveal  # deferred: imports hypothesis, needed only after a failure

    minimal = list(ctx.failures)
    last = ctx.last_failure
    seen = [e["notes"] for e in minimal]
    revealing = [e for e in reveal.search(item, ctx, **({} if guard is None else {"guard": guard}))
                 if e["notes"] not in seen]
    examples = minimal + revealing
    causes = diagnose(examples, ctx.dtype)
    n = sum(1 for e in examples if e.get("outputs"))
    lines = help_lines(causes, n)
    extra = {"likely_causes": causes}
    if revealing:
        first = revealing[0]
        path = reveal.save_revealing(ctx, first)
        region = reveal.region_text(first["notes"])
        case = ", ".join(f"{k}={v!r}" for k, v in _jsonable_notes(first["notes"]).items())
        lines.append(f"revealing example ({region}; {len(revealing)} found): error[{first['clause']}]: "
                     f"{first['headline']}\n    case: {case}\n    repro: {ctx.repro_command(path)}")
        extra["revealing"] = {"clause": first["clause"], "message": first["headline"], "region": region,
                              "case": _jsonable_notes(first["notes"]), "npz": path, "repro": ctx.repro_command(path)}
    extra["help"] = "\n".join(lines)
    if last is not None:
        last.update(extra)
    text = "\n".join("  " + ln for ln in lines)
    for e in _leaves(exc):
        if isinstance(e, ConformanceFailure) and e.args:
            e.args = (f"{e.args[0]}\n{text}",) + tuple(e.args[1:])


def _leaves(exc):
    subs = getattr(exc, "exceptions", None)
    if subs:
        for s in subs:
            yield from _leaves(s)
    else:
        yield exc
