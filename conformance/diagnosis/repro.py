"""Replay a saved counterexample: ``python -m a2ats_conformance.diagnosis.repro FILE.npz --iut module:object``.

The .npz (written by the suite on failure, loaded with allow_pickle=False) holds the IUT calls of the
failing example.  Each call is re-run on the IUT and on the float64 oracle and the difference is printed,
so a port author can debug without Hypothesis or pytest.  Cache clauses replay the whole operation
sequence on the port's caches and on ``a2ats_spec.oracle.OracleCache`` side by side and name the first
operation where they diverge.  ``--iut`` is required: the file names the IUT it was recorded with, but a
replay never imports a module only because a file says so.  The file is self-contained: a path the
recorded run used (a save/load file) is stored as ``<tmpdir>/name`` and replayed in a fresh folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np

from a2ats_spec import oracle

from a2ats_conformance.harness.adapter import AdapterError, load_adapter
from a2ats_conformance.harness.pytest_helpers import to_numpy
from a2ats_conformance.harness.tolerances import tolerance

__all__ = ["TMP_PLACEHOLDER", "load_counterexample", "replay", "diff_text", "fill_placeholder", "main"]

#: Stands for the temp folder of a recorded path (CACHE-SAVE's save/load file).
TMP_PLACEHOLDER = "<tmpdir>"


def load_counterexample(path: str) -> tuple[dict, list[tuple[str, tuple, dict]]]:
    """-> (meta, [(fn, args, kwargs), ...]) with arrays restored."""
    with np.load(path, allow_pickle=False) as f:
        meta = json.loads(str(f["__meta__"]))
        arrays = {k: f[k] for k in f.files if k != "__meta__"}

    def dec(v):
        if "array" in v:
            return arrays[v["array"]]
        if "dict" in v:
            return {k: dec(x) for k, x in v["dict"].items()}
        return v["value"]

    calls = [(c["fn"], tuple(dec(a) for a in c["args"]), {k: dec(v) for k, v in c["kwargs"].items()})
             for c in meta["calls"]]
    return meta, calls


def fill_placeholder(x, tmp: str):
    """A recorded ``<tmpdir>/name`` argument -> ``tmp/name`` (anything else unchanged)."""
    if isinstance(x, str) and x.startswith(TMP_PLACEHOLDER + "/"):
        return tmp + x[len(TMP_PLACEHOLDER):]
    return x


def _as_results(x):
    return list(x) if isinstance(x, tuple) else [x]


def to_float64(x):
    """Float arrays (also inside a config dict) in float64, as the oracle takes them; the rest unchanged."""
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return x.astype(np.float64)
    if isinstance(x, dict):
        return {k: to_float64(v) for k, v in x.items()}
    return x


def _fmt_call(name, args, kwargs) -> str:
    def f(v):
        if isinstance(v, np.ndarray):
            return f"{v.dtype}{v.shape}"
        if isinstance(v, dict):
            return "{config}"
        return repr(v)
    return f"{name}({', '.join([f(a) for a in args] + [f'{k}={f(v)}' for k, v in kwargs.items()])})"


def diff_text(got, want, rtol: float, atol: float) -> str:
    """'' when equal within tolerance (exactly, for integer/bool results); else a numpy.testing-style diff:
    share mismatched, worst absolute and relative difference and where, first mismatches."""
    if got is None or want is None or isinstance(want, (np.dtype, type)) or not hasattr(np.asarray(want), "shape"):
        return "" if got == want else f"IUT {got!r} vs oracle {want!r}"
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return f"shape {g.shape} vs oracle {w.shape}"
    if w.size == 0:
        return ""
    exact = w.dtype.kind in "iub" or g.dtype.kind in "iub"
    if exact:
        bad = g != w
    else:
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        bad = ~(np.abs(g64 - w64) <= atol + rtol * np.abs(w64)) | (np.isnan(g64) != np.isnan(w64))
    if not bad.any():
        return ""
    first = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:3]]
    lines = [f"mismatched elements: {int(bad.sum())} / {bad.size} ({100 * bad.mean():.3g}%)"]
    if exact:
        lines.append("(compared exactly here; the suite itself accepts near-tie alternatives from the oracle's margins)")
    else:
        d = np.abs(g64 - w64)
        r = d / np.maximum(np.abs(w64), np.finfo(np.float64).tiny)
        ia, ir = np.unravel_index(np.nanargmax(d), d.shape), np.unravel_index(np.nanargmax(r), r.shape)
        lines.append(f"max abs diff {d[ia]:.6g} at {tuple(int(i) for i in ia)}; max rel diff {r[ir]:.6g} at "
                     f"{tuple(int(i) for i in ir)} (tolerance rtol={rtol:g}, atol={atol:g})")
    lines.append("first: " + "; ".join(f"{ix}: IUT {g[ix]!r}, oracle {w[ix]!r}" for ix in first))
    return "\n".join(lines)


def _run(fn, args, kwargs):
    try:
        return _as_results(to_numpy(fn(*args, **kwargs))), None
    except Exception as exc:  # noqa: BLE001 - report and go on: the point is to see what happens
        return None, f"{type(exc).__name__}: {exc}"


def replay(path: str, iut: str, out=sys.stdout) -> list[dict]:
    """Re-run the recorded calls on ``iut`` and on the oracle; prints and returns one row per call."""
    meta, calls = load_counterexample(path)
    adapter = load_adapter(iut)
    try:
        adapter.input_dtype = meta.get("dtype")
    except AttributeError:
        pass
    clause = (meta.get("clauses") or [None])[0]
    rtol, atol = tolerance(meta.get("dtype", "float32"), clause)
    print(f"counterexample {path}\n  test {meta.get('test')}\n  clauses {meta.get('clauses')}\n"
          f"  dtype {meta.get('dtype')}  case {meta.get('case')}\n  recorded IUT {meta.get('iut')}, replayed on {iut}",
          file=out)
    rows: list[dict] = []
    ports: list = []       # the port's caches, in creation order (make_cache, load)
    models: list = []      # OracleCache twins
    first = None
    with tempfile.TemporaryDirectory(prefix="a2ats-repro-") as tmp:
        for k, (name, args, kwargs) in enumerate(calls):
            args = tuple(fill_placeholder(a, tmp) for a in args)
            row = {"fn": name}
            got, row["iut_error"] = _run(_target(adapter, ports, name), args, kwargs)
            want, row["oracle_error"] = _run(_target(_OracleSide(), models, name, oracle_dir=tmp),
                                             tuple(to_float64(a) for a in args), {k2: to_float64(v) for k2, v in kwargs.items()})
            _created(name, got, ports)
            _created(name, want, models)
            diffs = []
            if got is not None and want is not None and name != "make_cache" and not name.endswith((".load", ".save",
                                                                                                      ".append")):
                diffs = [t for t in (diff_text(g, w, rtol, atol) for g, w in zip(got, want)) if t]
                if len(got) != len(want):
                    diffs.insert(0, f"{len(got)} results vs the oracle's {len(want)}")
            elif (got is None) != (want is None):
                diffs = [f"IUT {'raised ' + row['iut_error'] if got is None else 'returned'}; oracle "
                         f"{'raised ' + row['oracle_error'] if want is None else 'returned'}"]
            row["diffs"] = diffs
            mark = ""
            if diffs and first is None:
                first, mark = k, "  <-- first divergence from the oracle"
            print(f"- [{k}] {_fmt_call(name, args, kwargs)}{mark}", file=out)
            for t in diffs if mark else diffs[:1]:
                print("    " + t.replace("\n", "\n    "), file=out)
            rows.append(row)
    print("no call diverges from the oracle" if first is None else
          f"first divergence: call [{first}] {rows[first]['fn']}", file=out)
    return rows


class _OracleSide:
    """The oracle as an adapter: clause functions, and OracleCache for make_cache."""

    def make_cache(self, config):
        return oracle.OracleCache(config)

    def __getattr__(self, name):
        return getattr(oracle, name)


def _target(adapter, caches, name, oracle_dir=None):
    if name == "make_cache":
        return adapter.make_cache
    if name.startswith("cache") and "." in name:
        idx, _, meth = name.partition(".")
        i = int(idx[len("cache"):])
        if i >= len(caches) or caches[i] is None:
            return _missing(f"{idx} was not created")
        if oracle_dir is not None and meth in ("save", "load"):   # the oracle side keeps its files apart
            fn = getattr(caches[i], meth)
            return lambda p, *a, **kw: fn(p + ".oracle", *a, **kw)
        return getattr(caches[i], meth)
    return getattr(adapter, name)


def _missing(why):
    def f(*a, **k):
        raise RuntimeError(why)
    return f


def _created(name, results, caches):
    if name == "make_cache" or name.endswith(".load"):
        caches.append(results[0] if results else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m a2ats_conformance.diagnosis.repro", description=__doc__.splitlines()[0])
    p.add_argument("npz")
    p.add_argument("--iut", default=None, help="adapter module:object to replay on (required)")
    a = p.parse_args(argv)
    try:
        meta, _ = load_counterexample(a.npz)
    except (OSError, ValueError, KeyError) as exc:
        print(f"repro: cannot read {a.npz!r} as a counterexample ({exc})", file=sys.stderr)
        return 2
    if not a.iut:
        print(f"repro: --iut is required. This counterexample was recorded with --iut {meta.get('iut')!r}; pass it "
              "(or another adapter) explicitly: a replay does not import a module just because a file names it",
              file=sys.stderr)
        return 2
    try:
        rows = replay(a.npz, a.iut)
    except AdapterError as exc:
        print(f"repro: {exc}", file=sys.stderr)
        return 2
    return 1 if any(r["diffs"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
