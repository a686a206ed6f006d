"""a2ats-ref: the MLX reference implementation of A2ATS (arXiv 2502.12665).

Clauses live in spec/SPEC.md (installed as ``a2ats_spec``); each module here opens with the
clause it implements. The BLAS preload must run before anything imports ``mlx.core``, which is
why it is the first statement of the package (see ``a2ats_ref/_blas.py``; opt out with
``A2ATS_NO_FAST_BLAS=1``).
"""

from . import _blas

_blas.preload()

from importlib.metadata import version as _version  # noqa: E402  (after the preload, on purpose)

__version__ = _version("a2ats-ref")  # pyproject.toml is the one place the version is written
