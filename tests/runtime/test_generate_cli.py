"""a2ats-generate on a tiny mlx-lm model folder with a codebook calibrated for it: A2ATS and --dense, the
codebook checks (before the model loads where the folder's config allows), and the flags' help."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from a2ats_ref.calibration import calibrate as cal
from a2ats_ref.runtime import generate as gen
from a2ats_ref.runtime.cache import A2ATSCache
from a2ats_ref.runtime.codebook import Codebook
from test_cache_support import HEAD_DIM, N_HEADS, N_KV, N_LAYERS, VOCAB, tiny_llama
from hang_guard import HANG_S

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun "


def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {chr(97 + i): i for i in range(26)}
    vocab[" "], vocab["<eos>"] = 26, 27
    vocab.update({f"<x{i}>": i for i in range(28, VOCAB)})
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tk.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def _model_folder(path: Path, seed: int) -> Path:
    """An mlx-lm model folder (config.json, weights, tokenizer) holding tiny_llama(seed)."""
    path.mkdir()
    model = tiny_llama(seed=seed)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_hidden_layers=N_LAYERS, intermediate_size=128,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
        vocab_size=VOCAB, rope_traditional=False, rope_theta=10000.0, tie_word_embeddings=False)))
    _tokenizer().save_pretrained(str(path))
    return path


def tiny_model_and_codebook(root: Path) -> tuple[Path, Path]:
    """The tiny model folder under root and the codebook file calibrated for it."""
    from a2ats_ref.files.gguf import load_model

    folder = _model_folder(root / "tiny", seed=0)
    text = root / "calib.txt"
    text.write_text(WORDS * 20)
    model, tok = load_model(folder)
    cb = cal.calibrate(model, tok, texts=[text], tokens=400, codebook_size=16, b=64, seed=0, seq_len=128,
                       packing="packed", chunk=64, quiet=True)
    return folder, cb.save(root / "tiny-k16.safetensors")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    folder, path = tiny_model_and_codebook(root)
    return folder, _model_folder(root / "tiny-other-weights", seed=1), path


def run(argv, capsys, monkeypatch=None, stdin=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = gen.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def timings(out: str) -> tuple[int, int]:
    p = re.search(r"Prompt: (\d+) tokens, [\d.]+ tokens-per-sec", out)
    g = re.search(r"Generation: (\d+) tokens, [\d.]+ tokens-per-sec", out)
    assert p and g, out
    return int(p.group(1)), int(g.group(1))


def generated(out: str) -> str:
    return out.split("==========")[0].strip() if "==========" in out else out.strip()


def test_a2ats_and_dense_both_ways(files, capsys, monkeypatch):
    folder, _, cb = files
    calls = []
    orig = A2ATSCache.decode
    monkeypatch.setattr(A2ATSCache, "decode", lambda self, q, **k: calls.append(1) or orig(self, q, **k))
    common = ["--model", folder, "--prompt", WORDS * 2, "--max-tokens", 12, "--ignore-chat-template", "--temp", 0]
    rc, out_a, err = run(common + ["--codebook", cb, "--topk", 1.0, "--window", 4, "--sinks", 2], capsys)
    assert rc == 0, err
    assert "A2ATS (w=4, b=64, sinks=2, topk=1.0" in err   # b: the codebook's own
    n_prompt, n_gen = timings(out_a)
    assert n_prompt == len(WORDS * 2) and 1 <= n_gen <= 12 and calls, "decode did not run A2ATS"
    rc, out_d, err = run(common + ["--dense"], capsys)
    assert rc == 0 and "dense" in err, err
    assert timings(out_d)[0] == n_prompt
    # every token selected (topk 1.0): A2ATS attends to what dense attention does, so greedy text agrees
    assert generated(out_a.split("==========", 1)[1]) == generated(out_d.split("==========", 1)[1])
    rc, out_s, _ = run(common + ["--codebook", cb, "--topk", 3, "--window", 4, "--verbose", "False"], capsys)
    assert rc == 0 and "tokens-per-sec" not in out_s and out_s.strip()


def test_a_long_prefill_reports_progress_on_stderr_and_stdout_is_unchanged(files, capsys, monkeypatch):
    folder, _, cb = files
    argv = ["--model", folder, "--codebook", cb, "--prompt", WORDS * 2, "--max-tokens", 6, "--ignore-chat-template",
            "--prefill-step-size", 16]   # one token per character: 170 prompt tokens, over 2 steps of 16
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    lines = re.findall(r"^\[a2ats-generate\] prefill (\d+)/(\d+) tokens, [\d.]+ tokens/s$", err, flags=re.M)
    assert len(lines) >= 2 and {int(t) for _, t in lines} == {len(WORDS * 2)}, err
    assert [int(d) for d, _ in lines] == sorted(int(d) for d, _ in lines) and int(lines[-1][0]) == len(WORDS * 2)
    monkeypatch.setattr(gen, "PROGRESS_AFTER_STEPS", 10**6)   # the same run, now below the threshold
    rc, out_short, err_short = run(argv, capsys)
    assert rc == 0 and "] prefill " not in err_short, err_short
    rates = lambda s: re.sub(r"[\d.]+ (tokens-per-sec|GB)", r"N \1", s)   # timings differ from run to run
    assert rates(out) == rates(out_short) and "] prefill " not in out
    timings(out)


def test_prompt_from_stdin_chat_template_and_sampling(files, capsys, monkeypatch):
    folder, _, cb = files
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    rc, out, err = run(["--model", folder, "--codebook", cb, "--prompt", "-", "--max-tokens", 5, "--temp", 0.8,
                        "--top-p", 0.9, "--seed", 3, "--chat-template", template], capsys, monkeypatch,
                       stdin="the lazy dog")
    assert rc == 0, err
    assert timings(out)[0] == len("the lazy dog ")   # the template's rendering of the one message


@pytest.mark.parametrize("case", ["missing", "mismatched-shapes", "not-a-codebook"])
def test_bad_codebook_fails_before_the_model_loads_naming_the_file(files, tmp_path, capsys, monkeypatch, case):
    folder, _, cb = files
    import a2ats_ref.files.gguf as gguf

    monkeypatch.setattr(gguf, "load_model", lambda *a, **k: pytest.fail("the model loaded before the codebook check"))
    path = tmp_path / f"{case}.safetensors"
    if case == "mismatched-shapes":
        good = Codebook.load(cb)
        meta = json.loads(json.dumps(good.meta))
        meta["model"]["n_layers"] = 1
        Codebook(good.cz[:1], good.Ls[:1], meta).save(path)   # a one-layer model's codebook; the model has two
    elif case == "not-a-codebook":
        path.write_bytes(b"\x00" * 64)
    rc, _, err = run(["--model", folder, "--codebook", path, "--prompt", "x"], capsys)
    assert rc == 2 and str(path) in err and "Traceback" not in err, err


def test_codebook_of_other_weights_is_refused_before_generating(files, capsys):
    _, other, cb = files
    rc, out, err = run(["--model", other, "--codebook", cb, "--prompt", "x"], capsys)
    assert rc == 2 and str(cb) in err and "weights_fingerprint" in err and "Prompt:" not in out, err


@pytest.mark.parametrize("argv, named", [
    (["--prompt", "x"], "--codebook"),
    (["--dense", "--codebook", "cb.safetensors"], "--dense"),
    (["--dense", "--max-tokens", "0"], "--max-tokens"),
    (["--dense", "--top-p", "0"], "--top-p"),
])
def test_usage_errors_name_the_flag(files, capsys, argv, named):
    folder = files[0]
    rc, _, err = run(["--model", folder] + argv, capsys)
    assert rc == 2 and named in err, err


def test_bad_a2ats_setting_names_the_flag(files, capsys):
    folder, _, cb = files
    rc, _, err = run(["--model", folder, "--codebook", cb, "--window", "-1"], capsys)
    assert rc == 2 and "--window" in err, err


def _crafted_weights(folder: Path, case: str) -> str:
    """Edit the copied model folder's weights as a hostile folder would; -> what the error must name."""
    f = folder / "model.safetensors"
    if case == "nan-weight":
        w = mx.load(str(f))
        name = sorted(w)[0]
        w[name] = mx.full(w[name].shape, float("nan"), w[name].dtype)
        mx.save_safetensors(str(f), w)
        return name
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    a, b = sorted(k for k in h if k != "__metadata__" and h[k]["shape"])[:2]
    if case == "aliased-span":   # two weights on one stored array: mlx-lm's loader would read both from it
        h[b] = dict(h[a])
    else:                        # a size past 32 bits, which MLX's reader narrows
        h[a]["shape"][0] += 2**32
    text = json.dumps(h).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return "model.safetensors"


@pytest.mark.parametrize("case", ["aliased-span", "wrapped-shape", "nan-weight"])
def test_a_crafted_model_folder_is_refused_naming_the_file(files, tmp_path, capsys, case):
    import shutil

    folder = Path(shutil.copytree(files[0], tmp_path / "model"))
    named = _crafted_weights(folder, case)
    rc, out, err = run(["--model", folder, "--dense", "--prompt", "x"], capsys)
    assert rc == 2 and named in err and str(folder) in err and "Traceback" not in err and "Prompt:" not in out, err


def test_missing_model_names_the_path(tmp_path, capsys):
    rc, _, err = run(["--model", tmp_path / "nope", "--dense"], capsys)
    assert rc == 2 and "nope" in err and "never downloads" in err


def test_console_script_and_help():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["a2ats-generate"] == "a2ats_ref.runtime.generate:main"
    parser = gen._parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings or action.dest} has no help"
    out = subprocess.run([sys.executable, "-m", "a2ats_ref.runtime.generate", "--help"], capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 0 and "--codebook" in out.stdout and "--dense" in out.stdout and "`" not in out.stdout


def test_a_weight_file_swapped_in_after_the_check_is_never_read_unchecked(files, tmp_path, capsys, monkeypatch):
    """mlx-lm reads a model folder's weights by path: a crafted file renamed over the checked one between the
    folder check and mlx-lm's read must still be refused, naming the file."""
    import shutil
    from a2ats_ref.files import gguf

    folder = Path(shutil.copytree(files[0], tmp_path / "model"))
    crafted = Path(shutil.copytree(files[0], tmp_path / "crafted"))
    _crafted_weights(crafted, "aliased-span")
    checked = gguf.check_model_folder

    def check_then_swap(p):
        checked(p)
        (crafted / "model.safetensors").replace(folder / "model.safetensors")

    monkeypatch.setattr(gguf, "check_model_folder", check_then_swap)
    original = mx.load
    rc, out, err = run(["--model", folder, "--dense", "--prompt", "x"], capsys)
    assert rc == 2 and "model.safetensors" in err and "Traceback" not in err and "Prompt:" not in out, err
    assert mx.load is original   # the checked loader is in place only while mlx-lm loads
