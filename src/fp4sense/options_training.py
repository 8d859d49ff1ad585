"""The options of the FP4 training commands (``analyze-training``, ``train-trial``),
defined once as :mod:`fp4sense.options` defines analyze's: keyword, flag, default, help
and validation; the command line, the Python API and optimum-cli take them from here.
Imports no torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4sense import defaults
from fp4sense.options import _LOW_MEMORY, _PLACEMENT, Option, windows
from fp4sense.validate import (
    InputError,
    non_empty,
    non_negative_float,
    positive_float,
    positive_int,
)

__all__ = ["ANALYZE_TRAINING", "PARTS", "RECIPES", "TRAIN_TRIAL", "TRAINING_VIEWS", "share",
           "views_of"]

#: the FP4 training recipes a policy is made for, and the Blackwell parts it is timed on
RECIPES = ("nvfp4", "mxfp4")
PARTS = ("b200", "gb200", "gb300")
TRAINING_VIEWS = ("component", "block", "gemm")


def share(value: str) -> float:
    """argparse type: a share of the linear GEMM FLOPs, from 0 (all FP4) to 1 (all BF16)."""
    x = non_negative_float(value)
    if x > 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a share of the GEMM FLOPs, from 0 to 1")
    return x


share.bounded = True


def views_of(value) -> tuple[str, ...]:
    views = tuple(v.strip() for v in value.split(",")) if isinstance(value, str) else \
        tuple(value)
    bad = [v for v in views if v not in TRAINING_VIEWS]
    if bad or not views:
        raise InputError(f"--views {','.join(views)}: choose from {', '.join(TRAINING_VIEWS)}")
    return views


_TRIALS = (
    Option("seeds", "--seeds", defaults.TRAINING_SEEDS, "seeds of stochastic rounding and "
           "data order (the SE is over them)", positive_int),
    Option("trial_steps", "--trial-steps", defaults.TRIAL_STEPS, "optimizer steps of each "
           "trial (and the horizon of the estimate's gradient damage)", positive_int),
    Option("trial_lr", "--trial-lr", defaults.TRIAL_LR, "AdamW learning rate of the trials "
           "(and of the estimate's step)", positive_float),
)

ANALYZE_TRAINING: tuple[Option, ...] = (
    Option("recipe", "--recipe", defaults.TRAINING_RECIPE, "the FP4 training recipe",
           choices=RECIPES),
    Option("views", "--views", TRAINING_VIEWS, "comma-separated views: component, block, "
           "gemm", non_empty, csv=True, convert=views_of),
    Option("modes", "--mode", ("estimated",), "estimated (one pass; a draw per seed), measured "
           "(short training trials per block, kind and GEMM), or both", choices=(
               "measured", "estimated", "both"), flag_default="estimated",
           convert=lambda m: ("measured", "estimated") if m == "both" else (m,)),
    *windows("analysis_windows", defaults.ANALYSIS_WINDOWS, "windows of the passes and "
             "the trials' training batches (calibration split)", renamed=False),
    Option("eval_windows", "--eval-windows", defaults.EVAL_WINDOWS, "held-aside windows the "
           "trials are scored on (evaluation split; fewer rank blocks by the text drawn)",
           positive_int),
    *_TRIALS,
    Option("bf16_share", "--bf16-share", defaults.BF16_SHARE, "the policy's budget: the "
           "BF16 share of the linear GEMM FLOPs (as a step time: the rest in FP4)", share),
    Option("step_time_ms", "--step-time-ms", None, "the policy's budget as the linear GEMMs' "
           "time per step on --part, in ms (instead of --bf16-share)", positive_float),
    Option("part", "--part", defaults.BLACKWELL_PART, "the Blackwell part the time is "
           "predicted on", choices=PARTS),
    Option("tokens_per_step", "--tokens-per-step", defaults.TOKENS_PER_STEP, "tokens per "
           "optimizer step of the training the policy is for", positive_int),
    Option("mxfp8", "--no-mxfp8", True, "offer the policy BF16 and FP4 only", switch=True),
    Option("out_dir", "--out", None, "output folder (training-sensitivity.json, "
           "training-policy.json, report.md, exports, plots)", Path,
           flag_default=Path("fp4sense-training")),
    Option("cache", "--no-cache", True, "neither read nor write the cache", switch=True),
    Option("plots", "--no-plots", True, "skip the PNG plots", switch=True),
    Option("low_memory", "--low-memory", False, _LOW_MEMORY + "; the estimated mode "
           "only", switch=True),
    *_PLACEMENT,
)

TRAIN_TRIAL: tuple[Option, ...] = (
    Option("policy", "--policy", None, "training-policy.json (analyze-training)", Path,
           required=True),
    Option("steps", "--steps", 32, "optimizer steps of each arm", positive_int),
    Option("eval_text", "--eval-text", None, "held-aside text (default: the protocol's "
           "evaluation split)"),
    *windows("analysis_windows", 16, "training windows (the batches: 2 windows each)",
             renamed=False),
    Option("eval_windows", "--eval-windows", defaults.EVAL_WINDOWS, "held-aside windows",
           positive_int),
    Option("seeds", "--seeds", defaults.TRAINING_SEEDS, "seeds of stochastic rounding and "
           "data order", positive_int),
    Option("lr", "--lr", defaults.TRIAL_LR, "AdamW learning rate", positive_float),
    Option("monitor_every", "--monitor-every", 4, "steps between the stability monitor's "
           "noise-to-signal checks", positive_int),
    Option("out_dir", "--out", None, "output folder (trial.json, report.md, loss curves)",
           Path, required=True),
    Option("cache", "--no-cache", True, "neither read nor write the cache of finished arms",
           switch=True),
    Option("plots", "--no-plots", True, "skip the PNG plots", switch=True),
    *_PLACEMENT,
)
