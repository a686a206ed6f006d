"""The golden-vector manifest as the grader reads it (VECTORS.md, "Format"): its format tags, and
``load_vectors``, which checks every entry and every array path of a manifest from others before anything reads
an array (``untrusted`` holds the file checks).
"""

from __future__ import annotations

import os

import numpy as np

from a2ats_spec import oracle as O

from a2ats_conformance.harness.adapter import FUNCTION_NAMES
from a2ats_conformance.harness.capabilities import CHOICES
from a2ats_conformance.harness.tolerances import DTYPES
from a2ats_conformance.vectors.untrusted import (UntrustedFileError, check_npy_header, inside, read_json, read_npy,
                                                 regular_file, safe_name)


_COMPARE = {
    "close": "|actual - expected| <= atol + rtol*|expected|, (rtol, atol) = tolerance[dtype]; same shape",
    "exact": "equal: integers, or the dtype name of a dtype output",
    "allowed": "integer codes c, shape = allowed.shape[:-1]: c is one of allowed[..., :] (padded with -1)",
    "mask": "bool mask M, shape of must: must <= M <= may",
}

FORMAT = "a2ats-golden-vectors/2"
FORMAT_V1 = "a2ats-golden-vectors/1"
GRADED_DTYPES = ("float32", "float64")   # allowed sets are computed at the float32 tie margin
class ManifestError(UntrustedFileError):
    """A vectors manifest that cannot be graded or answered: the message names the file and the entry."""


_OPS = {"append": ("keys", "values"), "decode": ("q",), "prefill": ("q",), "trim": ("n",), "save_load": ()}
_ARRAY_KEYS = ("array", "allowed", "must", "may")
class _Check:
    """Validates a manifest against VECTORS.md before anything is read or written: types, names used as answer
    file names, and every array path (inside the folder, a regular file, a .npy header its length matches)."""

    def __init__(self, vectors_dir: str, path: str, check_arrays: bool):
        self.dir, self.path, self.check_arrays = vectors_dir, path, check_arrays
        self.functions = set(FUNCTION_NAMES)
        self.ids: set[str] = set()
        self.seen: dict[str, None] = {}

    def fail(self, where: str, what: str):
        raise ManifestError(f"{self.path}: {where}: {what} (VECTORS.md describes the format)")

    def typed(self, obj, key, types, where, *, optional=False):
        if not isinstance(obj, dict) or key not in obj:
            if optional and isinstance(obj, dict):
                return None
            self.fail(where, f"missing {key!r}")
        v = obj[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple)
                                                                               else (types,))):
            names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            self.fail(where, f"{key!r} is {type(v).__name__} {str(v)[:60]!r}, expected {names}")
        return v

    def array_path(self, rel, where):
        try:
            real = inside(self.dir, rel, f"{where}: array path")
            if rel not in self.seen:
                self.seen[rel] = None
                regular_file(real, f"{where}: array {rel!r}:", own=True)
                if self.check_arrays:
                    check_npy_header(real, f"{where}: array {rel!r}:", own=True)
        except UntrustedFileError as exc:
            raise ManifestError(f"{self.path}: {exc}") from None

    def value(self, v, where):
        if not isinstance(v, dict) or len(v) != 1 or not {"array", "value", "dtype"} & set(v):
            self.fail(where, f"expected {{\"array\": path}}, {{\"value\": v}} or {{\"dtype\": name}}, got {str(v)[:80]}")
        if "array" in v:
            self.array_path(self.typed(v, "array", str, where), where)
        elif "dtype" in v:
            self.dtype(v, "dtype", where)

    def dtype(self, obj, key, where):
        name = self.typed(obj, key, str, where)
        try:
            ok = np.dtype(name).kind in "biuf"
        except TypeError:
            ok = False
        if not ok:
            self.fail(where, f"{key} {name!r} is not a numeric or bool dtype name")

    def tolerance(self, case, where):
        tol = self.typed(case, "tolerance", dict, where)
        for d in GRADED_DTYPES:
            pair = tol.get(d)
            if not (isinstance(pair, list) and len(pair) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf") for x in pair)):
                self.fail(where, f"tolerance[{d!r}] is {str(pair)[:60]}, expected [rtol, atol], finite and >= 0")

    def requires(self, case, where, *, optional=True):
        req = self.typed(case, "requires", dict, where, optional=optional) or {}
        for k, want in req.items():
            vals = [want] if isinstance(want, str) else want
            if k not in CHOICES or not isinstance(vals, list) or not all(isinstance(x, str) and x in CHOICES[k]
                                                                         for x in vals):
                self.fail(where, f"requires {k!r}: {str(want)[:60]}; known: "
                          f"{ {c: list(v) for c, v in CHOICES.items()} }")

    def case_id(self, case, where):
        cid = self.typed(case, "id", str, where)
        try:
            safe_name(cid, "id")
        except UntrustedFileError as exc:
            self.fail(where, str(exc))
        if cid in self.ids:
            self.fail(where, f"id {cid!r} appears twice")
        self.ids.add(cid)
        return cid

    def outputs(self, ents, where, names: set):
        if not isinstance(ents, list):
            self.fail(where, f"outputs/expect is {type(ents).__name__}, expected a list of output entries")
        for i, ent in enumerate(ents):
            w = f"{where}, output {i}"
            name = self.typed(ent, "name", str, w)
            try:
                safe_name(name, "output name")
            except UntrustedFileError as exc:
                self.fail(w, str(exc))
            if name in names:
                self.fail(w, f"output name {name!r} appears twice")
            names.add(name)
            kind = self.typed(ent, "compare", str, w)
            if kind not in _COMPARE:
                self.fail(w, f"compare {kind!r} is not one of {sorted(_COMPARE)}")
            for k in _ARRAY_KEYS:
                if k in ent:
                    self.array_path(self.typed(ent, k, str, w), w)
            need = {"close": ("array", "shape"), "allowed": ("allowed",), "mask": ("must", "may")}.get(kind, ())
            for k in need:
                if k not in ent:
                    self.fail(w, f"compare {kind!r} needs {k!r}")
            if "shape" in ent:
                shape = self.typed(ent, "shape", list, w)
                if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                    self.fail(w, f"shape {str(shape)[:60]} is not a list of sizes")
            if kind == "exact":
                if "dtype" in ent:
                    self.dtype(ent, "dtype", w)
                elif "value" in ent:
                    self.typed(ent, "value", int, w)
                elif "array" not in ent:
                    self.fail(w, "compare 'exact' needs 'dtype', 'value' or 'array'")
            if "code_dtype" in ent:
                self.dtype(ent, "code_dtype", w)
            if "over_mask" in ent:
                mask = self.typed(ent, "over_mask", str, w)
                if kind != "close" or mask not in {e.get("name") for e in ents if isinstance(e, dict)}:
                    self.fail(w, f"over_mask {mask!r} names no output of this entry (or compare is not 'close')")

    def call(self, i, case):
        where = f"calls[{i}]"
        self.typed(case, "id", str, where)
        where = f"calls[{i}] ({str(case['id'])[:60]})"
        self.case_id(case, where)
        self.typed(case, "clause", str, where)
        self.typed(case, "note", str, where)
        fn = self.typed(case, "function", str, where)
        if fn not in self.functions:
            self.fail(where, f"function {fn[:60]!r} is not a function of the spec's oracle")
        for j, a in enumerate(self.typed(case, "args", list, where)):
            self.value(a, f"{where}, args[{j}]")
        for k, v in self.typed(case, "kwargs", dict, where).items():
            self.value(v, f"{where}, kwargs[{k!r}]")
        if "scale" in case["kwargs"] and not isinstance(case["kwargs"]["scale"].get("value", 0.0),
                                                        (int, float, type(None))):
            self.fail(where, "kwargs['scale'] is not a number or null")
        self.tolerance(case, where)
        self.requires(case, where)
        if "expect" in case and case["expect"] != "ValueError":
            self.fail(where, f"expect {str(case['expect'])[:60]!r}: the only expectation is \"ValueError\"")
        outs = self.typed(case, "outputs", list, where)
        if "expect" not in case and not outs:
            self.fail(where, "no outputs and no \"expect\"")
        self.outputs(outs, where, set())

    def trace(self, i, t):
        where = f"traces[{i}]"
        self.typed(t, "id", str, where)
        where = f"traces[{i}] ({str(t['id'])[:60]})"
        self.case_id(t, where)
        self.typed(t, "clause", str, where)
        self.typed(t, "note", str, where)
        self.requires(t, where, optional=False)
        for k, v in self.typed(t, "config", dict, where).items():
            self.value(v, f"{where}, config[{k!r}]")
        self.tolerance(t, where)
        names: set = set()
        for n, step in enumerate(self.typed(t, "steps", list, where)):
            w = f"{where}, step {n}"
            op = self.typed(step, "op", str, w)
            if op not in _OPS:
                self.fail(w, f"op {op[:60]!r} is not one of {list(_OPS)}")
            for k in _OPS[op]:
                self.value(self.typed(step, k, dict, w), f"{w}, {k}")
            if op == "trim":
                nv = step["n"].get("value")
                if not isinstance(nv, int) or isinstance(nv, bool) or nv < 0:
                    self.fail(w, f"trim n is {str(nv)[:40]!r}, expected a count >= 0")
            self.outputs(self.typed(step, "expect", list, w), w, names)

    def manifest(self, m):
        for key, types in (("calls", list), ("traces", list), ("seed", int), ("size", str), ("spec_version", str),
                           ("spec_sha256", str)):
            self.typed(m, key, types, "the manifest")
        for i, c in enumerate(m["calls"]):
            self.call(i, c)
        for i, t in enumerate(m["traces"]):
            self.trace(i, t)


def load_vectors(vectors_dir: str, *, check_arrays: bool = True):
    """-> (manifest, decode) where decode turns a manifest entry into its value; ValueError (ManifestError) on
    another format or a manifest that is not well-formed (VECTORS.md, "Untrusted files"), before any array is
    read. ``check_arrays``: also check every array's .npy header against its file's length."""
    path = os.path.join(vectors_dir, "manifest.json")
    if not os.path.lexists(path):
        raise ValueError(f"{vectors_dir}: no manifest.json; write vectors with "
                         f"'a2ats-conformance vectors --out {vectors_dir}'")
    try:
        inside(vectors_dir, "manifest.json", "manifest")
        manifest = read_json(path, "manifest", follow=True, own=True)
    except UntrustedFileError as exc:
        raise ManifestError(str(exc)) from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if fmt == FORMAT_V1:
        raise ValueError(f"{vectors_dir}: these are {FORMAT_V1} vectors (stateless calls only, no cache traces); this "
                         f"reader reads {FORMAT}. Regenerate them with 'a2ats-conformance vectors --out DIR'")
    if fmt != FORMAT:
        raise ValueError(f"{vectors_dir}: not {FORMAT} vectors (format {str(fmt)[:80]!r}); regenerate them with "
                         f"'a2ats-conformance vectors --out DIR'")
    _Check(vectors_dir, path, check_arrays).manifest(manifest)

    def dec(v):
        rel = v if isinstance(v, str) else v.get("array")
        if rel is not None:
            real = inside(vectors_dir, rel, "array path")
            return read_npy(real, f"vectors array {rel!r}:", own=True)
        if "dtype" in v:
            return np.dtype(v["dtype"])
        return v["value"]

    return manifest, dec


def answer_names(manifest: dict) -> set[str]:
    """Every file name the answers to ``manifest`` may have (VECTORS.md, "Answers")."""
    names = {"answers.json"}
    for c in manifest["calls"]:
        names.add(f"{c['id']}.error")
        names.update(f"{c['id']}.{e['name']}.npy" for e in c["outputs"])
    for t in manifest["traces"]:
        names.update(f"{t['id']}.{e['name']}.npy" for s in t["steps"] for e in s["expect"])
    return names
