"""runtime.decode.precompiled on the host: the signature it writes, the NVRTC build where a CUDA compiler library
is installed, and the kept cubins' integrity. Loading and running the cubins needs a GPU (tests/gpu)."""

import hashlib

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref.runtime.decode import cuda as cd
from a2ats_ref.runtime.decode import precompiled as pc


def _specs(shapes_by_value=False):
    """The launch specs one decode step (and its mask) hands a launcher, for a few head shapes and dtypes."""
    specs = []

    def capture(name, **spec):
        specs.append((name, spec))
        return [mx.zeros(s, dtype=d) for s, d in zip(spec["output_shapes"], spec["output_dtypes"])]
    capture.shapes_by_value = shapes_by_value
    for dt, (G, n_kv, d, K) in [(mx.float16, (4, 2, 128, 4096)), (mx.float32, (1, 1, 64, 64)),
                                (mx.bfloat16, (2, 1, 128, 300))]:
        T = 1024
        q, k = mx.zeros((1, G * n_kv, 1, d), dtype=dt), mx.zeros((1, n_kv, T, d), dtype=dt)
        codes = mx.zeros((1, n_kv, T), dtype=mx.uint16 if K > 256 else mx.uint8)
        inv = mx.zeros((d // 2,))
        _, sel, _ = cd.decode(q, k, k, codes, mx.zeros((n_kv, d, K)), inv, counts=mx.zeros((1, n_kv, K), mx.int32),
                              kept=True, kk=30, c0=8, c1=T - 64, counted=T, S=64, n=T, sinks=8, w=64, b=2048.0,
                              query_pos=float(T - 1), scale=0.1, traditional=False, launch=capture)
        sel._replace(launch=capture).mask()
    return specs


@pytest.fixture
def fixed_arch(monkeypatch):
    monkeypatch.setattr(pc, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(pc, "nvrtc_version", lambda: "12.9")
    pc._instance.cache_clear()
    yield
    pc._instance.cache_clear()


@pytest.mark.clause("RET-DECODE")
def test_the_signature_passes_input_pointers_then_outputs_then_shapes(fixed_arch):
    """MLX hands a precompiled kernel its inputs' pointers, its outputs' pointers, then the scalars; the empty
    step-parameter arrays go as their shapes only, and each shape the body reads comes back as an array."""
    specs = _specs()
    assert {n for n, _ in specs} == {"select", "attend", "mask"}
    for name, spec in specs:
        symbol, source, scalars, inputs = pc.source_for(name, spec)
        ins, outs, body = cd.KERNELS[name]
        start = source.index('extern "C"')
        sig = source[start:source.index(") {", start)]
        params = [p.strip() for p in sig.split("(", 1)[1].split(",")]
        pointers = [p.split()[-1] for p in params if "*" in p]
        assert pointers == [n for n, x in zip(ins, spec["inputs"]) if x.size] + outs
        assert all("*" in p for p in params[:len(pointers)]) and not any("*" in p for p in params[len(pointers):])
        read = [(n, x) for n, x in zip(ins, spec["inputs"]) if f"{n}_shape" in body]
        assert scalars == [int(v) for _, x in read for v in x.shape]
        assert [x for x in inputs] == [x for x in spec["inputs"] if x.size]
        for n, x in read:
            assert f"const int {n}_shape[{x.ndim}]" in source
        assert symbol.startswith(f"a2ats_{name}_") and f"void {symbol}(" in source


def test_a_launcher_that_takes_shapes_by_value_gets_no_parameter_arrays(fixed_arch):
    """The same instances and arguments as from the empty arrays, with no MLX op built for the step's numbers."""
    by_array, by_value = _specs(), _specs(shapes_by_value=True)
    assert len(by_array) == len(by_value)
    for (name, a), (_, v) in zip(by_array, by_value):
        assert not any(isinstance(x, cd.StepShape) for x in a["inputs"])
        assert sum(isinstance(x, cd.StepShape) for x in v["inputs"]) == 2
        sa, sv = pc.source_for(name, a), pc.source_for(name, v)
        assert sa[:3] == sv[:3] and len(sa[3]) == len(sv[3])
    assert pc.launch.shapes_by_value and not getattr(cd.mlx_launch, "shapes_by_value", False)


def test_step_numbers_reach_the_launch_as_plain_ints():
    """MLX takes a precompiled kernel's scalars as bool, int or float only: a NumPy count becomes an int, a
    fractional one is refused before any launch."""
    kw = dict(kk=np.int64(30), c0=8, c1=np.int32(1000), counted=1000, S=64, kept=True, n=1064, sinks=8, w=64,
              b=2048.0, query_pos=1063.0, scale=0.1, chunk=256, arrays=False)
    a, z = cd.step_params(**kw)
    assert all(type(v) is int for v in a.shape + z.shape) and a.shape[1] == 30 and a.shape[3] == 1000
    with pytest.raises(TypeError):
        cd.step_params(**{**kw, "kk": 30.5})


@pytest.mark.parametrize("arrays", [True, False])
def test_step_params_are_made_once_per_step_and_thread(arrays):
    """Every layer of a token asks for the same step: the same numbers in one thread get the same parameters back,
    any changed number new ones (a stale step would decode another token's range), another thread its own."""
    import threading
    kw = dict(kk=30, c0=8, c1=1000, counted=1000, S=64, kept=True, n=1064, sinks=8, w=64, b=2048.0,
              query_pos=1063.0, scale=0.1, chunk=256, arrays=arrays)
    first = cd.step_params(**kw)
    assert all(x is y for x, y in zip(cd.step_params(**kw), first))
    shapes = [x.shape for x in first]
    changed = dict(kk=31, c0=7, c1=999, counted=1001, S=65, kept=False, n=1065, sinks=7, w=63, b=2047.0,
                   query_pos=1062.0, scale=0.2, chunk=512)
    for field, value in changed.items():
        assert [x.shape for x in cd.step_params(**{**kw, field: value})] != shapes, field
    assert [x.shape for x in cd.step_params(**kw)] == shapes
    other = []
    worker = threading.Thread(target=lambda: other.append(cd.step_params(**kw)))
    worker.start()
    worker.join()
    assert [x.shape for x in other[0]] == shapes
    assert not arrays or all(x is not y for x, y in zip(other[0], first))


@pytest.mark.clause("RET-DECODE")
def test_launch_hands_mlx_the_instance_its_pointers_and_its_shapes(fixed_arch, monkeypatch):
    """What launch passes mx.fast.precompiled_cuda_kernel is what source_for describes, with the kept cubin (a
    launch that passed an empty array as a pointer, or a shape out of place, would shift every argument after it)."""
    calls, loaded = [], []
    monkeypatch.setattr(pc, "_CUBINS", {})
    monkeypatch.setattr(pc, "cubin", lambda symbol, source: loaded.append(symbol) or f"cubin of {symbol}".encode())
    monkeypatch.setattr(pc.mx.fast, "precompiled_cuda_kernel", lambda **kw: calls.append(kw) or ["out"])
    for name, spec in _specs(shapes_by_value=True):
        symbol, _, scalars, inputs = pc.source_for(name, spec)
        for _ in range(2):
            assert pc.launch(name, **spec) == ["out"]
            got = calls.pop()
            assert got["name"] == symbol and got["compiled_source"] == f"cubin of {symbol}".encode()
            assert got["scalars"] == scalars and all(type(v) is int for v in scalars)
            assert len(got["inputs"]) == len(inputs) and all(a is b for a, b in zip(got["inputs"], inputs))
            assert all(got[k] == spec[k] for k in ("output_shapes", "output_dtypes", "grid", "threadgroup"))
            assert got["init_value"] == spec.get("init_value") and got["ensure_row_contiguous"]
    assert len(loaded) == len(set(loaded))   # each instance's cubin is read or built once per process


def test_an_instance_is_named_by_what_compiles_it(fixed_arch, monkeypatch):
    name, spec = next(s for s in _specs() if s[0] == "select")
    a = pc.source_for(name, spec)[0]
    assert pc.source_for(name, spec)[0] == a
    monkeypatch.setattr(pc, "compute_capability", lambda: (8, 0))
    pc._instance.cache_clear()
    assert pc.source_for(name, spec)[0] != a   # another GPU architecture: another cubin


def _nvrtc_here() -> bool:
    try:
        pc.nvrtc(), pc.cuda_include()
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(not _nvrtc_here(), reason="needs libnvrtc and the CUDA headers (pip: nvidia-cuda-nvrtc-cu12, "
                                             "nvidia-cuda-runtime-cu12)")
@pytest.mark.clause("RET-DECODE")
def test_every_kernel_instance_compiles_with_nvrtc(fixed_arch):
    done = set()
    for name, spec in _specs():
        symbol, source, _, _ = pc.source_for(name, spec)
        if symbol not in done:
            assert len(pc.compile_cubin(source, symbol, (9, 0), pc.cuda_include())) > 1000
            done.add(symbol)
    assert len(done) >= 6


def test_a_kept_cubin_that_does_not_match_its_digest_is_compiled_again(tmp_path, monkeypatch):
    compiled = []

    def fake_compile(source, name, arch, include):
        compiled.append(name)
        return b"CUBIN:" + name.encode() * 40
    monkeypatch.setattr(pc, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(pc, "compile_cubin", fake_compile)
    monkeypatch.setattr(pc, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(pc, "cuda_include", lambda: "/none")
    data = pc.cubin("a2ats_select_x", "src")
    assert compiled == ["a2ats_select_x"]
    path = tmp_path / "a2ats_select_x.cubin"
    assert path.read_bytes() == hashlib.sha256(data).digest() + data
    assert pc.cubin("a2ats_select_x", "src") == data and len(compiled) == 1   # kept: not compiled again
    raw = bytearray(path.read_bytes())
    raw[40] ^= 1
    path.write_bytes(bytes(raw))                                               # a flipped bit
    assert pc.cubin("a2ats_select_x", "src") == data and len(compiled) == 2
    path.write_bytes(path.read_bytes()[:50])                                   # a torn copy
    assert pc.cubin("a2ats_select_x", "src") == data and len(compiled) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".part-")]


@pytest.mark.parametrize("found", [True, False])
def test_the_step_takes_mlx_jit_unless_told_to_keep_cubins(found, monkeypatch):
    """MLX's JIT by default (the faster step on a GPU); auto keeps cubins where NVRTC is found, 1 insists."""
    monkeypatch.setattr(pc, "available", lambda: found)
    monkeypatch.delenv(pc.ENV, raising=False)
    assert pc.default_launch() is cd.mlx_launch
    monkeypatch.setenv(pc.ENV, "0")
    assert pc.default_launch() is cd.mlx_launch
    monkeypatch.setenv(pc.ENV, "auto")
    assert pc.default_launch() is (pc.launch if found else cd.mlx_launch)
    monkeypatch.setenv(pc.ENV, "1")   # insisted on: a missing NVRTC fails at the launch, naming what is missing
    assert pc.default_launch() is pc.launch
    monkeypatch.setenv(pc.ENV, "yes")
    with pytest.raises(ValueError, match=pc.ENV):
        pc.default_launch()


def test_a_suite_process_runs_the_launcher_a_user_gets(monkeypatch):
    """The conformance suite and the tests check the decode path a user runs: pinning their process leaves the
    launcher setting as it was (unset: MLX's JIT), whatever the user chose."""
    from a2ats_conformance.harness import suite_env
    for setting in (None, "0", "auto", "1"):
        if setting is None:
            monkeypatch.delenv(pc.ENV, raising=False)
        else:
            monkeypatch.setenv(pc.ENV, setting)
        suite_env.pin_suite_process()
        assert pc.os.environ.get(pc.ENV) == setting
    monkeypatch.delenv(pc.ENV, raising=False)
    suite_env.pin_suite_process()
    assert pc.default_launch() is cd.mlx_launch


def test_available_says_no_where_nvrtc_is_missing(monkeypatch):
    def missing():
        raise RuntimeError("kept CUDA kernels need libnvrtc")
    pc.available.cache_clear()
    monkeypatch.setattr(pc, "nvrtc", missing)
    try:
        assert pc.available() is False
    finally:
        pc.available.cache_clear()


PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a2ats_attend_x' for 'sm_90'
ptxas info    : Function properties for a2ats_attend_x
    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 18764 bytes smem
"""


def test_ptxas_report_is_read_and_a_missing_one_is_an_error():
    assert pc.ptxas_resources(PTXAS_LOG) == {"registers": 128, "smem": 18764, "spill_stores": 8, "spill_loads": 12}
    with pytest.raises(RuntimeError, match="no ptxas resource report"):
        pc.ptxas_resources("ptxas info    : 0 bytes gmem\n")


@pytest.mark.parametrize("regs, smem, threads, blocks, by", [
    (128, 18764, 256, 2, "registers"),     # 4,096 registers a warp, 8 warps a block: 2 blocks of 65,536
    (54, 23624, 1024, 1, "registers"),     # 54 -> 56 a thread (256 a warp), 32 warps: one block
    (41, 0, 512, 2, "registers"),          # 41 x 32 = 1,312 -> 1,536 a warp: 2 blocks, not 3
    (32, 116000, 128, 1, "smem"),          # 116,000 + 1,024 reserved: one block of 233,472 bytes, not 2
    (16, 0, 1024, 2, "threads"),
    (16, 0, 32, 32, "blocks"),
])
def test_blocks_per_sm_takes_the_tightest_limit(regs, smem, threads, blocks, by):
    from a2ats_ref.bench.decode_profile import blocks_per_sm
    assert blocks_per_sm(regs, smem, threads) == {"blocks_per_sm": blocks, "limited_by": by}


def test_decode_profile_resources_reports_each_kernel_or_names_what_it_needs(monkeypatch, capsys):
    from a2ats_ref.bench import decode_profile
    try:
        pc.nvrtc(), pc.cuda_include()
    except RuntimeError:
        with pytest.raises(SystemExit) as exit_:
            decode_profile.main(["--resources", "--T", "4096"])
        assert exit_.value.code == 2 and "NVRTC" in capsys.readouterr().err
        return
    rows = decode_profile.kernel_resources(65536, "float16", batch=2)
    assert [r["kernel"] for r in rows] == ["select", "attend"]
    for r in rows:
        assert r["registers"] > 0 and r["blocks_per_sm"] >= 1 and r["blocks"] >= 1
        assert r["waves"] == round(r["blocks"] / (r["blocks_per_sm"] * 132), 2)
    assert rows[0]["blocks"] == 2 * 8   # one select block per (sequence, KV head)
