"""An emulated FP4-training linear: fprop, dgrad and wgrad each computed from their operands
quantized as their recipe says (:mod:`fp4sense.numerics.training`), on a CPU or a GPU
alike, through ``torch.autograd``; and one call that puts a per-layer, per-GEMM policy on
a model's linears.

Operands per GEMM (W is (out N, in K), X (tokens M, K), dY (M, N)), as Transformer
Engine lays them out:

=======  ==================================  ======================================
GEMM     operand A                           operand B
=======  ==================================  ======================================
fprop    X along K                           W along K (NVFP4: 16×16 tiles)
dgrad    dY along N (stochastic rounding)    Wᵀ along N (NVFP4: fprop's tiles)
wgrad    dYᵀ along M (Hadamard, stochastic)  Xᵀ along M (Hadamard)
=======  ==================================  ======================================

Each GEMM multiplies the dequantized operands in float32 (the tensor cores accumulate
in FP32; the emulation is exact in the quantization, not in the GEMM's summation order).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from fp4sense.numerics.training import GEMMS, Recipe, get_recipe, rht
from fp4sense.validate import InputError

__all__ = ["EmulatedLinear", "GemmPrecision", "apply_training_policy", "emulated_linear",
           "gemm_operands"]


@dataclass(frozen=True)
class GemmPrecision:
    """The recipe of each of a linear's three GEMMs ("bf16": not quantized)."""

    fprop: Recipe
    dgrad: Recipe
    wgrad: Recipe

    @classmethod
    def of(cls, value: str | Recipe | Mapping | GemmPrecision) -> GemmPrecision:
        """One recipe for all three GEMMs, or a mapping ``{gemm: recipe}`` (missing GEMMs
        stay BF16)."""
        if isinstance(value, GemmPrecision):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - set(GEMMS)
            if unknown:
                raise InputError(f"unknown GEMM {sorted(unknown)}; the GEMMs are "
                                 f"{', '.join(GEMMS)}")
            return cls(*(get_recipe(value.get(g, "bf16")) for g in GEMMS))
        recipe = get_recipe(value)
        return cls(recipe, recipe, recipe)

    def to_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name).name for f in fields(self)}

    @property
    def quantized(self) -> bool:
        return any(getattr(self, g).element is not None for g in GEMMS)


def gemm_operands(gemm: str, recipe: Recipe, x: torch.Tensor, weight: torch.Tensor,
                  grad: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two quantized operands of ``gemm`` (dequantized, float32) laid out for a plain
    ``a @ b.T``: fprop (X, W), dgrad (dY, Wᵀ), wgrad (dYᵀ, Xᵀ). ``x``: (M, K), ``weight``:
    (N, K), ``grad``: (M, N)."""
    tile = recipe.weight_2d
    if gemm == "fprop":
        return recipe.quantize(x, "input"), recipe.quantize(weight, "weight", tile=tile)
    if gemm == "dgrad":
        w_t = recipe.quantize(weight, "weight", tile=True).t() if tile else \
            recipe.quantize(weight.t(), "weight")
        return recipe.quantize(grad, "grad", generator), w_t
    if gemm == "wgrad":
        g_t, x_t = grad.t().float(), x.t().float()
        if recipe.rht and recipe.element is not None:
            g_t, x_t = rht(g_t), rht(x_t)  # zero tokens pad both alike
        return recipe.quantize(g_t, "grad", generator), recipe.quantize(x_t, "input")
    raise InputError(f"unknown GEMM {gemm!r}; the GEMMs are {', '.join(GEMMS)}")


def _gemm(gemm, recipe, x, weight, grad=None, generator=None) -> torch.Tensor:
    if recipe.element is None:  # high precision: the products autograd computes for linear
        return {"fprop": lambda: x @ weight.t(), "dgrad": lambda: grad @ weight,
                "wgrad": lambda: grad.t() @ x}[gemm]()
    a, b = gemm_operands(gemm, recipe, x, weight, grad, generator)
    return a @ b.t()


class _EmulatedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, precision: GemmPrecision, generator):
        x2 = x.reshape(-1, x.shape[-1])
        if precision.fprop.element is None:
            y = torch.nn.functional.linear(x2, weight, bias)
        else:
            y = _gemm("fprop", precision.fprop, x2, weight).to(x.dtype)
            y = y if bias is None else y + bias
        # TE saves quantized copies made from these same tensors; quantizing them again
        # here gives the same codes (stochastic rounding draws anew, as it would)
        ctx.save_for_backward(x2, weight)
        ctx.precision, ctx.generator, ctx.shape = precision, generator, x.shape
        ctx.has_bias = bias is not None
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight = ctx.saved_tensors
        p, g = ctx.precision, ctx.generator
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _gemm("dgrad", p.dgrad, x2, weight, dy, g).to(grad_out.dtype).view(ctx.shape)
        if ctx.needs_input_grad[1]:
            dw = _gemm("wgrad", p.wgrad, x2, weight, dy, g)[:, : weight.shape[1]] \
                .to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0).to(grad_out.dtype)
        return dx, dw, db, None, None


def emulated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    precision: str | Recipe | Mapping | GemmPrecision,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with each GEMM of its training step quantized as
    ``precision`` says (forward and, through autograd, backward)."""
    return _EmulatedLinearFunction.apply(x, weight, bias, GemmPrecision.of(precision),
                                         generator)


class EmulatedLinear(torch.nn.Module):
    """An ``nn.Linear``'s parameters trained under a :class:`GemmPrecision` (the same
    Parameter objects: an optimizer built before the swap keeps working)."""

    def __init__(self, linear: torch.nn.Linear, precision, generator=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.precision = GemmPrecision.of(precision)
        self.generator = generator

    def forward(self, x):
        if not self.precision.quantized:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return emulated_linear(x, self.weight, self.bias, self.precision, self.generator)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.precision.to_dict()}"


def apply_training_policy(model: torch.nn.Module, policy: Mapping[str, object],
                          default: object = "bf16", generator=None) -> dict[str, GemmPrecision]:
    """Put a precision on every ``nn.Linear`` of ``model`` (in place): ``policy`` maps a
    module name, or ``re:REGEX`` (matched whole, the first that matches wins), to a
    recipe or ``{gemm: recipe}``; the others get ``default``. Returns name -> precision
    of every linear. A policy entry that matches no linear is refused by name."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               or isinstance(m, EmulatedLinear)]
    rules = [(re.compile(k[3:]) if k.startswith("re:") else None, k,
              GemmPrecision.of(v)) for k, v in policy.items()]
    used, chosen = set(), {}
    fallback = GemmPrecision.of(default)
    for name, module in linears:
        key, precision = next(((k, p) for pattern, k, p in rules
                               if (pattern.fullmatch(name) if pattern else k == name)),
                              (None, fallback))
        used.add(key)
        chosen[name] = precision
        if isinstance(module, EmulatedLinear):  # a policy again: its draws anew
            module.precision, module.generator = precision, generator
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, EmulatedLinear(module, precision, generator))
    unused = [k for _, k, _ in rules if k not in used]
    if unused:
        raise InputError(f"training policy: {unused[0]!r} matches no linear of the model "
                         f"(its linears are named like {linears[0][0] if linears else '-'!r})")
    return chosen
