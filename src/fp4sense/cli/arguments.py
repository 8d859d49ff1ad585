"""The arguments of each ``fp4sense`` command: one function per command adds them to a
parser, so that every front door (``fp4sense``, ``optimum-cli fp4sense``) takes the same
flags. The flags of analyze, quantize and eval are generated from their options' one
definition (:mod:`fp4sense.options`), QAD's from ``DistillSettings``; values are typed
and ranged by :mod:`fp4sense.validate`'s parsers."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4sense import options
from fp4sense.quantization.distill_settings import MODES, cli_options
from fp4sense.validate import (
    bounded_float,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

#: how the command line types each QAD setting it offers (names, defaults and help come
#: from the one definition, DistillSettings: :func:`_add_distill`)
_DISTILL_TYPES = {"steps": dict(type=positive_int, metavar="STEPS"),
                  "lr": dict(type=positive_float), "lr_4bit": dict(type=positive_float,
                                                                    metavar="FACTOR"),
                  "windows": dict(type=positive_int),
                  "holdout": dict(type=non_negative_int, metavar="N"),
                  "mode": dict(choices=list(MODES))}


#: verify-vllm --timeout: past a day, a run is hung, not slow (and far past it, the
#: subprocess's timer overflows)
MAX_VLLM_TIMEOUT = 86400.0
VLLM_TIMEOUT = bounded_float(MAX_VLLM_TIMEOUT, "a vLLM run that long is hung; give seconds")


def _add_distill(p: argparse.ArgumentParser) -> None:
    """The ``--distill*`` flags, generated from :class:`DistillSettings`' fields."""
    for name, (flag, default, help_) in cli_options().items():
        if name == "steps":  # the switch: no training unless given
            p.add_argument(flag, default=None, help="after planning, train the quantized "
                           "model to match the unquantized one for STEPS steps "
                           f"(quantization-aware distillation): {help_}", **_DISTILL_TYPES[name])
        else:
            p.add_argument(flag, default=default, help=f"{help_} (default {default})",
                           **_DISTILL_TYPES[name])


def _add_model_and_text(p: argparse.ArgumentParser, text_help: str) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="hub id or local folder (default: the bundled SmolLM2-135M)")
    _add_text(p, text_help)


def _add_text(p: argparse.ArgumentParser, text_help: str) -> None:
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", type=non_empty, default=None, help=text_help)
    text.add_argument("--dataset", type=non_empty, default=None,
                      help="HF dataset NAME[:CONFIG[:SPLIT]]")


def text_source(args: argparse.Namespace) -> str | None:
    return f"dataset:{args.dataset}" if args.dataset else args.text


def _add_json(p: argparse.ArgumentParser, what: str = "print the result as JSON") -> None:
    p.add_argument("--json", action="store_true", help=what)


def setup_args(p: argparse.ArgumentParser) -> None:
    _add_json(p, "print the asset paths as JSON")


def convert_gguf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", type=Path, help="path of the .gguf file")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--name", default=None, help="name_or_path to record (e.g. the hub id)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    _add_json(p)


def analyze_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "analysis text file (default: protocol calibration split)")
    options.add(p, options.ANALYZE)
    _add_json(p, "print a JSON summary")


def quantize_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "calibration text file (default: protocol calibration split)")
    table = options.QUANTIZE
    at = next(i for i, o in enumerate(table) if o.keyword == "scale_search")
    options.add(p, table[:at])
    _add_distill(p)
    options.add(p, table[at:])
    _add_json(p)


def eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    _add_text(p, "evaluation text file (default: protocol evaluation split)")
    options.add(p, options.EVAL)
    _add_json(p)


def verify_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, nargs="+",
                   help="compressed-tensors checkpoint folder(s); several share one vLLM "
                        "process")
    _add_text(p, "evaluation text file (default: protocol evaluation split)")
    options.add(p, options.windows(2, "evaluation windows to score; tokens <= 512"))
    p.add_argument("--prompt", default="The President of the United States said that")
    p.add_argument("--serve-python", default=None, help="python of the vLLM environment")
    p.add_argument("--max-abs", type=non_negative_float, default=None,
                   help="limit on max |d logprob| (default: by scheme, see docs/vllm.md)")
    p.add_argument("--mean-abs", type=non_negative_float, default=None,
                   help="limit on mean |d logprob|")
    p.add_argument("--ppl-rel", type=non_negative_float, default=None,
                   help="limit on the relative perplexity difference")
    p.add_argument("--timeout", type=VLLM_TIMEOUT, default=900.0,
                   help=f"seconds for the vLLM run (at most {MAX_VLLM_TIMEOUT:g}: a day)")
    _add_json(p)


def push_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    p.add_argument("--repo-id", required=True, help="Hub repo, OWNER/NAME (or NAME: yours)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check and list the files; upload nothing")
    p.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    p.add_argument("--message", default=None, help="commit message")
    p.add_argument("--allow-local-paths", action="store_true",
                   help="upload JSON files that record paths of this machine (older checkpoints)")
    _add_json(p)


def schemes_args(p: argparse.ArgumentParser) -> None:
    _add_json(p, "print as JSON")
