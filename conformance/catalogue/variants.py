"""Variants of the oracle's model (deviations.Model) that the deviation library has no entry for: the
authors' documented choices (SPEC.md, "Where we depart from the authors") and the cache-level departures of
real ports (far logits q·R_i·k, plain assignment, no selection).

Each class changes one hook of ``Model`` (or one adapter callable built on its hooks), so that the port
profile (catalogue/profile.py) can compose it with the variants found for other mechanisms.
"""

from __future__ import annotations

import numpy as np

from a2ats_spec import oracle as _o

from a2ats_conformance.diagnosis.deviations import Model, _f

__all__ = ["AuthorsAbsoluteStop", "AuthorsEmptyZero", "AuthorsInt64Codes", "AuthorsNothingSelected", "FarQueryWithoutRb", "NoSelection",
           "PlainAssignment", "QueryOwnPositionKeyUnrotated"]


class QueryOwnPositionKeyUnrotated(Model):
    """Far logits q_i R_i · k_j: the query at its own position, the (pre-RoPE) key unrotated; at decode the LUT
    is the post-RoPE query times the codebook (no de-rotation, no R_b)."""

    def far_scores(self, q, k, pq, pk, *, b, w, inv, traditional):
        return self._rope(q, pq, inv, traditional) @ np.swapaxes(_f(k), -1, -2)

    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        return _f(q)

    def token_scores_for(self, q_post, k_post, codes, C, *, query_pos, b, w, inv, traditional, scale):
        q = _f(self.selection_query(q_post, k_post, query_pos))
        return _o.token_scores(self.lut(q, C, scale), np.asarray(codes))


class FarQueryWithoutRb(Model):
    """far_query without R_b (b = 0): the de-rotated query q_pre itself; wrope_scores and H keep R_b."""

    def far_query(self, q, *, b, inv_freqs, traditional, positions=None):
        return Model.far_query(self, q, b=0, inv_freqs=inv_freqs, traditional=traditional, positions=positions)


class PlainAssignment(Model):
    """Assignment by plain ‖k − c‖² (H and L ignored): the nearest codeword in key space (z = k)."""

    def assign(self, k, C, H):
        k, C = _f(k), _f(C)
        return np.argmin(np.sum((k[..., None, :] - C) ** 2, axis=-1), axis=-1).astype(np.int64)

    def z(self, k, L):
        return _f(k)


class NoSelection(Model):
    """No retrieval: every visible token (j <= i) is attended; the scores choose nothing."""

    _decoding = False

    def decode_step(self, *a, **kw):
        self._decoding = True   # select_tokens itself is not part of this variant: only the decode ignores it
        try:
            return Model.decode_step(self, *a, **kw)
        finally:
            self._decoding = False

    def select(self, scores, *, n_kv_heads, query_pos, w, sinks, topk, capacity=None):
        if not self._decoding:
            return Model.select(self, scores, n_kv_heads=n_kv_heads, query_pos=query_pos, w=w, sinks=sinks,
                                topk=topk, capacity=capacity)
        s = _f(scores)
        T = s.shape[-1]
        mask = np.broadcast_to(np.arange(T) <= int(query_pos), s.shape[:-2] + (n_kv_heads, T)).copy()
        return mask, mask.astype(np.int64)


class AuthorsNothingSelected(Model):
    """The authors' rule where sinks, window and top-k select nothing (w = 0, sinks = 0, count 0): nothing is
    selected (SPEC RET-SELECT, "Our choice: the never-empty rule")."""

    def adds_own_token(self, k, forced):
        return False


class AuthorsEmptyZero(Model):
    """The authors' Lloyd update: an empty cluster's count is clamped to 1, so its centre collapses to the zero
    vector (SPEC EQ-17-STEP, Departures); no point is moved."""

    def lloyd_step(self, z, C):
        _o.lloyd_step(z, C)                  # the preconditions (ValueError) are the oracle's
        z, C = _f(z), _f(C)
        d2 = np.sum((z[:, None, :] - C[None]) ** 2, axis=-1)
        codes = np.argmin(d2, axis=1)
        err = d2[np.arange(z.shape[0]), codes]
        C_new = np.stack([z[codes == j].mean(axis=0) if np.any(codes == j) else np.zeros(z.shape[1])
                          for j in range(C.shape[0])])
        return C_new, codes.astype(np.int64), float(np.sum(err))


class AuthorsAbsoluteStop(Model):
    """The authors' stop rule: after the step where the centroids moved by less than tol in Frobenius norm,
    ‖C_s − C_(s−1)‖_F < tol, an absolute test (SPEC EQ-17-FIT, Departures)."""

    def stop(self, hist, C_prev, C, tol):
        return float(np.linalg.norm(C - C_prev)) < tol

    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        _o.kmeans(z, K, seed=seed, max_iter=1, tol=tol)   # the preconditions (ValueError) are the oracle's
        z = _f(z)
        C = self.kmeanspp_init(z, K, np.random.default_rng(seed).random(K))
        hist = []
        for _ in range(int(max_iter)):
            C_prev = C
            C, _, f = self.lloyd_step(z, C_prev)
            hist.append(float(f))
            if self.stop(hist, C_prev, C, tol):
                break
        codes = np.argmin(np.sum((z[:, None, :] - C[None]) ** 2, axis=-1), axis=1).astype(np.int64)
        return C, codes, np.asarray(hist)


class AuthorsInt64Codes(Model):
    """Codes held as int64 whatever K (the authors' torch.argmin output) instead of code_dtype(K)."""

    def code_dtype(self, K):
        _o.code_dtype(K)
        return np.dtype(np.int64)
