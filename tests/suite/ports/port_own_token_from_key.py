"""A faithful port whose decode step codes the query's own token from its key (RET-DECODE), as the authors'
decode does: the new token's code is its pre-RoPE key's nearest codeword, computed inside the step, and the
code handed in for that token is not read. Every other token's code is the one passed. Built on the
independent NumPy port.

RET-DECODE lets a port do this: the suite hands it the code of the own token's key (README-ADAPTER.md,
"The query's own token"), so both readings give the same code.
"""

from __future__ import annotations

import numpy as np

from a2ats_conformance.examples import numpy_port as _np_port


def _own_token_coded(k_post, codes, C, *, query_pos, inv_freqs, traditional):
    """codes with token query_pos recoded: the nearest codeword (Euclidean, key space) of its de-rotated key."""
    k_i = _np_port.far_keys(np.asarray(k_post)[..., query_pos:query_pos + 1, :], np.array([query_pos]),
                            inv_freqs, traditional=traditional)[..., 0, :]       # (..., n_kv, d)
    dist = np.sum((k_i[..., None, :] - np.asarray(C, dtype=k_i.dtype)) ** 2, axis=-1)   # (..., n_kv, K)
    out = np.array(codes, copy=True)
    out[..., query_pos] = np.argmin(dist, axis=-1).astype(out.dtype)
    return out


class Adapter:
    name = "own-token-from-key port (tests/ports)"
    version = "1"
    dtypes = ("float64", "float32")

    def __init__(self):
        port = _np_port.NumpyPort()
        for name, fn in vars(port).items():
            if callable(fn) and name != "decode_step":
                setattr(self, name, fn)
        self.make_cache = port.make_cache

    def decode_step(self, q_post, k_post, v, codes, C, *, query_pos, b, w, sinks, topk, inv_freqs, traditional,
                    scale=None, return_mask=False):
        codes = _own_token_coded(k_post, codes, C, query_pos=query_pos, inv_freqs=inv_freqs, traditional=traditional)
        return _np_port.decode_step(q_post, k_post, v, codes, C, query_pos=query_pos, b=b, w=w, sinks=sinks,
                                    topk=topk, inv_freqs=inv_freqs, traditional=traditional, scale=scale,
                                    return_mask=return_mask)
