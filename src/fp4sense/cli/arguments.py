"""The arguments of each ``fp4sense`` command: one function per command adds them to a
parser, so that every front door (``fp4sense``, ``optimum-cli fp4sense``) takes the same
flags; values are typed and ranged here (:mod:`fp4sense.validate`)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from fp4sense import defaults
from fp4sense.quantization.distill_settings import MODES, cli_options
from fp4sense.validate import (
    block_list,
    device_name,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)


def pins_of(values: list[str] | None) -> dict[str, str] | None:
    """``--pin UNIT_OR_REGEX=SCHEME`` values -> {pattern: scheme}, each regex compiled;
    None without any (the API's default)."""
    pins = {}
    for item in values or []:
        pattern, sep, scheme = item.rpartition("=")
        if not sep or not pattern:
            raise ValueError(f"--pin {item!r}: write UNIT_OR_REGEX=SCHEME, e.g. "
                             "'.*layers\\.0\\..*=BF16'")
        try:
            re.compile(pattern.removeprefix("re:"))
        except re.error as exc:
            raise ValueError(f"--pin {item!r}: {pattern!r} is not a valid regular expression "
                             f"({exc}); escape dots and brackets, or name a unit such as "
                             "'3:mlp.down_proj'") from None
        pins[pattern] = scheme
    return pins or None


#: how the command line types each QAD setting it offers (names, defaults and help come
#: from the one definition, DistillSettings: :func:`_add_distill`)
_DISTILL_TYPES = {"steps": dict(type=positive_int, metavar="STEPS"),
                  "lr": dict(type=positive_float), "lr_4bit": dict(type=positive_float,
                                                                    metavar="FACTOR"),
                  "windows": dict(type=positive_int),
                  "holdout": dict(type=non_negative_int, metavar="N"),
                  "mode": dict(choices=list(MODES))}


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


def _add_windows(p: argparse.ArgumentParser, default: int, what: str) -> None:
    p.add_argument("--windows", type=positive_int, default=default,
                   help=f"{what} (default {default})")
    p.add_argument("--tokens", type=positive_int, default=defaults.WINDOW_TOKENS,
                   help=f"tokens per window (default {defaults.WINDOW_TOKENS})")
    p.add_argument("--raw-windows", action="store_true",
                   help="windows of text tokens only: without the BOS (or prefix) the "
                   "tokenizer starts a sequence with, which windows otherwise begin with")


def _add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device_name, default="cpu",
                   help="auto, cpu, cuda or cuda:N (default cpu; auto: this rank's GPU when "
                   "there is one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype, for quantize also the oneshot's calibration "
                   "(default: float32 on the CPU, as the protocol; bfloat16 on a GPU)")


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
    p.add_argument("--schemes", type=non_empty, default="NVFP4,MXFP4",
                   help="comma-separated schemes of the menu (see `fp4sense schemes`)")
    p.add_argument("--views", type=non_empty, default="component,block",
                   help="comma-separated views: component, block, grid, experts (MoE: "
                   "each expert alone; best with --mode estimated)")
    p.add_argument("--mode", choices=["measured", "estimated", "both"], default="measured",
                   help="measured (isolation runs), estimated (one Fisher pass), or both")
    p.add_argument("--grid-blocks", type=block_list, default=None,
                   help="measure the grid only for these blocks (comma-separated; '' for "
                   "none, the estimate alone; default: all)")
    _add_windows(p, defaults.ANALYSIS_WINDOWS, "analysis windows")
    p.add_argument("--out", type=Path, default=Path("fp4sense-analysis"),
                   help="output folder (sensitivity.json, report.md, plots)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--offload-dir", type=Path, default=None,
                   help="keep decoder blocks on disk here, one in memory at a time (a copy; "
                   "--low-memory reads the model's own files instead)")
    p.add_argument("--low-memory", action="store_true",
                   help="hold one decoder block's weights at a time, read from the model's "
                   "safetensors files when it runs (models larger than memory)")
    _add_placement(p)
    _add_json(p, "print a JSON summary")


def quantize_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "calibration text file (default: protocol calibration split)")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--budget", type=positive_float,
                      help="average bits per weight, e.g. 4.75")
    goal.add_argument("--budget-bytes", type=positive_int, help="bytes of the decoder linears")
    goal.add_argument("--kl-target", type=positive_float,
                      help="fewest bits with predicted KL below")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--menu", type=non_empty, default=",".join(defaults.MENU),
                   help="schemes units may get")
    p.add_argument("--sensitivity", type=Path, default=None,
                   help="a saved sensitivity.json (default: estimate it now)")
    p.add_argument("--sensitivity-mode", choices=["measured", "estimated"], default=None,
                   help="which grid of the report to plan with")
    p.add_argument("--pin", action="append", metavar="UNIT_OR_REGEX=SCHEME",
                   help="force units to a scheme (repeatable)")
    p.add_argument("--gptq", action="store_true", help="round weights with GPTQ after planning")
    p.add_argument("--gptq-scores", action="store_true",
                   help="with --gptq: score the units after GPTQ, not after round-to-nearest "
                        "(one more GPTQ oneshot per quantizing scheme of the menu, before "
                        "planning; units GPTQ repairs well then cost fewer bits)")
    _add_distill(p)
    p.add_argument("--no-scale-search", action="store_true",
                   help="plan without the searched-scale twins of the FP4 menu schemes "
                        "(NVFP4 -> NVFP4_SEARCH, used by default where they score lower)")
    p.add_argument("--select-plans", type=positive_int, default=1, metavar="K",
                   help="measure the K best plans by prediction on calibration windows the "
                        "estimate did not use and keep the lowest (default 1: no measuring)")
    p.add_argument("--base-model-id", default=None, metavar="ORG/NAME",
                   help="the base model's Hub id, for the model card's lineage (default: "
                        "derived where certain: a hub id, a Hugging Face cache folder)")
    p.add_argument("--calib-windows", type=positive_int, default=defaults.CALIB_WINDOWS,
                   help="calibration windows")
    _add_windows(p, defaults.ANALYSIS_WINDOWS,
                 "windows for the sensitivity estimate (the first calibration ones)")
    p.add_argument("--eval-windows", type=positive_int, default=defaults.EVAL_WINDOWS,
                   help="evaluation windows for the model card's figures")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation for the card")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--low-memory", action="store_true",
                   help="estimate with one decoder block's weights in memory at a time")
    _add_placement(p)
    _add_json(p)


def eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="compressed-tensors checkpoint folder")
    p.add_argument("--base", default=None, help="unquantized model (default: as recorded)")
    _add_text(p, "evaluation text file (default: protocol evaluation split)")
    _add_windows(p, defaults.EVAL_WINDOWS, "evaluation windows")
    p.add_argument("--as-served", action="store_true",
                   help="compute MXFP4A16 layers as W4A4, as vLLM serves them")
    _add_placement(p)
    _add_json(p)


def verify_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, nargs="+",
                   help="compressed-tensors checkpoint folder(s); several share one vLLM "
                        "process")
    _add_text(p, "evaluation text file (default: protocol evaluation split)")
    _add_windows(p, 2, "evaluation windows to score; tokens <= 512")
    p.add_argument("--prompt", default="The President of the United States said that")
    p.add_argument("--serve-python", default=None, help="python of the vLLM environment")
    p.add_argument("--max-abs", type=non_negative_float, default=None,
                   help="limit on max |d logprob| (default: by scheme, see docs/vllm.md)")
    p.add_argument("--mean-abs", type=non_negative_float, default=None,
                   help="limit on mean |d logprob|")
    p.add_argument("--ppl-rel", type=non_negative_float, default=None,
                   help="limit on the relative perplexity difference")
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds for the vLLM run")
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
