"""An oracle adapter that takes only fractions for topk, and says so: an int topk is a TypeError here, so
any int the suite draws for it shows up as a failure."""

import numpy as np

from a2ats_spec import oracle

name, version, dtypes = "fraction-only", "0", ("float64",)
capabilities = {"topk": ("fraction",), "randomness": "own"}


def _fraction(topk):
    if not isinstance(topk, float):
        raise TypeError(f"this port takes topk as a fraction only, got {topk!r}")


def topk_count(T, topk, n_candidates=None):
    _fraction(topk)
    return oracle.topk_count(T, topk, n_candidates)


def select_tokens(scores, **kw):
    _fraction(kw["topk"])
    return oracle.select_tokens(scores, **kw)


def decode_step(*args, **kw):
    _fraction(kw["topk"])
    return oracle.decode_step(*args, **kw)


def kmeanspp_init(z, K, *, seed):
    """Its own randomness: a stream of its own (a generator the suite does not know), never the suite's uniforms."""
    return oracle.kmeanspp_init(z, K, np.random.default_rng([seed, 12345]).random(K))
