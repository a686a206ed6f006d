"""CACHE-*: float64 model of the adapter cache protocol (conformance/README-ADAPTER.md), built only from
the oracle's clause functions.

``OracleCache(config)`` takes the same config dict as an adapter's ``make_cache`` and has the same members
(``append``, ``decode``, ``prefill``, ``trim``, ``codes``, ``positions``, ``keys_values``, ``offset``,
``save``/``load``, ``copy``). Codes are EQ-12 de-rotation at each token's own position then EQ-16
assignment (CACHE-FAR-CODES), decode is RET-DECODE at position ``offset - 1`` (CACHE-DECODE), prefill is
PREFILL over everything cached (CACHE-CHUNK).

Batch (CACHE-BATCH): ``config["batch"] = B`` (an int >= 1) makes every array carry a leading batch axis
(keys (B, n_kv, t, d), queries (B, n_q, d), codes (B, n_kv, T) ...); all rows share the positions. Without
the key, arrays have no batch axis (a batch of one).

Checkers compare a port against allowed-result sets, never against this model's tie-broken choices:
``code_allowed(margin)`` is the allowed code set of every cached token, ``decode_allowed(q, codes, margin)``
the (must, may) selection sets of a decode query given the codes the port actually holds, and
``attention(q, mask)`` the exact attention over a given mask.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from . import oracle as _o

__all__ = ["OracleCache"]

#: tokens per block of code assignment: bounds the (tokens, K, d) temporaries of a long append
_BLOCK = 4096
_KEYS = ("n_kv_heads", "n_q_heads", "head_dim", "Cz", "L", "inv_freqs", "traditional", "w", "b", "sinks", "topk")


def _margin(margin: float | Callable[[np.ndarray], float], values: np.ndarray) -> float:
    return float(margin(values)) if callable(margin) else float(margin)


class OracleCache:
    """CACHE-DECODE. One layer's A2ATS cache in float64, the model of every CACHE-* clause (module docstring)."""

    def __init__(self, config: dict):
        if not isinstance(config, dict):
            raise ValueError(f"config: expected a dict (README-ADAPTER.md, cache protocol), got {type(config).__name__}")
        missing = [k for k in _KEYS if k not in config]
        if missing:
            raise ValueError(f"config: missing key(s) {missing}; the cache protocol needs {list(_KEYS)}")
        self.config = dict(config)
        self.n_kv = _o._int(config["n_kv_heads"], "config['n_kv_heads']", lo=1)
        self.n_q = _o._int(config["n_q_heads"], "config['n_q_heads']", lo=1)
        _o._groups(self.n_q, self.n_kv, "config['n_q_heads']")
        self.d = _o._int(config["head_dim"], "config['head_dim']")
        _o._head_dim(self.d, "config['head_dim']")
        self.Cz = _o._array(config["Cz"], "config['Cz']")
        _o._codebook(self.Cz, "config['Cz']", self.d, ndim=3)
        if self.Cz.shape[0] != self.n_kv:
            raise ValueError(f"config['Cz']: expected {self.n_kv} KV heads, got shape {self.Cz.shape}")
        self.L = _o._array(config["L"], "config['L']")
        if self.L.shape != (self.n_kv, self.d, self.d):
            raise ValueError(f"config['L']: expected shape ({self.n_kv}, {self.d}, {self.d}), got {self.L.shape}")
        _o._lower(self.L, "config['L']", self.d)
        C = config.get("C")
        self.C = _o.back_transform(self.Cz, self.L) if C is None else _o._array(C, "config['C']")
        if self.C.shape != self.Cz.shape:
            raise ValueError(f"config['C']: expected shape {self.Cz.shape} (= Cz L^-1), got {self.C.shape}")
        self.inv_freqs = _o._inv_freqs(config["inv_freqs"], self.d, "config['inv_freqs']")
        self.traditional = config["traditional"]
        _o._pairs(self.d, self.traditional)
        for k in ("w", "b", "sinks"):
            _o._int(config[k], f"config['{k}']", lo=0)
        _o.topk_count(1, config["topk"])           # validates the topk form
        self.scale = config.get("scale")
        batch = config.get("batch")
        self.batched = batch is not None
        self.B = 1 if batch is None else _o._int(batch, "config['batch']", lo=1)
        self.K = self.Cz.shape[1]
        self._k = np.zeros((self.B, self.n_kv, 0, self.d))
        self._v = np.zeros((self.B, self.n_kv, 0, self.d))
        self._c = np.zeros((self.B, self.n_kv, 0), dtype=np.int64)

    # ------------------------------------------------------------------ shapes
    def _in(self, x: Any, name: str, tail: tuple) -> np.ndarray:
        """Caller array -> (B, *tail) float64; tail entries None are free."""
        a = _o._array(x, name)
        lead = (self.B,) if self.batched else ()
        want = lead + tail
        if a.ndim != len(want) or any(w is not None and w != s for w, s in zip(want, a.shape)):
            shown = "(" + ", ".join("·" if w is None else str(w) for w in want) + ")"
            hint = "" if self.batched else " (no batch axis: config has no 'batch')"
            raise ValueError(f"{name}: expected shape {shown}{hint}, got {a.shape}")
        return a if self.batched else a[None]

    def _out(self, x: np.ndarray) -> np.ndarray:
        return x if self.batched else x[0]

    def _assign(self, k_post: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """CACHE-FAR-CODES: EQ-12 de-rotation at each token's own position, then EQ-16, per KV head."""
        k_pre = _o.far_keys(k_post, pos, self.inv_freqs, traditional=self.traditional)
        return np.stack([_o.assign_z(k_pre[:, g], self.Cz[g], self.L[g]) for g in range(self.n_kv)], axis=1)

    # ------------------------------------------------------------------ protocol
    @property
    def offset(self) -> int:
        return self._k.shape[2]

    def append(self, keys_post: Any, values: Any) -> None:
        """Write t tokens at positions offset..offset+t-1; codes = assign_z(far_keys(k, p), Cz, L) per KV head."""
        k = self._in(keys_post, "keys_post", (self.n_kv, None, self.d))
        v = self._in(values, "values", (self.n_kv, k.shape[-2], None))
        if self.offset and v.shape[-1] != self._v.shape[-1]:
            raise ValueError(f"values: value dim {v.shape[-1]} differs from the cached {self._v.shape[-1]}")
        t = k.shape[-2]
        pos = np.arange(self.offset, self.offset + t)
        codes = np.concatenate([self._assign(k[:, :, a:a + _BLOCK], pos[a:a + _BLOCK])
                                for a in range(0, t, _BLOCK)] or [np.zeros((self.B, self.n_kv, 0), np.int64)], axis=2)
        if self.offset == 0:
            self._v = np.zeros(v.shape[:2] + (0, v.shape[-1]))
        self._k = np.concatenate([self._k, k], axis=2)
        self._v = np.concatenate([self._v, v], axis=2)
        self._c = np.concatenate([self._c, codes], axis=2)

    def decode(self, q_post: Any) -> tuple[np.ndarray, np.ndarray]:
        """RET-DECODE for one query (n_q, d) post-RoPE at position offset-1 -> (out (n_q, dv), mask (n_kv, offset))."""
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        self._need_tokens("decode")
        cfg = self.config
        out, mask = _o.decode_step(q, self._k, self._v, self._c, self.C, query_pos=self.offset - 1, b=cfg["b"],
                                   w=cfg["w"], sinks=cfg["sinks"], topk=cfg["topk"], inv_freqs=self.inv_freqs,
                                   traditional=self.traditional, scale=self.scale, return_mask=True)
        return self._out(out), self._out(mask)

    def prefill(self, q_post: Any) -> np.ndarray:
        """PREFILL: queries (n_q, t, d) of the last t cached tokens, dense causal attention -> (n_q, t, dv)."""
        q = self._in(q_post, "q_post", (self.n_q, None, self.d))
        if not 1 <= q.shape[-2] <= self.offset:
            raise ValueError(f"q_post: expected 1..offset={self.offset} queries (the last cached tokens), got {q.shape[-2]}")
        return self._out(_o.prefill_attention(q, self._k, self._v, scale=self.scale))

    def trim(self, n: Any) -> int:
        """Drop the last min(n, offset) tokens; returns how many."""
        n = min(_o._int(n, "n", lo=0), self.offset)
        keep = self.offset - n
        self._k, self._v, self._c = self._k[:, :, :keep], self._v[:, :, :keep], self._c[:, :, :keep]
        return n

    def codes(self) -> np.ndarray:
        return self._out(self._c.astype(_o.code_dtype(self.K)))

    def positions(self) -> np.ndarray:
        return np.arange(self.offset, dtype=np.int64)

    def keys_values(self) -> tuple[np.ndarray, np.ndarray]:
        return self._out(self._k.copy()), self._out(self._v.copy())

    def copy(self) -> "OracleCache":
        c = OracleCache(self.config)
        c._k, c._v, c._c = self._k.copy(), self._v.copy(), self._c.copy()
        return c

    def save(self, path: str) -> None:
        """npz (no pickle): keys, values, codes and the config's scalar parameters (the codebook is not saved)."""
        meta = {k: self.config[k] for k in ("w", "b", "sinks", "topk", "traditional", "batch") if k in self.config}
        with open(_npz(path), "wb") as f:
            np.savez(f, keys=self._k, values=self._v, codes=self._c, meta=np.array(json.dumps(meta)))

    def load(self, path: str) -> "OracleCache":
        """A new cache with this cache's codebook and the saved state; ValueError if the parameters differ."""
        with np.load(_npz(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            ours = {k: self.config[k] for k in meta}
            if meta != json.loads(json.dumps(ours)):
                raise ValueError(f"path: saved with parameters {meta}, this cache has {ours}; load it with a matching cache")
            c = OracleCache(self.config)
            c._k, c._v, c._c = z["keys"], z["values"], z["codes"].astype(np.int64)
        if c._k.shape[:2] != (self.B, self.n_kv) or c._c.shape != c._k.shape[:3]:
            raise ValueError(f"path: saved keys {c._k.shape} / codes {c._c.shape} do not fit this cache "
                             f"(batch {self.B}, n_kv {self.n_kv})")
        return c

    # ------------------------------------------------------------------ checkers
    def _need_tokens(self, what: str) -> None:
        if self.offset == 0:
            raise ValueError(f"{what}: the cache is empty; append the query's own key/value first")

    def code_distances(self, tokens: Any = None) -> np.ndarray:
        """EQ-16 distances ‖k_pre L - Cz_j‖² of the cached tokens: (n_kv, n, K) (batch axis first if batched).

        tokens: indices or a slice of the cached tokens (default all of them).
        """
        idx = np.arange(self.offset)[slice(None) if tokens is None else tokens]
        k_pre = _o.far_keys(self._k[:, :, idx], idx, self.inv_freqs, traditional=self.traditional)
        dist = np.stack([_o.assign_z_distances(k_pre[:, g], self.Cz[g], self.L[g]) for g in range(self.n_kv)], axis=1)
        return self._out(dist)

    def code_allowed(self, margin: float | Callable[[np.ndarray], float], tokens: Any = None) -> np.ndarray:
        """CACHE-FAR-CODES. Allowed codes (n_kv, n, K) bool: argmin_allowed of code_distances(tokens).

        margin: a number, or a callable of the distances returning one (e.g. a tolerance-table margin).
        """
        dist = self.code_distances(tokens)
        return _o.argmin_allowed(dist, _margin(margin, dist))

    def decode_scores(self, q_post: Any, codes: Any) -> np.ndarray:
        """RET-LUT token scores (n_q, offset) of a decode query over the given codes (the port's, typically)."""
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        c = np.asarray(codes)
        c = c if self.batched else c[None]
        if c.shape != self._c.shape:
            raise ValueError(f"codes: expected shape {self._out(self._c).shape}, got {np.asarray(codes).shape}")
        qb = _o.far_query(q, b=self.config["b"], inv_freqs=self.inv_freqs, traditional=self.traditional,
                          positions=self.offset - 1)
        return self._out(_o.token_scores(_o.lut_scores(qb, self.C, scale=self.scale), c))

    def decode_allowed(self, q_post: Any, codes: Any, margin: float | Callable[[np.ndarray], float]
                       ) -> tuple[np.ndarray, np.ndarray]:
        """CACHE-DECODE. (must, may) selection masks (n_kv, offset) for a decode query, scored with ``codes``.

        Scoring the codes the port holds (not this model's) means a port's tie-broken code choices never
        fail it here; the codes themselves are checked with code_allowed.
        """
        self._need_tokens("decode_allowed")
        s = self.decode_scores(q_post, codes)
        cfg = self.config
        return _o.select_tokens_allowed(s, n_kv_heads=self.n_kv, query_pos=self.offset - 1, w=cfg["w"],
                                        sinks=cfg["sinks"], topk=cfg["topk"], margin=_margin(margin, s))

    def attention(self, q_post: Any, mask: Any) -> np.ndarray:
        """RET-ATTN. Exact attention (n_q, dv) of a decode query over the cached keys/values where mask is True."""
        q = self._in(q_post, "q_post", (self.n_q, self.d))
        m = np.asarray(mask)
        m = m if self.batched else m[None]
        return self._out(_o.retrieval_attention(q, self._k, self._v, m, scale=self.scale))


def _npz(path: Any) -> str:
    import os

    p = os.fspath(path)
    return p if p.endswith(".npz") else p + ".npz"
