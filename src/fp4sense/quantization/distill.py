"""FP4 training: quantization-aware distillation (QAD) of a planned model.

The model is trained to match its own unquantized next-token distributions while its
forward pass computes with the plan's formats:

- every quantized unit's weights are fake-quantized as the checkpoint will store them
  (:func:`fp4sense.structure.units.quantize_unit`: fused groups share the NVFP4 global
  scale), with straight-through gradients into float32 master weights; the
  ``*_SEARCH`` schemes search their block scales every ``rescale_every`` steps and
  round with them in between (a search costs about twenty plain quantizations);
- W4A4 / W8A8 units also fake-quantize their inputs (NVFP4's static input global scale
  from the base model's input maxima on the same windows), straight through;
- a rotated scheme's unit (``NVFP4_H16``, ``MXFP4_H32``) computes ``Q(x R) Q(W R)^T``
  as the checkpoint will (before calibration the training rotates, its input maxima and
  E[x^2] are the rotated input's; after GPTQ the host's rotation is in the model);
- the loss is KL(base || quantized) per token, the base log-probs computed once (bf16,
  in memory) before training;
- only the quantized units' weights train (BF16 units, norms, embeddings stay as they
  are); AdamW with a cosine schedule, gradients clipped to norm 1.
- ``backward`` (default ``bf16``): with a training recipe (``nvfp4``, ``mxfp4``,
  ``mxfp8``) the trained linears' dgrad and wgrad GEMMs also run on quantized operands,
  as FP4 training runs them on Blackwell
  (:mod:`fp4sense.quantization.straight_through`); with stochastic rounding (nvfp4) a
  resumed run draws its rounding anew, so it ends near, not exactly on, an
  uninterrupted one's weights.

Two ways (``mode``): ``end-to-end``, the loss above on the whole model; or ``block``,
each decoder block in turn trained to reproduce the unquantized block's output from the
output of the blocks before it as quantized and trained
(:mod:`fp4sense.quantization.blockwise`: a step costs one block, not the whole model,
and the model's KL judges the run at the end). Two places in a oneshot:

- before calibration (no GPTQ): the trained weights are then quantized by the usual
  oneshot, so every scale is derived from them by the format's own rules;
- after GPTQ (``frozen``): training starts from GPTQ's rounded weights under the scales
  it calibrated, quantizing weights and inputs with the host's own quantizers and those
  fixed scales, and leaves the weights on that grid, so the checkpoint stores exactly
  the model the training ended on (GPTQ run after training would round it again).

Either way the checkpoint is the one a plain run writes.

Stability: the mean loss over each ``check_every`` steps is watched (it judges the state
the window began with); a non-finite loss or gradient, or a mean above ``rise`` times the
best so far, restores the best state, halves the learning rate and says so. With
``holdout`` windows kept out of training, every checked state is also judged on them and
the run ends on the lowest there, the starting state included: it never ends worse on
windows it did not train on than it began (without, it ends on the better of its last
and best state by the training loss). With
``state_dir`` the run saves itself every ``save_every`` steps and resumes from there after
an interrupt (same model, plan and settings; seeded: it ends where an uninterrupted one does).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from fp4sense.diagnosis.blockio import no_cache
from fp4sense.numerics.rotation import rotate_input
from fp4sense.numerics.schemes import get_scheme
from fp4sense.quantization.blockwise import BlockTargets, record_blocks, train_blocks
from fp4sense.quantization.distill_settings import MODES, DistillError, DistillSettings
from fp4sense.quantization.qad_loop import train
from fp4sense.quantization.straight_through import FrozenRefresher, Refresher, install
from fp4sense.structure.units import UnitMap

__all__ = ["MODES", "DistillBase", "DistillError", "DistillSettings", "Frozen", "base_pass",
           "distill", "record_training", "trained_linears"]

Quantizer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DistillBase:
    """What the unquantized model gives the training, computed once: its log-probs per
    window (bf16) and, per trained linear, its inputs' absolute maximum and E[x^2]."""

    teacher: list[torch.Tensor]
    absmax: dict[str, float]
    importance: dict[str, torch.Tensor]
    blocks: BlockTargets | None = None  # block-wise: each block's calls and base outputs


@dataclass
class Frozen:
    """Quantizers whose scales an earlier calibration fixed (GPTQ's), per linear: the
    weight's and, for W4A4 / W8A8, the input's. The training quantizes with them as
    they are and ends with every weight on their grid."""

    weights: dict[str, Quantizer]
    inputs: dict[str, Quantizer] = field(default_factory=dict)
    name: str = "GPTQ"  # whose scales: said in the record


def distill(model: torch.nn.Module, units: UnitMap, schemes: dict[str, str],
            windows: torch.Tensor, settings: DistillSettings, *,
            state_dir: str | os.PathLike | None = None, key: str = "",
            progress: bool = True, log: Callable[[str], None] = print,
            base: DistillBase | None = None, frozen: Frozen | None = None) -> dict:
    """Train ``model`` in place under the plan ``schemes`` (unit name -> scheme).

    :param windows: (n, T) calibration token ids; the first ``settings.windows`` are used
    :param key: identifies model + plan for resuming (a saved state with another key is
        not resumed)
    :param base: the unquantized model's outputs (:func:`base_pass`), when the model has
        changed since (GPTQ); computed here when not given
    :param frozen: train under these fixed-scale quantizers instead of fp4sense's own
        (which derive the scales from the weights as they train), and end quantized
    :return: the record saved as distill.json (settings, losses, curves, rollbacks)
    """
    settings.check()
    trained = _trained(units, schemes)
    data = _split(windows, settings, log).to(next(model.parameters()).device)
    modules = dict(model.named_modules())
    names = trained_linears(units, schemes)
    missing = sorted(set(names) - set(frozen.weights)) if frozen is not None else []
    if missing:
        raise DistillError(f"no fixed-scale quantizer for {missing[:3]}: every trained "
                           "linear needs its calibrated scales")
    done = False
    # the weights are quantized in the dtype the model came in (the host calibrates in it)
    home = modules[names[0]].weight.dtype
    with _float32(model):
        for p in model.parameters():
            p.requires_grad_(False)
        t0 = time.perf_counter()
        if base is None:
            base = _base_pass(model, data, modules, names, _blocks_of(model, units, settings),
                              _rotations(units, schemes))
        if settings.mode == "block" and base.blocks is None:
            raise DistillError("block-wise distillation needs the base pass's block outputs; "
                               "take it with base_pass(...) under the same settings")
        params, hooks = install(modules, trained, base.absmax,
                                frozen.inputs if frozen is not None else None,
                                settings.backward, settings.seed)
        lr_scales = [settings.lr_4bit if scheme.weight_bits == 4 else 1.0
                     for unit, scheme in trained for _ in unit.modules]

        def quantizer_of(part):
            if frozen is not None:
                return FrozenRefresher(modules, [m for u, _ in part for m in u.modules],
                                       frozen.weights)
            return Refresher(modules, part, base.importance, dtype=home)

        quantizer = quantizer_of(trained)
        n = len(data) - settings.holdout  # trained on the first n, judged on the rest
        held = (data[n:], base.teacher[n:]) if settings.holdout else None
        state = Path(state_dir) if state_dir else None
        try:
            if settings.mode == "block":
                record = train_blocks(model, units, trained, base.blocks, data, base.teacher,
                                      dict(zip(names, params, strict=True)),
                                      dict(zip(names, lr_scales, strict=True)), quantizer_of,
                                      quantizer, settings, state, key, progress, log)
            else:
                record = train(model, data[:n], base.teacher[:n], params, quantizer,
                               settings, state, key, progress, log, held, lr_scales)
            done = True
        finally:
            for h in hooks:
                h.remove()
            for m in names:  # fixed scales: the weights stay on their grid
                parametrize.remove_parametrizations(
                    modules[m], "weight", leave_parametrized=done and frozen is not None)
            for p in model.parameters():
                p.requires_grad_(False)
    record["time_s"] = round(time.perf_counter() - t0, 1)
    record["settings"] = asdict(settings)
    record["tokens_per_step"] = int(data.shape[1])
    record["windows_trained"] = n
    record["start"] = (f"after {frozen.name}, under its scales" if frozen is not None
                       else "before calibration")
    record["mode"] = settings.mode
    return record


def base_pass(model: torch.nn.Module, units: UnitMap, schemes: dict[str, str],
              windows: torch.Tensor, settings: DistillSettings) -> DistillBase:
    """The unquantized model's outputs the training needs (in float32, as it trains);
    log-probs kept on the CPU."""
    settings.check()
    names = trained_linears(units, schemes)
    data = _split(windows, settings).to(next(model.parameters()).device)
    with _float32(model):
        got = _base_pass(model, data, dict(model.named_modules()), names,
                         _blocks_of(model, units, settings), _rotations(units, schemes))
    got.teacher = [t.cpu() for t in got.teacher]
    return got


def _blocks_of(model, units: UnitMap, settings: DistillSettings):
    """The decoder blocks whose calls and outputs the base pass keeps (block-wise)."""
    return model.get_submodule(units.blocks_path) if settings.mode == "block" else None


def _split(windows: torch.Tensor, settings: DistillSettings, log=None) -> torch.Tensor:
    """The windows QAD uses: up to ``windows`` to train on, then ``holdout`` held out (the
    training takes fewer when fewer are given, said through ``log``; the held-out ones
    are never cut)."""
    use = windows[:settings.windows + settings.holdout]
    if len(use) <= settings.holdout:
        raise DistillError(f"QAD holds out {settings.holdout} calibration windows and needs "
                           f"at least one more to train on, but {len(windows)} were given; "
                           "give more calibration windows or hold out fewer "
                           "(--distill-holdout)")
    if log is not None and len(use) < settings.windows + settings.holdout:
        log(f"note: QAD trains on {len(use) - settings.holdout} calibration windows, not "
            f"the {settings.windows} asked (--distill-windows): {len(windows)} were given "
            f"and {settings.holdout} are held out; raise --calib-windows to train on more")
    return use


def trained_linears(units: UnitMap, schemes: dict[str, str]) -> list[str]:
    """The linears QAD trains under the plan ``schemes``: those of every quantized unit."""
    return [m for u, _ in _trained(units, schemes) for m in u.modules]


def _rotations(units: UnitMap, schemes: dict[str, str]) -> dict[str, int]:
    """linear -> the width of its scheme's rotation, for the rotated ones."""
    return {m: s.rotation for u, s in _trained(units, schemes) if s.rotation
            for m in u.modules}


def _trained(units: UnitMap, schemes: dict[str, str]):
    by_name = units.by_name()
    unknown = sorted(set(schemes) - set(by_name))
    if unknown:
        raise DistillError(f"the plan names units this model does not have ({unknown[:3]}); "
                           "distill the model the plan was made for")
    trained = [(by_name[u], get_scheme(s)) for u, s in schemes.items()
               if get_scheme(s).quantizes]
    if not trained:
        raise DistillError("the plan quantizes no unit: nothing to distill")
    return trained


@contextlib.contextmanager
def _float32(model: torch.nn.Module):
    """float32 master weights, no dropout; each tensor goes back to its own dtype after
    (a host's float32 or FP8 scales stay as they were)."""
    mode = model.training
    dtypes = {k: t.dtype for k, t in [*model.named_parameters(), *model.named_buffers()]}
    model.float().eval()
    try:
        yield
    finally:
        for k, t in [*model.named_parameters(), *model.named_buffers()]:
            t.data = t.data.to(dtypes[k])
        model.train(mode)


@torch.no_grad()
def _base_pass(model, data, modules, names, blocks=None, rotations=None):
    """Base log-probs per window (bf16), each linear's input max and E[x^2] (of the
    rotated input for a linear in ``rotations``: linear -> width); with ``blocks``, what
    block-wise training replays (:func:`record_blocks`)."""
    absmax = {m: 0.0 for m in names}
    sq: dict[str, torch.Tensor] = {}
    rows = {m: 0 for m in names}
    rotations = rotations or {}

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            if name in rotations:
                x = rotate_input(x, rotations[name])
            absmax[name] = max(absmax[name], float(x.abs().max()))
            sq[name] = x.square().sum(0) + sq.get(name, 0)
            rows[name] += x.shape[0]
        return pre

    handles = [modules[m].register_forward_pre_hook(hook(m)) for m in names]
    current = {"i": 0}
    try:
        with (record_blocks(blocks, len(data), current) if blocks is not None
              else contextlib.nullcontext()) as kept:
            teacher = []
            for i, w in enumerate(data):
                current["i"] = i
                teacher.append(torch.log_softmax(model(input_ids=w[None], **no_cache(model))
                                                 .logits[0].float(), -1).to(torch.bfloat16))
    finally:
        for h in handles:
            h.remove()
    return DistillBase(teacher, absmax, {m: sq[m] / rows[m] for m in names if rows[m]},
                       kept)


def record_training(plan, work: Path, text: str) -> dict:
    """The QAD record the oneshot wrote in ``work``: the text named (``text``), summary in
    ``plan.training`` (plan.json rewritten with it); returns the record (the quantize job
    plots its curves as distill.png)."""
    record = json.loads((work / "distill.json").read_text())
    record["text"] = text
    (work / "distill.json").write_text(json.dumps(record, indent=1))
    st = record["settings"]
    plan.training = {"method": "qad", "mode": st.get("mode", "end-to-end"),
                     "steps": record["steps"], "text": record["text"],
                     "windows": record.get("windows_trained", st["windows"]), "lr": st["lr"],
                     "seed": st["seed"], "start": record.get("start", "before calibration"),
                     "backward": st.get("backward", "bf16"),
                     "loss_before": record["loss_before"], "loss_after": record["loss_after"],
                     "rollbacks": len(record["rollbacks"]), "time_s": record["time_s"]}
    if record.get("holdout"):
        plan.training["holdout"] = record["holdout"]
    plan.save(work / "plan.json")
    return record
