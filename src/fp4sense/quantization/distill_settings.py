"""QAD's settings, defined once: :class:`DistillSettings` is the definition every front
door takes its names, defaults and help from (``fp4sense quantize --distill-*``, the
Python API's ``distill=``, the YAML ``QuantizationAwareDistillationModifier``; a test
compares them). Light: no torch, so the command line can build its flags from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from fp4sense.validate import UserError

__all__ = ["BACKWARDS", "MODES", "DistillError", "DistillSettings", "cli_options"]

MODES = ("end-to-end", "block")
#: the recipes QAD's backward GEMMs (dgrad, wgrad) can run in: "bf16" (QAD's own: only
#: the forward is quantized) or a training recipe of :mod:`fp4sense.numerics.training`
BACKWARDS = ("bf16", "nvfp4", "mxfp4", "mxfp8")


class DistillError(UserError, ValueError):
    """Settings or inputs QAD cannot run with (the message says which and what to do)."""


def _opt(default, help_: str, flag: str | None = None):
    """A setting with its default, its help and (where the command line offers it) its
    ``--distill-*`` flag."""
    return field(default=default, metadata={"help": help_, "flag": flag})


@dataclass(frozen=True)
class DistillSettings:
    """How QAD trains (recorded in the checkpoint's distill.json)."""

    steps: int = field(metadata={"help": "optimizer steps (block-wise: per decoder block)",
                                 "flag": "--distill"})
    lr: float = _opt(5e-5, "distillation learning rate (cosine schedule to zero)",
                     "--distill-lr")
    lr_4bit: float = _opt(1.0, "factor on the learning rate for units with 4-bit weights, "
                          "whose grid steps are coarser", "--distill-lr-4bit")
    seed: int = _opt(0, "which calibration windows, and their order")
    windows: int = _opt(16, "calibration windows the distillation trains on (their base "
                        "log-probs stay in memory)", "--distill-windows")
    holdout: int = _opt(4, "further calibration windows, not trained on, that choose the "
                        "state the distillation ends on (0: none)", "--distill-holdout")
    check_every: int = _opt(10, "steps between stability checks")
    rise: float = _opt(1.5, "a check window's mean loss above rise x the best one rolls back")
    rescale_every: int = _opt(20, "steps between searches of the *_SEARCH block scales")
    save_every: int = _opt(20, "steps between saved states (a multiple of check_every)")
    mode: str = _opt("end-to-end", "end-to-end: the KL of the whole model; block: each "
                     "decoder block in turn matches its unquantized output, STEPS steps per "
                     "block, each step one block's forward and backward", "--distill-mode")
    backward: str = _opt("bf16", "the training recipe the trained linears' backward GEMMs "
                         "(dgrad, wgrad) run in: bf16 (the forward alone quantized) or "
                         "nvfp4 / mxfp4 / mxfp8, their operands quantized as FP4 training "
                         "quantizes them on Blackwell (analyze-training's recipes)",
                         "--distill-backward")

    def check(self) -> None:
        if self.mode not in MODES:
            raise DistillError(f"the distillation mode must be one of {', '.join(MODES)}, "
                               f"got {self.mode!r}")
        if self.backward not in BACKWARDS:
            raise DistillError(f"the distillation's backward recipe must be one of "
                               f"{', '.join(BACKWARDS)}, got {self.backward!r}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise DistillError(f"distillation steps must be a positive whole number, got "
                               f"{self.steps!r}; give e.g. --distill 100")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise DistillError(f"the distillation learning rate must be positive, got {self.lr}")
        if not (self.lr_4bit > 0 and math.isfinite(self.lr_4bit)):
            raise DistillError(f"the 4-bit units' learning-rate factor must be positive, got "
                               f"{self.lr_4bit}")
        if not isinstance(self.holdout, int) or self.holdout < 0:
            raise DistillError(f"the held-out windows must be a whole number, 0 or more, got "
                               f"{self.holdout!r}")
        if self.windows < 1 or self.check_every < 1 or self.rescale_every < 1:
            raise DistillError("distillation windows, check_every and rescale_every must be "
                               "at least 1")
        if self.save_every % self.check_every:
            raise DistillError(f"save_every ({self.save_every}) must be a multiple of "
                               f"check_every ({self.check_every})")
        if self.rise <= 1:
            raise DistillError(f"rise must be above 1, got {self.rise}")




def cli_options() -> dict[str, tuple[str, object, str]]:
    """Setting name -> (its ``--distill-*`` flag, default, help), for the settings the
    command line offers."""
    return {f.name: (f.metadata["flag"], f.default, f.metadata["help"])
            for f in fields(DistillSettings) if f.metadata.get("flag")}
