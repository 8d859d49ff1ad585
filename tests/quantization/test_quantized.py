"""bake_weights: applying weight fake-quantization once changes no number."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4A16", "FP8_DYNAMIC"])
def test_bake_weights_keeps_logits_bit_identical(scheme, tiny_llama):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    import fp4sense_llmcompressor  # noqa: F401
    from fp4sense.checkpoint.loading import bake_weights
    from helpers import calibration_dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    oneshot(model=model, dataset=calibration_dataset(tiny_llama), num_calibration_samples=4,
            max_seq_length=64, recipe=QuantizationModifier(targets=["Linear"], scheme=scheme,
                                                           ignore=["lm_head"]))
    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        assert bake_weights(model) == 14
        after = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert torch.equal(after, again)
