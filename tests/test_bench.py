"""a2ats-bench: the CI smoke run of `speed --quick`, `fidelity --tiny`, and the JSON schema consumers rely on."""

import json

from a2ats_ref import bench


def test_speed_quick_json_schema(tmp_path):
    # The --quick profile is the CI smoke run of the benchmark code (Llama-3.1-8B decode shapes, SmolLM2 e2e).
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    assert bench.main(["speed", "--quick", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["schema_version"] == bench.SCHEMA_VERSION and res["benchmark"] == "speed" and res["profile"] == "quick"
    m = res["machine"]
    for key in ("cpu", "cores", "mlx", "blas", "allocator_tuned"):
        assert key in m, key
    rows = res["decode_step"]
    assert [(r["T"], r["dtype"]) for r in rows] == [(T, dt) for T in (4096, 16384) for dt in ("float32", "float16")]
    for r in rows:
        for key in ("T", "dtype", "dense_ms", "a2ats_ms", "speedup"):
            assert key in r, key
        assert r["dense_ms"] > 0 and r["a2ats_ms"] > 0 and r["speedup"] > 0
        if r["T"] >= 16384:  # below that, reading the K=4096 codebook for the LUT can outweigh the saving
            assert r["bytes_read"]["a2ats"] < r["bytes_read"]["dense"]
    lib = res["library_decode"]   # the public-API rows: bench process, fresh process default, fresh untuned
    assert [r["row"].split(" (")[0] for r in lib] == ["bench process", "library default", "library, A2ATS_TUNE_ALLOCATOR=0"]
    assert all("error" not in r and r["dense_ms_per_token"] > 0 and r["a2ats_ms_per_token"] > 0 for r in lib), lib
    assert [r["allocator_tuned"] for r in lib] == [True, True, False]
    assert "library default" in md.read_text()
    for r in res["cache_update"]["rows"]:
        assert r["kvcache_ms"] > 0 and r["a2ats_ms"] > 0
    for r in res["memory"]["rows"]:
        assert r["a2ats_bytes"] > r["kvcache_bytes"]
    assert "| T | dtype | dense ms |" in md.read_text()
    e2e = res["e2e_smollm2"]
    assert e2e["dense"]["tokens_per_s"] > 0 and e2e["a2ats_cache_decode"]["tokens_per_s"] > 0


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
    from a2ats_ref import bench_fidelity as bf

    assert not set(bf.EVAL_PACKAGES) & set(bf.CALIB_PACKAGES)
    from a2ats_ref.corpus import stdlib_files

    assert not any(set(bf.EVAL_PACKAGES) & set(p.parts) for p in stdlib_files()), "a2ats-calibrate's default corpus must not contain the evaluation text"
    ev, ca = bf.eval_text(20000), bf.calib_text(20000)
    assert len(ev) == len(ca) == 20000
    assert ev[:2000] not in ca
