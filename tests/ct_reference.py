"""Reference FP4 results computed by compressed-tensors' own code (any version 0.17-0.19).

This follows llm-compressor's default path for a weight: min/max statistics per block in
the weight's dtype -> ``generate_gparam`` (NVFP4, over the fused group) ->
``calculate_qparams`` -> scale kept in the weight's dtype (llm-compressor's parameter)
-> the format's compressor; plus ``fake_quantize`` and the compressor's decompression.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

PRESET = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
COMPRESSOR = {"nvfp4": NVFP4PackedCompressor, "mxfp4": MXFP4PackedCompressor}


def reference_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    absmax = None
    for w in weights:
        m = torch.max(-w.amin(), w.amax())
        absmax = m if absmax is None else torch.max(absmax, m)
    return generate_gparam(-absmax.reshape(1), absmax.reshape(1))


def reference(weight: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None):
    """(compressed tensors, fake-quantized weight, decompressed weight) from compressed-tensors."""
    scheme = preset_name_to_scheme(PRESET[fmt], ["Linear"])
    args = scheme.weights
    blocks = weight.unflatten(-1, (weight.shape[1] // args.group_size, args.group_size))
    if fmt == "nvfp4" and global_scale is None:
        global_scale = reference_global_scale(weight)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=global_scale)
    scale = scale.to(weight.dtype)
    state = {"weight": weight, "weight_scale": scale}
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    compressed = COMPRESSOR[fmt].compress(state, scheme)
    fake = fake_quantize(weight, scale, None, args, global_scale=global_scale)
    decompressed = COMPRESSOR[fmt].decompress(dict(compressed), scheme)["weight"]
    return dict(compressed), fake, decompressed


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View 1-byte dtypes as uint8 so float8 tensors compare bit for bit."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (dtype, shape and every bit, -0.0 and NaN patterns included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


def special_weights(dtype: torch.dtype, block: int) -> list[tuple[str, torch.Tensor]]:
    """Edge cases: every E2M1 code, ties, zero / tiny / subnormal blocks, FP8/E8M0 limits."""
    cases: list[tuple[str, torch.Tensor]] = []
    g = torch.Generator().manual_seed(1)
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    all16 = torch.cat([codes, -codes])  # each of the 16 codes once (+-0 included)
    cases.append(("all 16 codes", all16.repeat(4, 64 // 16).to(dtype)))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    cases.append(("rounding ties", torch.cat([ties, -ties]).repeat(4, 64 // 16).to(dtype)))
    w = torch.randn(8, 64, generator=g).to(dtype)
    w[0] = 0.0
    w[1, :block] = -0.0
    cases.append(("zero blocks", w))
    tiny = torch.finfo(dtype).tiny
    w = torch.randn(8, 64, generator=g).to(dtype)
    w[0] = (torch.randn(64, generator=g) * tiny).to(dtype)  # subnormal
    w[1] = (torch.randn(64, generator=g) * tiny * 64).to(dtype)
    w[2, :block] = torch.finfo(dtype).smallest_normal
    cases.append(("tiny and subnormal blocks", w))
    big = min(torch.finfo(dtype).max / 8, 2.0**120)
    w = torch.randn(8, 64, generator=g).to(dtype)
    w[0] = (torch.randn(64, generator=g) * big).to(dtype)  # huge range: E8M0 top, FP8 clamps
    w[1] = (torch.randn(64, generator=g) * 1e-3).to(dtype)  # tiny block next to huge ones
    cases.append(("near FP8 / E8M0 limits", w))
    w = torch.randn(8, 64, generator=g).to(dtype) * 1e4
    w[3] = w[3] * 1e-7  # block scales under the E4M3 minimum after the global scale
    cases.append(("E4M3 underflow", w.to(dtype)))
    return cases
