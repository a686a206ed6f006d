"""Example of a port answering the golden vectors (conformance/VECTORS.md) with NumPy only.

    python answer_vectors.py VECTORS_DIR ANSWERS_DIR [--dtype float32|float64]
    a2ats-conformance grade VECTORS_DIR ANSWERS_DIR

This is what a port in C++, CUDA or Rust does, written in Python so that it can be read in one sitting: read
``manifest.json``, load every input ``.npy``, call the port, write one ``.npy`` per output, named
``<case id>.<output name>.npy`` (``<case id>.error`` when the port rejects a call). The port here is the
independent NumPy port next to this file (numpy_port.py); the script imports nothing else but NumPy and the
standard library (no a2ats_ref, a2ats_spec or a2ats_conformance), so a port author can copy its structure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy_port  # noqa: E402  (the file next to this one, not the installed package)

FORMAT = "a2ats-golden-vectors/2"


def load(vectors_dir: str):
    with open(os.path.join(vectors_dir, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise SystemExit(f"{vectors_dir}: expected {FORMAT} vectors, got {manifest.get('format')!r}")

    def value(entry, dtype):
        """A manifest argument -> its value; float arrays in the dtype the port computes in."""
        if "array" in entry:
            a = np.load(os.path.join(vectors_dir, entry["array"]), allow_pickle=False)
            return a.astype(dtype) if a.dtype.kind == "f" else a
        if "dtype" in entry:
            return np.dtype(entry["dtype"])
        return entry["value"]

    return manifest, value


def save(path: str, x) -> None:
    if isinstance(x, (np.dtype, type)):
        x = np.zeros((), np.dtype(x))        # a dtype answer: a 0-d array of that dtype
    np.save(path, np.asarray(x), allow_pickle=False)


def answer_call(case, value, dtype, out_dir):
    fn = getattr(numpy_port.PORT, case["function"])
    args = [value(a, dtype) for a in case["args"]]
    kwargs = {k: value(v, dtype if k != "inv_freqs" else np.float64) for k, v in case["kwargs"].items()}
    try:
        got = fn(*args, **kwargs)
    except ValueError as exc:                # the port rejects the input (INPUT-ERRORS)
        with open(os.path.join(out_dir, f"{case['id']}.error"), "w", encoding="utf-8") as f:
            f.write(f"{exc}\n")
        return
    outs = got if isinstance(got, tuple) else (got,)
    for entry, x in zip(case["outputs"], outs):
        save(os.path.join(out_dir, f"{case['id']}.{entry['name']}.npy"), x)


def answer_trace(trace, value, dtype, out_dir, tmp):
    config = {k: value(v, dtype) for k, v in trace["config"].items()}
    cache = numpy_port.NumpyCache(config)          # config "batch": B -> arrays with a leading batch axis
    for n, step in enumerate(trace["steps"]):
        op, res = step["op"], {}
        if op == "append":
            cache.append(value(step["keys"], dtype), value(step["values"], dtype))
        elif op == "decode":
            res["out"], res["mask"] = cache.decode(value(step["q"], dtype))
        elif op == "prefill":
            res["out"] = cache.prefill(value(step["q"], dtype))
        elif op == "trim":
            res["trimmed"] = np.int64(cache.trim(step["n"]["value"]))
        elif op == "save_load":
            path = os.path.join(tmp, f"{trace['id']}.{n}")
            cache.save(path)
            cache = cache.load(path)
        if op in ("append", "trim", "save_load"):
            res["codes"], res["offset"] = cache.codes(), np.int64(cache.offset)
        for what, x in res.items():
            save(os.path.join(out_dir, f"{trace['id']}.{n:03d}.{what}.npy"), x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("vectors_dir")
    p.add_argument("answers_dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    a = p.parse_args(argv)
    manifest, value = load(a.vectors_dir)
    dtype = np.dtype(a.dtype)
    os.makedirs(a.answers_dir, exist_ok=True)
    with open(os.path.join(a.answers_dir, "answers.json"), "w", encoding="utf-8") as f:
        json.dump({"name": numpy_port.PORT.name, "version": numpy_port.PORT.version, "dtype": a.dtype}, f)
    for case in manifest["calls"]:
        answer_call(case, value, dtype, a.answers_dir)
    with tempfile.TemporaryDirectory() as tmp:
        for trace in manifest["traces"]:
            answer_trace(trace, value, dtype, a.answers_dir, tmp)
    print(f"answered {len(manifest['calls'])} calls and {len(manifest['traces'])} traces in {a.answers_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
