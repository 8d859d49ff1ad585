"""Mixture-of-Experts structure inside decoder blocks, found from the modules alone.

- :func:`expert_lists`: the ``nn.ModuleList``s of a block whose children (two or more)
  hold linears of one structure - the routed experts, in any family's naming;
- :func:`expert_unit`: one block's experts as one unit (vLLM fuses them into one layer),
  with each expert's fused group (the linears reading one input: gate/up) as a part
  sharing an NVFP4 global scale;
- :func:`left_alone`: routers and shared-expert gates, never quantized, with the reason;
- :func:`run_on_all_tokens`: every expert's input statistics over all tokens (as
  llm-compressor calibrates experts), and how many tokens the router sent to each;
- :func:`unaccounted`: weight tensors no unit, no known kind and no left-alone entry
  explains (more than 1% of the model), so nothing is skipped without a word.
"""

from __future__ import annotations

import torch

__all__ = ["expert_hooks", "expert_lists", "expert_unit", "expert_targets", "left_alone",
           "projection_targets", "run_on_all_tokens", "unaccounted"]

ROUTER = "router: scores the experts per token; vLLM keeps it in 16 bits"
SHARED_GATE = "shared-expert gate: one score per token; vLLM keeps it in 16 bits"
#: share of the model's weights above which an unexplained tensor is named
UNACCOUNTED_SHARE = 0.01


def _linears(module: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]


def expert_lists(block: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """Relative path of each experts list in ``block`` -> its expert children (children
    without linears, such as an activation registered on the list, are not experts)."""
    found: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for rel, module in block.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or any(
                rel.startswith(f"{p}.") for p in found):
            continue
        children = [(n, c) for n, c in module.named_children() if _linears(c)]
        if len(children) < 2:
            continue
        shapes = {tuple((n, tuple(m.weight.shape) if m.weight.numel() else
                         (m.out_features, m.in_features)) for n, m in _linears(c))
                  for _, c in children}
        if len(shapes) == 1:
            found[rel] = children
    return found


def expert_unit(block: int, prefix: str, rel: str,
                children: list[tuple[str, torch.nn.Module]], seen: dict[str, tuple]):
    """The unit of one block's experts. ``seen``: linear name -> the input it read in the
    sample forward (linears reading one input share a global scale); an expert that got
    no token takes the grouping of one that did."""
    from fp4sense.structure.units import Unit

    names, ins, outs = [], [], []
    pattern: tuple[tuple[int, ...], ...] | None = None
    for child, module in children:
        lins = _linears(module)
        full = [f"{prefix}.{rel}.{child}.{n}" for n, _ in lins]
        names += full
        ins += [m.in_features for _, m in lins]
        outs += [m.out_features for _, m in lins]
        if pattern is None and all(f in seen for f in full):
            groups: dict[tuple, list[int]] = {}
            for j, f in enumerate(full):
                groups.setdefault(seen[f], []).append(j)
            pattern = tuple(tuple(g) for g in groups.values())
    width = len(names) // len(children)
    if pattern is None:  # no expert ran in the sample: each linear on its own
        pattern = tuple((j,) for j in range(width))
    parts = tuple(tuple(e * width + j for j in group)
                  for e in range(len(children)) for group in pattern)
    in_each = tuple(ins) if len(set(ins)) > 1 else ()
    return Unit(block, rel, tuple(names), ins[0], tuple(outs), in_each, parts,
                len(children))


def left_alone(block: torch.nn.Module, prefix: str, lists: dict) -> dict[str, str]:
    """Routers and shared-expert gates of a MoE block -> why they stay in 16 bits."""
    if not lists:
        return {}
    n_experts = {len(children) for children in lists.values()}
    out: dict[str, str] = {}
    for rel, module in block.named_modules():
        if any(rel == p or rel.startswith(f"{p}.") for p in lists):
            continue
        weight = module._parameters.get("weight")
        if weight is None or weight.dim() != 2:
            continue
        rows = module.out_features if isinstance(module, torch.nn.Linear) else weight.shape[0]
        if rows in n_experts:
            out[f"{prefix}.{rel}"] = ROUTER
        elif rows == 1:
            out[f"{prefix}.{rel}"] = SHARED_GATE
    return out


def unaccounted(model: torch.nn.Module, known: set[str]) -> dict[str, float]:
    """Modules holding 2-D+ weights that are not in ``known`` (units, left alone, outside
    the blocks), not embeddings, with their share of the model's weights (> 1% only)."""
    sizes: dict[str, int] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        for param in module._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            n = param.numel()
            if not n and isinstance(module, torch.nn.Linear):  # read from files later
                n = module.in_features * module.out_features
            if param.dim() >= 2 or (not param.numel() and isinstance(module, torch.nn.Linear)):
                sizes[name] = sizes.get(name, 0) + n
            else:
                sizes.setdefault("", 0)
                sizes[""] += n
    total = sum(sizes.values()) or 1
    embeddings = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    return {name: round(n / total, 4) for name, n in sizes.items()
            if name and name not in known and name not in embeddings
            and n / total > UNACCOUNTED_SHARE}


def run_on_all_tokens(modules: dict[str, torch.nn.Module], blocks_path: str, unit,
                      stat_hook, counts: list[int]) -> list:
    """Hooks for the base pass: when the experts' module is called, each expert also runs
    on all the block's tokens with ``stat_hook(name)`` pre-hooks recording its linears'
    inputs; during the routed forward each expert adds the tokens it got to
    ``counts[e]``."""
    name = f"{blocks_path}.{unit.block}.{unit.kind}"
    children = [c for _, c in modules[name].named_children() if _linears(c)]
    container = modules[name]
    if type(container).forward is torch.nn.ModuleList.forward:  # a plain list: its owner
        container = modules[name.rpartition(".")[0]]
    width = unit.per_expert
    collect = [[stat_hook(m) for m in unit.modules[e * width:(e + 1) * width]]
               for e in range(unit.experts)]
    state = {"all": False}

    def count(e):
        def hook(module, args):
            if not state["all"]:
                counts[e] += int(args[0].reshape(-1, args[0].shape[-1]).shape[0])
        return hook

    def every_token(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        state["all"] = True
        inner = []
        try:
            for e, child in enumerate(children):
                inner += [modules[m].register_forward_pre_hook(h) for m, h in zip(
                    unit.modules[e * width:(e + 1) * width], collect[e], strict=True)]
                child(x)
                for h in inner:
                    h.remove()
                inner = []
        finally:
            for h in inner:
                h.remove()
            state["all"] = False

    handles = [container.register_forward_pre_hook(every_token)]
    handles += [child.register_forward_pre_hook(count(e)) for e, child in enumerate(children)]
    return handles


def expert_hooks(modules: dict[str, torch.nn.Module], units, stat_hook
                 ) -> tuple[list, dict[str, list[int]]]:
    """The base pass's MoE hooks for every experts unit of ``units``, and the routing
    counts they fill (unit -> tokens routed to each expert)."""
    handles: list = []
    routing: dict[str, list[int]] = {}
    for unit in (u for u in units.units if u.experts):
        counts = routing.setdefault(unit.name, [0] * unit.experts)
        handles += run_on_all_tokens(modules, units.blocks_path, unit, stat_hook, counts)
    return handles, routing


def projection_targets(kind: str, members: list) -> list[tuple[str, list]]:
    """Component-view targets ``mlp.experts.*.down_proj``: one projection of every
    expert, in every block."""
    width = members[0].per_expert
    out = []
    for j in range(width):
        rel = members[0].modules[j].split(f".{kind}.", 1)[1].split(".", 1)[1]
        out.append((f"{kind}.*.{rel}", [(u, u.modules[j::width]) for u in members]))
    return out


def expert_targets(units, blocks) -> list[tuple[str, list]]:
    """The ``expert`` view's targets: each expert of each block alone
    (``3:mlp.experts.5``: which experts are fragile)."""
    out = []
    for u in units.units:
        width = u.per_expert
        out += [(f"{u.name}.{e}", [(u, u.modules[e * width:(e + 1) * width])])
                for e in range(u.experts)]
    return out
