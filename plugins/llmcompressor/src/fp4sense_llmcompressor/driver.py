"""The quantize step of ``fp4sense quantize``: llm-compressor's oneshot applying a plan.

The core finds this function through the ``fp4sense.quantizers`` entry point (name
``llmcompressor``), so it never imports llm-compressor itself. The plan is solved once,
by the core; this step only applies it (``SensitivityGuidedModifier(plan=...)``), and
returns the recipe that reproduces the checkpoint from its own folder.

``round_with_plan`` (entry point ``fp4sense.rounders``) runs the same oneshot with GPTQ
and saves the quantized weights instead of a checkpoint: the weights the scores after
GPTQ read (``fp4sense quantize --gptq-scores``, :mod:`fp4sense.quantization.rounded`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

__all__ = ["calibrated_model", "quantize_with_plan", "round_with_plan"]


def quantize_with_plan(source: str, calib: torch.Tensor, work: Path, *, plan: str,
                       gptq: bool = False, distill: dict | None = None,
                       state_dir: str | None = None) -> str:
    """Quantize ``source`` (hub id or folder) with the plan saved at ``work / plan`` on the
    calibration windows ``calib``; save the compressed checkpoint into ``work``.

    ``distill`` (the fields of :class:`fp4sense.quantization.distill.DistillSettings`)
    adds a QuantizationAwareDistillationModifier after the others: the weights are trained
    before calibration, or after GPTQ with ``gptq``; its record is written to
    ``work / "distill.json"``. ``state_dir``
    keeps an interrupted training's state (it is not written into the recipe).

    The model calibrates in the plan's ``calibration.dtype`` (bfloat16 where the plan
    names none, as llm-compressor loads models) and the checkpoint stores what it does
    not quantize in ``calibration.stored_dtype`` (:mod:`fp4sense_llmcompressor.storage`).

    :returns: recipe YAML naming the plan relative to the checkpoint folder, with a header
        saying how to rerun it in the same dtype.
    """
    from fp4sense.planning.milp import Plan
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    work = Path(work)
    dtype = calibration_dtype(work / plan)
    recipe = [SensitivityGuidedModifier(plan=str(work / plan))]
    stage: dict = {"SensitivityGuidedModifier": {"plan": plan}}
    if gptq:
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe.append(GPTQModifier())
        stage["GPTQModifier"] = {}
    trainer = None
    if distill is not None:
        from fp4sense_llmcompressor.distill import QuantizationAwareDistillationModifier

        trainer = QuantizationAwareDistillationModifier(**distill, state_dir=state_dir)
        recipe.append(trainer)
        stage["QuantizationAwareDistillationModifier"] = dict(distill)
    model = calibrated_model(source, calib, recipe, dtype=dtype)
    model.save_pretrained(work, save_compressed=True)
    if trainer is not None:
        (work / "distill.json").write_text(json.dumps(trainer.record, indent=1))
    stored = Plan.load(work / plan).calibration.get("stored_dtype")
    header = (f"# fp4sense: calibrated in {dtype}"
              + (f", unquantized tensors stored in {stored}" if stored else "") + ".\n"
              f"# Rerun from this folder with the base model loaded in {dtype}:\n"
              f"#   oneshot(model=BASE, recipe=\"recipe.yaml\", dataset=..., "
              f"precision=\"{dtype}\")\n")
    return header + yaml.safe_dump({"quant_stage": {"quant_modifiers": stage}},
                                   sort_keys=False)


def calibration_dtype(plan_file: str | Path) -> str:
    """The dtype a saved plan calibrates in (bfloat16 for plans that name none)."""
    from fp4sense.planning.milp import Plan

    return Plan.load(plan_file).calibration.get("dtype", "bfloat16")


def round_with_plan(source: str, calib: torch.Tensor, out_file: Path, *, plan: str) -> int:
    """Round ``source`` with GPTQ under the plan saved at ``plan`` (the oneshot of
    ``quantize_with_plan(..., gptq=True)``) and save each quantized linear's weight after
    GPTQ, dequantized and rounded to bfloat16 (what transformers and vLLM compute with),
    to the safetensors file ``out_file`` (tensor names: the linears' module names); the
    model calibrates in the plan's dtype, as ``quantize_with_plan``. Return how many."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from safetensors.torch import save_file

    from fp4sense.checkpoint.loading import bake_weights
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    model = calibrated_model(source, calib, [SensitivityGuidedModifier(plan=str(plan)),
                                             GPTQModifier()], dtype=calibration_dtype(plan))
    names = [name for name, module in model.named_modules()
             if getattr(getattr(module, "quantization_scheme", None), "weights", None)]
    bake_weights(model)  # the weights on the grid GPTQ chose, as the checkpoint stores them
    save_file({n: model.get_submodule(n).weight.detach().to(torch.bfloat16).contiguous()
               for n in names},
              str(out_file))
    return len(names)


def calibrated_model(source: str, calib: torch.Tensor, recipe: list,
                     dtype: str | torch.dtype = torch.bfloat16):
    """``source`` after llm-compressor's oneshot with ``recipe`` on the windows ``calib``
    (not saved), loaded from its files in ``dtype`` (a name or a torch dtype; default
    bfloat16, as llm-compressor loads models): the weights are quantized, and the scales
    computed, in that dtype."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp4sense.inputs.models import STORED_DTYPES

    if isinstance(dtype, str):
        dtype = STORED_DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    data = Dataset.from_dict({"input_ids": calib.tolist(),
                              "attention_mask": torch.ones_like(calib).tolist()})
    # in the windows' order (llm-compressor shuffles them unseeded by default): GPTQ's
    # Hessians and the searched scales' input statistics then sum alike in every run
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], processor=AutoTokenizer.from_pretrained(source),
            shuffle_calibration_samples=False)
    return model
