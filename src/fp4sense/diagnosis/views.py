"""Views of a model's FP4 sensitivity, and ``analyze``, which runs them.

A *report view* says which units each of its targets perturbs and how a measured run
replays it; it is registered with :func:`register_view` under the ``--views`` option that
asks for it. Built in: ``component`` (one kind in every block, fused groups and their
single linears), ``model`` (everything: the uniform baseline), ``block_isolate`` (one
block quantized), ``block_protect`` (all blocks but one; blocks before it replay the fully
quantized model), ``grid`` (every unit alone), ``expert`` (MoE: each expert of each block
alone). The estimated mode scores every linear once and sums a target's linears.

*Measured*: the real damage when only the perturbed units run fake-quantized
(:mod:`fp4sense.numerics.fakequant`), as KL(base || quantized), ΔPPL and top-1 agreement
on the analysis windows, each with its standard error over windows. Each block's
unquantized output is cached once per window; a perturbation whose first changed block
is ``b`` replays it for blocks ``< b`` and computes only blocks ``b..L-1``.

*Estimated*: one forward + backward per window scores every (linear, scheme) at once by
the diagonal Fisher form of the output error, ``½ Σ (g ⊙ ΔY)²`` per predicted token, where
``g`` is the gradient of the log-likelihood of tokens sampled from the base model (the
Fisher of KL(base || ·)) at the linear's output and ``ΔY`` the change of that output when
weights (and, for W4A4 / W8A8, inputs) are fake-quantized.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4sense.diagnosis.cache import EntryCache, cache_key
from fp4sense.diagnosis.engine import Analysis, Perturbation
from fp4sense.diagnosis.footprint import check_cache_memory, weight_cache_bytes
from fp4sense.diagnosis.results import SensitivityReport
from fp4sense.diagnosis.stages import ViewsRun
from fp4sense.inputs.models import quantization_dtypes
from fp4sense.numerics.schemes import clips_of, get_scheme, rotations_of
from fp4sense.structure.experts import expert_targets, projection_targets
from fp4sense.structure.units import Unit, UnitMap, find_units, model_fingerprint
from fp4sense.validate import register_unique

__all__ = ["MODES", "REPORT_VIEWS", "VIEWS", "ReportView", "analyze", "check_request",
           "register_view", "view_options"]

MODES = ("measured", "estimated")
#: a target's members: (unit, the linears of it to quantize)
Members = list[tuple[Unit, tuple[str, ...]]]
Targets = Callable[[UnitMap, "list[int] | None"], "list[tuple[str, Members]]"]
Measure = Callable[[Analysis, str, str, Perturbation], dict]


def _isolated(run: Analysis, scheme: str, target: str, pert: Perturbation) -> dict:
    """Only the target's units quantized; blocks before the first one replayed."""
    return run.measure(pert)


@dataclass(frozen=True)
class ReportView:
    """One view of a report: its targets and how a measured run replays them."""

    name: str
    option: str  # the --views value that asks for it
    targets: Targets
    measure: Measure = _isolated


#: name -> view, in registration order (the order of the report's sections)
REPORT_VIEWS: dict[str, ReportView] = {}


def register_view(name: str, option: str, measure: Measure = _isolated):
    """Decorator on a targets function ``(units, grid_blocks) -> [(target, members)]``:
    makes it the report view ``name``, computed when ``--views`` holds ``option``."""
    def deco(targets: Targets) -> Targets:
        register_unique(REPORT_VIEWS, name, ReportView(name, option, targets, measure),
                        targets, "report view")
        return targets
    return deco


@register_view("component", "component")
def _component(units: UnitMap, blocks) -> list[tuple[str, Members]]:
    out = []
    for kind in units.kinds:
        members = units.of_kind(kind)
        out.append((kind, [(u, u.modules) for u in members]))
        if members[0].experts:  # one projection of all experts (which projection hurts)
            out += projection_targets(kind, members)
        elif members[0].fused:  # the single linears of a fused group as well
            prefix = units.blocks_path
            for part in range(len(members[0].modules)):
                rel = members[0].modules[part].split(".", prefix.count(".") + 2)[-1]
                out.append((rel, [(u, (u.modules[part],)) for u in members]))
    return out


def _whole_model(run: Analysis, scheme: str, target: str, pert: Perturbation) -> dict:
    """The fully quantized model (its block outputs are kept for ``block_protect``)."""
    _, result = run.quantized_outputs(scheme, pert)
    return result


@register_view("model", "block", measure=_whole_model)
def _model(units: UnitMap, blocks) -> list[tuple[str, Members]]:
    return [("all", [(u, u.modules) for u in units.units])]


@register_view("block_isolate", "block")
def _block_isolate(units: UnitMap, blocks) -> list[tuple[str, Members]]:
    return [(str(b), [(u, u.modules) for u in units.of_block(b)])
            for b in range(units.n_blocks)]


def _protected(run: Analysis, scheme: str, target: str, pert: Perturbation) -> dict:
    """Blocks before the protected one compute what they compute in the fully quantized
    model (its cached outputs are replayed); from it on, all but it quantized."""
    everything = {m: (u, scheme) for u in run.units.units for m in u.modules
                  if u.why_infeasible(scheme) is None}
    source, _ = run.quantized_outputs(scheme, everything)
    return run.measure(pert, start=int(target), source=source)


@register_view("block_protect", "block", measure=_protected)
def _block_protect(units: UnitMap, blocks) -> list[tuple[str, Members]]:
    return [(str(b), [(u, u.modules) for u in units.units if u.block != b])
            for b in range(units.n_blocks)]


@register_view("grid", "grid")
def _grid(units: UnitMap, blocks) -> list[tuple[str, Members]]:
    keep = set(blocks) if blocks is not None else None
    return [(u.name, [(u, u.modules)]) for u in units.units
            if keep is None or u.block in keep]


#: MoE: each expert of each block alone; best with ``--mode estimated`` (one pass)
register_view("expert", "experts")(expert_targets)


def view_options() -> tuple[str, ...]:
    """The ``--views`` options of the registered views, in the order of their first view."""
    return tuple(dict.fromkeys(v.option for v in REPORT_VIEWS.values()))


#: the built-in ``--views`` options
VIEWS = view_options()


def check_request(schemes: Sequence[str], views: Sequence[str], modes: Sequence[str]) -> list[str]:
    names = [get_scheme(s).name for s in schemes]  # raises with the menu listed
    if not names or not views or not modes:
        raise ValueError("give at least one scheme, one view and one mode (e.g. --schemes "
                         "NVFP4 --views component)")
    for v in views:
        if v not in view_options():
            raise ValueError(f"unknown view {v!r}; choose from {', '.join(view_options())}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    idle = [n for n in names if not get_scheme(n).quantizes]
    if idle:
        raise ValueError(f"{idle[0]} leaves a unit alone: its damage is zero; drop it from "
                         "--schemes")
    return names


def analyze(
    model,
    windows: torch.Tensor,
    schemes: Sequence[str] = ("NVFP4", "MXFP4"),
    views: Sequence[str] = ("component", "block"),
    modes: Sequence[str] = ("measured",),
    grid_blocks: Iterable[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    text: dict | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    context: dict[str, str] | None = None,
    offload_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    rounded=None,
) -> SensitivityReport:
    """Run the analysis; finished entries are cached under ``cache_dir`` (resumable).

    :param model: a Hugging Face causal LM in float32 on CPU (or any device).
    :param windows: (n, T) analysis token windows.
    :param grid_blocks: measure the grid for these blocks only (default: all).
    :param context: unit name -> scheme: estimate at the model quantized so (the
        planner's refinement round re-scores units in the context of a plan).
    :param offload_dir: keep only the running decoder block's weights in memory, the
        others in safetensors files in this folder (models larger than memory); the
        model gets its weights back at the end; the estimate then streams one block at a
        time (:mod:`fp4sense.diagnosis.estimate`).
    :param device: where to compute (default: where the model is); offloaded blocks are
        loaded there one at a time.
    :param rounded: quantized weights to score instead of round-to-nearest, for the
        schemes they cover (:class:`fp4sense.quantization.rounded.RoundedWeights`, e.g.
        GPTQ's: the scores after GPTQ); the report's ``text["quantized_weights"]`` says so.

    Under torchrun (:mod:`fp4sense.runtime.distributed`) the ranks share the work: the
    measured runs round-robin, the estimate's windows likewise; every rank returns the
    same report, equal to a one-rank run.
    """
    schemes = check_request(schemes, views, modes)
    t0 = time.perf_counter()
    units = find_units(model, windows[:1, :16])
    for name, share in units.unaccounted.items():
        log(f"warning: {name} holds {share:.1%} of the model's weights in tensors fp4sense "
            "neither quantizes nor knows (not a linear, embedding, norm or router); they "
            "stay as they are")
    if grid_blocks is not None:
        grid_blocks = list(grid_blocks)
        absent = sorted(set(grid_blocks) - set(range(units.n_blocks)))
        if absent:
            raise ValueError(f"grid block(s) {', '.join(map(str, absent))} do not exist: the "
                             f"model has {units.n_blocks} decoder blocks (0–"
                             f"{units.n_blocks - 1})")
    fingerprint = model_fingerprint(model)
    # the weights are quantized in the compute dtype: a bf16 run's scores are not float32's
    key = cache_key(fingerprint, windows, rounded.identity if rounded is not None else "",
                    compute_dtype=str(quantization_dtypes(model)[0]).removeprefix("torch."))
    if rounded is not None:
        text = {**(text or {}), "quantized_weights": rounded.source}
    cache = EntryCache(Path(cache_dir) / f"{key}.jsonl" if cache_dir else None, log=log)
    if cache.items:
        log(f"resuming: {len(cache.items)} cached results ({cache.path})")
    streamed = offload_dir is not None or getattr(model, "fp4sense_blocks", None) is not None
    weights = weight_cache_bytes(units, len(schemes), block_scoped=streamed)
    check_cache_memory(model, windows, units, modes, views, streamed, log, weights)
    run = Analysis(model, windows, units, cache, progress,
                   Path(offload_dir) if offload_dir is not None else None, device,
                   rounded=rounded)
    run.qweight_limit = weights
    run.rotations, run.clips = rotations_of(schemes), clips_of(schemes)
    try:
        return ViewsRun(run, model, windows, units, cache, list(schemes), views, modes,
                        grid_blocks, text, context, fingerprint, key, t0, log,
                        REPORT_VIEWS)()
    finally:
        if run.store is not None and run.store.owns_weights:
            run.store.close(restore=True)
