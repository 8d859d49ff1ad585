"""Benchmark: the W4A4 activations' tensor scale chosen by measurement (the ``*_ACLIP``
schemes) against the calibration maximum, per protocol.md (bundled SmolLM2 in float32 on
the CPU, the estimate on the first 8 calibration windows, KL on the first 16 evaluation
windows, input scales from the 32 calibration windows).

- ``choices``: each dense unit's chosen fraction of its input maximum (the estimate's base
  pass), how many chose below the maximum, the output error they save, and why: the share
  of each input's 16-element blocks whose E4M3 scale falls under E4M3's normal range
  (2^-6) at the maximum, where a lower tensor scale would give them back their steps;
- ``uniform``: every unit NVFP4, then every unit NVFP4_ACLIP (in memory, fp4sense's judge);
- ``menu``: plans from the estimate with the W4A4 menu {NVFP4, FP8_DYNAMIC, BF16} and its
  searched-scale twins, with and without the ACLIP twins, at 4.75 / 5.0 / 5.5 bits.

GPTQ and QAD compose with the choice (the plan carries it; the observer writes it), but
their rows are not run here: ``bench stack`` runs them (about 45 minutes a row on 2 cores).

    .venv/bin/python -m bench input_clip [--budgets 4.75,5.0,5.5]

Results: bench/results/input_clip.json and input_clip.md. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench import harness
from bench.harness import RESULTS, command

OUT = RESULTS / "input_clip.json"
PLAIN = ["NVFP4", "NVFP4_SEARCH", "FP8_DYNAMIC"]
CLIPPED = ["NVFP4_ACLIP", "NVFP4_ACLIP_SEARCH"]
#: E4M3's smallest normal value over its largest: a block whose amax is under this share
#: of the tensor's maximum gets a subnormal (or zero) scale at the maximum
SUBNORMAL_SHARE = 2.0 ** -6 / 448


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--budgets", default="4.75,5.0,5.5")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--cache", type=Path, default=RESULTS / ".input-clip-cache")


@torch.no_grad()
def _subnormal_blocks(session, units) -> dict[str, float]:
    """unit -> share of its input's blocks under E4M3's normal range at the maximum."""
    modules = dict(session.model.named_modules())
    firsts = {u.modules[0]: u.name for u in units.units if not u.experts}
    blocks: dict[str, list[torch.Tensor]] = {m: [] for m in firsts}
    handles = [modules[m].register_forward_pre_hook(
        lambda _mod, args, m=m: blocks[m].append(
            args[0].detach().float().abs().unflatten(-1, (-1, 16)).amax(-1).flatten()))
        for m in firsts]
    try:
        for window in session.calib[:harness.ESTIMATE_WINDOWS]:
            session.model(input_ids=window[None])
    finally:
        for h in handles:
            h.remove()
    out = {}
    for m, parts in blocks.items():
        b = torch.cat(parts)
        out[firsts[m]] = float((b < b.max() * SUBNORMAL_SHARE).float().mean())
    return out


def _choices(report, subnormal) -> dict:
    rows = []
    for u in report.units.units:
        c = report.activation_stats[u.modules[0]].get("input_clip")
        if c is not None:
            rows.append({"unit": u.name, **c, "subnormal_blocks": subnormal.get(u.name)})
    below = [r for r in rows if r["fraction"] < 1]
    return {"units": len(rows), "below_max": len(below), "rows": below,
            "error_ratio_min": min((r["error_ratio"] for r in rows), default=None),
            "subnormal_blocks_max": max(subnormal.values()),
            "subnormal_blocks_median": statistics.median(subnormal.values())}


def run(args: argparse.Namespace) -> int:
    from fp4sense.planning.milp import solve

    session = harness.Session()
    report, secs = session.estimate(PLAIN + CLIPPED, args.cache)
    units = report.units
    result = {"command": command("input_clip", args.argv), "caveat": session.caveat,
              "estimate_s": secs, "choices": _choices(report, _subnormal_blocks(session, units))}
    judge = session.judge(units, schemes=PLAIN + CLIPPED)
    rows = []
    # the judge's own choices: its input scales come from all 32 calibration windows
    result["judge_below_max"] = sum(
        1 for u in units.units if (judge.inner.analysis.stats.get(u.modules[0], {})
                                   .get("input_clip") or {"fraction": 1.0})["fraction"] < 1)
    for scheme in ("NVFP4", "NVFP4_ACLIP"):
        rows.append(judge.row(f"uniform {scheme}", {u.name: scheme for u in units.units}))
    for budget in [float(b) for b in args.budgets.split(",")]:
        for name, menu in (("W4A4 + search", PLAIN + ["BF16"]),
                           ("W4A4 + search + ACLIP", PLAIN + CLIPPED + ["BF16"])):
            plan = solve(report, budget_bits=budget, menu=menu, mode="estimated")
            assign = {c.unit: c.scheme for c in plan.choices}
            clipped = [c.unit for c in plan.choices if c.input_fraction < 1]
            rows.append({**judge.row(f"{name} @{budget}", assign), "budget": budget,
                         "schemes": plan.schemes(), "units_below_max": len(clipped)})
    result["rows"] = rows
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(result))
    print(args.out.with_suffix(".md").read_text())
    return 0


def _markdown(r: dict) -> str:
    c = r["choices"]
    lines = ["# W4A4: the activations' tensor scale chosen by measurement", "",
             f"`{r['command']}`", "", r["caveat"], "",
             f"Estimate of {', '.join(PLAIN + CLIPPED)}: {r['estimate_s']} s.", "",
             "## Choices (8 calibration windows)", "",
             f"{c['below_max']} of {c['units']} dense units chose a fraction below the "
             f"maximum; the lowest output-error ratio of any choice is "
             f"{c['error_ratio_min']:.4f}. Share of an input's 16-element blocks whose E4M3 "
             f"scale is under E4M3's normal range at the maximum: at most "
             f"{c['subnormal_blocks_max']:.2e} (median {c['subnormal_blocks_median']:.2e}).",
             ""]
    if c["rows"]:
        lines += ["| unit | fraction | output error vs max | blocks saturated |",
                  "|---|---|---|---|"]
        lines += [f"| {x['unit']} | {x['fraction']:.4f} | {x['error_ratio']:.4f} | "
                  f"{x['saturated']:.2e} |" for x in c["rows"]]
        lines.append("")
    lines += ["## KL on the evaluation text", "",
              "The judge takes its input scales, and the ACLIP rows their fractions, from "
              f"all {harness.CALIB_WINDOWS} calibration windows: there "
              f"{r['judge_below_max']} of {c['units']} units chose below the maximum "
              "(the plans' column counts the estimate's choices).", "",
              "| row | bits | KL (± se) | PPL | top-1 | units below max | schemes |",
              "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['key']} | {x['bits']:.3f} | {x['kl']:.4f} ± {x['kl_se']:.4f} | "
                     f"{x['ppl']:.2f} | {x['top1']:.3f} | {x.get('units_below_max', '')} | "
                     f"{', '.join(f'{k} {v}' for k, v in x.get('schemes', {}).items())} |")
    return "\n".join(lines) + "\n"
