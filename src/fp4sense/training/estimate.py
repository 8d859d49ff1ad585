"""The estimated FP4 training sensitivity: one forward/backward pass per seed, in which
every unit's linears compute their exact outputs and gradients (what flows on) and, beside
them, what each of their three GEMMs gives with the recipe's quantized operands. So each
GEMM's error is measured where it arises, with every other GEMM exact: all units at once.

Per unit and GEMM (sums over the unit's linears):

- ``rel_error``: ‖Q − R‖ / ‖R‖, the root mean over seeds (R the exact GEMM output: the
  unit's output Y for fprop, the gradient it sends back dX for dgrad, its weight gradient
  dW for wgrad);
- wgrad also ``cosine`` (mean over seeds) and ``bias``: ‖mean over seeds of Q − R‖ / ‖R‖,
  the part stochastic rounding does not average away;
- ``damage``: the error as a share of the model's gradient power, one scale for the three
  GEMMs: wgrad's error power over the whole model's ‖dW‖²; dgrad's relative error
  squared times the share of ‖dW‖² of the units before it (the gradients it feeds);
  fprop's relative error squared (the forward reaches the loss and every gradient).

And per unit the gradient noise-to-signal ratio ``nsr`` = wgrad's ``rel_error``: FP4
gradients stop helping where ‖dW‖ falls below about √3 times the quantization noise
("FP4 All the Way", Chmiel et al.), i.e. ``nsr`` above 1/√3.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fp4sense.numerics.training import Recipe, get_recipe
from fp4sense.numerics.training_linear import EmulatedLinear, gemm_operands
from fp4sense.structure.units import UnitMap

__all__ = ["NSR_LIMIT", "GemmError", "UnitEstimate", "estimate_training", "not_eligible",
           "training_units"]

_LINEARS = (torch.nn.Linear, EmulatedLinear)
#: above this noise-to-signal ratio of a layer's gradient, FP4 stops helping (1/√3)
NSR_LIMIT = 1 / math.sqrt(3)


@dataclass
class GemmError:
    rel_error: float
    damage: float = 0.0
    cosine: float | None = None
    bias: float | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class UnitEstimate:
    name: str
    block: int
    kind: str
    modules: tuple[str, ...]
    flops_per_token: int  # one GEMM's (fprop = dgrad = wgrad)
    gemms: dict[str, GemmError] = field(default_factory=dict)
    grad_power: float = 0.0  # ‖dW‖² of the unit, the exact gradient

    @property
    def nsr(self) -> float:
        return self.gemms["wgrad"].rel_error

    def to_dict(self) -> dict:
        return {"name": self.name, "block": self.block, "kind": self.kind,
                "modules": list(self.modules), "flops_per_token": self.flops_per_token,
                "gemms": {g: e.to_dict() for g, e in self.gemms.items()},
                "nsr": self.nsr, "fp4_gradients_help": self.nsr < NSR_LIMIT}


class _Sums:
    """One linear's error sums over the seeds."""

    def __init__(self):
        self.err = {"fprop": 0.0, "dgrad": 0.0, "wgrad": 0.0}
        self.ref = {"fprop": 0.0, "dgrad": 0.0, "wgrad": 0.0}
        self.cos, self.mean_grad, self.exact_grad, self.passes = 0.0, None, None, 0

    def add(self, gemm: str, q: torch.Tensor, r: torch.Tensor) -> None:
        self.err[gemm] += float((q - r).pow(2).sum())
        self.ref[gemm] += float(r.pow(2).sum())
        if gemm == "wgrad":
            self.cos += float(torch.nn.functional.cosine_similarity(
                q.flatten(), r.flatten(), 0))
            self.mean_grad = q if self.mean_grad is None else self.mean_grad + q
            self.exact_grad = r
            self.passes += 1


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, sums, generator):
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = weight.float()
        y = torch.nn.functional.linear(x, weight, bias)
        qa, qb = gemm_operands("fprop", recipe, x2, w)
        sums.add("fprop", qa @ qb.t(), x2 @ w.t())
        ctx.save_for_backward(x2, w)
        ctx.recipe, ctx.sums, ctx.generator = recipe, sums, generator
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x2, w = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1]).float()
        dx, dw = dy @ w, dy.t() @ x2
        for gemm, exact in (("dgrad", dx), ("wgrad", dw)):
            qa, qb = gemm_operands(gemm, ctx.recipe, x2, w, dy, ctx.generator)
            ctx.sums.add(gemm, (qa @ qb.t())[:, : exact.shape[1]], exact)
        db = dy.sum(0).to(ctx.dtypes[0]) if ctx.needs_input_grad[2] else None
        return (dx.to(ctx.dtypes[0]).view(grad_out.shape[:-1] + (w.shape[1],)),
                dw.to(ctx.dtypes[1]), db, None, None, None)


def training_units(units: UnitMap, model: torch.nn.Module) -> list:
    """The units the emulation trains: those whose linears are ``nn.Linear`` (routed
    experts held as 3-D parameters are left in high precision, and named)."""
    return [u for u in units.units if all(isinstance(model.get_submodule(m), _LINEARS)
                                          for m in u.modules)]


def not_eligible(units, recipe: str | Recipe) -> dict[str, str]:
    """unit name -> why ``recipe`` cannot train it: a width its blocks do not divide
    (each GEMM reduces along one of the linear's two widths; TE and torchao refuse such
    a linear, so it stays in high precision)."""
    r = get_recipe(recipe)
    out = {}
    for u in units:
        widths = {*u.inputs, *u.out_features}
        bad = sorted(w for w in widths if r.element is not None and w % r.block)
        if bad:
            out[u.name] = (f"width {bad[0]} is not a multiple of {r.name}'s block of "
                           f"{r.block}")
    return out


def estimate_training(model: torch.nn.Module, windows: torch.Tensor, units: UnitMap,
                      recipe: str | Recipe, seeds: int = 2,
                      progress: Callable[[int], None] | None = None) -> list[UnitEstimate]:
    """The estimate of every unit's three GEMMs under ``recipe`` from ``seeds`` passes over
    ``windows`` (n, T) token ids, one batch (the GEMMs see all n·T tokens, as a training
    step's). The model's parameters are left as they were (gradients cleared)."""
    recipe = get_recipe(recipe)
    trained = training_units(units, model)
    skip = not_eligible(trained, recipe)
    trained = [u for u in trained if u.name not in skip]
    sums = {m: _Sums() for u in trained for m in u.modules}
    originals = {m: model.get_submodule(m).__dict__.get("forward") for m in sums}
    draw = {"generator": None}  # this seed's stochastic rounding
    for name, s in sums.items():
        linear = model.get_submodule(name)

        def probed(x, linear=linear, s=s):
            return _Probe.apply(x, linear.weight, linear.bias, recipe, s, draw["generator"])
        linear.forward = probed
    try:
        for seed in range(seeds):
            draw["generator"] = torch.Generator(windows.device).manual_seed(seed)
            model.zero_grad(set_to_none=True)
            model(input_ids=windows, labels=windows).loss.backward()
            if progress:
                progress(1)
    finally:
        for name, forward in originals.items():  # the class's own forward again
            module = model.get_submodule(name)
            if forward is None:
                del module.forward
            else:
                module.forward = forward
        model.zero_grad(set_to_none=True)
    return _collect(trained, sums, windows.numel())


def _collect(trained, sums: dict[str, _Sums], tokens: int) -> list[UnitEstimate]:
    out, err_power = [], {}
    for u in trained:
        parts = [sums[m] for m in u.modules]
        flops = 2 * sum(i * o for i, o in zip(u.inputs, u.out_features, strict=True))
        e = UnitEstimate(u.name, u.block, u.kind, u.modules, flops)
        for gemm in ("fprop", "dgrad", "wgrad"):
            err, ref = sum(p.err[gemm] for p in parts), sum(p.ref[gemm] for p in parts)
            e.gemms[gemm] = GemmError(math.sqrt(err / ref) if ref else 0.0)
        e.grad_power = sum(p.ref["wgrad"] for p in parts) / max(parts[0].passes, 1)
        w = e.gemms["wgrad"]
        w.cosine = sum(p.cos for p in parts) / (len(parts) * max(parts[0].passes, 1))
        bias = sum(float((p.mean_grad / p.passes - p.exact_grad).pow(2).sum()) for p in parts)
        w.bias = math.sqrt(bias / (e.grad_power or 1.0))
        err_power[u.name] = sum(p.err["wgrad"] for p in parts) / max(parts[0].passes, 1)
        out.append(e)
    total = sum(e.grad_power for e in out) or 1.0
    before = 0.0
    for e in out:  # units in forward order: dgrad feeds the ones before
        e.gemms["wgrad"].damage = err_power[e.name] / total
        e.gemms["dgrad"].damage = e.gemms["dgrad"].rel_error ** 2 * before / total
        e.gemms["fprop"].damage = e.gemms["fprop"].rel_error ** 2
        before += e.grad_power
    return out
