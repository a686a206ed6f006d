"""A launcher for cuda_decode that runs the kernels' CUDA sources on the host (tests/gpu/cuda_host_shim.hpp).

`emulate` takes what `cuda_decode.mlx_launch` takes. It writes the inputs to files, compiles the kernel once per
template instance with AddressSanitizer (g++ -std=c++20), runs it, and reads the outputs back as MLX arrays. So
`selfcheck.compare_parts(..., launch=emulate)` checks the kernels' indices and logic against the portable step
on any machine with g++. It does not check the GPU's memory model, timing or compiler.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from a2ats_ref.runtime.decode import cuda as cuda_decode
from a2ats_ref.runtime.decode import selfcheck

HERE = Path(__file__).resolve().parent
#: C++ type of each MLX dtype the kernels see
CTYPE = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint8: "uint8_t",
         mx.uint16: "uint16_t", mx.int32: "int32_t"}
_BITS = {mx.float16: mx.uint16, mx.bfloat16: mx.uint16}   # read and written as raw bits
_BUILD = Path(tempfile.gettempdir()) / "a2ats-cuda-emu"
#: undefined behaviour stops the run like an out-of-bounds access does
FLAGS = ["-std=c++20", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
         "-fno-omit-frame-pointer", "-pthread", "-w"]


@lru_cache(maxsize=None)
def available() -> bool:
    """Whether g++ builds a C++20 program with <barrier>, threads and both sanitizers here (checked once)."""
    if shutil.which("g++") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text("#include <barrier>\n#include <thread>\nint main() { std::barrier b(1); "
                       "std::thread t([&] { b.arrive_and_wait(); }); t.join(); }\n")
        ok = subprocess.run(["g++", "-std=c++20", "-fsanitize=address,undefined", "-pthread", "-o",
                             str(Path(d) / "probe"), str(src)], capture_output=True).returncode == 0
        return ok and subprocess.run([str(Path(d) / "probe")], capture_output=True).returncode == 0


def _program(name: str, in_types, out_types, template) -> str:
    ins, outs, src = cuda_decode.KERNELS[name]
    tparams = ", ".join(("typename " if isinstance(v, mx.Dtype) else "int ") + k for k, v in template)
    targs = ", ".join(CTYPE[v] if isinstance(v, mx.Dtype) else str(int(v)) for _, v in template)
    params = [f"const {t}* {n}, cuda::std::array<int32_t, 8> {n}_shape" for n, t in zip(ins, in_types)]
    params += [f"{t}* {n}" for n, t in zip(outs, out_types)]
    args = [f"({t}*)bufs[{i}], shapes[{i}]" for i, t in enumerate(in_types)]
    args += [f"({t}*)bufs[{len(ins) + j}]" for j, t in enumerate(out_types)]
    return f"""#include "cuda_host_shim.hpp"
#include <cstdio>
#include <fstream>
#include <new>
#include <string>
{cuda_decode._HEADER}
template <{tparams}>
void kernel({", ".join(params)}) {{
{src}
}}
int main(int argc, char** argv) {{
    const std::string dir = argv[1];
    std::ifstream meta(dir + "/meta.txt");
    unsigned gx, gy, bx;
    int init;
    meta >> gx >> gy >> bx >> init;
    const int n_in = {len(ins)}, n_all = {len(ins) + len(outs)};
    std::vector<void*> bufs(n_all, nullptr);
    std::vector<long> bytes(n_all);
    std::vector<std::array<int32_t, 8>> shapes(n_in);
    for (int i = 0; i < n_all; ++i) {{
        meta >> bytes[i];
        if (i < n_in) for (auto& s : shapes[i]) meta >> s;
        if (bytes[i] == 0) continue;
        bufs[i] = ::operator new(bytes[i], std::align_val_t(64));   // exact size: ASan sees one byte past it
        if (i < n_in) {{ std::ifstream f(dir + "/in" + std::to_string(i), std::ios::binary); f.read((char*)bufs[i], bytes[i]); }}
        else std::memset(bufs[i], init ? 0 : 0xA5, bytes[i]);   // not zeroed unless asked: like MLX's outputs
    }}
    a2ats_launch({{gx, gy, 1}}, {{bx, 1, 1}}, [&] {{ kernel<{targs}>({", ".join(args)}); }});
    for (int j = n_in; j < n_all; ++j)
        if (bytes[j]) {{ std::ofstream f(dir + "/out" + std::to_string(j - n_in), std::ios::binary); f.write((char*)bufs[j], bytes[j]); }}
    return 0;
}}
"""


def _binary(code: str) -> Path:
    shim = (HERE / "cuda_host_shim.hpp").read_text()
    key = hashlib.sha256((code + shim + " ".join(FLAGS)).encode()).hexdigest()[:20]
    exe = _BUILD / f"k{key}"
    if not exe.exists():
        # per-process file names, then an atomic rename: concurrent test workers never read a half-written file
        inc = _BUILD / f"include{os.getpid()}"
        inc.mkdir(parents=True, exist_ok=True)
        for h in ("cuda_fp16.h", "cuda_bf16.h"):   # the header's includes: the shim defines both types
            (inc / h).write_text("#pragma once\n")
        cpp = inc / f"k{key}.cpp"
        cpp.write_text(code)
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        subprocess.run(["g++", *FLAGS, f"-I{HERE}", f"-I{inc}", "-o", str(tmp), str(cpp)], check=True,
                       capture_output=True)
        os.replace(tmp, exe)   # atomic: concurrent test workers never run a half-written binary
    return exe


def emulate(name: str, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value=None) -> list:
    """cuda_decode's launch hook, on the host: the outputs of kernel `name` as MLX arrays."""
    if init_value not in (None, 0):
        raise ValueError(f"the host emulator zero-fills outputs only, got init_value={init_value}")
    mx.eval(*inputs)
    code = _program(name, [CTYPE[x.dtype] for x in inputs], [CTYPE[d] for d in output_dtypes], template)
    exe = _binary(code)
    with tempfile.TemporaryDirectory() as d:
        meta = [f"{-(-grid[0] // threadgroup[0])} {grid[1]} {threadgroup[0]} {int(init_value is not None)}"]
        for i, x in enumerate(inputs):
            a = np.array(x.view(_BITS.get(x.dtype, x.dtype)) if x.size else np.zeros(0, np.uint8))
            (Path(d) / f"in{i}").write_bytes(a.tobytes())
            meta.append(" ".join(map(str, [a.nbytes, *(list(x.shape) + [0] * 8)[:8]])))
        for shape, dt in zip(output_shapes, output_dtypes):
            meta.append(str(int(np.prod(shape)) * dt.size))
        (Path(d) / "meta.txt").write_text("\n".join(meta) + "\n")
        run = subprocess.run([str(exe), d], capture_output=True, text=True,
                             env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0"))
        if run.returncode:
            raise RuntimeError(f"kernel {name} failed on the host emulator (rc {run.returncode}):\n{run.stderr[-4000:]}")
        outs = []
        for j, (shape, dt) in enumerate(zip(output_shapes, output_dtypes)):
            raw = np.frombuffer((Path(d) / f"out{j}").read_bytes(), dtype=np.uint8)
            bits = _BITS.get(dt, dt)
            arr = mx.array(raw.view({mx.uint16: np.uint16, mx.float32: np.float32, mx.uint8: np.uint8,
                                     mx.int32: np.int32}[bits]).reshape(shape))
            outs.append(arr.view(dt) if dt in _BITS else arr)
        return outs
