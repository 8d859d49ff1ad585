"""The straight-through fake quantization QAD trains under: every trained linear's weight
is ``W + (Q(W) - W)`` with the difference held constant (the forward computes with the
quantized weight, the gradient reaches the float32 master weight as is), and W4A4 / W8A8
inputs the same; a quantizer refreshes the differences from the current weights (see
:mod:`fp4sense.quantization.distill`).

A rotated scheme trained before calibration (``NVFP4_H16``: the rotation is not in the
model yet) computes ``Q(x R) Q(W R)^T`` the same way, in the rotated basis: the weight is
``W R + (Q(W R) - W R)`` and the input ``x R + (Q(x R) - x R)``, with ``W R`` and ``x R``
differentiable, so the gradient reaches the master weight, kept in the model's own
basis, through the rotation (the oneshot then rotates the trained weights as usual).

With a training recipe for the backward (``backward``: nvfp4, mxfp4, mxfp8), each trained
linear computes its forward as above and its two backward GEMMs as FP4 training does:
dgrad ``dY·W`` and wgrad ``dYᵀ·X`` from operands quantized as the recipe says
(:func:`fp4sense.numerics.training_linear.emulated_linear`: NVFP4's stochastic rounding of
dY and Hadamard transform of wgrad's operands included), the operands being the ones the
forward computed with (the straight-through weight and input). The gradient reaching the
master weight is then the one FP4 training would apply.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils import parametrize

from fp4sense.numerics.fakequant import activation_quantizer
from fp4sense.numerics.input_clip import attached_fraction
from fp4sense.numerics.rotation import rotate_input, rotate_weight
from fp4sense.numerics.training_linear import GemmPrecision, emulated_linear
from fp4sense.structure.units import quantize_unit, unit_scales

__all__ = ["FrozenRefresher", "Refresher", "install"]


class _StraightThrough(torch.nn.Module):
    """weight -> weight + delta, delta = Q(weight) - weight held constant: the forward
    computes with the quantized weight, the gradient reaches the master weight as is.
    With ``rotation``: ``W R`` in place of the weight (the gradient through ``R``)."""

    def __init__(self, rotation: int | None = None):
        super().__init__()
        self.delta: torch.Tensor | None = None
        self.rotation = rotation

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            weight = rotate_weight(weight, self.rotation)
        return weight if self.delta is None else weight + self.delta


class _RecipeBackward:
    """A trained linear's forward replaced by :func:`emulated_linear` with BF16 fprop and
    the recipe's dgrad and wgrad: the same output, the backward GEMMs quantized.
    ``remove()`` puts back the forward the module had (a host's wrapper included)."""

    def __init__(self, module, precision: GemmPrecision, generator: torch.Generator):
        self.module, self.precision, self.generator = module, precision, generator
        self.own = module.__dict__.get("forward")
        module.forward = self

    def __call__(self, x):
        m = self.module
        return emulated_linear(x, m.weight, m.bias, self.precision, self.generator)

    def remove(self) -> None:
        if self.own is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.own


def install(modules, trained, absmax, inputs: dict[str, Callable] | None,
            backward: str = "bf16", seed: int = 0):
    """Straight-through weights and inputs (``inputs``: fixed-scale input quantizers, per
    linear, instead of fp4sense's own: the host's, after its calibration, which has put
    any rotation into the model already); returns the trainable weights and hooks. A
    rotated scheme under fp4sense's own quantizers rotates here (``absmax``: of the
    rotated input). ``backward``: the training recipe of the backward GEMMs (stochastic
    rounding drawn from a generator seeded with ``seed``)."""
    params, hooks = [], []
    precision = GemmPrecision.of({"dgrad": backward, "wgrad": backward})
    generator = None
    for unit, scheme in trained:
        rotation = scheme.rotation if inputs is None else None
        for m in unit.modules:
            mod = modules[m]
            parametrize.register_parametrization(mod, "weight", _StraightThrough(rotation),
                                                 unsafe=True)
            weight = mod.parametrizations.weight.original
            weight.requires_grad_(True)
            params.append(weight)
            quantize_input = (inputs.get(m) if inputs is not None
                              else activation_quantizer(
                                  scheme, absmax[m] * attached_fraction(mod) or None))
            if quantize_input is not None:
                hooks.append(mod.register_forward_pre_hook(_input(quantize_input, rotation)))
            if precision.quantized:
                generator = generator or torch.Generator(weight.device).manual_seed(seed)
                hooks.append(_RecipeBackward(mod, precision, generator))
    return params, hooks


def _input(quantize: Callable, rotation: int | None):
    """The straight-through input: ``x + (Q(x) - x)``, or with ``rotation`` ``x R + (Q(x R)
    - x R)`` (``quantize`` rotates its input itself, as a rotated scheme's quantizer does;
    the gradient reaches ``x`` through ``R``)."""

    def pre(_module, args):
        x = args[0]
        seen = x if rotation is None else rotate_input(x, rotation)
        return (seen + (quantize(x.detach()) - seen).detach(), *args[1:])

    return pre


class Refresher:
    """Refreshes every straight-through delta from the current master weights, quantized
    in ``dtype`` (the one the host calibrates in)."""

    def __init__(self, modules, trained, importance, dtype: torch.dtype = torch.bfloat16):
        self.modules, self.trained, self.importance = modules, trained, importance
        self.dtype = dtype
        self.scales: dict[str, torch.Tensor] = {}  # searched block scales, per linear

    @torch.no_grad()
    def refresh(self, search: bool) -> None:
        for unit, scheme in self.trained:
            mods = [self.modules[m] for m in unit.modules]
            ws = [mod.parametrizations.weight.original for mod in mods]
            imps = [self.importance.get(m) for m in unit.modules]
            kept = None
            if scheme.scale_search:  # searched now, or kept from the last search
                if search or any(m not in self.scales for m in unit.modules):
                    found = unit_scales(scheme.name, unit, ws, importance=imps,
                                        dtype=self.dtype)
                    self.scales.update(zip(unit.modules, found, strict=True))
                kept = [self.scales[m] for m in unit.modules]
            qs = quantize_unit(scheme.name, unit, ws, importance=imps, block_scales=kept,
                               dtype=self.dtype)
            for mod, w, q in zip(mods, ws, qs, strict=True):  # q: in the rotated basis
                seen = w if scheme.rotation is None else rotate_weight(w, scheme.rotation)
                mod.parametrizations.weight[0].delta = (q.to(w.dtype) - seen).detach()


class FrozenRefresher:
    """Refreshes the deltas with fixed-scale quantizers (nothing to search)."""

    def __init__(self, modules, names, weights: dict[str, Callable]):
        self.modules, self.names, self.weights = modules, names, weights
        self.scales: dict[str, torch.Tensor] = {}  # (saved with a state; none here)

    @torch.no_grad()
    def refresh(self, search: bool) -> None:
        for m in self.names:
            w = self.modules[m].parametrizations.weight.original
            q = self.weights[m](w)
            self.modules[m].parametrizations.weight[0].delta = (q.to(w.dtype) - w).detach()
