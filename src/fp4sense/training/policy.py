"""The FP4 training policy: per unit and per GEMM, BF16, MXFP8 or the FP4 recipe, the
least predicted training damage under a budget, solved exactly (a multiple-choice
knapsack as a 0/1 program, HiGHS through ``scipy.optimize.milp``, as the inference plans).

The budget is a predicted time of the linear GEMMs on a named Blackwell part, from its
dense tensor-core throughput per precision (:data:`PARTS`); ``bf16_share`` s sets it to
the time of keeping a share s of the GEMM FLOPs in BF16 and the rest in FP4 (NVIDIA's
recipe keeps about 15%). Fused linears (TE's fused QKV and FC1: fp4sense's fused units)
decide together. Beside the choice, NVIDIA's rule at the same share: whole blocks in
BF16, the first fifth of them at the start and the rest at the end (the 12B model's first
2 and last 8 of 62), the others all FP4, and its predicted damage.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from fp4sense import defaults
from fp4sense.numerics.training import GEMMS
from fp4sense.training.estimate import UnitEstimate
from fp4sense.validate import InputError

__all__ = ["DEFAULT_BF16_SHARE", "PARTS", "nvidia_rule", "solve_policy", "policy_linears"]

DEFAULT_BF16_SHARE = defaults.BF16_SHARE
#: dense tensor-core PFLOPS per GPU (sparsity off) by precision, and where they are from
PARTS = {
    "b200": ({"fp4": 9.0, "fp8": 4.5, "bf16": 2.25},
             "NVIDIA HGX B200 (1000 W) datasheet: 9 / 4.5 / 2.25 dense PFLOPS"),
    "gb200": ({"fp4": 10.0, "fp8": 5.0, "bf16": 2.5},
              "NVIDIA GB200 NVL72 datasheet, per GPU: 10 / 5 / 2.5 dense PFLOPS"),
    "gb300": ({"fp4": 15.0, "fp8": 5.0, "bf16": 2.5},
              "NVIDIA, Pretraining LLMs with NVFP4 (arXiv 2509.25149), Table 1: NVFP4 6x, "
              "FP8 2x BF16 on GB300 (absolute figures from secondary sources)"),
}
_KIND = {"bf16": "bf16", "mxfp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}


def _seconds(flops: float, precision: str, part: str) -> float:
    return flops / (PARTS[part][0][_KIND[precision]] * 1e15)


def _check(recipe: str, part: str, share: float | None) -> None:
    if part not in PARTS:
        raise InputError(f"unknown Blackwell part {part!r}; known: {', '.join(PARTS)}")
    if _KIND.get(recipe) != "fp4":
        raise InputError(f"the policy's recipe is an FP4 one (nvfp4, mxfp4), not {recipe!r}")
    if share is not None and not 0 <= share <= 1:
        raise InputError(f"--bf16-share {share}: a share of the GEMM FLOPs, from 0 to 1")


def solve_policy(fp4: Sequence[UnitEstimate], mxfp8: Sequence[UnitEstimate] | None,
                 recipe: str, tokens: int, part: str = defaults.BLACKWELL_PART,
                 bf16_share: float | None = DEFAULT_BF16_SHARE,
                 step_time_s: float | None = None,
                 fixed: Sequence[UnitEstimate] = ()) -> dict:
    """The policy (training-policy.json's content) for units estimated under the FP4
    ``recipe`` (``fp4``) and MXFP8 (``mxfp8``; None: not offered), ``tokens`` per step;
    ``fixed``: units the recipe cannot train (kept in BF16, their time counted). The
    budget: ``step_time_s`` of the linear GEMMs, else ``bf16_share``."""
    _check(recipe, part, None if step_time_s is not None else bf16_share)
    options = ["bf16", recipe] + (["mxfp8"] if mxfp8 is not None else [])
    by8 = {e.name: e for e in mxfp8 or []}
    fixed_flops = sum(e.flops_per_token for e in fixed) * tokens
    total_flops = sum(e.flops_per_token for e in fp4) * tokens + fixed_flops  # one GEMM's
    if step_time_s is None:
        step_time_s = 3 * (_seconds(total_flops * bf16_share, "bf16", part) +
                           _seconds(total_flops * (1 - bf16_share), recipe, part))
    kept = 3 * _seconds(fixed_flops, "bf16", part)
    lowest = kept + 3 * _seconds(total_flops - fixed_flops, recipe, part)
    if step_time_s < lowest * (1 - 1e-9):
        least = fixed_flops / total_flops if total_flops else 0.0
        raise InputError(
            f"a budget of {step_time_s * 1e3:.4g} ms is below the least this model allows on "
            f"{part}, {lowest * 1e3:.4g} ms" + (
                f" ({len(fixed)} unit(s) the recipe cannot train stay BF16, e.g. "
                f"{fixed[0].name}): the smallest feasible --bf16-share is {least:.4f}"
                if fixed else " (all FP4): give more"))
    keys, cost, damage, groups = [], [], [], []
    for e in fp4:
        for g in GEMMS:
            groups.append([])
            for p in options:
                if p == "mxfp8" and e.name not in by8:  # MXFP8's blocks do not fit it
                    continue
                groups[-1].append(len(keys))
                keys.append((e.name, g, p))
                cost.append(_seconds(e.flops_per_token * tokens, p, part))
                damage.append(0.0 if p == "bf16" else by8[e.name].gemms[g].damage
                              if p == "mxfp8" else e.gemms[g].damage)
    n = len(keys)
    one_each = np.zeros((len(groups), n))
    for i, members in enumerate(groups):
        one_each[i, members] = 1
    unit = 3 * _seconds(total_flops, "bf16", part) or 1.0  # all-BF16 time: HiGHS's
    # tolerances are absolute, so costs are solved as shares of it, not as seconds
    res = milp(c=np.array(damage), integrality=np.ones(n), bounds=Bounds(0, 1),
               constraints=[LinearConstraint(one_each, 1, 1),
                            LinearConstraint(np.array([cost]) / unit, -np.inf,
                                             (step_time_s - kept) / unit * (1 + 1e-9))])
    if res.x is None:  # pragma: no cover - all-FP4 is always feasible above
        raise InputError(f"no policy fits {step_time_s * 1e3:.4g} ms ({res.message})")
    picked = {keys[i]: (cost[i], damage[i]) for i in np.flatnonzero(res.x > 0.5)}
    choices = []
    for e in fp4:
        gemms = {g: p for (u, g, p) in picked if u == e.name}
        c = sum(picked[(e.name, g, p)][0] for g, p in gemms.items())
        d = sum(picked[(e.name, g, p)][1] for g, p in gemms.items())
        choices.append({"unit": e.name, "block": e.block, "kind": e.kind,
                        "modules": list(e.modules), "gemms": {g: gemms[g] for g in GEMMS},
                        "cost_s": c, "damage": d})
    for e in fixed:  # not eligible: BF16, named
        choices.append({"unit": e.name, "block": e.block, "kind": e.kind,
                        "modules": list(e.modules), "gemms": {g: "bf16" for g in GEMMS},
                        "cost_s": 3 * _seconds(e.flops_per_token * tokens, "bf16", part),
                        "damage": 0.0, "not_eligible": True})
    choices.sort(key=lambda c: (c["block"], c["unit"]))
    flops = {e.name: e.flops_per_token * tokens for e in (*fp4, *fixed)}
    bf16_flops = sum(flops[ch["unit"]] for ch in choices for g in GEMMS
                     if ch["gemms"][g] == "bf16")
    return {"recipe": recipe, "part": part, "part_source": PARTS[part][1],
            "tokens_per_step": tokens,
            "budget": {"step_time_s": step_time_s, "bf16_share": bf16_share,
                       "all_bf16_s": 3 * _seconds(total_flops, "bf16", part),
                       "all_fp4_s": lowest},
            "options": options, "choices": choices,
            "cost_s": sum(ch["cost_s"] for ch in choices),
            "predicted_damage": sum(ch["damage"] for ch in choices),
            "bf16_flops_share": bf16_flops / (3 * total_flops) if total_flops else 0.0,
            "nvidia_rule": nvidia_rule(fp4, recipe, tokens, part, kept, _share(
                step_time_s, total_flops, recipe, part) if bf16_share is None else bf16_share)}


def _share(step_time_s: float, flops: float, recipe: str, part: str) -> float:
    """The BF16 share of the FLOPs (the rest FP4) whose time is ``step_time_s``."""
    bf16, fp4 = 3 * _seconds(flops, "bf16", part), 3 * _seconds(flops, recipe, part)
    return min(1.0, max(0.0, (step_time_s - fp4) / (bf16 - fp4))) if bf16 > fp4 else 0.0


def nvidia_rule(fp4: Sequence[UnitEstimate], recipe: str, tokens: int, part: str,
                kept_s: float, share: float) -> dict:
    """Whole blocks in BF16 at ``share`` of the blocks (at least one), a fifth of them
    first and the rest last; its cost and predicted damage."""
    blocks = sorted({e.block for e in fp4})
    n = max(1, round(share * len(blocks))) if share > 0 else 0
    first = n // 5
    kept = set(blocks[:first]) | set(blocks[len(blocks) - (n - first):] if n - first else [])
    cost, damage = kept_s, 0.0  # units the recipe cannot train: BF16 under the rule too
    for e in fp4:
        p = "bf16" if e.block in kept else recipe
        cost += 3 * _seconds(e.flops_per_token * tokens, p, part)
        damage += 0 if p == "bf16" else sum(e.gemms[g].damage for g in GEMMS)
    return {"bf16_blocks": sorted(kept), "first": first, "last": n - first, "cost_s": cost,
            "predicted_damage": damage}


def policy_linears(policy: dict, rule: bool = False) -> dict[str, dict[str, str]]:
    """linear name -> {gemm: recipe}, what :func:`apply_training_policy` takes; ``rule``:
    the NVIDIA rule's instead of the solved choice."""
    out = {}
    kept = set(policy["nvidia_rule"]["bf16_blocks"]) if rule else None
    for ch in policy["choices"]:
        gemms = ({g: ("bf16" if ch["block"] in kept or ch.get("not_eligible") else
                      policy["recipe"]) for g in GEMMS} if rule else ch["gemms"])
        for m in ch["modules"]:
            out[m] = dict(gemms)
    return out
