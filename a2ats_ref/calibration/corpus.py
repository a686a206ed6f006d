"""Calibration text: user files/folders, or a default corpus that ships with Python, plus a UUID tail.

The authors calibrate on about 64K tokens of web text plus about 16K tokens of random UUID
strings. Nothing may be downloaded here, so the default text is the Python standard library's
own ``.py`` sources (code, docstrings, comments), read in a fixed order: sorted by the sha256 of
the path relative to the stdlib root, which mixes modules without any randomness. That text
depends on the Python version, which the codebook metadata records.

The UUID tail is ``uuid_fraction`` x (text tokens) tokens of random UUID4 strings drawn from
``random.Random(seed)``.

Packing. ``packing="documents"`` (the default) follows the authors (vqkey/notebooks/construct_codebooks.py
at 71f10b0, lines 170-204): every document is its own sequence, BOS first, cut at ``seq_len`` tokens
(16,384 there), and the UUID tail is one more such sequence of UUIDs joined by ", " (continued in further
sequences if it is longer than ``seq_len``). The last document is cut so the text totals exactly the budget.
``packing="packed"``: documents joined by EOS into ``seq_len``-token sequences, no BOS, one UUID per line.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import sysconfig
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".html", ".c", ".h", ".toml", ".cfg", ".ini", ".csv")


# Held out of the default calibration corpus: a2ats-bench evaluates fidelity on these stdlib packages,
# and evaluation text must be disjoint from calibration text.
EVAL_PACKAGES = ("asyncio",)


def stdlib_files() -> list[Path]:
    """The stdlib's .py files (site-packages, test suites and EVAL_PACKAGES excluded), in the fixed corpus order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", *EVAL_PACKAGES}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [n for n in dirnames if n not in skip]
        rel_dir = Path(dirpath).relative_to(root)
        for n in filenames:
            if n.endswith(".py"):
                rel = (rel_dir / n).as_posix()
                files.append((hashlib.sha256(rel.encode()).hexdigest(), Path(dirpath) / n))
    files.sort()
    return [p for _, p in files]


def user_files(paths: Iterable) -> list[Path]:
    """Files named by the user; folders are walked (sorted) for text-like files."""
    out = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FileNotFoundError(f"--text: {p} does not exist")
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise ValueError(f"--text: folder {p} holds no text files ({', '.join(TEXT_SUFFIXES)})")
            out.extend(found)
        elif not p.is_file():  # a device or pipe (/dev/zero, a FIFO) would be read forever
            raise ValueError(f"--text: {p} is not a regular file or folder; pass text files or folders of them")
        else:
            out.append(p)
    return out


def read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"cannot read calibration text {p}: {exc}") from None


def uuid_text(n_lines: int, seed: int, sep: str = "\n") -> str:
    rng = random.Random(seed)
    return sep.join(str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(n_lines))


@dataclass
class Corpus:
    """Token sequences ready for :func:`a2ats_ref.calibration.collect.collect` plus a description for metadata."""

    sequences: list = field(default_factory=list)
    text_tokens: int = 0
    uuid_tokens: int = 0
    description: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.text_tokens + self.uuid_tokens


def _encode(tokenizer, text: str) -> list[int]:
    enc = getattr(tokenizer, "encode")
    try:
        return list(enc(text, add_special_tokens=False))
    except TypeError:
        return list(enc(text))


def _pack(docs: Iterator[list[int]], budget: int, seq_len: int, sep: int | None) -> tuple[list, int]:
    """Concatenate documents (separated by ``sep``) into sequences of ``seq_len`` until ``budget`` tokens."""
    seqs, cur, total = [], [], 0
    for ids in docs:
        if sep is not None and cur:
            ids = [sep] + ids
        for tok in ids:
            if total >= budget:
                break
            cur.append(tok)
            total += 1
            if len(cur) == seq_len:
                seqs.append(cur)
                cur = []
        if total >= budget:
            break
    if cur:
        seqs.append(cur)
    return seqs, total


def _documents(docs: Iterator[list[int]], budget: int, seq_len: int, bos: list[int],
               *, continue_long: bool = False) -> tuple[list, int]:
    """Each document its own sequence, ``bos`` first, cut at ``seq_len`` tokens (or, with ``continue_long``,
    continued in further ``bos``-led sequences), until ``budget`` tokens."""
    seqs, total = [], 0
    for ids in docs:
        while total < budget:
            take = min(seq_len, budget - total) - len(bos)
            if take <= 0:
                return seqs, total
            seqs.append(bos + ids[:take])
            total += len(seqs[-1])
            ids = ids[take:]
            if not (continue_long and ids):
                break
        if total >= budget:
            break
    return seqs, total


def build_corpus(
    tokenizer,
    *,
    paths=None,
    tokens: int = 65536,
    uuid_fraction: float = 0.25,
    seq_len: int = 16384,
    seed: int = 0,
    packing: str = "documents",
) -> Corpus:
    """Tokenised calibration corpus: ``tokens`` text tokens, then ``uuid_fraction * tokens`` UUID tokens.

    Fewer text tokens may come back when the text runs out (the caller checks the count).
    """
    if tokens < 1:
        raise ValueError(f"tokens: expected a positive token budget, got {tokens}")
    if not (0 <= uuid_fraction <= 10):
        raise ValueError(f"uuid_fraction: expected a number in [0, 10] (UUID tokens per text token), got {uuid_fraction}")
    if seq_len < 1:
        raise ValueError(f"seq_len: expected a positive sequence length, got {seq_len}")
    if packing not in ("documents", "packed"):
        raise ValueError(f"packing: expected 'documents' (the authors') or 'packed', got {packing!r}")
    files = user_files(paths) if paths else stdlib_files()
    source = "user" if paths else "python-stdlib"
    sep = getattr(tokenizer, "eos_token_id", None)

    def docs():
        for p in files:
            text = read_text(p)
            if text.strip():
                yield _encode(tokenizer, text)

    bos_id = getattr(tokenizer, "bos_token_id", None)
    bos = [bos_id] if packing == "documents" and bos_id is not None else []
    if seq_len <= len(bos):
        raise ValueError(f"seq_len: a sequence holds BOS and at least one token, so it must be >= 2, got {seq_len}")
    if packing == "documents":
        seqs, n_text = _documents(docs(), tokens, seq_len, bos)
    else:
        seqs, n_text = _pack(docs(), tokens, seq_len, sep)
    joiner = ", " if packing == "documents" else "\n"
    n_uuid_target = int(round(uuid_fraction * n_text))
    n_uuid = 0
    if n_uuid_target > 0:
        # ~ 25 tokens per UUID line for byte-level BPEs; draw generously, then cut to the budget.
        lines = max(16, n_uuid_target // 8)
        ids = _encode(tokenizer, uuid_text(lines, seed, joiner))
        while len(ids) < n_uuid_target:
            lines *= 2
            ids = _encode(tokenizer, uuid_text(lines, seed, joiner))
        if packing == "documents":
            useq, n_uuid = _documents(iter([ids]), n_uuid_target, seq_len, bos, continue_long=True)
        else:
            useq, n_uuid = _pack(iter([ids]), n_uuid_target, seq_len, None)
        seqs.extend(useq)
    desc = {
        "source": source,
        "files": len(files) if not paths else [str(p) for p in files][:50],
        "python": sys.version.split()[0] if not paths else None,
        "text_tokens": n_text,
        "uuid_tokens": n_uuid,
        "uuid_fraction": uuid_fraction,
        "uuid_seed": seed,
        "seq_len": seq_len,
        "packing": packing,
        "bos_token_id": bos[0] if bos else None,
    }
    return Corpus(sequences=seqs, text_tokens=n_text, uuid_tokens=n_uuid, description=desc)
