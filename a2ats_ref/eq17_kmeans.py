"""EQ-17-INIT, EQ-17-STEP, EQ-17-FIT — k-means++ and Lloyd in z-space (z = k L).

The randomness is explicit: k-means++ consumes one uniform per centre and the fit
draws them from numpy.random.default_rng(seed), so runs are reproducible and
comparable with the oracle. An empty cluster takes the worst-fitted point of a
cluster that can spare one (PLAN.md's rule; the authors' code zeroes it instead),
which keeps the objective non-increasing and every codeword in use.

Scale: calibration runs N ~ 80K points, K = 4096, d = 64 per (layer, KV head).
Distances use ||z||^2 - 2 z C^T + ||C||^2 on row chunks so the N x K matrix is
never held at once (BLOCK_ROWS rows: one GEMM, then NumPy's argmin of that block);
k-means++ skips points a new centre cannot reach (triangle inequality, then a lower bound from projections on
the leading principal directions), which is exact and makes seeding O(N) per centre instead of O(N d).
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from a2ats_ref import checks
from a2ats_ref._blas import gflops
from a2ats_ref.codes import mx_code_dtype
from a2ats_ref.precision import addmm

#: rows of z per distance block (a 512 x 4096 float32 block is 8 MiB): the GEMM of a 64-wide inner dimension
#: runs well below BLAS peak on few rows, and 512 rows were 1.5x faster per Lloyd step than 128 at
#: 81,920 x 4096 x 64 (same centres bit for bit; the argmin is a small part either way)
BLOCK_ROWS = 512
#: rows per block on a GPU: each block is a few kernel launches and one eval, so blocks as large as memory
#: allows (a 16,384 x 4,096 float32 block is 256 MiB); 512-row blocks left the H200 waiting on launches
GPU_BLOCK_ROWS = 16384


def _points(z, name: str = "z") -> mx.array:
    z = checks.as_float(z, name)
    if z.ndim != 2 or z.shape[0] < 1 or z.shape[1] < 1:
        raise ValueError(f"{name}: expected points of shape (N, d) with N, d >= 1, got shape {tuple(z.shape)}")
    return z


def nearest(z: mx.array, C: mx.array) -> tuple[mx.array, mx.array]:
    """(codes int32 (N,), squared error (N,)) of each row of z to its nearest row of C (ties -> lowest).

    Distances are one GEMM per block of rows, ||C||^2 - 2 z C^T (||z||^2 is constant per row, so it does
    not change the argmin), reduced by an argmin while the block is in cache: only a block or two of the
    N x K distance matrix exist at a time. On a GPU addmm folds the bias into the GEMM and MLX reduces the
    block; on the CPU see _nearest_cpu (NumPy's argmin is vectorised, MLX's CPU argmin costs several times
    the GEMM that produced the block).
    """
    Ct_m2 = -2.0 * mx.swapaxes(C, 0, 1)
    c2 = mx.sum(C * C, axis=-1)
    mx.eval(Ct_m2, c2)
    N = z.shape[0]
    if mx.default_device().type != mx.cpu:  # a GPU reduces its own blocks; no host copy of N x K distances
        parts = []
        for s in range(0, N, GPU_BLOCK_ROWS):
            parts.append(mx.argmin(addmm(c2, z[s : s + GPU_BLOCK_ROWS], Ct_m2), axis=-1).astype(mx.int32))
            mx.eval(parts[-1])
        codes = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    else:
        codes = mx.array(_nearest_cpu(z, Ct_m2, np.array(c2)))
    # The error itself is computed directly, not by the (cancellation-prone) expansion.
    err = mx.sum(mx.square(z - C[codes]), axis=-1)
    return codes, err


def _nearest_cpu(z: mx.array, Ct_m2: mx.array, c2: np.ndarray) -> np.ndarray:
    """nearest's codes on the CPU: MLX's BLAS forms block i+1's z (-2 C^T) while NumPy adds ||C||^2 to block i
    in place and takes its argmin (two cores busy, not one after the other).

    Not mx.addmm(c2, z, -2 C^T): on the CPU it first broadcasts c2 into the output with MLX's copy, which took
    0.16 s of a 0.41 s distance pass at 81,920 x 4,096 x 64, where the GEMM itself took 0.24 s. The values are
    the same bit for bit: both round acc + c2 once, acc being the same sgemm kernel's dot product (the addmm
    GEMM runs with beta = 1 on the copied c2, the plain one with beta = 0 before NumPy's add).
    """
    N = z.shape[0]
    codes = np.empty(N, dtype=np.int32)
    nxt = z[:BLOCK_ROWS] @ Ct_m2
    mx.async_eval(nxt)
    for s in range(0, N, BLOCK_ROWS):
        block = nxt
        mx.eval(block)
        if s + BLOCK_ROWS < N:
            nxt = z[s + BLOCK_ROWS : s + 2 * BLOCK_ROWS] @ Ct_m2
            mx.async_eval(nxt)
        d = np.asarray(block)  # this function's own evaluated array: changed in place, no copy
        d += c2
        codes[s : s + BLOCK_ROWS] = d.argmin(axis=-1)
    return codes


def kmeanspp_init(z, K: int, uniforms) -> mx.array:
    """EQ-17-INIT: k-means++ centres (K, d) from explicit uniforms u (K,) in [0, 1)."""
    z = _points(z)
    return mx.array(_kmeanspp(np.array(z), checks.check_pos_int(K, "K"), uniforms))


def seed_centres(zn: np.ndarray, K: int, seed: int) -> np.ndarray:
    """EQ-17-FIT's C_0 for ``seed``: kmeanspp_init with numpy.random.default_rng(seed).random(K), NumPy in and
    out (float32 (N, d) -> (K, d)). It calls no MLX, so it may run in a worker thread while MLX works;
    pass the result to kmeans(init=...)."""
    zn = np.asarray(zn, dtype=np.float32)
    if zn.ndim != 2 or zn.shape[0] < 1 or zn.shape[1] < 1:
        raise ValueError(f"z: expected points of shape (N, d) with N, d >= 1, got shape {zn.shape}")
    K = checks.check_pos_int(K, "K")
    return _kmeanspp(zn, K, np.random.default_rng(checks.check_nonneg_int(seed, "seed")).random(K))


def _kmeanspp(zn: np.ndarray, K: int, uniforms) -> np.ndarray:
    N = zn.shape[0]
    u = np.asarray(uniforms, dtype=np.float64)
    if u.shape != (K,):
        raise ValueError(f"uniforms: expected shape ({K},) (one uniform per centre), got {u.shape}")
    if not np.all((u >= 0) & (u < 1)):
        raise ValueError("uniforms: every value must lie in [0, 1)")
    if N < K:
        raise ValueError(f"z: need at least K={K} points, got N={N}")
    n_distinct = np.unique(zn, axis=0).shape[0]
    if n_distinct < K:
        raise ValueError(f"z: need at least K={K} distinct points for k-means++, got {n_distinct}")

    chosen = np.empty(K, dtype=np.int64)
    chosen[0] = min(int(math.floor(u[0] * N)), N - 1)
    centres = np.empty((K, zn.shape[1]), dtype=np.float32)
    centres[0] = zn[chosen[0]]
    d2 = np.sum(np.square(zn - centres[0]), axis=-1)
    z2 = np.sum(np.square(zn), axis=-1)
    near = np.zeros(N, dtype=np.int64)  # index (into centres) of each point's nearest centre
    proj = _principal_projection(zn)
    # Per point: a centre c can only come closer if ||c - c_near||^2 < 4 D^2 (triangle inequality); the margin
    # absorbs float32 rounding in D^2.
    reach = 4.0 * d2.astype(np.float64) * (1.0 + 1e-5) + 1e-30
    c64 = np.zeros((K, zn.shape[1]), np.float64)  # centres in float64 for exact centre-centre distances
    c64[0] = centres[0]
    cn2 = np.zeros(K, np.float64)
    cn2[0] = c64[0] @ c64[0]
    tree = _CumWeights(d2)
    for t in range(1, K):
        n = tree.pick(u[t])
        chosen[t] = n
        c = zn[n]
        centres[t] = c
        c64[t] = c
        cn2[t] = c64[t] @ c64[t]
        # ||c_j - c||^2 by expansion in float64: errors ~1e-16 of the norms, far inside the 1e-5 margin.
        cc = cn2[:t] - 2.0 * np.einsum("ij,j->i", c64[:t], c64[t]) + cn2[t]  # einsum: no BLAS threads
        idx = np.flatnonzero(cc[near] < reach)
        # Projections on the leading principal directions bound the distance from below: ||P^T (x - c)|| <=
        # ||x - c||. On calibration keys (anisotropic) this drops most survivors of the triangle test while
        # reading PROJ_DIMS numbers per point, not d.
        if idx.size <= N // 4:
            dp = proj[idx] - proj[n]
            idx = idx[np.einsum("ij,ij->i", dp, dp) < d2[idx] * (1.0 + 1e-5) + 1e-30]
        else:
            # Weak pruning (early centres are far apart): screen every point with one matrix-vector product,
            # with a margin for its rounding, then measure the survivors directly.
            cn = float(cn2[t])
            approx = z2 + cn - 2.0 * np.einsum("ij,j->i", zn, c)  # einsum: no BLAS threads to contend
            idx = np.flatnonzero(approx < d2 + 1e-5 * (z2 + cn) + 1e-30)
        if idx.size:
            dn = np.sum(np.square(zn[idx] - c), axis=-1)
            closer = dn < d2[idx]
            hit = idx[closer]
            d2[hit] = dn[closer]
            near[hit] = t
            reach[hit] = 4.0 * dn[closer].astype(np.float64) * (1.0 + 1e-5) + 1e-30
            tree.update(hit, d2)
    return centres


#: principal directions kept for k-means++'s lower bound (on SmolLM2 keys in z-space the top 8 hold ~95% of
#: the variance, and the bound passed 0.2-7% of the points that the triangle test passed 5-30% of)
PROJ_DIMS = 8


def _principal_projection(zn: np.ndarray) -> np.ndarray:
    """(N, PROJ_DIMS) float64 coordinates of z on its leading principal directions (orthonormal)."""
    z64 = zn.astype(np.float64)
    cov = np.atleast_2d(np.cov(z64, rowvar=False)) if zn.shape[0] > 1 else np.zeros((zn.shape[1],) * 2)
    _, vecs = np.linalg.eigh(cov)  # ascending eigenvalues
    return z64 @ vecs[:, ::-1][:, :PROJ_DIMS]


class _CumWeights:
    """Inverse-CDF sampling over weights w (float32, N) that change a few at a time, as EQ-17-INIT draws.

    The rule is the smallest n with cumsum(w)[n] > u * sum(w), cumsum taken sequentially in float64 (as
    np.cumsum(w, dtype=np.float64)). Sums are kept per block of BLOCK weights, so a draw reads the block sums
    and one block, and an update re-sums the blocks it touched: O(N / BLOCK + BLOCK) instead of O(N). Block
    sums round differently from the sequential cumsum (by at most ~N eps of the total), so a draw that lands
    within 1e-9 of the total of a boundary is redone with the sequential cumsum: the pick is always the one
    the sequential rule gives.
    """

    BLOCK = 256

    def __init__(self, w: np.ndarray):
        self.w = w
        self.N = w.size
        nb = -(-self.N // self.BLOCK)
        self.w64 = np.zeros(nb * self.BLOCK, np.float64)
        self.w64[: self.N] = w
        self.sums = self.w64.reshape(nb, self.BLOCK).sum(axis=1)

    def update(self, idx: np.ndarray, w: np.ndarray) -> None:
        if idx.size == 0:
            return
        self.w64[idx] = w[idx]
        blocks = np.unique(idx // self.BLOCK)
        self.sums[blocks] = self.w64.reshape(-1, self.BLOCK)[blocks].sum(axis=1)

    def pick(self, u: float) -> int:
        bc = np.cumsum(self.sums)
        total = bc[-1]
        target = u * total
        j = int(np.searchsorted(bc, target, side="right"))
        if j < bc.size:
            base = bc[j - 1] if j else 0.0
            within = base + np.cumsum(self.w64[j * self.BLOCK : (j + 1) * self.BLOCK])
            k = int(np.searchsorted(within, target, side="right"))
            lo = within[k - 1] if k else base
            margin = 1e-9 * total
            if k < within.size and within[k] - target > margin and target - lo > margin:
                return min(j * self.BLOCK + k, self.N - 1)
        cum = np.cumsum(self.w, dtype=np.float64)  # near a boundary: the sequential rule itself
        return min(int(np.searchsorted(cum, u * cum[-1], side="right")), self.N - 1)


def _fix_empty(codes: np.ndarray, err: np.ndarray, K: int) -> np.ndarray:
    """Members after the empty-cluster rule: empties (in index order) take the worst-fitted spare point."""
    members = codes.copy()
    counts = np.bincount(members, minlength=K)
    empties = np.flatnonzero(counts == 0)
    if empties.size == 0:
        return members
    order = np.argsort(-err, kind="stable")  # largest error first, ties -> lowest index
    p = 0
    for e in empties:
        # Counts of non-empty clusters only fall, so a point skipped here stays ineligible.
        while counts[members[order[p]]] < 2:
            p += 1
        n = order[p]
        counts[members[n]] -= 1
        members[n] = e
        counts[e] = 1
        p += 1
    return members


def _means(z: mx.array, members: np.ndarray, K: int, *, fixed_order: bool | None = None) -> mx.array:
    """Centroids (K, d) of z's rows grouped by members (every cluster non-empty after _fix_empty).

    On the CPU a scatter-add (bitwise repeatable there). Elsewhere a scatter-add is not: MLX CUDA's
    `.at[].add` sums in whatever order atomics land, so centres, codes and the whole fit would change
    from run to run. There the sums are a sorted segment sum in float64 on the host: fixed order, so a
    fit is repeatable bit for bit on a given device and MLX version. fixed_order=None picks by device.
    """
    if fixed_order is None:
        fixed_order = mx.default_device().type != mx.cpu
    if not fixed_order:
        mem = mx.array(members)
        sums = mx.zeros((K, z.shape[1]), dtype=mx.float32).at[mem].add(z)
        counts = mx.zeros((K,), dtype=mx.float32).at[mem].add(1.0)
        return sums / counts[:, None]
    order = np.argsort(members, kind="stable")
    starts = np.searchsorted(members[order], np.arange(K))
    sums = np.add.reduceat(np.array(z, dtype=np.float64)[order], starts, axis=0)
    counts = np.bincount(members, minlength=K).astype(np.float64)
    return mx.array((sums / counts[:, None]).astype(np.float32))


def lloyd_step(z, C) -> tuple[mx.array, mx.array, float]:
    """EQ-17-STEP: (C_new, codes, objective); codes and objective are under the INPUT C."""
    z = _points(z)
    C = checks.as_float(C, "C")
    if C.ndim != 2 or C.shape[1] != z.shape[1] or C.shape[0] < 1:
        raise ValueError(f"C: expected shape (K, {z.shape[1]}) matching z's width, got shape {tuple(C.shape)}")
    N, K = z.shape[0], C.shape[0]
    if N < K:
        raise ValueError(f"z: need at least K={K} points, got N={N}")
    C_new, codes, objective = _step(z, C)
    return C_new, codes.astype(mx_code_dtype(K)), objective


def _step(z: mx.array, C: mx.array) -> tuple[mx.array, mx.array, float]:
    """One Lloyd step on checked inputs: every row's distances (no pruning bounds: a single Hamerly bound,
    tried before, still needed full rows for 77-100% of 81,402 calibration keys at K = 4096 and made the
    steps slower than full ones)."""
    codes, err = nearest(z, C)
    codes_np, err_np = np.array(codes), np.array(err)
    objective = float(np.sum(err_np, dtype=np.float64))
    members = _fix_empty(codes_np, err_np, C.shape[0])
    return _means(z, members, C.shape[0]), codes, objective


def kmeans(
    z, K: int, *, seed: int, max_iter: int = 300, tol: float = 1e-4,
    progress: Callable[[int, float], None] | None = None, stats: dict | None = None, assign: bool = True,
    init: np.ndarray | None = None,
) -> tuple[mx.array, mx.array | None, np.ndarray]:
    """EQ-17-FIT: (C (K, d), codes (N,), history of objectives).

    Stops after step s when s == max_iter, f_s == 0, or s >= 2 and f_{s-1} - f_s < tol * f_{s-1};
    codes are the nearest rows of the returned C. progress(step, objective) is called after each step.
    The steps are EQ-17-STEP's.
    stats: if a dict is given, phase times are added to it (see phase_stats).
    assign=False returns codes None and skips their pass over the N x K distances (a calibration keeps only C).
    init: C_0 computed ahead by seed_centres(z, K, seed) (a2ats-calibrate seeds the next head in a worker
    thread while this one runs its Lloyd steps); its time is then the caller's to count.
    """
    z = _points(z)
    K = checks.check_codebook_size(K)
    seed = checks.check_nonneg_int(seed, "seed")
    max_iter = checks.check_pos_int(max_iter, "max_iter")
    if not (isinstance(tol, numbers.Real) and math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol: expected a finite number >= 0, got {tol!r}")
    if z.shape[0] < K:
        raise ValueError(f"z: need at least K={K} points, got N={z.shape[0]}")
    t0 = time.perf_counter()
    if init is None:
        C = kmeanspp_init(z, K, np.random.default_rng(seed).random(K))
    else:
        C = mx.array(np.asarray(init, dtype=np.float32))
        if C.shape != (K, z.shape[1]):
            raise ValueError(f"init: expected centres of shape ({K}, {z.shape[1]}) from seed_centres, got {C.shape}")
    mx.eval(C)
    t1 = time.perf_counter()
    history: list[float] = []
    for s in range(1, max_iter + 1):
        C, _, f = _step(z, C)
        mx.eval(C)
        if not math.isfinite(f):   # squared distances overflowed float32: the assignments are garbage
            raise ValueError(f"z: float32 overflow in k-means step {s} (objective {f}); the points are too large "
                             "in magnitude: scale them down")
        history.append(f)
        if progress is not None:
            progress(s, f)
        if f == 0.0 or (s >= 2 and history[-2] - f < tol * history[-2]):
            break
    codes = None
    if assign:
        codes, _ = nearest(z, C)
        mx.eval(codes)
    if stats is not None:
        N, d = z.shape
        add = {"init_s": t1 - t0 if init is None else 0.0, "lloyd_s": time.perf_counter() - t1, "steps": len(history),
               # nominal work: each Lloyd step (and the final assignment) N x K distances
               "init_flop": init_flop(N, d, K) if init is None else 0.0,
               "lloyd_flop": 2.0 * N * K * d * (len(history) + int(assign))}
        for k, v in add.items():
            stats[k] = stats.get(k, 0) + v
    return C, None if codes is None else codes.astype(mx_code_dtype(K)), np.asarray(history)


def init_flop(N: int, d: int, K: int) -> float:
    """Nominal FLOPs of k-means++ (N points measured against each of K centres, 3 d each); with pruning, rates
    from it are effective rates."""
    return 3.0 * N * d * K


def phase_stats(stats: dict) -> dict:
    """Seconds and effective GFLOP/s of k-means++ and of the Lloyd steps, from kmeans(stats=...)."""
    return {"kmeans_init_s": round(stats.get("init_s", 0.0), 2),
            "kmeans_init_gflops": gflops(stats.get("init_flop", 0.0), stats.get("init_s", 0.0)),
            "kmeans_lloyd_s": round(stats.get("lloyd_s", 0.0), 2),
            "kmeans_lloyd_gflops": gflops(stats.get("lloyd_flop", 0.0), stats.get("lloyd_s", 0.0))}
