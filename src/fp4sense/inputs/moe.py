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

import re

import torch

from fp4sense.validate import InputError

__all__ = ["ExpertLayoutError", "fused_experts", "linearize_experts", "stored_expert_names"]


class ExpertLayoutError(InputError):
    """A MoE whose experts fp4sense cannot split into per-expert linears."""


def fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding experts as 3-D parameters (one slice per expert)."""
    return [(name, module) for name, module in model.named_modules()
            if any(p is not None and p.dim() == 3 for p in module._parameters.values())]


def linearize_experts(model: torch.nn.Module, source: str = "") -> torch.nn.Module:
    """``model`` with its fused experts rewritten as per-expert ``nn.Linear`` (in place) by
    the installed host; a model without fused experts is returned as it is."""
    from fp4sense.runtime.hosts import MOE_LINEARIZERS, HostMissingError, host

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


def stored_expert_names(model: torch.nn.Module, source) -> dict[str, tuple[str, tuple]]:
    """Where a MoE's files store experts under other names than its per-expert linears
    (Mixtral: the linears ``mlp.experts.N.gate_proj`` are ``block_sparse_moe.experts.N.w1``
    in the files): experts path -> (stored path, stored projection names). vLLM matches a
    checkpoint's config groups against its own module names, which follow the stored
    ones, so a plan's targets name both (:meth:`Plan.config_groups`). Empty when the names
    agree, for models without experts or without local safetensors, and where the files
    keep experts as 3-D tensors (the host writes those as the linears are named). Experts
    whose stored names cannot be paired with the linears are one error, before any work."""
    from fp4sense.inputs.models import _weight_files
    from fp4sense.structure.experts import expert_lists
    from fp4sense.structure.units import find_blocks

    blocks_path, blocks = find_blocks(model)
    lists = expert_lists(blocks[0])
    files = _weight_files(source) if lists and source else {}
    if not files:
        return {}
    prefix = f"{blocks_path}.0."
    stored: dict[str, set] = {}  # stored list path -> projections of its expert 0
    for key in files:
        found = re.match(re.escape(prefix) + r"(.+)\.0\.([^.]+)\.weight$", key)
        if found:
            stored.setdefault(found[1], set()).add(found[2])
    out: dict[str, tuple[str, tuple]] = {}
    for rel, children in lists.items():
        linears = sorted(n for n, m in children[0][1].named_modules()
                         if isinstance(m, torch.nn.Linear))
        if all(f"{prefix}{rel}.{children[0][0]}.{n}.weight" in files for n in linears):
            continue  # stored as the linears are named
        others = [p for p in stored if p not in lists and len(stored[p]) == len(linears)]
        if not others:  # not per expert in the files (3-D): written as the linears
            continue
        if len(others) > 1:
            raise ExpertLayoutError(
                f"model {str(source)!r}: the experts {prefix}{rel} are stored under names "
                f"fp4sense cannot pair with its per-expert linears ({', '.join(linears)}); "
                f"stored expert lists in block 0: {sorted(stored) or 'none'}")
        out[rel] = (others[0], tuple(sorted(stored[others[0]])))
    return out
