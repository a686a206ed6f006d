"""Help texts of a2ats-bench, a2ats-calibrate, a2ats-generate and a2ats-server (its own flags): every argument has help, the text reads as
plain text (no reST backticks), and a2ats-bench describes both of its benchmarks."""

from __future__ import annotations

import pytest

from a2ats_ref.bench import cli as bench
from a2ats_ref.calibration import calibrate
from a2ats_ref.runtime import generate, server

PARSERS = {"a2ats-bench": bench._parser, "a2ats-calibrate": calibrate._parser, "a2ats-generate": generate._parser,
           "a2ats-server": server._a2ats_parser}


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_argument_has_help_and_no_backticks(prog):
    parser = PARSERS[prog]()
    missing = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
    assert not missing, f"{prog}: arguments without help: {missing}"
    text = parser.format_help()
    assert "`" not in text, f"{prog} --help shows literal backticks:\n{text}"
    assert parser.epilog and "exit codes" in parser.epilog.lower(), f"{prog}: --help does not list its exit codes"


def test_bench_help_describes_speed_and_fidelity():
    text = bench._parser().format_help()
    for what, words in (("speed", "decode-step time"), ("fidelity", "perplexity")):
        line = next((l for l in text.splitlines() if l.strip().startswith(what + " ")), "")
        assert line, f"a2ats-bench --help does not describe {what}:\n{text}"
        assert words in text


def test_help_runs(capsys):
    for main in (bench.main, calibrate.main, generate.main):
        with pytest.raises(SystemExit) as exc:
            main(["--help"])
        assert exc.value.code == 0
    assert "usage: a2ats-generate" in capsys.readouterr().out
