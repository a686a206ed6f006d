"""README.md is user documentation that stays true: its size, its links, its commands, its numbers, its blocks.

- at most 20 KB, so the two commands, the quick start and the real-model path are read, not scrolled past;
- every link stays inside the repository and names a file or folder that exists;
- the test command is exactly what .ci/run runs;
- every number in a Results table is on a results page (spec/results/*.md), which names the command that made it;
- the real-model path runs as written: the calibration command and the passkey block, at smaller sizes (the only
  edits are the size arguments below, each checked to occur exactly once), and the block loads the file the
  command writes;
- the generate/serve block runs as written on a tiny model and the codebook made for it (the only edits: the
  model, the codebook file and the sizes, each checked to occur exactly once): a2ats-generate prints mlx-lm's
  timings, and a2ats-server accepts every flag the block gives it and loads the model.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "spec" / "results"
MAX_BYTES = 20_000

#: the real-model path at test size: README text -> what the test runs instead (sizes only)
CALIBRATE_SMALLER = {"--tokens 4096 --codebook-size 512 --max-iter 5": "--tokens 256 --codebook-size 16 --max-iter 1"}
#: the generate/serve block on the tiny model: README text -> what the test runs instead ({model}, {codebook}: its files)
GENERATE_SMALLER = {"--model smollm2": "--model {model}", "--codebook model-k4096.safetensors": "--codebook {codebook}",
                    "--max-tokens 64": "--max-tokens 8"}
SERVE_SMALLER = {"--model smollm2": "--model {model}", "--codebook model-k4096.safetensors": "--codebook {codebook}"}
PASSKEY_SMALLER = {"filler * 55 + ": "filler * 3 + ", " + filler * 55": " + filler * 3", "max_tokens=8": "max_tokens=2"}


def text() -> str:
    return README.read_text(encoding="utf-8")


def section(name: str) -> str:
    m = re.search(rf"^## {re.escape(name)}[^\n]*\n(.*?)(?=^## |\Z)", text(), flags=re.M | re.S)
    assert m, f"README.md has no '## {name}' section"
    return m.group(1)


def blocks(md: str, lang: str) -> list[str]:
    return [b.group(2) for b in re.finditer(r"^```([^\n]*)\n(.*?)^```[ \t]*$", md, flags=re.M | re.S)
            if b.group(1).strip() == lang]


def test_readme_is_at_most_20_kb():
    size = len(README.read_bytes())
    assert size <= MAX_BYTES, f"README.md is {size} bytes; at most {MAX_BYTES}: move results to spec/results pages"


def test_no_link_leaves_the_repository():
    t = text()
    assert not re.search(r"https?://|www\.", t), "README.md links outside the repository"
    for target in re.findall(r"\]\(([^)\s]+)\)", t):
        path = target.split("#", 1)[0]
        if not path:   # an anchor in the README itself
            continue
        resolved = (ROOT / path).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"README link {target!r} does not name a repo path"


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1].strip()
    two = blocks(section("The two commands"), "bash")
    assert len(two) == 2, "'## The two commands' holds the main job and the test command"
    assert two[1].strip() == ci, f"README's test command differs from .ci/run's:\n{two[1].strip()}\n{ci}"


def _numbers(cell: str) -> list[str]:
    cell = re.sub(r"`[^`]*`", "", cell)   # commands, flags and identifiers are not measurements
    return [n for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", cell) if n.strip(",")]


def results_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(RESULTS.glob("*.md")))


def test_every_number_in_a_readme_table_is_on_a_results_page():
    pages = results_text()
    flat = pages.replace(",", "")
    missing = []
    for line in section("Results").splitlines():   # the measured tables (the exit-code table is not measured)
        if not line.startswith("|") or re.match(r"^\|[-:| ]+\|$", line):
            continue
        for n in _numbers(line):
            if n.rstrip(",") not in pages and n.replace(",", "") not in flat:
                missing.append(f"{n!r} in {line.strip()[:100]}")
    assert not missing, "README table numbers found on no spec/results page:\n" + "\n".join(missing)


def test_number_check_catches_an_invented_figure():
    assert _numbers("| 16,384 | float32 | 41.43 | `--T 65536` |") == ["16,384", "41.43"]   # float32 and flags are not figures
    assert "987654.321" not in results_text()


def test_the_generate_block_loads_the_file_the_calibration_writes():
    part = section("Five minutes with a real model")
    (cmd,), (code,) = blocks(part, "bash"), blocks(part, "python")
    args = shlex.split(cmd)
    out = args[args.index("--out") + 1]
    assert f'Codebook.load("{out}")' in code, f"the generate block must load {out!r}, the file the command writes"


def _smaller(s: str, edits: dict) -> str:
    for old, new in edits.items():
        assert s.count(old) == 1, f"README block: expected {old!r} once (update the test's size edits with it)"
        s = s.replace(old, new)
    return s


def test_the_real_model_path_runs(tmp_path, monkeypatch):
    from a2ats_ref.files import gguf

    gguf.smollm2_path()   # the model the test command installs; its error says how
    part = section("Five minutes with a real model")
    (cmd,), (code,) = blocks(part, "bash"), blocks(part, "python")
    cmd = _smaller(cmd.strip(), CALIBRATE_SMALLER)
    assert cmd.startswith(".venv/bin/")
    args = shlex.split(cmd)
    args[0] = str(Path(sys.executable).parent / Path(args[0]).name)   # the .venv this test runs in
    run = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    out = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: out.append(" ".join(map(str, a))))
    exec(compile(_smaller(code, PASSKEY_SMALLER), "README.md:passkey", "exec"), {"__name__": "__readme__"})
    assert out[0].endswith("prompt tokens") and [o.split(":")[0] for o in out[1:]] == ["dense", "A2ATS"], out


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from test_generate_cli import tiny_model_and_codebook   # tests/runtime: the tiny model folder and its codebook

    return tiny_model_and_codebook(tmp_path_factory.mktemp("readme-tiny"))


def _block_line(prog: str, edits: dict, files) -> list[str]:
    """The README's one `prog` line of the generate/serve block, at test size, split as the shell would."""
    (block,) = [b for b in blocks(section("Using A2ATS with a real model"), "bash") if "a2ats-generate" in b]
    (line,) = [l.strip() for l in block.splitlines() if l.strip().startswith(prog + " ")]
    model, codebook = (shlex.quote(str(f)) for f in files)
    args = shlex.split(_smaller(line, {k: v.format(model=model, codebook=codebook) for k, v in edits.items()}))
    assert [a for a in args if a.startswith("-")] == [a for a in shlex.split(line) if a.startswith("-")]
    return args


def test_the_readme_generate_line_runs(tiny_files):
    args = _block_line("a2ats-generate", GENERATE_SMALLER, tiny_files)
    args[0] = str(Path(sys.executable).parent / args[0])   # the .venv's entry point
    run = subprocess.run(args, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^Generation: \d+ tokens, [\d.]+ tokens-per-sec$", run.stdout, flags=re.M), run.stdout


def test_the_readme_server_line_parses_and_loads(tiny_files, monkeypatch):
    import mlx_lm.server as mlx_server

    from a2ats_ref.runtime import server

    args = _block_line("a2ats-server", SERVE_SMALLER, tiny_files)
    served = []
    monkeypatch.setattr(mlx_server, "run", lambda host, port, provider: served.append((port, provider)))
    try:
        rc = server.main(args[1:])
    except SystemExit as exc:   # argparse refused a flag of the README's line
        pytest.fail(f"a2ats-server refused the README's flags {args[1:]} (exit {exc.code})")
    assert rc == 0 and len(served) == 1, "a2ats-server did not reach the point where it serves"
    port, provider = served[0]
    assert port == int(args[args.index("--port") + 1]) and provider.model is not None
