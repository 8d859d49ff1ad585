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

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fp4sense.diagnosis.cache import EntryCache, cache_key
from fp4sense.diagnosis.engine import Analysis, Perturbation
from fp4sense.diagnosis.footprint import check_cache_memory, weight_cache_bytes
from fp4sense.diagnosis.results import Entry, SensitivityReport
from fp4sense.diagnosis.stats import correlations, mean_se
from fp4sense.inputs.models import quantization_dtypes
from fp4sense.numerics.schemes import get_scheme, rotations_of
from fp4sense.runtime import distributed
from fp4sense.structure.experts import expert_targets, projection_targets
from fp4sense.structure.units import Unit, UnitMap, find_units, model_fingerprint, model_name
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
    run.rotations = rotations_of(schemes)
    try:
        return _run_views(run, model, windows, units, cache, schemes, views, modes,
                          grid_blocks, text, context, fingerprint, key, t0, log)
    finally:
        if run.store is not None and run.store.owns_weights:
            run.store.close(restore=True)


def _run_views(run: Analysis, model, windows, units, cache, schemes, views, modes,
               grid_blocks, text, context, fingerprint, key, t0, log) -> SensitivityReport:

    skipped = [{"unit": u.name, "scheme": s, "reason": u.why_infeasible(s)}
               for u in units.units for s in schemes if u.why_infeasible(s)]
    entries: list[Entry] = []
    view_parts = [p.name for p in REPORT_VIEWS.values() if p.option in views]
    cost = {"measured_block_forwards": 0, "naive_block_forwards": 0, "cached_entries": 0,
            "seconds": {}}

    if "measured" in modes:
        jobs = []
        for scheme in schemes:  # scheme outermost: protect reuses that scheme's outputs
            for part in view_parts:
                for target, members in REPORT_VIEWS[part].targets(units, grid_blocks):
                    pert = {m: (u, scheme) for u, mods in members for m in mods
                            if u.why_infeasible(scheme) is None}
                    if pert:
                        jobs.append((part, scheme, target, pert))
        t = time.perf_counter()
        mine = distributed.shard(list(range(len(jobs))))
        bar = tqdm(mine, desc="measuring", disable=not run.progress, unit="run")
        results: dict[int, tuple[dict, bool]] = {}
        for n in bar:
            part, scheme, target, pert = jobs[n]
            bar.set_postfix_str(f"{part} {scheme} {target}"[:40])
            k = f"measured|{part}|{scheme}|{target}"
            hit = cache.get(k)
            if hit is None:
                result = REPORT_VIEWS[part].measure(run, scheme, target, pert)
                cache.put(k, result)  # every rank appends its own, under a file lock
            results[n] = (hit if hit is not None else result, hit is not None)
        shares = distributed.gather((results, run.block_forwards))
        for share, _ in shares:
            results.update(share)
        for n, (part, scheme, target, _) in enumerate(jobs):
            result, was_cached = results[n]
            if was_cached:
                cost["cached_entries"] += 1
            else:
                cost["naive_block_forwards"] += len(windows) * units.n_blocks
            entries.append(Entry(part, scheme, target, "measured", **{
                f: result[f] for f in ("kl", "kl_se", "dppl", "dppl_se", "top1", "top1_se",
                                       "block_forwards")}))
        cost["seconds"]["measured"] = round(time.perf_counter() - t, 2)
        block_forwards = sum(forwards for _, forwards in shares)
        if block_forwards:  # the naive way needs the base model's pass too
            cost["naive_block_forwards"] += len(windows) * units.n_blocks
        cost["measured_block_forwards"] = block_forwards

    if "estimated" in modes:
        run.release_replay()
        t = time.perf_counter()
        k = "estimated|linears|" + ",".join(schemes)
        pert = None
        if context:
            by_name = units.by_name()
            pert = {m: (by_name[u], s) for u, s in sorted(context.items())
                    if get_scheme(s).quantizes for m in by_name[u].modules}
            k += "|context=" + hashlib.sha256(json.dumps(sorted(context.items())).encode()
                                              ).hexdigest()[:12]
        hit = cache.get(k)
        if hit is None:
            mine = distributed.shard(list(range(len(windows))))
            shares = distributed.gather(run.estimate(schemes, context=pert, windows=mine))
            raw = {key_: distributed.unshard([s[key_] for s in shares], len(windows))
                   for key_ in shares[0]}
            item = {"scores": {f"{m}|{s}": v for (m, s), v in raw.items()}}
            if distributed.is_main():
                cache.put(k, item)
            else:
                cache.items[k] = {"key": k, **item}
        else:
            raw = {tuple(key_.split("|")): v for key_, v in hit["scores"].items()}
            cost["cached_entries"] += 1
        cost["seconds"]["estimated"] = round(time.perf_counter() - t, 2)
        cost["estimated_forward_backward_passes"] = len(windows)
        for part in ["grid", *[p for p in view_parts if p != "grid"]]:
            for scheme in schemes:
                for target, members in REPORT_VIEWS[part].targets(units, None):
                    per_window = [raw[(m, scheme)] for u, mods in members for m in mods
                                  if (m, scheme) in raw]
                    if not per_window:
                        continue
                    summed = np.sum(np.asarray(per_window), axis=0).tolist()
                    kl, se = mean_se(summed)
                    entries.append(Entry(part, scheme, target, "estimated", kl, se))

    if run.stats is None:
        cached_stats = cache.get("stats")
        if cached_stats is None:
            run.base_pass()
    if run.stats is not None and cache.get("stats") is None:
        item = {"stats": run.stats, "base_ppl": run.base_ppl(), "routing": run.routing}
        if distributed.is_main():
            cache.put("stats", item)
        else:
            cache.items["stats"] = {"key": "stats", **item}
    stats_item = cache.get("stats")
    report = SensitivityReport(
        model=model_name(model), model_fingerprint=fingerprint,
        text={**(text or {}), "windows": int(windows.shape[0]),
              "window_tokens": int(windows.shape[1]), "cache_key": key},
        schemes=list(schemes), units=units, entries=entries,
        base_ppl=stats_item["base_ppl"], activation_stats=stats_item["stats"],
        routing=stats_item.get("routing", {}), skipped=skipped, cost=cost,
    )
    cost["total_seconds"] = round(time.perf_counter() - t0, 2)
    report.correlations = correlations(report)
    return report
