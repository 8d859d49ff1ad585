"""MoE experts in the layout llm-compressor calibrates, quantizes and saves.

transformers 5 keeps a block's routed experts as 3-D parameters in one module; llm-compressor
rewrites them as one ``nn.Linear`` per expert and projection (``linearize_moe``) before it
calibrates, and saves that layout (``experts.E.gate_proj.weight``, what vLLM loads).
fp4sense analyzes the same modules, so its units, fake quantization and plans name exactly
what llm-compressor writes.
"""

from __future__ import annotations

import torch

__all__ = ["linearize"]


def linearize(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every experts module llm-compressor knows linearized (in place).

    llm-compressor gives each new module the offloading of the experts it replaces
    (compressed-tensors' ``offload_module``: onload to the device they were on). A model
    that was not offloaded before is left so: otherwise, moved to a GPU afterwards, its
    experts would still compute on the CPU."""
    from compressed_tensors.offload import remove_dispatch
    from compressed_tensors.offload.cache import OffloadCache
    from llmcompressor.modeling.moe.linearize import linearize_moe

    offloaded = any(isinstance(m._parameters, OffloadCache) for m in model.modules())
    linearize_moe(model)
    if not offloaded:
        remove_dispatch(model, onload_tensors=True)
    return model
