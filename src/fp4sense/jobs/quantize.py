"""``fp4sense quantize``'s flat front door (:func:`quantize_model`, as llm-compressor's
``oneshot`` keeps one): its keywords are parsed into checked argument groups
(:mod:`fp4sense.jobs.quantize_request`) and run stage by stage — estimate, plan once, apply
the plan with the registered host quantizer (llm-compressor's oneshot), evaluate, and
publish the checkpoint folder in one rename (:mod:`fp4sense.jobs.quantize_run`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from fp4sense import defaults, options
from fp4sense.jobs.quantize_request import QuantizeRequest
from fp4sense.jobs.quantize_run import QuantizeResult, QuantizeRun
from fp4sense.quantization.distill_settings import DistillSettings
from fp4sense.validate import renamed_keywords

__all__ = ["quantize_model"]


@renamed_keywords(estimate_windows="analysis_windows")
def quantize_model(
    model: str | os.PathLike | None = None,
    *,
    out_dir: str | os.PathLike,
    budget_bits: float | None = None,
    budget_bytes: int | None = None,
    kl_target: float | None = None,
    menu: Sequence[str] = defaults.MENU,
    sensitivity: str | os.PathLike | None = None,
    sensitivity_mode: str | None = None,
    pins: dict[str, str] | None = None,
    gptq: bool = False,
    gptq_scores: bool = False,
    scale_search: bool = True,
    select_plans: int = 1,
    distill: DistillSettings | None = None,
    base_model_id: str | None = None,
    text: str | os.PathLike | None = None,
    calib_windows: int = defaults.CALIB_WINDOWS,
    analysis_windows: int = defaults.ANALYSIS_WINDOWS,
    window_tokens: int = defaults.WINDOW_TOKENS,
    raw_windows: bool = False,
    evaluate: bool = True,
    eval_windows: int = defaults.EVAL_WINDOWS,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: str | None = None,
    low_memory: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> QuantizeResult:
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
    :mod:`fp4sense.structure.lineage`).

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
    return only ``out`` and ``rank``). llm-compressor 0.14's distributed oneshot is not used:
    on CPUs it skips its broadcast of quantization parameters for modules in memory
    shared by the ranks without waiting for the rank that computes them (2-rank runs on
    a loaded CPU wrote corrupted tensors here, e.g. saturated FP8 weights), and no
    machine with several GPUs was available to prove its GPU path. ``distill`` trains on
    rank 0. ``gptq_scores``: rank 0 rounds before the ranks meet (the others wait at the
    meeting, up to ``FP4SENSE_RANK_TIMEOUT``), then every rank's estimate reads its files.
    """
    options.check(options.QUANTIZE, locals(), "quantize_model")  # as the flags are
    request = QuantizeRequest.parse(
        model, out_dir=out_dir, budget_bits=budget_bits, budget_bytes=budget_bytes,
        kl_target=kl_target, menu=menu, sensitivity=sensitivity,
        sensitivity_mode=sensitivity_mode, pins=pins, gptq=gptq, gptq_scores=gptq_scores,
        scale_search=scale_search, select_plans=select_plans, distill=distill,
        base_model_id=base_model_id, text=text, calib_windows=calib_windows,
        analysis_windows=analysis_windows, window_tokens=window_tokens,
        raw_windows=raw_windows, evaluate=evaluate, eval_windows=eval_windows,
        overwrite=overwrite, device=device, dtype=dtype, low_memory=low_memory,
        progress=progress, log=log)
    return QuantizeRun(request).run()
