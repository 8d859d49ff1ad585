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

__all__ = ["ExpertLayoutError", "check_stored_names", "fused_experts", "linearize_experts"]


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


def check_stored_names(model: torch.nn.Module, source) -> None:
    """Refuse, before any work, a MoE whose files store experts under other names than
    the per-expert linears (Mixtral's ``block_sparse_moe.experts.N.w1``): a plan names
    the linears, and vLLM matches a checkpoint's config groups against stored names, so
    the two must agree. Models without experts, or without local safetensors, pass."""
    from fp4sense.diagnosis.experts import expert_lists
    from fp4sense.diagnosis.units import find_blocks
    from fp4sense.inputs.models import _weight_files

    blocks_path, blocks = find_blocks(model)
    lists = expert_lists(blocks[0])
    if not lists:
        return
    files = _weight_files(source)
    rel, children = next(iter(lists.items()))
    name = f"{blocks_path}.0.{rel}.{children[0][0]}"
    linear = next(n for n, m in children[0][1].named_modules()
                  if isinstance(m, torch.nn.Linear))
    key = f"{name}.{linear}.weight"
    if files and key not in files:
        stored = sorted(k for k in files if ".experts." in k and k.startswith(
            f"{blocks_path}.0."))[:1]
        raise ExpertLayoutError(
            f"model {str(source)!r} stores its experts under other names ("
            f"{stored[0] if stored else 'not per expert'}) than the per-expert linears "
            f"fp4sense plans ({key}); vLLM matches a checkpoint's config groups against the "
            "stored names, so fp4sense cannot quantize this family yet (analyze works)")
