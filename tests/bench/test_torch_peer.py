"""RET-DECODE's peer in a2ats-bench: PyTorch SDPA beside the A2ATS rows, or a stated absence; batched decode."""

from __future__ import annotations

import sys

import pytest

from a2ats_ref.bench import cli as bench
from a2ats_ref.bench import speed, torch_peer


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # import torch raises ImportError
    monkeypatch.setattr(torch_peer, "_STATE", {})


def test_without_torch_the_peer_says_so_once_and_gives_no_numbers(no_torch, capsys):
    assert "PyTorch is not importable" in torch_peer.unavailable()
    assert torch_peer.sdpa_decode_ms(B=1, n_q=8, n_kv=2, T=256, d=32, dtype_name="float32") is None
    assert torch_peer.describe() is None
    torch_peer.unavailable()
    assert capsys.readouterr().err.count("PyTorch SDPA column is left out") == 1


def test_without_torch_the_tables_leave_the_column_out_and_say_why(no_torch, tmp_path):
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    assert bench.main(["speed", "--tiny", "--only", "decode,batch", "--json", str(out), "--md", str(md)]) == 0
    text = md.read_text()
    assert "PyTorch SDPA column: left out (PyTorch is not importable" in text
    assert "| PyTorch SDPA ms |" not in text and "A2ATS over PyTorch" not in text


def test_peer_numbers_fill_their_columns_as_peer_over_a2ats(monkeypatch, tmp_path):
    seen = []

    def fake_peer(**kw):
        seen.append(kw)
        return {"median_ms": 7.0 * kw["B"], "min_ms": 7.0, "reps": kw["reps"], "device": "cpu", "bytes_read": 0}

    monkeypatch.setattr(speed, "_peer", fake_peer)
    monkeypatch.setattr(torch_peer, "describe",
                        lambda: {"torch": "x", "device": "cpu", "gpu": None, "kernel": "sdpa(enable_gqa=True)"})
    out, md = tmp_path / "s.json", tmp_path / "s.md"
    assert bench.main(["speed", "--tiny", "--only", "decode,batch", "--json", str(out), "--md", str(md)]) == 0
    import json

    res = json.loads(out.read_text())
    for r in res["decode_step"] + res["batched_decode"]:
        B = r.get("B", 1)
        assert r["torch_sdpa_ms"] == 7.0 * B and r["over_torch_sdpa"] == pytest.approx(7.0 * B / r["a2ats_ms"])
    # the peer runs at each row's own shape, context, batch and dtype
    assert {(k["T"], k["B"], k["dtype_name"]) for k in seen} == {(512, 1, "float32"), (1024, 1, "float32"),
                                                                 (1024, 2, "float32")}
    assert all((k["n_q"], k["n_kv"], k["d"]) == (8, 2, 32) for k in seen)
    text = md.read_text()
    assert text.count("| A2ATS over PyTorch |") == 2 and "PyTorch SDPA peer: torch x on cpu" in text


def test_batched_decode_runs_all_rows_in_one_call(monkeypatch):
    """A batch of B sequences is one decode_step_fast call on (B, n_q, 1, d) queries, not B calls."""
    from a2ats_ref.runtime.decode import dispatch

    calls = []
    real = dispatch.decode_step_fast
    monkeypatch.setattr(dispatch, "decode_step_fast", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    monkeypatch.setattr(speed, "_peer", lambda **kw: None)
    rows = speed.batched_decode_table(512, [1, 3], dtype_name="float32", reps=2, shape=dict(n_q=8, n_kv=2, d=32), K=256)
    assert [r["B"] for r in rows] == [1, 3] and set(calls) == {1, 3}
    for r in rows:
        assert r["a2ats_tokens_per_s"] == pytest.approx(r["B"] * 1e3 / r["a2ats_ms"])
        assert r["dense_tokens_per_s"] == pytest.approx(r["B"] * 1e3 / r["dense_ms"])


@pytest.mark.parametrize("argv, flag", [(["--batch", "0"], "--batch"), (["--batch", "a"], "--batch"),
                                        (["--batch-T", "300"], "--batch-T"), (["--dtypes", "int8"], "--dtypes"),
                                        (["--e2e-ctx", "x"], "--e2e-ctx")])
def test_bad_speed_flags_name_the_flag(argv, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["speed", "--tiny", "--json", str(tmp_path / "s.json"), *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err
