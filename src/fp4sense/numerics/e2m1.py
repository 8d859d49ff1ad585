"""E2M1, the 4-bit element of NVFP4 and MXFP4: its values, the one rounder, its codes
and how two codes share a byte (compressed-tensors' packing).

A code is 4 bits: bit 3 the sign, bits 0-2 the index of the magnitude in
:data:`E2M1_VALUES`. Tested on every code point and every rounding tie against
compressed-tensors (``cast_to_fp4``, its compressors).
"""

from __future__ import annotations

import torch

from fp4sense.validate import UserError

__all__ = ["E2M1_MAGNITUDE_MASK", "E2M1_MAX", "E2M1_SIGN_BIT", "E2M1_VALUES", "E2M1Error",
           "e2m1_codes", "pack_codes", "round_to_e2m1", "unpack_codes"]

#: the eight E2M1 magnitudes, indexed by the low three bits of a code
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: bit 3 of an E2M1 code is its sign
E2M1_SIGN_BIT = 0b1000
E2M1_MAGNITUDE_MASK = 0b0111


class E2M1Error(UserError, ValueError):
    """Codes that cannot be packed or unpacked (says why)."""


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 rounder: nearest E2M1 value of ``x`` (``|x| <= 6``, already divided by its
    block step), ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4) — compressed-tensors' rounding, in a few exact
    vector passes in ``x``'s own dtype. Steps are 0.5 below 2, 1 below 4 and 2 up to 6,
    so rounding ``x / step`` half to even is exact. A negative value that rounds to zero
    keeps its sign (-0.0), as upstream stores it."""
    a = x.abs()
    r = torch.where(a < 2, torch.round(a * 2) / 2,
                    torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    r = r.clamp_(max=E2M1_MAX)
    return torch.where(x < 0, -r, r)


def e2m1_codes(values: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 values (from :func:`round_to_e2m1`) -> their 4-bit codes (uint8)."""
    a = values.abs().to(torch.float32)
    # magnitudes 0, .5, 1, 1.5 -> 0..3; 2, 3 -> 4, 5; 4, 6 -> 6, 7
    magnitude = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4))
    return magnitude.to(torch.uint8) | (negative.to(torch.uint8) * E2M1_SIGN_BIT)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes -> (out, in/2) bytes; even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise E2M1Error(f"cannot pack an odd number of columns ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """(out, in/2) bytes -> (out, in) uint8 codes."""
    if packed.dtype != torch.uint8:
        raise E2M1Error(f"packed FP4 weights must be uint8, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
