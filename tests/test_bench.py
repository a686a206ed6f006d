"""a2ats-bench: the speed CLI at unit-test size, and the JSON schema every consumer relies on."""

import json

from a2ats_ref import bench


def test_speed_tiny_json_schema(tmp_path):
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    assert bench.main(["speed", "--tiny", "--json", str(out), "--md", str(md)]) == 0
    res = json.loads(out.read_text())
    assert res["schema_version"] == bench.SCHEMA_VERSION and res["benchmark"] == "speed" and res["profile"] == "tiny"
    m = res["machine"]
    for key in ("cpu", "cores", "mlx", "blas", "allocator_tuned"):
        assert key in m, key
    rows = res["decode_step"]
    assert [(r["T"], r["dtype"]) for r in rows] == [(512, "float32"), (1024, "float32")]
    for r in rows:
        for key in ("T", "dtype", "dense_ms", "a2ats_ms", "speedup"):
            assert key in r, key
        assert r["dense_ms"] > 0 and r["a2ats_ms"] > 0 and r["speedup"] > 0
        assert r["bytes_read"]["a2ats"] < r["bytes_read"]["dense"]
    for r in res["cache_update"]["rows"]:
        assert r["kvcache_ms"] > 0 and r["a2ats_ms"] > 0
    for r in res["memory"]["rows"]:
        assert r["a2ats_bytes"] > r["kvcache_bytes"]
    assert "| T | dtype | dense ms |" in md.read_text()


def test_fidelity_text_is_disjoint_from_calibration_text():
    from a2ats_ref import bench_fidelity as bf

    assert not set(bf.EVAL_PACKAGES) & set(bf.CALIB_PACKAGES)
    from a2ats_ref.corpus import stdlib_files

    assert not any(set(bf.EVAL_PACKAGES) & set(p.parts) for p in stdlib_files()), "a2ats-calibrate's default corpus must not contain the evaluation text"
    ev, ca = bf.eval_text(20000), bf.calib_text(20000)
    assert len(ev) == len(ca) == 20000
    assert ev[:2000] not in ca
