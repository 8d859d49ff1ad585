"""Error-minimizing FP4 block scales (the ``*_SEARCH`` schemes).

For every block the amax scale (what llm-compressor's default observer picks) and its
neighbours in the scale's own number format are tried; the block keeps the one with the
lowest error. The candidates are *representable* scales (E4M3 codes for NVFP4, E8M0
exponents for MXFP4), so the search is exact rather than over a float grid that is
rounded afterwards, and the result is stored in the standard packed format.

The error is the weight error weighted per input channel by ``importance`` (E[x^2] of
the layer's calibration inputs: the diagonal of the layer Hessian, so the weighted
weight error is the expected output error when inputs are uncorrelated). Without
``importance`` it is the plain weight MSE. Because the amax candidate is always tried
first and replaced only by a strictly better one, no block ends up worse than amax.
"""

from __future__ import annotations

import torch

from fp4sense.numerics.formats import FP4Format, amax_block_scales, get_format
from fp4sense.numerics.fp4 import dequantize_codes, quantize_to_codes

__all__ = ["block_errors", "candidate_offsets", "search_block_scales"]


def candidate_offsets(fmt: str | FP4Format, steps: tuple[int, int] | None = None) -> list[int]:
    """Offsets to try, amax (0) first so ties keep the amax scale; default: the format's
    ``search_steps`` (wider than amax helps FP4, see "four over six")."""
    f = get_format(fmt)
    low, high = steps or f.search_steps
    return [0] + [d for d in range(low, high + 1) if d != 0]


def _shift(scales: torch.Tensor, fmt: FP4Format, offset: int) -> torch.Tensor:
    """Move each stored scale ``offset`` representable steps (saturating, never zero)."""
    codes = fmt.scale_codes(scales).to(torch.int16) + offset
    return fmt.scales_from_codes(codes.clamp(fmt.min_scale_code, fmt.max_scale_code))


def block_errors(
    weight: torch.Tensor,
    scales: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-block (importance-weighted) squared error of ``weight`` under ``scales``.

    :return: float32 (out, in / block_size)
    """
    f = get_format(fmt)
    codes = quantize_to_codes(weight, scales, f, global_scale)
    deq = dequantize_codes(codes, scales, f, global_scale, torch.float32)
    err = (weight.to(torch.float32) - deq).square()
    if importance is not None:
        err = err * importance.to(torch.float32).reshape(1, -1)
    return err.unflatten(-1, (err.shape[-1] // f.block_size, f.block_size)).sum(-1)


@torch.no_grad()
def search_block_scales(
    weight: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
    importance: torch.Tensor | None = None,
    steps: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Block scales (stored form) with the lowest per-block error among the candidates.

    :param weight: (out, in) weight in its own dtype
    :param global_scale: NVFP4's (fused) global scale; required for NVFP4
    :param importance: optional (in,) non-negative per-input-channel weights (E[x^2])
    :param steps: (low, high) candidate offsets in scale steps (default: the format's search_steps)
    """
    f = get_format(fmt)
    if importance is not None:
        if importance.numel() != weight.shape[1]:
            raise ValueError(
                f"importance has {importance.numel()} entries, the weight has "
                f"{weight.shape[1]} input channels"
            )
        if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
            raise ValueError("importance must be finite and non-negative")
    base = amax_block_scales(weight, f, global_scale)
    best = base.clone()
    best_err: torch.Tensor | None = None
    for offset in candidate_offsets(f, steps):
        cand = base if offset == 0 else _shift(base, f, offset)
        err = block_errors(weight, cand, f, global_scale, importance)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = f.scales_from_codes(torch.where(better, f.scale_codes(cand),
                                               f.scale_codes(best)))
    return best
