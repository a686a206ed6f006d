"""Module paths that moved into subpackages, kept importable for one minor release with a DeprecationWarning.

The old name is an alias of the new module object itself (not a copy), so attributes set through either name
are seen through both, and ``python -m <old name>`` runs the new module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module path -> the module it now is (SPEC.md, changelog, records the move)
MOVED = {
    "a2ats_ref.authors_checks": "a2ats_ref.bench.authors_checks",
    "a2ats_ref.bench_fidelity": "a2ats_ref.bench.fidelity",
    "a2ats_ref.bench_speed": "a2ats_ref.bench.speed",
    "a2ats_ref.decode_profile": "a2ats_ref.bench.decode_profile",
    "a2ats_ref.gpu_facts": "a2ats_ref.bench.gpu_facts",
    "a2ats_ref.cache": "a2ats_ref.runtime.cache",
    "a2ats_ref.hook": "a2ats_ref.runtime.hook",
    "a2ats_ref.codebook": "a2ats_ref.runtime.codebook",
    "a2ats_ref.fast_decode": "a2ats_ref.runtime.decode.dispatch",
    "a2ats_ref.cuda_decode": "a2ats_ref.runtime.decode.cuda",
    "a2ats_ref.cache_io": "a2ats_ref.files.cache",
    "a2ats_ref.fileio": "a2ats_ref.files.atomic",
    "a2ats_ref.gguf": "a2ats_ref.files.gguf",
    "a2ats_ref.calibrate": "a2ats_ref.calibration.calibrate",
    "a2ats_ref.collect": "a2ats_ref.calibration.collect",
    "a2ats_ref.corpus": "a2ats_ref.calibration.corpus",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moved: dict[str, str]):
        self.moved = moved

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = self.moved[spec.name]
        warnings.warn(f"{spec.name} is deprecated: import {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass   # the new module is already executed

    def get_code(self, fullname):   # for ``python -m <old name>``
        new = self.moved[fullname]
        return importlib.util.find_spec(new).loader.get_code(new)


def alias_finder(moved: dict[str, str]):
    """An ``install()`` that puts one finder for ``moved`` (old path -> new path) on sys.meta_path, once."""
    def install() -> None:
        if not any(isinstance(f, _Alias) and f.moved is moved for f in sys.meta_path):
            sys.meta_path.append(_Alias(moved))
    return install


install = alias_finder(MOVED)
