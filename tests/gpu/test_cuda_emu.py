"""RET-DECODE's CUDA kernels (a2ats_ref/runtime/decode/cuda.py) run on the host: their sources, compiled by g++ with
AddressSanitizer and UBSan against tests/gpu/cuda_host_shim.hpp (one thread per CUDA thread), checked by
selfcheck.compare_parts exactly as the GPU self-check checks them: the LUT against float64, the selected set
against the portable selection (exactly), the attention against the portable attention.

This checks the kernels' indices and logic on any machine, the shapes no GPU run has covered included. It does
not check the GPU's memory model, timing or compiler: tests/gpu/test_gpu.py does, on MLX CUDA.
"""

from functools import partial

import a2ats_ref  # noqa: F401  (before mlx: BLAS preload)
from a2ats_ref.runtime.decode import dispatch, selfcheck
import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref.runtime.decode import cuda as cuda_decode
from a2ats_ref.runtime.decode import portable as fast_decode
from a2ats_ref.retrieval import topk_count

cuda_emu = pytest.importorskip("cuda_emu")
pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ (C++20) to build the host emulator")

ATTN_BOUND = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}


@pytest.mark.parametrize("case", [
    # 8B-like group, K = 256, the slot cut binding at level 1 (S = 256 < G * kk). The kernels cut level-2 ties
    # in index order over the whole GQA group; the portable step ranks the tied tokens each head needs for its
    # own k (RET-SELECT's per-head count) with level 1, so the two selections differ where the cut binds
    pytest.param(dict(T=3000, n_q=8, n_kv=2, d=128, K=256, dtype=mx.float16, seed=7, S=256),
                 marks=pytest.mark.xfail(strict=True, reason="kernels: no per-head tie quota in the S-slot cut")),
    # huge tie buckets (K = 8) cut at level 2 (S = 60)
    dict(T=1500, n_q=4, n_kv=4, d=32, K=8, dtype=mx.bfloat16, seed=8, S=60),
    # counts recounted from the codes (no kept counts), bfloat16
    dict(T=3000, n_q=6, n_kv=3, d=64, K=64, dtype=mx.bfloat16, seed=9, kept=False),
    # K = 4096 (uint16 codes), float32
    dict(T=2000, n_q=8, n_kv=2, d=128, K=4096, dtype=mx.float32, seed=11),
    # a 70B-like group of 8 heads
    dict(T=2500, n_q=16, n_kv=2, d=128, K=256, dtype=mx.float16, seed=12),
    # head sizes outside RUN_HEAD_DIMS (never run on a GPU): d = 8, the shape of the GPU run's one failure, and 256
    dict(T=3000, n_q=4, n_kv=1, d=8, K=16, dtype=mx.float32, seed=1),
    dict(T=2000, n_q=4, n_kv=1, d=256, K=64, dtype=mx.float16, seed=10),
], ids=lambda c: f"d{c['d']}-G{c['n_q'] // c['n_kv']}-K{c['K']}-{str(c['dtype']).rsplit('.', 1)[-1]}"
                 + (f"-S{c['S']}" if "S" in c else "") + ("-recounted" if c.get("kept") is False else ""))
@pytest.mark.clause("RET-SELECT", "RET-DECODE")
def test_kernels_on_the_host_match_the_portable_step(case):
    diff = selfcheck.compare_parts(launch=cuda_emu.emulate, **case)
    assert diff["same_selection"] and diff["extra"] == diff["missing"] == 0, diff
    assert diff["cut"] == ("S" in case), diff
    assert diff["lut_rel_err"] <= 1e-5, diff
    assert diff["max_rel_err"] <= ATTN_BOUND[case["dtype"]], diff


CUT_CASE = dict(T=1500, n_q=4, n_kv=4, d=32, K=8, dtype=mx.float32, seed=8, S=60)
PLAIN_CASE = dict(T=1500, n_q=4, n_kv=2, d=32, K=64, dtype=mx.float32, seed=3)


@pytest.mark.parametrize("old,new,case,expect", [
    # the level-2 cut off by one: a tie too many taken where the cut binds
    ("(lv[e] == 2 && n1 + r2 < S)", "(lv[e] == 2 && n1 + r2 <= S)", CUT_CASE, "selection"),
    # ranks that ignore the candidates before the chunk
    ("r2 = before[1] + (ex & 0xffff);", "r2 = (ex & 0xffff);", CUT_CASE, "selection"),
    # the radix select looking for the (2 kk)-th score instead of the kk-th
    ("rem[tid] = kk;", "rem[tid] = 2 * kk;", PLAIN_CASE, "selection"),
    # the attention's lane-group merge losing the other groups' sums
    ("ll[g] = ll[g] * fa + lo * fb;", "ll[g] = ll[g] * fa;", PLAIN_CASE, "attention"),
    # one token past the row in the mask kernel's write: AddressSanitizer stops it
    ("sel[(size_t)r * n + tok[i]] = 1;", "sel[(size_t)r * n + tok[i] + 1] = 1;", PLAIN_CASE, "crash"),
], ids=["cut-off-by-one", "ranks-without-earlier-chunks", "radix-rank", "lane-group-merge", "write-past-row"])
@pytest.mark.clause("RET-SELECT", "RET-ATTN")
def test_host_kernels_reject_mutants(monkeypatch, old, new, case, expect):
    # a mutant of a source shared by several kernels (the scan) changes all of them, as an edit of the module would
    hit = [k for k, (_, _, src) in cuda_decode.KERNELS.items() if old in src]
    assert hit, old
    for k in hit:
        ins, outs, src = cuda_decode.KERNELS[k]
        monkeypatch.setitem(cuda_decode.KERNELS, k, (ins, outs, src.replace(old, new)))
    if expect == "crash":
        with pytest.raises(RuntimeError, match="host emulator"):
            selfcheck.compare_parts(launch=cuda_emu.emulate, **case)
        return
    diff = selfcheck.compare_parts(launch=cuda_emu.emulate, **case)
    if expect == "selection":
        assert not diff["same_selection"] and diff["extra"] + diff["missing"] > 0, diff
    else:
        assert diff["same_selection"] and diff["max_rel_err"] > 1e-3, diff


def test_compare_parts_refuses_a_shape_the_kernels_cannot_hold():
    with pytest.raises(ValueError, match="do not fit G=8, d=256"):
        selfcheck.compare_parts(T=500, n_q=8, n_kv=1, d=256, K=64, launch=cuda_emu.emulate)


@pytest.fixture
def host_kernels(monkeypatch):
    """decode_step_fast(method="cuda") on this machine: the CUDA step's kernels launched by the host emulator."""
    monkeypatch.setattr(cuda_decode, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_decode, "_kernels", lambda: {k: partial(cuda_emu.emulate, k) for k in cuda_decode.KERNELS})


@pytest.mark.clause("RET-SELECT", "RET-DECODE")
@pytest.mark.parametrize("traditional,tables,dtype", [(True, True, mx.float32), (False, True, mx.float16),
                                                      (True, False, mx.bfloat16)])
def test_decode_step_through_the_host_kernels_matches_the_portable_step(host_kernels, traditional, tables, dtype):
    # What compare_parts does not reach, through decode_step_fast(method="cuda") as the cache calls it: batch 2 (rows
    # b * n_kv + h), traditional RoPE, the model's applied-angle tables, kept counts corrected by the coded window
    # tail, and a query before the buffer's end (the mask padded from n to n_tokens).
    rng = np.random.default_rng(5)
    B, n_q, n_kv, d, K, T_buf, n_tokens, i, w = 2, 8, 2, 32, 64, 1200, 1100, 1049, 64
    arr = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))
    q, k, v = arr(B, n_q, 1, d).astype(dtype), arr(B, n_kv, T_buf, d).astype(dtype), arr(B, n_kv, T_buf, d).astype(dtype)
    codes = mx.array(rng.integers(0, K, (B, n_kv, T_buf)).astype(np.uint8))
    CT = fast_decode.prepare_codebook(arr(n_kv, K, d))
    inv = mx.array((1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32))
    counted = i + 1 - w + 20   # the window's first 20 tokens already coded: the kernel subtracts their codes
    kw = dict(query_pos=i, b=2048, w=w, sinks=4, topk=0.05, inv_freqs=inv, traditional=traditional,
              n_tokens=n_tokens, return_mask=True, code_counts=(fast_decode.code_counts(codes[..., :counted], K), counted))
    if tables:
        th = np.float32(i) * np.array(inv)
        kw["applied_angle"] = (mx.array(np.cos(th).astype(np.float32)), mx.array(np.sin(th).astype(np.float32)))
    out_c, mask_c = dispatch.decode_step_fast(q, k, v, codes, CT, method="cuda", **kw)
    out_p, mask_p = dispatch.decode_step_fast(q, k, v, codes, CT, method="sortfree", **kw)
    assert mask_c.shape == mask_p.shape == (B, n_kv, n_tokens)
    assert np.array_equal(np.array(mask_c), np.array(mask_p))
    assert not np.array(mask_c)[..., i + 1:].any() and np.array(mask_c)[..., i].all()
    o, r = np.array(out_c.astype(mx.float32)), np.array(out_p.astype(mx.float32))
    assert np.abs(o - r).max() <= ATTN_BOUND[dtype] * np.abs(r).max()


@pytest.mark.clause("RET-SELECT", "RET-DECODE")
def test_kept_counts_lose_exactly_the_coded_window(host_kernels):
    # The select kernel subtracts the sinks' and the coded window tail's codes from the kept counts. Crafted so
    # one count decides: b = the query position (EQ-12 rotates by nothing), code 0 = q and code 1 = -q, the top
    # code 0 on kk - 1 candidates and on every window token. Corrected, the kk-th score is a code-1 tie and every
    # candidate is taken; one window code left in (a count of kk) would make code 0 a whole level-1 set alone.
    d, K, n, w, sinks, topk = 32, 2, 600, 16, 2, 0.05
    _, c0, c1 = fast_decode._regions(n, w, sinks)
    kk = topk_count(n, topk, c1 - c0)
    qv = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    codes = np.ones((1, 1, n), np.uint8)
    codes[..., :c0 + kk - 1] = 0
    codes[..., c1:] = 0
    counted = c1 + 10
    codes = mx.array(codes)
    kw = dict(query_pos=n - 1, b=n - 1, w=w, sinks=sinks, topk=topk, traditional=False,
              inv_freqs=mx.array((1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32)),
              code_counts=(fast_decode.code_counts(codes[..., :counted], K), counted), return_mask=True)
    kv = mx.array(np.random.default_rng(1).standard_normal((1, 1, n, d)).astype(np.float32))
    CT = fast_decode.prepare_codebook(mx.array(np.stack([qv, -qv])[None]))
    q = mx.array(qv.reshape(1, 1, 1, d))
    _, mask_c = dispatch.decode_step_fast(q, kv, kv, codes, CT, method="cuda", **kw)
    _, mask_p = dispatch.decode_step_fast(q, kv, kv, codes, CT, method="sortfree", **kw)
    assert np.array(mask_p).all() and np.array_equal(np.array(mask_c), np.array(mask_p))
