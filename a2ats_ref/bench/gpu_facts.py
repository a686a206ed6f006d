"""PRECISION, EQ-12 on the device — the device facts README's GPU section quotes, measured on this machine.

    python -m a2ats_ref.bench.gpu_facts [--json F]

Prints (and writes as JSON) for the default MLX device: whether float32 matmuls are TF32 and the
relative error of a plain float32 matmul and of precision.mm; the largest de-rotation error, over
positions up to 131,072, of undoing mlx-lm's RoPE by m * inv_freqs and by the device's own angles
(rope.applied_cos_sin); and whether two k-means fits are bitwise equal. No timing.
"""

from __future__ import annotations

import argparse
import json

from a2ats_ref import _blas

_blas.preload()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from a2ats_ref import precision, rope  # noqa: E402
from a2ats_ref.eq17_kmeans import kmeans  # noqa: E402


def _matmul_errors() -> dict:
    r = np.random.default_rng(0)
    a, b = r.standard_normal((512, 128)).astype(np.float32), r.standard_normal((128, 512)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.max(np.abs(exact))
    plain = np.array(mx.array(a) @ mx.array(b))
    split = np.array(precision.mm(mx.array(a), mx.array(b)))
    return {"tf32_active": precision.tf32_active(),
            "plain_matmul_rel_err": float(np.max(np.abs(plain - exact)) / scale),
            "precision_mm_rel_err": float(np.max(np.abs(split - exact)) / scale)}


def _derotation_errors() -> dict:
    pos = np.unique(np.concatenate([np.arange(0, 131073, 4096), [90000, 131071, 131072]]))
    out = {}
    for name, module in (("base", nn.RoPE(128, traditional=False, base=500000.0)),
                         ("base_traditional", nn.RoPE(128, traditional=True, base=10000.0))):
        x = mx.array(np.random.default_rng(1).standard_normal((len(pos), 1, 1, 128)).astype(np.float32))
        y = mx.concatenate([module(x[i : i + 1], offset=int(p)) for i, p in enumerate(pos)])[:, 0, 0]
        inv, trad = rope.rope_params_from_module(module)
        formula = rope.rotate_unchecked(y, mx.array(pos.astype(np.float32)), inv, trad, -1.0)
        c, s = rope.applied_cos_sin(mx.array(pos), 128, trad, rope.fast_rope_args(module))
        tables = rope.rotate_by_tables(y, c, s, trad, -1.0)
        out[name] = {"max_abs_err_m_times_inv_freqs": float(mx.max(mx.abs(formula - x[:, 0, 0])).item()),
                     "max_abs_err_device_angles": float(mx.max(mx.abs(tables - x[:, 0, 0])).item())}
    return out


def _kmeans_repeatable() -> bool:
    z = mx.array(np.random.default_rng(2).standard_normal((20000, 64)).astype(np.float32))
    a, b = kmeans(z, 512, seed=0, max_iter=6), kmeans(z, 512, seed=0, max_iter=6)
    return bool(np.array_equal(np.array(a[0]), np.array(b[0])) and np.array_equal(np.array(a[1]), np.array(b[1])))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m a2ats_ref.bench.gpu_facts", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the facts here")
    args = ap.parse_args(argv)
    facts = {"device": str(mx.default_device()), "mlx": mx.__version__, "matmul": _matmul_errors(),
             "derotation_to_131072": _derotation_errors(), "kmeans_bitwise_repeatable": _kmeans_repeatable()}
    text = json.dumps(facts, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
