"""CACHE-BATCH — ``a2ats-server``: mlx-lm's HTTP server (``mlx_lm.server``) with A2ATS caches.

    a2ats-server --model smollm2 --codebook smollm2-k4096.safetensors --port 8080 [mlx_lm.server flags]

Every flag of ``mlx_lm.server`` works as there; the A2ATS flags (--codebook, --topk, --window, --sinks,
--b) are read first and the codebook is loaded and checked before the server starts. The model may also
be a GGUF file or ``smollm2``, which ``mlx_lm.server`` cannot load. Requests are batched as mlx-lm batches
them (a2ats_ref.runtime.batching: one A2ATSCache per request, merged into an A2ATSBatchCache), and the server's
prompt-cache reuse copies and trims A2ATS caches like its own, up to their prefilled tokens
(``A2ATSPromptCache``): an answer never depends on which requests came before it.

Refused at start, with a message: --kv-bits (mlx-lm would quantize its own caches and leave A2ATS ones
as they are), --draft-model and --adapter-path (the codebook is fitted to one model's weights).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from a2ats_ref import _blas  # noqa: F401  (must load OpenBLAS before mlx.core is imported)

import mlx_lm.server as mlx_server
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.server import ModelProvider

from a2ats_ref.files.gguf import smollm2_path
from a2ats_ref.runtime.cache import A2ATSCache, A2ATSConfig
from a2ats_ref.runtime.codebook import Codebook, CodebookError
from a2ats_ref.runtime.generate import _config, _load_model, _topk
from a2ats_ref.runtime.hook import install_a2ats_cache

__all__ = ["A2ATSModelProvider", "A2ATSPromptCache", "main"]


def _a2ats_parser() -> argparse.ArgumentParser:
    d = A2ATSConfig()
    p = argparse.ArgumentParser(
        prog="a2ats-server", add_help=False,
        description="mlx-lm's HTTP server (mlx_lm.server) with A2ATS caches. These flags are a2ats-server's; "
                    "every other flag is mlx_lm.server's (listed below).",
        epilog="Exit codes: 0 stopped, 2 usage or input error (before the server starts).",
    )
    p.add_argument("--codebook", required=True, metavar="PATH",
                   help="codebook file written by a2ats-calibrate for --model (checked before the server starts)")
    p.add_argument("--topk", type=_topk, default=d.topk,
                   help=f"tokens retrieved per query head: a fraction in (0, 1] of the context (e.g. 0.03) or a count "
                        f"(e.g. 64) (default {d.topk})")
    p.add_argument("--window", type=int, default=d.w, help=f"recent window w, always attended (default {d.w})")
    p.add_argument("--sinks", type=int, default=d.sinks, help=f"attention sinks, always attended (default {d.sinks})")
    p.add_argument("--b", type=int, default=None,
                   help="far relative position b of R_b (default: the b the codebook was calibrated for)")
    return p


class A2ATSModelProvider(ModelProvider):
    """mlx_lm.server's ModelProvider whose models build A2ATS caches (a2ats_ref.runtime.hook.install_a2ats_cache);
    it also loads GGUF files and 'smollm2'."""

    def __init__(self, cli_args, codebook, config, codebook_path: str = "codebook"):
        for flag, v in (("--kv-bits", getattr(cli_args, "kv_bits", None)),
                        ("--draft-model", getattr(cli_args, "draft_model", None)),
                        ("--adapter-path", getattr(cli_args, "adapter_path", None))):
            if v is not None:
                raise ValueError(f"{flag}: not supported with A2ATS (the codebook is fitted to one model's "
                                 "weights, and mlx-lm quantizes only its own caches)")
        self.a2ats_codebook, self.a2ats_config, self.a2ats_codebook_path = codebook, config, codebook_path
        super().__init__(cli_args)
        self.load_default()   # a model the codebook does not fit stops here, not in the generation thread

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("A2ATS: adapters and draft models are not supported")
        src = smollm2_path() if model_path == "smollm2" else Path(model_path)
        if src.is_file():
            self.reset()
            model, tokenizer = _load_model(src, quantized=False)
            self.model_key = (model_path, None, None)
            self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, None
        else:
            super()._load(model_path, None, None)
        try:
            install_a2ats_cache(self.model, self.a2ats_codebook, self.a2ats_config)
        except CodebookError as exc:
            model_key = self.model_key
            self.reset()
            raise ValueError(f"{self.a2ats_codebook_path}: {exc} (model {model_key[0]})") from None
        self.is_batchable = True   # A2ATSCache.merge: mlx-lm's BatchGenerator batches the requests


class A2ATSPromptCache(LRUPromptCache):
    """mlx_lm.server's prompt-cache LRU that hands out an A2ATS cache only up to its prefilled tokens.

    The server keeps each request's cache after it answers (prompt and generated tokens) and gives the nearest
    one to a later prompt that shares its start. Generated tokens hold keys and values that depend on the
    selections of the retrieval decodes that produced them (A2ATSCache.prefilled, runtime.prompt), which a
    prefill of the same tokens does not reproduce. Reused, they would make the later prompt's answer depend on
    the requests before it; so the handed-out cache is trimmed to the tokens every A2ATS layer prefilled, the
    rest of the prompt is prefilled again, and the next token appended is a prompt token (start_prompt).
    """

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is None:
            return cache, rest
        reused = len(tokens) - len(rest)
        keep = min((c.prefilled for c in cache if isinstance(c, A2ATSCache)), default=reused)
        if keep < reused:
            if keep == 0 or not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, reused - keep)
            rest = tokens[keep:]
        for c in cache:
            if isinstance(c, A2ATSCache):
                c.start_prompt()   # what this request appends next is its prompt's
        return cache, rest


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = _a2ats_parser()
    if "-h" in argv or "--help" in argv:
        ours.print_help()
        print("\nmlx_lm.server's flags:\n")
        sys.argv = ["a2ats-server", "--help"]
        try:
            mlx_server.main()
        except SystemExit:
            pass
        return 0
    args, rest = ours.parse_known_args(argv)
    try:
        try:
            codebook = Codebook.load(args.codebook)
        except FileNotFoundError:
            raise ValueError(f"--codebook: {args.codebook} does not exist; write one with a2ats-calibrate") from None
        except CodebookError as exc:
            raise ValueError(f"--codebook: {exc}") from None
        config = _config(args, codebook)
        provider = A2ATSModelProvider
        made = []

        def make_provider(cli_args):
            made.append(provider(cli_args, codebook, config, args.codebook))
            return made[-1]

        old = sys.argv, mlx_server.ModelProvider, mlx_server.LRUPromptCache
        sys.argv = ["a2ats-server", *rest]
        mlx_server.ModelProvider, mlx_server.LRUPromptCache = make_provider, A2ATSPromptCache
        try:
            mlx_server.main()
        finally:
            sys.argv, mlx_server.ModelProvider, mlx_server.LRUPromptCache = old
    except ValueError as exc:
        print(f"a2ats-server: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
