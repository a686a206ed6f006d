"""The fast paths of a2ats_ref.eq17_kmeans pick what the plain rules pick (EQ-17-INIT's inverse CDF)."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import numpy as np
import pytest

import mlx.core as mx

from a2ats_ref.eq17_kmeans import _CumWeights, kmeanspp_init


def _sequential(w, u):
    cum = np.cumsum(w, dtype=np.float64)
    return min(int(np.searchsorted(cum, u * cum[-1], side="right")), w.size - 1)


@pytest.mark.clause("EQ-17-INIT")
@pytest.mark.parametrize("N", [1, 7, 256, 1000])
def test_block_sums_pick_as_the_sequential_cumsum(N):
    rng = np.random.default_rng(N)
    # Weights over 30 decades round differently in block sums than in one running sum; draws placed exactly on
    # the sequential cumsum's boundaries (and one float64 step either side) are where the two could disagree.
    w = (10.0 ** rng.uniform(-15, 15, N)).astype(np.float32)
    w[rng.random(N) < 0.2] = 0.0
    w[0] = max(w[0], 1.0)
    tree = _CumWeights(w)
    for _ in range(3):
        cum = np.cumsum(w, dtype=np.float64)
        us = list(rng.random(50)) + [c / cum[-1] for c in cum[:-1]]
        us = [x for u in us for x in (u, np.nextafter(u, 0.0), np.nextafter(u, 1.0)) if 0.0 <= x < 1.0]
        assert [tree.pick(u) for u in us] == [_sequential(w, u) for u in us]
        idx = np.unique(rng.integers(0, N, max(1, N // 10)))
        w[idx] = (w[idx] * rng.uniform(0, 1, idx.size)).astype(np.float32)  # D^2 only shrinks
        tree.update(idx, w)


def _plain_kmeanspp(zn, K, u):
    """EQ-17-INIT without pruning, in the implementation's arithmetic (float32 D^2, float64 cumsum)."""
    N = zn.shape[0]
    chosen = [min(int(np.floor(u[0] * N)), N - 1)]
    d2 = np.sum(np.square(zn - zn[chosen[0]]), axis=-1)
    for t in range(1, K):
        chosen.append(_sequential(d2, u[t]))
        d2 = np.minimum(d2, np.sum(np.square(zn - zn[chosen[-1]]), axis=-1))
    return zn[chosen]


@pytest.mark.clause("EQ-17-INIT")
@pytest.mark.parametrize("spread", [0.05, 1.0])
def test_pruned_kmeanspp_picks_as_the_plain_rule(spread):
    # Anisotropic clusters (a few dominant directions, like calibration keys) and near-isotropic ones: the
    # triangle test, the principal-projection bound and the full screen each decide some centres.
    rng = np.random.default_rng(0)
    N, d, K = 3000, 16, 300
    scales = np.maximum(0.6 ** np.arange(d), spread)
    centres = rng.normal(size=(40, d)) * scales * 4
    zn = (centres[rng.integers(0, 40, N)] + rng.normal(size=(N, d)) * scales).astype(np.float32)
    u = np.random.default_rng(1).random(K)
    got = np.array(kmeanspp_init(mx.array(zn), K, u))
    np.testing.assert_array_equal(got, _plain_kmeanspp(zn, K, u))


@pytest.mark.clause("EQ-17-FIT")
def test_fit_from_centres_seeded_ahead_is_the_same_fit():
    # a2ats-calibrate seeds in a worker thread (seed_centres, NumPy only) and passes the centres as init.
    from a2ats_ref.eq17_kmeans import kmeans, seed_centres

    zn = np.random.default_rng(5).normal(size=(600, 8)).astype(np.float32)
    C, _, hist = kmeans(mx.array(zn), 40, seed=11, max_iter=6)
    C2, codes, hist2 = kmeans(mx.array(zn), 40, seed=11, max_iter=6, init=seed_centres(zn, 40, 11), assign=False)
    np.testing.assert_array_equal(np.array(C2), np.array(C))
    np.testing.assert_array_equal(hist2, hist)
    assert codes is None
    with pytest.raises(ValueError, match="init: expected centres of shape"):
        kmeans(mx.array(zn), 40, seed=11, init=np.zeros((39, 8), np.float32))
