"""RET-DECODE on MLX's CUDA backend: the whole sort-free decode step in two CUDA kernels.

The selection is the portable sort-free step's (``fast_decode``: RET-SELECT's sets from per-code levels, ties
at a head's threshold taken whole, level-1 tokens first and then level-2 ties, each in index order, cut at S
slots), and so is the attention, except where the S-slot cut binds in a GQA group of G > 1: the kernels cut
the level-2 ties of the whole group in index order, the portable step first ranks the tied tokens each head
needs for its own kk (RET-SELECT's per-head count) with level 1, so there a kernel step can leave a head short
of its count. What changes is the number of launches and the bytes read: the portable step
is ~80 small MLX kernels and its time on an H200 was launch overhead (ncu: 81 kernels, most of 2-3 us), and each
launch through MLX's custom-kernel path still costs ~0.03-0.05 ms of wall time there. So the step is two
kernels, the fewest its one global dependency allows (every token's fate needs each head's threshold, which
needs every code's score):

1. ``select`` (one block of 1,024 threads per (b, kv) row): EQ-12 on the query (undo the angle mlx-lm applied,
   apply b) and the LUT q_b C for every code, in float32 FMAs (no TF32: closer to the oracle than the portable
   step's GEMM under MLX's TF32 default); then the kept code counts corrected by the sinks and the coded window
   tail (as ``fast_decode._candidate_counts``), each query head's kk-th largest candidate score by a radix
   select over the K code scores weighted by their counts (4 passes of 8 bits; T tokens are never sorted), each
   code's level (1 must, 2 tie at a threshold, 0 not) and the level token counts n1, n2;
2. ``attend`` (one block per chunk of tokens and row): the chunk's tokens are scanned against the code levels
   (the forced sinks and window always taken) and compacted in index order in shared memory by warp ballots, so
   no index list goes through memory; their key and value rows are read in place from the cache buffer, 16
   bytes per lane, several rows in flight per warp, with an online softmax per lane group (float32); each block
   leaves a partial (max, sum, weighted V) and the row's last block merges them into the output, in the values'
   dtype. The S-slot cut of level-2 ties only binds when n1 + n2 > S; only then does a block count the level-1
   and level-2 tokens before its chunk, to rank its own.

The ``mask`` kernel is the same scan writing the selected set instead of attending to it: only run when a caller
asks which tokens were selected (``KernelSelection.mask``, the cache's ``last_selection``, the self-check).

Every per-step number (kk, the candidate range, the coded count, the slot count, the token count; b, the query
position and the scale as float32 bits; the chunk length) travels as the shape of an empty array (step_params),
which MLX passes to the kernel by value: decoding never recompiles a kernel and hands the GPU no host-written
memory. Each kernel is compiled per dtype and head shape. Through ``mx.fast.cuda_kernel`` (``mlx_launch``) that
happens in every process: MLX 0.32 keeps no on-disk copy of its modules, and on an H100 the select and attend
instances of a new head shape took 2.4-3.0 s together, the mask kernel 1.2 s. ``runtime.decode.precompiled`` keeps
each instance's cubin on disk instead and compiles it once per machine, at a slower step; it says when each launcher
is taken (``python -m a2ats_ref.bench.decode_profile --first-use`` times the first call per shape).

``fast_decode`` runs this for method="cuda", and "auto" takes it on CUDA when ``usable()``: a once-per-process
self-check that the kernels compile and reproduce the portable parts (the LUT against float64, the selected set
against the portable selection given the same LUT, exactly, and the attention to float32 tolerance). Anything
else (Metal, CPU, shapes outside ``shapes_supported``) runs the portable sort-free step, which the conformance
suite checks on every backend.
"""

from __future__ import annotations

import operator
import struct
from pathlib import Path
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from a2ats_ref.runtime.threads import ThreadState

#: threads per block of the select kernel (one block per row: the radix select needs the whole row's scores)
SELECT_THREADS = 1024
#: warps per block of the attend and mask kernels, and row groups each lane keeps in flight
WARPS, ROWS_IN_FLIGHT = 8, 4
#: threads per block of the attend and mask kernels (NT in their source)
ATTEND_THREADS = WARPS * 32
#: the longest chunk of tokens one attend block scans (its shared token list); chunks are powers of two from
#: ATTEND_THREADS to this, picked per step so a row's chunks fill the GPU (chunk_for)
CHUNK_MAX = 2048
#: attend blocks per step that chunk_for aims at: ~8 per SM of a 132-SM H200, enough to hide the gathers' latency
TARGET_BLOCKS = 1024
#: the head sizes the kernels are taken for: the ones shown to run correctly on an H200 (gate and
#: tests/gpu/test_gpu.py). kernels_fit admits d = 8..256, and the host emulator (tests/gpu/test_cuda_emu.py) runs
#: d = 8 and 256 correctly, but a d = 8 self-check on the GPU can fail to load its kernel and leave the process at an
#: illegal-address error (most likely MLX's shared JIT cache: conformance/harness/suite_env.py). Other head sizes
#: take the portable step until a GPU run shows them clean
RUN_HEAD_DIMS = (32, 64, 128)
#: static shared memory a kernel may use (CUDA's limit without opt-in is 48 KB)
_SHARED_LIMIT = 46 * 1024


def _source(name: str) -> str:
    """A kernel's CUDA source from the package's kernels/ folder (a kernel body for mx.fast.cuda_kernel, or the
    header the bodies share)."""
    return (Path(__file__).with_name("kernels") / name).read_text()


_HEADER = f"#define A2ATS_CHUNK_MAX {CHUNK_MAX}\n" + _source("common.cuh")

# q (B, n_q, 1, D) post-RoPE in the cache dtype; CT (n_kv, D, K) float32; inv, tc, ts (D/2,); counts (B, n_kv, K);
# codes (B, n_kv, T). Row r = b * n_kv + h; its query heads are r * G + g.
_SELECT_SRC = _source("select.cu")

# codes (B, n_kv, T); levels (BH, KS) uint8 (1 must, 2 may, 0 not); nsel (BH, 3): n1, n2, the attend ticket. Block
# (c, r) scans tokens [c * chunk, (c + 1) * chunk) of [0, n) and leaves tok[0, m): the tokens it takes, in index
# order. A candidate j in [c0, c1) of level 1 is taken if fewer than S level-1 tokens precede it, one of level 2
# if n1 plus the level-2 tokens before it are fewer than S (the portable step's slot order: level 1 first, each
# level in index order); the sinks and the window are always taken.
_SCAN_SRC = _source("scan.cuh")

# sel (BH, n) uint8, zeroed by MLX (init_value): 1 on every token the step attends to.
_MASK_SRC = _SCAN_SRC + _source("mask.cu")

# q (B, n_q, 1, D) post-RoPE; keys/values (B, n_kv, T_buf, D). A lane group of D / EPL lanes holds one row, EPL
# elements per lane (one 8-32 byte load); a warp holds 32 / (D / EPL) rows per load and U such loads in flight.
# Each lane group keeps its own online softmax (max, sum, EPL dims of sum p * V per head); the warp merges its
# groups, the block its warps into a partial per (row, block, head): pm max logit, pl sum, pacc (D,) sum p * V.
_ATTEND_SRC = _SCAN_SRC + _source("attend.cu")

def on_cuda() -> bool:
    """True when MLX's default device is a CUDA GPU (not Metal, not the CPU)."""
    return mx.default_device().type != mx.cpu and _cuda_backend()


@lru_cache(maxsize=None)
def _cuda_backend() -> bool:
    """Whether this MLX build's GPU is CUDA (asked once: the decode step checks on_cuda on every token)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and hasattr(mx.fast, "cuda_kernel"))


def lane_elems(d: int, itemsize: int) -> int | None:
    """Elements of a row each lane loads in the attend kernel (EPL): a power of two, at most 16 bytes where one warp
    load covers 2 or 4 rows, 32 where one row takes the whole warp; None if d splits no such way."""
    for rows in (4, 2, 1):   # rows one warp load covers
        lanes = 32 // rows
        epl = d // lanes
        if d % lanes == 0 and epl & (epl - 1) == 0 and epl * itemsize <= (16 if rows > 1 else 32):
            return epl
    return None


@lru_cache(maxsize=None)
def shapes_supported(G: int, d: int, dv: int, K: int = 4096) -> bool:
    """Whether "auto" and method="cuda" take the kernels for this head shape: they fit it (kernels_fit) and d is
    one of RUN_HEAD_DIMS."""
    return d in RUN_HEAD_DIMS and kernels_fit(G, d, dv, K)


@lru_cache(maxsize=None)
def kernels_fit(G: int, d: int, dv: int, K: int = 4096) -> bool:
    """What the kernels can hold: the rotated queries, angles, code counts and G 256-bin histograms in the select
    block's shared memory; the code levels, a chunk's token list, the scaled queries and per-warp partials in the
    attend block's; a row split over lanes in 8-32 byte loads for 2- and 4-byte dtypes; G * EPL accumulators per
    lane; at most one float4 of a row's G * d outputs per thread in the merge."""
    epl = [lane_elems(d, s) for s in (2, 4)]
    return (d == dv and None not in epl and 1 <= G <= 32 and G * max(epl) <= 64 and G * d <= 4 * ATTEND_THREADS
            and 4 * G * d + 8 * d + 4 * K + 4 * 256 * G + 16 * G + 16 <= _SHARED_LIMIT
            and _scan_smem(K, G, d) + 4 * WARPS + 8 + 4 * G * d + 8 * G + 4 <= _SHARED_LIMIT)


def _scan_smem(K: int, G: int = 0, d: int = 0) -> int:
    """Bytes of the attend/mask kernels' shared buffer (SMEM): the code levels and a chunk's token list, which
    the attend kernel then reuses for its warps' partials (max and sum per head, D sums per head) and then for
    the merge's float4 sums (one per thread)."""
    return max(-(-K // 16) * 16 + 4 * CHUNK_MAX, 4 * WARPS * G * (d + 2), 16 * ATTEND_THREADS)


#: each kernel's input names, output names and source (MLX builds the signature from the names and the arrays)
KERNELS = {
    "select": (["q", "CT", "inv", "tc", "ts", "counts", "codes", "ipa", "ipb"], ["lut", "levels", "nsel"], _SELECT_SRC),
    "attend": (["q", "keys", "values", "codes", "levels", "nsel", "ipa", "ipb"], ["pm", "pl", "pacc", "out"], _ATTEND_SRC),
    "mask": (["codes", "levels", "nsel", "ipa", "ipb"], ["sel"], _MASK_SRC),
}


@lru_cache(maxsize=None)
def _kernels():
    return {name: mx.fast.cuda_kernel(name=f"a2ats_{name}", input_names=ins, output_names=outs, source=src,
                                      header=_HEADER)
            for name, (ins, outs, src) in KERNELS.items()}


def mlx_launch(name: str, **spec) -> list:
    """Run kernel `name` through MLX's CUDA custom-kernel path (spec: inputs, output_shapes, output_dtypes, grid,
    threadgroup, template and optionally init_value, as mx.fast.cuda_kernel's call takes them). The functions
    below take another launcher in `launch`; tests/gpu/cuda_emu.py runs the same specs on the host."""
    return _kernels()[name](**spec)


def chunk_for(n: int, BH: int) -> int:
    """Tokens per attend block: the power of two from ATTEND_THREADS to CHUNK_MAX that gives about TARGET_BLOCKS
    blocks for n tokens in BH rows (longer chunks mean fewer partials to merge, shorter ones more blocks to fill
    the GPU with)."""
    chunk = ATTEND_THREADS
    while chunk < CHUNK_MAX and -(-n // chunk) * BH > TARGET_BLOCKS:
        chunk *= 2
    return chunk


class StepShape(NamedTuple):
    """A step-parameter array's shape without the array, for a launcher that passes shapes to the kernel as
    arguments by value (``shapes_by_value``): what step_params gives such a launcher, so no MLX op is built."""

    shape: tuple
    dtype = mx.int32
    size = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)


#: per thread, (the numbers, the parameters) of step_params' last call
_LAST_PARAMS = ThreadState()


def step_params(*, kk: int, c0: int, c1: int, counted: int, S: int, kept: bool, n: int, sinks: int, w: int,
                b: float, query_pos: float, scale: float, chunk: int, arrays: bool = True):
    """The per-step numbers as the kernels read them (a2ats_step): the shapes of two empty int32 arrays, the leading
    0 keeping them empty, and (b, query position, scale) as float32 bits.

    MLX passes an input's shape to a kernel by value. An array with data would be written on the host and read by
    the GPU, and on the H200 that first read cost ~0.15 ms per step (0.59 against 0.44 ms at 256K float16, with
    the same array reused; two device arrays used in turn cost nothing: it is the host-written page, not the
    pointer). Empty arrays have no page.

    Every layer of a model decodes the same step with the same numbers, so each thread keeps its last call's
    result and hands it out again for the same numbers (an MLX array made in one thread fails in another)."""
    key = (kk, c0, c1, counted, S, kept, n, sinks, w, b, query_pos, scale, chunk, arrays)
    last = getattr(_LAST_PARAMS, "last", None)
    if last is not None and last[0] == key:
        return last[1]
    bits = struct.unpack("3i", struct.pack("3f", b, query_pos, scale))
    if min(bits) < 0:
        raise ValueError(f"b, query_pos and scale must be >= 0, got {b}, {query_pos}, {scale}")
    if chunk % ATTEND_THREADS or not ATTEND_THREADS <= chunk <= CHUNK_MAX:
        raise ValueError(f"chunk must be a multiple of {ATTEND_THREADS} up to {CHUNK_MAX}, got {chunk}")
    a, z = (0, kk, c0, c1, counted, S, int(kept), n), (0, sinks, w, *bits, chunk)
    if not arrays:   # plain ints: MLX refuses any other scalar type (a NumPy int included) at the launch
        made = StepShape(tuple(map(operator.index, a))), StepShape(tuple(map(operator.index, z)))
    else:
        empty = mx.array([], dtype=mx.int32)
        made = empty.reshape(*a), empty.reshape(*z)
    _LAST_PARAMS.last = (key, made)
    return made


def select(queries, CT, inv, counts, codes, ip, *, traditional: bool, applied_angle=None, launch=mlx_launch):
    """(lut (BH, G, K) float32, levels (BH, K) uint8, nsel (BH, 3) int32) (kernel 1): scale · q R_{b - applied} · C
    per code; each code's level; the level-1 and level-2 token counts and, zeroed, the attend kernel's ticket.
    counts (B, n_kv, K) and codes (B, n_kv, T) as the cache holds them (no reshape: every op is host time on every
    step)."""
    B, n_q, _, d = queries.shape
    n_kv, K = CT.shape[0], CT.shape[-1]
    G, BH = n_q // n_kv, B * n_kv
    tables = applied_angle is not None
    tc, ts = applied_angle if tables else (inv, inv)
    return launch(
        "select", inputs=[queries, CT, inv, tc, ts, counts, codes, *ip], output_shapes=[(BH, G, K), (BH, K), (BH, 3)],
        output_dtypes=[mx.float32, mx.uint8, mx.int32], grid=(SELECT_THREADS, BH, 1),
        threadgroup=(SELECT_THREADS, 1, 1),
        template=[("T", queries.dtype), ("G", G), ("D", d), ("NKV", n_kv), ("TRAD", int(traditional)),
                  ("TABLES", int(tables)), ("KS", K), ("CodeT", codes.dtype)])


def attend(queries, keys, values, codes, lv, nsel, ip, *, n: int, chunk: int, launch=mlx_launch) -> mx.array:
    """Exact softmax attention over the tokens the step selects in [0, n), (B, n_q, 1, d) (kernel 2): each block
    scans its chunk of tokens, attends to the ones it takes and leaves a partial; each row's last block merges
    them (a ticket in nsel's third column, which select zeroes and the last block resets)."""
    B, n_q, _, d = queries.shape
    n_kv = keys.shape[1]
    BH, G, K = B * n_kv, n_q // n_kv, lv.shape[-1]
    NC = -(-n // chunk)
    *_, out = launch(
        "attend", inputs=[queries, keys, values, codes, lv, nsel, *ip],
        output_shapes=[(BH, NC, G), (BH, NC, G), (BH, NC, G, d), (B, n_q, 1, d)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, values.dtype],
        grid=(NC * ATTEND_THREADS, BH, 1), threadgroup=(ATTEND_THREADS, 1, 1),
        template=[("T", keys.dtype), ("G", G), ("D", d), ("KS", K), ("NW", WARPS), ("SMEM", _scan_smem(K, G, d)),
                  ("EPL", lane_elems(d, keys.dtype.size)), ("U", ROWS_IN_FLIGHT), ("CodeT", codes.dtype)])
    return out


def selection_mask(codes, lv, nsel, ip, *, n: int, chunk: int, launch=mlx_launch) -> mx.array:
    """(BH, n) bool: the tokens attend takes, by the same scan (the mask kernel)."""
    BH, K = lv.shape
    (sel,) = launch(
        "mask", inputs=[codes, lv, nsel, *ip], output_shapes=[(BH, n)], output_dtypes=[mx.uint8],
        grid=(-(-n // chunk) * ATTEND_THREADS, BH, 1), threadgroup=(ATTEND_THREADS, 1, 1), init_value=0,
        template=[("KS", K), ("NW", WARPS), ("SMEM", _scan_smem(K)), ("CodeT", codes.dtype)])
    return sel.astype(mx.bool_)


class KernelSelection(NamedTuple):
    """The token set one CUDA decode step attended to, kept lazily as the scan's inputs (the mask kernel runs only
    when mask() is asked for): the counterpart of fast_decode.Selection."""

    codes: mx.array
    levels: mx.array
    nsel: mx.array
    ip: tuple
    n: int
    chunk: int
    shape: tuple   # (B, n_kv, n_tokens), n_tokens >= n
    launch: object = mlx_launch

    def mask(self) -> mx.array:
        """Bool (B, n_kv, n_tokens): True on every token the step attended to."""
        B, n_kv, n_tokens = self.shape
        m = selection_mask(self.codes, self.levels, self.nsel, self.ip, n=self.n, chunk=self.chunk, launch=self.launch)
        if n_tokens > self.n:
            m = mx.concatenate([m, mx.zeros((B * n_kv, n_tokens - self.n), dtype=mx.bool_)], axis=-1)
        return m.reshape(B, n_kv, n_tokens)


def decode(queries, keys, values, codes, CT, inv, *, counts, kept: bool, kk: int, c0: int, c1: int, counted: int,
           S: int, n: int, sinks: int, w: int, b: float, query_pos: float, scale: float, traditional: bool,
           applied_angle=None, n_tokens: int | None = None, launch=mlx_launch):
    """One sort-free decode step in two kernels: (out (B, n_q, 1, d), KernelSelection, lut (BH, G, K))."""
    B, n_kv = queries.shape[0], CT.shape[0]
    chunk = chunk_for(n, B * n_kv)
    ip = step_params(kk=kk, c0=c0, c1=c1, counted=counted, S=S, kept=kept, n=n, sinks=sinks, w=w, b=b,
                     query_pos=query_pos, scale=scale, chunk=chunk, arrays=not getattr(launch, "shapes_by_value", False))
    table, lv, nsel = select(queries, CT, inv, counts, codes, ip, traditional=traditional, applied_angle=applied_angle,
                             launch=launch)
    out = attend(queries, keys, values, codes, lv, nsel, ip, n=n, chunk=chunk, launch=launch)
    shape = (B, n_kv, n if n_tokens is None else n_tokens)
    return out, KernelSelection(codes, lv, nsel, ip, n, chunk, shape, launch), table

