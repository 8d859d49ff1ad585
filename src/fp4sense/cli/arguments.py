"""The arguments of each ``fp4sense`` command: one function per command adds them to a
parser, so that every front door (``fp4sense``, ``optimum-cli fp4sense``) takes the same
flags. The flags of analyze, quantize and eval are generated from their options' one
definition (:mod:`fp4sense.options`), QAD's from ``DistillSettings``; values are typed
and ranged by :mod:`fp4sense.validate`'s parsers."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4sense import options
from fp4sense.quantization.distill_settings import BACKWARDS, MODES, cli_options
from fp4sense.validate import (
    non_empty,
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
                  "mode": dict(choices=list(MODES)),
                  "backward": dict(choices=list(BACKWARDS))}


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
    options.add(p, options.CONVERT_GGUF)
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
    options.add(p, options.VERIFY_VLLM)
    _add_json(p)


def push_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    options.add(p, options.PUSH)
    _add_json(p)


def schemes_args(p: argparse.ArgumentParser) -> None:
    _add_json(p, "print as JSON")
