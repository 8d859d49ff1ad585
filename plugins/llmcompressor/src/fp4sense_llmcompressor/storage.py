"""What a checkpoint stores when the oneshot calibrated in another dtype than the base's.

``fp4sense quantize`` calibrates in the dtype of its placement (float32 on a CPU, where
bfloat16 matrix products are slow without native support; bfloat16 on a GPU). The
checkpoint still stores what a calibration in the base's own dtype stores: the
quantized weights as their formats pack them, and every tensor left unquantized
(embeddings, norms, lm_head, biases, BF16 units) and every scale whose dtype follows the
weight's (FP8 / INT per-channel or per-group scales) in the base's dtype, so
transformers and vLLM load it unchanged. Scales a format fixes (NVFP4's FP8 block
scales and float32 global scales, MXFP4's exponents) are left as they are. A rotated
scheme's Hadamard matrices (+-1 entries, computed in float64 at calibration) are stored
in the base's dtype too: exact, and what vLLM loads them in.
"""

from __future__ import annotations

import torch

from fp4sense.inputs.models import STORED_DTYPES

__all__ = ["store_in"]

#: quantization parameters a format creates in float32 whatever the model's dtype
_FIXED_FLOAT32 = ("global_scale",)


def store_in(model: torch.nn.Module, dtype: str | torch.dtype) -> int:
    """Cast, in place, what the checkpoint stores in the base's dtype (see the module
    docstring) to ``dtype``; weights that will be compressed stay as calibrated, so their
    codes are the calibration's. Returns how many tensors changed dtype."""
    from compressed_tensors.transform.factory.base import TransformBase

    target = STORED_DTYPES[dtype] if isinstance(dtype, str) else dtype
    changed = 0
    for module in model.modules():
        if isinstance(module, TransformBase):  # Hadamard blocks: +-1, exact in any dtype
            for tensor in module.parameters(recurse=False):
                if tensor.is_floating_point() and tensor.dtype != target:
                    tensor.data, changed = tensor.data.to(target), changed + 1
            continue
        scheme = getattr(module, "quantization_scheme", None)
        quantized_weight = scheme is not None and scheme.weights is not None
        # parameters only: buffers (rotary frequencies) stay as transformers builds them
        for name, tensor in module.named_parameters(recurse=False):
            if tensor is None or not tensor.is_floating_point() or tensor.dtype == target:
                continue
            if tensor.dtype not in STORED_DTYPES.values():  # FP8 block scales and codes
                continue
            if name == "weight" and quantized_weight:
                continue  # compressed at save from the calibrated weight
            if name.endswith(_FIXED_FLOAT32):
                continue
            tensor.data = tensor.data.to(target)
            changed += 1
    return changed
