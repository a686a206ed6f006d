"""An oracle adapter that takes topk only as an int count, and says so: a fraction is a TypeError here."""

from a2ats_spec import oracle

name, version, dtypes = "count-only", "0", ("float64",)
capabilities = {"topk": ("count",)}


def _count(topk):
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise TypeError(f"this port takes topk as an int count only, got {topk!r}")


def topk_count(T, topk, n_candidates=None):
    _count(topk)
    return oracle.topk_count(T, topk, n_candidates)


def select_tokens(scores, **kw):
    _count(kw["topk"])
    return oracle.select_tokens(scores, **kw)


def decode_step(*args, **kw):
    _count(kw["topk"])
    return oracle.decode_step(*args, **kw)
