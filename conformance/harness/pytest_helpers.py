"""Per-test context of the conformance suite: calls into the IUT and the oracle, comparisons,
allowed-result checks, and failure messages that carry a repro.

A property receives the ``ctx`` fixture.  ``ctx.call(name, ...)`` calls the IUT (inputs rounded to
the dtype under test and logged), ``ctx.oracle(name, ...)`` calls ``a2ats_spec.oracle`` on the same
rounded values in float64, ``ctx.check(name, ..., clause=...)`` does both and compares.  Every
failure names the clause, the IUT, the dtype, the shapes, the drawn case (seeds included) and a
``python -m a2ats_conformance.diagnosis.repro FILE.npz`` command that replays the failing calls.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile

import numpy as np

from a2ats_spec import oracle as _oracle

from a2ats_conformance.harness import messages as _messages
from a2ats_conformance.harness.adapter import NotImplementedByIUT, get_function
from a2ats_conformance.harness.tolerances import tie_margin, tolerance

__all__ = ["Context", "ConformanceFailure", "round_to_dtype", "default_counterexample_dir", "to_numpy"]

_NP_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.float32}
#: Parameters that are not data: never rounded below float32.
_PARAM_NAMES = {"inv_freqs", "uniforms"}


class ConformanceFailure(AssertionError):
    """A property failed; the message is the full report."""


def default_counterexample_dir() -> str:
    return os.environ.get("A2ATS_COUNTEREXAMPLES") or os.path.join(tempfile.gettempdir(), "a2ats-counterexamples")


def repro_command(path: str, iut_spec: str, prefix: str = "") -> str:
    """One copy-paste line: this interpreter (full path), the saved example, the IUT and the import path
    the IUT needs from a plain shell (``prefix``, e.g. ``PYTHONPATH=/where/the/adapter/lives``)."""
    line = (f"{shlex.quote(sys.executable)} -m a2ats_conformance.diagnosis.repro {shlex.quote(path)} "
            f"--iut {shlex.quote(iut_spec)}")
    return f"{prefix} {line}" if prefix else line


def _round_bf16(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def _atol_text(atol, idx) -> str:
    """An atol for a failure message: a scalar, or a per-entry bound (an error model) at the worst entry."""
    if np.ndim(atol) == 0:
        return f"{float(atol):g}"
    return f"{float(np.broadcast_to(atol, np.shape(atol))[idx]):g} here (per-entry bound)"


def round_to_dtype(x, dtype: str, *, param: bool = False):
    """Round a float array to ``dtype`` (bfloat16 -> float32 holding bfloat16 values). Others pass."""
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        return x
    if param and dtype in ("float16", "bfloat16"):
        dtype = "float32"
    if dtype == "bfloat16":
        return _round_bf16(x)
    return x.astype(_NP_DTYPES[dtype])


def to_numpy(x):
    """IUT results -> NumPy (tuples/lists elementwise); scalars stay scalars."""
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(v) for v in x)
    if isinstance(x, (np.ndarray, np.generic, int, float, bool, type(None), np.dtype, type)):
        return x
    if hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
        return np.asarray(x)
    return x  # e.g. a cache object


def _snapshot(x):
    """A copy of a result that later calls cannot change (cache buffers are views)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, (tuple, list)):
        return type(x)(_snapshot(v) for v in x)
    return x


#: failing examples kept per test for diagnosis: the first few (generation finds them) and the last
#: (Hypothesis's minimal example is replayed last); shrinking in between produces hundreds.
_KEEP_FAILURES = 6


def _describe(x) -> str:
    if isinstance(x, dict):   # e.g. a cache config: arrays by dtype and shape
        return "{" + ", ".join(f"{k}: {_describe(v) if isinstance(v, np.ndarray) and v.size > 8 else v!r}"
                               for k, v in x.items()) + "}"
    if isinstance(x, np.ndarray):
        return f"{x.dtype} {tuple(x.shape)}" if x.size > 8 else f"{x.dtype} {np.array2string(x, precision=6)}"
    return repr(x)


def _jsonable(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


#: callable -> (argument index, the rank of that argument without leading dims): SPEC's "(..., ...)" shapes
_BASE_RANK = {"rope_apply": (0, 2), "rope_invert": (0, 2), "far_keys": (0, 2), "far_query": (0, 2),
              "wrope_scores": (0, 2), "score_error": (0, 1), "assign": (0, 1), "z_transform": (0, 1),
              "assign_z": (0, 1), "lut_scores": (0, 2), "token_scores": (0, 2), "select_tokens": (0, 2),
              "retrieval_attention": (0, 2), "decode_step": (0, 2)}


def _leading_dims(name: str, args: tuple):
    """The leading dims of the call's main array argument beyond its SPEC rank, or None when it has none."""
    if name not in _BASE_RANK:
        return None
    i, rank = _BASE_RANK[name]
    shape = np.shape(args[i]) if len(args) > i and isinstance(args[i], np.ndarray) else ()
    return tuple(shape[:-rank]) if len(shape) > rank else None


class Context:
    """State of one conformance test (shared by all its Hypothesis examples)."""

    _expecting_error = False   # inside expect_value_error: the IUT's exception is the expected answer

    def __init__(self, adapter, *, iut_spec: str, dtype: str, clauses: tuple[str, ...], nodeid: str,
                 counterexample_dir: str | None = None, repro_prefix: str = ""):
        self.iut = adapter
        self.iut_spec = iut_spec
        self.dtype = dtype
        self.clauses = clauses
        self.nodeid = nodeid
        self.counterexample_dir = counterexample_dir or default_counterexample_dir()
        self.repro_prefix = repro_prefix
        self.examples = 0
        self.calls: list[tuple[str, tuple, dict]] = []
        self.outputs: dict[int, object] = {}   # index into calls -> the IUT's result of that call
        self.notes: dict = {}
        self.last_failure: dict | None = None
        #: failing examples seen by this test, (clause, calls, outputs, notes): what diagnosis/diagnose.py reads
        self.failures: list[dict] = []
        self.max_position: int | None = None   # largest RoPE position (or b) of the example; see positions_up_to
        try:   # every property announces its dtype (bfloat16 arrays arrive as float32)
            adapter.input_dtype = dtype
        except AttributeError:
            pass

    # ------------------------------------------------------------------ example bookkeeping
    def begin_example(self) -> None:
        self.examples += 1
        self.calls = []
        self.outputs = {}
        self.notes = {}
        self.max_position = None

    def note(self, **kw) -> None:
        """Record drawn parameters (seeds, shapes) for the failure message."""
        self.notes.update(kw)

    # ------------------------------------------------------------------ calls
    def cast(self, x, *, param: bool = False):
        return round_to_dtype(x, self.dtype, param=param)

    def _prepare(self, args, kwargs):
        a = tuple(self.cast(x) for x in args)
        kw = {k: self.cast(v, param=k in _PARAM_NAMES) for k, v in kwargs.items()}
        return a, kw

    def has(self, name: str) -> bool:
        return callable(getattr(self.iut, name, None))

    def call(self, name: str, *args, **kwargs):
        """Call the IUT's ``name`` on inputs rounded to the dtype under test."""
        fn = get_function(self.iut, name)
        a, kw = self._prepare(args, kwargs)
        return self.logged(name, a, kw, fn)

    def logged(self, name: str, args: tuple, kwargs: dict, fn):
        """Log the call ``name(*args, **kwargs)`` (inputs as given), run ``fn`` on them, log its result."""
        idx = len(self.calls)
        self.calls.append((name, args, kwargs))
        try:
            res = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is a port refusing leading dims
            lead = _leading_dims(name, args)
            if lead is None or self._expecting_error or isinstance(exc, (ConformanceFailure, NotImplementedByIUT)):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            self.fail(self.clauses[0] if self.clauses else "INPUT-ERRORS",
                      f"{name} raised {type(exc).__name__} ({first}) on an input with leading dims {lead}: SPEC "
                      f"gives {name} leading batch dims (...); see README-ADAPTER.md, 'Leading dims'")
        out = to_numpy(res)
        self.outputs[idx] = _snapshot(out)
        return out

    def oracle(self, name: str, *args, **kwargs):
        """The oracle's ``name`` on the same rounded values, in float64."""
        a, kw = self._prepare(args, kwargs)
        up = lambda x: x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype.kind == "f" else x  # noqa: E731
        return getattr(_oracle, name)(*(up(x) for x in a), **{k: up(v) for k, v in kw.items()})

    def check(self, name: str, *args, clause: str, what: str | None = None, **kwargs):
        """IUT vs oracle on the same inputs; returns (actual, expected)."""
        actual = self.call(name, *args, **kwargs)
        expected = self.oracle(name, *args, **kwargs)
        if isinstance(expected, tuple):
            if not isinstance(actual, tuple) or len(actual) != len(expected):
                self.fail(clause, f"{name}: expected a tuple of {len(expected)} results, got {_describe(actual)}")
            for i, (a, e) in enumerate(zip(actual, expected)):
                self.assert_close(a, e, clause=clause, what=f"{what or name} (result {i})")
        else:
            self.assert_close(actual, expected, clause=clause, what=what or name)
        return actual, expected

    def expect_value_error(self, name: str, *args, clause: str = "INPUT-ERRORS", what: str, names=(), **kwargs) -> str:
        """The IUT must reject this input with ValueError, whose message names one of ``names`` (the argument to
        fix) when given; returns the message."""
        try:
            self._expecting_error = True
            out = self.call(name, *args, **kwargs)
        except ValueError as exc:
            if names:
                self.require_named(str(exc), names, f"{name}: {what}", clause=clause)
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - any other type is the failure being reported
            self.fail(clause, f"{name}: {what} must raise ValueError, raised {type(exc).__name__}: {exc}")
        finally:
            self._expecting_error = False
        self.fail(clause, f"{name}: {what} must raise ValueError, but the call returned {_describe(out)}")

    def require_named(self, msg: str, names, what: str, *, clause: str = "INPUT-ERRORS") -> None:
        """A ValueError message must name the argument to fix: ``names``, one name or any of several."""
        names = (names,) if isinstance(names, str) else tuple(names)
        if not any(n in msg for n in names):
            self.fail(clause, f"{what}: the ValueError must name the argument "
                      f"{' or '.join(repr(n) for n in names)}, got: {msg!r}")

    # ------------------------------------------------------------------ assertions
    def positions_up_to(self, max_position) -> None:
        """Declare the example's largest RoPE position (or b): past the tolerance table's bound, the
        position-dependent tolerances (tolerances.tolerance) grow with it."""
        self.max_position = int(max_position)
        self.note(max_position=self.max_position)

    def tol(self, clause: str) -> tuple[float, float]:
        return tolerance(self.dtype, clause, self.max_position)

    def margin(self, clause: str, values) -> float:
        """Tie margin for ranking ``values`` (oracle outputs): relative to their magnitude."""
        scale = float(np.max(np.abs(values))) if np.size(values) else 1.0
        return tie_margin(self.dtype, clause, self.max_position) * max(1.0, scale)

    def assert_close(self, actual, expected, *, clause: str, what: str, rtol=None, atol=None) -> None:
        r, a = self.tol(clause)
        r = r if rtol is None else rtol
        a = a if atol is None else atol
        exp = np.asarray(expected, dtype=np.float64)
        try:
            act = np.asarray(actual, dtype=np.float64)
        except (TypeError, ValueError):
            self.fail(clause, f"{what}: result is not a numeric array: {_describe(actual)}")
        if act.shape != exp.shape:
            self.fail(clause, f"{what}: shape {act.shape} != expected {exp.shape}")
        if not np.all(np.isfinite(act)):
            self.fail(clause, f"{what}: result has non-finite entries at {np.argwhere(~np.isfinite(act))[:5].tolist()}")
        bound = a + r * np.abs(exp)
        diff = np.abs(act - exp)
        bad = diff > bound
        if np.any(bad):
            idx = np.unravel_index(int(np.argmax(diff - bound)), diff.shape) if diff.ndim else ()
            self.fail(
                clause,
                f"{what}: {int(bad.sum())} of {bad.size} entries differ beyond tolerance",
                f"worst at index {tuple(int(i) for i in idx)}: actual {act[idx]!r}, expected {exp[idx]!r}, "
                f"|diff| {diff[idx]:.3g} > {bound[idx]:.3g} (rtol={r:g}, atol={_atol_text(a, idx)}); "
                f"max |diff| {diff.max():.3g}",
            )

    def assert_equal(self, actual, expected, *, clause: str, what: str) -> None:
        act, exp = np.asarray(actual), np.asarray(expected)
        if act.shape != exp.shape or not np.array_equal(act, exp):
            where = ""
            if act.shape == exp.shape:
                idx = np.argwhere(act != exp)[:5].tolist()
                where = f"; first differing indices {idx}"
            self.fail(clause, f"{what}: not equal", f"actual {_describe(act)}\nexpected {_describe(exp)}{where}")

    def assert_in_allowed(self, codes, allowed, *, clause: str, what: str, values=None) -> None:
        """codes (...) ints must satisfy allowed[..., codes] (allowed (..., K) bool from the oracle)."""
        c = np.asarray(codes)
        if c.dtype.kind not in "iu":
            self.fail(clause, f"{what}: codes must be integers, got dtype {c.dtype}")
        if c.shape != allowed.shape[:-1]:
            self.fail(clause, f"{what}: codes shape {c.shape} != expected {allowed.shape[:-1]}")
        K = allowed.shape[-1]
        if np.any(c < 0) or np.any(c >= K):
            self.fail(clause, f"{what}: codes out of range [0, {K}): {np.unique(c[(c < 0) | (c >= K)])[:5]}")
        ok = np.take_along_axis(allowed, c[..., None].astype(np.int64), axis=-1)[..., 0]
        if not np.all(ok):
            i = tuple(int(x) for x in np.argwhere(~ok)[0])
            extra = ""
            if values is not None:
                extra = (f"; oracle values at that row: chosen {values[i + (int(c[i]),)]:.6g}, "
                         f"best {np.min(values[i]):.6g} at {int(np.argmin(values[i]))}")
            self.fail(clause, f"{what}: {int((~ok).sum())} code(s) outside the allowed (near-optimal) set",
                      f"first at {i}: got {int(c[i])}, allowed {np.flatnonzero(allowed[i]).tolist()}{extra}")

    def assert_mask_allowed(self, mask, must, may, *, clause: str, what: str, count=None,
                            selection: dict | None = None) -> None:
        """must ⊆ mask ⊆ may. ``selection`` (scores, query_pos, w, sinks, topk; the oracle's scores) makes the
        message list each wrong token with its role, score and margin, and the per-head k."""
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            self.fail(clause, f"{what}: mask must be bool, got {m.dtype}")
        if m.shape != must.shape:
            self.fail(clause, f"{what}: mask shape {m.shape} != expected {must.shape}")
        missing = must & ~m
        extra = m & ~may
        if missing.any() or extra.any():
            if selection is not None:
                details = _messages.explain_selection(m, must, may, **selection)
            else:
                details = (f"missing required tokens at {np.argwhere(missing)[:6].tolist()}; "
                           f"selected forbidden tokens at {np.argwhere(extra)[:6].tolist()}")
            self.fail(clause, f"{what}: {int(missing.sum())} required token(s) missing, {int(extra.sum())} "
                      f"forbidden token(s) selected (allowed-result set)", details)
        if count is not None:
            got = m.sum(axis=-1)
            if np.any(got != count):
                self.fail(clause, f"{what}: wrong number of selected tokens", f"got {got.tolist()}, expected {np.asarray(count).tolist()}")

    # ------------------------------------------------------------------ failure report
    def repro_path(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.nodeid).strip("_")[:150]
        return os.path.join(self.counterexample_dir, f"{safe}.npz")

    def save_counterexample(self) -> str | None:
        """Write the current example's IUT calls to an .npz (no pickle); returns its path."""
        if not self.calls:
            return None
        arrays: dict[str, np.ndarray] = {}
        calls = []
        for ci, (name, args, kwargs) in enumerate(self.calls):
            def enc(v, key):
                if isinstance(v, np.ndarray):
                    arrays[key] = v
                    return {"array": key}
                if isinstance(v, dict) and any(isinstance(x, np.ndarray) for x in v.values()):
                    return {"dict": {str(k): enc(x, f"{key}.{k}") for k, x in v.items()}}
                return {"value": _jsonable(v)}
            calls.append({"fn": name,
                          "args": [enc(v, f"c{ci}_a{i}") for i, v in enumerate(args)],
                          "kwargs": {k: enc(v, f"c{ci}_{k}") for k, v in kwargs.items()}})
        meta = {"format": "a2ats-counterexample/1", "iut": self.iut_spec, "dtype": self.dtype,
                "clauses": list(self.clauses), "test": self.nodeid, "case": _jsonable(self.notes), "calls": calls}
        path = self.repro_path()
        try:
            os.makedirs(self.counterexample_dir, exist_ok=True)
            np.savez(path, __meta__=np.array(json.dumps(meta)), **arrays)
        except OSError:
            return None
        return path

    def repro_command(self, path: str | None) -> str:
        if path is None:
            return "(no IUT call was made before the failure)"
        return repro_command(path, self.iut_spec, self.repro_prefix)

    def _keep_failure(self, clause: str, headline: str) -> None:
        snap = {"clause": clause, "headline": headline, "calls": list(self.calls), "outputs": dict(self.outputs),
                "notes": dict(self.notes)}
        if len(self.failures) > _KEEP_FAILURES:
            self.failures[-1] = snap
        else:
            self.failures.append(snap)

    def fail(self, clause: str, headline: str, details: str = "") -> None:
        self._keep_failure(clause, headline)
        shapes = "; ".join(
            f"{name}(" + ", ".join([_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kw.items()]) + ")"
            for name, args, kw in self.calls[-3:]
        )
        path = self.save_counterexample()
        case = ", ".join(f"{k}={_jsonable(v)!r}" for k, v in self.notes.items() if not isinstance(v, np.ndarray))
        msg = (
            f"error[{clause}]: {headline}\n"
            + (f"  {details}\n" if details else "")
            + f"  note: {_messages.parameter_note(self)}\n"
            + f"  IUT: {getattr(self.iut, 'name', '?')} {getattr(self.iut, 'version', '?')} ({self.iut_spec}), dtype {self.dtype}\n"
            + f"  case: {case or '-'}\n"
            + f"  calls: {shapes or '-'}\n"
            + f"  repro: {self.repro_command(path)}"
        )
        self.last_failure = {"clause": clause, "message": headline, "details": details, "case": _jsonable(self.notes),
                             "npz": path, "repro": self.repro_command(path)}
        raise ConformanceFailure(msg)
