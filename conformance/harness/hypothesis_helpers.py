"""Hypothesis strategies for the conformance suite.

Arrays are not drawn element by element: a strategy draws shapes, parameters and a ``seed``
and the values come from ``numpy.random.default_rng(seed)``.  Shrinking then works on the
shapes and the seed (fast), and the seed is what failure messages report.  Edge cases that
random normals would miss (duplicate rows, exact ties, zeros) are drawn explicitly.

Every strategy returns plain dicts of NumPy float64 arrays and Python scalars; the suite rounds
arrays to the dtype under test before handing the same values to the IUT and the oracle.
Options are keyword-only and accept a value or a strategy, and are checked up front.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from a2ats_spec import oracle

from a2ats_conformance.harness import capabilities

__all__ = [
    "MAX_POSITION", "head_dims", "rope_params", "layouts", "topk_values", "topk_for_count", "gqa_heads", "positions", "spd_matrices",
    "rope_scaling_dict", "LLAMA3_OPTIONAL",
    "rng_from", "as_strategy", "normal", "codebook_case", "large_codebook_case", "scores_case", "kmeans_points",
    "LONG_POSITION", "max_positions", "WIDE_GROUPS", "KMEANS_BLOCK", "PAST_BLOCK_SIZES",
]

#: Largest absolute position of most draws (the tolerance table's bound, tolerances.TABLE_MAX_POSITION).
MAX_POSITION = 4096
#: Largest position the suite reaches (a 128K context); tolerances grow with position past MAX_POSITION.
LONG_POSITION = 131_072
HEAD_DIMS = (2, 4, 6, 8, 10, 16, 32, 64)
BASES = (10000.0, 100000.0, 500000.0)


def as_strategy(value, name: str):
    """A value or a strategy -> a strategy (Hypothesis' own convention)."""
    if isinstance(value, st.SearchStrategy):
        return value
    if value is None:
        raise ValueError(f"{name}: expected a value or a strategy, got None")
    return st.just(value)


def rng_from(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return scale * rng.standard_normal(shape)


def seeds():
    return st.integers(0, 2**32 - 1)


def head_dims(*, max_dim: int = 64):
    """Even head dims, including 2 and non-powers of two."""
    if not isinstance(max_dim, int) or max_dim < 2:
        raise ValueError(f"max_dim: expected an int >= 2, got {max_dim!r}")
    return st.sampled_from([d for d in HEAD_DIMS if d <= max_dim])


@st.composite
def layouts(draw):
    """A ``traditional=`` flag among the RoPE layouts the IUT declares (capabilities, read at draw time)."""
    return draw(st.sampled_from(capabilities.current().traditional_values), label="traditional")


@st.composite
def topk_values(draw, *, fractions=(0.03, 0.1, 0.25, 0.5, 0.99, 1.0), counts=st.integers(1, 12)):
    """A ``topk`` argument in a form the IUT declares: a fraction in (0, 1] and/or an int count."""
    forms = capabilities.current().topk
    opts = []
    if "fraction" in forms:
        opts.append(fractions if isinstance(fractions, st.SearchStrategy) else st.sampled_from(list(fractions)))
    if "count" in forms:
        opts.append(counts if isinstance(counts, st.SearchStrategy) else st.sampled_from(list(counts)))
    return draw(st.one_of(opts), label="topk")


def topk_for_count(k: int, n_visible: int):
    """``topk`` that selects ``k`` candidates of a query seeing ``n_visible`` tokens (RET-TOPK): the int ``k``
    when the IUT takes counts, else the fraction (k + 0.5) / n_visible, whose floor times n_visible is k."""
    if "count" in capabilities.current().topk:
        return k
    f = 1.0 if k >= n_visible else (k + 0.5) / n_visible
    if not 0 < f <= 1:
        raise ValueError(f"topk_for_count: cannot select {k} of {n_visible} tokens with a fraction")
    return f


#: ROPE-FREQ's optional llama3 keys -> values a config may give (the spec's default first; every low value is
#: below every high one). rope_params gives every key (real configs do); with ``leave_out`` it leaves each out
#: at random, so a port's own defaults are read (test_rope's defaults test only).
LLAMA3_OPTIONAL = {"low_freq_factor": (1.0, 2.0), "high_freq_factor": (4.0, 8.0),
                   "original_max_position_embeddings": (8192, 4096, 32768)}
#: How a config names the type (ROPE-FREQ reads it as mlx-lm does: ``type``, else ``rope_type``); HF configs
#: often carry both.
ROPE_TYPE_KEYS = ("type", "rope_type", "both")


def rope_scaling_dict(kind: str, type_key: str = "rope_type") -> dict:
    """``{"type" or "rope_type" (or both): kind}``, the start of a rope_scaling config."""
    if type_key not in ROPE_TYPE_KEYS:
        raise ValueError(f"type_key: expected one of {ROPE_TYPE_KEYS}, got {type_key!r}")
    return {k: kind for k in (("type", "rope_type") if type_key == "both" else (type_key,))}


@st.composite
def rope_params(draw, *, head_dim=None, max_dim: int = 64, scaled: bool = True, leave_out: bool = False):
    """{'d', 'base', 'scaling', 'traditional', 'inv_freqs'} with inv_freqs from the oracle (float64).

    A llama3 scaling gives all of LLAMA3_OPTIONAL (each its default or another value), as every released config
    does; ``leave_out``: each key may be left out (ROPE-FREQ's defaults apply)."""
    d = draw(as_strategy(head_dim, "head_dim") if head_dim is not None else head_dims(max_dim=max_dim), label="head_dim")
    if d < 2 or d % 2:
        raise ValueError(f"head_dim: expected an even int >= 2, got {d!r}")
    base = draw(st.sampled_from(BASES), label="base")
    kinds = ["default", "linear", "llama3"] if scaled else ["default"]
    kind = draw(st.sampled_from(kinds), label="rope_type")
    scaling = None
    if kind != "default" or draw(st.booleans(), label="explicit_default"):
        scaling = rope_scaling_dict(kind, draw(st.sampled_from(ROPE_TYPE_KEYS), label="type_key"))
    if kind == "linear":
        scaling["factor"] = draw(st.sampled_from([2.0, 4.0, 8.0]), label="factor")
    elif kind == "llama3":
        scaling["factor"] = draw(st.sampled_from([8.0, 2.0, 32.0]), label="factor")
        for key, values in LLAMA3_OPTIONAL.items():   # given (default or not), or with leave_out also left out
            value = draw(st.one_of(st.none(), st.sampled_from(values)) if leave_out else st.sampled_from(values),
                         label=key)
            if value is not None:
                scaling[key] = value
    traditional = draw(layouts(), label="traditional")
    inv = oracle.rope_inv_freqs(d, base, scaling)
    return {"d": d, "base": base, "scaling": scaling, "traditional": traditional, "inv_freqs": inv}


#: GQA group sizes past the small ones: Llama-3-70B has 8 query heads per KV head, some models 16; 9 is the
#: first size an 8-lane head mask gets wrong.
WIDE_GROUPS = (4, 8, 9, 16)


@st.composite
def gqa_heads(draw, *, max_kv: int = 3, max_group: int = 16):
    """(n_q, n_kv) with n_q = G * n_kv: G of 1-3 or one of WIDE_GROUPS (up to max_group; n_kv <= 2 then)."""
    if not isinstance(max_group, int) or max_group < 1:
        raise ValueError(f"max_group: expected an int >= 1, got {max_group!r}")
    wide = [g for g in WIDE_GROUPS if 3 < g <= max_group]
    small = st.integers(1, min(3, max_group))
    G = draw(st.one_of(small, st.sampled_from(wide)) if wide else small, label="G")
    n_kv = draw(st.integers(1, max_kv if G <= 3 else min(2, max_kv)), label="n_kv")
    return n_kv * G, n_kv


def max_positions():
    """An upper bound for drawn positions: mostly the table's bound, sometimes up to a 128K context."""
    return st.sampled_from([MAX_POSITION, MAX_POSITION, 32_768, LONG_POSITION])


@st.composite
def positions(draw, n: int, *, max_position: int = MAX_POSITION, contiguous=None):
    """(n,) int64 positions: either p0 + arange(n) or arbitrary (sorted) positions."""
    contig = draw(st.booleans(), label="contiguous") if contiguous is None else contiguous
    if contig:
        p0 = draw(st.integers(0, max_position - n), label="p0")
        return np.arange(p0, p0 + n, dtype=np.int64)
    seed = draw(seeds(), label="positions_seed")
    return np.sort(rng_from(seed).integers(0, max_position + 1, size=n)).astype(np.int64)


def spd_matrix(rng: np.random.Generator, d: int, *, cond: float = 100.0, kind: str = "random") -> np.ndarray:
    """A symmetric positive-definite d x d matrix with condition number <= cond."""
    if kind == "identity":
        return np.eye(d)
    if kind == "diagonal":
        return np.diag(np.exp(rng.uniform(0, np.log(cond), size=d)))
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    ev = np.exp(rng.uniform(0, np.log(cond), size=d))
    H = (Q * ev) @ Q.T
    return (H + H.T) / 2


@st.composite
def spd_matrices(draw, d: int, *, max_cond: float = 1000.0):
    kind = draw(st.sampled_from(["random", "diagonal", "identity"]), label="H_kind")
    cond = draw(st.sampled_from([1.0, 10.0, max_cond]), label="H_cond")
    seed = draw(seeds(), label="H_seed")
    scale = draw(st.sampled_from([1.0, 0.01, 30.0]), label="H_scale")
    return scale * spd_matrix(rng_from(seed), d, cond=cond, kind=kind)


@st.composite
def codebook_case(draw, *, max_dim: int = 32, max_K: int = 12, max_points: int = 6):
    """Keys k (n, d), a codebook C (K, d) and an SPD H (d, d), with optional exact ties."""
    d = draw(head_dims(max_dim=max_dim), label="head_dim")
    K = draw(st.integers(1, max_K), label="K")
    n = draw(st.integers(1, max_points), label="n_keys")
    seed = draw(seeds(), label="seed")
    rng = rng_from(seed)
    C = normal(rng, (K, d))
    k = normal(rng, (n, d))
    edge = draw(st.sampled_from(["none", "duplicate_codeword", "key_is_codeword", "integer_grid"]), label="edge")
    if edge == "duplicate_codeword" and K >= 2:
        C[-1] = C[0]                         # exact tie: two identical codewords
    elif edge == "key_is_codeword":
        k[0] = C[rng.integers(K)]            # zero distance
    elif edge == "integer_grid":
        C, k = np.round(C), np.round(k)      # many exact ties
    H = draw(spd_matrices(d), label="H")
    return {"d": d, "K": K, "n": n, "seed": seed, "edge": edge, "k": k, "C": C, "H": H}


@st.composite
def large_codebook_case(draw, *, max_dim: int = 16):
    """codebook_case past the uint8 range: K in {256, 257, 300, 1000} (codes of K > 256 need uint16, CODES-DTYPE),
    and most keys sit on (or next to) codewords of index >= 255, so a code that wraps modulo 256 or saturates at 255
    is wrong. Codewords have norm ~sqrt(d) >= 2 apart from near-duplicates, which are rare at d >= 4."""
    d = draw(st.sampled_from([dd for dd in HEAD_DIMS if 4 <= dd <= max_dim]), label="head_dim")
    K = draw(st.sampled_from([256, 257, 300, 1000]), label="K")
    n = draw(st.integers(1, 8), label="n_keys")
    seed = draw(seeds(), label="seed")
    rng = rng_from(seed)
    C = normal(rng, (K, d))
    targets = np.concatenate([[K - 1, 255], rng.integers(255, K, size=max(0, n - 2))])[:n]
    k = C[targets] + normal(rng, (n, d), 0.01)
    k[0] = C[K - 1]                          # one key exactly on the last codeword
    H = draw(spd_matrices(d, max_cond=100.0), label="H")
    return {"d": d, "K": K, "n": n, "seed": seed, "edge": "large_K", "k": k, "C": C, "H": H,
            "targets": targets}


@st.composite
def scores_case(draw, *, max_T: int = 48, leads=None):
    """Token scores (n_q, T) for a decode query, with selection parameters and optional exact ties.

    leads: leading shapes to draw from (RET-SELECT's scores are (..., n_q, T)); None: none, scores (n_q, T)."""
    n_q, n_kv = draw(gqa_heads(), label="heads")
    lead = () if leads is None else tuple(draw(st.sampled_from(leads), label="lead"))
    T = draw(st.integers(1, max_T), label="T")
    query_pos = draw(st.integers(0, T - 1), label="query_pos")
    w = draw(st.integers(0, 8), label="w")
    sinks = draw(st.integers(0, 4), label="sinks")
    topk = draw(topk_values(), label="topk")
    seed = draw(seeds(), label="seed")
    rng = rng_from(seed)
    s = normal(rng, lead + (n_q, T))
    if draw(st.booleans(), label="ties"):
        s = np.round(s * 2) / 2              # few distinct values: many exact ties
    return {"n_q": n_q, "n_kv": n_kv, "T": T, "lead": lead, "query_pos": query_pos, "w": w, "sinks": sinks,
            "topk": topk, "seed": seed, "scores": s}


#: Rows of one distance block of a blocked k-means (the reference's BLOCK_ROWS on the CPU): kmeans_points'
#: ``past_block`` sizes straddle it, so a bug confined to one block shows.
KMEANS_BLOCK = 512
PAST_BLOCK_SIZES = (513, 700, 1100)


@st.composite
def kmeans_points(draw, *, max_N: int = 40, max_dim: int = 8, max_K: int = 6, past_block: bool = False):
    """Points z (N, d) with N >= K distinct points, and K. ``past_block``: N from PAST_BLOCK_SIZES (more than one
    KMEANS_BLOCK), clustered; the cluster centres come back as ``centres``."""
    d = draw(st.integers(1, max_dim), label="d")
    K = draw(st.integers(1, max_K), label="K")
    if past_block:
        N = draw(st.sampled_from(PAST_BLOCK_SIZES), label="N")
    else:
        N = draw(st.integers(K, max(K, max_N)), label="N")
    seed = draw(seeds(), label="seed")
    rng = rng_from(seed)
    clustered = True if past_block else draw(st.booleans(), label="clustered")
    centres = None
    if clustered:
        centres = normal(rng, (K, d), 5.0)
        z = centres[rng.integers(K, size=N)] + normal(rng, (N, d), 0.3)
    else:
        z = normal(rng, (N, d))
    return {"z": z, "K": K, "N": N, "d": d, "seed": seed, "clustered": clustered, "centres": centres}


__all__ += ["leading_keys_case"]


@st.composite
def leading_keys_case(draw, *, max_dim: int = 16, max_K: int = 12):
    """Keys with leading dims, k (*lead, n, d) with lead in {(2,), (3, 1), (2, 2)}, a codebook C (K, d), K >= 2, and
    an SPD H. Every key sits next to a codeword (``targets``, noise 0.02) and the first key of each row of the
    leading dims targets a different codeword, so the rows have different codes: a port that codes only the first
    row, or flattens the leading dims without restoring them, is wrong. (EQ-13, EQ-14, EQ-16: ``k (..., d)``.)"""
    d = draw(head_dims(max_dim=max_dim), label="head_dim")
    K = draw(st.integers(2, max_K), label="K")
    n = draw(st.integers(1, 4), label="n_keys")
    lead = tuple(draw(st.sampled_from([(2,), (3, 1), (2, 2)]), label="lead"))
    seed = draw(seeds(), label="seed")
    rng = rng_from(seed)
    C = normal(rng, (K, d))
    targets = rng.integers(K, size=lead + (n,))
    targets.reshape(-1, n)[:, 0] = np.arange(int(np.prod(lead))) % K
    k = C[targets] + normal(rng, lead + (n, d), 0.02)
    H = draw(spd_matrices(d, max_cond=100.0), label="H")
    return {"d": d, "K": K, "n": n, "lead": lead, "seed": seed, "k": k, "C": C, "H": H, "targets": targets}
