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

    :returns: recipe YAML naming the plan relative to the checkpoint folder.
    """
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    work = Path(work)
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
    model = calibrated_model(source, calib, recipe)
    model.save_pretrained(work, save_compressed=True)
    if trainer is not None:
        (work / "distill.json").write_text(json.dumps(trainer.record, indent=1))
    return yaml.safe_dump({"quant_stage": {"quant_modifiers": stage}}, sort_keys=False)


def round_with_plan(source: str, calib: torch.Tensor, out_file: Path, *, plan: str) -> int:
    """Round ``source`` with GPTQ under the plan saved at ``plan`` (the oneshot of
    ``quantize_with_plan(..., gptq=True)``) and save each quantized linear's weight after
    GPTQ, dequantized in the model's bfloat16, to the safetensors file ``out_file``
    (tensor names: the linears' module names); return how many."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from safetensors.torch import save_file

    from fp4sense.checkpoint.loading import bake_weights
    from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier

    model = calibrated_model(source, calib, [SensitivityGuidedModifier(plan=str(plan)),
                                     GPTQModifier()])
    names = [name for name, module in model.named_modules()
             if getattr(getattr(module, "quantization_scheme", None), "weights", None)]
    bake_weights(model)  # the weights on the grid GPTQ chose, as the checkpoint stores them
    save_file({n: model.get_submodule(n).weight.detach().contiguous() for n in names},
              str(out_file))
    return len(names)


def calibrated_model(source: str, calib: torch.Tensor, recipe: list,
                     dtype: torch.dtype = torch.bfloat16):
    """``source`` after llm-compressor's oneshot with ``recipe`` on the windows ``calib``
    (not saved). ``dtype``: bf16 as llm-compressor loads models, so the NVFP4 global scale
    comes from a bf16 amax, as in every checkpoint fp4sense writes; ``bench/`` runs float32
    where bf16 matrix products are slow (CPUs without native bf16)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    data = Dataset.from_dict({"input_ids": calib.tolist(),
                              "attention_mask": torch.ones_like(calib).tolist()})
    # in the windows' order (llm-compressor shuffles them unseeded by default): GPTQ's
    # Hessians and the searched scales' input statistics then sum alike in every run
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=len(calib),
            max_seq_length=calib.shape[1], processor=AutoTokenizer.from_pretrained(source),
            shuffle_calibration_samples=False)
    return model
