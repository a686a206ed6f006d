"""Reproductions behind SPEC.md's "Where we depart from the authors" (RET-ATTN, RET-TOPK, EQ-17-STEP).

Each function recomputes one fact about the authors' released code (github junhuihe-hjh/A2ATS, commit
71f10b0) from first principles, so the numbers SPEC quotes come from a command:

    python -m a2ats_ref.bench.authors_checks          # prints JSON

* ``kernel_attention_gap``: their kernel path (``vqkey/models/llama.py``) feeds the query rotated to the
  far position b, with keys rotated at their true positions, to exact attention, i.e. it attends at relative
  position b - j; their masked path and this spec attend at i - j. Float64, random data, all tokens selected.
* ``float32_topk_counts``: their count is ``int(topk * seq_len)`` with ``seq_len`` an int64 tensor, a float32
  product; against the spec's float64 ``int(topk * T)`` for every T up to a bound.
* ``zero_codeword_collapse``: their empty-cluster rule (count clamped to 1, so the centre becomes the zero
  vector) against EQ-17-STEP's re-seeding, on a small example.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from a2ats_spec import oracle as _o


def kernel_attention_gap(positions=(199, 2048, 5000), *, b: int = 2048, d: int = 128, base: float = 500000.0,
                         n_q: int = 8, n_kv: int = 2, logit_std: float = 3.0, seed: int = 0) -> dict:
    """Max |out_kernel - out_spec| and max total variation between the two attention distributions.

    Per query position i (T = i + 1 tokens, all selected): out_spec = softmax(s (q R_i)(k_j R_j)ᵀ) v (the spec,
    their ``llama_masked.py``), out_kernel = softmax(s (q R_b)(k_j R_j)ᵀ) v (their ``llama.py`` kernel input).
    q, k, v are standard normal; q is scaled so the logits have standard deviation ``logit_std``.
    """
    inv = _o.rope_inv_freqs(d, base)
    G = n_q // n_kv
    out = {"b": b, "d": d, "rope_base": base, "n_q": n_q, "n_kv": n_kv, "logit_std": logit_std, "seed": seed,
           "rows": []}
    for i in positions:
        rng = np.random.default_rng([seed, i])
        T = i + 1
        q_pre = rng.standard_normal((n_q, d)) * logit_std      # q·k / sqrt(d) then has std logit_std
        k_pre = rng.standard_normal((n_kv, T, d))
        v = rng.standard_normal((n_kv, T, d))
        k_post = _o.rope_apply(k_pre, np.arange(T), inv, traditional=False)
        mask = np.ones((n_kv, T), bool)
        spec = _o.retrieval_attention(_o.rope_apply(q_pre, i, inv, traditional=False), k_post, v, mask)
        kern = _o.retrieval_attention(_o.rope_apply(q_pre, b, inv, traditional=False), k_post, v, mask)

        def probs(q):
            lg = np.einsum("gxd,gtd->gxt", q.reshape(n_kv, G, d), k_post) / np.sqrt(d)
            p = np.exp(lg - lg.max(-1, keepdims=True))
            return p / p.sum(-1, keepdims=True)

        tv = 0.5 * np.abs(probs(_o.rope_apply(q_pre, i, inv, traditional=False))
                          - probs(_o.rope_apply(q_pre, b, inv, traditional=False))).sum(-1)
        out["rows"].append({"query_pos": int(i), "max_abs_output_diff": float(np.max(np.abs(kern - spec))),
                            "max_total_variation": float(tv.max()),
                            "output_rms": float(np.sqrt(np.mean(spec ** 2)))})
    return out


def float32_topk_counts(fractions=(0.01, 0.03, 0.05, 0.1, 0.29, 0.3), t_max: int = 131072) -> dict:
    """For each fraction: T in 1..t_max where int(float32(topk) * float32(T)) != int(topk * T) (float64).

    PyTorch multiplies an int64 tensor by a Python float in its default float dtype (float32): the fraction
    is rounded to float32, T is converted to float32 (exact below 2**24), the product is rounded to float32.
    """
    T = np.arange(1, t_max + 1)
    rows = []
    for f in fractions:
        a32 = (np.float32(f) * T.astype(np.float32)).astype(np.int64)
        a64 = np.floor(f * T.astype(np.float64)).astype(np.int64)
        diff = np.flatnonzero(a32 != a64)
        rows.append({"topk": f, "t_max": t_max, "n_differ": int(diff.size),
                     "n_higher": int(np.sum(a32[diff] > a64[diff])), "n_lower": int(np.sum(a32[diff] < a64[diff])),
                     "examples": [{"T": int(T[j]), "authors": int(a32[j]), "spec": int(a64[j])} for j in diff[:3]]})
    return {"t_max": t_max, "rows": rows}


def authors_lloyd_step(z, C) -> tuple[np.ndarray, float]:
    """One step of their update (``kmeans.py``): nearest centre, mean of members, an empty cluster's count
    clamped to 1 so its new centre is the zero vector. Returns (C_new, objective under the input C)."""
    z, C = np.asarray(z, np.float64), np.asarray(C, np.float64)
    d2 = ((z[:, None, :] - C[None]) ** 2).sum(-1)
    codes = d2.argmin(1)
    sums = np.zeros_like(C)
    np.add.at(sums, codes, z)
    counts = np.bincount(codes, minlength=len(C)).astype(np.float64)
    return sums / np.maximum(counts, 1.0)[:, None], float(d2.min(1).sum())


def zero_codeword_collapse() -> dict:
    """A 1-D example with an empty cluster: objective after one step under both rules, and codewords used.

    The zero-vector collapse cannot raise the objective: each point's own cluster is non-empty and moves to the
    members' mean, which never increases that cluster's error, and a new zero centre can only be nearer. What
    it costs is a code: the zero codeword sits where no key is, so the next assignment leaves it unused.
    """
    z = np.array([[1.0], [1.1], [5.0], [5.2], [9.0], [9.4]])
    C = np.array([[1.05], [5.1], [9.2], [100.0]])     # centre 3 attracts nothing
    auth, f0 = authors_lloyd_step(z, C)
    _, f_auth = authors_lloyd_step(z, auth)
    spec, _, f0s = _o.lloyd_step(z, C)
    _, _, f_spec = _o.lloyd_step(z, spec)
    used = lambda Cn: int(np.unique(((z[:, None, :] - Cn[None]) ** 2).sum(-1).argmin(1)).size)  # noqa: E731
    return {"objective_before": f0, "authors": {"objective_after": f_auth, "codewords_used": used(auth),
                                                "centres": auth[:, 0].tolist()},
            "spec": {"objective_after": f_spec, "codewords_used": used(spec), "centres": spec[:, 0].tolist()},
            "K": len(C)}


def main(argv=None) -> int:
    res = {"kernel_attention_gap": [kernel_attention_gap(logit_std=s) for s in (1.0, 3.0)],
           "float32_topk_counts": float32_topk_counts(tuple(round(0.01 * i, 2) for i in range(1, 100))),
           "zero_codeword_collapse": zero_codeword_collapse()}
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
