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

import torch

from fp4sense.numerics.e2m1 import E2M1_MAX, E2M1Error
from fp4sense.validate import register_unique

__all__ = [
    "E4M3_MAX",
    "E8M0_BIAS",
    "FORMATS",
    "FP4Format",
    "FormatError",
    "check_weight",
    "decode_scales",
    "get_format",
    "global_scale",
    "amax_block_scales",
    "register_format",
]

# --- named constants (no magic numbers below; E2M1's own are in fp4sense.numerics.e2m1) -----
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


class FormatError(E2M1Error):
    """A weight cannot be stored in the requested FP4 format (says which and why)."""


#: name -> format; filled by :func:`register_format`
FORMATS: dict[str, FP4Format] = {}


def register_format(cls: type[FP4Format]) -> type[FP4Format]:
    """Class decorator: make an FP4 format available by its name (``get_format``)."""
    register_unique(FORMATS, cls.name, cls(), cls, "FP4 format")
    return cls


class FP4Format:
    """E2M1 elements in blocks along the input dimension, each block with a stored scale.

    A subclass says how a block's scale is chosen from its amax, stored, decoded and
    stepped; packing, codes and rounding are shared (compressed-tensors' MXFP4
    compressor likewise subclasses its NVFP4 one). Describes; the functions below act.
    """

    name: str
    block_size: int
    scale_dtype: torch.dtype
    compression_format: str  # compressed-tensors' CompressionFormat value
    has_global_scale: bool = False
    #: stored-scale codes a scale search may move to (never 0: an empty scale)
    min_scale_code: int
    max_scale_code: int
    #: candidate offsets (in stored-scale steps) a scale search tries around amax
    search_steps: tuple[int, int]

    @property
    def scale_bits(self) -> int:
        return torch.finfo(self.scale_dtype).bits if self.scale_dtype.is_floating_point else 8

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)

    def tensor_scale(self, weights: tuple[torch.Tensor, ...],
                     given: torch.Tensor | None) -> torch.Tensor | None:
        """The tensor-wide scale to use (None where the format has none)."""
        return None

    def block_scales(self, amax: torch.Tensor, dtype: torch.dtype,
                     tensor_scale: torch.Tensor | None) -> torch.Tensor:
        """Stored block scales for blocks with absolute maximum ``amax``."""
        raise NotImplementedError

    def decode_scales(self, scales: torch.Tensor,
                      tensor_scale: torch.Tensor | None) -> torch.Tensor:
        """Stored block scales -> the float32 step of each block."""
        raise NotImplementedError

    def quantize_step(self, scales: torch.Tensor, tensor_scale: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
        """The step a value of ``dtype`` is divided by before rounding (as upstream)."""
        return self.decode_scales(scales, tensor_scale).to(dtype)

    def scale_codes(self, scales: torch.Tensor) -> torch.Tensor:
        """Stored scales as ordered unsigned codes (bigger code, bigger scale)."""
        return scales.view(torch.uint8)

    def scales_from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.uint8).view(self.scale_dtype)


@register_format
class NVFP4Format(FP4Format):
    """NVFP4: blocks of 16, FP8 E4M3 block scales under an FP32 global scale."""

    name = "nvfp4"
    block_size = 16
    scale_dtype = torch.float8_e4m3fn
    compression_format = "nvfp4-pack-quantized"
    has_global_scale = True
    # positive E4M3 bit patterns are ordered like their values; 0x7F is NaN
    min_scale_code = 1
    max_scale_code = 0x7E  # 448
    #: E4M3 steps are 2^(1/8) apart: -6..+6 spans about 0.6x..1.7x of the amax scale
    search_steps = (-6, 6)

    def tensor_scale(self, weights, given):
        if given is not None:
            return given.to(torch.float32).reshape(1)
        return global_scale(*weights)

    def block_scales(self, amax, dtype, tensor_scale):
        if tensor_scale is None:
            raise ValueError("NVFP4 block scales need the (fused) global scale")
        local = amax / torch.tensor(E2M1_MAX, dtype=amax.dtype)
        return _round_to_e4m3(tensor_scale * local)

    def decode_scales(self, scales, tensor_scale):
        if tensor_scale is None:
            raise ValueError("NVFP4 needs weight_global_scale to decode its block scales")
        return scales.to(torch.float32) / tensor_scale.to(torch.float32)

    def quantize_step(self, scales, tensor_scale, dtype):
        # llm-compressor keeps the E4M3 scale in the weight's dtype (exact) and divides
        # by the float32 global scale
        return scales.to(dtype) / tensor_scale


@register_format
class MXFP4Format(NVFP4Format):
    """MXFP4 (OCP MX): blocks of 32, E8M0 power-of-two block scales, no global scale."""

    name = "mxfp4"
    block_size = 32
    scale_dtype = torch.uint8
    compression_format = "mxfp4-pack-quantized"
    has_global_scale = False
    min_scale_code = 0
    max_scale_code = 254  # 255 is reserved for NaN in the OCP MX spec
    #: E8M0 steps are factors of 2
    search_steps = (-1, 1)

    def tensor_scale(self, weights, given):
        return None

    def block_scales(self, amax, dtype, tensor_scale):
        power = _round_amax_to_power_of_two(amax)
        exponent = E8M0_BIAS + torch.floor(torch.log2(power)) - MX_E2M1_EXPONENT_OFFSET
        code = torch.round(torch.clamp(exponent, 0, E8M0_MAX_CODE)).to(torch.uint8)
        # compressed-tensors holds the decoded step in the weight's dtype and replaces a
        # step that underflowed to 0 there (fp16 only, tiny blocks) by 1.0, i.e. code 127
        underflow = self.decode_scales(code, None).to(dtype) == 0
        return torch.where(underflow, torch.tensor(E8M0_BIAS, dtype=torch.uint8), code)

    def decode_scales(self, scales, tensor_scale):
        return torch.exp2(scales.to(torch.int32).to(torch.float32) - E8M0_BIAS)

    def quantize_step(self, scales, tensor_scale, dtype):
        return self.decode_scales(scales, None).to(dtype)


NVFP4 = FORMATS["nvfp4"]
MXFP4 = FORMATS["mxfp4"]


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
    return f.block_scales(_block_amax(weight, f.block_size), weight.dtype, global_scale)


def decode_scales(
    scales: torch.Tensor, fmt: str | FP4Format, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Stored block scales -> the float32 step of each block (what one code unit is worth)."""
    return get_format(fmt).decode_scales(scales, global_scale)
