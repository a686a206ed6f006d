"""The catalogue (conformance/catalogue) and the port profile: every record's mutant is named by its own probe,
the spec's implementations profile as the spec's variants only, ports with several deviations get each named,
and the report carries the profile (terminal, JSON, Markdown)."""

import os
import sys

import numpy as np
import pytest

from a2ats_conformance import catalogue as K
from a2ats_conformance import mutants as MU
from a2ats_conformance.harness.capabilities import read as read_caps
from a2ats_conformance.catalogue.profile import profile
from a2ats_conformance.run.cli import format_markdown, format_table, port_profile_rows
from a2ats_conformance.report import validate_report

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "ports"))
import port_multi  # noqa: E402
import port_unfaithful  # noqa: E402

_NAMED = [r for r in K.RECORDS if r.kind != "spec" and not r.catch_all]


def _rows(adapter, dtype=None):
    return {r["mechanism"]: r for r in profile(adapter, dtype=dtype or adapter.dtypes[0], caps=read_caps(adapter))}


@pytest.mark.parametrize("rec", _NAMED, ids=lambda r: r.key)
def test_each_record_is_named_by_its_own_probe(rec):
    """The record's mutant (its a2ats_conformance.mutants class where it has one, else its model as a port) reads the
    record's variant on the record's mechanism."""
    row = _rows(MU.port_for(rec))[rec.mechanism]
    assert row["variant"] == rec.variant, (rec.key, row["evidence"])


@pytest.mark.parametrize("rec", [r for r in _NAMED if r.mutant], ids=lambda r: r.key)
def test_each_record_model_is_named_too(rec):
    """Where the record names an a2ats_conformance.mutants class, its model is named by the same probe as well."""
    row = _rows(K.model_adapter(rec.model))[rec.mechanism]
    assert row["variant"] == rec.variant, (rec.key, row["evidence"])


def test_records_group_is_their_mutant_group():
    groups = {"shipped": MU.MUTANTS, "coverage": MU.COVERAGE_MUTANTS, "gap": MU.GAP_MUTANTS}
    for r in K.RECORDS:
        assert r.kind in ("spec", "authors", "port"), r.key
        if r.mutant is None:
            assert r.group is None, r.key
            continue
        assert r.mutant in groups[r.group], (r.key, r.group)
        assert getattr(MU, r.mutant).record == r.key and getattr(MU, r.mutant).bug == r.description, r.key


def test_every_known_deviation_is_in_the_catalogue():
    """The diagnosis library holds no deviation the catalogue does not index: each is a record's, or the known
    cause of a mutant's entry."""
    from a2ats_conformance.catalogue.bugs import BUGS
    from a2ats_conformance.diagnosis.deviations import DEVIATIONS

    indexed = {r.deviation for r in K.RECORDS} | {b.cause for b in BUGS}
    assert [d.id for d in DEVIATIONS if d.id not in indexed] == []


def test_authors_variants_cite_spec_and_their_file_line():
    for r in K.RECORDS:
        if r.kind == "authors":
            assert "SPEC" in r.source and "authors vqkey/" in r.source and ":" in r.source.split("authors ")[1], r.key


@pytest.mark.parametrize("iut,dtype", [("a2ats_conformance.adapters.oracle:OracleAdapter", "float64"),
                                       ("a2ats_conformance.examples.numpy_port:NumpyPort", "float64"),
                                       ("a2ats_conformance.examples.numpy_port:NumpyPort", "float32"),
                                       ("a2ats_conformance.adapters.reference:ReferenceAdapter", "float32")])
def test_spec_implementations_profile_as_the_spec(iut, dtype):
    from a2ats_conformance.harness.adapter import load_adapter

    rows = _rows(load_adapter(iut), dtype)
    assert {m: r["variant"] for m, r in rows.items() if r["status"] != "spec"} == {}
    assert set(rows) == {m.id for m in K.MECHANISMS}


@pytest.mark.parametrize("name", sorted(port_multi.MULTI))
def test_multi_deviation_port_gets_each_deviation_named(name):
    cls = port_multi.MULTI[name]
    assert len(cls.named) >= 3
    rows = _rows(cls(), "float32")
    found = {m: r["variant"] for m, r in rows.items()
             if r["status"] not in ("spec", "not-applicable", "not-implemented", "not-run")}
    assert found == cls.named, {m: rows[m]["evidence"] for m in set(found) ^ set(cls.named) | set(found)}
    for m, r in rows.items():   # a row left unclassified names the catch-all variant that confounds its probe
        if r["status"] == "not-run":
            assert "not classified: the port's" in r["evidence"] and cls.named.get("cache-values") == "quantized", \
                (m, r["evidence"])


@pytest.mark.parametrize("name", sorted(n for n, c in port_unfaithful.UNFAITHFUL.items()
                                        if c.deviation))
def test_unfaithful_port_deviation_is_named(name):
    """Each one-bug port: some profile row reads a record of its deviation, and no mechanism reads unknown."""
    cls = port_unfaithful.UNFAITHFUL[name]
    rows = _rows(cls(), "float64")
    named = {r.deviation for r in K.RECORDS for m, row in rows.items() if m == r.mechanism and row["variant"] == r.variant}
    assert cls.deviation in named, {m: r["variant"] for m, r in rows.items() if r["status"] != "spec"}
    assert not [m for m, r in rows.items() if r["status"] == "unknown"]


def test_profile_reads_not_implemented_and_not_applicable():
    class Partial:
        name, version, dtypes = "partial", "1", ("float64",)
        capabilities = {"cache_ops": ("append", "decode")}

        def __init__(self):
            port = port_multi.P.NumpyPort()
            self.rope_apply, self.rope_invert, self.make_cache = port.rope_apply, port.rope_invert, port.make_cache

    rows = _rows(Partial())
    assert rows["rope-layout"]["status"] == "spec"
    assert rows["h-pooling"]["status"] == "not-implemented" and "query_moment" in rows["h-pooling"]["evidence"]
    assert rows["cache-trim"]["status"] == "not-applicable"
    assert rows["cache-values"]["status"] == "spec"


def test_own_randomness_port_reads_not_applicable_where_the_stream_decides():
    """A port drawing its own random stream (randomness: own) is never handed the suite's uniforms: the probes
    whose answer depends on the stream read not-applicable, the stream-free k-means rules are still measured,
    and no row reads error (a probe called with the explicit-uniforms signature would raise TypeError)."""
    import port_own_rng

    rows = _rows(port_own_rng.Adapter())
    assert not [m for m, r in rows.items() if r["status"] == "error"], {m: r["evidence"] for m, r in rows.items()}
    inits = [m for m in rows if rows[m]["probe"] in ("kmeans-init", "kmeans")]
    assert inits and all(rows[m]["status"] == "not-applicable" for m in inits), {m: rows[m] for m in inits}
    assert rows["empty-cluster"]["status"] == "spec", rows["empty-cluster"]


def test_a_port_that_raises_reads_error_and_unknown_is_not_a_variant():
    class Raises:
        name, version, dtypes = "raises", "1", ("float64",)

        def rope_apply(self, *a, **kw):
            raise ValueError("x: this port only takes 2-D arrays")

        def rope_invert(self, x, positions, inv_freqs, *, traditional):
            return x * 1.5

    rows = _rows(Raises())
    assert rows["rope-layout"]["status"] == "unknown"
    assert "rope_apply raised ValueError: x: this port only takes 2-D arrays" in rows["rope-layout"]["evidence"]


def test_report_shows_verdict_then_profile_then_clauses():
    rows = profile(port_multi.CalibrationPort(), dtype="float64")
    rep = {"implementation": {"name": "p", "iut": "m:P", "dtype": "float64"}, "profile": "ci", "wall_s": 1.0,
           "clauses": {"EQ-10": {"status": "fail", "tests": 1, "examples": 1, "counterexample": {"message": "bad H"}},
                       "EQ-11": {"status": "pass", "tests": 1, "examples": 1, "counterexample": None}},
           "summary": {"fail": 1, "pass": 1, "failed_clauses": ["EQ-10"], **{k: 0 for k in (
               "timeout", "crash", "interrupted", "xfail", "not-implemented", "not-applicable", "untested")}},
           "tests": {"t": {}}, "port_profile": port_profile_rows(rows, ["EQ-10"])}
    text = format_table(rep)
    lines = text.splitlines()
    assert lines[1].startswith("verdict: FAIL, 1 clause(s) fail: EQ-10")
    assert lines[2].startswith("port profile")
    assert text.index("*one-head") < text.index("EQ-10                fail")
    h = next(r for r in rep["port_profile"] if r["mechanism"] == "h-pooling")
    assert h["explains"] == ["EQ-10"]
    md = format_markdown(rep)
    assert md.index("verdict: FAIL") < md.index("## Port profile") < md.index("## Clauses")
    assert "| H: GQA pooling | *one-head |" in md


def test_report_schema_takes_the_profile():
    from a2ats_conformance.report import SCHEMA, validate

    rows = port_profile_rows(profile(port_multi.AuthorsPort(), dtype="float64"), ["EQ-17-STEP"])
    assert validate(rows, {"type": "array", "items": SCHEMA["$defs"]["profile_row"]}, SCHEMA) == []
    assert validate([{"mechanism": "x"}], {"type": "array", "items": SCHEMA["$defs"]["profile_row"]}, SCHEMA)
    assert validate_report  # the full report is validated in test_report.py


def test_a_port_refusing_leading_dims_is_told_so_in_one_line(tmp_path):
    """A callable that raises a framework error on SPEC's leading batch dims fails with one line that says so
    (and where README-ADAPTER.md states them), not with the raw error."""
    from a2ats_conformance.harness.pytest_helpers import ConformanceFailure, Context

    class FlatOnly:
        name, version, dtypes = "flat", "1", ("float64",)

        def assign(self, k, C, H):
            if np.ndim(k) > 1:
                raise TypeError("expected a 1-D tensor")
            return int(np.argmin(np.sum((C - k) ** 2, axis=-1)))

    ctx = Context(FlatOnly(), iut_spec="m:FlatOnly", dtype="float64", clauses=("EQ-14",), nodeid="t",
                  counterexample_dir=str(tmp_path))
    H, C = np.eye(4), np.eye(4)
    assert ctx.call("assign", np.ones(4), C, H) == 0
    with pytest.raises(ConformanceFailure) as e:
        ctx.call("assign", np.ones((3, 4)), C, H)
    first = str(e.value).splitlines()[0]
    assert first.startswith("error[EQ-14]: assign raised TypeError (expected a 1-D tensor) on an input with leading "
                            "dims (3,)") and "README-ADAPTER.md, 'Leading dims'" in first
    with pytest.raises(ConformanceFailure, match="must raise ValueError, raised TypeError"):   # judged as before
        ctx.expect_value_error("assign", np.ones((3, 4)), C, H, what="x")
