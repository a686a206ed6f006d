"""a2ats-bench: the CI smoke run of `speed --quick`, `fidelity --tiny`, and the JSON schema consumers rely on."""

import json
import signal
import time

import pytest

from a2ats_ref.bench import cli as bench
from a2ats_ref.runtime.decode import selfcheck


def test_speed_quick_json_schema(tmp_path):
    # The --quick profile is the smoke run of the benchmark code (Llama-3.1-8B decode shapes, SmolLM2 e2e), with
    # shorter contexts: its decode table at one (the longer adds a minute of dense float16 steps and no code path),
    # and e2e at one context with a real prefill and one of synthetic keys and values, as at its own sizes.
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    assert bench.main(["speed", "--quick", "--T", "4096", "--e2e-ctx", "512,1280",
                       "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["schema_version"] == bench.SCHEMA_VERSION and res["benchmark"] == "speed" and res["profile"] == "quick"
    m = res["machine"]
    for key in ("cpu", "cores", "mlx", "blas", "allocator_tuned"):
        assert key in m, key
    rows = res["decode_step"]
    assert [(r["T"], r["dtype"]) for r in rows] == [(4096, dt) for dt in ("float32", "float16")]
    for r in rows:
        for key in ("T", "dtype", "dense_ms", "a2ats_ms", "speedup"):
            assert key in r, key
        assert r["dense_ms"] > 0 and r["a2ats_ms"] > 0 and r["speedup"] > 0
        # bytes read: dense reads every key and value; A2ATS the gathered rows, one code per token and the codebook
        sh, item = r["shape"], 4 if r["dtype"] == "float32" else 2
        assert r["bytes_read"]["dense"] == 2 * sh["n_kv"] * r["T"] * sh["d"] * item
        rows_read = 2 * sh["n_kv"] * r["gathered_rows_per_kv_head"] * sh["d"] * item
        assert rows_read < r["bytes_read"]["a2ats"] and r["gathered_rows_per_kv_head"] < r["T"]
    assert [r["T"] for r in res["dtype_ratio"]] == [4096]   # float16 time / float32 time, interleaved
    assert all(set(r["time_over_float32"]) == {"float16"} and r["time_over_float32"]["float16"] > 0
               for r in res["dtype_ratio"])
    for r in res["dtype_ratio"]:   # 3x the decode rows' reps, the median inside its quartiles
        lo, hi = r["time_over_float32_quartiles"]["float16"]
        assert r["reps"] == 9 and lo <= r["time_over_float32"]["float16"] <= hi
    lib = res["library_decode"]   # the public-API rows: bench process, fresh process default, fresh untuned
    assert [r["row"].split(" (")[0] for r in lib] == ["bench process", "library default", "library, A2ATS_TUNE_ALLOCATOR=0"]
    assert all("error" not in r and r["dense_ms_per_token"] > 0 and r["a2ats_ms_per_token"] > 0 for r in lib), lib
    assert [r["allocator_tuned"] for r in lib] == [True, True, False]
    assert "library default" in md.read_text()
    for r in res["cache_update"]["rows"]:
        assert r["kvcache_ms"] > 0 and r["a2ats_ms"] > 0 and r["a2ats_eager_ms"] > 0 and r["ratio_bound_at_blas_peak"] > 0
        lo, hi = r["eager_over_deferred_quartiles"]   # 3x the decode rows' reps, the paired median inside its quartiles
        assert r["reps"] == 9 and r["layers"] == 1 and lo <= r["eager_over_deferred"] <= hi
    assert [(r["T"], r["layers"]) for r in res["cache_update_layers"]["rows"]] == [(1024, 2)]
    assert "as in generation" in md.read_text()
    assert res["cache_update"]["assignment_gemm"]["flops_per_token"] == 2 * 8 * 128 * 4096   # n_kv · d · K at 8B shapes
    for r in res["memory"]["rows"]:
        assert r["a2ats_bytes"] > r["kvcache_bytes"]
    assert "| T | dtype | dense ms |" in md.read_text()
    bd = res["batched_decode"]   # B sequences sharing one codebook, one call per step
    assert [(r["T"], r["B"]) for r in bd] == [(4096, 1), (4096, 4)]
    assert all(r["a2ats_ms"] > 0 and r["dense_ms"] > 0 and r["speedup"] > 0 for r in bd)
    assert "## Batched decode" in md.read_text()
    e2e = res["e2e_smollm2"]
    assert [(r["context"], r["prefill"] == "real") for r in e2e["rows"]] == [(512, True), (1280, False)]
    for r in e2e["rows"]:
        assert r["dense"]["tokens_per_s"] > 0 and r["a2ats"]["tokens_per_s"] > 0
        bt = r["bytes_per_token"]
        assert bt["dense"] == bt["weights"] + bt["dense_kv"] and bt["ideal_ratio"] > 0
    real = e2e["rows"][0]
    assert real["prefill_tokens_per_s"] > 0 and len(real["greedy_tokens"]["dense"]) == 4
    assert real["prefill_probe"]["mlx_lm_dense_tokens_per_s"] > 0 and real["prefill_probe"]["a2ats_tokens_per_s"] > 0


def test_paired_ratio_is_the_median_of_per_repetition_ratios():
    from a2ats_ref.bench.speed import paired_ratio

    # per-repetition ratios 3, 1, 2: median 2 (the ratio of the medians would be 4 / 4 = 1)
    assert paired_ratio([3.0, 4.0, 10.0], [1.0, 4.0, 5.0]) == {"median": 2.0, "q25": 1.5, "q75": 2.5, "n": 3}
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([1.0, 2.0], [1.0])


def test_update_case_codes_one_batch_per_repetition_in_every_layer(monkeypatch):
    """The update case's batched row codes w + 1 tokens per repetition in each layer (one batch, triggered as decode
    triggers it), each layer with its own codebook, and every repetition starts from the same T cached tokens."""
    from a2ats_ref.bench import speed as bs
    from a2ats_ref.runtime import cache as C

    seen = []
    real = C.A2ATSCache._assign_pending

    def spy(self, upto):
        pending = self.offset - self._coded if self._coded < min(upto, self.offset) else 0
        if pending and upto < self.offset:   # the batched row (the eager row asks for every token: upto == offset)
            seen.append((id(self.codebook), self._coded, pending))
        real(self, upto)

    monkeypatch.setattr(C.A2ATSCache, "_assign_pending", spy)
    res = bs.cache_update_table([256], shape=dict(n_kv=2, d=32), K=256, reps=2, w=8, layers=3)
    (row,) = res["rows"]
    assert row["layers"] == 3 and row["reps"] == 2 and row["tokens_per_rep"] == 9
    # warm-up + 2 repetitions, 3 layers: 9 batches, each of the w + 1 tokens appended after the T seeded ones
    assert len(seen) == 9 and {(s, n) for _, s, n in seen} == {(256, 9)}, seen
    assert len({cb for cb, _, _ in seen}) == 3   # each layer its own codebook


def test_speed_T_chooses_the_context_lengths(tmp_path):
    out = tmp_path / "speed.json"
    assert bench.main(["speed", "--tiny", "--T", "768", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["decode_step"]
    assert row["T"] == 768
    from a2ats_ref.runtime.decode import cuda as cuda_decode
    methods = {"mlx", "sortfree", "host"} | ({"cuda"} if selfcheck.usable() else set())
    assert set(row["method_ms"]) == set(row["method_speedup"]) == methods   # beside dense
    with pytest.raises(SystemExit) as e:
        bench.main(["speed", "--tiny", "--T", "1000", "--json", str(out)])
    assert e.value.code == 2


def test_fidelity_tiny_json_schema(tmp_path):
    out, md = tmp_path / "fid.json", tmp_path / "fid.md"
    assert bench.main(["fidelity", "--tiny", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "fidelity" and res["profile"] == "tiny"
    se = res["score_error"]
    assert set(se) == {"query_aware", "plain"} and all(v["mean"] > 0 for v in se.values())
    assert set(res["attention_mass_recall"]) == {"1%", "3%", "10%"}
    for r in res["attention_mass_recall"].values():
        assert 0 < r["a2ats"] <= 1 and 0 < r["oracle"] <= 1 + 1e-9
    assert "| relative score error" in md.read_text()


def test_fidelity_text_is_disjoint_from_calibration_text():
    from a2ats_ref.bench import fidelity as bf

    assert not set(bf.EVAL_PACKAGES) & set(bf.CALIB_PACKAGES)
    from a2ats_ref.calibration.corpus import stdlib_files

    assert not any(set(bf.EVAL_PACKAGES) & set(p.parts) for p in stdlib_files()), "a2ats-calibrate's default corpus must not contain the evaluation text"
    ev, ca = bf.eval_text(20000), bf.calib_text(20000)
    assert len(ev) == len(ca) == 20000
    assert ev[:2000] not in ca


def test_fidelity_authors_tiny_runs_the_authors_code_path(tmp_path):
    # `--profile authors --tiny`: the same code as the hour-long authors run, at toy sizes.
    out, md = tmp_path / "fa.json", tmp_path / "fa.md"
    assert bench.main(["fidelity", "--profile", "authors", "--tiny", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["profile"] == "authors-tiny" and res["codebook"]["packing"] == "documents"
    assert res["config"] == {"b": 2048, "w": 64, "sinks": 8}
    r = res["recall"]
    budgets = ["1%", "2%", "3%", "5%", "10%"]
    assert set(r["attention_mass_recall"]) == {"query_aware_vq", "query_aware_vq_bf16", "wrope_true_keys",
                                               "exact_topk", "window_sinks"}
    assert set(r["attention_mass_recall_plain_layers"]) == set(r["attention_mass_recall"]) | {"plain_vq"}
    for block in (r["attention_mass_recall"], r["attention_mass_recall_plain_layers"]):
        for row in block.values():
            assert list(row) == budgets and all(0 < x <= 1 + 1e-9 for x in row.values())
        # every selection holds the window and the sinks, so none recalls less than they do alone
        for meth in block:
            for b_ in budgets:
                assert block[meth][b_] >= block["window_sinks"][b_] - 1e-9, (meth, b_)
    assert 0 <= r["bf16_codes_differ_share"] <= 1
    assert set(r["score_error"]["plain"]["per_layer"]) == {"0", "29"}
    assert len(r["score_error"]["query_aware"]["per_layer"]) == 30
    assert set(r["b_sweep_wrope_true_keys"]) == {"0", "64", "2048"}
    rc = res["retrieval_vs_compression"]
    assert [b_["context_tokens"] for b_ in rc] == [160, 192]
    for blk in rc:
        assert {"compression_faithful", "compression_velox", "a2ats_3%"} <= set(blk["rows"])
    for row in res["ppl"]:
        assert all(row[m] > 1 for m in ("dense", "a2ats", "compression_faithful", "compression_velox"))
    acc = res["needles"]["accuracy"]
    assert set(acc) == {"passkey@160", "multikey@160"} and acc["multikey@160"]["n"] == 1
    pk = res["packing"]
    assert pk["documents"]["tokens"] == pk["packed"]["tokens"]          # equal token count, equal K
    assert "## Retrieval vs compression" in md.read_text()


class _CharTok:
    """A character-level stand-in tokenizer: enough for the packing rules."""
    bos_token_id, eos_token_id = 1, 2

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) % 200) for c in text]


def test_calibration_packing_follows_the_authors():
    from a2ats_ref.bench.fidelity import calibration_sequences

    tok = _CharTok()
    seqs, n_text, n_uuid = calibration_sequences(tok, text_tokens=3000, uuid_tokens=500, max_len=400,
                                                 packing="documents")
    assert (n_text, n_uuid) == (3000, 500)
    assert all(s[0] == tok.bos_token_id and len(s) <= 400 for s in seqs)     # BOS first, at most max_len
    assert sum(map(len, seqs[:-2])) == 3000 and [len(s) for s in seqs[-2:]] == [400, 100]  # UUID tail: 400 + 100
    assert tok.encode(", ")[0] in seqs[-1] and tok.eos_token_id not in seqs[-1]
    seqs_p, n_text_p, n_uuid_p = calibration_sequences(tok, text_tokens=3000, uuid_tokens=500, max_len=400,
                                                       packing="packed")
    assert (n_text_p, n_uuid_p) == (3000, 500)
    assert all(len(s) <= 1024 for s in seqs_p) and seqs_p[0][0] != tok.bos_token_id


def test_machine_block_names_the_gpu_memory_under_either_key():
    # Metal's device_info says memory_size; MLX CUDA's does not (the H200 block read "None bytes"): any integer
    # entry naming memory is taken, and the whole dict is kept
    from types import SimpleNamespace

    from a2ats_ref.bench import cli as bench

    def fake(info):
        return SimpleNamespace(gpu="gpu", cpu="cpu", default_device=lambda: SimpleNamespace(type="gpu"),
                               device_info=lambda: info, cuda=SimpleNamespace(is_available=lambda: True))

    g = bench._gpu(fake({"device_name": "NVIDIA H200", "total_memory": 150_000_000_000, "architecture": "sm_90"}))
    assert g["name"] == "NVIDIA H200" and g["memory_bytes"] == 150_000_000_000 and g["mlx_backend"] == "cuda"
    assert g["device_info"]["architecture"] == "sm_90"
    assert bench._gpu(fake({"device_name": "M3", "memory_size": 17}))["memory_bytes"] == 17


def _interrupt_at_call(monkeypatch, n, how):
    """Make the decode table's n-th case stop the run (``how``: "ctrl-c" or "sigterm")."""
    import os

    from a2ats_ref.bench import speed as bench_speed

    real, calls = bench_speed.decode_step_case, []

    def case(*a, **kw):
        calls.append(a)
        if len(calls) == n:
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)   # the handler raises here
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(bench_speed, "decode_step_case", case)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_speed_run_keeps_the_rows_it_measured(tmp_path, monkeypatch, capsys, how):
    # A bench stopped by a time limit (timeout(1) sends SIGTERM) must not lose the rows it measured.
    import threading

    if how == "sigterm" and threading.current_thread() is not threading.main_thread():
        pytest.skip("only the main thread can take SIGTERM as an exception; here the signal would end pytest")
    out = tmp_path / "speed.json"
    _interrupt_at_call(monkeypatch, 2, how)
    term_before = signal.getsignal(signal.SIGTERM)
    assert bench.main(["speed", "--tiny", "--only", "decode", "--json", str(out)]) == 130
    assert not out.exists()   # the --json path is for whole runs only
    kept = json.loads((tmp_path / "speed.json.partial").read_text())
    assert kept["partial"] is True and [r["T"] for r in kept["decode_step"]] == [512]
    assert kept["decode_step"][0]["dense_ms"] > 0 and kept["machine"]
    assert "speed.json.partial" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is term_before   # the run's SIGTERM handler is put back


def test_a_speed_run_interrupted_before_any_row_writes_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "speed.json"
    _interrupt_at_call(monkeypatch, 1, "ctrl-c")
    assert bench.main(["speed", "--tiny", "--only", "decode", "--json", str(out)]) == 130
    assert not out.exists() and not (tmp_path / "speed.json.partial").exists()
    assert "nothing was written" in capsys.readouterr().err
