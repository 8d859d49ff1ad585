"""Mixture-of-Experts models in the layout their host quantizes.

transformers 5 keeps a block's routed experts as 3-D parameters in one module
(``gate_up_proj`` of shape experts x out x in). The quantize host calibrates and saves
them as one ``nn.Linear`` per expert and projection; fp4sense analyzes that same layout,
so units, fake quantization and plans name exactly the tensors the checkpoint holds. The
rewrite is the host's (entry point ``fp4sense.moe_linearizers``; the core imports no
host), and it is checked: experts left as 3-D parameters are one clear error naming the
module, never skipped.
"""

from __future__ import annotations

import torch

from fp4sense.validate import InputError

__all__ = ["ExpertLayoutError", "fused_experts", "linearize_experts"]


class ExpertLayoutError(InputError):
    """A MoE whose experts fp4sense cannot split into per-expert linears."""


def fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding experts as 3-D parameters (one slice per expert)."""
    return [(name, module) for name, module in model.named_modules()
            if any(p is not None and p.dim() == 3 for p in module._parameters.values())]


def linearize_experts(model: torch.nn.Module, source: str = "") -> torch.nn.Module:
    """``model`` with its fused experts rewritten as per-expert ``nn.Linear`` (in place) by
    the installed host; a model without fused experts is returned as it is."""
    from fp4sense.quantization.hosts import MOE_LINEARIZERS, HostMissingError, host

    found = fused_experts(model)
    if not found:
        return model
    label = f"model {source!r}" if source else type(model).__name__
    try:
        linearize = host(MOE_LINEARIZERS, what=f"{label} keeps its experts as 3-D "
                         f"parameters ({found[0][0]}): reading them")
    except HostMissingError as exc:
        raise ExpertLayoutError(str(exc)) from None
    model = linearize(model) or model
    left = fused_experts(model)
    if left:
        name, module = left[0]
        shapes = ", ".join(f"{k} {tuple(p.shape)}" for k, p in module._parameters.items()
                           if p is not None and p.dim() == 3)
        raise ExpertLayoutError(
            f"{label}: experts module {name} ({type(module).__name__}: {shapes}) has a "
            "layout fp4sense cannot split into per-expert linears; it needs the module to "
            "follow transformers' experts interface (gate_up_proj / down_proj, "
            "@use_experts_implementation) or a linearized class registered with "
            "llm-compressor (LinearExperts2D)")
    return model
