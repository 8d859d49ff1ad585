"""Calibration / evaluation windows from text files or Hugging Face datasets.

protocol.md: tokenize the joined split with the model's tokenizer (no special tokens),
cut it into consecutive non-overlapping windows of 512 tokens; calibration uses the first
32 calibration windows, evaluation the first 16 evaluation windows. Each window starts
the way the tokenizer starts a sequence (:func:`sequence_prefix`: BOS, or a family's
prefix) followed by text tokens, so a model is measured as it is served; a tokenizer
that prepends nothing (SmolLM2's) gives windows of text alone, as before. ``raw``
windows leave the prefix out.

A text file is read as a stream: only as much of it as the windows asked for need (a
prefix, doubled until it holds enough tokens), so memory grows with the windows, not
with the file; the tokens are those of the whole text (the prefix is cut at a line end
and a margin of tokens before the cut is never used).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from fp4sense import defaults
from fp4sense.inputs.assets import ensure_text
from fp4sense.validate import UserError

__all__ = [
    "DataError",
    "EVAL_WINDOWS",
    "CALIB_WINDOWS",
    "WINDOW_TOKENS",
    "load_text",
    "model_context",
    "read_text",
    "make_windows",
    "protocol_windows",
    "sequence_prefix",
    "tokenizer_warning",
    "window_prefix",
]

WINDOW_TOKENS = defaults.WINDOW_TOKENS
CALIB_WINDOWS = 32
EVAL_WINDOWS = 16
# how results name the default evaluation text
PROTOCOL_EVAL_TEXT = "protocol evaluation split"


class DataError(UserError, ValueError):
    """Text input is missing or too short (says how many tokens are needed)."""


def load_text(source: str | os.PathLike | None = None, split: str = "calibration") -> str:
    """Text from a file, an HF dataset (``dataset:NAME[:CONFIG][:SPLIT]``) or the default,
    whole (:func:`read_text` reads only a prefix).

    With ``source=None`` the bundled State of the Union ``split`` is used (fetched into
    the cache if missing).
    """
    return read_text(source, split)[0]


def read_text(source: str | os.PathLike | None = None, split: str = "calibration",
              chars: int | None = None) -> tuple[str, bool]:
    """The first ``chars`` characters of the text :func:`load_text` reads (all of it
    when None), and whether that is the whole text. A file is read no further."""
    if source is None:
        source = ensure_text()[split]
    text_source = str(source)
    if text_source.startswith("dataset:"):
        text = _dataset_text(text_source[len("dataset:"):])
        return (text, True) if chars is None else (text[:chars], len(text) <= chars)
    path = Path(text_source)
    if path.is_dir():
        raise DataError(f"--text {path} is a folder; give one text file (join the files "
                        "first, e.g. cat *.txt > all.txt) or dataset:NAME[:CONFIG][:SPLIT]")
    if not path.exists():
        raise DataError(
            f"text file {path} not found; pass a text file path or dataset:NAME[:CONFIG][:SPLIT]"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read() if chars is None else f.read(chars + 1)
    except UnicodeDecodeError as exc:
        raise DataError(f"text file {path} is not UTF-8 text (byte {exc.start}); convert it "
                        "(e.g. iconv -t utf-8) or pass another file") from None
    except OSError as exc:
        raise DataError(f"text file {path} cannot be read ({exc.strerror})") from None
    if not text.strip():
        raise DataError(f"text file {path} is empty; pass a file with text in it")
    whole = chars is None or len(text) <= chars
    return text if whole else text[:chars], whole


def _dataset_text(spec: str) -> str:
    parts = spec.split(":")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 else "train"
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DataError("reading an HF dataset needs the 'datasets' package") from exc
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name or split, ...: one line naming it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"dataset {spec!r} could not be loaded ({type(exc).__name__}: "
                        f"{first}); check the name and the network, or pass --text FILE"
                        ) from None
    if len(ds) == 0 or not ds.column_names:
        raise DataError(f"dataset {spec!r} has no text")
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n\n".join(str(t) for t in ds[column])


def model_context(config) -> int | None:
    """A model's context length in tokens (``max_position_embeddings`` of its text
    config), from a transformers config or a config.json's dict; None when it says none."""
    if isinstance(config, dict):
        config = config.get("text_config") or config
        value = config.get("max_position_embeddings")
    else:
        value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


#: what the prefix probe encodes (any text does; the prefix is what comes before it)
_PROBE = "Hello world"


def sequence_prefix(tokenizer) -> list[int]:
    """The token ids the tokenizer puts before a text when it encodes a sequence with its
    special tokens (``[bos]`` for Llama and Gemma; ``[]`` for a tokenizer that adds
    none, e.g. SmolLM2's). Tokens it appends (EOS) are not part of it."""
    plain = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(_PROBE, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def window_prefix(tokenizer, raw: bool = False) -> list[int]:
    """The tokens every window starts with: the tokenizer's :func:`sequence_prefix`, or
    none for ``raw`` windows (what reports and plan.json record as ``window_prefix``)."""
    return [] if raw else sequence_prefix(tokenizer)


def make_windows(
    tokenizer, text: str, n_windows: int, window_tokens: int = WINDOW_TOKENS,
    what: str = "text", raw: bool = False,
) -> torch.Tensor:
    """The first ``n_windows`` windows of ``window_tokens`` tokens: (n, T) int64. Each is
    the tokenizer's :func:`sequence_prefix` followed by the next consecutive text tokens
    (``raw``: text tokens only)."""
    head = window_prefix(tokenizer, raw)
    body = window_tokens - len(head)
    if body < 1:
        raise DataError(f"windows of {window_tokens} tokens leave no room for text after the "
                        f"{len(head)} token(s) the tokenizer starts a sequence with; use "
                        "longer windows (--tokens)")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return _rows(ids, head, n_windows, body, window_tokens, what)


def _rows(ids: list[int], head: list[int], n_windows: int, body: int, window_tokens: int,
          what: str) -> torch.Tensor:
    needed = n_windows * body
    if len(ids) < needed:
        raise DataError(
            f"{what} has {len(ids):,} tokens but {n_windows} windows of {window_tokens} "
            f"need {needed:,}; give more text or ask for fewer windows"
        )
    rows = torch.tensor(ids[:needed], dtype=torch.long).view(n_windows, body)
    if head:
        rows = torch.cat([torch.tensor(head, dtype=torch.long).expand(n_windows, -1), rows], 1)
    return rows


def protocol_windows(tokenizer, split: str, n_windows: int | None = None,
                     source: str | os.PathLike | None = None,
                     window_tokens: int = WINDOW_TOKENS, raw: bool = False,
                     context: int | None = None,
                     log: Callable[[str], None] | None = None) -> torch.Tensor:
    """Windows of the protocol's split (calibration: 32, evaluation: 16 by default), or
    of ``source`` (a text file or ``dataset:...``) in its place; each starts with the
    tokenizer's :func:`sequence_prefix` unless ``raw``. ``context``: the model's
    context length, which a window may not exceed. The text is read as a stream. A
    tokenizer that gives about one token per character (:func:`tokenizer_warning`) is
    named through ``log`` before any work."""
    n = n_windows if n_windows is not None else (
        CALIB_WINDOWS if split == "calibration" else EVAL_WINDOWS)
    if n < 1 or window_tokens < 1:
        raise DataError(f"windows ({n}) and tokens per window ({window_tokens}) must be at "
                        "least 1")
    if context is not None and window_tokens > context:
        raise DataError(f"--tokens {window_tokens} is longer than the model's context of "
                        f"{context} tokens (max_position_embeddings); use --tokens {context} "
                        "or fewer")
    what = str(source) if source is not None else f"the {split} split"
    head = window_prefix(tokenizer, raw)
    body = window_tokens - len(head)
    if body < 1:
        return make_windows(tokenizer, "", n, window_tokens, what, raw)  # says why
    ids, read = _stream_tokens(tokenizer, source, split, n * body)
    warning = tokenizer_warning(tokenizer, read, len(ids))
    if warning and log is not None:
        log(warning)
    return _rows(ids, head, n, body, window_tokens, what)


#: tokens before the cut of a text prefix that are never used: a cut can change how the
#: last words before it tokenize, never more than a few tokens back
_CUT_MARGIN = 64
#: characters read per needed token at first (English runs 4-5 per token)
_CHARS_PER_TOKEN = 8


def _stream_tokens(tokenizer, source, split: str, needed: int) -> tuple[list[int], str]:
    """At least ``needed`` tokens of the text, as tokenizing it whole gives them (all of
    them when the text is shorter), from a prefix doubled until it holds enough; and the
    prefix they were read from."""
    chars = needed * _CHARS_PER_TOKEN + 4096
    if source is None:  # the bundled split, fetched and checked once, not per prefix
        source = ensure_text()[split]
    while True:
        text, whole = read_text(source, split, chars)
        if not whole:
            line_end = text.rfind("\n", len(text) // 2)
            text = text[:line_end + 1] if line_end >= 0 else text
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if whole or len(ids) >= needed + _CUT_MARGIN:
            return ids, text
        chars *= 2


#: fewer characters per token than this on text that is not mostly CJK (where a token
#: per character is normal): a tokenizer that splits words into characters (subword
#: tokenizers give 3-5 on English prose)
MIN_CHARS_PER_TOKEN = 1.5


def tokenizer_warning(tokenizer, text: str, n_tokens: int) -> str | None:
    """One warning line when ``tokenizer`` gave ``text`` about a token per character,
    naming the tokenizer's folder; None when it looks like a subword tokenizer."""
    if not n_tokens or not text:
        return None
    wide = sum(1 for c in text if ord(c) >= 0x2E80)  # CJK and beyond: a token a character
    if wide > 0.3 * len(text):
        return None
    per_token = len(text) / n_tokens
    if per_token >= MIN_CHARS_PER_TOKEN:
        return None
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return (f"warning: the tokenizer {name} gives {per_token:.2f} characters per token on this "
            f"text (subword tokenizers give 3-5): it looks broken (words split into "
            "characters), so every figure would come from tokens the model never sees "
            "when served; check its tokenizer.json (convert-gguf it again with this fp4sense)")
