"""FP4 training: quantization-aware distillation (QAD) of a planned model.

The model is trained to match its own unquantized next-token distributions while its
forward pass computes with the plan's formats:

- every quantized unit's weights are fake-quantized as the checkpoint will store them
  (:func:`fp4sense.diagnosis.units.quantize_unit`: fused groups share the NVFP4 global
  scale), with straight-through gradients into float32 master weights; the
  ``*_SEARCH`` schemes search their block scales every ``rescale_every`` steps and
  round with them in between (a search costs about twenty plain quantizations);
- W4A4 / W8A8 units also fake-quantize their inputs (NVFP4's static input global scale
  from the base model's input maxima on the same windows), straight through;
- the loss is KL(base || quantized) per token, the base log-probs computed once (bf16,
  in memory) before training;
- only the quantized units' weights train (BF16 units, norms, embeddings stay as they
  are); AdamW with a cosine schedule, gradients clipped to norm 1.

End to end (the whole model in memory, the best quality for its cost); a block-wise
variant (each block matching its base output, as llm-compressor's sequential pipeline
walks blocks) is not built. The trained weights are then quantized by the usual
oneshot, so every scale is derived from them by the format's own rules and the
checkpoint is the one a plain run writes.

Stability: the mean loss over each ``check_every`` steps is watched (it judges the state
the window began with); a non-finite loss or gradient, or a mean above ``rise`` times the
best so far, restores the best state, halves the learning rate and says so. With
``state_dir`` the run saves itself every ``save_every`` steps and resumes from there after
an interrupt (same model, plan and settings; seeded: it ends where an uninterrupted one does).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from fp4sense.diagnosis.units import UnitMap, quantize_unit, unit_scales
from fp4sense.numerics.fakequant import activation_quantizer
from fp4sense.numerics.schemes import get_scheme

__all__ = ["DistillError", "DistillSettings", "distill"]

STATE_FILE = "distill-state.pt"


class DistillError(ValueError):
    """Settings or inputs QAD cannot run with (the message says which and what to do)."""


@dataclass(frozen=True)
class DistillSettings:
    """How QAD trains (recorded in the checkpoint's distill.json)."""

    steps: int
    lr: float = 5e-5
    seed: int = 0
    windows: int = 16  # calibration windows trained on (base log-probs kept in memory)
    check_every: int = 10
    rise: float = 1.5  # a check-window mean above rise x the best one rolls back
    rescale_every: int = 20
    save_every: int = 20  # a multiple of check_every (a resumed run checks where it would have)

    def check(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise DistillError(f"distillation steps must be a positive whole number, got "
                               f"{self.steps!r}; give e.g. --distill 100")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise DistillError(f"the distillation learning rate must be positive, got {self.lr}")
        if self.windows < 1 or self.check_every < 1 or self.rescale_every < 1:
            raise DistillError("distillation windows, check_every and rescale_every must be "
                               "at least 1")
        if self.save_every % self.check_every:
            raise DistillError(f"save_every ({self.save_every}) must be a multiple of "
                               f"check_every ({self.check_every})")
        if self.rise <= 1:
            raise DistillError(f"rise must be above 1, got {self.rise}")


class _StraightThrough(torch.nn.Module):
    """weight -> weight + delta, delta = Q(weight) - weight held constant: the forward
    computes with the quantized weight, the gradient reaches the master weight as is."""

    def __init__(self):
        super().__init__()
        self.delta: torch.Tensor | None = None

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.delta is None else weight + self.delta


def distill(model: torch.nn.Module, units: UnitMap, schemes: dict[str, str],
            windows: torch.Tensor, settings: DistillSettings, *,
            state_dir: str | os.PathLike | None = None, key: str = "",
            progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Train ``model`` in place under the plan ``schemes`` (unit name -> scheme).

    :param windows: (n, T) calibration token ids; the first ``settings.windows`` are used
    :param key: identifies model + plan for resuming (a saved state with another key is
        not resumed)
    :return: the record saved as distill.json (settings, losses, curves, rollbacks)
    """
    settings.check()
    by_name = units.by_name()
    unknown = sorted(set(schemes) - set(by_name))
    if unknown:
        raise DistillError(f"the plan names units this model does not have ({unknown[:3]}); "
                           "distill the model the plan was made for")
    trained = [(by_name[u], get_scheme(s)) for u, s in schemes.items()
               if get_scheme(s).quantizes]
    if not trained:
        raise DistillError("the plan quantizes no unit: nothing to distill")
    device, mode = next(model.parameters()).device, model.training
    # each tensor goes back to its own dtype (a host's float32 scales stay float32)
    dtypes = {k: t.dtype for k, t in [*model.named_parameters(), *model.named_buffers()]}
    data = windows[:settings.windows].to(device)
    modules = dict(model.named_modules())
    model.float().eval()  # float32 master weights; no dropout
    for p in model.parameters():
        p.requires_grad_(False)
    t0 = time.perf_counter()
    teacher, absmax, importance = _base_pass(model, data, modules,
                                             [m for u, _ in trained for m in u.modules])
    params, hooks = _install(model, modules, trained, absmax)
    quantizer = _Quantizer(modules, trained, importance)
    try:
        record = _train(model, data, teacher, params, quantizer, settings,
                        Path(state_dir) if state_dir else None, key, progress, log)
    finally:
        for h in hooks:
            h.remove()
        for unit, _ in trained:
            for m in unit.modules:
                parametrize.remove_parametrizations(modules[m], "weight",
                                                    leave_parametrized=False)
        for p in model.parameters():
            p.requires_grad_(False)
        for k, t in [*model.named_parameters(), *model.named_buffers()]:
            t.data = t.data.to(dtypes[k])
        model.train(mode)
    record["time_s"] = round(time.perf_counter() - t0, 1)
    record["settings"] = asdict(settings)
    record["tokens_per_step"] = int(data.shape[1])
    return record


@torch.no_grad()
def _base_pass(model, data, modules, names):
    """Base log-probs per window (bf16), each linear's input max and E[x^2]."""
    absmax = {m: 0.0 for m in names}
    sq: dict[str, torch.Tensor] = {}
    rows = {m: 0 for m in names}

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            absmax[name] = max(absmax[name], float(x.abs().max()))
            sq[name] = x.square().sum(0) + sq.get(name, 0)
            rows[name] += x.shape[0]
        return pre

    handles = [modules[m].register_forward_pre_hook(hook(m)) for m in names]
    try:
        teacher = [torch.log_softmax(model(input_ids=w[None]).logits[0].float(), -1)
                   .to(torch.bfloat16) for w in data]
    finally:
        for h in handles:
            h.remove()
    return teacher, absmax, {m: sq[m] / rows[m] for m in names if rows[m]}


def _install(model, modules, trained, absmax):
    """Straight-through weights and inputs; returns the trainable weights and hooks."""
    params, hooks = [], []
    for unit, scheme in trained:
        for m in unit.modules:
            mod = modules[m]
            parametrize.register_parametrization(mod, "weight", _StraightThrough(),
                                                 unsafe=True)
            weight = mod.parametrizations.weight.original
            weight.requires_grad_(True)
            params.append(weight)
            quantize_input = activation_quantizer(scheme, absmax[m] or None)
            if quantize_input is not None:
                hooks.append(mod.register_forward_pre_hook(
                    lambda _m, args, q=quantize_input: (
                        args[0] + (q(args[0].detach()) - args[0]).detach(), *args[1:])))
    return params, hooks


class _Quantizer:
    """Refreshes every straight-through delta from the current master weights."""

    def __init__(self, modules, trained, importance):
        self.modules, self.trained, self.importance = modules, trained, importance
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
                    found = unit_scales(scheme.name, unit, ws, importance=imps)
                    self.scales.update(zip(unit.modules, found, strict=True))
                kept = [self.scales[m] for m in unit.modules]
            qs = quantize_unit(scheme.name, unit, ws, importance=imps, block_scales=kept)
            for mod, w, q in zip(mods, ws, qs, strict=True):
                mod.parametrizations.weight[0].delta = (q.to(w.dtype) - w).detach()


def _kl(model, window, teacher) -> torch.Tensor:
    student = torch.log_softmax(model(input_ids=window[None]).logits[0].float(), -1)
    base = teacher.float()
    return (base.exp() * (base - student)).sum(-1).mean()


@torch.no_grad()
def _mean_kl(model, data, teacher, quantizer, n: int = 4) -> float:
    quantizer.refresh(search=True)
    pairs = list(zip(data[:n], teacher[:n], strict=False))
    return sum(float(_kl(model, w, t)) for w, t in pairs) / len(pairs)


def _train(model, data, teacher, params, quantizer, st: DistillSettings,
           state_dir: Path | None, key: str, progress: bool, log) -> dict:
    gen = torch.Generator().manual_seed(st.seed)
    order = [int(i) for _ in range(-(-st.steps // len(data)))
             for i in torch.randperm(len(data), generator=gen)]
    lr = st.lr
    hist: dict = {"step": [], "loss": [], "grad_norm": [], "lr": []}
    rollbacks: list[dict] = []
    best: tuple[float, int, list[torch.Tensor]] | None = None
    step = 0
    saved = _load_state(state_dir, key, st) if state_dir else None
    loss_before = _mean_kl(model, data, teacher, quantizer)
    if saved is not None:
        for p, v in zip(params, saved["params"], strict=True):
            p.data.copy_(v)
        step, lr, hist, rollbacks = saved["step"], saved["lr"], saved["hist"], saved["rollbacks"]
        best, quantizer.scales = saved["best"], saved["scales"]
        log(f"distill: resumed at step {step} of {st.steps} from {state_dir / STATE_FILE}")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if saved is not None:
        opt.load_state_dict(saved["opt"])
    bar = tqdm(total=st.steps, initial=step, desc="distill", disable=not progress)
    window_losses: list[float] = []
    start: tuple[int, list[torch.Tensor]] | None = None  # the state a check window began at
    while step < st.steps:
        if not window_losses:  # a window's losses judge the state it began with
            start = (step, [p.detach().clone() for p in params])
        quantizer.refresh(search=step % st.rescale_every == 0)
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / st.steps))
        opt.zero_grad(set_to_none=True)
        i = order[step]
        loss = _kl(model, data[i], teacher[i])
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        value = float(loss.detach())
        if math.isfinite(value) and math.isfinite(norm):
            opt.step()
        step += 1
        for k, v in zip(hist, (step, value, norm, opt.param_groups[0]["lr"]), strict=True):
            hist[k].append(v)
        window_losses.append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", lr=f"{opt.param_groups[0]['lr']:.1e}")
        diverged = not (math.isfinite(value) and math.isfinite(norm))
        if len(window_losses) == st.check_every or diverged or step == st.steps:
            mean = sum(window_losses) / len(window_losses)
            window_losses = []
            if not diverged and (best is None or mean < best[0]):
                best = (mean, *start)
            elif diverged or mean > st.rise * best[0]:
                if best is None:
                    raise DistillError(f"the distillation loss was not finite at step {step} "
                                       f"(learning rate {lr:g}); lower --distill-lr")
                for p, v in zip(params, best[2], strict=True):
                    p.data.copy_(v)
                lr /= 2
                opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
                what = "was not finite" if diverged else f"rose to {mean:.4f}"
                rollbacks.append({"step": step, "to_step": best[1], "lr": lr,
                                  "why": what})
                log(f"distill: the loss {what} at step {step} (best {best[0]:.4f} at step "
                    f"{best[1]}): rolled back to step {best[1]}, learning rate now {lr:g}")
        if state_dir is not None and (step % st.save_every == 0 or step == st.steps):
            _save_state(state_dir, key, st, params, opt, step, lr, hist, rollbacks, best,
                        quantizer.scales)
    bar.close()
    loss_after = _mean_kl(model, data, teacher, quantizer)
    if best is not None and best[1] != step:  # end on the better of the last and the best
        last = [p.detach().clone() for p in params]
        for p, v in zip(params, best[2], strict=True):
            p.data.copy_(v)
        at_best = _mean_kl(model, data, teacher, quantizer)
        if at_best < loss_after:
            loss_after = at_best
            log(f"distill: ended on the state of step {best[1]} (lower KL than the last)")
        else:
            for p, v in zip(params, last, strict=True):
                p.data.copy_(v)
            quantizer.refresh(search=True)
    log(f"distill: {st.steps} steps, KL on the first training windows {loss_before:.4f} -> "
        f"{loss_after:.4f}" + (f", {len(rollbacks)} rollback(s)" if rollbacks else ""))
    return {"steps": st.steps, "loss_before": loss_before, "loss_after": loss_after,
            "rollbacks": rollbacks, "history": hist}


def _save_state(state_dir: Path, key, st, params, opt, step, lr, hist, rollbacks, best,
                scales):
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save({"key": key, "settings": asdict(st), "step": step, "lr": lr, "hist": hist,
                "rollbacks": rollbacks, "best": best, "scales": scales, "opt": opt.state_dict(),
                "params": [p.detach() for p in params]}, tmp)
    tmp.replace(state_dir / STATE_FILE)  # a state is whole or absent


def _load_state(state_dir: Path, key: str, st: DistillSettings) -> dict | None:
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=False)
    return saved if saved.get("key") == key and saved.get("settings") == asdict(st) else None

