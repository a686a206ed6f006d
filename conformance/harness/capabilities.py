"""Adapter capabilities (README-ADAPTER.md, "Capabilities"): what a port supports, so that the suite only
draws what it accepts and marks the rest ``not-applicable`` instead of ``fail``.

An adapter may declare ``capabilities = {"topk": ("fraction", "count"), "rope_layouts": ("traditional", "half"),
"randomness": "explicit", "cache_ops": ("append", "decode", "prefill", "trim", "save_load", "batch"),
"rope_scaling": ("complete", "mlx_lm")}``; every
key is optional and a missing key means full support.  ``read(adapter)`` validates the declaration and returns
a frozen ``Capabilities``; ``current()`` is the running IUT's (set by the plugin in every pytest process).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["AdapterError", "Capabilities", "FULL", "CHOICES", "read", "current", "set_current", "unmet"]

class AdapterError(ValueError):
    """The adapter could not be loaded or does not follow the protocol (re-exported by adapter.py)."""


#: Allowed values per key; the order is the default (full support).
CHOICES: dict[str, tuple[str, ...]] = {
    "topk": ("fraction", "count"),
    "rope_layouts": ("traditional", "half"),
    "randomness": ("explicit", "own"),
    "cache_ops": ("append", "decode", "prefill", "trim", "save_load", "batch"),
    # "mlx_lm": rope_inv_freqs reads a rope_scaling dict as mlx-lm does (left-out llama3 keys take ROPE-FREQ's
    # defaults; "type" wins over a disagreeing "rope_type"); a port that reads complete, unambiguous dicts only
    # (transformers indexes every llama3 key and reads "rope_type" first) declares ("complete",)
    "rope_scaling": ("complete", "mlx_lm"),
}
#: Keys whose value is one choice (the others are a non-empty tuple of choices).
_SINGLE = {"randomness"}


@dataclass(frozen=True)
class Capabilities:
    topk: tuple[str, ...] = CHOICES["topk"]
    rope_layouts: tuple[str, ...] = CHOICES["rope_layouts"]
    randomness: str = "explicit"
    cache_ops: tuple[str, ...] = CHOICES["cache_ops"]
    rope_scaling: tuple[str, ...] = CHOICES["rope_scaling"]

    def has(self, key: str, value: str) -> bool:
        got = getattr(self, key)
        return value == got if key in _SINGLE else value in got

    def as_dict(self) -> dict:
        return {f.name: (getattr(self, f.name) if f.name in _SINGLE else list(getattr(self, f.name)))
                for f in fields(self)}

    @property
    def traditional_values(self) -> tuple[bool, ...]:
        """The ``traditional=`` flags the port accepts (True = pairs (x[2i], x[2i+1]))."""
        return tuple(v for v, name in ((True, "traditional"), (False, "half")) if name in self.rope_layouts)


FULL = Capabilities()
_CURRENT: list[Capabilities] = []


def read(adapter, spec: str = "<adapter>") -> Capabilities:
    """Validate ``adapter.capabilities`` (absent: full support); raises AdapterError saying what to fix."""
    decl = getattr(adapter, "capabilities", None)
    if decl is None:
        return FULL
    if not isinstance(decl, dict):
        raise AdapterError(f"IUT {spec!r}: 'capabilities' must be a dict such as {{'topk': ('fraction',)}}, "
                           f"got {type(decl).__name__}")
    unknown = sorted(set(decl) - set(CHOICES))
    if unknown:
        raise AdapterError(f"IUT {spec!r}: unknown capability key(s) {unknown}; known keys: {sorted(CHOICES)}")
    out = {}
    for key, value in decl.items():
        allowed = CHOICES[key]
        if key in _SINGLE:
            if value not in allowed:
                raise AdapterError(f"IUT {spec!r}: capabilities[{key!r}] must be one of {list(allowed)}, got {value!r}")
            out[key] = value
            continue
        if isinstance(value, str) or not isinstance(value, (tuple, list, set, frozenset)) or not value:
            raise AdapterError(f"IUT {spec!r}: capabilities[{key!r}] must be a non-empty tuple drawn from "
                               f"{list(allowed)}, got {value!r}")
        bad = [v for v in value if v not in allowed]
        if bad:
            raise AdapterError(f"IUT {spec!r}: capabilities[{key!r}] has unknown value(s) {bad}; allowed: {list(allowed)}")
        out[key] = tuple(v for v in allowed if v in value)   # canonical order: draws do not depend on the spelling
    return Capabilities(**out)


def set_current(caps: Capabilities | None) -> None:
    """The running IUT's capabilities (None: back to full support)."""
    _CURRENT.clear()
    if caps is not None:
        _CURRENT.append(caps)


def current() -> Capabilities:
    return _CURRENT[0] if _CURRENT else FULL


def unmet(caps: Capabilities, requires: dict) -> list[str]:
    """Reasons a test marked ``requires={key: value or (values...)}`` does not apply to ``caps`` (empty: it does)."""
    reasons = []
    for key, want in requires.items():
        if key not in CHOICES:
            raise ValueError(f"requires: unknown capability {key!r}; known: {sorted(CHOICES)}")
        for v in ((want,) if isinstance(want, str) else tuple(want)):
            if v not in CHOICES[key]:
                raise ValueError(f"requires[{key!r}]: unknown value {v!r}; allowed: {list(CHOICES[key])}")
            if not caps.has(key, v):
                reasons.append(f"{key} {v!r} (the IUT declares {getattr(caps, key)!r})")
    return reasons
