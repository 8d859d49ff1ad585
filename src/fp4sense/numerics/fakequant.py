"""What a unit computes under a scheme, in memory: fake-quantized weights and activations.

The sensitivity analysis perturbs one unit at a time and needs, fast and without
llm-compressor's calibration machinery, the same numbers a checkpoint would carry:

- FP4 weights go through :mod:`fp4sense.numerics.formats` (bit for bit compressed-tensors'),
  with the NVFP4 global scale shared by the parts of a fused group, as llm-compressor
  writes it; the ``*_SEARCH`` schemes take their block scales from
  :func:`fp4sense.numerics.scale_search.search_block_scales`, weighted by each input
  channel's E[x^2] where given (what the ``fp4sense_scale_search`` observer does);
- FP8 / INT8 / INT4 weights use compressed-tensors' own ``calculate_qparams`` and
  ``fake_quantize`` on min / max taken per channel or per group (what the default
  min-max observer sees);
- input activations use compressed-tensors' ``forward_quantize`` with the scheme's
  dynamic arguments; NVFP4 inputs need a static global scale, made from the input's
  absolute maximum over the analysis text (as llm-compressor calibrates it).

Weights are quantized in the checkpoint dtype (bf16 by default, what llm-compressor
loads) and handed back in the model's dtype, a slice of rows at a time: every weight
format here scales per row or per block within a row (the NVFP4 global scale is taken
from the whole group first), so the slices give the same bits as the whole tensor, and
the temporaries of a large weight stay the size of a slice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from compressed_tensors.quantization import QuantizationStatus, QuantizationStrategy
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, forward_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from fp4sense.numerics import formats, fp4
from fp4sense.numerics.rotation import rotate_input, rotate_weight
from fp4sense.numerics.scale_search import search_block_scales
from fp4sense.numerics.schemes import MENU, Scheme, clip_key, get_scheme, to_quantization_scheme

__all__ = ["activation_quantizer", "input_absmax", "quantize_weights", "searched_scales"]

#: elements of one weight quantized at once (bounds the temporaries, not the result)
ROW_SLICE_ELEMENTS = 1 << 20


def _row_step(weight: torch.Tensor) -> int:
    """Rows of ``weight`` in one slice."""
    return max(1, ROW_SLICE_ELEMENTS // max(1, weight[0].numel()))


def _by_rows(weight: torch.Tensor, fn: Callable[[slice], torch.Tensor],
             out_dtype: torch.dtype) -> torch.Tensor:
    """``fn(rows)`` over slices of ``weight``'s rows, written into one ``out_dtype`` result."""
    step = _row_step(weight)
    if weight.shape[0] <= step:
        return fn(slice(None)).to(out_dtype)
    out = torch.empty(weight.shape, dtype=out_dtype, device=weight.device)
    for r in range(0, weight.shape[0], step):
        out[r:r + step] = fn(slice(r, r + step))
    return out


def _minmax_qdq(weight: torch.Tensor, args, scale_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """compressed-tensors fake quantization with min-max qparams (channel or group);
    ``scale_dtype``: the dtype the checkpoint stores the scales in, where that is not the
    weight's (a float32 calibration of a bf16 model stores them rounded to bf16)."""

    if args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    elif args.strategy == QuantizationStrategy.GROUP:
        grouped = weight.unflatten(-1, (-1, args.group_size))
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    else:  # pragma: no cover - no menu scheme uses another weight strategy
        raise ValueError(f"unsupported weight strategy {args.strategy}")
    scale, zero_point = calculate_qparams(lo, hi, args)
    if scale_dtype is not None and scale_dtype != scale.dtype:
        scale = scale.to(scale_dtype).to(scale.dtype)
    return fake_quantize(weight, scale, zero_point, args)


@torch.no_grad()
def quantize_weights(
    scheme: str | Scheme,
    weights: Sequence[torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    importance: Sequence[torch.Tensor | None] | None = None,
    block_scales: Sequence[torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    only: int | None = None,
    scale_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Fake-quantized copies of ``weights`` (the parts of one unit) under ``scheme``, in
    ``out_dtype`` (default: each weight's own); with ``only``, of that part alone (its
    global scale still the whole group's: the same bits, a list of one).

    ``dtype`` is the one the host calibrates in (the weights are quantized, and the scales
    computed, in it); ``scale_dtype`` the one the checkpoint stores FP8 / INT scales in
    (default: ``dtype``; FP4 formats fix their scales' dtypes).

    The parts of a fused group are passed together: NVFP4 gives them one global scale.
    ``importance`` (one (in,) E[x^2] per part, or None) weights the block-scale search of
    the ``*_SEARCH`` schemes; without it the search minimizes the plain weight error.
    ``block_scales`` (one per part, from :func:`searched_scales`) are used instead of
    searching again.

    A rotated scheme's weights come back in the rotated basis (``Q(W R)``, what the
    checkpoint stores): use them with :func:`activation_quantizer`'s function, which
    rotates the input (``Q(x R) Q(W R)^T``, what vLLM computes).
    """
    s = get_scheme(scheme)
    pick = (lambda xs: xs) if only is None else (lambda xs: [xs[only]])
    out_dtype = [out_dtype or w.dtype for w in pick(weights)]
    shared = s.is_fp4 and formats.get_format(s.weight_format).has_global_scale
    # in the calibration dtype; a rotated scheme's in the rotated basis (W R), as stored
    ready = [_prepared(w, dtype, s.rotation) if shared or only is None or i == only else None
             for i, w in enumerate(weights)]
    gs = formats.global_scale(*ready) if shared else None
    ws = pick(ready)
    if importance is not None:
        importance = pick(list(importance))
    if block_scales is not None:
        block_scales = pick(list(block_scales))
    if s.weight_format is None:
        return [w.to(d) for w, d in zip(ws, out_dtype, strict=True)]
    if s.is_fp4:
        fmt = formats.get_format(s.weight_format)
        if s.scale_search and block_scales is None:
            block_scales = _search(ws, fmt, gs, importance)
        given = list(block_scales) if s.scale_search else [None] * len(ws)
        return [_by_rows(w, lambda rows, w=w, sc=sc: fp4.quantize_dequantize(
                    w[rows], fmt, global_scale=gs, scales=None if sc is None else sc[rows]), d)
                for w, sc, d in zip(ws, given, out_dtype, strict=True)]
    args = to_quantization_scheme(s, ["Linear"]).weights
    return [_by_rows(w, lambda rows, w=w: _minmax_qdq(w[rows], args, scale_dtype), d)
            for w, d in zip(ws, out_dtype, strict=True)]


def _prepared(weight: torch.Tensor, dtype: torch.dtype, rotation: int | None) -> torch.Tensor:
    """``weight`` in ``dtype``; with ``rotation``, rotated (``W R``) a slice of rows at a
    time (the rotation mixes columns only: the same bits as the whole tensor at once)."""
    w = weight.detach().to(dtype)
    if rotation is None:
        return w
    return _by_rows(w, lambda rows: rotate_weight(w[rows], rotation), dtype)


def searched_scales(
    scheme: str | Scheme,
    weights: Sequence[torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    importance: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """The block scales a ``*_SEARCH`` scheme's search picks for ``weights`` (the parts
    of one unit, as :func:`quantize_weights` takes them), one per part; a rotated
    scheme's for the rotated weights (``W R``), as it quantizes them."""
    s = get_scheme(scheme)
    if not s.scale_search:
        raise ValueError(f"{s.name} does not search its block scales")
    fmt = formats.get_format(s.weight_format)
    ws = [_prepared(w, dtype, s.rotation) for w in weights]
    return _search(ws, fmt, formats.global_scale(*ws) if fmt.has_global_scale else None,
                   importance)


def _search(ws, fmt, gs, importance) -> list[torch.Tensor]:
    imps = list(importance) if importance is not None else [None] * len(ws)
    # per block, so per slice of rows (the global scale is the whole group's)
    return [torch.cat([search_block_scales(w[r:r + _row_step(w)], fmt, gs, imp)
                       for r in range(0, w.shape[0], _row_step(w))])
            for w, imp in zip(ws, imps, strict=True)]


def activation_quantizer(
    scheme: str | Scheme, input_amax: float | None = None
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A function fake-quantizing a linear's input as ``scheme`` serves it, or None when
    the scheme keeps activations in 16 bits. NVFP4 needs ``input_amax`` (its static
    input global scale is made from it, as llm-compressor calibrates it). A rotated
    scheme always has one: it rotates the input (``x R``), then quantizes it as its
    unrotated scheme does (``input_amax``: the rotated input's, :func:`input_absmax`).

    FP4 inputs go through :func:`fp4sense.numerics.fp4.quantize_dequantize_activations`, the
    one activation quantizer; FP8 / INT8 through compressed-tensors' ``forward_quantize``.
    """

    s = get_scheme(scheme)
    if s.rotation is not None:  # the input rotated first (amax: of the rotated input)
        plain = activation_quantizer(MENU[s.preset], input_amax)
        return functools.partial(_rotated_input, rotation=s.rotation, then=plain)
    if s.activations is None:
        return None
    if s.is_fp4:
        fmt = formats.get_format(s.weight_format)
        global_scale = None
        if fmt.has_global_scale:
            if input_amax is None:
                raise ValueError(f"{s.name} quantizes inputs under a static global scale: "
                                 "pass the input's absolute maximum")
            amax = torch.tensor(float(input_amax))
            global_scale = generate_gparam(-amax, amax)

        on: dict[torch.device, torch.Tensor] = {}  # the global scale on each input's device

        def quantize_fp4(x: torch.Tensor) -> torch.Tensor:
            gs = global_scale
            if gs is not None and gs.device != x.device:
                gs = on.setdefault(x.device, gs.to(x.device))
            return fp4.quantize_dequantize_activations(x, fmt, gs)

        return quantize_fp4

    args = to_quantization_scheme(s, ["Linear"]).input_activations
    # forward_quantize reads the status from a module
    holder = torch.nn.Module()
    holder.quantization_status = QuantizationStatus.FROZEN

    def quantize(x: torch.Tensor) -> torch.Tensor:
        return forward_quantize(holder, x, "input", args)

    return quantize


def input_absmax(stats: dict, scheme: str | Scheme) -> float | None:
    """The input maximum ``scheme`` calibrates its input global scale from, out of one
    linear's base-pass statistics: the rotated input's for a rotated scheme; for an
    ``*_ACLIP`` scheme, the fraction of it the analysis chose for the unit."""
    s = get_scheme(scheme)
    amax = stats.get("absmax" if s.rotation is None else f"absmax_h{s.rotation}")
    if not s.input_clip or amax is None:
        return amax
    chosen = stats.get(clip_key(s.rotation))
    if chosen is None:
        raise ValueError(f"{s.name}: no tensor-scale fraction was chosen for this input "
                         "(the analysis chooses it in its base pass)")
    return amax * chosen["fraction"]


def _rotated_input(x: torch.Tensor, rotation: int,
                   then: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    x = rotate_input(x, rotation)
    return x if then is None else then(x)
