"""The cache reads like mlx-lm's KVCache: a short class whose methods are the protocol, the A2ATS work in named
functions of modules by concern, and one codebook type for users."""

from __future__ import annotations

import inspect
import warnings

from a2ats_ref.runtime import cache, codebook

#: most source lines of the A2ATSCache class body: past it, a piece of A2ATS work belongs in its module
MAX_CLASS_LINES = 160


def test_the_cache_class_stays_short():
    lines, _ = inspect.getsourcelines(cache.A2ATSCache)
    assert len(lines) <= MAX_CLASS_LINES, f"A2ATSCache is {len(lines)} lines; move the work to runtime.coding, " \
                                          "runtime.buffers or runtime.decode.step"


def test_the_cache_speaks_mlx_lms_protocol():
    for name in ("update_and_fetch", "state", "meta_state", "trim", "is_trimmable", "make_mask", "nbytes",
                 "from_state", "merge", "size", "empty"):
        assert name in vars(cache.A2ATSCache), name


def test_one_public_codebook_type():
    import a2ats_ref

    public = {n for n in dir(a2ats_ref) if "odebook" in n and isinstance(getattr(a2ats_ref, n, None), type)}
    assert a2ats_ref.Codebook is codebook.Codebook and public <= {"Codebook"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the random codebook's wiring-test warning
        cb = cache.random_codebook(1, 1, 4, 8)
    assert type(cb) is codebook.Codebook and type(cb.layer(0)) is codebook.CodebookLayer


def test_old_codebook_names_still_import_with_a_warning():
    for old, new in (("A2ATSCodebook", codebook.Codebook), ("LayerCodebook", codebook.CodebookLayer)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = getattr(cache, old)
        assert got is new, old
        assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in seen), old
