"""FP4 tensors: compress a weight to what compressed-tensors stores, decompress it, and
fake-quantize weights and activations — the functions that act on the formats that
:mod:`fp4sense.numerics.formats` describes.

Everything here is plain torch and is tested bit for bit against compressed-tensors
(its compressors and its fake quantization) and against the checkpoints llm-compressor
writes with its default observers.
"""

from __future__ import annotations

import torch

from fp4sense.numerics.e2m1 import (
    E2M1_MAGNITUDE_MASK,
    E2M1_MAX,
    E2M1_SIGN_BIT,
    E2M1_VALUES,
    e2m1_codes,
    pack_codes,
    round_to_e2m1,
    unpack_codes,
)
from fp4sense.numerics.formats import (
    FormatError,
    FP4Format,
    _blocks,
    amax_block_scales,
    check_weight,
    get_format,
)

__all__ = ["compress", "decompress", "dequantize_codes", "quantize_dequantize",
           "quantize_dequantize_activations", "quantize_to_codes"]


def _scaled(weight: torch.Tensor, scales: torch.Tensor, f: FP4Format,
            global_scale: torch.Tensor | None) -> torch.Tensor:
    """(out, in/block, block): values divided by their block step, clamped to E2M1."""
    step = f.quantize_step(scales, global_scale, weight.dtype)
    return torch.clamp(_blocks(weight, f.block_size) / step.unsqueeze(-1), -E2M1_MAX,
                       E2M1_MAX)


def quantize_to_codes(
    weight: torch.Tensor,
    scales: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """E2M1 codes (uint8, one per weight, values 0..15) for ``weight`` under ``scales``."""
    scaled = _scaled(weight, scales, get_format(fmt), global_scale)
    return e2m1_codes(round_to_e2m1(scaled), scaled < 0).flatten(-2)


def _fake_quantize(x: torch.Tensor, scales: torch.Tensor, f: FP4Format,
                   global_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_codes(quantize_to_codes(...))`` without the codes: the same bits."""
    values = round_to_e2m1(_scaled(x, scales, f, global_scale)).to(torch.float32)
    step = f.decode_scales(scales, global_scale)
    return (values * step.unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Codes + block scales -> weight in ``dtype`` (float32 arithmetic, then cast)."""
    f = get_format(fmt)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = table[(codes & E2M1_MAGNITUDE_MASK).long()]
    values = torch.where((codes & E2M1_SIGN_BIT) != 0, -values, values)
    step = f.decode_scales(scales, global_scale)
    out = _blocks(values, f.block_size) * step.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


# --- public API ---------------------------------------------------------------------
def _prepare(weight: torch.Tensor, fmt: str | FP4Format, global_scale: torch.Tensor | None,
             scales: torch.Tensor | None, name: str
             ) -> tuple[FP4Format, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Checked weight, its tensor scale and its block scales (the amax choice unless
    given): what compressing and fake-quantizing a weight both start from."""
    f = get_format(fmt)
    check_weight(weight, f, name)
    weight = weight.detach()
    tensor_scale = f.tensor_scale((weight,), global_scale)
    if scales is None:
        scales = amax_block_scales(weight, f, tensor_scale)
    return f, weight, tensor_scale, scales


def compress(
    weight: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    name: str = "weight",
) -> dict[str, torch.Tensor]:
    """Quantize a linear weight to the tensors compressed-tensors stores for it.

    :param weight: (out, in) floating point weight
    :param fmt: "nvfp4" or "mxfp4"
    :param global_scale: NVFP4 only; pass the fused group's shared value (see
        :func:`global_scale`), else it is computed from ``weight`` alone
    :param scales: block scales in stored form (E4M3 / E8M0 uint8) to use instead of
        the amax choice (e.g. from :mod:`fp4sense.numerics.scale_search`)
    :param name: the tensor's name, used in error messages
    :return: ``weight_packed``, ``weight_scale`` and, for NVFP4, ``weight_global_scale``
    """
    f, weight, tensor_scale, scales = _prepare(weight, fmt, global_scale, scales, name)
    codes = quantize_to_codes(weight, scales, f, tensor_scale)
    out = {"weight_packed": pack_codes(codes), "weight_scale": scales.to(f.scale_dtype)}
    if tensor_scale is not None:
        out["weight_global_scale"] = tensor_scale
    return out


def decompress(
    tensors: dict[str, torch.Tensor], fmt: str | FP4Format, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of :func:`compress`: the dequantized (out, in) weight in ``dtype``."""
    f = get_format(fmt)
    missing = [k for k in ("weight_packed", "weight_scale") if k not in tensors]
    if f.has_global_scale and "weight_global_scale" not in tensors:
        missing.append("weight_global_scale")
    if missing:
        raise FormatError(f"{f.name.upper()} tensors lack {', '.join(missing)}")
    codes = unpack_codes(tensors["weight_packed"])
    return dequantize_codes(
        codes, tensors["weight_scale"], f, tensors.get("weight_global_scale"), dtype
    )


def quantize_dequantize(
    weight: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    name: str = "weight",
) -> torch.Tensor:
    """Fake-quantize ``weight`` (same shape and dtype): what a served checkpoint computes
    with — the bits of ``decompress(compress(weight))``, without packing."""
    f, weight, tensor_scale, scales = _prepare(weight, fmt, global_scale, scales, name)
    return _fake_quantize(weight, scales, f, tensor_scale, weight.dtype)


def quantize_dequantize_activations(
    x: torch.Tensor, fmt: str | FP4Format = "mxfp4", global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Dynamic FP4 fake quantization of activations along the last dimension: the one
    activation quantizer (the analysis and the vLLM plugin's CPU kernels use it).

    Each block gets the scale of its amax by the same rule as the weights, as
    compressed-tensors' dynamic input quantization and vLLM's W4A4 kernels compute it;
    NVFP4 inputs take a static global scale (calibrated from the input's amax).
    """
    f = get_format(fmt)
    if f.has_global_scale and global_scale is None:
        raise FormatError(f"{f.name.upper()} activations need their static global scale")
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[-1] % f.block_size:
        raise FormatError(
            f"activation dimension {flat.shape[-1]} is not divisible by the "
            f"{f.name.upper()} block size {f.block_size}"
        )
    gs = global_scale if f.has_global_scale else None
    scales = amax_block_scales(flat, f, gs)
    return _fake_quantize(flat, scales, f, gs, x.dtype).reshape(x.shape)
