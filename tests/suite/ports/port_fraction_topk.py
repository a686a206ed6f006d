"""A faithful port with a fraction-only ``topk`` and a cache without trim/save/load (RET-TOPK, CACHE-*).

Like the authors' code (``topk=0.03``), this port only knows a fraction of the sequence: an int ``topk``
is rejected with ValueError. Its cache appends, decodes and prefills, but cannot roll back or persist.
It declares both, so the suite never hands it an int ``topk`` and reads CACHE-TRIM / CACHE-SAVE as
not-applicable rather than failing. Built on the independent NumPy port (composition, no subclassing).
"""

from __future__ import annotations

import numbers

from a2ats_conformance.examples import numpy_port as _np_port


def _fraction(topk):
    if isinstance(topk, bool) or isinstance(topk, numbers.Integral) or not isinstance(topk, numbers.Real):
        raise ValueError(f"topk: this port takes a fraction of the sequence in (0, 1], got {topk!r}")
    return float(topk)


class AppendOnlyCache:
    """append / decode / prefill and the read-outs; no trim, save or load."""

    def __init__(self, config):
        _fraction(config["topk"])
        self._inner = _np_port.NumpyCache(config)

    @property
    def offset(self):
        return self._inner.offset

    def append(self, keys_post, values):
        self._inner.append(keys_post, values)

    def decode(self, q_post):
        return self._inner.decode(q_post)

    def prefill(self, q_post):
        return self._inner.prefill(q_post)

    def codes(self):
        return self._inner.codes()

    def positions(self):
        return self._inner.positions()

    def keys_values(self):
        return self._inner.keys_values()


class Adapter:
    name = "fraction-topk port (tests/suite/ports)"
    version = "1"
    dtypes = ("float64", "float32")
    capabilities = {"topk": ("fraction",), "cache_ops": ("append", "decode", "prefill")}

    def __init__(self):
        port = _np_port.NumpyPort()
        for name in ("rope_inv_freqs", "rope_apply", "rope_invert", "query_moment", "wrope_scores", "far_keys",
                     "far_query", "score_error", "assign", "cholesky", "z_transform", "assign_z", "kmeanspp_init",
                     "lloyd_step", "kmeans", "back_transform", "lut_scores", "token_scores",
                     "retrieval_attention", "prefill_attention", "code_dtype"):
            setattr(self, name, getattr(port, name))
        self._port = port

    def topk_count(self, T, topk, n_candidates=None):
        return self._port.topk_count(T, _fraction(topk), n_candidates)

    def select_tokens(self, scores, *, topk, **kw):
        return self._port.select_tokens(scores, topk=_fraction(topk), **kw)

    def decode_step(self, *args, topk, **kw):
        return self._port.decode_step(*args, topk=_fraction(topk), **kw)

    def make_cache(self, config):
        return AppendOnlyCache(config)
