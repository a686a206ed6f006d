"""INPUT-ERRORS on the runtime's own arguments: a flag that is not a bool, a b that float32 cannot hold."""

from __future__ import annotations

import mlx.core as mx
import pytest

from a2ats_ref.cache import A2ATSCache, A2ATSConfig
from test_cache_support import quiet_codebook


@pytest.mark.parametrize("flag", ["no", "false", "", 0, 1, None, 1.0])
def test_traditional_must_be_a_bool(flag):
    """bool("no") is True: a string or number taken as a bool silently picks the other RoPE layout."""
    lc = quiet_codebook().layers[0]
    with pytest.raises(ValueError, match="traditional"):
        A2ATSCache(lc, mx.ones((lc.head_dim // 2,)), flag)


@pytest.mark.parametrize("b", [2 ** 24, 2 ** 24 + 1, 10 ** 9])
def test_b_beyond_float32_integers_is_refused(b):
    """R_b's angle is b * inv_freq in float32, where integers above 2^24 are not all representable."""
    with pytest.raises(ValueError, match=r"\bb\b"):
        A2ATSConfig(b=b)


def test_largest_exact_b_is_accepted():
    assert A2ATSConfig(b=2 ** 24 - 1).b == 2 ** 24 - 1
