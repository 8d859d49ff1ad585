"""fp4sense adapter for llm-compressor.

Importing this package registers, with the hosts' own registries:
  * the ``fp4sense_scale_search`` weight observer and the ``fp4sense_input_clip`` NVFP4
    input observer (llm-compressor's Observer registry);
  * fp4sense's schemes missing from compressed-tensors' preset table
    (``NVFP4_SEARCH``, ``NVFP4A16_SEARCH``, ``MXFP4_SEARCH``, ``MXFP4A16_SEARCH``,
    ``INT4``), so ``QuantizationModifier(scheme="NVFP4A16_SEARCH")`` works in Python
    and in YAML recipes;
  * ``SensitivityGuidedModifier`` and ``QuantizationAwareDistillationModifier`` (FP4
    training) with llm-compressor's ModifierFactory, so recipes name them like any
    built-in modifier.
"""

from llmcompressor.modifiers.factory import ModifierFactory

from fp4sense.numerics.schemes import register_presets
from fp4sense_llmcompressor.distill import QuantizationAwareDistillationModifier
from fp4sense_llmcompressor.modifier import SensitivityGuidedModifier
from fp4sense_llmcompressor.observers import InputClipObserver, ScaleSearchObserver

register_presets()
ModifierFactory.register(SensitivityGuidedModifier.__name__, SensitivityGuidedModifier)
ModifierFactory.register(QuantizationAwareDistillationModifier.__name__,
                         QuantizationAwareDistillationModifier)

__all__ = ["InputClipObserver", "QuantizationAwareDistillationModifier",
           "ScaleSearchObserver", "SensitivityGuidedModifier"]
