"""Informative counterexamples: after a failure, look for failing examples in the
region where causes show, beside Hypothesis's minimal example.

Shrinking drives an example to the degenerate corner where a bug may be invisible (b = 0 hides a
missing R_b; a one-token cache hides everything but the values). So the test body is run again with
fresh draws from its own strategies, bounded in tries and time, and the failing examples whose drawn
parameters (``ctx.note``) lie in the region are kept. The search is bounded by work (tries and the
input elements the tries hand the IUT), never by time, so its result does not depend on the machine's load:

- b >= 1;
- K >= 2;
- T > sinks + w + 1 (i + 1 tokens visible when the query sits at query_pos = i);
- at least one far token selected and not forced: topk_count(i + 1, topk, #candidates) >= 1.

Each condition applies only when the test notes its parameters. The first revealing example is
saved as its own counterexample (``<test>-revealing.npz``) and reported; all of them go to diagnosis.
"""

from __future__ import annotations

import contextlib
import inspect

from hypothesis import HealthCheck, Phase, given, seed, settings
import numpy as np

from a2ats_spec import oracle

from a2ats_conformance.harness.pytest_helpers import ConformanceFailure

__all__ = ["in_region", "region_text", "search"]

#: bounds of one search: a few hundred tries, a handful of failing examples, and at most MAX_ELEMENTS array
#: elements handed to the IUT in all (a few hundred small examples, or a few of the 32K-token cache decodes)
MAX_TRIES = 300
MAX_ELEMENTS = 20_000_000
WANT = 5


def _elements(calls) -> int:
    return sum(np.size(x) for _, args, kw in calls for x in (*args, *kw.values()) if isinstance(x, np.ndarray))


def _visible(notes: dict):
    """(i + 1, w, sinks) when the notes say where the query sits, else None."""
    if "w" not in notes or "sinks" not in notes:
        return None
    if "query_pos" in notes:
        return int(notes["query_pos"]) + 1, int(notes["w"]), int(notes["sinks"])
    if "T" in notes:
        return int(notes["T"]), int(notes["w"]), int(notes["sinks"])
    return None


class _Done(Exception):
    """Ends the search early."""


def in_region(notes: dict) -> bool:
    b, K = notes.get("b"), notes.get("K")
    if b is not None and int(b) < 1:
        return False
    if K is not None and int(K) < 2:
        return False
    vis = _visible(notes)
    if vis is not None:
        n, w, sinks = vis
        if n <= sinks + w + 1:
            return False
        if notes.get("topk") is not None:
            n_cand = max(0, n - sinks - w)
            if oracle.topk_count(n, notes["topk"], n_cand) < 1:
                return False
    return True


def region_text(notes: dict) -> str:
    parts = []
    if "b" in notes:
        parts.append("b >= 1")
    if "K" in notes:
        parts.append("K >= 2")
    if _visible(notes) is not None:
        parts.append("T > sinks + w + 1")
        if notes.get("topk") is not None:
            parts.append("a far token selected and not forced")
    return ", ".join(parts) or "any fresh example"


def search(item, ctx, *, max_tries: int = MAX_TRIES, max_elements: int = MAX_ELEMENTS, want: int = WANT,
           guard=contextlib.nullcontext) -> list[dict]:
    """Failing examples in the region, found by re-running the test body; ctx's state is left as it was
    apart from the returned snapshots. Empty when the test is not a Hypothesis test. ``guard()``: a context
    manager around each try (the plugin's per-example hang limit)."""
    h = getattr(getattr(item, "obj", None), "hypothesis", None)
    strategies = getattr(h, "_given_kwargs", None)
    if h is None or not strategies:
        return []
    params = inspect.signature(h.inner_test).parameters
    fixtures = {n: item.funcargs[n] for n in params if n in item.funcargs and n not in strategies}
    saved = (ctx.calls, ctx.outputs, ctx.notes, ctx.failures, ctx.last_failure, ctx.examples)
    found: list[dict] = []
    work = [0]

    def body(**drawn):
        if len(found) >= want or work[0] > max_elements:
            raise _Done   # before any draw from ``drawn``: Hypothesis stops here (no shrink phase)
        ctx.begin_example()
        ctx.failures = []
        try:
            with guard():
                h.inner_test(**fixtures, **drawn)
        except ConformanceFailure:
            if ctx.failures and in_region(ctx.failures[-1]["notes"]):
                found.append(ctx.failures[-1])
        except Exception:  # noqa: BLE001 - other errors are not what we are looking for
            pass
        finally:
            work[0] += _elements(ctx.calls)

    run = settings(max_examples=max_tries, phases=[Phase.generate], database=None, deadline=None,
                   suppress_health_check=list(HealthCheck))(seed(0)(given(**strategies)(body)))
    try:
        run()
    except Exception:  # noqa: BLE001 - _Done, or Hypothesis objecting to the early stop: `found` is the result
        pass
    finally:
        ctx.calls, ctx.outputs, ctx.notes, ctx.failures, ctx.last_failure, ctx.examples = saved
    return found


def save_revealing(ctx, example: dict) -> str | None:
    """Write the revealing example as ``<test>-revealing.npz``; returns its path."""
    saved = (ctx.calls, ctx.notes, ctx.nodeid)
    ctx.calls, ctx.notes, ctx.nodeid = example["calls"], example["notes"], ctx.nodeid + "-revealing"
    try:
        return ctx.save_counterexample()
    finally:
        ctx.calls, ctx.notes, ctx.nodeid = saved
