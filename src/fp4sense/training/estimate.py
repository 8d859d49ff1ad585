"""The estimated FP4 training sensitivity: one forward/backward pass, in which every
unit's linears compute their exact outputs and gradients (what flows on) and, beside them,
what each of their three GEMMs gives with the recipe's quantized operands (dgrad and wgrad
once per seed of stochastic rounding). So each GEMM's error is measured where it arises,
with every other GEMM exact: all units at once.

Per unit and GEMM (sums over the unit's linears):

- ``rel_error``: ‖Q − R‖ / ‖R‖, the root mean over seeds (R the exact GEMM output: the
  unit's output Y for fprop, the gradient it sends back dX for dgrad, its weight gradient
  dW for wgrad);
- wgrad also ``cosine`` (mean over seeds) and ``bias``: ‖mean over seeds of Q − R‖ / ‖R‖,
  the part stochastic rounding does not average away;
- ``damage``, in nats of training loss, one scale for the three GEMMs: fprop's is the
  loss a forward under FP4 adds, at every step: its kind's measured cost
  (:func:`forward_stakes`: that kind's fprop in FP4 in every block) shared out by each
  unit's diagonal Fisher form of its output error, ``½ Σ (g ⊙ ΔY)²`` per predicted token
  with ``g`` the per-token gradient of the training loss at the unit's output (the
  inference estimate's form); without ``forward`` that form alone. wgrad's and
  dgrad's are that GEMM's measured cost over a run (:func:`gradient_stakes`: the loss a
  step loses with that GEMM of every unit in FP4) shared out by each unit's part of the
  error: wgrad's error power, and dgrad's relative error squared times the share of the
  gradient power ‖dW‖² of the units before it (the gradients it feeds). Without
  ``stakes`` the two are those parts as shares of the model's gradient power.

And per unit the gradient noise-to-signal ratio ``nsr`` = wgrad's ``rel_error``: FP4
gradients stop helping where ‖dW‖ falls below about √3 times the quantization noise
("FP4 All the Way", Chmiel et al.), i.e. ``nsr`` above 1/√3.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from fp4sense.numerics.training import Recipe, get_recipe
from fp4sense.numerics.training_linear import (
    EmulatedLinear,
    apply_training_policy,
    gemm_operands,
)
from fp4sense.structure.units import UnitMap
from fp4sense.training.stream import stepped_blocks, streamed_backward

__all__ = ["NSR_LIMIT", "GemmError", "UnitEstimate", "estimate_training", "not_eligible",
           "forward_stakes", "gradient_stakes", "training_units"]

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
    """One linear's error sums: fprop's once, dgrad's and wgrad's over the seeds' draws.
    No tensor is kept: a streamed estimate holds one block's."""

    def __init__(self):
        self.fisher = 0.0  # Σ (dy ⊙ ΔY)², dy of the mean loss
        self.err = {"fprop": 0.0, "dgrad": 0.0, "wgrad": 0.0}
        self.ref = {"fprop": 0.0, "dgrad": 0.0, "wgrad": 0.0}
        self.cos, self.bias, self.passes = 0.0, 0.0, 0

    def add(self, gemm: str, qs: list[torch.Tensor], r: torch.Tensor) -> None:
        """The GEMM's outputs ``qs`` (one per seed) against the exact one ``r``."""
        for q in qs:
            self.err[gemm] += float((q - r).pow(2).sum())
            self.ref[gemm] += float(r.pow(2).sum())
        if gemm == "wgrad":
            self.cos += sum(float(torch.nn.functional.cosine_similarity(
                q.flatten(), r.flatten(), 0)) for q in qs)
            self.bias += float((sum(qs) / len(qs) - r).pow(2).sum())  # what SR leaves
            self.passes += len(qs)


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe, sums, generators):
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = weight.float()
        y = torch.nn.functional.linear(x, weight, bias)
        ctx.save_for_backward(x2, w)  # fprop's error is scored in backward, beside dY
        ctx.recipe, ctx.sums, ctx.generators = recipe, sums, generators
        ctx.dtypes = (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x2, w = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1]).float()
        dx, dw = dy @ w, dy.t() @ x2
        qa, qb = gemm_operands("fprop", ctx.recipe, x2, w)
        q, y = qa @ qb.t(), x2 @ w.t()
        ctx.sums.add("fprop", [q], y)
        ctx.sums.fisher += float((dy * (q - y)).pow(2).sum())
        for gemm, exact in (("dgrad", dx), ("wgrad", dw)):  # each seed its own draws
            outs = []
            for g in ctx.generators:
                qa, qb = gemm_operands(gemm, ctx.recipe, x2, w, dy, g)
                outs.append((qa @ qb.t())[:, : exact.shape[1]])
            ctx.sums.add(gemm, outs, exact)
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
                      progress: Callable[[int], None] | None = None,
                      stakes: Mapping[str, float] | None = None,
                      forward: Mapping[str, float] | None = None,
                      streamed: bool | None = None) -> list[UnitEstimate]:
    """The estimate of every unit's three GEMMs under ``recipe`` from one pass over
    ``windows`` (n, T) token ids with ``seeds`` draws of stochastic rounding, one batch
    (the GEMMs see all n·T tokens, as a training step's). The model's parameters are left
    as they were (gradients cleared). ``streamed`` (default: when the blocks are read from
    files, a low-memory model): the pass one block at a time
    (:mod:`fp4sense.training.stream`), the same figures."""
    recipe = get_recipe(recipe)
    if streamed is None:
        streamed = hasattr(model, "fp4sense_blocks")
    blocks = model.get_submodule(units.blocks_path)
    trained = training_units(units, model)
    skip = not_eligible(trained, recipe)
    trained = [u for u in trained if u.name not in skip]
    sums = {m: _Sums() for u in trained for m in u.modules}
    originals = {m: model.get_submodule(m).__dict__.get("forward") for m in sums}
    # every seed's stochastic rounding in one pass: the exact GEMMs flow on, so the seeds
    # differ only in their draws (each seed's generator draws as a pass of its own would)
    draws = [torch.Generator(windows.device).manual_seed(seed) for seed in range(seeds)]
    for name, s in sums.items():
        linear = model.get_submodule(name)

        def probed(x, linear=linear, s=s):
            return _Probe.apply(x, linear.weight, linear.bias, recipe, s, draws)
        linear.forward = probed
    try:
        model.zero_grad(set_to_none=True)
        if streamed:  # the blocks' gradients are the probes' alone: not kept
            streamed_backward(model, units.blocks_path, windows,
                              lambda i: blocks[i].zero_grad(set_to_none=True))
        else:
            model(input_ids=windows, labels=windows).loss.backward()
        if progress:
            progress(seeds)
    finally:
        for name, own in originals.items():  # the class's own forward again
            module = model.get_submodule(name)
            if own is None:
                del module.forward
            else:
                module.forward = own
        model.zero_grad(set_to_none=True)
    predicted = windows.shape[0] * (windows.shape[1] - 1)  # the mean loss's tokens
    return _collect(trained, sums, predicted, stakes, forward)


def _collect(trained, sums: dict[str, _Sums], tokens: int, stakes: Mapping[str, float] | None,
             forward: Mapping[str, float] | None) -> list[UnitEstimate]:
    out, err_power, fisher = [], {}, {}
    for u in trained:
        parts = [sums[m] for m in u.modules]
        flops = 2 * sum(i * o for i, o in zip(u.inputs, u.out_features, strict=True))
        e = UnitEstimate(u.name, u.block, u.kind, u.modules, flops)
        for gemm in ("fprop", "dgrad", "wgrad"):
            err, ref = sum(p.err[gemm] for p in parts), sum(p.ref[gemm] for p in parts)
            e.gemms[gemm] = GemmError(math.sqrt(err / ref) if ref else 0.0)
        passes = max(parts[0].passes, 1)
        e.grad_power = sum(p.ref["wgrad"] for p in parts) / passes
        w = e.gemms["wgrad"]
        w.cosine = sum(p.cos for p in parts) / (len(parts) * passes)
        w.bias = math.sqrt(sum(p.bias for p in parts) / (e.grad_power or 1.0))
        err_power[u.name] = sum(p.err["wgrad"] for p in parts) / passes
        # per-token gradients are tokens × dy (dy: of the mean loss): ½ Σ (g ⊙ ΔY)² / tokens
        fisher[u.name] = 0.5 * tokens * sum(p.fisher for p in parts)
        out.append(e)
    total = sum(e.grad_power for e in out) or 1.0
    before = 0.0
    for e in out:  # units in forward order: dgrad feeds the ones before
        e.gemms["wgrad"].damage = err_power[e.name] / total
        e.gemms["dgrad"].damage = e.gemms["dgrad"].rel_error ** 2 * before / total
        e.gemms["fprop"].damage = fisher[e.name]
        before += e.grad_power
    for gemm in ("dgrad", "wgrad") if stakes is not None else ():  # shares of the cost
        share = sum(e.gemms[gemm].damage for e in out) or 1.0
        for e in out:
            e.gemms[gemm].damage *= stakes[gemm] / share
    for kind in forward or ():  # each kind's measured forward cost, by the Fisher form
        mine = [e.gemms["fprop"] for e in out if e.kind == kind]
        share = sum(g.damage for g in mine)
        for g in mine:
            g.damage = forward[kind] * (g.damage / share if share else 1 / len(mine))
    return out


def forward_stakes(model: torch.nn.Module, windows: torch.Tensor, units,
                   recipe: str | Recipe) -> dict[str, float]:
    """What each unit kind's FP4 forward costs, measured: per kind, the mean training loss
    of ``windows`` with that kind's fprop in ``recipe`` in every block (every other GEMM
    exact) less the exact loss, at least 0: one forward per kind (in eval mode, no
    dropout), no gradients. :func:`estimate_training` shares a kind's cost out to its
    units by their diagonal Fisher form. That form ranks the units of one kind, but it
    counts each token's output error alone and misjudges kinds against each other (on
    SmolLM2 it rated q/k/v's forward at twice what the trials measure)."""
    recipe = get_recipe(recipe)
    was_training = model.training
    model.eval()
    try:
        with _linears_kept(model), torch.no_grad():
            exact = float(model(input_ids=windows, labels=windows).loss)
            out = {}
            for kind in dict.fromkeys(u.kind for u in units):
                apply_training_policy(model, {m: {"fprop": recipe} for u in units
                                              if u.kind == kind for m in u.modules})
                lost = float(model(input_ids=windows, labels=windows).loss) - exact
                out[kind] = max(0.0, lost)
        return out
    finally:
        model.train(was_training)


@contextmanager
def _linears_kept(model: torch.nn.Module):
    """The model's own linears again after a policy was applied."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, _LINEARS)}
    try:
        yield
    finally:
        for n, module in linears.items():
            parent, _, leaf = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, module)


def gradient_stakes(model: torch.nn.Module, windows: torch.Tensor, units, recipe: str | Recipe,
                    lr: float, steps: int, seeds: int = 1) -> dict[str, float]:
    """What the gradient GEMMs' FP4 costs a run of ``steps`` steps, in nats of the loss on
    text it does not train on. From the present weights (restored after), one AdamW step
    at ``lr`` on the first half of ``windows`` (a trial's batch), scored by the loss of the
    other half: ``progress``, what an exact step gains; ``dgrad`` and ``wgrad``, what the
    step loses when that GEMM of every unit of ``units`` runs in ``recipe`` (mean over
    ``seeds`` draws of stochastic rounding); each times ``steps``, at least 0. One window:
    it is both halves. Memory: a copy of the weights on the CPU, the gradients; no
    optimizer state (AdamW's first step is ``lr · g / (|g| + eps)``). A low-memory model
    steps one block at a time, its stepped blocks on disk (:func:`stepped_blocks`)."""
    half = max(1, len(windows) // 2)
    batch, held = windows[:half], windows[half:] if len(windows) > 1 else windows
    start = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    recipe = get_recipe(recipe)
    was_training = model.training

    streamed = hasattr(model, "fp4sense_blocks")

    def step(param, grad):  # AdamW's first step, no moments kept: lr · g / (|g| + eps)
        return param - lr * grad / (grad.abs() + 1e-8)

    def held_loss(policy, generator=None) -> float:
        model.load_state_dict(start)
        apply_training_policy(model, policy, default="bf16", generator=generator)
        model.train()
        model.zero_grad(set_to_none=True)
        with stepped_blocks(model, step) if streamed else nullcontext() as on_block:
            if streamed:
                streamed_backward(model, model.fp4sense_blocks.prefix, batch, on_block)
            else:
                model(input_ids=batch, labels=batch).loss.backward()
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param.copy_(step(param, param.grad))
                return float(model(input_ids=held, labels=held).loss)

    try:
        with _linears_kept(model):
            with torch.no_grad():
                before = float(model(input_ids=held, labels=held).loss)
            exact = held_loss({})
            out = {"progress": max(0.0, steps * (before - exact))}
            for gemm in ("dgrad", "wgrad"):
                policy = {m: {gemm: recipe} for u in units for m in u.modules}
                lost = [held_loss(policy, torch.Generator(windows.device).manual_seed(seed))
                        - exact for seed in range(seeds)]
                out[gemm] = max(0.0, steps * sum(lost) / len(lost))
            return out
    finally:
        model.load_state_dict(start)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
