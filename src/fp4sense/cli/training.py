"""The FP4 training commands' arguments and actions (``analyze-training``,
``train-trial``), their flags generated from :mod:`fp4sense.options_training`."""

from __future__ import annotations

import argparse
import sys

from fp4sense import options, options_training
from fp4sense.cli.arguments import _add_json, _add_model_and_text, text_source
from fp4sense.cli.streams import emit_json

__all__ = ["analyze_training_args", "run_analyze_training", "run_train_trial",
           "train_trial_args"]

EXIT_OK = 0


def analyze_training_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "training text file (default: protocol calibration split)")
    options.add(p, options_training.ANALYZE_TRAINING)
    _add_json(p, "print a JSON summary")


def train_trial_args(p: argparse.ArgumentParser) -> None:
    _add_model_and_text(p, "training text file (default: protocol calibration split)")
    options.add(p, options_training.TRAIN_TRIAL)
    _add_json(p, "print one line: {\"arms\": {ARM: {\"loss\": L, \"se\": SE}, ...}}")


def _log(args):
    return (lambda msg: print(msg, file=sys.stderr)) if args.json else print


def run_analyze_training(args: argparse.Namespace) -> int:
    from fp4sense.api import analyze_training
    from fp4sense.reports.training import findings

    result = analyze_training(args.model, text=text_source(args),
                              **options.keywords(args, options_training.ANALYZE_TRAINING),
                              progress=not args.json, log=_log(args))
    from fp4sense.runtime import distributed

    if not distributed.is_main():  # rank 0 speaks for a torchrun launch
        return EXIT_OK
    lines = findings(result, result["policy"])
    if args.json:
        emit_json({"out": str(args.out_dir), "findings": lines,
                   "rank_correlation": result["rank_correlation"],
                   "predicted_damage": result["policy"]["predicted_damage"],
                   "nvidia_rule_damage": result["policy"]["nvidia_rule"]["predicted_damage"]})
    else:
        print()
        for line in lines:
            print(f"- {line.replace('**', '')}")
    return EXIT_OK


def run_train_trial(args: argparse.Namespace) -> int:
    from fp4sense.api import train_trial

    out = train_trial(args.model, text=text_source(args),
                      **options.keywords(args, options_training.TRAIN_TRIAL),
                      progress=not args.json, log=_log(args))
    arms = {n: {"loss": a["loss"], "se": a["se"]} for n, a in out["arms"].items()}
    if args.json:
        emit_json({"arms": arms}, one_line=True)
    else:
        for name, a in out["arms"].items():
            print(f"{name:12s} loss {a['loss']:.4f} ± {a['se']:.4f} (in BF16 "
                  f"{a['loss_bf16']:.4f} ± {a['se_bf16']:.4f})")
    return EXIT_OK
