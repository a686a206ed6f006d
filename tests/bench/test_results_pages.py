"""Results pages (a2ats_ref.results_page): each carries the command, the date, the commit and the machine beside
its numbers, lands only inside its folder, and draws its plots where matplotlib is installed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from a2ats_ref.bench import cli as bench
from a2ats_ref.bench import plots, results_page

ROOT = Path(__file__).resolve().parents[2]

MACHINE = {"cpu": "Test CPU", "cores": 2, "platform": "Linux", "python": "3.11", "mlx": "0.32", "mlx_lm": "0.32",
           "device": "Device(cpu, 0)", "gpu": None, "blas": {"config": "OpenBLAS test"}, "allocator_tuned": True,
           "loadavg_at_start": [0.5, 0.5, 0.5]}


def speed_result() -> dict:
    rows = [{"T": T, "dtype": "float32", "dense_ms": T / 400, "a2ats_ms": T / 2000 + 1, "speedup": 2.0,
             "select_method": "host", "method_ms": {}, "method_speedup": {},
             "bytes_read": {"dense": 2 * T, "a2ats": T}} for T in (4096, 16384)]
    return {"schema_version": bench.SCHEMA_VERSION, "benchmark": "speed", "profile": "tiny", "wall_s": 1.5,
            "provenance": {"command": "a2ats-bench speed --tiny --results-dir R", "date": "D",
                           "commit": results_page.commit_of()},
            "machine": MACHINE, "decode_step": rows,
            "e2e_smollm2": {"model": "m", "decode_tokens": 2, "codebook": "random", "rows": []}}


def fidelity_result() -> dict:
    rec = {m: {"1%": v, "3%": v + 0.02, "10%": v + 0.05} for m, v in
           (("query_aware_vq", 0.8), ("wrope_true_keys", 0.82), ("exact_topk", 0.9), ("window_sinks", 0.6))}
    return {"benchmark": "fidelity", "profile": "authors-tiny", "machine": MACHINE, "wall_s": 2.0,
            "provenance": {"command": "a2ats-bench fidelity --profile authors --tiny", "date": "D", "commit": "C"},
            "recall": {"attention_mass_recall": rec}}


@pytest.fixture(autouse=True)
def _fidelity_body(monkeypatch):
    # the page writer is under test, not the fidelity tables (tests/test_bench.py checks those on real runs)
    monkeypatch.setattr(bench, "fidelity_markdown", lambda res: "# title\n\nMachine: x\n\n| recall | 0.8 |\n")


def test_provenance_names_the_command_and_the_settings_that_change_it(monkeypatch):
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    monkeypatch.delenv("A2ATS_PRECOMPILED_KERNELS", raising=False)   # a setting of the shell that runs the tests
    p = results_page.provenance("a2ats-bench", ["speed", "--T", "16384,65536"])
    assert p["command"] == "MLX_ENABLE_TF32=0 a2ats-bench speed --T 16384,65536"
    assert re.fullmatch(r"20\d\d-\d\d-\d\d \d\d:\d\d UTC", p["date"]) and p["commit"]


def test_a_gpu_page_names_the_decode_kernels_launcher_and_its_setting(monkeypatch):
    """The CUDA step's launcher changes its host time (runtime.decode.precompiled): the machine block names the one
    the run used, and the command the variable that chose it."""
    gpu = {"name": "GPU", "memory_bytes": 1, "mlx_backend": "cuda", "float32_matmul_tf32": False,
           "decode_kernels": "MLX JIT"}
    assert "decode kernels: MLX JIT |" in "\n".join(results_page.machine_lines({**MACHINE, "gpu": gpu}))
    monkeypatch.setenv("A2ATS_PRECOMPILED_KERNELS", "auto")
    command = results_page.provenance("a2ats-bench", ["speed"])["command"]
    assert "A2ATS_PRECOMPILED_KERNELS=auto a2ats-bench speed" in command


@pytest.mark.parametrize("setting, launcher", [("0", "MLX JIT"), ("1", "kept cubins")])
def test_a_cuda_run_records_the_launcher_it_used(setting, launcher, monkeypatch):
    from types import SimpleNamespace
    import mlx.core as mx
    fake = SimpleNamespace(gpu=mx.gpu, default_device=lambda: SimpleNamespace(type=mx.gpu),
                           device_info=lambda: {"device_name": "GPU", "total_memory": 1},
                           cuda=SimpleNamespace(is_available=lambda: True))
    monkeypatch.setenv("A2ATS_PRECOMPILED_KERNELS", setting)
    assert bench._gpu(fake)["decode_kernels"] == launcher


def test_a_page_names_its_command_date_commit_and_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    out = bench.write_page(speed_result(), tmp_path, "speed-test")
    page = out["md"].read_text()
    prov = speed_result()["provenance"]
    assert "```bash\na2ats-bench speed --tiny --results-dir R\n```" in page
    assert "Date: D. Commit: " in page, page[:600]
    assert prov["commit"] in page and "| CPU | Test CPU, 2 cores |" in page and "OpenBLAS test" in page
    assert "| 16384 | float32 | 40.960 |" in page   # the body's table, beside them
    assert json.loads(out["json"].read_text())["provenance"]["command"] == prov["command"]
    assert not list(tmp_path.glob("*.png"))


def test_plots_are_skipped_with_one_line_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(plots, "available", lambda: False)
    bench.write_page(fidelity_result(), tmp_path, "fid")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plots skipped: matplotlib is not installed" in err[0]


def test_with_matplotlib_the_page_embeds_its_plots(tmp_path):
    pytest.importorskip("matplotlib")
    out = bench.write_page(fidelity_result(), tmp_path, "fid")
    assert out["recall"].name == "fid-recall.png" and out["recall"].read_bytes()[:4] == b"\x89PNG"
    assert "![attention-mass recall against the top-k budget](fid-recall.png)" in out["md"].read_text()
    out = bench.write_page(speed_result(), tmp_path, "spd")
    assert out["decode"].read_bytes()[:4] == b"\x89PNG" and "e2e" not in out   # no e2e rows: nothing to draw


def test_recall_curves_read_both_fidelity_layouts():
    got = plots.recall_curves(fidelity_result())["exact_topk"]
    assert [b for b, _ in got] == [1.0, 3.0, 10.0] and [v for _, v in got] == pytest.approx([0.9, 0.92, 0.95])
    default = {"attention_mass_recall": {"1%": {"a2ats": 0.8, "oracle": 0.9}, "3%": {"a2ats": 0.85, "oracle": 0.93}}}
    assert plots.recall_curves(default) == {"a2ats": [(1.0, 0.8), (3.0, 0.85)], "oracle": [(1.0, 0.9), (3.0, 0.93)]}


@pytest.mark.parametrize("name", ["../out", "a/b", ".hidden", "x.md", ""])
def test_a_page_name_cannot_leave_its_folder(name):
    with pytest.raises(ValueError, match="--name"):
        results_page.check_name(name)


def test_bench_refuses_a_missing_results_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["speed", "--tiny", "--results-dir", str(tmp_path / "nope")])
    assert e.value.code == 2 and "--results-dir" in capsys.readouterr().err


def test_page_renders_again_from_its_json(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    (tmp_path / "fid.json").write_text(json.dumps(fidelity_result()))
    assert bench.main(["page", "--json", str(tmp_path / "fid.json")]) == 0
    assert "a2ats-bench fidelity --profile authors --tiny" in (tmp_path / "fid.md").read_text()
    (tmp_path / "other.json").write_text("[]")
    assert bench.main(["page", "--json", str(tmp_path / "other.json")]) == 2


def test_every_committed_page_carries_its_command_date_and_commit():
    pages = sorted((ROOT / "spec" / "results").glob("*.md"))
    assert pages
    for p in pages:
        t = p.read_text()
        assert "```bash\n" in t and "Date: " in t and "Commit: " in t and "| machine | |" in t, p.name


def test_a_tiny_run_writes_its_page_with_the_command_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    argv = ["speed", "--tiny", "--only", "decode", "--results-dir", str(tmp_path), "--name", "speed-t"]
    assert bench.main(argv) == 0
    page = (tmp_path / "speed-t.md").read_text()
    assert f"a2ats-bench speed --tiny --only decode --results-dir {tmp_path} --name speed-t\n```" in page
    res = json.loads((tmp_path / "speed-t.json").read_text())
    assert [r["T"] for r in res["decode_step"]] == [512, 1024] and res["provenance"]["commit"]


def test_bench_needs_somewhere_to_write(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["speed", "--tiny"])
    assert e.value.code == 2 and "--json or --results-dir" in capsys.readouterr().err


def test_the_conformance_page_runs_the_example_port_that_exists():
    from a2ats_conformance.report import compat

    assert Path(compat.EXAMPLE).is_file(), compat.EXAMPLE   # its answer-files row runs this script
