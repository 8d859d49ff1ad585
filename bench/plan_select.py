"""Benchmark: the additivity correction (`fp4sense.planning.select`) on SmolLM2.

A plan's predicted KL is a sum of one-unit scores; the whole plan's damage is not. At
each budget the K best plans by prediction (searched-scale menus, as `fp4sense quantize`
plans by default) are measured on calibration windows the estimate did not use
(calibration windows 8 .. 8+S), the lowest is kept, and the predicted optimum and the
kept plan are both judged on the 16 evaluation windows (KL per protocol). The
correction is worth keeping only where the kept plan's evaluation KL is lower.

    .venv/bin/python -m bench plan_select [--k 6] [--select-windows 4] [--menus W4A4,weight-only]

Reuses `bench/stack.py`'s estimate (bench/results/.stack-cache/sensitivity.json) when it
is there, else computes the same one. Resumable (bench/results/.plan-select-cache).
Results: bench/results/plan_select.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.harness import MENUS, RESULTS, Done, Session, command

BUDGETS = [4.75, 5.0, 5.5]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, default=6, help="plans measured per budget")
    parser.add_argument("--select-windows", type=int, default=4)
    parser.add_argument("--menus", default="W4A4,weight-only")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--cache", type=Path, default=RESULTS / ".plan-select-cache")
    parser.add_argument("--report", type=Path,
                        default=RESULTS / ".stack-cache" / "sensitivity.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_select.json")


def run(args: argparse.Namespace) -> int:
    from fp4sense.diagnosis import SensitivityReport
    from fp4sense.numerics.schemes import with_search_twins
    from fp4sense.planning.select import assignment, best_plans
    from fp4sense.structure.units import model_fingerprint

    args.cache.mkdir(parents=True, exist_ok=True)
    done = Done(args.cache / "measured.jsonl")

    session = Session()
    calib = session.calib
    menus = {m: with_search_twins(MENUS[m]) for m in args.menus.split(",")}
    schemes = sorted({s for menu in menus.values() for s in menu if s != "BF16"})
    t = time.perf_counter()
    if args.report.is_file():
        est = SensitivityReport.load(args.report, model_fingerprint(session.model))
    else:
        est, _ = session.estimate(schemes, args.cache / "analysis")
    analysis_s = round(time.perf_counter() - t, 1)
    units = est.units

    # input scales and scale-search weights from the calibration text, for both judges
    judges = {"select": session.judge(units, calib[8:8 + args.select_windows]),
              "eval": session.judge(units)}

    def measure(on: str, assign: dict[str, str]) -> float:
        key = on + "|" + json.dumps(sorted(assign.items()))
        if key not in done:
            done.keep({"key": key, "kl": judges[on].kl(assign)})
        return done[key]["kl"]

    rows = []
    for name, menu in menus.items():
        for budget in (float(b) for b in args.budgets.split(",")):
            t = time.perf_counter()
            plans = best_plans(est, args.k, budget_bits=budget, menu=menu, mode="estimated")
            trials = [{"predicted": p.predicted_kl, "bits": p.bits,
                       "select_kl": measure("select", assignment(p))} for p in plans]
            kept = min(range(len(plans)), key=lambda i: trials[i]["select_kl"])
            row = {"menu": name, "budget": budget, "candidates": trials, "kept_rank": kept,
                   "predicted_best_eval_kl": measure("eval", assignment(plans[0])),
                   "kept_eval_kl": measure("eval", assignment(plans[kept])),
                   "wall_s": round(time.perf_counter() - t, 1)}
            row["change"] = row["kept_eval_kl"] / row["predicted_best_eval_kl"] - 1
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "candidates"}), flush=True)
    result = {"command": command("plan_select", args.argv),
              "protocol": {"estimate_windows": 8, "select_windows": args.select_windows,
                           "eval_windows": 16, "window_tokens": 512, "k": args.k},
              "analysis_s": analysis_s, "rows": rows, "caveat": session.caveat}
    args.out.write_text(json.dumps(result, indent=1))
    write_markdown(result, args.out.with_suffix(".md"))
    return 0


def write_markdown(result: dict, path: Path) -> None:
    p = result["protocol"]
    lines = ["# Additivity correction: the best measured of the K best predicted plans", "",
             f"K = {p['k']} plans per budget (searched-scale menus), measured on "
             f"{p['select_windows']} calibration windows the estimate did not use; both "
             f"plans judged on {p['eval_windows']} evaluation windows (KL).", "",
             "| menu | budget | kept (rank by prediction) | KL predicted optimum | "
             "KL kept | change | wall s |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['menu']} | {r['budget']} | {r['kept_rank'] + 1} of "
                     f"{len(r['candidates'])} | {r['predicted_best_eval_kl']:.4f} | "
                     f"{r['kept_eval_kl']:.4f} | {100 * r['change']:+.1f}% | {r['wall_s']} |")
    lines += ["", f"> {result['caveat']}", ""]
    path.write_text("\n".join(lines))

