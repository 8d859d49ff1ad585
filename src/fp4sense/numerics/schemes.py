"""The scheme menu: names -> compressed-tensors QuantizationSchemes, and their bit cost.

A *scheme* is a weight format plus activation handling, one compressed-tensors
``QuantizationScheme``. Most of the menu is compressed-tensors' own preset table; what
the table lacks (our error-minimizing FP4 variants, the ``INT4`` name) is registered
into it by :func:`register_presets`, so ``QuantizationModifier(scheme="NVFP4A16_SEARCH")``
works like any preset once fp4sense is imported.

The ``*_SEARCH`` schemes store exactly the standard ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized`` tensors (vLLM loads them unchanged); only the choice of each
block scale differs: it is searched for the lowest output error instead of taken from
the block amax. The search itself is an llm-compressor observer
(``fp4sense_scale_search``) provided by the ``fp4sense-llmcompressor`` plugin.

The ``*_ACLIP`` schemes (W4A4 NVFP4 only) store the standard tensors too; their
``input_global_scale`` is made from a fraction of the calibration maximum that the
analysis chose for each unit (:mod:`fp4sense.numerics.input_clip`), which the plan
carries and the ``fp4sense_input_clip`` input observer applies.
"""

from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass, replace

import torch

from fp4sense.numerics.formats import BITS_PER_BYTE, FLOAT32_BYTES, get_format
from fp4sense.validate import UserError

__all__ = [
    "INPUT_CLIP_OBSERVER",
    "MENU",
    "SCALE_SEARCH_OBSERVER",
    "Scheme",
    "SchemeError",
    "bits_per_weight",
    "clip_key",
    "clips_of",
    "get_scheme",
    "menu_name_of",
    "register_presets",
    "rotations_of",
    "to_quantization_scheme",
    "with_search_twins",
]

#: registry name of the scale-search observer (plugins/llmcompressor)
SCALE_SEARCH_OBSERVER = "fp4sense_scale_search"
#: registry name of the input observer of the ``*_ACLIP`` schemes (plugins/llmcompressor):
#: llm-compressor's static min-max, its tensor scale made from a fraction of the maximum
INPUT_CLIP_OBSERVER = "fp4sense_input_clip"
INT4_GROUP_SIZE = 128
#: pack-quantized INT4 stores a (2,) int64 ``weight_shape`` beside each weight
INT4_SHAPE_BYTES = 2 * 8


class SchemeError(UserError, ValueError):
    """Unknown scheme name (the message lists the menu)."""


@dataclass(frozen=True)
class Scheme:
    """One entry of the menu (a description; functions below act on it)."""

    name: str
    preset: str | None  # compressed-tensors preset it is built from; None = left alone
    weight_format: str | None  # nvfp4 | mxfp4 | fp8 | int8 | int4 | None
    activations: str | None  # fp4 | fp8 | int8 | None (weight-only)
    scale_search: bool = False
    description: str = ""
    #: width of the block-Hadamard rotation applied to the input and the weight before
    #: quantization (:mod:`fp4sense.numerics.rotation`); None: not rotated
    rotation: int | None = None
    #: the NVFP4 input's tensor scale made from a fraction of the calibration maximum,
    #: chosen per unit by measurement (:mod:`fp4sense.numerics.input_clip`)
    input_clip: bool = False

    @property
    def quantizes(self) -> bool:
        """Whether this scheme changes a unit at all (BF16 leaves it alone)."""
        return self.weight_format is not None

    @property
    def is_fp4(self) -> bool:
        return self.weight_format in ("nvfp4", "mxfp4")

    @property
    def weight_bits(self) -> int | None:
        """Bits of one weight code (None: left alone)."""
        return None if self.weight_format is None else 4 if self.weight_format[-1] == "4" else 8

    @property
    def block_size(self) -> int | None:
        """Input-dimension granularity the weight format needs (None: any size)."""
        if self.is_fp4:
            size = get_format(self.weight_format).block_size
            return size if self.rotation is None else math.lcm(size, self.rotation)
        if self.weight_format == "int4":
            return INT4_GROUP_SIZE
        return None


_MENU_LIST = [
    Scheme("NVFP4", "NVFP4", "nvfp4", "fp4", description="W4A4 NVFP4 (E4M3 scales / 16)"),
    Scheme("NVFP4A16", "NVFP4A16", "nvfp4", None, description="NVFP4 weights, 16-bit activations"),
    Scheme("MXFP4", "MXFP4", "mxfp4", "fp4", description="W4A4 MXFP4 (E8M0 scales / 32)"),
    Scheme("MXFP4A16", "MXFP4A16", "mxfp4", None, description="MXFP4 weights, 16-bit activations"),
    Scheme("NVFP4_SEARCH", "NVFP4", "nvfp4", "fp4", True, "NVFP4 with searched block scales"),
    Scheme("NVFP4A16_SEARCH", "NVFP4A16", "nvfp4", None, True, "NVFP4A16, searched block scales"),
    Scheme("MXFP4_SEARCH", "MXFP4", "mxfp4", "fp4", True, "MXFP4 with searched block scales"),
    Scheme("MXFP4A16_SEARCH", "MXFP4A16", "mxfp4", None, True, "MXFP4A16, searched block scales"),
    Scheme("FP8_DYNAMIC", "FP8_DYNAMIC", "fp8", "fp8", description="FP8 per-channel weights, "
           "dynamic per-token FP8 activations"),
    Scheme("INT8", "W8A8", "int8", "int8", description="INT8 W8A8 (per-channel / per-token)"),
    Scheme("INT4", "W4A16", "int4", None, description="INT4 weights, group 128 (W4A16)"),
    Scheme("BF16", None, None, None, description="left unquantized"),
    *(Scheme(f"{base}_H{size}{'_SEARCH' if search else ''}", base, fmt, act, search,
             f"{base} after a {size}-wide block-Hadamard rotation"
             f"{', searched block scales' if search else ''} (+ one {size}x{size} matrix "
             "per checkpoint)", rotation=size)
      for search in (False, True)
      for base, fmt, act, sizes in (("NVFP4", "nvfp4", "fp4", (16, 64, 128)),
                                    ("NVFP4A16", "nvfp4", None, (16, 64, 128)),
                                    ("MXFP4", "mxfp4", "fp4", (32, 64, 128)),
                                    ("MXFP4A16", "mxfp4", None, (32, 64, 128)))
      for size in sizes),
]


def _clip_twin(scheme: Scheme) -> Scheme:
    """``scheme`` (W4A4 NVFP4) with its input's tensor scale chosen by measurement."""
    base = scheme.name.removesuffix("_SEARCH")
    return replace(scheme, name=f"{base}_ACLIP{'_SEARCH' if scheme.scale_search else ''}",
                   input_clip=True, description=f"{scheme.description}; the activations' "
                   "tensor scale chosen per unit by measurement")


_MENU_LIST += [_clip_twin(s) for s in _MENU_LIST
               if s.weight_format == "nvfp4" and s.activations == "fp4"]
MENU: dict[str, Scheme] = {s.name: s for s in _MENU_LIST}


def get_scheme(name: str | Scheme) -> Scheme:
    """The menu entry called ``name`` (case-insensitive)."""
    if isinstance(name, Scheme):
        return name
    key = str(name).upper()
    if key not in MENU:
        raise SchemeError(f"unknown scheme {name!r}; the menu is: {', '.join(MENU)}")
    return MENU[key]


def rotations_of(schemes) -> tuple[int, ...]:
    """The rotation widths the rotated schemes among ``schemes`` use (sorted)."""
    return tuple(sorted({get_scheme(s).rotation for s in schemes} - {None}))


def clips_of(schemes) -> tuple[int, ...]:
    """The inputs whose tensor scale the ``*_ACLIP`` schemes among ``schemes`` choose,
    by rotation width (0: the unrotated input), sorted."""
    return tuple(sorted({get_scheme(s).rotation or 0 for s in schemes
                         if get_scheme(s).input_clip}))


def clip_key(rotation: int | None) -> str:
    """The statistic holding a unit input's chosen fraction (``input_clip``, or
    ``input_clip_h16`` for the 16-wide rotated input)."""
    return "input_clip" if not rotation else f"input_clip_h{rotation}"


def with_search_twins(menu) -> list[str]:
    """``menu`` with each plain FP4 scheme's searched-scale twin added after it.

    A twin stores the same tensors at the same bits, so a plan holding both takes, unit
    by unit, whichever scores lower: the searched scales are used where they win.
    """
    names = [get_scheme(s).name for s in menu]
    out: list[str] = []
    for name in names:
        out.append(name)
        twin = f"{name}_SEARCH"
        if twin in MENU and twin not in names and twin not in out:
            out.append(twin)
    return out


def _preset_args(scheme: Scheme, input_fraction: float = 1.0) -> dict:
    """The keyword arguments of a QuantizationScheme for ``scheme`` (no targets); an
    ``*_ACLIP`` scheme's input observer makes its tensor scale from ``input_fraction`` of
    the calibration maximum."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    args = deepcopy(PRESET_SCHEMES[scheme.preset])
    if scheme.scale_search:
        args["weights"] = args["weights"].model_copy(
            update={"observer": SCALE_SEARCH_OBSERVER}
        )
    if scheme.input_clip:
        args["input_activations"] = args["input_activations"].model_copy(update={
            "observer": INPUT_CLIP_OBSERVER,
            "observer_kwargs": {"fraction": float(input_fraction)}})
    return args


def to_quantization_scheme(name: str | Scheme, targets: list[str],
                           input_fraction: float = 1.0):
    """compressed-tensors ``QuantizationScheme`` for ``name``; None for BF16.
    ``input_fraction``: an ``*_ACLIP`` scheme's chosen fraction of the input maximum."""
    from compressed_tensors.quantization import QuantizationScheme

    scheme = get_scheme(name)
    if not scheme.quantizes:
        return None
    return QuantizationScheme(targets=targets, **_preset_args(scheme, input_fraction))


def _signature(args) -> tuple | None:
    """What a QuantizationArgs computes (its observer only where it is fp4sense's: the
    scale search, the input clip; llm-compressor fills in its default observer when it
    attaches a scheme)."""
    if args is None:
        return None
    ours = args.observer if args.observer in (SCALE_SEARCH_OBSERVER, INPUT_CLIP_OBSERVER) \
        else None
    return (args.num_bits, str(args.type), args.symmetric, args.group_size,
            str(args.strategy), args.dynamic, ours)


def menu_name_of(qscheme) -> str | None:
    """The menu name of an attached compressed-tensors ``QuantizationScheme`` (same weight
    and input quantization, scale search or not), or None when no menu entry computes it."""
    got = (_signature(qscheme.weights), _signature(qscheme.input_activations),
           _signature(qscheme.output_activations))
    for scheme in MENU.values():
        if not scheme.quantizes or scheme.rotation:
            continue
        ref = to_quantization_scheme(scheme, list(qscheme.targets))
        if got == (_signature(ref.weights), _signature(ref.input_activations),
                   _signature(ref.output_activations)):
            return scheme.name
    return None


def register_presets() -> list[str]:
    """Add the menu names compressed-tensors lacks to its preset table (idempotent).

    :return: the names added by this call
    """
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    added = []
    # (a rotation is no quantization scheme: transform_config; an input clip's fraction
    # is the plan's, unit by unit)
    for scheme in MENU.values():
        if (not scheme.quantizes or scheme.rotation or scheme.input_clip
                or scheme.name in PRESET_SCHEMES):
            continue
        PRESET_SCHEMES[scheme.name] = _preset_args(scheme)
        added.append(scheme.name)
    return added


def bits_per_weight(
    name: str | Scheme, shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> float:
    """Stored bits per weight of an (out, in) linear under ``name``.

    Counts every tensor compressed-tensors writes for the linear: packed weights,
    scales (in ``dtype``, the checkpoint's dtype, where the format keeps them there),
    global scales, the NVFP4 input global scale, INT4's ``weight_shape``.
    """
    scheme = get_scheme(name)
    out_features, in_features = shape
    n = out_features * in_features
    dtype_bits = torch.finfo(dtype).bits
    fmt = scheme.weight_format
    if fmt is None:
        return float(dtype_bits)
    if scheme.is_fp4:
        f = get_format(fmt)
        bits = n * 4 + (n // f.block_size) * f.scale_bits
        if f.has_global_scale:
            bits += FLOAT32_BYTES * BITS_PER_BYTE
            if scheme.activations == "fp4":
                bits += FLOAT32_BYTES * BITS_PER_BYTE  # input_global_scale
        return bits / n
    if fmt in ("fp8", "int8"):
        return (n * 8 + out_features * dtype_bits) / n
    if fmt == "int4":
        groups = out_features * (in_features // INT4_GROUP_SIZE)
        return (n * 4 + groups * dtype_bits + INT4_SHAPE_BYTES * BITS_PER_BYTE) / n
    raise SchemeError(f"no bit accounting for weight format {fmt!r}")  # pragma: no cover
