"""The reference adapter with a call counter on every runtime branch of the CPU decode path (host and in-graph),
so a test can see that a conformance run of the cache clauses executes each of them: a branch the suite never
runs is a branch whose bugs it cannot see.

Counts go to $A2ATS_TRIPWIRE_DIR/counts-<pid>.json when the process exits (one file per suite process)."""

from __future__ import annotations

import atexit
import collections
import json
import os

from a2ats_conformance.adapters.reference import ReferenceAdapter

#: every branch counted; tests/test_tripwire.py requires each to be non-zero
BRANCHES = (
    "assign_codes: fast_rope (angle tables of the model's rope)",
    "assign_codes: inv_freqs",
    "deferred coding: pending tokens coded by a decode",
    "deferred coding: pending tokens coded by codes()/state",
    "_query_angle: with a fast_rope",
    "_query_angle: without (None)",
    "LUT: angle tables",
    "LUT: inv_freqs",
    "selection: host top-k",
    "selection: in-graph argpartition",
    "attention: host softmax",
    "hook: decode",
    "hook: prefill by mlx-lm's attention",
    "hook: host prefill",
)

COUNTS: collections.Counter = collections.Counter()


def _install():
    import mlx_lm.models.base as base

    from a2ats_ref import prefill
    from a2ats_ref.runtime import cache, coding
    from a2ats_ref.runtime.decode import portable as fd

    def wrap(owner, name, branch_of):
        original = getattr(owner, name)

        def counted(*a, **kw):
            branch = branch_of(*a, **kw)
            if branch:
                COUNTS[branch] += 1
            return original(*a, **kw)
        setattr(owner, name, counted)
        return original

    wrap(coding, "assign_codes", lambda *a, fast_rope=None, **kw: BRANCHES[0] if fast_rope is not None else BRANCHES[1])
    decoding = []

    def pending(self, upto):
        if self._coded < min(upto, self.offset):
            return BRANCHES[2] if decoding else BRANCHES[3]
    wrap(cache.A2ATSCache, "_assign_pending", pending)
    wrap(cache.A2ATSCache, "_query_angle", lambda self: BRANCHES[4] if self.fast_rope is not None else BRANCHES[5])
    wrap(fd, "_lut_fn", lambda *a, **kw: BRANCHES[6] if (a[6] if len(a) > 6 else kw.get("tables", False)) else BRANCHES[7])
    wrap(fd, "_select_host", lambda *a, **kw: BRANCHES[8])
    wrap(fd, "_select_mlx_fn", lambda *a, **kw: BRANCHES[9])
    wrap(fd, "softmax_host", lambda *a, **kw: BRANCHES[10])
    decode = cache.A2ATSCache.decode

    def counted_decode(self, *a, **kw):
        COUNTS[BRANCHES[11]] += 1
        decoding.append(True)
        try:
            return decode(self, *a, **kw)
        finally:
            decoding.pop()
    cache.A2ATSCache.decode = counted_decode
    # the hook's dispatcher is built from the name mlx-lm's modules bind (the adapter builds it on first use)
    wrap(base, "scaled_dot_product_attention", lambda *a, **kw: BRANCHES[12])
    wrap(prefill, "causal_attention_host", lambda *a, **kw: BRANCHES[13])


def _write():
    folder = os.environ.get("A2ATS_TRIPWIRE_DIR")
    if folder:
        with open(os.path.join(folder, f"counts-{os.getpid()}.json"), "w", encoding="utf-8") as f:
            json.dump(dict(COUNTS), f)


_install()
atexit.register(_write)


class Tripwire(ReferenceAdapter):
    name = "a2ats_ref (MLX reference, branch counters)"
