"""The adapter protocol: how a port of A2ATS is plugged into the conformance suite.

An adapter is any object (a class instance, a module, a SimpleNamespace) with:

metadata
    ``name: str``, ``version: str``, ``dtypes: tuple[str, ...]`` -- the input dtypes the port
    supports, from ("float64", "float32", "float16", "bfloat16"); the first one is the default
    dtype of a run.

one callable per clause, named exactly as the functions of ``a2ats_spec.oracle``
    rope_inv_freqs, rope_apply, rope_invert, query_moment, wrope_scores, far_keys, far_query,
    score_error, assign, cholesky, z_transform, assign_z, kmeanspp_init, lloyd_step, kmeans,
    back_transform, lut_scores, token_scores, topk_count, select_tokens, retrieval_attention,
    decode_step, prefill_attention, code_dtype; optionally collection_attention (PREFILL's test of a
    calibration's collection attention).
    Same signatures as the oracle (see spec/SPEC.md).  Arguments and results are NumPy arrays
    (plain Python numbers and bools for scalar parameters; tuples for multiple results).
    Array inputs arrive in the dtype under test; results may be any float dtype (the suite
    compares in float64) except codes, which must have the dtype ``code_dtype(K)`` names.
    For dtype "bfloat16" (not a NumPy dtype) arrays arrive as float32 holding exactly
    bfloat16-representable values; the suite sets ``adapter.input_dtype`` to the dtype under
    test before each property, so the adapter can cast them.  Bad input must raise ``ValueError`` (INPUT-ERRORS).

optional cache factory (the CACHE-* clauses)
    ``make_cache(config: dict) -> cache``; config holds n_kv_heads, n_q_heads, head_dim, Cz
    (n_kv, K, d) z-space codebooks, L (n_kv, d, d), C (n_kv, K, d) key space, inv_freqs,
    traditional, w, b, sinks, topk, scale.  The cache has ``append(keys_post, values)``,
    ``decode(q_post) -> (out, mask)``, ``prefill(q_post) -> out``, ``trim(n) -> int``,
    ``codes()``, ``positions()``, ``keys_values()``, ``offset``, ``save(path)`` and
    ``load(path) -> cache``.  README-ADAPTER.md has the full contract.

A missing callable marks only the clauses that need it "not-implemented"; every other clause
still runs.  ``load_adapter("package.module:object")`` loads an adapter; ``object`` may be an
instance, a module, or a class (instantiated without arguments); ``package.module`` alone uses the
module itself as the adapter.
"""

from __future__ import annotations

import importlib
import inspect
import os
from types import ModuleType

from a2ats_conformance.harness.capabilities import AdapterError
from a2ats_conformance.harness.capabilities import read as read_capabilities
from a2ats_conformance.harness.tolerances import TOLERANCES

__all__ = [
    "CLAUSE_FUNCTIONS",
    "FUNCTION_NAMES",
    "AdapterError",
    "NotImplementedByIUT",
    "DEFAULT_IUT",
    "ORACLE_IUT",
    "load_adapter",
    "resolve_iut_spec",
    "describe",
    "has_function",
    "get_function",
    "get_member",
]

DEFAULT_IUT = "a2ats_conformance.adapters.reference:ReferenceAdapter"
ORACLE_IUT = "a2ats_conformance.adapters.oracle:OracleAdapter"
ENV_VAR = "A2ATS_IUT"

#: Which adapter callables a clause needs (a test needs the union over the clauses it cites,
#: unless its marker says ``needs=(...)``).
CLAUSE_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "ROPE-FREQ": ("rope_inv_freqs",),
    "ROPE-APPLY": ("rope_apply",),
    "ROPE-INVERSE": ("rope_invert",),
    "EQ-10": ("query_moment",),
    "EQ-11": ("wrope_scores",),
    "EQ-12": ("far_keys", "far_query"),
    "EQ-13": ("score_error",),
    "EQ-14": ("assign",),
    "EQ-15": ("cholesky",),
    "EQ-16": ("z_transform", "assign_z"),
    "EQ-17-INIT": ("kmeanspp_init",),
    "EQ-17-STEP": ("lloyd_step",),
    "EQ-17-FIT": ("kmeans",),
    "EQ-18": ("back_transform",),
    "RET-LUT": ("lut_scores", "token_scores"),
    "RET-TOPK": ("topk_count",),
    "RET-SELECT": ("select_tokens",),
    "RET-ATTN": ("retrieval_attention",),
    "RET-DECODE": ("decode_step",),
    "PREFILL": ("prefill_attention",),
    "CODES-DTYPE": ("code_dtype",),
    "INPUT-ERRORS": (),
}
CACHE_FUNCTIONS = ("make_cache",)

#: Callables a clause's further tests need beyond CLAUSE_FUNCTIONS (those tests cite them with ``needs=``): a
#: port without one reads not-implemented on those tests only, and its clause verdict says "partial".
OPTIONAL_FUNCTIONS: tuple[str, ...] = ("collection_attention",)   # PREFILL: calibration's collection attention

FUNCTION_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys([f for fs in CLAUSE_FUNCTIONS.values() for f in fs] + list(OPTIONAL_FUNCTIONS))
)


class NotImplementedByIUT(Exception):
    """Raised when a property needs a callable the adapter (or a member its cache) does not provide."""

    def __init__(self, name: str, owner: str = "adapter"):
        what = "callable" if owner == "adapter" else "member"
        super().__init__(f"not-implemented: the {owner} has no {what} {name!r}")
        self.name = name


def resolve_iut_spec(spec: str | None = None) -> str:
    """The IUT import path: explicit ``spec``, else $A2ATS_IUT, else the MLX reference adapter."""
    if spec is not None:
        if not isinstance(spec, str) or not spec.strip():
            raise AdapterError(f"IUT: --iut {spec!r} is empty; give 'package.module:object', or leave --iut out "
                               "to test the MLX reference")
        return spec.strip()
    if ENV_VAR in os.environ:
        if not os.environ[ENV_VAR].strip():
            raise AdapterError(f"IUT: ${ENV_VAR} is set but empty; give 'package.module:object', or unset it to "
                               "test the MLX reference")
        return os.environ[ENV_VAR].strip()
    return DEFAULT_IUT


def load_adapter(spec: str | None = None):
    """Load ``module:object`` (or ``module``) and check the metadata; raises AdapterError."""
    spec = resolve_iut_spec(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise AdapterError(f"IUT: expected 'package.module:object', got {spec!r}")
    mod_name, _, obj_name = spec.strip().partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise AdapterError(
            f"IUT {spec!r}: cannot import module {mod_name!r} ({exc}). Give an importable module path, "
            f"e.g. --iut mypkg.a2ats_adapter:Adapter or A2ATS_IUT=mypkg.a2ats_adapter:Adapter"
        ) from exc
    obj: object = mod
    if obj_name:
        for part in obj_name.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                names = sorted(n for n in dir(mod) if not n.startswith("_"))[:20]
                raise AdapterError(
                    f"IUT {spec!r}: module {mod_name!r} has no attribute {obj_name!r}; it defines {names}"
                ) from exc
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise AdapterError(f"IUT {spec!r}: instantiating {obj_name}() failed: {exc!r}") from exc
    check_metadata(obj, spec)
    return obj


def check_metadata(adapter, spec: str = "<adapter>") -> None:
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name:
        raise AdapterError(f"IUT {spec!r}: adapter needs a non-empty str attribute 'name', got {name!r}")
    version = getattr(adapter, "version", None)
    if not isinstance(version, str):
        raise AdapterError(f"IUT {spec!r}: adapter needs a str attribute 'version', got {version!r}")
    dtypes = getattr(adapter, "dtypes", None)
    if isinstance(dtypes, str) or not isinstance(dtypes, (tuple, list)) or not dtypes:
        raise AdapterError(
            f"IUT {spec!r}: adapter needs 'dtypes', a non-empty tuple such as ('float32',), got {dtypes!r}"
        )
    bad = [d for d in dtypes if d not in TOLERANCES]
    if bad:
        raise AdapterError(f"IUT {spec!r}: unknown dtypes {bad}; supported: {sorted(TOLERANCES)}")
    read_capabilities(adapter, spec)   # a malformed capabilities declaration is a load error, not a run of false verdicts
    if not any(callable(getattr(adapter, f, None)) for f in FUNCTION_NAMES + CACHE_FUNCTIONS):
        raise AdapterError(
            f"IUT {spec!r}: adapter implements none of the clause callables {list(FUNCTION_NAMES)}"
        )


def has_function(adapter, name: str) -> bool:
    return callable(getattr(adapter, name, None))


def get_function(adapter, name: str):
    fn = getattr(adapter, name, None)
    if not callable(fn):
        raise NotImplementedByIUT(name)
    return fn


def get_member(cache, name: str):
    """``getattr(cache, name)``, but a member the cache does not define raises NotImplementedByIUT (the
    clause reads not-implemented), while an AttributeError raised inside a defined member stays a failure."""

    try:
        return getattr(cache, name)
    except AttributeError:
        try:
            inspect.getattr_static(cache, name)
        except AttributeError:
            raise NotImplementedByIUT(name, owner="cache") from None
        raise


def describe(adapter, spec: str = "") -> dict:
    """The report header: which implementation was tested."""
    implemented = [f for f in FUNCTION_NAMES + CACHE_FUNCTIONS if has_function(adapter, f)]
    return {
        "iut": spec,
        "name": adapter.name,
        "version": adapter.version,
        "dtypes": list(adapter.dtypes),
        "module": adapter.__name__ if isinstance(adapter, ModuleType) else type(adapter).__module__,
        "implemented": implemented,
        "missing": [f for f in FUNCTION_NAMES + CACHE_FUNCTIONS if f not in implemented],
        "capabilities": read_capabilities(adapter, spec).as_dict(),
    }
