"""INPUT-ERRORS on the runtime's own arguments: a flag that is not a bool, a b that float32 cannot hold."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig
from test_cache_support import quiet_codebook
from hang_guard import HANG_S


@pytest.mark.clause("INPUT-ERRORS")
@pytest.mark.parametrize("flag", ["no", "false", "", 0, 1, None, 1.0])
def test_traditional_must_be_a_bool(flag):
    """bool("no") is True: a string or number taken as a bool silently picks the other RoPE layout."""
    lc = quiet_codebook().layers[0]
    with pytest.raises(ValueError, match="traditional"):
        A2ATSCache(lc, mx.ones((lc.head_dim // 2,)), flag)


@pytest.mark.clause("INPUT-ERRORS")
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

    probe = ("import hashlib, warnings, numpy as np; from a2ats_ref.runtime.cache import random_codebook\n"
             "warnings.simplefilter('ignore')\n"
             "cb = random_codebook(2, 2, 64, 256, seed=3)\n"
             "h = hashlib.sha256()\n"
             "[h.update(np.array(a).tobytes()) for lc in cb.layers for a in (lc.Cz, lc.L)]\n"
             "print(h.hexdigest())\n")
    digests = []
    for first in ("import a2ats_ref\n", "import mlx.core\n"):
        out = subprocess.run([sys.executable, "-c", first + probe], capture_output=True, text=True, timeout=HANG_S)
        assert out.returncode == 0, out.stderr
        digests.append(out.stdout.strip().splitlines()[-1])
    assert digests[0] == digests[1], "random_codebook(seed=3) differs with the import order of mlx and a2ats_ref"


@pytest.mark.clause("CACHE-DECODE")
def test_first_decode_after_a_long_prefill_codes_a_bounded_number_of_tokens(monkeypatch):
    """A prefill chunk's tokens are coded with the chunk: left pending, the first decode after a 32K prefill
    coded all 32K at once (tens of seconds, no progress). A decode codes at most the w + 1 tokens appended
    since the last chunk."""
    from a2ats_ref.runtime import coding

    lc = quiet_codebook().layers[0]
    cfg = A2ATSConfig(w=4, sinks=2, topk=0.1)
    c = A2ATSCache(lc, mx.ones((lc.head_dim // 2,)) * 0.01, False, cfg)
    kv = lambda t, i: mx.random.normal((1, lc.n_kv_heads, t, lc.head_dim), key=mx.random.key(i))
    for i, t in enumerate((300, 500)):
        c.update_and_fetch(kv(t, 2 * i), kv(t, 2 * i + 1))
    coded = []
    real = coding.assign_codes
    monkeypatch.setattr(coding, "assign_codes", lambda k, *a, **kw: coded.append(k.shape[2]) or real(k, *a, **kw))
    q = mx.random.normal((1, 2 * lc.n_kv_heads, 1, lc.head_dim), key=mx.random.key(9))
    for i in range(12):
        c.update_and_fetch(kv(1, 100 + i), kv(1, 200 + i))
        mx.eval(c.decode(q))
    assert sum(coded) <= 12 and max(coded, default=0) <= cfg.w + 1, f"tokens coded per decode batch: {coded}"


def test_caches_without_the_hook_warn_once(monkeypatch):
    """Without enable_a2ats, mlx-lm's dense attention reads the A2ATS cache's keys and values: the output looks
    right and A2ATS never ran."""
    import warnings

    import a2ats_ref.runtime.cache as cache_mod
    from a2ats_ref.runtime.hook import disable_a2ats, enable_a2ats
    from test_cache_support import a2ats_caches, run, tiny_llama, tokens

    monkeypatch.setattr(cache_mod, "_warned_no_hook", [False])
    model = tiny_llama()
    counts = []
    for hooked in (True, False, False):
        (enable_a2ats if hooked else disable_a2ats)(model)
        caches = a2ats_caches(model, w=4, sinks=2, topk=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run(model, tokens(40), caches, prefill=30)
        counts.append(sum("enable_a2ats" in str(w.message) for w in seen))
    assert counts == [0, 1, 0], f"warnings naming enable_a2ats (hooked, unhooked, unhooked again): {counts}"


def test_evaluating_the_cache_state_every_step_warns_once(monkeypatch):
    """A decode loop that evaluates cache.state after each step makes each next token a prompt token
    (runtime.prompt): dense attention, A2ATS never runs. mlx-lm's own generation does not warn."""
    import warnings

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from a2ats_ref.runtime import prompt
    from a2ats_ref.runtime.hook import enable_a2ats
    from test_cache_support import a2ats_caches, tiny_llama, tokens

    model = enable_a2ats(tiny_llama())
    seen_by = {}
    for loop in ("mlx-lm", "state every step"):
        monkeypatch.setattr(prompt, "_warned", [False])
        caches = a2ats_caches(model, w=4, sinks=2, topk=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if loop == "mlx-lm":
                list(generate_step(tokens(40)[0], model, prompt_cache=caches, max_tokens=prompt.PROMPT_RUN + 8,
                                   prefill_step_size=16))
            else:
                model(tokens(20), cache=caches)
                for t in range(prompt.PROMPT_RUN + 8):
                    mx.eval(model(mx.array([[t % 50]]), cache=caches), [c.state for c in caches])
        seen_by[loop] = sum(prompt.PROMPT_RUN_WARNING == str(w.message) for w in seen)
    assert seen_by == {"mlx-lm": 0, "state every step": 1}, seen_by


# ---------------------------------------------------------------- float32 overflow: a clear error, never inf/NaN

def _big(shape, scale, seed=0):
    return mx.array((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32))


def _overflow_cases():
    from a2ats_ref.eq10_query_moment import query_moment
    from a2ats_ref.eq17_kmeans import kmeans
    from a2ats_ref.eq18_back_transform import back_transform
    from a2ats_ref.retrieval import retrieval_attention

    inv = mx.array(np.geomspace(1.0, 1e-3, 8).astype(np.float32))
    return {
        "kmeans": lambda: kmeans(_big((64, 16), 1e20), 8, seed=0),
        "query_moment": lambda: query_moment(_big((4, 6, 16), 1e20), n_kv_heads=2, b=2048, inv_freqs=inv,
                                             traditional=False),
        # q0 q1 over two tokens is 1e40 - 1e40: inf - inf in float32, NaN whatever order the sum takes
        "query_moment_cancelling": lambda: query_moment(
            mx.array(np.array([[[1e20, 1e20] + [0.0] * 14, [1e20, -1e20] + [0.0] * 14]] * 2, np.float32)),
            n_kv_heads=1, b=0, inv_freqs=inv, traditional=False),
        "retrieval_attention": lambda: retrieval_attention(_big((4, 16), 1e20), _big((2, 5, 16), 1e20, 1),
                                                           _big((2, 5, 16), 1.0, 2), mx.ones((2, 5), mx.bool_)),
        "back_transform": lambda: back_transform(_big((8, 16), 1e37),
                                                 mx.array(np.eye(16, dtype=np.float32) * 1e-3)),
    }


@pytest.mark.clause("INPUT-ERRORS")
@pytest.mark.parametrize("name", ["kmeans", "query_moment", "query_moment_cancelling", "retrieval_attention",
                                  "back_transform"])
def test_overflow_raises_a_clear_error(name):
    with pytest.raises(ValueError, match="overflow"):
        out = _overflow_cases()[name]()
        pytest.fail(f"{name} returned without an error; finite: "
                    f"{[bool(mx.all(mx.isfinite(o)).item()) for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, mx.array)]}")


@pytest.mark.clause("INPUT-ERRORS")
@pytest.mark.parametrize("flag", ["false", "no", 0])
def test_meta_state_traditional_must_be_a_bool(flag):
    import json

    lc = quiet_codebook().layers[0]
    cache = A2ATSCache(lc, mx.ones((lc.head_dim // 2,)), False)
    cfg, rope = cache.meta_state
    bad = json.dumps({**json.loads(rope), "traditional": flag})
    with pytest.raises(ValueError, match="traditional"):
        A2ATSCache.from_state((), (cfg, bad), codebook=lc)
    with pytest.raises(ValueError, match="traditional"):
        cache.meta_state = (cfg, bad)


def test_layer_codebook_nbytes_counts_the_bytes_it_holds():
    """C and the decode operand CT share one buffer: counting both over-stated a codebook's memory by a third."""
    import gc

    from a2ats_ref.runtime.codebook import CodebookLayer

    rng = np.random.default_rng(0)
    Cz = mx.array(rng.standard_normal((3, 1024, 64)).astype(np.float32))
    L = mx.array(np.tile(np.eye(64, dtype=np.float32), (3, 1, 1)))
    mx.eval(Cz, L)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    lc = CodebookLayer.from_z(Cz, L)
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    assert lc.nbytes - Cz.nbytes - L.nbytes == held, (lc.nbytes - Cz.nbytes - L.nbytes, held)


@pytest.mark.clause("EQ-10")
@pytest.mark.parametrize("scale", [1e-3, 1e6, 1e12])
def test_query_moment_is_scale_invariant_where_float32_holds_h(scale):
    """H is RMS-normalised, so q and c*q give one H. At c = 1e12 the entries of H are ~1e24, finite in float32,
    but their squares are not: an RMS taken of H*H reads inf and H / inf returned the ridge alone."""
    from a2ats_ref.eq10_query_moment import query_moment

    q = np.random.default_rng(5).standard_normal((4, 6, 16)).astype(np.float32)
    inv = mx.array(np.geomspace(1.0, 1e-3, 8).astype(np.float32))
    kw = dict(n_kv_heads=2, b=2048, inv_freqs=inv, traditional=False)
    ref = np.array(query_moment(mx.array(q), **kw))
    got = np.array(query_moment(mx.array(q * np.float32(scale)), **kw))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
