"""The activations' tensor scale chosen by measurement: what the ``*_ACLIP`` schemes do.

An NVFP4 input is quantized in 16-element blocks whose E4M3 scales sit under one static
FP32 tensor scale, ``input_global_scale = 448 * 6 / amax``, which llm-compressor makes
from the calibration maximum. Each block's scale is ``448 * amax_block / amax``: a single
outlier token raises ``amax`` and pushes every other block's scale toward the bottom of
E4M3's range, into its subnormals (fewer steps) or under its smallest value (the block
reads as zero). A tensor scale made from ``fraction * amax`` moves every block's scale up
by ``1 / fraction``; the blocks above ``fraction * amax`` saturate (their scale is E4M3's
largest, their largest elements clip). The checkpoint's format does not change: vLLM
serves ``input_global_scale`` as it is.

Each candidate fraction is scored by the output error the unit's input quantization
causes, summed over the calibration windows: ``||(Q(x) - x) W^T||^2`` for quantization
errors uncorrelated across input channels, ``sum_j ||Q(x)_j - x_j||^2 ||W_:j||^2`` (W the
unit's weights, the parts of a fused group stacked: they share the input, so one choice;
the same weighting as the block-scale search's). The weights' own error does not depend
on the input's scale and is left out. A candidate
that saturates more than :data:`MAX_SATURATED` of the unit's input blocks is not taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from compressed_tensors.quantization.utils import generate_gparam

from fp4sense.numerics.formats import get_format
from fp4sense.numerics.fp4 import quantize_dequantize_activations
from fp4sense.numerics.schemes import INPUT_CLIP_OBSERVER
from fp4sense.validate import UserError

__all__ = ["FRACTIONS", "MAX_SATURATED", "ClipScores", "InputClipError", "attached_fraction",
           "check_fraction", "input_global_scale"]

#: the candidates, as fractions of the calibration maximum (1: the maximum itself)
FRACTIONS = tuple(round(2.0 ** (-k / 2), 6) for k in range(13))  # 1 .. 1/64
#: the largest share of a unit's input blocks a candidate may saturate
MAX_SATURATED = 0.001


class InputClipError(UserError, ValueError):
    """A fraction of the input maximum outside (0, 1]."""


def check_fraction(fraction, where: str) -> float:
    """``fraction`` as a float in (0, 1], else one :class:`InputClipError` naming ``where``."""
    try:
        value = float(fraction)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise InputClipError(f"{where}: the activations' tensor scale is made from a fraction "
                             f"of the calibration maximum in (0, 1], got {fraction!r}; give "
                             "one in (0, 1] (1: the maximum, as llm-compressor calibrates)")
    return value


def input_global_scale(absmax: float | torch.Tensor, fraction: float = 1.0) -> torch.Tensor:
    """The NVFP4 ``input_global_scale`` made from ``fraction`` of the input maximum, as
    llm-compressor's ``generate_gparam`` makes it from the maximum: in the maximum's
    dtype (a bf16 calibration's scale is rounded to bf16), returned as float32 (1,)."""
    amax = torch.as_tensor(absmax)
    if not amax.is_floating_point():
        amax = amax.float()
    amax = amax.reshape(1) * float(fraction)
    return generate_gparam(-amax, amax)


def attached_fraction(module: torch.nn.Module) -> float:
    """The fraction of the input maximum ``module``'s attached compressed-tensors scheme
    makes its input tensor scale from (its ``fp4sense_input_clip`` observer's; else 1)."""
    args = getattr(getattr(module, "quantization_scheme", None), "input_activations", None)
    if args is None or args.observer != INPUT_CLIP_OBSERVER:
        return 1.0
    return check_fraction((args.observer_kwargs or {}).get("fraction", 1.0),
                          f"{INPUT_CLIP_OBSERVER} observer_kwargs.fraction")


class ClipScores:
    """One unit input's candidates, scored window by window (:meth:`add`), then chosen."""

    def __init__(self, absmax: float, fractions: Sequence[float] = FRACTIONS,
                 fmt: str = "nvfp4"):
        self.fmt = get_format(fmt)
        self.absmax = float(absmax)
        self.fractions = tuple(check_fraction(f, "input clip candidates") for f in fractions)
        self.scales = [input_global_scale(self.absmax, f) for f in self.fractions]
        self.error = torch.zeros(len(self.fractions), dtype=torch.float64)
        self.saturated = torch.zeros(len(self.fractions), dtype=torch.float64)
        self.blocks = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """Score every candidate on the inputs ``x`` (..., in) of a unit whose (stacked)
        weights are ``weight`` (out, in)."""
        rows = x.detach().reshape(-1, x.shape[-1])
        column_power = weight.detach().to(torch.float32).square().sum(0)  # ||W_:j||^2
        block_max = rows.float().abs().unflatten(-1, (-1, self.fmt.block_size)).amax(-1)
        self.blocks += block_max.numel()
        for i, (fraction, gs) in enumerate(zip(self.fractions, self.scales, strict=True)):
            q = quantize_dequantize_activations(rows, self.fmt, gs.to(rows.device))
            delta = (q.float() - rows.float()).square().sum(0)
            self.error[i] += float((delta.double() * column_power.double()).sum())
            self.saturated[i] += float((block_max > self.absmax * fraction).sum())

    def choice(self) -> dict:
        """The fraction with the lowest error among those that saturate at most
        :data:`MAX_SATURATED` of the blocks (ties: the larger fraction), with each
        candidate's error relative to the maximum's."""
        share = self.saturated / max(self.blocks, 1)
        allowed = [i for i in range(len(self.fractions)) if share[i] <= MAX_SATURATED] or [
            max(range(len(self.fractions)), key=lambda i: self.fractions[i])]
        best = min(allowed, key=lambda i: (float(self.error[i]), -self.fractions[i]))
        full = float(self.error[self.fractions.index(1.0)]) if 1.0 in self.fractions else None
        return {"fraction": self.fractions[best],
                "error_ratio": (float(self.error[best]) / full) if full else None,
                "saturated": float(share[best]),
                "refused": [self.fractions[i] for i in range(len(self.fractions))
                            if i not in allowed]}
