"""``fp4sense quantize``: estimate, plan once, apply the plan with the registered host
quantizer (llm-compressor's oneshot), evaluate, and publish the checkpoint folder in one
rename."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fp4sense.evaluation.evaluate import evaluate_checkpoint
from fp4sense.evaluation.metrics import implausible
from fp4sense.inputs.models import (
    DEFAULT_ANALYSIS_WINDOWS,
    QUANTIZE_INSTEAD,
    analysis_windows,
    load_model,
)
from fp4sense.inputs.moe import stored_expert_names
from fp4sense.inputs.texts import window_prefix
from fp4sense.publishing.lineage import text_name

__all__ = ["quantize_model"]


def quantize_model(
    model: str | os.PathLike | None = None,
    *,
    out_dir: str | os.PathLike,
    budget_bits: float | None = None,
    budget_bytes: int | None = None,
    kl_target: float | None = None,
    menu: Sequence[str] = ("NVFP4", "FP8_DYNAMIC", "BF16"),
    sensitivity: str | os.PathLike | None = None,
    sensitivity_mode: str | None = None,
    pins: dict[str, str] | None = None,
    gptq: bool = False,
    gptq_scores: bool = False,
    scale_search: bool = True,
    select_plans: int = 1,
    distill=None,
    base_model_id: str | None = None,
    text: str | os.PathLike | None = None,
    calib_windows: int = 32,
    estimate_windows: int = DEFAULT_ANALYSIS_WINDOWS,
    window_tokens: int = 512,
    raw_windows: bool = False,
    evaluate: bool = True,
    eval_windows: int = 16,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
    low_memory: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """``fp4sense quantize``: plan under the budget and quantize with llm-compressor's
    oneshot (SensitivityGuidedModifier, optionally + GPTQModifier), writing the
    compressed checkpoint with plan.json, sensitivity.json, recipe.yaml and a model card.

    ``scale_search`` (default) adds each FP4 menu scheme's searched-scale twin
    (``NVFP4`` -> ``NVFP4_SEARCH``): same stored format and bits, block scales searched
    for the lowest output error; the plan takes it for the units where it scores lower.
    With GPTQ, GPTQ rounds under the searched scales.

    ``gptq_scores`` (with ``gptq``) scores the units after GPTQ instead of after
    round-to-nearest: each quantizing scheme of the menu first rounds the whole model with
    GPTQ once (one more oneshot per scheme; files kept beside ``out_dir`` until publishing,
    so an interrupted run resumes), and the estimate reads those weights
    (:mod:`fp4sense.quantization.rounded`). Units GPTQ repairs well then cost fewer bits.

    ``select_plans`` > 1 measures that many best plans by prediction on 4 calibration
    windows the estimate did not use and keeps the lowest (the additivity correction of
    :mod:`fp4sense.planning.select`; ``selection`` in the result records them).

    ``distill`` (a :class:`fp4sense.quantization.distill.DistillSettings`) trains the
    planned model to match the unquantized one under the plan's formats (QAD) inside the
    oneshot (the host's QAD modifier, in recipe.yaml too): after GPTQ, under its scales,
    with ``gptq``; before calibration without; distill.json / distill.png and
    ``plan.training`` record it; an interrupted training resumes from a kept state.

    ``base_model_id`` names the base model's Hub id for the model card's lineage
    (``base_model``) where it cannot be derived (a local folder outside the Hugging Face
    cache). Shared files name the base and the text without local paths (see
    :mod:`fp4sense.publishing.lineage`).

    Works in a temporary folder beside ``out_dir`` and renames it at the end, so an
    interrupted run never leaves a checkpoint that looks complete. Without ``overwrite``
    a non-empty ``out_dir`` is refused before anything runs.

    ``device`` and ``dtype`` place the estimate, the oneshot and the evaluation (default:
    float32 on a CPU, bfloat16 on a GPU; loaded from the files in ``dtype``). The oneshot
    calibrates and the estimate quantizes in ``dtype``; what is not quantized is stored in
    the base's dtype (plan.json's ``calibration``). ``raw_windows``: no sequence prefix
    (BOS) in the windows. ``low_memory`` streams the estimate one decoder block at a time
    from the model's files (:func:`fp4sense.inputs.models.load_model`).

    Under torchrun the ranks share the estimate's windows and rank 0 plans; then the
    ranks disband and rank 0 alone runs the oneshot, evaluates and publishes (the others
    return ``{"out", "rank"}``). llm-compressor 0.14's distributed oneshot is not used:
    on CPUs it skips its broadcast of quantization parameters for modules in memory
    shared by the ranks without waiting for the rank that computes them (2-rank runs on
    a loaded CPU wrote corrupted tensors here, e.g. saturated FP8 weights), and no
    machine with several GPUs was available to prove its GPU path. ``distill`` trains on
    rank 0. ``gptq_scores``: rank 0 rounds before the ranks meet (the others wait at the
    meeting, up to ``FP4SENSE_RANK_TIMEOUT``), then every rank's estimate reads its files.
    """
    import functools
    import shutil
    import time

    from fp4sense.diagnosis import analyze
    from fp4sense.numerics.schemes import get_scheme, with_search_twins
    from fp4sense.planning.milp import check_pins
    from fp4sense.planning.select import check_menu
    from fp4sense.publishing.lineage import hub_id_of, public_name, write_local_record
    from fp4sense.runtime import distributed
    from fp4sense.runtime.devices import resolve
    from fp4sense.validate import check_quantize_output, publish_folder

    out = Path(out_dir)
    # the user's model is never the output, nor inside it, nor holding it
    check_quantize_output(model, out, overwrite=overwrite)

    menu = with_search_twins(menu) if scale_search else [get_scheme(s).name for s in menu]
    check_menu(menu, distill=distill is not None, gptq_scores=gptq_scores)
    check_pins(pins, menu)  # the schemes now; the units they match when the plan is solved
    placement = resolve(device, dtype, log=log)
    if base_model_id is not None:
        hub_id_of("", base_model_id)  # a malformed id fails before anything runs
    if select_plans < 1:
        raise ValueError(f"select_plans must be at least 1, got {select_plans}")
    if sum(x is not None for x in (budget_bits, budget_bytes, kl_target)) != 1:
        raise ValueError("give exactly one of --budget, --budget-bytes, --kl-target")
    if gptq_scores and not gptq:
        raise ValueError("--gptq-scores scores the units after GPTQ rounds them: add --gptq")
    if gptq_scores and sensitivity is not None:
        raise ValueError(f"--gptq-scores estimates the scores after GPTQ itself; "
                         f"--sensitivity {sensitivity} gives scores already: drop one")
    if distill is not None:
        from fp4sense.quantization.distill import DistillError

        distill.check()
        if low_memory:
            raise DistillError("--distill trains inside llm-compressor's oneshot, which holds "
                               "the whole model in memory (also with --distill-mode block); "
                               "drop --low-memory")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    hf_model, tokenizer, notes = load_model(model, placement.dtype, placement.device,
                                            low_memory=low_memory, instead=QUANTIZE_INSTEAD)
    source = str(model) if model is not None else hf_model.config._name_or_path
    stored_expert_names(hf_model, source)  # MoE: experts under unpairable names stop here
    if pins and not low_memory:  # the units pins match, before the estimate (streamed: at
        from fp4sense.diagnosis.units import find_units  # the plan, as one forward costs)

        check_pins(pins, menu, find_units(hf_model))
    hub_id = hub_id_of(source, base_model_id)
    calib = analysis_windows(tokenizer, text, calib_windows, window_tokens, raw_windows)
    calibration = {"dtype": placement.dtype_name, "stored_dtype": str(
        hf_model.fp4sense_stored_dtype).removeprefix("torch."),
        "window_prefix": window_prefix(tokenizer, raw_windows)}
    quantized = [s for s in menu if get_scheme(s).quantizes]
    rounded = None
    if gptq_scores and distributed.launch_rank() == 0:
        # before the ranks meet: llm-compressor's oneshot then runs as in one process (its
        # distributed path is not used, see above); the others wait at the meeting
        t = time.perf_counter()
        from fp4sense.quantization.rounded import round_beside

        rounded = round_beside(hf_model, source, calib, quantized, out, calibration, log)
        timings["gptq_scores_s"] = time.perf_counter() - t
    distributed.init_from_env(placement.device, distributed.QUANTIZE_TIMEOUT_S)
    if not distributed.is_main():  # rank 0 speaks for the run and writes the folder
        log, progress = (lambda message: None), False
    if gptq_scores:  # every rank's estimate reads rank 0's files
        from fp4sense.quantization.rounded import RoundedWeights

        rounded = RoundedWeights(distributed.share(rounded))
    work = distributed.on_main(lambda: _work_folder(out, log),  # None on the other ranks:
                               "creating the work folder")  # only rank 0 writes
    try:
        report = None
        if sensitivity is None:  # the ranks share the estimate's windows
            t = time.perf_counter()
            report = analyze(hf_model, calib[:estimate_windows], schemes=quantized,
                             views=["grid"], modes=["estimated"], cache_dir=None,
                             text={"source": text_name(text),
                                   "window_prefix": calibration["window_prefix"]},
                             progress=progress, log=log, rounded=rounded)
            timings["sensitivity_s"] = time.perf_counter() - t
            if warning := implausible(report.base_ppl, hf_model.config.get_text_config()
                                      .vocab_size):
                log(warning)
        planned = distributed.on_main(functools.partial(
            _plan, hf_model, report, sensitivity, menu, scale_search, calib, estimate_windows,
            select_plans, dict(budget_bits=budget_bits, budget_bytes=budget_bytes,
                               kl_target=kl_target, pins=pins, mode=sensitivity_mode),
            hub_id, text, work, log, rounded, calibration), "planning")
        del hf_model
        main, rank = distributed.is_main(), distributed.rank()
        distributed.disband()  # the shared work is done: rank 0 goes on alone
        if not main:
            return {"out": str(out), "rank": rank}
        plan, selection = planned

        t = time.perf_counter()
        recipe = _oneshot_plan(source, calib, work, plan="plan.json", gptq=gptq,
                               distill=distill, state_dir=_state_dir(out))
        timings["oneshot_s"] = time.perf_counter() - t
        if distill is not None:
            from fp4sense.quantization.distill import record_training

            record_training(plan, work, text_name(text))
        tokenizer.save_pretrained(work)
        (work / "recipe.yaml").write_text(recipe)

        result = {"plan": {"schemes": plan.schemes(), "bits_theory": plan.bits,
                           "predicted_kl": plan.predicted_kl, "damage_source": plan.damage_source}}
        if selection is not None:
            result["plan"]["selection"] = selection
        if evaluate:
            t = time.perf_counter()
            result["eval"] = evaluate_checkpoint(work, base=source, n_windows=eval_windows,
                                                 window_tokens=window_tokens,
                                                 raw_windows=raw_windows,
                                                 device=str(placement.device),
                                                 dtype=placement.dtype, progress=progress,
                                                 log=log)
            result["eval"]["checkpoint"] = out.resolve().name
            result["eval"]["base"] = public_name(source, hub_id)
            timings["eval_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0
        result["timings"] = {k: round(v, 1) for k, v in timings.items()}
        from fp4sense.reports.model_card import write_model_card

        write_local_record(work, base=source, text=text)
        write_model_card(work, plan, result.get("eval"), source=source, hub_id=hub_id,
                         notes=notes,
                         gptq=gptq, name=out.name)
        if distill is not None:
            shutil.rmtree(_state_dir(out), ignore_errors=True)  # finished: nothing to resume
        if rounded is not None:
            from fp4sense.quantization.rounded import rounding_dir

            shutil.rmtree(rounding_dir(out), ignore_errors=True)
        (work / "fp4sense-quantize.json").write_text(json.dumps(result, indent=1))
        publish_folder(work, out)  # the finished folder replaces out_dir in one rename
    except BaseException:
        if distributed.is_main():  # (after disband, only rank 0 is still here)
            shutil.rmtree(work, ignore_errors=True)
        raise
    result["out"] = str(out)
    return result


def _work_folder(out: Path, log: Callable[[str], None]) -> Path:
    """A new work folder beside ``out`` (published by one rename at the end), marked with
    its writer; partial folders of provably dead runs are removed first."""
    import shutil
    import tempfile

    from fp4sense.validate import remove_dead_partials, write_owner

    out.parent.mkdir(parents=True, exist_ok=True)
    for note in remove_dead_partials(out.parent, out.name):
        log(f"note: {note}")
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        work.chmod(0o777 & ~umask)  # a normal folder once published, not mkdtemp's 0700
        write_owner(work)  # a later run may remove this folder once this process is gone
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # unmarked: no later run could remove it
        raise
    return work


def _plan(model, report, sensitivity, menu, scale_search: bool, calib, estimate_windows: int,
          select_plans: int, objective: dict, hub_id, text, work: Path, log, rounded=None,
          calibration: dict | None = None):
    """Rank 0's part: the report (given or estimated) saved without local paths, the plan
    solved once (or selected among the best measured) and saved for the modifier, with
    how the host calibrates (``calibration``, :attr:`~fp4sense.planning.milp.Plan.calibration`).
    ``rounded``: the scores are after GPTQ, and the selection measures with its weights."""
    from fp4sense.numerics.schemes import get_scheme
    from fp4sense.planning.milp import plan_cost, solve
    from fp4sense.planning.select import check_quantizes
    from fp4sense.publishing.lineage import public_name

    if sensitivity is not None:
        from fp4sense.diagnosis import SensitivityReport
        from fp4sense.diagnosis.units import model_fingerprint

        report = SensitivityReport.load(sensitivity, model_fingerprint(model))
        unscored = [s for s in menu if get_scheme(s).scale_search and s not in report.schemes]
        if scale_search and unscored:  # twins the saved report did not score
            log(f"note: {sensitivity} does not score {', '.join(unscored)}; planning "
                "without them (analyze with them in --schemes to use searched scales)")
            menu = [s for s in menu if s not in unscored]
    # shared files name the base and the text, not their paths here
    report.model = public_name(report.model, hub_id)
    report.text["source"] = public_name(report.text.get("source"))
    report.save(work / "sensitivity.json")
    lo, hi = plan_cost(report.units, menu)
    objective = {**objective, "menu": menu}
    selection = None
    if select_plans > 1:  # the predicted optimum is the first of the plans measured
        from fp4sense.planning.select import select_on_calibration

        plan, selection = select_on_calibration(model, report, calib, estimate_windows,
                                                select_plans, objective, log, rounded)
    else:
        plan = solve(report, **objective)
    if rounded is not None:
        plan.damage_source = f"after-GPTQ {plan.damage_source}"
    plan.calibration = dict(calibration or {})
    log(f"plan: {plan.schemes()}, {plan.bits:.3f} bits per weight (menu reaches "
        f"{lo:.2f}–{hi:.2f}), predicted KL {plan.predicted_kl:.4f}")
    check_quantizes(plan, objective, lo, hi, sum(u.numel for u in report.units.units), log)
    plan.save(work / "plan.json")  # solved once: the modifier applies this file
    return plan, selection


def _state_dir(out: Path) -> Path:
    """Where an interrupted distillation's state waits (beside the output, not in it)."""
    return out.parent / f".{out.name}.distill-state"


def _oneshot_plan(source: str, calib: torch.Tensor, work: Path, *, plan: str, gptq: bool,
                  distill=None, state_dir: Path | None = None) -> str:
    """Apply the plan saved as ``work / plan`` with the registered quantizer (the
    llm-compressor plugin's oneshot; with ``distill``, FP4 training first); return the
    recipe YAML that reproduces it."""
    from dataclasses import asdict

    from fp4sense.quantization.hosts import quantizer

    if distill is None:
        return quantizer()(source, calib, work, plan=plan, gptq=gptq)
    return quantizer()(source, calib, work, plan=plan, gptq=gptq, distill=asdict(distill),
                       state_dir=str(state_dir))
