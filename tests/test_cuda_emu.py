"""RET-DECODE's CUDA kernels (a2ats_ref/cuda_decode.py) run on the host: their sources, compiled by g++ with
AddressSanitizer and UBSan against tests/cuda_host_shim.hpp (one thread per CUDA thread), checked by
cuda_decode.compare_parts exactly as the GPU self-check checks them: the LUT against float64, the selected set
against the portable selection (exactly), the attention against the portable attention.

This checks the kernels' indices and logic on any machine, the shapes no GPU run has covered included. It does
not check the GPU's memory model, timing or compiler: tests/test_gpu.py does, on MLX CUDA.
"""

import a2ats_ref  # noqa: F401  (before mlx: BLAS preload)
import mlx.core as mx
import pytest

from a2ats_ref import cuda_decode

cuda_emu = pytest.importorskip("cuda_emu")
pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ (C++20) to build the host emulator")

ATTN_BOUND = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 1e-2}


@pytest.mark.parametrize("case", [
    # 8B-like group, K = 256, the slot cut binding at level 1 (S = 256 < G * kk)
    dict(T=3000, n_q=8, n_kv=2, d=128, K=256, dtype=mx.float16, seed=7, S=256),
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
def test_kernels_on_the_host_match_the_portable_step(case):
    diff = cuda_decode.compare_parts(launch=cuda_emu.emulate, **case)
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
def test_host_kernels_reject_mutants(monkeypatch, old, new, case, expect):
    # a mutant of a source shared by several kernels (the scan) changes all of them, as an edit of the module would
    hit = [k for k, (_, _, src) in cuda_decode.KERNELS.items() if old in src]
    assert hit, old
    for k in hit:
        ins, outs, src = cuda_decode.KERNELS[k]
        monkeypatch.setitem(cuda_decode.KERNELS, k, (ins, outs, src.replace(old, new)))
    if expect == "crash":
        with pytest.raises(RuntimeError, match="host emulator"):
            cuda_decode.compare_parts(launch=cuda_emu.emulate, **case)
        return
    diff = cuda_decode.compare_parts(launch=cuda_emu.emulate, **case)
    if expect == "selection":
        assert not diff["same_selection"] and diff["extra"] + diff["missing"] > 0, diff
    else:
        assert diff["same_selection"] and diff["max_rel_err"] > 1e-3, diff


def test_compare_parts_refuses_a_shape_the_kernels_cannot_hold():
    with pytest.raises(ValueError, match="do not fit G=8, d=256"):
        cuda_decode.compare_parts(T=500, n_q=8, n_kv=1, d=256, K=64, launch=cuda_emu.emulate)
