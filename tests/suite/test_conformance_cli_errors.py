"""a2ats-conformance's usage errors name the flag and the path, and give no traceback: report paths that collide,
an empty, unwritable or full vectors folder, a negative seed, unknown clause IDs; its help lists the
subcommands and every flag has a help text."""

import contextlib
import io
import os
import subprocess
import sys

import pytest

from a2ats_conformance.run.cli import _parser, main as cli_main
from hang_guard import HANG_S


def _main(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli_main(list(map(str, args)))
        except SystemExit as exc:      # argparse's usage errors
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize("sub", [["--clauses", "ROPE-FREQ"], ["grade", "VEC", "ANS"]])
def test_two_reports_on_one_path_are_refused_naming_both_flags(tmp_path, sub):
    same = tmp_path / "r.out"
    code, err = _main(*sub, "--report-json", same, "--report-md", same)
    assert code == 2 and "--report-json" in err and "--report-md" in err and "same file" in err, err
    assert not same.exists()


def test_unknown_clause_ids_name_the_flag():
    code, err = _main("--clauses", "ROPE-FREQ,NOPE", "--profile", "quick")
    assert code == 2 and "--clauses" in err and "'NOPE' is not a clause ID" in err, err


@pytest.mark.parametrize("seed", ["-1", "x"])
def test_a_bad_vectors_seed_names_the_flag(tmp_path, seed):
    code, err = _main("vectors", "--out", tmp_path / "v", "--seed", seed)
    assert code == 2 and "--seed" in err and ">= 0" in err and "Traceback" not in err, err
    assert not (tmp_path / "v").exists()


def test_an_empty_vectors_out_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _main("vectors", "--out", "")
    assert code == 2 and "--out" in err and "empty" in err, err
    assert os.listdir(tmp_path) == []


def test_an_unwritable_vectors_out_names_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = _main("vectors", "--out", blocker / "sub")
    assert code == 2 and str(blocker / "sub") in err and "Traceback" not in err, err


# A file-size limit set after the imports (Python ignores SIGXFSZ, so a write past it fails with EFBIG), as a
# full disk would fail it.
_FULL = ("import resource, sys; from a2ats_conformance.run.cli import main; from a2ats_conformance import vectors; "
         "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); sys.exit(main(sys.argv[1:]))")


def test_a_full_disk_names_the_path_and_leaves_no_manifest(tmp_path):
    out = tmp_path / "v"
    p = subprocess.run([sys.executable, "-c", _FULL, "vectors", "--out", str(out)], capture_output=True, text=True,
                       timeout=HANG_S)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert str(out) in p.stderr and "cannot be written" in p.stderr, p.stderr
    assert not (out / "manifest.json").exists()


def test_help_lists_the_subcommands_and_every_flag_has_help(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    text = capsys.readouterr().out
    assert "a2ats-conformance vectors" in text and "a2ats-conformance grade" in text
    from a2ats_conformance.vectors import export as vectors, grade

    bare = []
    for name, make in (("a2ats-conformance", _parser), ("vectors", vectors.parser), ("grade", grade.parser)):
        p = make()
        bare += [f"{name} {a.option_strings}" for a in p._actions if a.option_strings and not a.help]
        assert "exit status" in " ".join(p.format_help().split()), name
    assert not bare, bare
