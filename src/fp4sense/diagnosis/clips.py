"""The ``*_ACLIP`` schemes' choice, made after the base pass: for each dense unit's input
(unrotated, and rotated by each width the menu's rotated ``*_ACLIP`` schemes use), the
fraction of the input maximum whose NVFP4 tensor scale gives the lowest output error over
the analysis windows (:class:`fp4sense.numerics.input_clip.ClipScores`). One more pass of
the model over the windows, hooks on each unit's first linear (a fused group's parts share
that input); streamed blocks are loaded as the base pass loads them. The choices join the
linears' statistics (``input_clip``, ``input_clip_h16``, ...), so the report and the plan
carry them."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from fp4sense.diagnosis import blockio
from fp4sense.numerics.input_clip import ClipScores
from fp4sense.numerics.rotation import rotate_input, rotate_weight
from fp4sense.numerics.schemes import clip_key

__all__ = ["choose_input_clips"]

#: the scheme whose feasibility decides which units take a choice, per rotation width
_SCHEME = "NVFP4_ACLIP"


def _scheme(width: int) -> str:
    return _SCHEME if not width else f"NVFP4_H{width}_ACLIP"


@torch.no_grad()
def choose_input_clips(run, widths: tuple[int, ...]) -> dict[str, dict]:
    """linear -> {``input_clip[_hW]``: the choice} for every dense unit ``run``'s units
    hold (``run``: a :class:`fp4sense.diagnosis.engine.Analysis` after its base pass)."""
    scores: dict[tuple[str, int], ClipScores] = {}
    units = {}
    for unit in run.units.units:
        for width in widths:
            key = "absmax" if not width else f"absmax_h{width}"
            amax = run.stats.get(unit.modules[0], {}).get(key)
            if unit.why_infeasible(_scheme(width)) is None and amax:
                scores[(unit.name, width)] = ClipScores(amax)
                units[unit.name] = unit

    def hook_for(unit):
        def hook(module, args):
            x = args[0]
            weight = torch.cat([run.modules[m].weight.detach().float() for m in unit.modules])
            for width in widths:
                s = scores.get((unit.name, width))
                if s is not None:  # rotated in the input's dtype, as the host does
                    s.add(rotate_input(x, width) if width else x,
                          rotate_weight(weight, width) if width else weight)
        return hook

    handles = [run.modules[u.modules[0]].register_forward_pre_hook(hook_for(u))
               for u in units.values()]
    try:
        for window in tqdm(run.windows, desc="input scales", leave=False,
                           disable=not run.progress):
            run.model(input_ids=window[None], **blockio.no_cache(run.model))
    finally:
        for h in handles:
            h.remove()
    run.block_forwards += len(run.windows) * run.units.n_blocks
    out: dict[str, dict] = {}
    for (name, width), s in scores.items():
        for m in units[name].modules:
            out.setdefault(m, {})[clip_key(width)] = s.choice()
    return out
