"""Replay a saved counterexample: ``python -m a2ats_conformance.repro FILE.npz [--iut module:object]``.

The .npz (written by the suite on failure, loaded with allow_pickle=False) holds the IUT calls of
the failing example.  Each call is re-run on the IUT and on the float64 oracle and the difference
is printed, so a port author can debug without Hypothesis or pytest.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from a2ats_spec import oracle

from .adapter import load_adapter
from .pytest_helpers import to_numpy
from .tolerances import tolerance

__all__ = ["load_counterexample", "replay", "main"]


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


def _as_results(x):
    return list(x) if isinstance(x, tuple) else [x]


def replay(path: str, iut: str | None = None, out=sys.stdout) -> list[dict]:
    meta, calls = load_counterexample(path)
    adapter = load_adapter(iut or meta.get("iut"))
    try:
        adapter.input_dtype = meta.get("dtype")
    except AttributeError:
        pass
    clause = (meta.get("clauses") or [None])[0]
    rtol, atol = tolerance(meta.get("dtype", "float32"), clause)
    print(f"counterexample {path}\n  test {meta.get('test')}\n  clauses {meta.get('clauses')}\n"
          f"  dtype {meta.get('dtype')}  case {meta.get('case')}", file=out)
    rows = []
    caches: list = []
    for name, args, kwargs in calls:
        row = {"fn": name}
        if name == "make_cache" or name.startswith("cache"):
            rows.append(_replay_cache_call(adapter, caches, name, args, kwargs, row, out))
            continue
        try:
            got = _as_results(to_numpy(getattr(adapter, name)(*args, **kwargs)))
        except Exception as exc:  # report and go on: the point is to see what happens
            got = None
            row["iut_error"] = repr(exc)
        up = lambda x: x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x  # noqa: E731
        try:
            want = _as_results(getattr(oracle, name)(*(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()}))
        except Exception as exc:
            want = None
            row["oracle_error"] = repr(exc)
        print(f"- {name}({', '.join(f'{a.dtype}{a.shape}' if isinstance(a, np.ndarray) else repr(a) for a in args)}"
              f"{', ' if kwargs else ''}{', '.join(f'{k}={v.dtype}{v.shape}' if isinstance(v, np.ndarray) else f'{k}={v!r}' for k, v in kwargs.items())})",
              file=out)
        if got is not None and want is not None:
            diffs = []
            for g, w in zip(got, want):
                g, w = np.asarray(g), np.asarray(w)
                if g.shape != w.shape:
                    diffs.append(f"shape {g.shape} vs oracle {w.shape}")
                elif w.dtype.kind in "iub":
                    diffs.append(f"{int(np.sum(g != w))} discrete entries differ from the oracle's tie-broken result")
                else:
                    d = np.abs(g.astype(np.float64) - w)
                    diffs.append(f"max |IUT - oracle| = {d.max() if d.size else 0:.3g} (tolerance rtol={rtol:g}, atol={atol:g})")
            row["diffs"] = diffs
            print("    " + "\n    ".join(diffs), file=out)
        else:
            print(f"    {row}", file=out)
        rows.append(row)
    return rows


def _replay_cache_call(adapter, caches, name, args, kwargs, row, out):
    """Cache calls are replayed in order on the IUT's caches (cache<i> = the i-th make_cache)."""
    try:
        if name == "make_cache":
            caches.append(adapter.make_cache(*args, **kwargs))
            res = f"cache{len(caches) - 1} created"
        else:
            idx, _, meth = name.partition(".")
            got = getattr(caches[int(idx[5:])], meth)(*args, **kwargs)
            got = _as_results(to_numpy(got))
            res = ", ".join(f"{np.asarray(g).dtype}{np.asarray(g).shape}" if g is not None else "None" for g in got)
            row["result"] = [np.asarray(g).tolist() if g is not None and np.size(g) <= 64 else None for g in got]
    except Exception as exc:  # noqa: BLE001 - show what the IUT does
        res = f"raised {exc!r}"
        row["iut_error"] = repr(exc)
    print(f"- {name}(...) -> {res}", file=out)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m a2ats_conformance.repro", description=__doc__.splitlines()[0])
    p.add_argument("npz")
    p.add_argument("--iut", default=None, help="adapter module:object (default: the one recorded in the file)")
    a = p.parse_args(argv)
    replay(a.npz, a.iut)
    return 0


if __name__ == "__main__":
    sys.exit(main())
