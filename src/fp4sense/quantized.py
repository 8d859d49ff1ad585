"""Helpers for models carrying compressed-tensors quantization (fake-quantized in memory).

After llm-compressor's oneshot a model re-quantizes every weight on every forward
(fake quantization). For evaluation that is wasted work: :func:`bake_weights` applies
the weight quantization once, with compressed-tensors' own ``forward_quantize``, and
leaves only the activation quantization live. The numbers do not change.
"""

from __future__ import annotations

import torch

__all__ = ["bake_weights"]


@torch.no_grad()
def bake_weights(model: torch.nn.Module) -> int:
    """Replace each quantized weight by its fake-quantized value, once; return the count."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    baked = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        status = getattr(module, "quantization_status", None)
        if scheme is None or scheme.weights is None or status is None:
            continue
        if status >= QuantizationStatus.COMPRESSED:
            continue
        module.weight.data = forward_quantize(module, module.weight.data, "weight", scheme.weights)
        # the forward wrapper reads the scheme each call: without weights it only
        # quantizes activations from now on
        module.quantization_scheme = scheme.model_copy(update={"weights": None})
        baked += 1
    return baked
