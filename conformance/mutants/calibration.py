"""Mutants of calibration (EQ-10, EQ-15 to EQ-18 and k-means): the query moment H, the Cholesky factor, the
z-space transform and its assignment, k-means++ seeding, the Lloyd step's empty-cluster rule and blocks, the fit's
stop rule and codes, the back-transform."""

from __future__ import annotations

import math

import numpy as np

from a2ats_spec import oracle as _o
from a2ats_spec.oracle import code_dtype

from a2ats_conformance.diagnosis.deviations import _round
from a2ats_conformance.mutants.base import Mutant, _np

from a2ats_ref.eq17_kmeans import _fix_empty


class LTransposed(Mutant):
    def z_transform(self, k, L):
        return _np(k) @ np.swapaxes(_np(L), -1, -2)

    def assign_z(self, k, Cz, L):
        z = self.z_transform(k, L)
        d2 = np.sum((z[..., None, :] - _np(Cz)) ** 2, axis=-1)
        return np.argmin(d2, axis=-1)


class HNotPooled(Mutant):
    def query_moment(self, queries, *, n_kv_heads, **kw):
        q = np.asarray(queries)
        G = q.shape[0] // n_kv_heads
        return self._ref.query_moment(q[::G], n_kv_heads=n_kv_heads, **kw)


class RidgeIgnored(Mutant):
    def query_moment(self, queries, *, n_kv_heads, ridge=1e-6, **kw):
        return self._ref.query_moment(queries, n_kv_heads=n_kv_heads, ridge=0.0, **kw)


class KmeansppSearchsortedLeft(Mutant):
    def kmeanspp_init(self, z, K, uniforms):
        z, u = _np(z), _np(uniforms)
        chosen = [int(math.floor(u[0] * z.shape[0]))]
        D2 = np.sum((z - z[chosen[0]]) ** 2, axis=-1)
        for t in range(1, K):
            cum = np.cumsum(D2)
            n = int(np.searchsorted(cum, u[t] * cum[-1]))
            chosen.append(n)
            D2 = np.minimum(D2, np.sum((z - z[n]) ** 2, axis=-1))
        return z[chosen].astype(np.float32)


def _lloyd_empty_rule(z, C, *, stale_counts=False, tie_high=False):
    """EQ-17-STEP with one empty-cluster bug: donors judged by the sizes before any move, or ties of the
    largest error going to the highest point index."""
    z, C = _np(z), _np(C)
    N, K = z.shape[0], C.shape[0]
    d2 = np.sum((z[:, None, :] - C[None]) ** 2, axis=-1)
    codes = np.argmin(d2, axis=1)
    err = d2[np.arange(N), codes]
    members = codes.copy()
    counts = np.bincount(members, minlength=K)
    before = counts.copy()
    taken = np.zeros(N, bool)
    for e in range(K):
        if counts[e] > 0:
            continue
        size = before[codes] if stale_counts else counts[members]
        cand = np.flatnonzero(~taken & (size >= 2))
        n = int(cand[np.argsort(err[cand], kind="stable")[-1]] if tie_high else cand[np.argmax(err[cand])])
        counts[members[n]] -= 1
        members[n] = e
        counts[e] = 1
        taken[n] = True
    # a cluster the bug empties keeps its input centre (the usual guard against 0/0)
    C_new = np.stack([z[members == j].mean(axis=0) if np.any(members == j) else C[j] for j in range(K)])
    return C_new.astype(np.float32), codes.astype(np.int64), np.float32(err.sum())


class EmptyClusterTieHighIndex(Mutant):
    def lloyd_step(self, z, C):
        return _lloyd_empty_rule(z, C, tie_high=True)


class EmptyClusterStaleCounts(Mutant):
    def lloyd_step(self, z, C):
        return _lloyd_empty_rule(z, C, stale_counts=True)


def _first_L(L):
    """A stack of L (..., d, d) collapsed to its first matrix: the broadcast written as L[0]."""
    L = np.asarray(L)
    return L.reshape(-1, L.shape[-2], L.shape[-1])[0] if L.ndim > 2 else L


class ZTransformBatchedFirstL(Mutant):
    def z_transform(self, k, L):
        return self._ref.z_transform(k, _first_L(L))


class BackTransformBatchedFirstL(Mutant):
    def back_transform(self, Cz, L):
        return self._ref.back_transform(Cz, _first_L(L))


class AssignZCodesUint8(Mutant):
    def assign_z(self, k, Cz, L):
        return np.asarray(self._ref.assign_z(k, Cz, L)).astype(np.uint8)


class CholeskyLooseSymmetry(Mutant):
    def cholesky(self, H):
        H = _np(H)
        asym = float(np.abs(H - np.swapaxes(H, -1, -2)).max()) if H.size else 0.0
        if asym <= 1e-3 * max(1.0, float(np.abs(H).max()) if H.size else 1.0):
            H = (H + np.swapaxes(H, -1, -2)) / 2
        return self._ref.cholesky(H.astype(np.float32))


class QueryMomentBBfloat16(Mutant):
    def query_moment(self, queries, *, b, inv_freqs, traditional, **kw):
        # the reference rotates by b; rotating the queries by bf16(b) - b first makes that bf16(b) in all
        shift = float(_round(b, "bfloat16")) - b
        q = np.asarray(queries)
        q = _o.rope_apply(_np(q), shift, _np(inv_freqs), traditional=traditional).astype(q.dtype)
        return self._ref.query_moment(q, b=b, inv_freqs=inv_freqs, traditional=traditional, **kw)


class QueryMomentEpsNormalise(Mutant):
    def query_moment(self, queries, *, n_kv_heads, b, inv_freqs, traditional, ridge=1e-6):
        q = _o.rope_apply(_np(queries), b, _np(inv_freqs), traditional=traditional)
        n_q, N, d = q.shape
        Q = q.reshape(n_kv_heads, n_q // n_kv_heads * N, d)
        H = np.swapaxes(Q, -1, -2) @ Q / Q.shape[1]
        rms = np.sqrt(np.mean(H ** 2, axis=(-2, -1), keepdims=True))
        return (H / (rms + 1e-12) + ridge * np.eye(d)).astype(np.float32)


class AssignZLeadingRowZero(Mutant):
    def assign_z(self, k, Cz, L):
        k = np.asarray(k)
        if k.ndim <= 2:
            return self._ref.assign_z(k, Cz, L)
        first = np.asarray(self._ref.assign_z(k.reshape((-1,) + k.shape[-2:])[0], Cz, L))
        return np.broadcast_to(first, k.shape[:-1]).copy()


def _kmeans_fit(z, K, seed, max_iter, tol, stop, codes_of_last_step=False):
    """EQ-17-FIT on the oracle's seeding and Lloyd steps with another stop test ``stop(hist, C_prev, C, tol)``;
    codes_of_last_step: return the last step's codes (nearest its input centres) instead of nearest(z, C_s)."""
    z = _np(z)
    C = _o.kmeanspp_init(z, K, np.random.default_rng(seed).random(K))
    hist = []
    for _ in range(max_iter):
        C_prev = C
        C, codes, f = _o.lloyd_step(z, C_prev)
        hist.append(float(f))
        if stop(hist, C_prev, C, tol):
            break
    if not codes_of_last_step:
        codes = np.argmin(np.sum((z[:, None, :] - C[None]) ** 2, axis=-1), axis=1)
    return C.astype(np.float32), codes.astype(np.int64), np.array(hist, np.float32)


def _relative_stop(hist, C_prev, C, tol):
    return hist[-1] == 0 or (len(hist) >= 2 and hist[-2] - hist[-1] < tol * hist[-2])


class KmeansCentroidShiftStop(Mutant):
    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return _kmeans_fit(z, K, seed, max_iter, tol, lambda h, P, C, t: float(np.linalg.norm(C - P)) < t)


class KmeansCodesOfLastStep(Mutant):
    def kmeans(self, z, K, *, seed, max_iter=300, tol=1e-4):
        return _kmeans_fit(z, K, seed, max_iter, tol, _relative_stop, codes_of_last_step=True)


#: rows of one distance block of the reference's k-means (a2ats_ref.eq17_kmeans.BLOCK_ROWS on the CPU)
_KMEANS_BLOCK = 512


class KmeansFirstBlockBias(Mutant):
    def lloyd_step(self, z, C):
        z64, C64 = _np(z), _np(C)
        if z64.shape[0] <= _KMEANS_BLOCK:
            return self._ref.lloyd_step(z, C)
        c2 = np.sum(C64 ** 2, axis=1)
        dist = c2[None, :] - 2.0 * z64 @ C64.T
        dist[:_KMEANS_BLOCK] += c2[None, :]
        codes = np.argmin(dist, axis=1)
        err = np.sum((z64 - C64[codes]) ** 2, axis=1)
        members = _fix_empty(codes, err, C64.shape[0])
        C_new = np.stack([z64[members == k].mean(axis=0) for k in range(C64.shape[0])])
        return C_new.astype(np.float32), codes.astype(code_dtype(C64.shape[0])), float(err.sum())
