"""Benchmark: budgeted plans vs uniform FP4, common heuristics and a weight-MSE planner.

On the bundled SmolLM2 per protocol.md (float32 on CPU; sensitivities from calibration
windows; KL / PPL / top-1 on the first 16 evaluation windows), for the menus
{NVFP4, FP8_DYNAMIC, BF16} and {NVFP4A16, FP8_DYNAMIC, BF16}:

- uniform NVFP4 (NVFP4A16), the starting point;
- "NVFP4 everywhere, down_proj in FP8";  "first and last blocks in FP8";
- the same exact planner fed plain weight-quantization MSE (HIGGS-style allocation);
- ours: estimated (8 windows, one Fisher pass) and measured (isolation runs on
  ``--measured-windows`` windows) sensitivities, and the estimated plan refined once
  (units re-scored in the context of the plan, then solved again);

at budgets 4.75, 5.0, 5.5, 6.0 bits per weight and at each heuristic's own bits.

Plans are evaluated in memory with fp4sense's fake quantization (weights bit for bit
compressed-tensors'; NVFP4 input scales from the calibration windows); the bits are
what the checkpoint stores (fp4sense's accounting equals the written bytes, a test). One
plan per run is also written as a real checkpoint by `fp4sense quantize` and evaluated
from disk, to show that the two agree; the same step times `fp4sense quantize`
(estimated sensitivities) against a plain llm-compressor NVFP4 oneshot with the same
calibration data.

    .venv/bin/python -m bench plans

Results: bench/results/plans.{json,md}, bench/results/plans_pareto.png. Resumable
(``--fresh`` starts over). Caveat: SmolLM2's released weights were Q4_1-quantized
before we got them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import RESULTS, Done, Session, command, plain_oneshot

BUDGETS = [4.75, 5.0, 5.5, 6.0]
#: the menus by their FP4 scheme (the rows' names): W4A4's and weight-only's
MENUS = {"NVFP4": harness.menu("NVFP4"), "NVFP4A16": harness.menu("NVFP4A16")}
TARGET_REDUCTION = {4.75: 0.35, 5.0: 0.50, 5.5: 0.65}


def weight_mse(model, units, schemes):
    """scheme -> unit -> Σ ||W - Q(W)||² over the unit's linears (HIGGS-style score)."""
    from fp4sense.numerics.fakequant import quantize_weights

    modules = dict(model.named_modules())
    out = {}
    for s in schemes:
        out[s] = {}
        for u in units.units:
            ws = [modules[m].weight.data for m in u.modules]
            qs = quantize_weights(s, ws)
            out[s][u.name] = float(sum(((w - q).double() ** 2).sum() for w, q in zip(
                ws, qs, strict=True)))
    return out


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--windows", type=int, default=8, help="windows for the estimate")
    parser.add_argument("--measured-windows", type=int, default=2)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--menus", default=",".join(MENUS))
    parser.add_argument("--schemes", default=None,
                        help="schemes the sensitivities cover (default: the menus'); the "
                             "same set reuses the cached analyses")
    parser.add_argument("--cache", type=Path, default=RESULTS / ".plans-cache")
    parser.add_argument("--out", type=Path, default=RESULTS / "plans.json")
    parser.add_argument("--refine-at", default="4.75",
                        help="budgets at which the refinement round is tried (it costs a "
                             "forward + backward pass per window each)")
    parser.add_argument("--no-heuristic-budgets", action="store_true",
                        help="do not add each heuristic's own bits to the budgets")
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="recompute targets and rewrite the Markdown from --out")


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        result = json.loads(args.out.read_text())
        result["targets"] = targets(result["rows"])
        args.out.write_text(json.dumps(result, indent=1))
        write_markdown(result, args.out.with_suffix(".md"))
        pareto(result["rows"], args.out.with_name(args.out.stem + "_pareto.png"))
        return 0

    from fp4sense.diagnosis import analyze
    from fp4sense.planning.milp import plan_cost, solve

    if args.fresh and args.cache.exists():
        shutil.rmtree(args.cache)
    args.cache.mkdir(parents=True, exist_ok=True)
    done = Done(args.cache / "evaluations.jsonl")

    session = Session(max(args.windows, args.measured_windows), args.eval_windows)
    model, tok, calib = session.model, session.tok, session.calib
    schemes = sorted(args.schemes.split(",") if args.schemes else
                     {s for m in args.menus.split(",") for s in MENUS[m] if s != "BF16"})
    timings = {}

    t = time.perf_counter()
    est = analyze(model, calib[:args.windows], schemes=schemes, views=["grid"],
                  modes=["estimated"], cache_dir=args.cache, log=print)
    timings["estimated_grid_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    meas = analyze(model, calib[:args.measured_windows], schemes=schemes, views=["grid"],
                   modes=["measured"], cache_dir=args.cache, log=print)
    timings["measured_grid_s"] = round(time.perf_counter() - t, 1)
    units = est.units
    mse = weight_mse(model, units, schemes)

    # NVFP4 input scales from the estimate's calibration text
    evaluator = session.judge(units, stats=est.activation_stats, done=done)
    evaluate = evaluator.row

    refine_at = {float(b) for b in args.refine_at.split(",") if b}
    rows = []
    for menu_name in args.menus.split(","):
        menu = MENUS[menu_name]
        fp4 = menu[0]
        uniform = {u.name: fp4 for u in units.units}
        heuristics = {
            "uniform": uniform,
            "down_proj in FP8": {u.name: "FP8_DYNAMIC" if u.kind.endswith("down_proj") else fp4
                                 for u in units.units},
            "first+last blocks in FP8": {u.name: "FP8_DYNAMIC" if u.block in (
                0, units.n_blocks - 1) else fp4 for u in units.units},
        }
        base = {}
        for name, assign in heuristics.items():
            r = evaluate(f"{menu_name}|{name}", assign)
            base[name] = r
            rows.append({"menu": menu_name, "method": name, "budget": None, **r})
        budgets = {float(b) for b in args.budgets.split(",")}
        if not args.no_heuristic_budgets:
            budgets |= {round(base[h]["bits"], 4) for h in heuristics if h != "uniform"}
        budgets = sorted(budgets)
        lo, _ = plan_cost(units, menu)
        for b in budgets:
            if b < lo:
                continue
            plans = {
                "weight MSE plan": solve(est, budget_bits=b, menu=menu, damage=mse,
                                         damage_source="weight_mse"),
                "ours, estimated": solve(est, budget_bits=b, menu=menu, mode="estimated"),
                "ours, measured": solve(meas, budget_bits=b, menu=menu, mode="measured"),
            }
            refined_key = f"{menu_name}|ours, estimated + refined|{b}"
            if refined_key in done:  # evaluated before: no need to re-solve
                rows.append({"menu": menu_name, "method": "ours, estimated + refined",
                             "budget": b, "predicted": done[refined_key].get("predicted"),
                             **done[refined_key]})
            elif b in refine_at:
                first = {c.unit: c.scheme for c in plans["ours, estimated"].choices}
                refined = analyze(model, calib[:args.windows], schemes=schemes,
                                  views=["grid"], modes=["estimated"], cache_dir=args.cache,
                                  context=first, log=lambda m: None, progress=False)
                plans["ours, estimated + refined"] = solve(refined, budget_bits=b, menu=menu,
                                                           mode="estimated")
            for method, plan in plans.items():
                assign = {c.unit: c.scheme for c in plan.choices}
                r = evaluate(f"{menu_name}|{method}|{b}", assign)
                rows.append({"menu": menu_name, "method": method, "budget": b,
                             **r, "predicted": plan.predicted_kl})

    checkpoint = None if args.no_checkpoint else checkpoint_check(
        model, tok, calib[:args.windows], evaluate, est, args)
    summary = targets(rows)
    result = {
        "command": command("plans", args.argv),
        "protocol": {"analysis_windows": args.windows,
                     "measured_windows": args.measured_windows,
                     "eval_windows": args.eval_windows, "window_tokens": 512},
        "base_ppl": evaluator.base_ppl(), "timings": timings, "rows": rows,
        "targets": summary, "checkpoint": checkpoint, "caveat": session.caveat,
    }
    args.out.write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out.with_suffix(".md"))
    pareto(rows, args.out.with_name(args.out.stem + "_pareto.png"))
    print(json.dumps(summary, indent=1))
    return 0


def checkpoint_check(model, tok, calib, evaluate, est, args) -> dict:
    """Write one plan as a real checkpoint, evaluate it from disk; time quantize against a
    plain llm-compressor NVFP4 oneshot on the same calibration data."""
    from fp4sense.api import evaluate_checkpoint, quantize_model
    from fp4sense.inputs.assets import ensure_model
    from fp4sense.planning.milp import Plan

    source = ensure_model(log=lambda m: None)
    with tempfile.TemporaryDirectory(prefix="fp4sense-bench-") as tmp:
        plain_s = plain_oneshot(calib, tok)
        t = time.perf_counter()
        quantize_model(None, out_dir=Path(tmp) / "planned", budget_bits=4.75,
                       calib_windows=len(calib), analysis_windows=len(calib),
                       evaluate=False, progress=False, log=lambda m: None)
        ours_s = time.perf_counter() - t
        disk = evaluate_checkpoint(Path(tmp) / "planned", base=str(source),
                                   eval_windows=args.eval_windows, progress=False)
        plan = Plan.load(Path(tmp) / "planned" / "plan.json")
        memory = evaluate("checkpoint plan in memory|4.75",
                          {c.unit: c.scheme for c in plan.choices})
    return {"plain_nvfp4_oneshot_s": round(plain_s, 1),
            "fp4sense_quantize_estimated_s": round(ours_s, 1),
            "time_ratio": round(ours_s / plain_s, 2),
            "checkpoint": {k: disk[k] for k in ("kl", "kl_se", "ppl", "top1",
                                                "effective_bits")},
            "in_memory": {k: memory[k] for k in ("kl", "kl_se", "ppl", "top1", "bits")},
            "plan_bits_theory": plan.bits}


def targets(rows: list[dict]) -> list[dict]:
    """Per menu and budget: ours vs uniform (reduction target) and vs every other
    method that spends at least as many bits."""
    out = []
    for menu in sorted({r["menu"] for r in rows}):
        mine = [r for r in rows if r["menu"] == menu]
        uniform = next(r for r in mine if r["method"] == "uniform")
        for r in mine:
            if not r["method"].startswith("ours") or r["budget"] is None:
                continue
            # rivals: other plans under the same budget, and heuristics spending at least
            # as many bits as this plan (ours at equal or fewer bits)
            rivals = [o for o in mine if not o["method"].startswith("ours")
                      and o["method"] != "uniform"
                      and (o["budget"] == r["budget"] if o["budget"] is not None
                           else o["bits"] >= r["bits"] - 1e-9)]
            reduction = 1 - r["kl"] / uniform["kl"]
            need = TARGET_REDUCTION.get(r["budget"])
            out.append({
                "menu": menu, "method": r["method"], "budget": r["budget"],
                "bits": r["bits"], "kl": r["kl"], "reduction_vs_uniform": reduction,
                "reduction_target": need,
                "meets_reduction": None if need is None else reduction >= need,
                "beats": {o["method"] + (f" @{o['budget']}" if o["budget"] else
                                         f" @{o['bits']:.3f}"): r["kl"] < o["kl"]
                          for o in rivals},
            })
    return out


def write_markdown(result: dict, path: Path) -> None:
    lines = ["# Budgeted plans on SmolLM2", "", f"`{result['command']}`", "",
             f"Base PPL {result['base_ppl']:.3f}. {result['caveat']}", "",
             "| menu | method | budget | bits | KL (± se) | PPL | top-1 |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['menu']} | {r['method']} | {r['budget'] or '–'} | "
                     f"{r['bits']:.3f} | {r['kl']:.4f} ± {r['kl_se']:.4f} | {r['ppl']:.2f} | "
                     f"{r['top1']:.3f} |")
    lines += ["", "## Targets", "", "| menu | method | budget | KL reduction vs uniform "
              "| target | lower KL than every rival spending ≥ its bits |",
              "|---|---|---|---|---|---|"]
    for t in result["targets"]:
        target = f"{t['reduction_target']:.0%}" if t["reduction_target"] else "–"
        beats = "yes" if all(t["beats"].values()) else "no: " + ", ".join(
            k for k, v in t["beats"].items() if not v)
        lines.append(f"| {t['menu']} | {t['method']} | {t['budget']} | "
                     f"{t['reduction_vs_uniform']:.1%} | {target} | {beats} |")
    c = result.get("checkpoint")
    if c:
        lines += ["", "## Checkpoint on disk vs in memory (ours, estimated, 4.75 bits)", "",
                  f"- from disk: effective bits {c['checkpoint']['effective_bits']:.4f}, KL "
                  f"{c['checkpoint']['kl']:.4f}, PPL {c['checkpoint']['ppl']:.3f}",
                  f"- in memory: bits {c['in_memory']['bits']:.4f}, KL "
                  f"{c['in_memory']['kl']:.4f}, PPL {c['in_memory']['ppl']:.3f}",
                  f"- time: fp4sense quantize (estimated) {c['fp4sense_quantize_estimated_s']}"
                  f" s vs plain llm-compressor NVFP4 oneshot {c['plain_nvfp4_oneshot_s']} s "
                  f"= {c['time_ratio']}x"]
    path.write_text("\n".join(lines) + "\n")


def pareto(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    menus = sorted({r["menu"] for r in rows})
    fig, axes = plt.subplots(1, len(menus), figsize=(6 * len(menus), 4.5), squeeze=False)
    for ax, menu in zip(axes[0], menus, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["bits"], r["kl"]) for r in rows
                         if r["menu"] == menu and r["method"] == method)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if method.startswith("ours") else "s",
                    linestyle="-" if len(pts) > 1 else "none", label=method)
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (stored)")
        ax.set_ylabel("KL(base ‖ quantized) per token")
        ax.set_title(f"SmolLM2, menu {{{menu}, FP8_DYNAMIC, BF16}}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

