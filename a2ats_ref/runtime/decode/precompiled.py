"""RET-DECODE on CUDA, compiled once per machine: the decode kernels of ``runtime.decode.cuda`` built by NVRTC here,
kept on disk, and run through MLX's ``mx.fast.precompiled_cuda_kernel``.

MLX 0.32 keeps what ``mx.fast.cuda_kernel`` compiles in memory only, so every process compiles each kernel instance
it uses again (``runtime.decode.cuda`` says what that costs). ``launch`` takes what ``cuda.mlx_launch`` takes and
runs the same kernel bodies:

- the source is the one MLX would build, with the signature written here: ``extern "C"``, one pointer per input
  and output in the spec's order, then the shape of each input the body reads (``<name>_shape``) as int
  arguments by value, which the body reads back from a local array of that name. An input whose only content is
  its shape (the step's empty parameter arrays) goes as its shape alone;
- NVRTC compiles it as MLX does (``--gpu-architecture=sm_<major><minor>`` and the CUDA include folder, no other
  option), so the machine code is the same;
- the cubin is kept under the user's cache folder, named by a digest of the source, the options and the NVRTC
  version, and written atomically: a later process, or another worker, loads it without compiling.

What it costs and saves, side by side with the JIT path (an H100, float16):
- per step, host time: MLX copies and hashes a precompiled kernel's bytes at every launch, and a cubin (19-69 KB
  here) is larger than the source ``mx.fast.cuda_kernel`` hashes (7-14 KB); this module's own per-launch Python
  adds about 18 us per layer (``decode_profile --host-build``, which leaves MLX's own launch work out of both).
  ``decode_profile --parts`` at 64K, alternating: a step of 0.222 and 0.224 ms here against 0.196 and 0.197 ms
  through the JIT path; SmolLM2 end to end at 32K (``a2ats-bench speed --only e2e --e2e-ctx 32768``, alternating):
  0.78x and 0.80x dense here against 0.89x and 0.92x, 134-146 against 109-116 us of A2ATS attention per layer;
- per process: a head shape's first step takes 0.001-0.24 s once its cubins are kept, against 2.4-3.5 s of
  compiling through ``mx.fast.cuda_kernel``. The conformance suite at ci on 15 workers took 52 s warm this way,
  and 70 s, then 61 s, through MLX's JIT, whose modules the suite's pool (``a2ats_conformance.harness.suite_env``)
  keeps across processes; so the suite runs the default launcher, the one a user gets.

So MLX's JIT is the default, and a process that meets many head shapes briefly may keep the cubins instead.
``A2ATS_PRECOMPILED_KERNELS=auto`` takes this path wherever NVRTC and the CUDA headers are found (``available``;
MLX's CUDA wheel brings both), ``=1`` insists on it (a missing NVRTC is then an error at the first launch, not a
silent fallback), and ``=0`` or unset runs the kernels through ``mx.fast.cuda_kernel``.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from a2ats_ref.runtime.decode import cuda as cuda_decode

#: 0 or unset: run the decode kernels through mx.fast.cuda_kernel; 1: through this module, or fail; auto: this
#: module where available()
ENV = "A2ATS_PRECOMPILED_KERNELS"
#: C type of each MLX dtype a kernel argument can have
CTYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint8: "unsigned char",
          mx.uint16: "unsigned short", mx.int32: "int", mx.uint32: "unsigned int", mx.bool_: "bool"}


def enabled() -> bool:
    """Whether the decode kernels run from kept cubins (see ENV)."""
    asked = os.environ.get(ENV, "")
    if asked not in ("", "0", "1", "auto"):
        raise ValueError(f"{ENV}={asked!r}: set it to 0 or leave it unset (MLX's JIT, the fastest step), 1 (kept "
                         "cubins) or auto (kept cubins where NVRTC is found)")
    return asked == "1" or (asked == "auto" and available())


@lru_cache(maxsize=None)
def available() -> bool:
    """NVRTC, the CUDA headers and a CUDA driver are all here."""
    try:
        nvrtc(), cuda_include(), compute_capability()
    except (RuntimeError, OSError):
        return False
    return True


#: what launcher() calls each path: MLX's JIT (``mx.fast.cuda_kernel``), or this module's kept cubins
JIT, KEPT = "MLX JIT", "kept cubins"


def launcher() -> str:
    """The name of the launcher the decode step takes (default_launch), as benches and results pages state it."""
    return KEPT if enabled() else JIT


def default_launch():
    """The launcher the decode step and its self-check use: this module's where enabled(), else MLX's JIT."""
    return launch if enabled() else cuda_decode.mlx_launch


def _cuda_home() -> str:
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def _site_dirs() -> list[str]:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]


@lru_cache(maxsize=None)
def nvrtc() -> ctypes.CDLL:
    """libnvrtc: the one beside MLX's CUDA libraries (site-packages/nvidia/cuda_nvrtc), else the CUDA toolkit's."""
    found = [lib for root in _site_dirs()
             for lib in sorted(glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
             if "builtins" not in lib and ".alt." not in lib]
    home = _cuda_home()
    found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    for lib in found:
        try:
            return ctypes.CDLL(lib)
        except OSError:
            continue
    raise RuntimeError(f"kept CUDA kernels need libnvrtc: none beside MLX (site-packages/nvidia/cuda_nvrtc) or in {home}/lib64")


@lru_cache(maxsize=None)
def cuda_include() -> str:
    """The folder with cuda_fp16.h that NVRTC compiles against: the CUDA toolkit's (as MLX uses), else the pip
    package's."""
    home = _cuda_home()
    dirs = [os.path.join(home, "include")] + [os.path.join(r, "nvidia", "cuda_runtime", "include") for r in _site_dirs()]
    for d in dirs:
        if os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            return d
    raise RuntimeError(f"kept CUDA kernels need the CUDA headers (cuda_fp16.h): none in {dirs}; set {ENV}=0 to "
                       "compile them with MLX's JIT instead")


@lru_cache(maxsize=None)
def compute_capability() -> tuple[int, int]:
    """(major, minor) of CUDA device 0, from the driver (MLX's Python API names no device index: on a machine with
    unlike GPUs the kept cubins would be built for device 0's architecture)."""
    cu = ctypes.CDLL("libcuda.so.1")
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for call in (lambda: cu.cuInit(0), lambda: cu.cuDeviceGet(ctypes.byref(dev), 0),
                 lambda: cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev),    # ..._COMPUTE_CAPABILITY_MAJOR
                 lambda: cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)):   # ..._COMPUTE_CAPABILITY_MINOR
        if call() != 0:
            raise RuntimeError("the CUDA driver did not report device 0's compute capability")
    return major.value, minor.value


def _check(lib, result: int, prog=None) -> None:
    if result == 0:
        return
    log = ""
    if prog is not None:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(result).decode()}\n{log}")


def compile_cubin(source: str, name: str, arch: tuple[int, int], include: str) -> bytes:
    """The cubin NVRTC makes of ``source`` for sm_<arch>, with MLX's options."""
    return _compile(source, name, arch, include)[0]


def resources(source: str, name: str, arch: tuple[int, int], include: str) -> dict:
    """What the kernel in ``source`` uses per thread and block once compiled as compile_cubin compiles it (ptxas's
    report): registers, static shared memory bytes, spill store and load bytes."""
    return ptxas_resources(_compile(source, name, arch, include, ("--ptxas-options=-v",))[1])


def ptxas_resources(log: str) -> dict:
    """registers, smem, spill_stores and spill_loads from a ptxas -v report (0 where it names none)."""
    def grab(pattern: str) -> int:
        found = re.findall(pattern, log)
        return max(map(int, found)) if found else 0
    if not re.search(r"Used \d+ registers", log):
        raise RuntimeError(f"NVRTC gave no ptxas resource report:\n{log}")
    return {"registers": grab(r"Used (\d+) registers"), "smem": grab(r"(\d+) bytes smem"),
            "spill_stores": grab(r"(\d+) bytes spill stores"), "spill_loads": grab(r"(\d+) bytes spill loads")}


def _compile(source: str, name: str, arch: tuple[int, int], include: str, extra=()) -> tuple[bytes, str]:
    """(cubin, NVRTC's log) of ``source`` for sm_<arch> with MLX's options and ``extra`` ones."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None))
    try:
        opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode(), f"--include-path={include}".encode(),
                *(o.encode() for o in extra)]
        _check(lib, lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)), prog)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, buf))
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        return buf.raw, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "a2ats-ref" / "cuda-kernels"


def source_for(kernel: str, spec: dict) -> tuple[str, str, list, list]:
    """(symbol, full CUDA source, scalar arguments, pointer inputs) of one instance of ``kernel`` for a launch
    spec. The source depends only on the dtypes, ranks and template (``_instance``, built once per process); the
    scalars are this launch's shapes."""
    inputs = spec["inputs"]
    # runs on every launch: one pass over the inputs, list comprehensions (cheaper than generators here)
    layout = tuple([(x.dtype, x.ndim, x.size == 0) for x in inputs])
    symbol, source, shaped, pointers = _instance(kernel, layout, tuple(spec["output_dtypes"]),
                                                 tuple(spec.get("template", ())))
    return symbol, source, [v for i in shaped for v in inputs[i].shape], [inputs[i] for i in pointers]


@lru_cache(maxsize=None)
def _instance(kernel: str, layout: tuple, output_dtypes: tuple, template: tuple) -> tuple[str, str, tuple, tuple]:
    """(symbol, source, indices of the inputs whose shapes go as scalars, indices of the inputs passed as
    pointers: the non-empty ones) of one kernel instance."""
    in_names, out_names, body = cuda_decode.KERNELS[kernel]
    # MLX passes a precompiled kernel its inputs' pointers, then its outputs', then the scalars, in that order
    args, shape_args, locals_, shaped = [], [], [], []
    for i, (name, (dtype, ndim, empty)) in enumerate(zip(in_names, layout)):
        if not empty:
            args.append(f"const {CTYPES[dtype]}* __restrict__ {name}")
        if f"{name}_shape" in body:
            dims = [f"{name}_s{k}" for k in range(ndim)]
            shape_args += [f"int {d}" for d in dims]
            locals_.append(f"const int {name}_shape[{max(1, ndim)}] = {{{', '.join(dims) or '0'}}};")
            shaped.append(i)
    args += [f"{CTYPES[dt]}* __restrict__ {name}" for name, dt in zip(out_names, output_dtypes)]
    args += shape_args
    consts = [f"using {n} = {CTYPES[v]};" if isinstance(v, mx.Dtype) else f"constexpr int {n} = {int(v)};"
              for n, v in template]
    text = "\n".join(["extern \"C\" __global__ void KERNEL(", ",\n".join(f"    {a}" for a in args) + ") {",
                      *(f"  {c}" for c in consts + locals_), body, "}"])
    head = cuda_decode._HEADER
    digest = hashlib.sha256("\0".join([head, text, repr(compute_capability()), nvrtc_version()]).encode()).hexdigest()
    symbol = f"a2ats_{kernel}_{digest[:20]}"
    pointers = tuple(i for i, (_, _, empty) in enumerate(layout) if not empty)
    return symbol, head + "\n" + text.replace("KERNEL(", f"{symbol}(", 1), tuple(shaped), pointers


def cubin(symbol: str, source: str) -> bytes:
    """The kept cubin of ``symbol``, compiled and written if this machine has none. The file holds the cubin's
    SHA-256 before it: a file that does not match (a torn or flipped copy) is compiled again and replaced, never
    loaded, since a changed instruction would run without an error."""
    path = cache_dir() / f"{symbol}.cubin"
    try:
        kept = path.read_bytes()
        if hashlib.sha256(kept[32:]).digest() == kept[:32]:
            return kept[32:]
    except OSError:
        pass
    data = compile_cubin(source, symbol, compute_capability(), cuda_include())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(data).digest() + data)
        os.replace(tmp, path)   # whole or absent: another process reads the old file or this one
    except OSError:
        pass   # an unwritable cache folder: this process keeps its cubin in memory, the next compiles again
    return data


_CUBINS: dict = {}


def launch(name: str, **spec) -> list:
    """Run kernel ``name`` as cuda.mlx_launch does, through a kept cubin (see the module docstring)."""
    symbol, source, scalars, inputs = source_for(name, spec)
    data = _CUBINS.get(symbol)
    if data is None:
        data = _CUBINS[symbol] = cubin(symbol, source)
    return mx.fast.precompiled_cuda_kernel(
        name=symbol, compiled_source=data, inputs=inputs, output_shapes=spec["output_shapes"],
        output_dtypes=spec["output_dtypes"], scalars=scalars, grid=spec["grid"], threadgroup=spec["threadgroup"],
        init_value=spec.get("init_value"), ensure_row_contiguous=True)


launch.shapes_by_value = True   # cuda.step_params gives it StepShape tuples: no MLX op per step for the numbers
