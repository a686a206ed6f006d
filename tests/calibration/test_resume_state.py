"""a2ats-calibrate's resume state (``<out>.partial/``) is untrusted: a file whose bytes changed is recomputed,
with a warning naming it, so a resumed run equals an uninterrupted one; and the codebook's timings cover every
segment of a resumed run."""

from __future__ import annotations

import a2ats_ref  # noqa: F401  (first: its __init__ loads the fast BLAS before mlx)

import numpy as np
import pytest

from a2ats_ref.calibration import calibrate as cal
from a2ats_ref import eq17_kmeans

from test_calib_tiny import TEXT, ByteTokenizer, tiny_model

CAL = dict(tokens=300, codebook_size=8, b=64, seed=0, seq_len=128, packing="packed", chunk=64, quiet=True,
           checkpoint_tokens=128)


def _same_codebook(a, b) -> bool:
    return all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.cz + a.Ls, b.cz + b.Ls))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole")
    text = folder / "calib.py"
    text.write_text(TEXT)
    cb = cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], partial_dir=folder / "p", **CAL)
    state = {f.name: f.read_bytes() for f in sorted((folder / "p").iterdir()) if f.name != cal.LOCK_NAME}
    assert any(n.startswith("collect_") for n in state) and any(n.startswith("layer_") for n in state)
    return text, cb, state


def _flip(raw: bytes, at: int) -> bytes:
    b = bytearray(raw)
    b[at % len(b)] ^= 0x10
    return bytes(b)


# Where in each file the byte is flipped, as a fraction of its length: the header, the arrays' data, the end.
@pytest.mark.parametrize("where", [0.02, 0.3, 0.55, 0.8, 0.97])
def test_one_flipped_byte_in_each_resume_file_is_recomputed(uninterrupted, tmp_path, where):
    text, whole, state = uninterrupted
    partial = tmp_path / "p"
    partial.mkdir()
    for name, raw in state.items():
        (partial / name).write_bytes(_flip(raw, int(where * len(raw))))
    with pytest.warns(UserWarning) as caught:
        resumed = cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], partial_dir=partial, **CAL)
    assert _same_codebook(resumed, whole), "a resumed run trusted a corrupted resume file"
    named = " ".join(str(w.message) for w in caught)
    for name in state:
        assert str(partial / name) in named or name.startswith("collect_"), (name, named)


def test_flipped_array_bytes_in_a_layer_file_are_refused_by_its_checksum(uninterrupted, tmp_path, monkeypatch):
    """The silent case: a byte in the middle of cz's float data, where the file still parses."""
    import mlx.core as mx

    text, whole, state = uninterrupted
    partial = tmp_path / "p"
    partial.mkdir()
    for name, raw in state.items():
        (partial / name).write_bytes(raw)
    f = partial / "layer_001.safetensors"
    arrays, _ = mx.load(str(f), return_metadata=True)
    header = int.from_bytes(state[f.name][:8], "little") + 8
    f.write_bytes(_flip(state[f.name], header + 4 * 7 + 2))   # inside the first array's data
    fits = []
    orig = eq17_kmeans.kmeans
    monkeypatch.setattr(cal, "kmeans", lambda *a, **k: (fits.append(1), orig(*a, **k))[1])
    with pytest.warns(UserWarning, match="layer_001.safetensors.*checksum.*fitting layer 1 again"):
        resumed = cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], partial_dir=partial, **CAL)
    assert _same_codebook(resumed, whole)
    assert len(fits) == arrays["cz"].shape[0], "only the corrupted layer is fitted again"


def test_flipped_key_bytes_in_a_collected_group_are_refused(uninterrupted, tmp_path):
    text, whole, state = uninterrupted
    partial = tmp_path / "p"
    partial.mkdir()
    for name, raw in state.items():
        (partial / name).write_bytes(raw)
    f = partial / "collect_0000.npz"
    with np.load(f) as z:
        keys = z["keys_0"]
    raw = state[f.name]
    at = raw.index(keys.tobytes()[:64]) + 40    # a float of layer 0's keys, stored uncompressed
    f.write_bytes(_flip(raw, at))
    with pytest.warns(UserWarning, match="collect_0000.npz.*collecting group 0 again"):
        resumed = cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], partial_dir=partial, **CAL)
    assert _same_codebook(resumed, whole)


def test_resumed_timings_cover_every_segment(uninterrupted, tmp_path):
    """A rerun that reuses every group and layer reports the seconds those took, not only its own."""
    text, whole, state = uninterrupted
    partial = tmp_path / "p"
    partial.mkdir()
    for name, raw in state.items():
        (partial / name).write_bytes(raw)
    resumed = cal.calibrate(tiny_model(), ByteTokenizer(), texts=[text], partial_dir=partial, **CAL)
    t_whole, t_resumed = whole.meta["timings"], resumed.meta["timings"]
    for key in ("collect_s", "kmeans_s", "kmeans_init_s", "kmeans_lloyd_s"):
        assert t_resumed[key] == t_whole[key], (key, t_resumed, t_whole)
    assert t_resumed["earlier_runs_s"] == pytest.approx(t_whole["collect_s"] + t_whole["kmeans_s"], abs=0.02)
    assert t_resumed["total_s"] >= t_resumed["earlier_runs_s"]


def test_nonfinite_weights_are_refused_before_collection(uninterrupted, monkeypatch):
    import mlx.core as mx

    from a2ats_ref.calibration import collect as col

    text, _, _ = uninterrupted
    m = tiny_model()
    w = m.model.layers[1].self_attn.k_proj.weight
    m.model.layers[1].self_attn.k_proj.weight = mx.where(mx.arange(w.size).reshape(w.shape) == 3, mx.nan, w)
    monkeypatch.setattr(col, "collect", lambda *a, **k: pytest.fail("collection started on NaN weights"))
    with pytest.raises(ValueError, match=r"model: parameter 'model.layers.1.self_attn.k_proj.weight' holds NaN"):
        cal.calibrate(m, ByteTokenizer(), texts=[text], **CAL)


def test_cli_resume_over_corrupted_state_equals_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    """a2ats-calibrate on a GGUF, interrupted after its first layer; one byte flipped in every resume file; the
    rerun exits 0, warns about each file, and writes the codebook an uninterrupted run writes."""
    from a2ats_ref.runtime.codebook import Codebook
    from gguf_writer import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "m.gguf")
    text = tmp_path / "calib.py"
    text.write_text(TEXT)
    args = [str(model), "--text", str(text), "--tokens", "300", "--codebook-size", "8", "--b", "64", "--seq-len",
            "128", "--packing", "packed", "--quiet"]
    assert cal.main([*args, "--out", str(tmp_path / "whole.safetensors")]) == 0
    out = tmp_path / "cb.safetensors"
    save = cal._save_partial

    def dies_after_layer_0(partial, l, *a):
        save(partial, l, *a)
        raise KeyboardInterrupt

    monkeypatch.setattr(cal, "_save_partial", dies_after_layer_0)
    assert cal.main([*args, "--out", str(out)]) == 130
    monkeypatch.setattr(cal, "_save_partial", save)
    partial = cal.partial_path(out)
    files = [f for f in sorted(partial.iterdir()) if f.name != cal.LOCK_NAME]
    assert {f.name for f in files} == {"collect_0000.npz", "layer_000.safetensors"}, files
    for f in files:
        raw = f.read_bytes()
        f.write_bytes(_flip(raw, len(raw) // 2))
    capsys.readouterr()
    with pytest.warns(UserWarning) as caught:
        assert cal.main([*args, "--out", str(out)]) == 0
    warned = " ".join(str(w.message) for w in caught)
    assert all(str(f) in warned for f in files), warned
    a, b = Codebook.load(out), Codebook.load(tmp_path / "whole.safetensors")
    assert _same_codebook(a, b), "the resumed codebook differs from an uninterrupted run"
