"""The oracle's cache without trim/save/load: undeclared (NoTrim: CACHE-TRIM reads not-implemented) or
declared (DeclaredNoTrim: CACHE-TRIM reads not-applicable)."""

from a2ats_spec.oracle import OracleCache

_KEEP = ("append", "decode", "prefill", "codes", "positions", "keys_values")


class _Cache:
    def __init__(self, inner):
        for m in _KEEP:
            setattr(self, m, getattr(inner, m))
        self._inner = inner

    @property
    def offset(self):
        return self._inner.offset


class NoTrim:
    name, version, dtypes = "no-trim", "0", ("float64",)

    def make_cache(self, config):
        return _Cache(OracleCache(config))


class DeclaredNoTrim(NoTrim):
    capabilities = {"cache_ops": ("append", "decode", "prefill")}


class LossyLoad(NoTrim):
    """The oracle's cache whose load drops the last token: CACHE-SAVE fails, and its counterexample
    records a save/load path that the replay must fill with a fresh folder."""

    def make_cache(self, config):
        cache = OracleCache(config)
        load = cache.load

        def lossy(path):
            c = load(path)
            if c.offset:
                c.trim(1)
            return c
        cache.load = lossy
        return cache
