"""Block-Hadamard rotations: what a rotated scheme (``NVFP4_H16``, ``MXFP4_H32``, ...) does
to a linear before it quantizes.

A linear ``y = x W^T`` is rewritten as ``y = (x R)(W R)^T`` with ``R`` block-diagonal,
each block ``H_B / sqrt(B)`` (Sylvester's Hadamard matrix of size ``B``, orthogonal once
normalized): the product is unchanged before quantization, and quantizing ``x R`` and
``W R`` spreads each block's outliers over its ``B`` channels. This is compressed-tensors'
``hadamard`` transform with ``head_dim = B`` (llm-compressor's QuIPModifier ``v``
rotation): the weight side is fused into the stored weights (``weight_input``, inverse),
the input side is applied online by vLLM (``input``: hadacore on CUDA GPUs, QuTLASS's
fused Hadamard + NVFP4 quantization on Blackwell for B in 16..128, and the fp4sense vLLM
plugin's kernel on the CPU).

Both sides go through compressed-tensors' own ``apply_transform_weight`` with the
matrix it builds (``deterministic_hadamard_matrix``), in float64 as its transforms
compute them, and are cast back to the value's dtype: the same numbers as the
checkpoint's weights and the calibration's inputs, bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import torch
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme
from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix
from compressed_tensors.transform.utils.matrix import apply_transform_weight

__all__ = ["TRANSFORM_PRECISION", "TRANSFORM_TYPE", "hadamard", "rotate_input",
           "rotate_weight", "rotation_flops_per_token", "transform_config"]

#: compressed-tensors transform type of every rotated scheme (deterministic Sylvester
#: blocks: what hadacore and QuTLASS compute without loading a matrix)
TRANSFORM_TYPE = "hadamard"
#: precision the transforms compute in (llm-compressor's default on CPUs and CUDA)
TRANSFORM_PRECISION = torch.float64


@functools.lru_cache(maxsize=8)
def _sylvester(block: int) -> torch.Tensor:
    return deterministic_hadamard_matrix(block, TRANSFORM_PRECISION, torch.device("cpu"))


def hadamard(block: int) -> torch.Tensor:
    """The normalized ``block`` x ``block`` Hadamard matrix (float64, orthogonal)."""
    return _sylvester(block) / math.sqrt(block)


def _apply(value: torch.Tensor, block: int, location: str) -> torch.Tensor:
    """compressed-tensors' HadamardTransform.forward for ``head_dim = block`` at
    ``location`` ("input", or "weight_input" with the inverse matrix)."""

    if value.shape[-1] % block:
        raise ValueError(f"a {block}-wide Hadamard rotation needs an input width divisible "
                         f"by {block}, got {value.shape[-1]}")
    h = _sylvester(block).to(value.device)
    weight = h if location == "input" else h.T  # the weight side applies the inverse
    scale = torch.tensor(block, dtype=torch.float64).sqrt()
    return (apply_transform_weight(weight, value.to(TRANSFORM_PRECISION), location,
                                   torch.nn.Linear) / scale).to(value.dtype)


def rotate_input(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x R``: a linear's input rotated as the checkpoint's online transform does."""
    return _apply(x, block, "input")


def rotate_weight(weight: torch.Tensor, block: int) -> torch.Tensor:
    """``W R`` for an (out, in) weight: what the checkpoint fuses into the weight."""
    return _apply(weight, block, "weight_input")


def rotation_flops_per_token(in_features: int, out_features: int, block: int) -> float:
    """The online rotation's cost relative to the linear's, per token, as a dense block
    product (``2 * in * block`` against ``2 * in * out``); a fast Walsh-Hadamard kernel
    (hadacore) needs ``in * log2(block)`` additions instead."""
    return block / out_features


def transform_config(targets: Mapping[str, Sequence[str]]):
    """The compressed-tensors ``TransformConfig`` that rotates the linears a plan gives a
    rotated scheme (``targets``: scheme -> compressed-tensors targets, as
    :meth:`fp4sense.planning.milp.Plan.targets` gives them), one config group per width
    (``hadamard_16``, ...): the input online, the weight fused (inverse), as
    llm-compressor's QuIPModifier ``v`` rotation does. None when no scheme rotates."""

    from fp4sense.numerics.schemes import get_scheme

    by_width: dict[int, list[str]] = {}
    for scheme, names in targets.items():
        width = get_scheme(scheme).rotation
        if width is not None:
            by_width.setdefault(width, []).extend(names)
    if not by_width:
        return None
    return TransformConfig(config_groups={
        f"hadamard_{width}": TransformScheme(
            type=TRANSFORM_TYPE, head_dim=width, precision=TRANSFORM_PRECISION,
            apply=[TransformArgs(targets=sorted(names), location="input"),
                   TransformArgs(targets=sorted(names), location="weight_input", inverse=True)])
        for width, names in sorted(by_width.items())})
