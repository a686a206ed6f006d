"""a2ats-ref: the MLX reference implementation of A2ATS (arXiv 2502.12665).

Clauses live in spec/SPEC.md (installed as ``a2ats_spec``); each module opens with the clause it implements.
The equations sit at the top (``eq10_query_moment`` … ``eq18_back_transform``, ``rope``, ``retrieval``,
``prefill``); ``runtime/`` holds the mlx-lm cache, hook and decode paths, ``files/`` the file formats,
``calibration/`` the offline fit and ``bench/`` the benchmarks.

The BLAS preload must run before anything imports ``mlx.core``, which is why it is the first statement of the
package (``a2ats_ref/_blas.py``; opt out with ``A2ATS_NO_FAST_BLAS=1``).
"""

from a2ats_ref import _blas

_blas.preload()

from importlib.metadata import version as _version  # noqa: E402  (after the preload, on purpose)

from a2ats_ref import _moved  # noqa: E402

_moved.install()

__version__ = _version("a2ats-ref")  # pyproject.toml is the one place the version is written

#: the public API, imported on first use so that ``import a2ats_ref`` stays light (no mlx-lm at import)
_PUBLIC = {
    "A2ATSConfig": "a2ats_ref.runtime.cache",
    "A2ATSCache": "a2ats_ref.runtime.cache",
    "make_a2ats_cache": "a2ats_ref.runtime.cache",
    "random_codebook": "a2ats_ref.runtime.cache",
    "enable_a2ats": "a2ats_ref.runtime.hook",
    "disable_a2ats": "a2ats_ref.runtime.hook",
    "install_a2ats_cache": "a2ats_ref.runtime.hook",
    "Codebook": "a2ats_ref.runtime.codebook",
    "save_a2ats_cache": "a2ats_ref.files.cache",
    "load_a2ats_cache": "a2ats_ref.files.cache",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name):
    if name in _PUBLIC:
        import importlib   # deferred: the runtime imports mlx-lm, which a plain `import a2ats_ref` must not
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'a2ats_ref' has no attribute {name!r}")
