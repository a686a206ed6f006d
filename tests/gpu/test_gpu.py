"""What the reference must get right on GPUs (SPEC, Conventions: Precision on GPUs, The angle the model applied).

Run on any backend; the GPU-only checks skip with the reason on a machine without one.
"""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import a2ats_ref  # noqa: F401  (before mlx: BLAS preload)
from a2ats_ref.runtime.decode import dispatch, selfcheck
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE

from a2ats_ref import precision, rope
from a2ats_ref.runtime.cache import A2ATSCache, assign_codes, random_codebook
from a2ats_ref.eq17_kmeans import _means, kmeans
from hang_guard import HANG_S

ON_GPU = mx.default_device().type == mx.gpu
pytestmark = pytest.mark.filterwarnings("ignore:A2ATS is using a RANDOM codebook")


def test_split_head_is_tf32_exact_and_head_plus_tail_is_the_value():
    # A head with more than TF32's 10 explicit mantissa bits, or a tail that does not restore x,
    # would put TF32's rounding back into mm.
    x = mx.array(np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e3)
    hi, lo = precision._split(x)
    assert np.all(np.array(hi.view(mx.uint32)) & 0x1FFF == 0)
    assert np.array_equal(np.array(hi + lo), np.array(x))
    assert np.all(np.abs(np.array(lo)) <= 2.0 ** -10 * np.abs(np.array(x)))


@pytest.mark.clause("EQ-14", "RET-LUT")
def test_mm_matches_float64_when_tf32_is_forced(monkeypatch):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 40, 64)), rng.standard_normal((64, 50))
    monkeypatch.setitem(precision._TF32, str(mx.default_device()), True)
    got = np.array(precision.mm(mx.array(a.astype(np.float32)), mx.array(b.astype(np.float32))))
    exact = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    assert np.max(np.abs(got - exact)) <= 1e-5 * np.max(np.abs(exact))


@pytest.mark.clause("EQ-14", "RET-LUT")
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend (MLX CUDA or Metal): TF32 exists only there")
def test_clause_functions_stay_float32_in_a_tf32_process():
    code = (
        "import a2ats_ref, mlx.core as mx, numpy as np\n"
        "from a2ats_ref import precision\n"
        "from a2ats_ref.retrieval import lut_scores\n"
        "r = np.random.default_rng(0); q = r.standard_normal((8, 64)); C = r.standard_normal((2, 512, 64))\n"
        "got = np.array(lut_scores(mx.array(q.astype(np.float32)), mx.array(C.astype(np.float32)), scale=1.0))\n"
        "ex = np.einsum('gkd,ghd->ghk', C, q.reshape(2, 4, 64)).reshape(8, 512)\n"
        "print(precision.tf32_active(), np.max(np.abs(got - ex)) / np.max(np.abs(ex)))\n"
    )
    env = dict(os.environ, MLX_ENABLE_TF32="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    active, rel = out.stdout.split()
    assert rel and float(rel) < 1e-5, out.stdout


def _rope_modules():
    yield nn.RoPE(64, traditional=False, base=500000.0)
    yield nn.RoPE(64, traditional=True, base=10000.0, scale=0.25)
    yield Llama3RoPE(64, max_position_embeddings=131072, traditional=False, base=500000.0,
                     scaling_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})


@pytest.mark.clause("ROPE-INVERSE")
@pytest.mark.parametrize("module", list(_rope_modules()), ids=["neox-base", "traditional-scaled", "llama3"])
def test_applied_angles_undo_the_models_rotation_to_131072(module):
    # The de-rotation must undo what mx.fast.rope did on this device (SPEC: The angle the model applied).
    pos = [0, 1, 4095, 65537, 90000, 131071, 131072]
    x = mx.array(np.random.default_rng(2).standard_normal((len(pos), 1, 1, 64)).astype(np.float32))
    y = mx.concatenate([module(x[i : i + 1], offset=p) for i, p in enumerate(pos)])
    c, s = rope.applied_cos_sin(mx.array(pos), 64, module.traditional, rope.fast_rope_args(module))
    back = rope.rotate_by_tables(y[:, 0, 0], c, s, module.traditional, -1.0)
    assert np.max(np.abs(np.array(back - x[:, 0, 0]))) < 1e-5


@pytest.mark.clause("ROPE-INVERSE")
@pytest.mark.parametrize("module", list(_rope_modules()), ids=["neox-base", "traditional-scaled", "llama3"])
def test_applied_angles_of_a_run_of_positions(module):
    # The cache reads a run of positions back with one scalar-offset call (a sequence, as mlx-lm rotates it; on
    # MLX CUDA 0.32 a 251-long offset array failed to launch): the same angles as per-position offsets.
    args = rope.fast_rope_args(module)
    for s0, n in ((0, 1), (242, 251), (131000, 73)):
        c, s = rope.applied_cos_sin(range(s0, s0 + n), 64, module.traditional, args)
        c2, s2 = rope.applied_cos_sin(mx.arange(s0, s0 + n), 64, module.traditional, args)
        assert c.shape == c2.shape == (n, 32)
        assert np.max(np.abs(np.array(c - c2))) < 1e-6 and np.max(np.abs(np.array(s - s2))) < 1e-6
    with pytest.raises(ValueError, match="step 1"):
        rope.applied_cos_sin(range(0, 10, 2), 64, module.traditional, args)


@pytest.mark.clause("CACHE-FAR-CODES")
def test_cache_codes_use_the_models_angles():
    # A cache built with the model's rope arguments codes mx.fast.rope keys as their pre-RoPE selves.
    module = nn.RoPE(64, traditional=False, base=500000.0)
    lc = random_codebook(1, 2, 64, 256).layers[0]
    inv, trad = rope.rope_params_from_module(module)
    k = mx.array(np.random.default_rng(3).standard_normal((1, 2, 4, 64)).astype(np.float32))
    pos = mx.array([3, 100000, 120000, 131072])
    k_post = mx.concatenate([module(k[:, :, i : i + 1], offset=int(p)) for i, p in enumerate(pos.tolist())], axis=2)
    want = assign_codes(k, mx.zeros((4,)), lc, inv, traditional=trad)
    got = assign_codes(k_post, pos, lc, inv, traditional=trad, fast_rope=rope.fast_rope_args(module))
    assert np.array_equal(np.array(got), np.array(want))
    cache = A2ATSCache(lc, inv, trad, fast_rope=rope.fast_rope_args(module))
    rebuilt = A2ATSCache(lc, inv, trad)
    rebuilt.meta_state = cache.meta_state
    assert rebuilt.fast_rope == cache.fast_rope


@pytest.mark.clause("CACHE-SAVE")
def test_saved_cache_keeps_the_models_rope_call(tmp_path):
    # A loaded cache must keep undoing the model's own angles for the tokens it appends later.
    from a2ats_ref.files.cache import load_a2ats_cache, save_a2ats_cache

    cb = random_codebook(1, 2, 64, 256)
    module = nn.RoPE(64, traditional=True, base=10000.0, scale=0.5)
    inv, trad = rope.rope_params_from_module(module)
    cache = A2ATSCache(cb.layers[0], inv, trad, fast_rope=rope.fast_rope_args(module))
    kv = mx.zeros((1, 2, 3, 64))
    cache.update_and_fetch(kv, kv)
    save_a2ats_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = load_a2ats_cache(str(tmp_path / "c.safetensors"), cb)
    assert loaded.fast_rope == {"base": 10000.0, "scale": 0.5}


def test_empty_cache_positions_convert_to_numpy():
    # np.array(mx.arange(0)) segfaults on MLX CUDA 0.32; an empty cache's positions must not be built that way.
    lc = random_codebook(1, 2, 64, 256).layers[0]
    inv, trad = rope.rope_params_from_module(nn.RoPE(64))
    p = A2ATSCache(lc, inv, trad).positions
    assert np.array(p).shape == (0,)


@pytest.mark.clause("EQ-17-STEP")
def test_fixed_order_means_agree_with_scatter_and_repeat_bitwise():
    rng = np.random.default_rng(4)
    z = mx.array(rng.standard_normal((5000, 16)).astype(np.float32))
    members = rng.integers(0, 64, 5000)
    members[:64] = np.arange(64)
    host = [np.array(_means(z, members, 64, fixed_order=True)) for _ in range(2)]
    scatter = np.array(_means(z, members, 64, fixed_order=False))
    assert np.array_equal(host[0], host[1])
    assert np.max(np.abs(host[0] - scatter)) < 1e-5


@pytest.mark.clause("EQ-17-STEP")
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU backend: the CPU's scatter-add is repeatable already")
def test_kmeans_repeats_bitwise_on_the_gpu():
    z = mx.array(np.random.default_rng(5).standard_normal((20000, 32)).astype(np.float32))
    runs = [kmeans(z, 256, seed=0, max_iter=8) for _ in range(2)]
    assert np.array_equal(np.array(runs[0][0]), np.array(runs[1][0]))
    assert np.array_equal(np.array(runs[0][1]), np.array(runs[1][1]))


# --------------------------------------------------------------------------- RET-DECODE's CUDA kernels
from a2ats_ref.runtime.decode import cuda as cuda_decode  # noqa: E402
from a2ats_ref.runtime.decode import portable as fast_decode

ON_CUDA = cuda_decode.on_cuda()


def test_cuda_method_is_refused_off_cuda_with_what_to_use_instead():
    if ON_CUDA:
        pytest.skip("this machine has MLX CUDA: the refusal is for other devices")
    x = mx.zeros((1, 4, 1, 64))
    kv = mx.zeros((1, 2, 300, 64))
    codes = mx.zeros((1, 2, 300), dtype=mx.uint16)
    CT = fast_decode.prepare_codebook(mx.zeros((2, 16, 64)))
    inv = mx.array((1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32))
    with pytest.raises(ValueError, match="method='cuda' needs MLX's CUDA backend.*use method='sortfree'"):
        dispatch.decode_step_fast(x, kv, kv, codes, CT, query_pos=299, b=2048, w=8, sinks=2, topk=0.1,
                                     inv_freqs=inv, traditional=False, method="cuda")
    assert not selfcheck.usable()
    assert dispatch.auto_method(10**6) in ("host", "mlx", "sortfree")


def test_cuda_kernel_shapes_fit_the_block():
    # rows in 8-32 byte lane loads and per-warp partials in static shared memory: 8B (G 4, d 128), SmolLM2 (3, 64)
    # and 70B-like groups (8, 128) fit
    assert cuda_decode.shapes_supported(4, 128, 128) and cuda_decode.shapes_supported(3, 64, 64)
    assert cuda_decode.shapes_supported(8, 128, 128) and cuda_decode.shapes_supported(7, 128, 128)
    assert not cuda_decode.shapes_supported(4, 96, 96)      # 3 elements per lane: no aligned vector load
    assert cuda_decode.lane_elems(8, 4) == 1 and not cuda_decode.shapes_supported(4, 8, 8)   # not run on a GPU
    assert not cuda_decode.shapes_supported(4, 256, 256)
    assert not cuda_decode.shapes_supported(4, 128, 128, K=16384)   # code counts over the shared-memory budget
    assert not cuda_decode.shapes_supported(4, 80, 80)      # not a multiple of 32
    assert not cuda_decode.shapes_supported(4, 128, 64)     # dv != d
    assert not cuda_decode.shapes_supported(16, 256, 256)   # partials over the shared-memory budget


@pytest.mark.clause("RET-SELECT", "RET-DECODE")
@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend (the kernels are CUDA source)")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("T,n_q,n_kv,d,K,kept,S", [(5000, 32, 8, 128, 256, True, None), (70000, 9, 3, 64, 4096, True, None),
                                                   (1500, 4, 4, 32, 8, True, None), (3000, 6, 3, 64, 64, False, None),
                                                   # the slot cut binding at level 1 (S = 256 < G * kk): the kernels cut
                                                   # the group's level-2 ties in index order, the portable step first
                                                   # ranks each head's own tie quota (cuda.py's docstring), as the
                                                   # host emulator's same case shows (test_cuda_emu.py)
                                                   pytest.param(5000, 32, 8, 128, 256, True, 256, marks=pytest.mark.xfail(
                                                       strict=True, reason="kernels: no per-head tie quota in the S-slot cut")),
                                                   (1500, 4, 4, 32, 8, True, 60)])
def test_cuda_step_parts_match_the_portable_step(dtype, T, n_q, n_kv, d, K, kept, S):
    # The select kernel's LUT against float64; the set the attend kernel's scan takes against the portable
    # selection given that LUT, exactly (ties included: K = 8 makes huge tie buckets; a small S makes the slot cut
    # bind, level 1 at S = 256 and level-2 ties at S = 60); the attention against the portable attention over that
    # set. A kernel that loses a ballot prefix, a chunk's rank, a radix digit or a tie shows here.
    diff = selfcheck.compare_parts(T=T, n_q=n_q, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=T, kept=kept, S=S)
    assert diff["lut_rel_err"] <= 1e-5, diff
    assert diff["same_selection"], diff
    assert diff["cut"] == (S is not None), diff
    assert diff["max_rel_err"] <= (1e-5 if dtype == mx.float32 else 1e-2), diff


@pytest.mark.clause("RET-SELECT", "RET-DECODE")
@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend (the kernels are CUDA source)")
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("T,n_q,n_kv,d,K,kept,S", [(5000, 32, 8, 128, 256, True, None), (3000, 6, 3, 64, 64, False, None),
                                                   (1500, 4, 4, 32, 8, True, 60)])
def test_kept_cubins_match_the_portable_step_and_load_without_compiling(dtype, T, n_q, n_kv, d, K, kept, S, tmp_path,
                                                                       monkeypatch):
    from a2ats_ref.runtime.decode import precompiled

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(precompiled, "_CUBINS", {})   # an instance an earlier test loaded would not be compiled here
    built = []
    real = precompiled.compile_cubin
    monkeypatch.setattr(precompiled, "compile_cubin", lambda *a: built.append(a[1]) or real(*a))
    diff = selfcheck.compare_parts(T=T, n_q=n_q, n_kv=n_kv, d=d, K=K, dtype=dtype, seed=T, kept=kept, S=S,
                                   launch=precompiled.launch)
    assert diff["lut_rel_err"] <= 1e-5 and diff["same_selection"], diff
    assert diff["max_rel_err"] <= (1e-5 if dtype == mx.float32 else 1e-2), diff
    assert len(built) == 3 and len(list((tmp_path / "a2ats-ref" / "cuda-kernels").glob("*.cubin"))) == 3
    monkeypatch.setattr(precompiled, "_CUBINS", {})   # as a new process: the kept files, no compiler
    monkeypatch.setattr(precompiled, "compile_cubin", lambda *a: pytest.fail("compiled a kept kernel again"))
    for name in ("select", "attend", "mask"):
        symbol = next(p.stem for p in (tmp_path / "a2ats-ref" / "cuda-kernels").glob(f"a2ats_{name}_*.cubin"))
        assert precompiled.cubin(symbol, "unused")


def test_step_params_layout_is_what_the_kernels_read():
    # the kernels read the step from two empty arrays' shapes (a2ats_step): a[1..7] = kk, c0, c1, counted, S, kept, n
    # and z[1..6] = sinks, w, (b, query position, scale) as float32 bits, chunk; a host/kernel mismatch here would
    # decode silently wrong, and an array with data would hand the GPU a host-written page on every step
    a, z = cuda_decode.step_params(kk=5, c0=8, c1=100, counted=164, S=256, kept=True, n=164, sinks=8, w=64,
                                   b=2048.0, query_pos=163.0, scale=0.125, chunk=512)
    assert a.size == z.size == 0 and a.dtype == z.dtype == mx.int32
    assert a.shape == (0, 5, 8, 100, 164, 256, 1, 164) and z.shape[:3] == (0, 8, 64) and z.shape[6] == 512
    assert np.array(z.shape[3:6], dtype=np.int32).view(np.float32).tolist() == [2048.0, 163.0, 0.125]
    assert max(a.ndim, z.ndim) <= 8   # MLX CUDA passes at most MAX_NDIM = 8 dims of a shape
    for field, at in (("kk", "a[1]"), ("c0", "a[2]"), ("c1", "a[3]"), ("counted", "a[4]"), ("S", "a[5]"),
                      ("kept", "a[6]"), ("n", "a[7]"), ("sinks", "z[1]"), ("w", "z[2]"), ("chunk", "z[6]"),
                      ("b", "z[3]"), ("qpos", "z[4]"), ("scale", "z[5]")):
        assert f"{field}(" in cuda_decode._HEADER and at in cuda_decode._HEADER.split(f"{field}(")[1][:30], field
    for src in (cuda_decode._SELECT_SRC, cuda_decode._SCAN_SRC):
        assert "a2ats_step P(ipa_shape, ipb_shape)" in src   # MLX passes a shape only when the source names it
    kw = dict(kk=5, c0=8, c1=100, counted=164, S=256, kept=True, n=164, sinks=8, w=64, b=2048.0, query_pos=163.0,
              scale=0.125, chunk=512)
    with pytest.raises(ValueError, match="must be >= 0"):
        cuda_decode.step_params(**{**kw, "b": -1.0})
    with pytest.raises(ValueError, match="chunk must be a multiple of 256 up to 2048"):
        cuda_decode.step_params(**{**kw, "chunk": 300})


def test_chunks_fill_the_gpu_and_stay_in_the_shared_token_list():
    # ~TARGET_BLOCKS attend blocks at long contexts, one token list of CHUNK_MAX at most, and never below a round
    # of the block's threads
    assert cuda_decode.chunk_for(262144, 8) == 2048 and -(-262144 // 2048) * 8 == cuda_decode.TARGET_BLOCKS
    assert cuda_decode.chunk_for(10**7, 8) == cuda_decode.CHUNK_MAX
    assert cuda_decode.chunk_for(16384, 8) == 256 and cuda_decode.chunk_for(10, 1) == cuda_decode.ATTEND_THREADS
    assert cuda_decode.chunk_for(65536, 8) == 512


def test_self_check_bound_covers_each_dtype_rounding():
    # the attention bound of the self-check must admit one ulp of the output dtype (both sides round to it) and
    # nothing near a real error: float16 within 2 ulps, bfloat16 within 3 (the H200 check differed by 3.2e-3)
    for name, ulp in (("float32", 2.0 ** -23), ("float16", 2.0 ** -10), ("bfloat16", 2.0 ** -7)):
        assert ulp <= selfcheck.SELF_CHECK_ATTN_REL[name] <= max(2e-3, 1.3 * ulp), name


@pytest.mark.skipif(not ON_CUDA, reason="needs MLX's CUDA backend (the kernels are CUDA source)")
def test_auto_takes_the_cuda_step_where_it_is_usable():
    assert selfcheck.usable()
    assert dispatch.auto_method(10 ** 6, G=4, d=128, dv=128, K=4096) == "cuda"
    assert dispatch.auto_method(10 ** 6, G=4, d=80, dv=80, K=4096) == "sortfree"


def test_decode_profile_brackets_one_step_and_reads_ncu_csv(tmp_path):
    from a2ats_ref.bench import decode_profile

    info = decode_profile.profile_step("sortfree", 1024, "float32")
    assert info["T"] == 1024 and info["method"] == "sortfree" and info["graph_build_ms_median"] > 0
    csv = tmp_path / "s.csv"
    head = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    row = lambda i, k, u, v: f'"{i}","1","python3","h","{k}","1","7","(256, 1, 1)","(8, 8, 1)","0","9.0","S",' \
                             f'"gpu__time_duration.sum","{u}","{v}"\n'
    csv.write_text(head + row(0, "a2ats_lut", "nsecond", "20,480") + row(1, "a2ats_attend", "usecond", "99.5"))
    text = decode_profile.summarize(str(csv))
    assert "20.5 us  a2ats_lut" in text and "99.5 us  a2ats_attend" in text and "total 120.0 us over 2 kernels" in text
    (tmp_path / "empty.csv").write_text("==PROF== nothing\n")
    with pytest.raises(ValueError, match="no ncu CSV rows"):
        decode_profile.summarize(str(tmp_path / "empty.csv"))


def test_decode_profile_parts_times_the_cuda_step_or_says_where_it_runs():
    from a2ats_ref.bench import decode_profile

    if not ON_CUDA:
        with pytest.raises(SystemExit, match="MLX's CUDA backend"):
            decode_profile.parts(1024, "float32")
        return
    got = decode_profile.parts(1024, "float16", reps=3)["median_ms"]
    assert set(got) >= {"dense", "cuda step", "cuda step, parameter array reused", "select (LUT, levels)",
                        "attend (scan, attention, merge)", "mask (the scan alone)"}
    assert all(v > 0 for v in got.values()), got


def test_decode_profile_first_use_times_each_shapes_compilation_or_says_where_it_runs(tmp_path, monkeypatch):
    from a2ats_ref.bench import decode_profile
    from a2ats_ref.runtime.decode import precompiled

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))   # count what this call keeps, not what the machine has
    monkeypatch.setattr(precompiled, "_CUBINS", {})

    if not ON_CUDA:
        with pytest.raises(SystemExit, match="MLX's CUDA backend"):
            decode_profile.first_use("float16")
        return
    got = decode_profile.first_use("float16", shapes=((1, 1, 64, 64), (2, 1, 128, 128)), T=1024)
    assert [(r["G"], r["d"]) for r in got["shapes"]] == [(1, 64), (2, 128)]
    assert all(r["first_s"] > 0 and r["second_s"] > 0 for r in got["shapes"]), got
    assert got["mlx_jit_files_of_these_kernels"] is None or got["mlx_jit_files_of_these_kernels"] >= 0
    assert got["launcher"] == ("kept cubins" if precompiled.enabled() else "MLX JIT")
    assert got["kept_cubins"] >= (4 if precompiled.enabled() else 0)   # select and attend of each shape


def test_decode_profile_host_build_times_each_launcher_anywhere_and_restores_the_decode_path():
    from a2ats_ref.bench import decode_profile
    from a2ats_ref.runtime.decode import cuda as cd
    from a2ats_ref.runtime.decode import precompiled

    before = (cd.on_cuda, cd.mlx_launch, precompiled.cubin, mx.fast.precompiled_cuda_kernel)
    shape = dict(n_q=4, n_kv=2, d=64, K=64, layers=2)
    got = decode_profile.host_build(512, "float32", steps=3, rounds=2, shape=shape)
    assert set(got["host_us_per_layer"]) == {"MLX JIT", "kept cubins"}
    assert all(v > 0 for v in got["host_us_per_layer"].values()), got
    # each launcher ran every step of its rounds: 2 layers x (select, attend) x (3 steps + 2 warm-up) x 2 rounds
    assert got["launches"] == {"MLX JIT": 2 * 2 * 5 * 2, "kept cubins": 2 * 2 * 5 * 2}, got
    assert (cd.on_cuda, cd.mlx_launch, precompiled.cubin, mx.fast.precompiled_cuda_kernel) == before


def test_decode_profile_pipelined_keeps_one_step_in_flight_and_times_both():
    from a2ats_ref.bench import decode_profile

    calls = []

    def fn():
        calls.append(mx.array(float(len(calls))) + 1)
        return calls[-1]
    assert decode_profile._pipelined_ms(fn, 4) > 0
    assert len(calls) == 5 and [float(c.item()) for c in calls] == [1.0, 2.0, 3.0, 4.0, 5.0]   # one build per step
    got = decode_profile.pipelined(1024, "float32", "sortfree", steps=2, blocks=2)
    assert got["dense_ms"] > 0 and got["a2ats_ms"] > 0 and got["speedup"] > 0 and got["method"] == "sortfree"
    with pytest.raises(SystemExit):
        decode_profile.main(["--pipelined", "--method", "dense", "--T", "1024"])


# --------------------------------------------------------------------------- the suite's MLX process settings
def _child_jit_cache(env):
    code = ("import os; from a2ats_conformance.harness.suite_env import pin_suite_process; pin_suite_process(); "
            "d = os.environ['MLX_PTX_CACHE_DIR']; print(d, os.environ.get('A2ATS_PTX_CACHE_OWNER'), os.getpid(), "
            "os.path.isdir(d), os.environ['MLX_ENABLE_TF32'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_every_suite_process_gets_a_jit_cache_of_its_own():
    # MLX CUDA's JIT shares one PTX directory between processes and writes it unlocked: a worker can load a kernel
    # another is still writing. This process (conftest) and a child that inherits its
    # environment, as xdist and the conformance CLI's workers do, each get their own directory.
    from a2ats_conformance.harness.suite_env import OWNER

    mine = os.environ["MLX_PTX_CACHE_DIR"]
    assert os.environ[OWNER] == str(os.getpid()) and os.path.isdir(mine)
    d, owner, pid, existed, tf32 = _child_jit_cache(dict(os.environ))
    assert d != mine and owner == pid and existed == "True" and tf32 == "0"
    assert not os.path.exists(d)   # removed when the child exits
    # a directory the user chose (no owner tag) is kept, as is a TF32 setting
    user = {k: v for k, v in os.environ.items() if k != OWNER}
    d, owner, _, _, tf32 = _child_jit_cache(dict(user, MLX_PTX_CACHE_DIR=mine, MLX_ENABLE_TF32="1"))
    assert d == mine and owner == "None" and tf32 == "1"


def test_a_child_starts_with_the_modules_that_earlier_children_compiled(tmp_path):
    # One directory per process would make every conformance subprocess compile every kernel again (minutes of
    # a GPU test run). A child publishes its modules to the pool when it exits; the next one starts
    # with them, and a file MLX never reads (a .cu, a half-copied ".part-") does not travel. The children share a
    # pool of this test's own: on a GPU the run's pool holds real modules.
    from a2ats_conformance.harness.suite_env import POOL, POOL_OWNER

    writes = ("import os, pathlib; from a2ats_conformance.harness.suite_env import pin_suite_process; pin_suite_process(); "
              "d = pathlib.Path(os.environ['MLX_PTX_CACHE_DIR']); (d / 'n').mkdir(); "
              "[(d / f).write_text(f) for f in ('m1.ptx', 'm1.txt', 'm1.cu', 'n/m2.ptx', 'n/m2.txt', '.part-x')]")
    reads = ("import os, pathlib; from a2ats_conformance.harness.suite_env import pin_suite_process; pin_suite_process(); "
             "d = pathlib.Path(os.environ['MLX_PTX_CACHE_DIR']); "
             "print(sorted(str(p.relative_to(d)) + '=' + p.read_text() for p in d.rglob('*') if p.is_file()))")
    env = dict(os.environ, **{POOL: str(tmp_path), POOL_OWNER: "1"})
    subprocess.run([sys.executable, "-c", writes], env=env, check=True)
    seen = subprocess.run([sys.executable, "-c", reads], env=env, capture_output=True, text=True, check=True).stdout
    assert seen.strip() == str(["m1.ptx=m1.ptx", "m1.txt=m1.txt", "n/m2.ptx=n/m2.ptx", "n/m2.txt=n/m2.txt"])
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["m1.ptx", "m1.txt", "m2.ptx", "m2.txt", "n"]


def test_a_module_enters_the_pool_names_first(tmp_path, monkeypatch):
    # MLX reads a module once its .ptx exists, then its kernel names from the .txt: a .ptx renamed into the pool
    # before its .txt could be read with no names, the same broken load as a half-written file.
    from a2ats_conformance.harness import suite_env

    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "n").mkdir(parents=True)
    for f in ("a.ptx", "a.txt", "n/b.ptx", "n/b.txt"):
        (src / f).write_text(f)
    order = []
    place = suite_env._place
    monkeypatch.setattr(suite_env, "_place", lambda s, d: (order.append(d.relative_to(dst).as_posix()), place(s, d)))
    assert suite_env.copy_modules(src, dst) == 2
    assert sorted(order) == ["a.ptx", "a.txt", "n/b.ptx", "n/b.txt"]
    assert order.index("a.txt") < order.index("a.ptx") and order.index("n/b.txt") < order.index("n/b.ptx")
    assert suite_env.copy_modules(src, dst) == 0   # what the pool has is not copied again
    assert not list(dst.rglob(".part-*"))


def test_between_tests_a_worker_shares_what_it_compiled_and_takes_what_others_did(tmp_path, monkeypatch):
    # conftest calls exchange() after every test: the pytest workers live until the run ends, and each would
    # otherwise compile every kernel the others already had.
    from a2ats_conformance.harness import suite_env

    mine, pool = tmp_path / "mine", tmp_path / "pool"
    mine.mkdir(), pool.mkdir()
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(mine))
    monkeypatch.setenv(suite_env.POOL, str(pool))
    for d, name in ((mine, "compiled-here"), (pool, "compiled-elsewhere")):
        for ext in (".txt", ".ptx"):
            (d / (name + ext)).write_text(name + ext)
    suite_env.exchange()
    for d in (mine, pool):
        assert sorted(p.name for p in d.iterdir()) == ["compiled-elsewhere.ptx", "compiled-elsewhere.txt",
                                                       "compiled-here.ptx", "compiled-here.txt"]
    assert (mine / "compiled-elsewhere.ptx").read_text() == "compiled-elsewhere.ptx"
    # another process's directory (a user's, or an inherited one) is left alone
    monkeypatch.setenv(suite_env.OWNER, "1")
    (mine / "late.txt").write_text(""), (mine / "late.ptx").write_text("")
    suite_env.exchange()
    assert not (pool / "late.ptx").exists()


def test_on_an_nvidia_gpu_the_pool_outlives_the_run(tmp_path, monkeypatch):
    # The ~60 modules MLX compiles for the suite on a GPU cost each cold process about a minute: the pool is kept
    # under the user's cache, one folder per MLX version and GPU model (a module is machine code for one GPU, built
    # by one MLX). Without an NVIDIA GPU no CUDA module is built, and the pool stays a temporary one.
    from a2ats_conformance.harness import suite_env

    gpus = tmp_path / "gpus"
    for bus, model in (("0000:01:00.0", "NVIDIA H100 80GB HBM3"), ("0000:02:00.0", "NVIDIA H100 80GB HBM3")):
        (gpus / bus).mkdir(parents=True)
        (gpus / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t 42\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert suite_env.gpu_models(str(gpus)) == ["NVIDIA H100 80GB HBM3"]
    kept = Path(suite_env.persistent_pool(str(gpus)))
    assert kept.is_dir() and kept.parent == tmp_path / "cache" / "a2ats-ref" / "mlx-jit"
    assert kept.name == f"mlx-{importlib.metadata.version('mlx')}-NVIDIA-H100-80GB-HBM3"
    assert suite_env.persistent_pool(str(tmp_path / "none")) is None
    # a process whose parent made no pool takes the kept one, and marks no owner to remove it
    monkeypatch.setattr(suite_env, "NVIDIA_GPUS", str(gpus))
    for var in (suite_env.POOL, suite_env.POOL_OWNER, suite_env.OWNER, "MLX_PTX_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    suite_env.pin_suite_process()
    assert os.environ[suite_env.POOL] == str(kept) and suite_env.POOL_OWNER not in os.environ
    assert Path(os.environ["MLX_PTX_CACHE_DIR"]).is_dir() and os.environ[suite_env.OWNER] == str(os.getpid())
