"""Benchmark: the whole stack — plans, searched scales, GPTQ, FP4 training (QAD).

On the bundled SmolLM2 per protocol.md (float32 on CPU; KL / PPL / top-1 on the first
16 evaluation windows; one calibration text for everything: 32 windows of the protocol's
calibration split, the first 8 for the sensitivity estimate), for three menus:

- weight-only {NVFP4A16, FP8_DYNAMIC, BF16};  W4A4 {NVFP4, FP8_DYNAMIC, BF16};
  MX {MXFP4, FP8_DYNAMIC, BF16} (W4A4);

rows: uniform RTN, plan RTN, plan + searched scales at 4.5, 4.75, 5.0 and 5.5 bits (MX:
at its 4.95 target), evaluated in memory with fp4sense's fake quantization (bit for bit
the checkpoints'; bits from the plan's accounting, which equals the written bytes); and,
written as real checkpoints by `fp4sense quantize` (searched twins on) and evaluated
from disk (bits measured from the files): plan + GPTQ and plan + GPTQ + QAD at the
target budget of each of ``--checkpoint-menus`` (or at each of ``--checkpoint-budgets``),
and uniform NVFP4 + QAD at 4.5 bits; with ``--rounding-checkpoints`` also the uniform
and plan rows without GPTQ or QAD (RTN, searched scales), selected with ``--only``.
`bench/stack_table.py` merges the results into one table per menu, method by budget.
The same run times a plain llm-compressor NVFP4 oneshot on the same calibration data (the
baseline of the time target) and runs `fp4sense verify-vllm` on every written checkpoint
(``--verify``).

    .venv/bin/python -m bench stack [--verify]

Results: bench/results/stack.{json,md}. Resumable (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from bench.harness import MENUS, RESULTS, Done, Session, command, plain_oneshot, verify_vllm

BUDGETS = [4.5, 4.75, 5.0, 5.5]
#: menu -> (budget of the written checkpoints, KL target there)
TARGETS = {"weight-only": (5.0, 0.047), "W4A4": (5.0, 0.10), "MX": (4.95, 0.38)}
UNIFORM_QAD_TARGET = 0.15  # W4A4, uniform NVFP4 at 4.5 bits with QAD
TIME_TARGET = 6.0  # the whole stack within 6x a plain NVFP4 oneshot


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--menus", default=",".join(MENUS))
    parser.add_argument("--steps", type=int, default=64, help="QAD steps")
    parser.add_argument("--lr", type=float, default=5e-5, help="QAD learning rate")
    parser.add_argument("--lr-4bit", type=float, default=1.0,
                        help="factor on QAD's learning rate for the 4-bit units")
    parser.add_argument("--qad-mode", choices=["end-to-end", "block"], default="end-to-end",
                        help="QAD's mode; block-wise rows are named '... + block QAD' (steps "
                             "per block)")
    parser.add_argument("--qad-windows", type=int, default=28)
    parser.add_argument("--qad-holdout", type=int, default=4,
                        help="calibration windows QAD holds out to choose its end state")
    parser.add_argument("--cache", type=Path, default=RESULTS / ".stack-cache")
    parser.add_argument("--out", type=Path, default=RESULTS / "stack.json")
    parser.add_argument("--verify", action="store_true", help="verify-vllm each checkpoint")
    parser.add_argument("--checkpoint-menus", default="W4A4,weight-only,MX",
                        help="menus whose rows are also written as checkpoints (GPTQ, QAD)")
    parser.add_argument("--checkpoint-budgets", default=None, metavar="BITS[,BITS]",
                        help="budgets of the written plan rows (default: each menu's target "
                             "budget); the W4A4 row at its target budget is the timed one")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--only", default=None, metavar="METHOD[,METHOD]",
                        help="write only these rows' checkpoints (e.g. 'plan + QAD'); "
                             "publish the others finished before")
    parser.add_argument("--checkpoints-only", action="store_true",
                        help="skip the in-memory rows (an experiment on written rows only)")
    parser.add_argument("--rounding-checkpoints", action="store_true",
                        help="also write the uniform and plan rows without GPTQ or QAD (RTN, "
                             "searched scales) as checkpoints; select them with --only")
    parser.add_argument("--cached-only", action="store_true",
                        help="publish (and verify) the rows finished before; write no new one")


def run(args: argparse.Namespace) -> int:
    from fp4sense.numerics.schemes import with_search_twins
    from fp4sense.planning.milp import solve

    if args.fresh and args.cache.exists():
        shutil.rmtree(args.cache)
    args.cache.mkdir(parents=True, exist_ok=True)
    done = Done(args.cache / "rows.jsonl")

    def keep(item: dict) -> dict:
        done.keep(item)
        if "kl" in item:
            print(f"{item['key']}: bits {item['bits']:.3f} KL {item['kl']:.4f}", flush=True)
        return item

    menus = {m: MENUS[m] for m in args.menus.split(",")}
    session = Session()
    calib, tok, caveat = session.calib, session.tok, session.caveat
    schemes = sorted({s for menu in menus.values() for s in with_search_twins(menu)
                      if s != "BF16"})
    report_path = args.cache / "sensitivity.json"
    est, analysis_s = session.estimate(schemes, args.cache / "analysis", report_path)
    if "analysis" not in done and analysis_s > 60:  # computed, not cached
        keep({"key": "analysis", "wall_s": analysis_s})
    units = est.units
    # input scales and scale-search weights from the calibration text
    evaluator = session.judge(units, done=done)

    def in_memory(key: str, assign: dict[str, str]) -> dict:
        return evaluator.row(key, assign, eval="in memory")

    rows = []
    for name, menu in ({} if args.checkpoints_only else menus).items():
        fp4 = menu[0]
        twins = with_search_twins(menu)
        for method, assign in (
                ("uniform RTN", {u.name: fp4 for u in units.units}),
                ("uniform + searched scales", {u.name: f"{fp4}_SEARCH" for u in units.units})):
            rows.append({"menu": name, "method": method, "budget": None,
                         **in_memory(f"{name}|{method}", assign)})
        budgets = BUDGETS if name != "MX" else [TARGETS[name][0]]  # MX: its target only
        for b in sorted({*budgets, TARGETS[name][0]} - {4.5}):
            for method, m in (("plan RTN", menu), ("plan + searched scales", twins)):
                plan = solve(est, budget_bits=b, menu=m, mode="estimated")
                r = in_memory(f"{name}|{method}|{b}", {c.unit: c.scheme for c in plan.choices})
                rows.append({"menu": name, "method": method, "budget": b, **r,
                             "predicted": plan.predicted_kl})
    base_ppl = evaluator.base_ppl()  # of the evaluation windows
    evaluator.release()  # free the replay caches

    plain_s = done["plain-oneshot"]["wall_s"] if "plain-oneshot" in done else None
    if plain_s is None:
        plain_s = plain_oneshot(calib, tok)
        done.keep({"key": "plain-oneshot", "wall_s": plain_s})
    del session
    # written checkpoints, in priority order; results are rewritten after each one
    plans = [(name, m, b) for name, m in menus.items()
             if name in args.checkpoint_menus.split(",")
             for b in ([float(x) for x in args.checkpoint_budgets.split(",")]
                       if args.checkpoint_budgets else [TARGETS[name][0]])]
    qad = "block QAD" if args.qad_mode == "block" else "QAD"
    runs = [(n, "plan + GPTQ", dict(budget_bits=b, menu=m, gptq=True)) for n, m, b in plans]
    if args.rounding_checkpoints:  # the rows without GPTQ or QAD, written (issue 34)
        chosen = args.checkpoint_menus.split(",")
        runs += [row for n, m in menus.items() if n in chosen for row in (
            (n, "uniform RTN", dict(budget_bits=16.0, menu=[m[0]], scale_search=False)),
            (n, "uniform + searched scales", dict(budget_bits=16.0, menu=[f"{m[0]}_SEARCH"],
                                                  scale_search=False)))]
        runs += [row for n, m, b in plans for row in (
            (n, "plan RTN", dict(budget_bits=b, menu=m, scale_search=False)),
            (n, "plan + searched scales", dict(budget_bits=b, menu=m)))]
    if "W4A4" in args.checkpoint_menus.split(","):  # the menu's top: uniform NVFP4
        runs.append(("W4A4", f"uniform + {qad}", dict(budget_bits=16.0, menu=["NVFP4"],
                                                      qad=True)))
        if args.qad_mode == "block":  # and with GPTQ before it
            runs.append(("W4A4", f"uniform + GPTQ + {qad}",
                         dict(budget_bits=16.0, menu=["NVFP4"], gptq=True, qad=True)))
    runs[1:1] = [(n, f"plan + GPTQ + {qad}", dict(budget_bits=b, menu=m, gptq=True, qad=True,
                                                  own_analysis=b == TARGETS[n][0]))
                 for n, m, b in plans if n == "W4A4"]  # the timed row, then the rest
    runs += [(n, f"plan + GPTQ + {qad}", dict(budget_bits=b, menu=m, gptq=True, qad=True))
             for n, m, b in plans if n != "W4A4"]
    runs += [(n, f"plan + {qad}", dict(budget_bits=b, menu=m, qad=True))  # QAD, no GPTQ
             for n, m, b in plans if n == "W4A4"]
    only = set(args.only.split(",")) if args.only else None
    result = {"command": command("stack", args.argv),
              "protocol": {"estimate_windows": 8, "calib_windows": 32, "eval_windows": 16,
                           "window_tokens": 512, "qad_steps": args.steps, "qad_lr": args.lr,
                           "qad_lr_4bit": args.lr_4bit, "qad_mode": args.qad_mode,
                           "qad_windows": args.qad_windows, "qad_holdout": args.qad_holdout},
              "base_ppl": base_ppl, "analysis_s": done.get("analysis", {}).get("wall_s"),
              "analysis_schemes": schemes, "plain_nvfp4_oneshot_s": plain_s, "rows": rows,
              "verify_vllm": {}, "caveat": caveat}
    written = []
    for name, method, kw in runs:
        key = f"{name}|{method}|{kw['budget_bits']}|checkpoint"
        folder = args.cache / "checkpoints" / key.replace("|", "_").replace(" ", "")
        if key not in done and (args.cached_only or only and method not in only):
            continue
        item = done.get(key) or keep(checkpoint(key, folder, calib, report_path, args, **kw))
        budget = None if method.startswith("uniform") else kw["budget_bits"]
        rows.append({"menu": name, "method": method, "budget": budget, **item})
        written.append(folder)
        publish(result, args.out)
    if args.verify:
        result["verify_vllm"] = verify(written, done)
    publish(result, args.out)
    print(json.dumps(result["targets"], indent=1))
    return 0


def publish(result: dict, out: Path) -> None:
    result["targets"] = targets(result)
    out.write_text(json.dumps(result, indent=1))
    write_markdown(result, out.with_suffix(".md"))


def checkpoint(key, folder, calib, report_path, args, *, budget_bits, menu, gptq=False,
               qad=False, own_analysis=False, scale_search=True) -> dict:
    """`fp4sense quantize` (searched-scale twins on unless ``scale_search`` is False),
    evaluated from disk."""
    from fp4sense.api import quantize_model
    from fp4sense.quantization.distill import DistillSettings

    distill = DistillSettings(steps=args.steps, lr=args.lr, lr_4bit=args.lr_4bit,
                              windows=args.qad_windows, holdout=args.qad_holdout,
                              mode=args.qad_mode) if qad else None
    t = time.perf_counter()
    result = quantize_model(None, out_dir=folder, budget_bits=budget_bits, menu=menu,
                            sensitivity=None if own_analysis else report_path,
                            gptq=gptq, distill=distill, calib_windows=len(calib),
                            scale_search=scale_search,
                            eval_windows=16, overwrite=True, progress=False, log=print)
    wall = time.perf_counter() - t
    e, timings = result["eval"], result["timings"]
    item = {"key": key, "bits": e["effective_bits"], "kl": e["kl"], "kl_se": e["kl_se"],
            "ppl": e["ppl"], "top1": e["top1"], "eval": "checkpoint",
            "schemes": result["plan"]["schemes"], "timings": timings,
            "wall_s": round(wall - timings.get("eval_s", 0.0), 1)}
    if qad:
        record = json.loads((folder / "distill.json").read_text())
        item["qad"] = {k: record[k] for k in ("loss_before", "loss_after", "time_s", "start",
                                              "windows_trained")}
        item["qad"]["rollbacks"] = len(record["rollbacks"])
        item["qad"]["holdout"] = record.get("holdout")
        item["qad"]["lr"] = record["settings"]["lr"]
        item["qad"]["lr_4bit"] = record["settings"]["lr_4bit"]
        item["qad"]["mode"] = record["settings"].get("mode", "end-to-end")
        item["qad"]["steps"] = record["steps"]
    return item


def verify(folders, done) -> dict:
    """`fp4sense verify-vllm` on the checkpoints not verified before, in one call."""
    todo = [f for f in folders if f"verify|{f.name}" not in done]
    verdicts, tail = verify_vllm(todo)
    for f in todo:
        passed = verdicts.get(f.name, {}).get("passed")
        done.keep({"key": f"verify|{f.name}", "rc": 0 if passed else 1, "tail": tail})
    return {f.name: "PASS" if done[f"verify|{f.name}"]["rc"] == 0 else "FAIL"
            for f in folders}


def targets(result: dict) -> list[dict]:
    rows, out = result["rows"], []
    for menu, (budget, kl) in TARGETS.items():
        best = min((r for r in rows if r["menu"] == menu and r["bits"] <= budget + 1e-6),
                   key=lambda r: r["kl"], default=None)
        if best is not None:
            out.append({"menu": menu, "target": f"KL <= {kl} at <= {budget} bits",
                        "best": f"{best['method']} @{best['bits']:.3f}: {best['kl']:.4f}",
                        "met": best["kl"] <= kl})
    qad = [r for r in rows if r["method"].startswith("uniform + ") and "QAD" in r["method"]]
    if qad:
        best = min(qad, key=lambda r: r["kl"])
        out.append({"menu": "W4A4", "target": f"uniform NVFP4 + QAD <= {UNIFORM_QAD_TARGET}",
                    "best": f"{best['method']}: {best['kl']:.4f}",
                    "met": best["kl"] <= UNIFORM_QAD_TARGET})
    full = [r for r in rows if r["method"].startswith("plan + GPTQ + ") and "QAD" in r["method"]
            and r["menu"] == "W4A4" and r.get("timings", {}).get("sensitivity_s")]
    if full and result.get("plain_nvfp4_oneshot_s"):
        fastest = min(full, key=lambda r: r["wall_s"])
        ratio = fastest["wall_s"] / result["plain_nvfp4_oneshot_s"]
        out.append({"menu": "W4A4", "target": f"whole stack within {TIME_TARGET}x a plain "
                    "NVFP4 oneshot", "best": f"{fastest['method']}: {fastest['wall_s']:.0f} s / "
                    f"{result['plain_nvfp4_oneshot_s']:.0f} s = {ratio:.1f}x",
                    "met": ratio <= TIME_TARGET})
    return out


def write_markdown(result: dict, path: Path) -> None:
    p = result["protocol"]
    lines = ["# The whole stack on SmolLM2", "", f"`{result['command']}`", "",
             f"Base PPL {result['base_ppl']:.3f}. {result['caveat']}", "",
             f"QAD: {p['qad_steps']} steps (when it starts, its learning rate, the windows it "
             "trains on and holds out: per row under QAD). "
             "Estimate of all the menus' schemes: "
             + (f"{result['analysis_s']:.0f} s" if result["analysis_s"] else "cached from an "
                "earlier run of the command") + ". Plain llm-compressor NVFP4 oneshot on the same "
             f"data: {result['plain_nvfp4_oneshot_s']:.1f} s. Wall time of a written "
             "checkpoint: `fp4sense quantize` from start to the written folder (estimate "
             "only for the W4A4 plan + GPTQ + QAD row; the others plan from the shared "
             "estimate), without its evaluation.", ""]
    for menu in dict.fromkeys(r["menu"] for r in result["rows"]):
        lines += [f"## {menu}", "", "| method | budget | bits | KL (± se) | PPL | top-1 | "
                  "evaluated | wall s |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted((r for r in result["rows"] if r["menu"] == menu),
                        key=lambda r: (round(r["bits"], 2), r["eval"] == "checkpoint")):
            budget = r["budget"] or "–"
            lines.append(f"| {r['method']} | {budget} | {r['bits']:.3f} | {r['kl']:.4f} ± "
                         f"{r['kl_se']:.4f} | {r['ppl']:.2f} | {r['top1']:.3f} | {r['eval']} | "
                         + (f"{r['wall_s']:.0f} |" if r["eval"] == "checkpoint" else "– |"))
        lines.append("")
    lines += ["## QAD", "", "| row | mode, steps | starts | learning rate (× on 4-bit units) "
              "| windows trained | held out (KL before → after, end step) | training KL before "
              "→ after |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in result["rows"] if r.get("qad")):
        # rows written before these were recorded: before calibration, 32 windows, none
        # held out, learning rate 5e-5 and one rate for all units (every QAD row's then)
        q = {"start": "before calibration", "windows_trained": 32, "holdout": None,
             "lr": 5e-5, "lr_4bit": 1.0, "mode": "end-to-end", "steps": p["qad_steps"],
             **r["qad"]}
        h = q["holdout"]
        held = (f"{h['windows']} ({h['before']:.4f} → {h['after']:.4f}, step {h['step']})"
                if h else "none")
        per = " per block" if q["mode"] == "block" else ""
        lines.append(f"| {r['menu']} {r['method']} | {q['mode']}, {q['steps']}{per} | "
                     f"{q['start']} | {q['lr']:g} "
                     f"(× {q['lr_4bit']:g}) | "
                     f"{q['windows_trained']} | "
                     f"{held} | {q['loss_before']:.4f} → {q['loss_after']:.4f} |")
    lines += ["", "## Targets", "", "| menu | target | best | met |", "|---|---|---|---|"]
    lines += [f"| {t['menu']} | {t['target']} | {t['best']} | {'yes' if t['met'] else 'no'} |"
              for t in result["targets"]]
    if result["verify_vllm"]:
        lines += ["", "## verify-vllm", ""]
        lines += [f"- {k}: {v}" for k, v in result["verify_vllm"].items()]
    path.write_text("\n".join(lines) + "\n")

