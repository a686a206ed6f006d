"""A ci conformance run of the cache clauses against the reference executes every runtime branch of the CPU
decode path, host and in-graph (tests/suite/honesty_adapters/tripwire.py counts the calls): the cache the suite
checks is the cache users run, as make_a2ats_cache builds it and the attention hook drives it."""

import json

import pytest

from a2ats_conformance.run.cli import main


def test_cache_clauses_run_every_cpu_decode_branch(tmp_path, monkeypatch):
    from honesty_adapters.tripwire import BRANCHES

    monkeypatch.setenv("A2ATS_TRIPWIRE_DIR", str(tmp_path))
    out = tmp_path / "r.json"
    code = main(["--iut", "honesty_adapters.tripwire:Tripwire", "--profile", "ci", "--seed", "0", "-q",
                 "--clauses", "CACHE-DECODE,CACHE-CHUNK,CACHE-FAR-CODES", "--report-json", str(out)])
    rep = json.loads(out.read_text())
    assert code == 0, {c: v["status"] for c, v in rep["clauses"].items()}
    counts = {b: 0 for b in BRANCHES}
    files = list(tmp_path.glob("counts-*.json"))
    assert files, "the suite process wrote no counts"
    for f in files:
        for b, n in json.loads(f.read_text()).items():
            counts[b] += n
    assert all(counts.values()), {b: n for b, n in counts.items() if not n}
