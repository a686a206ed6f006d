"""Meta-tests of the conformance suite: citations, strategies, tolerances, xfails, adapter loading."""

import importlib
import pkgutil
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import a2ats_conformance.properties
from a2ats_conformance.run.cli import SUITE_DIR
from a2ats_conformance.harness import hypothesis_helpers as hh
from a2ats_conformance.harness import tolerances as T
from a2ats_conformance.run import xfails as X
from a2ats_conformance.harness.adapter import CLAUSE_FUNCTIONS, AdapterError, FUNCTION_NAMES, load_adapter
from a2ats_spec import oracle
from a2ats_spec.clauses import clause_ids


def _properties():
    """(module, function name, cited clauses) for every test function of the suite.

    The imported test modules are dropped from sys.modules afterwards: when the suite is installed
    (not editable), pytest's nested run in the other tests would otherwise reuse these copies, which
    were decorated outside the suite's plugin and then fail Hypothesis' fixture health check.
    """
    out = []
    before = set(sys.modules)
    for m in pkgutil.iter_modules(a2ats_conformance.properties.__path__):
        if not m.name.startswith("test_"):
            continue
        with warnings.catch_warnings():   # the suite registers its marker in its own plugin, not here
            warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
            mod = importlib.import_module(f"a2ats_conformance.properties.{m.name}")
        for name, fn in vars(mod).items():
            if name.startswith("test_") and callable(fn):
                cited = [c for mk in getattr(fn, "pytestmark", []) if mk.name == "clause" for c in mk.args]
                out.append((m.name, name, cited))
    for name in set(sys.modules) - before:
        if name.startswith("a2ats_conformance.properties.test_"):
            del sys.modules[name]
    return out


PROPS = _properties()


def test_every_clause_has_a_property():
    cited = {c for _, _, cl in PROPS for c in cl}
    missing = [c for c in clause_ids() if c not in cited]
    assert not missing, f"clauses without a property: {missing}"


def test_every_property_cites_known_clauses():
    known = set(clause_ids())
    assert all(cl for _, _, cl in PROPS), [f"{m}::{n}" for m, n, cl in PROPS if not cl]
    bad = [(m, n, c) for m, n, cl in PROPS for c in cl if c not in known]
    assert not bad, f"tests cite unknown clauses: {bad}"


def test_clause_functions_are_oracle_functions():
    assert set(CLAUSE_FUNCTIONS) <= set(clause_ids())
    assert all(callable(getattr(oracle, f, None)) for f in FUNCTION_NAMES)


def test_property_names_are_unique():
    names = [n for _, n, _ in PROPS]
    assert len(names) == len(set(names))


# --------------------------------------------------------------------------- strategies

@settings(max_examples=25, deadline=None)
@given(p=hh.rope_params())
def test_rope_params_are_valid(p):
    assert p["d"] % 2 == 0 and p["inv_freqs"].shape == (p["d"] // 2,) and np.all(p["inv_freqs"] > 0)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_spd_matrices_are_spd(data):
    d = data.draw(hh.head_dims())
    H = data.draw(hh.spd_matrices(d))
    assert np.allclose(H, H.T)
    ev = np.linalg.eigvalsh(H)
    assert ev.min() > 0 and ev.max() / ev.min() <= 1.01e3
    oracle.cholesky(H)


@settings(max_examples=25, deadline=None)
@given(c=hh.codebook_case())
def test_codebook_cases_are_valid(c):
    assert c["k"].shape == (c["n"], c["d"]) and c["C"].shape == (c["K"], c["d"]) and c["H"].shape == (c["d"], c["d"])
    oracle.assign(c["k"], c["C"], c["H"])


@settings(max_examples=25, deadline=None)
@given(c=hh.scores_case())
def test_scores_cases_are_valid(c):
    assert 0 <= c["query_pos"] < c["T"] and c["n_q"] % c["n_kv"] == 0
    oracle.select_tokens(c["scores"], n_kv_heads=c["n_kv"], query_pos=c["query_pos"], w=c["w"], sinks=c["sinks"],
                         topk=c["topk"])


@settings(max_examples=25, deadline=None)
@given(c=hh.kmeans_points(), data=st.data())
def test_kmeans_points_and_positions_are_valid(c, data):
    assert c["z"].shape == (c["N"], c["d"]) and c["N"] >= c["K"]
    pos = data.draw(hh.positions(5))
    assert pos.shape == (5,) and pos.min() >= 0 and pos.max() <= hh.MAX_POSITION


def test_strategy_options_are_checked():
    with pytest.raises(ValueError, match="max_dim"):
        hh.head_dims(max_dim=1)
    with pytest.raises(ValueError, match="head_dim"):
        hh.as_strategy(None, "head_dim")


# --------------------------------------------------------------------------- tolerances

def test_tolerance_entries_carry_reasons():
    for name, tol in T.TOLERANCES.items():
        assert tol.reason.strip() and tol.rtol > 0 and tol.atol > 0, name
    known = set(clause_ids())
    for clause, per in T.OVERRIDES.items():
        assert clause in known, f"override for unknown clause {clause}"
        for dt, tol in per.items():
            assert dt in T.TOLERANCES and len(tol.reason.strip()) > 10, (clause, dt)
            base = T.TOLERANCES[dt]
            assert tol.rtol >= base.rtol and tol.atol >= base.atol, f"override {clause}/{dt} is tighter than the base"


def test_tolerance_lookup():
    assert T.tolerance("float64") == (1e-12, 1e-12)
    assert T.tolerance(np.float32, "EQ-11") >= T.tolerance("float32")
    for dt in T.DTYPES:
        for c in clause_ids():
            r, a = T.tolerance(dt, c)
            rb, ab = T.TOLERANCES[dt][:2]
            assert r >= rb and a >= ab                 # overrides only loosen
    with pytest.raises(ValueError, match="no tolerance entry"):
        T.tolerance("int8")
    assert T.tie_margin("float32", "EQ-14") > 0


# --------------------------------------------------------------------------- known deviations

def test_xfails_parsing():
    devs = X.parse_xfails("# comment\n\nEQ-14  # our assign uses fp16 distances\n"
                          "test_retrieval.py::test_decode_step  # slow path\n")
    assert [(d.pattern, d.is_clause) for d in devs] == [("EQ-14", True), ("test_retrieval.py::test_decode_step", False)]
    assert X.matches(devs[0], "x/test_a.py::t[float32]", ["EQ-14"])
    assert X.matches(devs[1], "some/dir/test_retrieval.py::test_decode_step_matches_oracle[float32]", ["RET-DECODE"])
    with pytest.raises(ValueError, match="needs a reason"):
        X.parse_xfails("EQ-14\n")
    with pytest.raises(ValueError, match="needs a reason"):
        X.parse_xfails("EQ-14  #   \n")
    with pytest.raises(ValueError, match="one clause ID"):
        X.parse_xfails("EQ-14 EQ-15  # two\n")


def test_stale_xfail_line_warns():
    devs = X.parse_xfails("EQ-99  # no such clause\nEQ-14  # real\n")
    with pytest.warns(X.XfailWarning, match="EQ-99"):
        stale = X.unmatched(devs, {"test_x.py::t": ["EQ-14"]})
    assert [d.pattern for d in stale] == ["EQ-99"]


def test_xfails_file_marks_a_failing_clause_xfail(tmp_path):
    import json

    from a2ats_conformance.run.cli import main

    f = tmp_path / "xfails.txt"
    f.write_text("RET-TOPK  # we round up on purpose\ntest_nothing.py::test_gone  # stale line\n")
    out = tmp_path / "r.json"
    with pytest.warns(X.XfailWarning, match="test_gone"):
        code = main(["--iut", "a2ats_conformance.mutants:TopkCeil", "--profile", "selftest", "--seed", "0", "-q",
                     "--clauses", "RET-TOPK", "--xfails", str(f), "--report-json", str(out)])
    rep = json.loads(out.read_text())
    assert code == 0 and rep["clauses"]["RET-TOPK"]["status"] == "xfail"
    assert "we round up on purpose" in rep["clauses"]["RET-TOPK"]["reason"]
    assert any("test_nothing.py::test_gone" in w for w in rep["xfail_warnings"])


def test_missing_callable_is_not_implemented_only(tmp_path, monkeypatch):
    import json

    from a2ats_conformance.run.cli import main

    # A module file, not an in-memory module: the suite runs in a child process, which imports the IUT itself.
    (tmp_path / "_a2ats_partial_adapter.py").write_text(
        'from a2ats_spec.oracle import topk_count\nname, version, dtypes = "partial", "0", ("float64",)\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.json"
    code = main(["--iut", "_a2ats_partial_adapter", "--profile", "selftest", "--seed", "0", "-q", "--clauses",
                 "RET-TOPK,EQ-11,INPUT-ERRORS", "--report-json", str(out)])
    rep = json.loads(out.read_text())
    st_ = {c: v["status"] for c, v in rep["clauses"].items()}
    # INPUT-ERRORS runs only topk_count's bad-input cases (test_input_errors_b.py); every case of another callable
    # reads not-implemented, none fails
    assert code == 0 and st_ == {"RET-TOPK": "pass", "EQ-11": "not-implemented", "INPUT-ERRORS": "pass"}, st_
    ran = {k for k, v in rep["tests"].items() if "INPUT-ERRORS" in v["clauses"] and v["outcome"] == "passed"}
    assert ran and all("topk" in k for k in ran), ran
    ie = rep["clauses"]["INPUT-ERRORS"]   # a pass earned by a part of the clause says so
    assert ie["not_run"] >= 1 and ie["reason"].startswith("partial:"), ie
    assert "not_run" not in rep["clauses"]["RET-TOPK"], rep["clauses"]["RET-TOPK"]
    assert "wrope_scores" in rep["implementation"]["missing"]


# --------------------------------------------------------------------------- adapter loading

@pytest.mark.parametrize("spec, match", [
    ("no_such_module_xyz:Adapter", "cannot import module 'no_such_module_xyz'"),
    ("a2ats_conformance.adapters.reference:NoSuchThing", "has no attribute 'NoSuchThing'"),
    ("a2ats_conformance.harness.tolerances", "needs a non-empty str attribute 'name'"),
])
def test_adapter_loading_errors_are_clear(spec, match):
    with pytest.raises(AdapterError, match=match):
        load_adapter(spec)


def test_adapter_metadata_errors():
    mod = types.ModuleType("_a2ats_bad_adapter")
    sys.modules[mod.__name__] = mod
    mod.name, mod.version, mod.dtypes = "bad", "0", "float32"
    with pytest.raises(AdapterError, match="dtypes"):
        load_adapter(mod.__name__)
    mod.dtypes = ("float8",)
    with pytest.raises(AdapterError, match="unknown dtypes"):
        load_adapter(mod.__name__)
    mod.dtypes = ("float32",)
    with pytest.raises(AdapterError, match="implements none"):
        load_adapter(mod.__name__)


def test_default_iut_and_env(monkeypatch):
    monkeypatch.delenv("A2ATS_IUT", raising=False)
    assert load_adapter().name.startswith("a2ats_ref")
    monkeypatch.setenv("A2ATS_IUT", "a2ats_conformance.adapters.oracle:OracleAdapter")
    assert load_adapter().dtypes == ("float64",)


def test_cli_usage_errors(tmp_path, capsys):
    from a2ats_conformance.run.cli import main

    assert main(["--iut", "no_such_module_xyz:A"]) == 2
    assert "cannot import" in capsys.readouterr().err
    bad = tmp_path / "x.txt"
    bad.write_text("EQ-14\n")
    assert main(["--xfails", str(bad)]) == 2


def test_properties_hold_no_bare_assert():
    """The suite runs with --assert=plain (run/cli.py): a bare assert in a property would fail without saying
    what differed, where the suite's own checks name the clause, the quantity and the tolerance."""
    import ast

    found = []
    for path in sorted(Path(SUITE_DIR).glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.name}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert not found, found


def test_profiles_shrink_without_the_explain_phase():
    """Hypothesis' explain phase traces every run of a test after its first failure, which made a failing port's
    run markedly slower; the suite's own diagnosis explains failures. Shrinking stays where a profile shrinks."""
    from hypothesis import Phase

    from a2ats_conformance.run.plugin import PROFILES

    for name in PROFILES:
        phases = settings.get_profile(name).phases
        assert Phase.explain not in phases and Phase.generate in phases, (name, phases)
        assert (Phase.shrink in phases) == (name != "selftest"), (name, phases)


def _xdist_makespan(order: list, workers: int) -> float:
    """The wall time of running ``order`` ((name, seconds) pairs) on ``workers`` pytest-xdist workers under its own
    load scheduler, as the suite's CLI configures it (--maxschedchunk 1). A worker runs a test once it holds the
    next one or was told to shut down, and the controller shuts every worker down once none holds two."""
    from xdist.scheduler.load import LoadScheduling

    class Config:
        def getvalue(self, name):
            return [f"{workers}*popen"]

        def getoption(self, name):
            return 1

    class Node:
        def __init__(self, i):
            self.gateway, self.held, self.shutting_down, self.busy_until = types.SimpleNamespace(id=f"gw{i}"), [], False, None

        def send_runtest_some(self, indices):
            self.held += indices

        def shutdown(self):
            self.shutting_down = True

    sched, nodes = LoadScheduling(Config()), [Node(i) for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, [name for name, _ in order])
    sched.schedule()
    now, done = 0.0, 0
    while done < len(order):
        if not sched.pending and all(len(n.held) < 2 for n in nodes):
            for n in nodes:
                n.shutdown()
        for n in nodes:
            if n.busy_until is None and (len(n.held) >= 2 or (n.held and n.shutting_down)):
                n.busy_until = now + order[n.held[0]][1]
        node = min((n for n in nodes if n.busy_until is not None), key=lambda n: n.busy_until)
        now, node.busy_until, index = node.busy_until, None, node.held.pop(0)
        sched.mark_test_complete(node, index, order[index][1])
        done += 1
    return now


def test_heavy_tests_start_first_one_per_worker():
    """With workers, the suite's run takes about as long as its heaviest test, not two heavy tests back to back.

    The cache properties' durations on a GPU: three near-tie tests of ~50 s (one per dtype, collected side by side),
    14 others of 10-30 s, and 137 light ones."""
    from a2ats_conformance.run.plugin import heavy_first

    def item(name, cost):
        marks = [types.SimpleNamespace(name="cost", args=(cost,))] if cost else []
        return types.SimpleNamespace(name=name, iter_markers=lambda name="cost", m=marks: iter(m))

    seconds = {}
    light = [item(f"light{i}", 0) for i in range(137)]
    cache = [item(f"cache{i}", 1) for i in range(14)]
    ties = [item(f"ties[{dt}]", 2) for dt in ("float32", "float16", "bfloat16")]
    seconds.update({it.name: 0.5 for it in light}, **{it.name: 10.0 + 20.0 * (i % 2) for i, it in enumerate(cache)},
                   **{it.name: 50.0 for it in ties})
    collected = light[:40] + cache + ties + light[40:]
    for workers in (2, 4, 15):
        bound = max(max(seconds.values()), sum(seconds.values()) / workers)
        ordered = heavy_first(collected, workers)
        assert sorted(it.name for it in ordered) == sorted(it.name for it in collected)
        span = _xdist_makespan([(it.name, seconds[it.name]) for it in ordered], workers)
        assert span <= 1.15 * bound, (workers, span, bound)
    # with no light test to pair with (a run of the cache clauses alone), the heaviest still start apart
    only_heavy = cache + ties
    for workers in (2, 4, 8, 15):
        bound = max(50.0, sum(seconds[it.name] for it in only_heavy) / workers)
        span = _xdist_makespan([(it.name, seconds[it.name]) for it in heavy_first(only_heavy, workers)], workers)
        assert span <= 1.5 * bound, (workers, span, bound)
    # the collection's own order runs two heavy tests back to back on one worker
    assert _xdist_makespan([(it.name, seconds[it.name]) for it in collected], 15) >= 1.5 * 50.0


def test_the_cli_hands_out_one_test_at_a_time_and_marks_the_cache_properties_heavy():
    from a2ats_conformance.properties import test_cache, test_cache_near_ties
    from a2ats_conformance.run.cli import _parser, _pytest_args

    args = _pytest_args(_parser().parse_args(["-n", "4"]), "ini", "cex", "")
    assert args[args.index("--maxschedchunk") + 1] == "1"
    assert "--maxschedchunk" not in _pytest_args(_parser().parse_args([]), "ini", "cex", "")
    assert test_cache.pytestmark.name == "cost" and test_cache.pytestmark.args == (1,)
    assert [m.args for m in test_cache_near_ties.test_cache_decode_near_ties.pytestmark if m.name == "cost"] == [(2,)]
