"""The defaults that several front doors share (the command line, the Python API, the YAML
modifiers, optimum-cli, which reuses the command line's arguments), defined once here.
It imports only the standard library, so the command line reads it before torch is imported;
tests/cli/test_options.py fails when a door's default differs from these."""

from __future__ import annotations

import os
from pathlib import Path

#: the environment variable that moves the fp4sense cache (assets, analyses, locks)
CACHE_ENV = "FP4SENSE_CACHE"

#: the schemes a plan may give a unit (BF16 = left alone)
MENU = ("NVFP4", "FP8_DYNAMIC", "BF16")
#: analysis windows, and the sensitivity estimate's (the first calibration windows)
ANALYSIS_WINDOWS = 8
#: calibration windows of quantize (llm-compressor's oneshot, GPTQ, QAD)
CALIB_WINDOWS = 32
#: evaluation windows of the held-out text (eval, the model card's figures)
EVAL_WINDOWS = 16
#: tokens per window
WINDOW_TOKENS = 512
#: verify-vllm: the prompt vLLM and transformers both continue greedily
VLLM_PROMPT = "The President of the United States said that"
#: verify-vllm: seconds the vLLM run may take
VLLM_TIMEOUT_S = 900.0
#: FP4 training: the recipe, the BF16 share of the linear GEMM FLOPs a policy may keep
#: (NVIDIA's NVFP4 pretraining recipe keeps about 15%), the Blackwell part its time is
#: predicted on, tokens per optimizer step, the seeds of stochastic rounding and data
#: order, and the trials' steps and AdamW learning rate
TRAINING_RECIPE = "nvfp4"
BF16_SHARE = 0.15
BLACKWELL_PART = "b200"
TOKENS_PER_STEP = 1 << 20
TRAINING_SEEDS = 2
TRIAL_STEPS = 8
TRIAL_LR = 1e-4


def cache_dir() -> Path:
    """The fp4sense cache: ``$FP4SENSE_CACHE`` or ``~/.cache/fp4sense``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fp4sense").expanduser()
