"""FP4 numerics: NVFP4 and MXFP4 exactly as compressed-tensors stores them.

Everything here is plain torch and is tested bit for bit against compressed-tensors
(its compressors and its fake-quantization) and against the checkpoints that
llm-compressor writes with its default observers.

Layout of a compressed FP4 linear weight ``W`` of shape (out, in):

* ``weight_packed``  uint8 (out, in / 2): two E2M1 codes per byte, the even column in
  the low nibble, bit 3 of each nibble is the sign.
* ``weight_scale``   one scale per block of ``block_size`` inputs: FP8 E4M3 (NVFP4) or an
  E8M0 biased exponent stored as uint8 (MXFP4).
* ``weight_global_scale`` (NVFP4 only) float32 (1,): ``E4M3_MAX * E2M1_MAX / amax(W)``,
  shared by every part of a fused group (q/k/v, gate/up).

The effective per-block step is ``weight_scale / weight_global_scale`` (NVFP4) or
``2 ** (weight_scale - 127)`` (MXFP4).

Like llm-compressor, the block and tensor amax are taken in the weight's own dtype
(bf16 for a bf16 checkpoint): recomputing them in float32 does not give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E8M0_BIAS",
    "FORMATS",
    "FP4Format",
    "FormatError",
    "check_weight",
    "compress",
    "decode_scales",
    "decompress",
    "dequantize_codes",
    "get_format",
    "global_scale",
    "amax_block_scales",
    "pack_codes",
    "quantize_dequantize",
    "quantize_dequantize_activations",
    "quantize_to_codes",
    "unpack_codes",
]

# --- named constants (no magic numbers below) -------------------------------------
#: the eight E2M1 magnitudes, indexed by the low three bits of a code
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: bit 3 of an E2M1 code is its sign
E2M1_SIGN_BIT = 0b1000
E2M1_MAGNITUDE_MASK = 0b0111
#: boundaries between consecutive E2M1 magnitudes. A value exactly on a boundary goes
#: to the magnitude with the even code (round half to even), as compressed-tensors does:
#: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0.
_E2M1_BOUNDARIES: tuple[tuple[float, bool], ...] = (
    # (boundary, a value equal to it rounds up)
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
E4M3_MAX = 448.0
#: compressed-tensors replaces an E4M3 block scale of 0 (an all-zero block) by this
E4M3_ZERO_SCALE = 0.125
E8M0_BIAS = 127
E8M0_MAX_CODE = 255
#: the MX reference maps a block's amax into E2M1's range by this exponent offset:
#: floor(log2(E2M1_MAX)) = 2
MX_E2M1_EXPONENT_OFFSET = 2
BITS_PER_BYTE = 8
FLOAT32_BYTES = 4


class FormatError(ValueError):
    """A weight cannot be stored in the requested FP4 format (says which and why)."""


@dataclass(frozen=True)
class FP4Format:
    """Description of one FP4 weight format (what it is; the functions below act)."""

    name: Literal["nvfp4", "mxfp4"]
    block_size: int
    scale_dtype: torch.dtype
    has_global_scale: bool
    compression_format: str  # compressed-tensors' CompressionFormat value

    @property
    def scale_bits(self) -> int:
        return torch.finfo(self.scale_dtype).bits if self.scale_dtype.is_floating_point else 8


NVFP4 = FP4Format("nvfp4", 16, torch.float8_e4m3fn, True, "nvfp4-pack-quantized")
MXFP4 = FP4Format("mxfp4", 32, torch.uint8, False, "mxfp4-pack-quantized")
FORMATS: dict[str, FP4Format] = {"nvfp4": NVFP4, "mxfp4": MXFP4}


def get_format(fmt: str | FP4Format) -> FP4Format:
    """Return the FP4Format named ``fmt`` ("nvfp4" or "mxfp4")."""
    if isinstance(fmt, FP4Format):
        return fmt
    try:
        return FORMATS[fmt.lower()]
    except (KeyError, AttributeError):
        raise FormatError(
            f"unknown FP4 format {fmt!r}; choose one of {sorted(FORMATS)}"
        ) from None


# --- validation ---------------------------------------------------------------------
def check_weight(weight: torch.Tensor, fmt: str | FP4Format, name: str = "weight") -> None:
    """Raise FormatError naming ``name`` if ``weight`` cannot be stored in ``fmt``.

    Checks: 2-D floating point, finite, input dimension divisible by the block size.
    """
    f = get_format(fmt)
    if weight.ndim != 2:
        raise FormatError(
            f"{name}: FP4 weights must be 2-D (out_features, in_features), got shape "
            f"{tuple(weight.shape)}"
        )
    if not weight.is_floating_point():
        raise FormatError(f"{name}: expected a floating point weight, got {weight.dtype}")
    if weight.shape[1] % f.block_size != 0:
        raise FormatError(
            f"{name}: input dimension {weight.shape[1]} is not divisible by the "
            f"{f.name.upper()} block size {f.block_size}; leave this layer at a higher "
            "precision (e.g. FP8_DYNAMIC or BF16)"
        )
    if not bool(torch.isfinite(weight).all()):
        bad = int((~torch.isfinite(weight)).sum())
        raise FormatError(
            f"{name}: contains {bad} NaN/Inf value(s); FP4 scales would be undefined. "
            "Fix or drop this tensor before quantizing"
        )


def _blocks(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """(out, in) -> (out, in / block_size, block_size), no copy."""
    return weight.unflatten(-1, (weight.shape[-1] // block_size, block_size))


def _block_amax(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    # in the weight's own dtype, as llm-compressor's observers do
    return _blocks(weight, block_size).abs().amax(dim=-1)


# --- scales -------------------------------------------------------------------------
def global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """NVFP4 tensor scale shared by ``weights`` (one tensor, or the parts of a fused group).

    ``E4M3_MAX * E2M1_MAX / amax``, computed in the weights' dtype and returned as
    float32 of shape (1,), exactly as llm-compressor's ``generate_gparam``.
    """
    if not weights:
        raise ValueError("global_scale needs at least one weight")
    amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    scale = (E4M3_MAX * E2M1_MAX) / amax
    # an all-zero or overflowing tensor gets 1.0 ("no global scaling"), as upstream
    scale = torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def _round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to E4M3, then zero scales replaced as compressed-tensors does."""
    e4m3 = torch.clamp(x, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.where(
        e4m3.to(torch.float32) == 0,
        torch.tensor(E4M3_ZERO_SCALE, dtype=torch.float32).to(torch.float8_e4m3fn),
        e4m3,
    )


#: (mantissa bits, exponent bits) of the float dtypes a weight can have
_FLOAT_LAYOUT: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (7, 8),
    torch.float16: (10, 5),
    torch.float32: (23, 8),
    torch.float64: (52, 11),
}


def _round_amax_to_power_of_two(amax: torch.Tensor) -> torch.Tensor:
    """The MX reference's power-of-two rounding of a block amax (in amax's dtype).

    It adds half of the second mantissa bit to the raw bits and keeps sign and
    exponent, so a mantissa of 1.75 or more rounds up to the next power of two.
    """
    mantissa_bits, exponent_bits = _FLOAT_LAYOUT[amax.dtype]
    total_bits = 1 + exponent_bits + mantissa_bits
    int_dtype = {16: torch.int16, 32: torch.int32, 64: torch.int64}[total_bits]
    raw = amax.view(int_dtype).to(torch.int64)
    if total_bits == 16:
        raw = raw & 0xFFFF
    add = 1 << (mantissa_bits - 1 - 1)  # E2M1 has one mantissa bit
    keep = ((1 << (exponent_bits + 1)) - 1) << mantissa_bits
    rounded = (raw + add) & keep
    if total_bits == 16:
        rounded = torch.where(rounded >= 1 << 15, rounded - (1 << 16), rounded)
    return rounded.to(int_dtype).view(amax.dtype)


def amax_block_scales(
    weight: torch.Tensor, fmt: str | FP4Format, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Block scales chosen from each block's amax, as llm-compressor's default observer.

    NVFP4: ``E4M3(global_scale * amax / 6)`` as float8_e4m3fn, shape (out, in/16).
    MXFP4: the E8M0 biased exponent as uint8, shape (out, in/32).
    """
    f = get_format(fmt)
    amax = _block_amax(weight, f.block_size)
    if f.name == "nvfp4":
        if global_scale is None:
            raise ValueError("NVFP4 block scales need the (fused) global scale")
        local = amax / torch.tensor(E2M1_MAX, dtype=amax.dtype)
        return _round_to_e4m3(global_scale * local)
    power = _round_amax_to_power_of_two(amax)
    exponent = E8M0_BIAS + torch.floor(torch.log2(power)) - MX_E2M1_EXPONENT_OFFSET
    code = torch.round(torch.clamp(exponent, 0, E8M0_MAX_CODE)).to(torch.uint8)
    # compressed-tensors holds the decoded step in the weight's dtype and replaces a
    # step that underflowed to 0 there (fp16 only, tiny blocks) by 1.0, i.e. code 127
    underflow = decode_scales(code, f).to(weight.dtype) == 0
    return torch.where(underflow, torch.tensor(E8M0_BIAS, dtype=torch.uint8), code)


def decode_scales(
    scales: torch.Tensor, fmt: str | FP4Format, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Stored block scales -> the float32 step of each block (what one code unit is worth)."""
    f = get_format(fmt)
    if f.name == "nvfp4":
        if global_scale is None:
            raise ValueError("NVFP4 needs weight_global_scale to decode its block scales")
        return scales.to(torch.float32) / global_scale.to(torch.float32)
    return torch.exp2(scales.to(torch.int32).to(torch.float32) - E8M0_BIAS)


# --- codes --------------------------------------------------------------------------
def _decision_points() -> torch.Tensor:
    """Boundaries as strict thresholds: a magnitude above the i-th gets at least code i+1.

    A boundary whose tie rounds up is moved to the float32 just below it, so that one
    strict comparison (one ``bucketize``) implements both tie directions.
    """
    points = []
    for boundary, tie_up in _E2M1_BOUNDARIES:
        b = torch.tensor(boundary, dtype=torch.float32)
        points.append(torch.nextafter(b, torch.tensor(0.0)) if tie_up else b)
    return torch.stack(points)


_E2M1_DECISION_POINTS = _decision_points()


def _encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their block step) to E2M1 codes (uint8)."""
    # float32 holds bf16 / fp16 values exactly, so the comparisons are unchanged
    magnitude = x.abs().to(torch.float32)
    points = _E2M1_DECISION_POINTS.to(magnitude.device)
    index = torch.bucketize(magnitude, points, right=False).to(torch.uint8)
    # a negative value that rounds to zero keeps its sign (-0.0), as upstream stores it
    sign = (x < 0).to(torch.uint8) * E2M1_SIGN_BIT
    return index | sign


def quantize_to_codes(
    weight: torch.Tensor,
    scales: torch.Tensor,
    fmt: str | FP4Format,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """E2M1 codes (uint8, one per weight, values 0..15) for ``weight`` under ``scales``."""
    f = get_format(fmt)
    if f.name == "nvfp4":
        # llm-compressor keeps the E4M3 scale in the weight's dtype (exact) and divides
        # by the float32 global scale
        step = scales.to(weight.dtype) / global_scale
    else:
        step = decode_scales(scales, f).to(weight.dtype)
    scaled = _blocks(weight, f.block_size) / step.unsqueeze(-1)
    scaled = torch.clamp(scaled, -E2M1_MAX, E2M1_MAX)
    return _encode_e2m1(scaled).flatten(-2)


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
    step = decode_scales(scales, f, global_scale)
    out = _blocks(values, f.block_size) * step.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes -> (out, in/2) bytes; even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise FormatError(f"cannot pack an odd number of columns ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) bytes -> (out, in) uint8 codes."""
    if packed.dtype != torch.uint8:
        raise FormatError(f"packed FP4 weights must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# --- public API ---------------------------------------------------------------------
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
        the amax choice (e.g. from :mod:`fp4sense.scale_search`)
    :param name: the tensor's name, used in error messages
    :return: ``weight_packed``, ``weight_scale`` and, for NVFP4, ``weight_global_scale``
    """
    f = get_format(fmt)
    check_weight(weight, f, name)
    weight = weight.detach()
    tensor_scale = _tensor_scale(weight, f, global_scale)
    if scales is None:
        scales = amax_block_scales(weight, f, tensor_scale)
    codes = quantize_to_codes(weight, scales, f, tensor_scale)
    out = {"weight_packed": pack_codes(codes), "weight_scale": scales.to(f.scale_dtype)}
    if tensor_scale is not None:
        out["weight_global_scale"] = tensor_scale
    return out


def _tensor_scale(
    weight: torch.Tensor, fmt: FP4Format, given: torch.Tensor | None
) -> torch.Tensor | None:
    """The NVFP4 global scale to use (the given fused one, or the weight's own); None for MX."""
    if not fmt.has_global_scale:
        return None
    if given is not None:
        return given.to(torch.float32).reshape(1)
    return global_scale(weight)


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
    """Fake-quantize ``weight`` (same shape and dtype): what a served checkpoint computes with."""
    return decompress(compress(weight, fmt, global_scale, scales, name), fmt, weight.dtype)


def quantize_dequantize_activations(
    x: torch.Tensor, fmt: str | FP4Format = "mxfp4"
) -> torch.Tensor:
    """Dynamic MXFP4 fake quantization of activations along the last dimension.

    Each block of 32 gets the E8M0 scale of its amax (the same rule as the weights), as
    compressed-tensors' dynamic MXFP4 input quantization and vLLM's W4A4 MXFP4 compute it.
    """
    f = get_format(fmt)
    if f.has_global_scale:
        raise FormatError("dynamic activation fake quantization here is for MXFP4 only")
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[-1] % f.block_size:
        raise FormatError(
            f"activation dimension {flat.shape[-1]} is not divisible by the MXFP4 block "
            f"size {f.block_size}"
        )
    scales = amax_block_scales(flat, f)
    codes = quantize_to_codes(flat, scales, f)
    return dequantize_codes(codes, scales, f, dtype=x.dtype).reshape(x.shape)
