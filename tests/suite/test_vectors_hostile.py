"""Vectors and answers are files handed between strangers (VECTORS.md, "Untrusted files"): every path in a manifest
stays inside its folder, a malformed manifest or answer is a clear error (exit 2) that names it, nothing is
written before everything is checked, a non-regular file is never opened, a .npy header never sizes an
allocation beyond its file, and a run where nothing was answered does not exit 0.  The last test is a
Hypothesis property over generated hostile manifests and answers."""

import contextlib
import copy
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from a2ats_conformance.harness.adapter import ORACLE_IUT, load_adapter
from a2ats_conformance.run.cli import main as cli_main
from a2ats_conformance.vectors.export import write_answers, write_vectors
from hang_guard import HANG_S

KEEP_CALLS = ("ROPE-FREQ.rope_inv_freqs.000", "EQ-14.assign.000", "RET-SELECT.select_tokens.000",
              "RET-DECODE.decode_step.000", "CODES-DTYPE.code_dtype.000", "INPUT-ERRORS.rope_apply.000")
KEEP_TRACES = ("CACHE-CHUNK.trace.000",)
NOTHING_ANSWERED = 4
MiB = 1 << 20


def _refs(x):
    """Every array path a manifest entry names."""
    if isinstance(x, dict):
        for k, v in x.items():
            if k in ("array", "allowed", "must", "may") and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(x, list):
        for v in x:
            yield from _refs(v)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small valid vectors folder (a few calls of each compare rule, one trace) and the oracle's answers."""
    full = tmp_path_factory.mktemp("full")
    write_vectors(str(full))
    m = json.loads((full / "manifest.json").read_text())
    m["calls"] = [c for c in m["calls"] if c["id"] in KEEP_CALLS]
    m["traces"] = [t for t in m["traces"] if t["id"] in KEEP_TRACES]
    assert len(m["calls"]) == len(KEEP_CALLS) and len(m["traces"]) == len(KEEP_TRACES)
    vec = tmp_path_factory.mktemp("vec")
    (vec / "arrays").mkdir()
    for ref in set(_refs([m["calls"], m["traces"]])):
        shutil.copy(full / ref, vec / ref)
    (vec / "manifest.json").write_text(json.dumps(m))
    ans = tmp_path_factory.mktemp("ans")
    write_answers(str(vec), load_adapter(ORACLE_IUT), str(ans), "float64")
    return m, str(vec), str(ans)


def _copy(base, root, manifest=None):
    m, vec, ans = base
    v, a = root / "vec", root / "ans"
    shutil.copytree(vec, v, symlinks=True)
    shutil.copytree(ans, a, symlinks=True)
    if manifest is not None:
        (v / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    return v, a


def _grade(*args):
    """-> (exit status, stderr); any exception escaping the CLI fails the test (a traceback for the user)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["grade", *map(str, args)])
    return code, err.getvalue()


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, ds, fs in os.walk(root) for f in fs + ds)


def test_the_small_base_grades_pass(base, tmp_path):
    v, a = _copy(base, tmp_path)
    assert _grade(v, a, "--report-json", tmp_path / "r.json") == (0, "")


# --------------------------------------------------------------------------- paths in the manifest

@pytest.mark.parametrize("where", ["call id", "trace id", "output name", "trace answer name"])
def test_a_traversal_name_writes_nothing_anywhere(base, tmp_path, where):
    m = copy.deepcopy(base[0])
    bad = "../../x"
    if where == "call id":
        m["calls"][0]["id"] = bad
    elif where == "trace id":
        m["traces"][0]["id"] = bad
    elif where == "output name":
        m["calls"][0]["outputs"][0]["name"] = bad
    else:
        m["traces"][0]["steps"][0]["expect"][0]["name"] = bad
    v, _ = _copy(base, tmp_path / "in", m)
    out = tmp_path / "deep" / "er" / "answers"
    before = _tree(tmp_path)
    code, err = _grade(v, out, "--iut", ORACLE_IUT, "--report-json", tmp_path / "deep" / "r.json")
    assert code == 2 and bad in err and "manifest.json" in err, err
    assert _tree(tmp_path) == before, "a refused manifest wrote files"


@pytest.mark.parametrize("ref", ["../secret.npy", "ABS", "arrays/../../secret.npy", "arrays/link.npy"])
def test_an_expected_output_outside_the_folder_is_refused(base, tmp_path, ref):
    m = copy.deepcopy(base[0])
    v, a = _copy(base, tmp_path, m)
    call = next(c for c in m["calls"] if c["function"] == "rope_inv_freqs")
    secret = tmp_path / "secret.npy"
    shutil.copy(v / call["outputs"][0]["array"], secret)    # the right values: reading it would grade a pass
    os.symlink(secret, v / "arrays" / "link.npy")
    call["outputs"][0]["array"] = str(secret) if ref == "ABS" else ref
    (v / "manifest.json").write_text(json.dumps(m))
    code, err = _grade(v, a)
    assert code == 2 and call["outputs"][0]["array"] in err and "outside" in err, err


def test_a_symlink_inside_the_folder_is_read(base, tmp_path):
    m = copy.deepcopy(base[0])
    v, a = _copy(base, tmp_path, m)
    call = next(c for c in m["calls"] if c["function"] == "rope_inv_freqs")
    os.symlink(os.path.basename(call["outputs"][0]["array"]), v / "arrays" / "alias.npy")
    call["outputs"][0]["array"] = "arrays/alias.npy"
    (v / "manifest.json").write_text(json.dumps(m))
    assert _grade(v, a) == (0, "")


# --------------------------------------------------------------------------- malformed manifests

@pytest.mark.parametrize("edit, names", [
    (lambda m: m.pop("calls"), "calls"),
    (lambda m: m.pop("traces"), "traces"),
    (lambda m: m["calls"][1].pop("outputs"), "outputs"),
    (lambda m: m["calls"][1].update(outputs={"name": "out0"}), "outputs"),
    (lambda m: m["calls"][0]["outputs"][0].update(compare="approx"), "compare"),
    (lambda m: m["calls"][0].update(tolerance={"float32": "tight"}), "tolerance"),
    (lambda m: m["traces"][0]["steps"][0].update(op="explode"), "op"),
    (lambda m: m["calls"].append(dict(m["calls"][0])), "twice"),
    (lambda m: m["calls"][0]["args"].append({"nothing": 1}), "args"),
])
def test_a_malformed_manifest_names_what_is_wrong(base, tmp_path, edit, names):
    m = copy.deepcopy(base[0])
    edit(m)
    v, a = _copy(base, tmp_path, m)
    code, err = _grade(v, a)
    assert code == 2 and names in err and "manifest.json" in err, err


def test_a_deeply_nested_manifest_is_a_clear_error(base, tmp_path):
    v, a = _copy(base, tmp_path, "[" * 100_000 + "]" * 100_000)
    code, err = _grade(v, a)
    assert code == 2 and "nested" in err and "manifest.json" in err, err


def test_an_oversized_manifest_is_refused_before_parsing(base, tmp_path, monkeypatch):
    from a2ats_conformance.vectors import untrusted

    monkeypatch.setattr(untrusted, "MAX_JSON_BYTES", 1000)
    v, a = _copy(base, tmp_path)
    code, err = _grade(v, a)
    assert code == 2 and "manifest.json" in err and "1000" in err, err


# --------------------------------------------------------------------------- answers that are not plain files

def _run_guarded(args, timeout=HANG_S):
    """The CLI in a subprocess: an open() of a FIFO blocks forever, and must fail the test, not hang it."""
    p = subprocess.run([sys.executable, "-m", "a2ats_conformance.run.cli", "grade", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


@pytest.mark.parametrize("victim", ["ROPE-FREQ.rope_inv_freqs.000.out0.npy", "INPUT-ERRORS.rope_apply.000.error",
                                    "answers.json"])
def test_a_fifo_answer_is_never_opened(base, tmp_path, victim):
    v, a = _copy(base, tmp_path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(a / victim)
    os.mkfifo(a / victim)
    code, err = _run_guarded([v, a])
    assert code == 2 and victim in err and "not a regular file" in err and "Traceback" not in err, err


def test_a_symlink_answer_says_symlink(base, tmp_path):
    v, a = _copy(base, tmp_path)
    victim = a / "EQ-14.assign.000.out0.npy"
    os.rename(victim, tmp_path / "real.npy")
    os.symlink(tmp_path / "real.npy", victim)
    code, err = _grade(v, a)
    assert code == 2 and "symbolic link" in err and "pickle" not in err, err


def test_a_truncated_npy_claiming_a_huge_shape_allocates_nothing(base, tmp_path):
    v, a = _copy(base, tmp_path)
    for target in (a / "EQ-14.assign.000.out0.npy", v / base[0]["calls"][0]["outputs"][0]["array"]):
        saved = target.read_bytes()
        with open(target, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f8", "fortran_order": False, "shape": (10**8,)})
            f.write(b"\0" * 16)
        tracemalloc.start()
        try:
            code, err = _grade(v, a)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert code == 2 and target.name in err and "800000000" in err, err
        assert peak < 64 * MiB, f"{peak / MiB:.0f} MiB allocated for a {target.stat().st_size}-byte file"
        target.write_bytes(saved)


def test_write_answers_does_not_write_through_a_symlink(base, tmp_path):
    m, vec, _ = base
    out = tmp_path / "answers"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere.npy"
    elsewhere.write_bytes(b"keep")
    os.symlink(elsewhere, out / "ROPE-FREQ.rope_inv_freqs.000.out0.npy")
    code, err = _grade(vec, out, "--iut", ORACLE_IUT)
    assert code == 2 and "ROPE-FREQ.rope_inv_freqs.000.out0.npy" in err and "symbolic link" in err, err
    assert elsewhere.read_bytes() == b"keep"


@pytest.mark.parametrize("victim", ["EQ-14.assign.000.out0.npy", "INPUT-ERRORS.rope_apply.000.error", "answers.json"])
def test_a_hard_linked_answer_is_refused(base, tmp_path, victim):
    v, a = _copy(base, tmp_path)
    os.link(a / victim, tmp_path / "outside")   # the same file under a name outside the answers folder
    code, err = _grade(v, a)
    assert code == 2 and victim in err and "hard links" in err, err


@pytest.mark.parametrize("victim", ["manifest.json", "array"])
def test_a_hard_linked_vectors_file_is_refused(base, tmp_path, victim):
    """A hard link in the vectors folder may alias a file from outside it (the expected outputs a port is graded
    against, or the manifest itself): it is refused as an answer's is, before any answer is written."""
    m, _, _ = base
    v, a = _copy(base, tmp_path)
    name = "manifest.json" if victim == "manifest.json" else next(_refs(m["calls"]))
    os.link(v / name, tmp_path / "outside")
    out = tmp_path / "fresh"
    out.mkdir()
    code, err = _grade(v, out, "--iut", ORACLE_IUT)
    assert code == 2 and os.path.basename(name) in err and "hard links" in err, err
    assert _listing(out) == [], "answers were written from a vectors folder holding a hard link"
    code, err = _grade(v, a)
    assert code == 2 and "hard links" in err, err


def _listing(folder):
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_write_answers_checks_every_name_before_writing(base, tmp_path, kind):
    out = tmp_path / "answers"
    out.mkdir()
    blocker = out / "RET-DECODE.decode_step.000.out1.npy"
    blocker.mkdir() if kind == "folder" else os.mkfifo(blocker)
    code, err = _run_guarded([base[1], out, "--iut", ORACLE_IUT])
    assert code == 2 and blocker.name in err and "not a regular file" in err, err
    assert _listing(out) == [blocker.name], "answers were written before every name was checked"


def _crashing_on(function, monkeypatch):
    """The oracle adapter, with ``function`` crashing (a port that answers no case of it this time)."""
    ad = load_adapter(ORACLE_IUT)

    def crash(*a, **k):
        raise RuntimeError("port crashed")

    monkeypatch.setattr(ad, function, crash, raising=False)
    return ad


def test_answers_an_earlier_run_left_are_not_graded_as_this_runs(base, tmp_path, monkeypatch):
    from a2ats_conformance.vectors.grade import grade_cases

    _, vec, ans = base
    out = tmp_path / "answers"
    shutil.copytree(ans, out)   # an earlier, complete run
    (out / "notes.txt").write_text("mine")
    write_answers(vec, _crashing_on("rope_inv_freqs", monkeypatch), str(out), "float64")
    results = grade_cases(vec, str(out), "float64")
    assert results["ROPE-FREQ.rope_inv_freqs.000"]["outcome"] == "not-implemented", results["ROPE-FREQ.rope_inv_freqs.000"]
    assert results["EQ-14.assign.000"]["outcome"] == "passed"
    assert (out / "notes.txt").read_text() == "mine" and results["__unused__"] == ["notes.txt"]


def test_an_answer_is_written_whole_or_not_at_all(base, tmp_path, monkeypatch):
    from a2ats_conformance.vectors import answers

    out, saving, real_save, real_save_answer = tmp_path / "answers", [], np.save, answers._save_answer

    def save_answer(path, value):
        saving.append(os.path.basename(path))
        real_save_answer(path, value)

    def torn_save(f, a, **kw):   # a full disk halfway through the third answer
        if len(saving) == 3:
            f.write(b"\x93NUMPY")
            raise OSError(28, "No space left on device")
        real_save(f, a, **kw)

    monkeypatch.setattr(answers, "_save_answer", save_answer)
    monkeypatch.setattr(answers.np, "save", torn_save)
    with pytest.raises(ValueError, match="No space left"):
        write_answers(base[1], load_adapter(ORACLE_IUT), str(out), "float64")
    assert saving[-1] not in _listing(out), f"a torn answer was left under its name: {saving[-1]}"
    assert set(saving[:2]) <= set(_listing(out)) and not [n for n in _listing(out) if n.endswith(".part")], \
        _listing(out)


# --------------------------------------------------------------------------- nothing answered

def test_an_empty_answers_folder_does_not_exit_0(base, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _grade(base[1], empty, "--report-json", tmp_path / "r.json")
    assert code == NOTHING_ANSWERED and "no case was answered" in err, err
    only_meta = tmp_path / "meta"
    only_meta.mkdir()
    shutil.copy(os.path.join(base[2], "answers.json"), only_meta)
    assert _grade(base[1], only_meta)[0] == NOTHING_ANSWERED


def test_exit_statuses_are_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli_main(["grade", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "4 when nothing was answered" in text, text


# --------------------------------------------------------------------------- the property

_HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["../../x", "/etc/passwd", "arrays/../../secret.npy", "a/b", "", "\0", ".", "..", "x" * 5000,
                     "arrays/missing.npy", "manifest.json", "arrays"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.sampled_from(["array", "value", "dtype", "name"]),
                                                         st.sampled_from(["../x", 1, None, "arrays"]), max_size=2))


def _nodes(x, path=()):
    yield path
    if isinstance(x, dict):
        for k in sorted(x):
            yield from _nodes(x[k], path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _nodes(v, path + (i,))


def _set(x, path, value):
    for p in path[:-1]:
        x = x[p]
    if value is _DELETE:
        del x[path[-1]]
    else:
        x[path[-1]] = value


_DELETE = object()


def _npy_header(shape, descr="<f8"):
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    return f.getvalue()


_BAD_ANSWERS = st.sampled_from(["fifo", "symlink", "dir", "empty", "garbage", "pickle", "huge", "huge2",
                                "complex", "unicode", "structured", "wrong shape", "deleted", "deep json"])


def _spoil(path, how, outside):
    if os.path.lexists(path):
        os.remove(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "symlink":
        os.symlink(outside, path)
    elif how == "dir":
        os.mkdir(path)
    elif how == "deleted":
        pass
    else:
        data = {"empty": b"", "garbage": b"\x93NUMPY\x01\x00garbage",
                "huge": _npy_header((10**9,)) + b"\0" * 8, "huge2": _npy_header((2**40, 2**40)) + b"\0" * 8,
                "deep json": b"[" * 50_000}.get(how)
        if data is None:
            a = {"pickle": np.array([{"a": 1}], object), "complex": np.ones(3, complex),
                 "unicode": np.array(["x"]), "structured": np.zeros(2, "i4,f8"),
                 "wrong shape": np.zeros((7, 3))}[how]
            buf = io.BytesIO()
            np.save(buf, a, allow_pickle=True)
            data = buf.getvalue()
        with open(path, "wb") as f:
            f.write(data)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_vectors_and_answers_give_a_clear_error_or_a_verdict(base, tmp_path_factory, data):
    """No traceback, no hang (no non-regular file is opened), no write outside the answers and report paths,
    no allocation beyond a bound; a spoilt answer file is an error naming it, a wrong shape a failure."""
    root = tmp_path_factory.mktemp("h")
    m = copy.deepcopy(base[0])
    nodes = list(_nodes(m))[1:]
    edits = data.draw(st.lists(st.tuples(st.sampled_from(nodes), st.one_of(_HOSTILE_VALUES, st.just(_DELETE))),
                               max_size=3), label="manifest edits")
    for path, value in edits:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            _set(m, path, value)
    deep = data.draw(st.sampled_from([None, "[", "{\"a\":"]), label="deep manifest")
    v, a = _copy(base, root / "in", deep * 200_000 if deep else m)
    outside = root / "outside.npy"
    shutil.copy(os.path.join(base[2], "ROPE-FREQ.rope_inv_freqs.000.out0.npy"), outside)
    names = sorted(os.listdir(a))
    spoilt = data.draw(st.lists(st.tuples(st.sampled_from(names), _BAD_ANSWERS), max_size=2, unique_by=lambda t: t[0]),
                       label="answer files spoilt")
    for name, how in spoilt:
        _spoil(a / name, how, outside)
    use_iut = data.draw(st.booleans(), label="--iut")
    out = root / "out" / "answers" if use_iut else a
    os.makedirs(root / "out")
    before = {p: os.lstat(os.path.join(root, p)).st_mtime_ns for p in _tree(root)}
    tracemalloc.start()
    try:
        args = [v, out, "--report-json", root / "out" / "r.json"] + (["--iut", ORACLE_IUT] if use_iut else [])
        code, err = _grade(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code in (0, 1, 2, NOTHING_ANSWERED), (code, err)
    assert peak < 128 * MiB, f"{peak / MiB:.0f} MiB"
    if code == 2:
        assert err.startswith("a2ats-conformance grade: ") and "Traceback" not in err, err
    after = {p: os.lstat(os.path.join(root, p)).st_mtime_ns for p in _tree(root)}
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert all(p == "out" or p.startswith("out" + os.sep) for p in changed), sorted(changed)
    if not edits and not deep and not use_iut and spoilt:
        # a non-regular file is refused before any answer is read; a spoilt content is found when read (a case
        # stops at its first wrong answer: a spoilt file after it is not read)
        nonregular = [n for n, h in spoilt if h in ("fifo", "symlink", "dir")]
        # a .error file holds the port's message: any text in it, none included, is a valid answer ("it raised")
        content = [n for n, h in spoilt if (h not in ("fifo", "symlink", "dir", "deleted", "wrong shape")
                                            or (n == "answers.json" and h == "wrong shape"))
                   and not n.endswith(".error")]
        if nonregular or (content and len(spoilt) == 1):
            assert code == 2 and any(n in err for n in nonregular + content), (spoilt, err)
        elif any(h != "deleted" and (h in ("fifo", "symlink", "dir") or not n.endswith(".error"))
                 for n, h in spoilt):
            assert code in (1, 2), (spoilt, code, err)
    if not edits and not deep and not spoilt:
        assert code == 0, err
