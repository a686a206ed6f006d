"""RET-DECODE on CUDA, the gate: the once-per-process self-check that the CUDA kernels reproduce the portable step.

``usable()`` compiles the kernels of ``runtime.decode.cuda`` for a head shape and dtype, runs them on a random
case and compares with the portable parts (``runtime.decode.portable``): the LUT against float64, the selected
set exactly, the attention within ``SELF_CHECK_ATTN_REL``. "auto" takes the kernels only where it passed.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np

from a2ats_ref.codes import code_dtype
from a2ats_ref.retrieval import topk_count
from a2ats_ref.rope import rope_inv_freqs
from a2ats_ref.runtime.decode import cuda as cuda_decode
from a2ats_ref.runtime.decode import precompiled
from a2ats_ref.runtime.decode import portable as fd


_USABLE: dict = {}   # (device, dtype, G, n_kv, d, K) -> the self-check's verdict, once per process


def usable(*, dtype=None, G: int | None = None, n_kv: int | None = None, d: int | None = None,
           K: int | None = None) -> bool:
    """Whether method="cuda" may be taken here: on a CUDA device, the kernels compile and reproduce the portable
    parts (compare_parts) on a small case of this head shape and dtype (a small float16 case when none is given),
    so the check compiles the kernel instances the step will use. Checked once per process and shape; a failure
    warns (with the reason) and leaves "auto" on the portable step."""
    if not cuda_decode.on_cuda():
        return False
    key = (str(mx.default_device()), str(dtype), G, n_kv, d, K)
    if key not in _USABLE:
        _USABLE[key] = _self_check(dtype or mx.float16, G or 4, n_kv or 2, d or 64, K or 64)
    return _USABLE[key]


def _random_case(*, T, n_q, n_kv, d, K, dtype, seed):
    rng = np.random.default_rng(seed)
    x = dict(
        q=mx.array(rng.standard_normal((1, n_q, 1, d)).astype(np.float32)).astype(dtype),
        k=mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype),
        v=mx.array(rng.standard_normal((1, n_kv, T, d)).astype(np.float32)).astype(dtype),
        codes=mx.array(rng.integers(0, K, (1, n_kv, T)).astype(code_dtype(K))),
        C=rng.standard_normal((n_kv, K, d)).astype(np.float32),
        inv=np.array(rope_inv_freqs(d, 10000.0)))
    x["CT"] = fd.prepare_codebook(mx.array(x["C"]))
    return x


def compare_parts(*, T: int, n_q: int, n_kv: int, d: int, K: int, dtype=mx.float32, seed: int = 0,
                  topk=0.03, w: int = 64, sinks: int = 8, b: int = 2048, kept: bool = True, S: int | None = None,
                  launch=None) -> dict:
    """One random decode step by the kernels, part by part against the portable step and float64:

    lut_rel_err: the select kernel's LUT against a float64 NumPy LUT (relative to its largest entry);
    same_selection: the tokens the kernels cuda_decode.attend to (the mask kernel's scan) against the portable selection
    (fast_decode._sortfree_select given the kernel's LUT, plus the forced tokens), exactly; extra and missing count
    the tokens only the kernels take and only the portable step takes;
    max_rel_err: the attention against the portable attention (fast_decode._attend_fn) over that selection.
    S (default: fast_decode.sortfree_width) may be set smaller to make the slot cut bind. launch runs the kernels
    (default: MLX CUDA; tests/gpu/cuda_emu.py's host emulator runs the same sources on any machine).
    """
    launch = precompiled.default_launch() if launch is None else launch
    if not cuda_decode.kernels_fit(n_q // n_kv, d, d, K):
        raise ValueError(f"compare_parts: the kernels do not fit G={n_q // n_kv}, d={d}, K={K} (kernels_fit)")
    x = _random_case(T=T, n_q=n_q, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=seed)
    n = T
    forced, c0, c1 = fd._regions(n, w, sinks)
    kk = topk_count(n, topk, c1 - c0)
    G, BH = n_q // n_kv, n_kv
    S = fd.sortfree_width(kk, G, K, c1 - c0) if S is None else S
    inv = mx.array(x["inv"])
    counts = fd.code_counts(x["codes"], K) if kept else mx.zeros((1, n_kv, K), dtype=mx.int32)
    scale = 1.0 / np.sqrt(d)
    step = dict(kk=kk, c0=c0, c1=c1, counted=n if kept else 0, S=S, kept=kept, n=n, sinks=sinks, w=w,
                b=float(b), query_pos=float(n - 1), scale=float(scale))
    out, sel, table = cuda_decode.decode(x["q"], x["k"], x["v"], x["codes"], x["CT"], inv, counts=counts, traditional=False,
                             launch=launch, **step)
    mask = sel.mask()
    # float64 LUT: q de-rotated by (n - 1) * inv, rotated by b * inv, scaled, times C
    q64 = np.array(x["q"].astype(mx.float32), dtype=np.float64).reshape(n_kv, G, d)
    # EQ-12 undoes the float32 angle mlx-lm applied: the angles are float32 products, the rest float64
    th_q = (np.float32(n - 1) * x["inv"]).astype(np.float64)
    th_b = (np.float32(b) * x["inv"]).astype(np.float64)
    half = d // 2
    a, bb = q64[..., :half], q64[..., half:]
    a1, b1 = a * np.cos(th_q) + bb * np.sin(th_q), bb * np.cos(th_q) - a * np.sin(th_q)
    qb = np.concatenate([a1 * np.cos(th_b) - b1 * np.sin(th_b), a1 * np.sin(th_b) + b1 * np.cos(th_b)], -1) * scale
    lut64 = np.einsum("hgd,hkd->hgk", qb, x["C"].astype(np.float64))
    lut_err = float(np.abs(np.array(table).reshape(lut64.shape) - lut64).max() / np.abs(lut64).max())
    cand = fd._step_counts(x["codes"], counts, mx.array(c0), mx.array(c1), mx.array(n), kept=kept, BH=BH, K=K,
                           T_codes=T, sinks=sinks, w=w)
    idx_p, keep_p = fd._sortfree_select(table, x["codes"], cand, mx.array(kk, mx.int32), mx.array(c0), mx.array(c1),
                                        mx.array(S), BH=BH, T_codes=T, S=S)
    forced_idx = mx.array(np.asarray(forced, dtype=np.int32))
    mask_p = fd.Selection(idx_p, keep_p, forced_idx, (1, n_kv, n)).mask()
    att = fd._attend_fn(1, n_q, n_kv, d, d, T, len(forced), (None,))
    ref = att(x["q"], x["k"], x["v"], idx_p, keep_p, forced_idx, mx.array(scale, dtype=mx.float32))
    mx.eval(out, mask, mask_p, ref, sel.nsel)
    o, r = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    n12 = np.array(sel.nsel)[:, :2].sum(-1)
    mk, mp = np.array(mask), np.array(mask_p)
    return {"lut_rel_err": lut_err, "same_selection": bool(np.array_equal(mk, mp)), "selected": int(mk.sum()),
            "extra": int((mk & ~mp).sum()), "missing": int((mp & ~mk).sum()), "cut": bool((n12 > S).any()),
            "max_rel_err": float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30)), "dtype": str(dtype), "T": T}


#: the self-check's bound on the attention's relative difference from the portable step, per value dtype: both
#: outputs are rounded to that dtype, so bfloat16 (8 significant bits, an ulp of 2^-8 = 3.9e-3 relative at the
#: top of a binade) needs a wider bound than float16/float32; an H200's bfloat16 check differs by up to 3.2e-3,
#: and a tighter bound sends it to the portable step for want of one ulp
SELF_CHECK_ATTN_REL = {"float32": 2e-3, "float16": 2e-3, "bfloat16": 1e-2}


def _self_check(dtype, G: int, n_kv: int, d: int, K: int) -> bool:
    try:
        diff = compare_parts(T=3000, n_q=G * n_kv, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=1)
        bound = SELF_CHECK_ATTN_REL[str(dtype).rsplit(".", 1)[-1]]
        if not (diff["same_selection"] and diff["lut_rel_err"] <= 1e-5 and diff["max_rel_err"] <= bound):
            warnings.warn(f"a2ats_ref: the CUDA decode kernels disagree with the portable step ({diff}); "
                          "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
            return False
        return True
    except Exception as e:  # a compile or launch failure on this CUDA build: fall back, and say why
        warnings.warn(f"a2ats_ref: the CUDA decode kernels cannot run here ({type(e).__name__}: {e}); "
                      "decoding uses the portable sort-free step", RuntimeWarning, stacklevel=3)
        return False
