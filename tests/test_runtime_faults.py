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


def test_random_codebook_depends_only_on_its_seed():
    """Whether mlx is imported before a2ats_ref decides which BLAS MLX runs: the codebook must not depend on it."""
    import subprocess
    import sys

    probe = ("import hashlib, warnings, numpy as np; from a2ats_ref.cache import random_codebook\n"
             "warnings.simplefilter('ignore')\n"
             "cb = random_codebook(2, 2, 64, 256, seed=3)\n"
             "h = hashlib.sha256()\n"
             "[h.update(np.array(a).tobytes()) for lc in cb.layers for a in (lc.Cz, lc.L)]\n"
             "print(h.hexdigest())\n")
    digests = []
    for first in ("import a2ats_ref\n", "import mlx.core\n"):
        out = subprocess.run([sys.executable, "-c", first + probe], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1], "random_codebook(seed=3) differs with the import order of mlx and a2ats_ref"
